"""`ckpt.fori_loop`: a drop-in for `lax.fori_loop` that saves every `every` iterations
with no conditional per iteration (issue 54 item 2a). Exact against `lax.fori_loop` with
concrete and traced bounds, from an aligned start and from any other (a resume), under
`jit`, `vmap` and `grad`; checkpoint `k` holds the carry after iteration `k - 1`; the
compiled program of an aligned loop has no conditional at all (a `maybe_save` in the body
has one per iteration: the check can fail); every_seconds and a stop request are decided
at chunk ends."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_cb_ckpt
from jax_cb_ckpt import ConfigError


def body(i, carry):
    # Exactly representable arithmetic: any compilation gives the same bits.
    return {"w": carry["w"] * 2.0 + i.astype(jnp.float32), "n": carry["n"] + 1}


def init():
    return {"w": jnp.zeros(3), "n": jnp.int32(0)}


def plain(lower, upper, carry=None):
    return jax.lax.fori_loop(lower, upper, body, init() if carry is None else carry)


@pytest.mark.parametrize("traced", [False, True], ids=["concrete", "traced"])
@pytest.mark.parametrize("lower, upper, every", [(0, 12, 4), (3, 17, 4), (4, 6, 4), (5, 5, 2)])
def test_same_as_lax_fori_loop_and_saves_at_the_multiples(make_ckpt, lower, upper, every, traced):
    ckpt = make_ckpt()
    if traced:
        run = jax.jit(lambda c, lo, hi: ckpt.fori_loop(lo, hi, body, c, every=every))
        out = run(init(), lower, upper)
    else:
        out = jax.jit(lambda c: ckpt.fori_loop(lower, upper, body, c, every=every))(init())
    assert jax_cb_ckpt.same_bits(out, plain(lower, upper))
    ckpt.wait()
    expected = [k for k in range(lower + 1, upper + 1) if k % every == 0]
    assert ckpt.all_steps() == expected
    for step in expected:  # checkpoint k: the carry after iteration k - 1
        assert jax_cb_ckpt.same_bits(ckpt.restore(init(), step=step), plain(lower, step)), step


def test_save_last_and_a_resume_run_one_program(make_ckpt):
    ckpt = make_ckpt(every=5)
    traces = []

    @jax.jit
    def train(state, start, end):
        traces.append(1)
        return ckpt.fori_loop(start, end, body, state, every=5, save_last=True)

    first = train(init(), 0, 12)  # a run stopped at 12, its last state saved
    ckpt.wait()
    assert ckpt.all_steps() == [5, 10, 12]
    resumed = train(ckpt.restore(init()), 12, 23)
    assert len(traces) == 1  # the fresh run and the resume: one compiled program
    ckpt.wait()
    assert ckpt.all_steps() == [5, 10, 12, 15, 20, 23]
    assert jax_cb_ckpt.same_bits(first, plain(0, 12))
    assert jax_cb_ckpt.same_bits(resumed, plain(0, 23))


def test_no_conditional_in_an_aligned_loop(make_ckpt):
    ckpt = make_ckpt(every=10)

    def conditionals(fn):
        """The conditional ops of the compiled program (HLO `conditional(`)."""
        text = jax.jit(fn).lower(init()).compile().as_text()
        return len(re.findall(r"\bconditional\(", text))

    def in_body(c):
        def step(i, c):
            c = body(i, c)
            ckpt.maybe_save(c, i + 1)
            return c

        return jax.lax.fori_loop(0, 100, step, c)

    assert conditionals(in_body) > 0  # what fori_loop does without
    assert conditionals(lambda c: ckpt.fori_loop(0, 100, body, c, every=10)) == 0
    # from a start that is no multiple: the iterations up to the first one decide each
    assert conditionals(lambda c: ckpt.fori_loop(3, 100, body, c, every=10)) > 0


def test_under_vmap_every_member_is_saved(make_ckpt):
    ckpt = make_ckpt(every=4)
    batch = jax.tree.map(lambda x: jnp.stack([x, x + 1]), init())
    out = jax.jit(jax.vmap(lambda c: ckpt.fori_loop(0, 9, body, c, every=4)))(batch)
    expected = jax.vmap(lambda c: plain(0, 9, c))(batch)
    assert jax_cb_ckpt.same_bits(out, expected)
    ckpt.wait()
    assert ckpt.all_steps() == [4, 8]
    saved = ckpt.restore(batch, step=8)
    assert jax_cb_ckpt.same_bits(saved, jax.vmap(lambda c: plain(0, 8, c))(batch))


def test_grad_through_concrete_bounds_is_the_same(make_ckpt):
    ckpt = make_ckpt(every=3)

    def loss(w, loop):
        return loop(0, 7, lambda i, c: c * w + 1.0, jnp.ones(3)).sum()

    mine = jax.grad(loss)(1.5, functools.partial(ckpt.fori_loop, every=3))
    theirs = jax.grad(loss)(1.5, jax.lax.fori_loop)
    assert jax_cb_ckpt.same_bits(mine, theirs)
    ckpt.wait()
    assert ckpt.all_steps() == [3, 6]


@pytest.mark.parametrize("kind", [np.int32, np.int64, jnp.int32], ids=["np32", "np64", "jnp32"])
def test_grad_through_bounds_that_are_numpy_or_concrete_array_integers(make_ckpt, kind):
    # lax.fori_loop makes a scan of any bounds Python knows, numpy integers and concrete
    # arrays included, and so is reverse-differentiable under jit: so is ckpt.fori_loop.
    ckpt = make_ckpt(every=3)
    lower, upper = kind(0), kind(7)

    def loss(w, loop):
        return loop(lower, upper, lambda i, c: c * w + 1.0, jnp.ones(3)).sum()

    mine = jax.jit(jax.grad(loss, argnums=0), static_argnums=1)(
        1.5, functools.partial(ckpt.fori_loop, every=3)
    )
    theirs = jax.jit(jax.grad(loss, argnums=0), static_argnums=1)(1.5, jax.lax.fori_loop)
    assert jax_cb_ckpt.same_bits(mine, theirs)
    ckpt.wait()
    assert ckpt.all_steps() == [3, 6]


def test_every_seconds_is_asked_at_chunk_ends(make_ckpt):
    # every_seconds so short that it has always passed: a save at every ask
    ckpt = make_ckpt(every_seconds=1e-6)
    out = jax.jit(lambda c: ckpt.fori_loop(0, 17, body, c, check_every=5))(init())
    assert jax_cb_ckpt.same_bits(out, plain(0, 17))
    ckpt.wait()
    assert ckpt.all_steps() == [5, 10, 15]


@pytest.mark.parametrize("lower", [0, 2])
def test_a_stop_request_saves_and_ends_the_loop_at_the_next_ask(make_ckpt, lower):
    ckpt = make_ckpt(every=10)
    ckpt.request_stop()
    run = jax.jit(lambda c, lo: ckpt.fori_loop(lo, 100, body, c, stoppable=True, check_every=5))
    out = run(init(), lower)
    ckpt.wait()
    assert ckpt.stop_requested
    assert ckpt.all_steps() == [5]  # the first ask: saved there, and ended
    assert jax_cb_ckpt.same_bits(out, plain(lower, 5))
    assert jax_cb_ckpt.same_bits(ckpt.restore(init()), out)


def test_without_a_stop_request_a_stoppable_loop_runs_to_the_end(make_ckpt):
    ckpt = make_ckpt(every=4)
    out = jax.jit(lambda c: ckpt.fori_loop(1, 14, body, c, every=4, stoppable=True))(init())
    assert jax_cb_ckpt.same_bits(out, plain(1, 14))
    ckpt.wait()
    assert ckpt.all_steps() == [4, 8, 12]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"body_fun": 3}, "fori_loop(body_fun=3): body_fun must be a function, as for jax.lax"),
        ({"every": 0}, "fori_loop: every must be a positive int"),
        ({"every": None, "save_last": True}, "fori_loop(save_last=...): save_last is an option"),
        ({"every": None, "check_every": 5}, "nothing to decide at the asks"),
        ({"stoppable": 1}, "fori_loop: stoppable must be True or False"),
        ({"check_every": 0}, "fori_loop: check_every must be a positive int"),
        ({"metrics": "loss"}, "metrics must be a function of the carry"),
    ],
)
def test_bad_arguments_are_refused_by_name(make_ckpt, kwargs, message):
    ckpt = make_ckpt()  # no every of its own
    arguments = {"body_fun": body, "every": 4, **kwargs}
    with pytest.raises(ConfigError) as e:
        ckpt.fori_loop(0, 8, arguments.pop("body_fun"), init(), **arguments)
    assert message in str(e.value)


def test_under_vmap_with_per_member_ends_a_member_that_is_done_saves_nothing(make_ckpt):
    """Per-member bounds (members that stop at different iterations): the loops with
    traced bounds hold their saves to the members still in them (ckpt.while_loop's
    rule), so member 0 (done at 9) is not saved at 12 with a state it never had."""
    ckpt = make_ckpt()
    batch = jax.tree.map(lambda x: jnp.stack([x, x + 1]), init())
    ends = jnp.asarray([9, 13])
    run = jax.jit(jax.vmap(lambda c, hi: ckpt.fori_loop(0, hi, body, c, every=4)))
    out = run(batch, ends)
    member = [jax.tree.map(lambda x, k=k: x[k], batch) for k in range(2)]
    for k, hi in enumerate((9, 13)):
        assert jax_cb_ckpt.same_bits(
            jax.tree.map(lambda x, k=k: x[k], out), plain(0, hi, member[k])
        )
    ckpt.wait()
    assert ckpt.all_steps() == [4, 8, 12]
    assert ckpt.metadata(12)["members"] == [False, True]
    for step in (4, 8, 12):
        for k in range(2) if step < 12 else (1,):
            saved = ckpt.restore(init(), step=step, member=k)
            assert jax_cb_ckpt.same_bits(saved, plain(0, step, member[k])), (step, k)
