"""A `maybe_save` that does not fire adds to the compiled loop body no more than a
`lax.cond` on the step counter that hands the step and the state to a callback does
(issue 45). XLA:CPU runs a loop body of at most 8 thunks in program order and a longer
one through its dataflow executor, about 0.5 us a step more: one thunk too many made a
never-firing save cost 1.4x a tiny bare step. Structure is checked here, never time
(benchmarks/hot_path.py measures it)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_cb_ckpt
from benchmarks.hot_path import SEQUENTIAL_THUNKS, body_thunks

W = jnp.asarray(np.random.default_rng(0).standard_normal((64, 64)) / 8, jnp.float32)
X = jnp.ones((8, 64), jnp.float32)


def _loop(extra):
    def body(x, i):
        x = jnp.tanh(x @ W)
        extra(x, i)
        return x, None

    return jax.jit(lambda x, first: jax.lax.scan(body, x, first + jnp.arange(100))[0])


def _floor(x, i):
    """The least a save on the device can be: a cond on the step, the step and the state
    handed to the host in its true branch."""
    step = i + 1
    jax.lax.cond(
        step % 10**9 == 0,
        lambda s, x: jax.debug.callback(lambda *_: None, s, x),
        lambda *_: None,
        step,
        x,
    )


@pytest.mark.parametrize("crossing", ["buffer", "callback"])
@pytest.mark.parametrize("predicate", ["every", "when"])
def test_a_save_that_does_not_fire_adds_no_thunk_over_a_cond_on_the_step(
    tmp_path, crossing, predicate
):
    floor = body_thunks(_loop(_floor), X)
    assert floor is not None and floor <= SEQUENTIAL_THUNKS  # the reference runs in order
    with jax_cb_ckpt.Checkpointer(tmp_path, every=10**9, crossing=crossing) as ckpt:
        if predicate == "every":
            program = _loop(lambda x, i: ckpt.maybe_save(x, i + 1))
        else:
            program = _loop(lambda x, i: ckpt.maybe_save(x, i + 1, when=(i + 1) % 10**9 == 0))
        assert body_thunks(program, X) <= floor
        np.testing.assert_array_equal(program(X, 0), _loop(lambda x, i: None)(X, 0))
    assert jax_cb_ckpt.all_steps(tmp_path) == []


def test_a_save_that_fires_still_hands_over_the_step_it_was_asked_for(tmp_path):
    """The branch no longer receives `wanted` (it holds there): saves are as before."""
    with jax_cb_ckpt.Checkpointer(tmp_path, every=25) as ckpt:
        out = _loop(lambda x, i: ckpt.maybe_save(x, i + 1))(X, 1000)
    assert jax_cb_ckpt.all_steps(tmp_path) == [1025, 1050, 1075, 1100]
    restored = jax_cb_ckpt.restore(tmp_path, X, step=1100)
    assert jax_cb_ckpt.same_bits(restored, out)


def test_under_vmap_an_unbatched_step_adds_no_thunk_either(tmp_path):
    """Under `vmap` over seeds with a shared step counter, the step and the decision are
    not broadcast at every step any more (the rule broadcast them before the `cond`):
    the batched loop body holds no more thunks than the unbatched reference."""
    xs = jnp.stack([X, 2 * X, 3 * X, 4 * X])
    floor = body_thunks(_loop(_floor), X)
    with jax_cb_ckpt.Checkpointer(tmp_path, every=10**9) as ckpt:
        loop = _loop(lambda x, i: ckpt.maybe_save(x, i + 1))
        batched = jax.jit(jax.vmap(loop, in_axes=(0, None)))
        assert body_thunks(batched, xs) <= floor


def test_nested_vmaps_broadcast_each_unbatched_operand_inside_the_branch(tmp_path):
    """vmap over 3 outer and 2 inner members, a state of a leaf batched on the inner axis
    only, one on the outer axis only and one on neither, the step shared and the decision
    per inner member: the saved step holds every leaf with both axes, each member's
    values, and the mask of the members that asked."""
    inner_leaf = jnp.arange(2 * 5, dtype=jnp.float32).reshape(2, 5)
    outer_leaf = jnp.arange(3 * 4, dtype=jnp.int32).reshape(3, 4)
    shared = jnp.float32(7.5)

    with jax_cb_ckpt.Checkpointer(tmp_path) as ckpt:

        def member(a, b, first):
            def body(carry, i):
                a, b = carry
                state = {"a": a, "b": b, "c": shared}
                ckpt.maybe_save(state, first + i, when=(i == 2) & (a[0] >= 5))
                return (a, b), None

            return jax.lax.scan(body, (a, b), jnp.arange(4))[0]

        inner = jax.vmap(member, in_axes=(0, None, None))
        jax.jit(jax.vmap(inner, in_axes=(None, 0, None)))(inner_leaf, outer_leaf, 100)
    assert jax_cb_ckpt.all_steps(tmp_path) == [102]
    like = {
        "a": jnp.zeros((3, 2, 5), jnp.float32),
        "b": jnp.zeros((3, 2, 4), jnp.int32),
        "c": jnp.zeros((3, 2), jnp.float32),
    }
    got = jax_cb_ckpt.restore(tmp_path, like, step=102)
    np.testing.assert_array_equal(got["a"], np.broadcast_to(inner_leaf, (3, 2, 5)))
    np.testing.assert_array_equal(got["b"], np.broadcast_to(outer_leaf[:, None], (3, 2, 4)))
    np.testing.assert_array_equal(got["c"], np.full((3, 2), 7.5, np.float32))
    rows = jax_cb_ckpt.metrics_table(tmp_path)
    assert [r["member_index"] for r in rows] == [(o, i) for o in range(3) for i in range(2)]
    assert [r["asked"] for r in rows] == [False, True] * 3


@pytest.mark.parametrize("crossing", ["buffer", "callback"])
@pytest.mark.parametrize("shape", [(0, 3), (2, 0, 3)])
def test_a_vmap_over_no_member_saves_nothing(tmp_path, crossing, shape):
    """A helper's find: with the decision shared by all members (a scalar), the save
    no longer went through `any` of the broadcast mask, and a vmap over zero members
    crossed with an empty batch, which the host refused ("different steps []")."""
    with jax_cb_ckpt.Checkpointer(tmp_path, every=2, crossing=crossing) as ckpt:

        def member(w):
            def body(w, i):
                ckpt.maybe_save({"w": w}, i)
                return w + 1, None

            return jax.lax.scan(body, w, jnp.arange(5))[0]

        program = jax.vmap(member)
        for _ in range(len(shape) - 2):
            program = jax.vmap(program)
        out = jax.jit(program)(jnp.zeros(shape))
    assert out.shape == shape
    assert jax_cb_ckpt.all_steps(tmp_path) == []
