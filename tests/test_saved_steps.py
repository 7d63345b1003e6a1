"""One scan/loop body, run under every control-flow construct: the saved steps are
exactly the expected set and each saved state equals the independently computed one."""

import jax
import jax.numpy as jnp
import pytest
from helpers import assert_same_state, toy_reference, toy_state, toy_update

N_STEPS = 20
EVERY = 4
EXPECTED = [s for s in range(N_STEPS) if s % EVERY == 0]


def body_with(ckpt, how):
    def body(state, step):
        state = toy_update(state, step)
        if how == "every":
            ckpt.maybe_save(state, step)
        elif how == "when":
            ckpt.maybe_save(state, step, when=(step % EVERY == 0))
        elif how == "save_in_cond":
            jax.lax.cond(step % EVERY == 0, lambda s: ckpt.save(s, step), lambda s: None, state)
        elif how == "maybe_save_in_cond":
            # maybe_save inside a branch that is always taken.
            jax.lax.cond(step >= 0, lambda s: ckpt.maybe_save(s, step), lambda s: None, state)
        return state

    return body


def run_eager(ckpt, how):
    state = toy_state()
    body = body_with(ckpt, how)
    for step in range(N_STEPS):
        state = body(state, jnp.asarray(step, jnp.int32))
    return state


def run_jit_step(ckpt, how):
    step_fn = jax.jit(body_with(ckpt, how))
    state = toy_state()
    for step in range(N_STEPS):
        state = step_fn(state, jnp.asarray(step, jnp.int32))
    return state


def run_scan(ckpt, how, *, jit=True):
    body = body_with(ckpt, how)

    def train(state):
        return jax.lax.scan(lambda s, i: (body(s, i), None), state, jnp.arange(N_STEPS))[0]

    return (jax.jit(train) if jit else train)(toy_state())


def run_fori(ckpt, how):
    body = body_with(ckpt, how)
    return jax.jit(lambda s: jax.lax.fori_loop(0, N_STEPS, lambda i, s: body(s, i), s))(toy_state())


def run_while(ckpt, how):
    body = body_with(ckpt, how)

    def train(state):
        def step(carry):
            i, s = carry
            return i + 1, body(s, i)

        return jax.lax.while_loop(lambda c: c[0] < N_STEPS, step, (jnp.int32(0), state))[1]

    return jax.jit(train)(toy_state())


def run_nested_scan(ckpt, how):
    body = body_with(ckpt, how)
    inner = 5

    def train(state):
        def epoch(state, e):
            def one(state, i):
                return body(state, e * inner + i), None

            return jax.lax.scan(one, state, jnp.arange(inner))[0], None

        return jax.lax.scan(epoch, state, jnp.arange(N_STEPS // inner))[0]

    return jax.jit(train)(toy_state())


RUNNERS = {
    "eager": run_eager,
    "jit_step": run_jit_step,
    "scan": run_scan,
    "scan_nojit": lambda c, h: run_scan(c, h, jit=False),
    "fori_loop": run_fori,
    "while_loop": run_while,
    "nested_scan": run_nested_scan,
}


@pytest.mark.parametrize("how", ["every", "when", "save_in_cond", "maybe_save_in_cond"])
@pytest.mark.parametrize("runner", list(RUNNERS))
def test_saved_steps_and_contents(make_ckpt, runner, how):
    ckpt = make_ckpt(every=EVERY)
    final = RUNNERS[runner](ckpt, how)
    ckpt.wait()
    assert ckpt.all_steps() == EXPECTED
    stats = ckpt.stats
    # Exactly one crossing per save step: nothing else reached the host.
    assert (stats.saves, stats.skipped, stats.duplicates, stats.failed) == (len(EXPECTED), 0, 0, 0)
    reference = toy_reference(N_STEPS)
    assert_same_state(final, reference[N_STEPS - 1])
    for step in EXPECTED:
        assert_same_state(ckpt.restore(toy_state(), step=step), reference[step])


def test_python_int_step_decides_in_python(make_ckpt):
    ckpt = make_ckpt(every=3)
    state = toy_state()
    for step in range(7):
        ckpt.maybe_save(state, step)  # plain ints: no cond in any program
    ckpt.wait()
    assert ckpt.all_steps() == [0, 3, 6]


def test_python_bool_when(make_ckpt):
    ckpt = make_ckpt()
    ckpt.maybe_save(toy_state(), 5, when=False)
    ckpt.maybe_save(toy_state(), 6, when=True)
    ckpt.wait()
    assert ckpt.all_steps() == [6]


def test_no_retrace_on_second_call(make_ckpt):
    ckpt = make_ckpt(every=EVERY)
    traces = []

    @jax.jit
    def train(state, steps):
        traces.append(1)

        def body(s, i):
            s = toy_update(s, i)
            ckpt.maybe_save(s, i)
            return s, None

        return jax.lax.scan(body, state, steps)[0]

    state = train(toy_state(), jnp.arange(0, 8))
    state = train(state, jnp.arange(8, 16))
    ckpt.wait()
    assert len(traces) == 1
    assert train._cache_size() == 1
    assert ckpt.all_steps() == [0, 4, 8, 12]
