"""CI's newest end, run as `python -W error .ci/strict_warnings.py`: the library on the
newest releases raises no warning at all on the paths every user takes (import, an eager
save, maybe_save in a jitted scan and under vmap, restore, restore_or_init, verify,
metadata, the CLI's ls): every warning is an error here, so a deprecated JAX or numpy API
that our code calls, or a warning of ours on a correct program, stops CI. (Orbax is not
imported on these paths: a run that saves and restores its own steps never imports it.)"""

import subprocess
import sys
import tempfile
import warnings

import jax
import jax.numpy as jnp
import numpy as np

import jax_cb_ckpt

assert sys.warnoptions == ["error"], "run with python -W error"
directory = tempfile.mkdtemp() + "/run"
state = {"w": jnp.arange(8, dtype=jnp.float32), "key": jax.random.key(0), "n": jnp.int32(0)}


def update(state, step):
    return {"w": state["w"] * 1.5 + 1, "key": jax.random.split(state["key"])[0], "n": step}


def train_with(ckpt):
    def train(state):
        def body(state, i):
            state = update(state, i + 1)
            ckpt.maybe_save(state, i + 1)
            return state, None

        return jax.lax.scan(body, state, jnp.arange(20))[0]

    return train


with jax_cb_ckpt.Checkpointer(directory, every=5, max_to_keep=3) as ckpt:
    ckpt.save(state, 0)
    final = jax.jit(train_with(ckpt))(state)
with jax_cb_ckpt.Checkpointer(directory, every=5, max_to_keep=3) as ckpt:
    resumed, step = ckpt.restore_or_init(lambda: state, like=state)
    assert step == 20 and jax_cb_ckpt.same_bits(resumed, final)
assert jax_cb_ckpt.all_steps(directory) == [10, 15, 20], jax_cb_ckpt.all_steps(directory)
assert jax_cb_ckpt.same_bits(jax_cb_ckpt.restore(directory, state), final)
jax_cb_ckpt.verify(directory)
jax_cb_ckpt.metadata(directory)

batched = jax.tree.map(lambda x: jnp.stack([x, x]), state)
with jax_cb_ckpt.Checkpointer(directory + "-vmap", every=10) as ckpt:
    jax.jit(jax.vmap(train_with(ckpt)))(batched)
assert jax_cb_ckpt.latest_step(directory + "-vmap") == 20
assert jax_cb_ckpt.same_bits(
    jax_cb_ckpt.restore(directory + "-vmap", batched),
    jax.tree.map(lambda x: jnp.stack([x, x]), final),
)

ls = subprocess.run(
    [sys.executable, "-W", "error", "-m", "jax_cb_ckpt", "ls", directory],
    capture_output=True,
    text=True,
)
assert ls.returncode == 0 and not ls.stderr, (ls.returncode, ls.stderr)
with warnings.catch_warnings():
    warnings.simplefilter("error")
    np.asarray(final["w"])  # nothing deferred
print(
    "strict warnings: import, save, maybe_save (scan, vmap), restore, restore_or_init,"
    " verify, metadata, ls raised no warning on jax",
    jax.__version__,
)
