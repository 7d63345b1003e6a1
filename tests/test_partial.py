"""Partial restore (issue 56 item 1): `restore(like, partial_restore=True)` with `like`
holding some of the checkpoint's leaves (the parameters of a flax TrainState, not the
optimizer state) reads and checks only those leaves' chunks: with the other leaves'
stored bytes flipped on disk, the partial restore still returns the parameters bit for
bit while a full restore fails. Also one member of a vmap batch, a sharded `like`, a
restart (no `step=`), a plain Orbax step, and the errors: a `like` leaf the checkpoint
does not hold is named as the user writes it; a `like` lacking leaves without
`partial_restore` points at the option."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import linen as nn
from flax.training import train_state
from helpers import flip

import jax_cb_ckpt
from jax_cb_ckpt import ConfigError, DamagedStepError, StructureMismatchError
from jax_cb_ckpt._layout import _ocdbt


class _MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(4)(nn.relu(nn.Dense(64)(x)))


def _state(seed=0):
    """A flax TrainState with adam's optimizer state, one optimizer step in (so its
    moments are not zeros)."""
    model = _MLP()
    params = model.init(jax.random.key(seed), jnp.ones((1, 32)))["params"]
    state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(0.1))
    return state.apply_gradients(grads=jax.tree.map(jnp.ones_like, params))


def _flip_leaves(step_dir, prefix):
    """Flip one byte in every stored chunk of the leaves whose stored name starts with
    `prefix` (found through the step's index; a scalar inline in the index is left):
    what a read of them would see."""
    index = _ocdbt.Database(os.path.join(step_dir, "state"))
    flipped = 0
    for key, where in index.values.items():
        name = key.decode()
        if name.startswith(prefix) and not name.endswith(".zarray"):
            if not isinstance(where, _ocdbt.Indirect):  # (a scalar, inline in the index)
                continue
            flip(os.path.join(step_dir, "state", where.path), where.offset + where.length // 2)
            flipped += 1
    assert flipped  # (the full restore failing shows the flips sit in data a read checks)
    return flipped


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Steps 1 and 2 of a TrainState; the optimizer state of step 2 flipped on disk."""
    directory = tmp_path_factory.mktemp("partial") / "ckpt"
    with jax_cb_ckpt.Checkpointer(directory) as ckpt:
        ckpt.save(_state(1), 1)
        ckpt.save(_state(2), 2)
    _flip_leaves(os.path.join(directory, "2"), "opt_state")
    return directory


def _params_like():
    return {"params": jax.eval_shape(lambda: _state().params)}


def test_only_the_selected_leaves_are_read_and_checked(saved):
    restored = jax_cb_ckpt.restore(saved, _params_like(), step=2, partial_restore=True)
    assert jax_cb_ckpt.same_bits(restored, {"params": _state(2).params})
    with pytest.raises(DamagedStepError, match="opt_state"):  # the whole step: refused
        jax_cb_ckpt.restore(saved, jax.eval_shape(lambda: _state()), step=2)


def test_a_trainstate_without_its_optimizer_state_restores_from_a_restart(saved):
    like = jax.eval_shape(lambda: _state()).replace(opt_state=None)
    with jax_cb_ckpt.Checkpointer(saved) as ckpt:  # no step=: the newest, step 2
        restored = ckpt.restore(like, partial_restore=True)
    assert isinstance(restored, train_state.TrainState) and restored.opt_state is None
    assert jax_cb_ckpt.same_bits(restored.params, _state(2).params)
    assert int(restored.step) == 1


def test_a_leaf_the_checkpoint_lacks_is_named_as_written(saved):
    like = _params_like() | {"ema": {"Dense_0": {"kernel": jnp.zeros((32, 64))}}}
    with pytest.raises(
        StructureMismatchError, match=r"leaf like\['ema'\]\['Dense_0'\]\['kernel'\]"
    ):
        jax_cb_ckpt.restore(saved, like, step=1, partial_restore=True)


def test_without_partial_restore_a_like_lacking_leaves_points_at_it(saved):
    with pytest.raises(
        StructureMismatchError, match=r"which like does not have.*partial_restore=True"
    ):
        jax_cb_ckpt.restore(saved, _params_like(), step=1)
    with pytest.raises(ConfigError, match="partial_restore must be True"):
        jax_cb_ckpt.restore(saved, _params_like(), step=1, partial_restore="yes")


def test_one_member_of_a_batch(tmp_path):
    def init(seed):
        return {
            "params": jnp.full((8,), seed, jnp.float32),
            "opt": jnp.full((1000,), -seed, jnp.float32),
        }

    with jax_cb_ckpt.Checkpointer(tmp_path / "ckpt") as ckpt:

        def save(state):
            ckpt.maybe_save(state, 1, when=True)
            return state

        jax.block_until_ready(jax.jit(jax.vmap(save))(jax.vmap(init)(jnp.arange(4.0))))
    _flip_leaves(str(tmp_path / "ckpt" / "1"), "opt")
    like = {"params": jnp.zeros(8)}
    restored = jax_cb_ckpt.restore(tmp_path / "ckpt", like, step=1, member=2, partial_restore=True)
    np.testing.assert_array_equal(restored["params"], np.full(8, 2.0, np.float32))
    with pytest.raises(DamagedStepError):
        jax_cb_ckpt.restore(tmp_path / "ckpt", init(0.0), step=1, member=2)


def test_a_sharded_like(saved):
    mesh = jax.make_mesh((4,), ("x",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, "x"))
    kernel = jax.ShapeDtypeStruct((32, 64), jnp.float32, sharding=sharding)
    like = {"params": {"Dense_1": {"kernel": kernel}}}
    restored = jax_cb_ckpt.restore(saved, like, step=2, partial_restore=True)
    out = restored["params"]["Dense_1"]["kernel"]
    assert out.sharding == sharding
    np.testing.assert_array_equal(out, _state(2).params["Dense_1"]["kernel"])


def test_a_plain_orbax_step(tmp_path):
    state = {"params": _state(3).params, "opt_state": _state(3).opt_state}
    with ocp.CheckpointManager(tmp_path / "orbax") as manager:
        manager.save(5, args=ocp.args.StandardSave(state))
    restored = jax_cb_ckpt.restore(tmp_path / "orbax", _params_like(), step=5, partial_restore=True)
    assert jax_cb_ckpt.same_bits(restored, {"params": state["params"]})
    with pytest.raises(StructureMismatchError, match="partial_restore=True"):
        jax_cb_ckpt.restore(tmp_path / "orbax", _params_like(), step=5)
