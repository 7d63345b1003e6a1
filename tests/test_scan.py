"""`ckpt.scan`: a drop-in for `lax.scan` that saves every `every` iterations with no
conditional in the loop (issue 22 item 1). Exact against `lax.scan` (carry and ys) under
`jit`, `vmap` and `grad`, forwards and in reverse, with and without a remainder; each
checkpoint holds the carry after that many iterations; the compiled program has no
conditional (a `maybe_save` in the body has one: the check can fail)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_cb_ckpt


def body(carry, x):
    carry = {"w": carry["w"] * 1.01 + x["a"], "n": carry["n"] + 1}
    return carry, {"sum": carry["w"].sum(), "twice": 2 * x["a"]}


def init():
    return {"w": jnp.zeros(3), "n": jnp.int32(0)}


def xs_of(length):
    return {"a": jnp.arange(length * 3, dtype=jnp.float32).reshape(length, 3)}


def partial_carry(k, length, reverse):
    """The carry after k iterations of the plain scan."""
    xs = xs_of(length)
    order = xs["a"][::-1] if reverse else xs["a"]
    return jax.lax.scan(body, init(), {"a": order[:k]})[0]


@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reverse"])
@pytest.mark.parametrize("length, every", [(10, 4), (12, 4), (3, 4), (7, 1)])
def test_same_as_lax_scan_and_saves_every_n(make_ckpt, length, every, reverse):
    ckpt = make_ckpt()
    plain = jax.jit(lambda c, xs: jax.lax.scan(body, c, xs, reverse=reverse))(init(), xs_of(length))
    saving = jax.jit(
        lambda c, xs: ckpt.scan(body, c, xs, reverse=reverse, every=every, start=1000)
    )(init(), xs_of(length))
    assert jax_cb_ckpt.same_bits(saving, plain)
    ckpt.wait()
    expected = [1000 + k for k in range(every, length + 1, every)]
    assert ckpt.all_steps() == expected
    for step in expected:
        saved = ckpt.restore(init(), step=step)
        assert jax_cb_ckpt.same_bits(saved, partial_carry(step - 1000, length, reverse)), step


def test_length_without_xs_unroll_and_a_traced_start(make_ckpt):
    ckpt = make_ckpt(every=5)

    def count(c, _):
        return c + 1.0, None

    run = jax.jit(lambda c, s: ckpt.scan(count, c, None, length=12, unroll=2, start=s))
    carry, ys = run(jnp.zeros(2), jnp.int32(40))
    assert ys is None
    np.testing.assert_array_equal(carry, np.full(2, 12.0))
    ckpt.wait()
    assert ckpt.all_steps() == [45, 50]
    np.testing.assert_array_equal(ckpt.restore(jnp.zeros(2), step=45), np.full(2, 5.0))


def test_under_vmap(make_ckpt):
    ckpt = make_ckpt()
    inits = jax.vmap(lambda s: {"w": jnp.full(3, s), "n": jnp.int32(0)})(jnp.arange(4.0))
    xs = xs_of(9)

    def run(scan):
        return jax.jit(jax.vmap(lambda c: scan(body, c, xs)))(inits)

    plain = run(jax.lax.scan)
    saving = run(lambda f, c, xs: ckpt.scan(f, c, xs, every=3))
    assert jax_cb_ckpt.same_bits(saving, plain)
    ckpt.wait()
    assert ckpt.all_steps() == [3, 6, 9]
    assert ckpt.metadata(step=9)["batch_shape"] == [4]
    assert jax_cb_ckpt.same_bits(ckpt.restore(inits, step=9), plain[0])


def test_under_grad(make_ckpt):
    ckpt = make_ckpt()
    xs = xs_of(8)

    def loss(scale, scan):
        carry, ys = scan(lambda c, x: body({"w": c["w"] * scale, "n": c["n"]}, x), init(), xs)
        return carry["w"].sum() + ys["sum"].sum()

    plain = jax.jit(jax.grad(lambda s: loss(s, jax.lax.scan)))(1.0)
    saving = jax.jit(jax.grad(lambda s: loss(s, lambda f, c, xs: ckpt.scan(f, c, xs, every=4))))(
        1.0
    )
    assert jax_cb_ckpt.same_bits(saving, plain)
    ckpt.wait()
    assert ckpt.all_steps() == [4, 8]  # the primal carries


def test_no_conditional_in_the_compiled_program(make_ckpt):
    ckpt = make_ckpt(every=4)
    xs = xs_of(10)

    def conditionals(fn):
        """The conditional ops of the compiled program (HLO `conditional(`)."""
        text = jax.jit(fn).lower(init(), xs).compile().as_text()
        return len(re.findall(r"\bconditional\(", text))

    def in_body(c, xs):
        def step(carry, x):
            carry, ys = body(carry, x)
            ckpt.maybe_save(carry, carry["n"])
            return carry, ys

        return jax.lax.scan(step, c, xs)

    assert conditionals(in_body) > 0  # what ckpt.scan does without
    assert conditionals(lambda c, xs: ckpt.scan(body, c, xs)) == 0


def test_bad_arguments_say_what_to_pass(make_ckpt):
    ckpt = make_ckpt()
    with pytest.raises(jax_cb_ckpt.ConfigError, match=r"scan: no every"):
        ckpt.scan(body, init(), xs_of(4))
    with pytest.raises(jax_cb_ckpt.ConfigError, match=r"every must be a positive int"):
        ckpt.scan(body, init(), xs_of(4), every=0)
    with pytest.raises(jax_cb_ckpt.ConfigError, match=r"length=5, but xs has leaves"):
        ckpt.scan(body, init(), xs_of(4), length=5, every=2)
    with pytest.raises(jax_cb_ckpt.ConfigError, match=r"pass length="):
        ckpt.scan(lambda c, x: (c, None), init(), None, every=2)


def innermost_loops(text):
    """The texts of the `stablehlo.while` ops of a lowered program that hold no other
    loop. MLIR prints an op's regions indented under it and closes the last one with a
    `}` at the op's own indentation (after its `} do {` line)."""
    lines = text.splitlines()
    loops = []
    for n, line in enumerate(lines):
        if "stablehlo.while" not in line:
            continue
        indent = len(line) - len(line.lstrip())
        end = next(
            k
            for k in range(n + 1, len(lines))
            if lines[k].strip() == "}" and len(lines[k]) - len(lines[k].lstrip()) == indent
        )
        loop = "\n".join(lines[n : end + 1])
        if loop.count("stablehlo.while") == 1:
            loops.append(loop)
    return loops


def decides_nothing(loop):
    return "stablehlo.case" not in loop and "custom_call" not in loop


def test_run_steps_in_chunks_with_no_conditional_inside(make_ckpt):
    """`ckpt.run`'s loop: the steps run in a scan of gcd(every, check_every) steps with
    no conditional in it; the stop read and the save come between chunks."""
    from jax_cb_ckpt._user import _preempt, _run

    ckpt = make_ckpt(every=20)

    def step_fn(s, i):
        return jnp.sin(s) + i

    def lowered(make):
        loop = make(ckpt, step_fn, 100, 20, 10, _preempt.StopFlag().traced, None)
        return jax.jit(loop).lower(jnp.zeros(3), jnp.int32(0)).as_text()

    # The steps' loop (the only loop without a decision in it) is there...
    assert any(decides_nothing(loop) for loop in innermost_loops(lowered(_run.make_loop)))

    def per_step(ckpt, step_fn, num_steps, every, check, read_stop, shardings):
        """The loop before: a decision after every step (what the check must catch)."""

        def loop(state, start):
            def one(carry):
                i, s, _ = carry
                s, i = step_fn(s, i), i + 1
                stop = jax.lax.cond(i % check == 0, read_stop, lambda i: jnp.asarray(False), i)
                ckpt.maybe_save(s, i, when=(i % every == 0) | stop)
                return i, s, stop

            return jax.lax.while_loop(
                lambda c: c[0] < num_steps, one, (start, state, jnp.asarray(False))
            )

        return loop

    # ...where a loop with a decision after every step has none.
    assert not any(decides_nothing(loop) for loop in innermost_loops(lowered(per_step)))
    # and the run itself: exact against the plain loop, saves where they were
    final = ckpt.run(step_fn, jnp.zeros(3), 100)
    plain = jax.jit(lambda s: jax.lax.fori_loop(0, 100, lambda i, s: step_fn(s, i), s))(
        jnp.zeros(3)
    )
    assert jax_cb_ckpt.same_bits(final, plain)
    assert ckpt.all_steps() == [20, 40, 60, 80, 100]


def test_run_resumed_from_a_step_off_the_chunk_grid(make_ckpt, ckpt_dir):
    """A run resumed at step 7 with every=4: steps 8 (one at a time), then chunks of 4,
    then the last 2 steps one at a time; saves land where every=4 puts them."""

    def step_fn(s, i):
        return jnp.sin(s) + i

    first = make_ckpt(every=3)
    first.run(step_fn, jnp.zeros(3), 7)  # saves 3, 6, 7
    first.close()
    second = make_ckpt(every=4, max_to_keep=None)
    final = second.run(step_fn, jnp.zeros(3), 22)
    plain = jax.jit(lambda s: jax.lax.fori_loop(0, 22, lambda i, s: step_fn(s, i), s))(jnp.zeros(3))
    assert jax_cb_ckpt.same_bits(final, plain)
    assert second.all_steps() == [3, 6, 7, 8, 12, 16, 20, 22]
    plain_12 = jax.jit(lambda s: jax.lax.fori_loop(0, 12, lambda i, s: step_fn(s, i), s))(
        jnp.zeros(3)
    )
    assert jax_cb_ckpt.same_bits(second.restore(jnp.zeros(3), step=12), plain_12)
