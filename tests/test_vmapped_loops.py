"""Saves in a vmapped loop whose members stop at different iterations (issue 53, item 1).

JAX runs the body of a member that is done while any member goes on and throws its
result away after the body: a save there handed over a state the member never had, and
recorded it as asked (`members`), so a restart resumed that member from it. In
`ckpt.while_loop` / `ckpt.fori_loop` a save holds only for the members still in the
loop; a restart takes each member from its own newest step, or from `init_fn` at step 0
when it asked for none; `restore(step=k)` of the whole batch names, in a
`MemberStateWarning`, the members that did not ask for `k`."""

import re
import sys
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import run_child, run_twice, while_batch

import jax_cb_ckpt
from jax_cb_ckpt import ConfigError, MemberStateWarning


def _resumed(ckpt, ns):
    """A restart of `while_batch`'s run: each member from what `restore_or_init` gives,
    on to its own `ns`; (the state and steps restored, the final states)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a correct restart says nothing
        state, start = ckpt.restore_or_init(lambda: jnp.zeros(len(ns)))
    return (np.asarray(state), np.asarray(start)), while_batch(ckpt, ns, start=start, x=state)


def test_a_member_that_left_the_loop_is_not_saved_where_another_goes_on(make_ckpt):
    """n=[4, 5], every=5: member 0 is done after 4 iterations; in the 5th its body ran
    on with counter 4 and asked step 5 with 5.0, a state it never had. Step 5 held
    [5, 5] with members [True, True], and the restart resumed member 0 from it (the
    resumed run ended [5, 5])."""
    ckpt = make_ckpt(every=5)
    assert while_batch(ckpt, [4, 5]).tolist() == [4.0, 5.0]
    assert ckpt.all_steps() == [5]
    meta = jax_cb_ckpt.metadata(ckpt.directory, step=5)
    assert meta["members"] == [False, True] and meta["left"] == [True, False]
    assert float(jax_cb_ckpt.restore(ckpt.directory, jnp.float32(0), step=5, member=1)) == 5.0
    with pytest.raises(jax_cb_ckpt.RestoreError, match=r"member \(0,\) did not save at step 5"):
        jax_cb_ckpt.restore(ckpt.directory, jnp.float32(0), step=5, member=0)
    # Without step= it is no better to suggest restoring without step= (as it did).
    with pytest.raises(jax_cb_ckpt.RestoreError) as refused:
        jax_cb_ckpt.restore(ckpt.directory, jnp.float32(0), member=0)
    assert "member (0,) did not save at step 5, the newest of " in str(refused.value)
    assert "nor at any readable step before it" in str(refused.value)
    assert "restore_or_init" in str(refused.value)
    assert "restore without step=" not in str(refused.value)
    shown = run_child([sys.executable, "-m", "jax_cb_ckpt", "show", ckpt.directory])
    assert "1 of 2 members saved: [(1,)]; left their loop: [(0,)]" in shown.stdout, shown
    (state, start), final = _resumed(ckpt, [4, 5])
    assert start.tolist() == [0, 5] and state.tolist() == [0.0, 5.0]  # member 0 from init
    assert final.tolist() == [4.0, 5.0]


def test_a_member_that_left_the_loop_does_not_stop_the_others(make_ckpt):
    """n=[4, 10]: the finished member 0 asked step 5 again beside member 1's step 10,
    and the run died: "the members that save at once have different steps [5, 10]"."""
    ckpt = make_ckpt(every=5)
    assert while_batch(ckpt, [4, 10]).tolist() == [4.0, 10.0]
    assert ckpt.all_steps() == [5, 10]
    for step in (5, 10):
        meta = jax_cb_ckpt.metadata(ckpt.directory, step=step)
        assert meta["members"] == [False, True] and meta["left"] == [True, False]
    assert jax_cb_ckpt.metadata(ckpt.directory, step=10)["member_steps"] == [5, 10]
    assert float(jax_cb_ckpt.restore(ckpt.directory, jnp.float32(0), step=10, member=1)) == 10
    (state, start), final = _resumed(ckpt, [4, 10])
    assert start.tolist() == [0, 10] and state.tolist() == [0.0, 10.0]
    assert final.tolist() == [4.0, 10.0]


def test_a_run_cut_short_resumes_each_member_from_its_own_state(make_ckpt, tmp_path):
    """Members to 4, 7 and 12, every=5, the run stopped after step 10 (its loop to 10,
    the run's `n` capped): the restart takes member 1 from step 5 (its own newest), 2
    from 10 and 0 from init, and every member ends as the uninterrupted run."""
    ckpt = make_ckpt(tmp_path / "cut", every=5)
    while_batch(ckpt, [4, 7, 10])  # the first 10 iterations of a run to [4, 7, 12]
    (state, start), final = _resumed(ckpt, [4, 7, 12])
    assert start.tolist() == [0, 5, 10] and state.tolist() == [0.0, 5.0, 10.0]
    whole = while_batch(make_ckpt(tmp_path / "whole", every=5), [4, 7, 12])
    assert final.tolist() == whole.tolist() == [4.0, 7.0, 12.0]


def test_fori_loop_with_a_batched_start_saves_only_members_still_in_it(make_ckpt):
    """The restart's batched start: member 1 starts at 5 and is done at 9 while member 0
    goes on; its body then asks 10 at every iteration. `lax.fori_loop` failed at
    member 0's step 5 ("different steps [5, 10]"); `ckpt.fori_loop` saves step 5 as
    member 0's alone, and computes what `lax.fori_loop` does, bit for bit."""
    ckpt = make_ckpt(every=5)

    def train(loop):
        def run(x, start):
            def body(i, x):
                x = x * 1.5 + 1.0
                ckpt.maybe_save(x, i + 1)
                return x

            return loop(start, 9, body, x)

        return jax.jit(jax.vmap(run))(jnp.ones(2), jnp.asarray([0, 5], jnp.int32))

    final = train(ckpt.fori_loop)
    ckpt.wait()
    assert ckpt.all_steps() == [5]
    meta = jax_cb_ckpt.metadata(ckpt.directory, step=5)
    assert meta["members"] == [True, False] and meta["member_steps"] == [5, 10]
    assert meta["left"] == [False, True]
    plain = jax.jit(jax.vmap(lambda x, s: jax.lax.fori_loop(s, 9, lambda i, x: x * 1.5 + 1.0, x)))
    assert jax_cb_ckpt.same_bits(final, plain(jnp.ones(2), jnp.asarray([0, 5], jnp.int32)))
    # Unvmapped, a traced bound: JAX's while_loop, the same saves and bits.
    unvmapped = jax.jit(lambda x, s: ckpt.fori_loop(s, 12, lambda i, x: x * 1.5 + 1.0, x))
    assert jax_cb_ckpt.same_bits(
        unvmapped(jnp.float32(1), jnp.int32(9)),
        jax.jit(lambda x, s: jax.lax.fori_loop(s, 12, lambda i, x: x * 1.5 + 1.0, x))(
            jnp.float32(1), jnp.int32(9)
        ),
    )


def test_the_loops_save_and_compute_as_jax_s_where_every_member_goes_on(make_ckpt, tmp_path):
    """Unvmapped, or with bounds Python knows, the loops are JAX's: the same saves and
    the same bits."""
    finals, steps = [], []
    for name in ("ours", "jax"):
        ckpt = make_ckpt(tmp_path / name, every=5)
        loop = ckpt.while_loop if name == "ours" else jax.lax.while_loop

        def body(c, ckpt=ckpt):
            i, x = c
            x = x * 1.5 + 1.0
            ckpt.maybe_save(x, i + 1)
            return i + 1, x

        finals.append(jax.jit(lambda x: loop(lambda c: c[0] < 12, body, (0, x)))(1.0))  # noqa: B023
        ckpt.wait()
        steps.append(ckpt.all_steps())
    assert jax_cb_ckpt.same_bits(*finals) and steps == [[5, 10], [5, 10]]
    ckpt = make_ckpt(every=5)
    fori = jax.jit(jax.vmap(lambda x: ckpt.fori_loop(0, 3, lambda i, x: x * 1.5 + i, x)))
    lax_fori = jax.jit(jax.vmap(lambda x: jax.lax.fori_loop(0, 3, lambda i, x: x * 1.5 + i, x)))
    assert jax_cb_ckpt.same_bits(fori(jnp.ones(2)), lax_fori(jnp.ones(2)))


def test_a_save_nested_in_the_body_holds_for_the_members_still_in_the_loop(make_ckpt):
    """A save in a `lax.cond` and one in a `lax.scan` inside the body: both see the
    loop's members (`ckpt.save` too, which would otherwise save every iteration)."""
    ckpt = make_ckpt(every=5)

    def run(x, n):
        def body(c):
            i, x = c

            def inner(x, _):
                ckpt.save(x + 1.0, i + 1)  # unconditional: each live iteration
                return x, None

            x = jax.lax.cond(
                i >= 0, lambda x: jax.lax.scan(inner, x, None, length=1)[0], lambda x: x, x
            )
            return i + 1, x + 1.0

        return ckpt.while_loop(lambda c: c[0] < n, body, (0, x))[1]

    jax.jit(jax.vmap(run))(jnp.zeros(2), jnp.asarray([2, 3]))
    ckpt.wait()
    assert ckpt.all_steps() == [1, 2, 3]
    members = [jax_cb_ckpt.metadata(ckpt.directory, step=s)["members"] for s in (1, 2, 3)]
    assert members == [[True, True], [True, True], [False, True]]


def test_vmap_inside_pmap_records_each_device_s_members(make_ckpt):
    """vmap inside pmap (the gather path): device 0's member 0 leaves at 4 while every
    other member goes on to 9. The gathered save took device 0's steps for every
    device: its left member's step stood for device 1's member 0, which asked, and the
    callback failed ('different steps'), leaving device 1 in the next all_gather (the
    process aborted). Now each device's steps are gathered beside its mask."""
    ckpt = make_ckpt(every=5)

    def run(x, n):
        def body(c):
            i, x = c
            ckpt.maybe_save(x + 1.0, i + 11, axis_name="i")
            return i + 1, x + 1.0

        return ckpt.while_loop(lambda c: c[0] < n, body, (0, x))[1]

    ns = jnp.asarray([[4, 9], [9, 9]])
    final = jax.pmap(jax.vmap(run), axis_name="i")(jnp.zeros((2, 2)), ns)
    assert np.asarray(final).tolist() == [[4.0, 9.0], [9.0, 9.0]]
    ckpt.wait()
    assert ckpt.all_steps() == [15]
    meta = ckpt.metadata(15)
    assert meta["members"] == [[False, True], [True, True]]
    assert meta["left"] == [[True, False], [False, False]]
    restored = jax_cb_ckpt.restore(ckpt.directory, jnp.float32(0), step=15, member=(1, 0))
    assert float(restored) == 5.0


def test_a_function_traced_in_the_body_is_traced_again_outside_it(make_ckpt, tmp_path):
    """A jitted step and a scan body defined outside the loop, which save (the scan's
    with a second Checkpointer): traced in the loop's body they hold to its members;
    called again outside, JAX's caches handed back the jaxpr that held the body's
    predicate (UnexpectedTracerError)."""
    ckpt, other = make_ckpt(tmp_path / "a", every=5), make_ckpt(tmp_path / "b", every=5)

    @jax.jit
    def step_fn(x, i):
        ckpt.maybe_save(x + 1.0, i + 1)
        return x + 1.0

    def inner(carry, _):
        i, x = carry
        other.maybe_save(x * 2.0, i + 1)
        return carry, None

    def run(x, n):
        def body(c):
            i, x = c
            jax.lax.scan(inner, (i, x), None, length=1)
            return i + 1, step_fn(x, i)

        return ckpt.while_loop(lambda c: c[0] < n, body, (0, x))[1]

    assert jax.jit(jax.vmap(run))(jnp.zeros(2), jnp.asarray([4, 10])).tolist() == [4.0, 10.0]
    assert float(step_fn(jnp.float32(20.0), 19)) == 21.0  # saves step 20, outside
    jax.jit(lambda x: jax.lax.scan(inner, (jnp.int32(24), x), None, length=1))(jnp.float32(1))
    for c, last in ((ckpt, 20), (other, 25)):
        c.wait()
        assert c.all_steps() == [5, 10, last]
        assert [c.metadata(s).get("left") for s in (5, 10)] == [[True, False]] * 2
        assert "batch_shape" not in c.metadata(last)


def test_restore_of_a_step_names_the_members_that_did_not_ask_for_it(make_ckpt):
    """`restore(like, step=k)` of the whole batch returned, for a member that did not
    ask at `k`, what `k` holds, silently."""
    ckpt = make_ckpt(every=5)
    while_batch(ckpt, [4, 10, 10])
    like = jnp.zeros(3)
    with pytest.warns(
        MemberStateWarning, match=r"restore\(step=10\) from .*: member\(s\) 0 of the"
    ):
        state = jax_cb_ckpt.restore(ckpt.directory, like, step=10)
    assert np.asarray(state).tolist() == [5.0, 10.0, 10.0]  # member 0's data, as stored
    with pytest.warns(MemberStateWarning, match=r"member\(s\) 0 of the batch saved at step 10"):
        jax_cb_ckpt.restore(ckpt.directory, like)  # each from its own newest: 0 has none
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        jax_cb_ckpt.restore(ckpt.directory, like[0], step=10, member=1)  # asked: nothing said


def test_a_member_that_asked_for_no_step_but_was_at_it_keeps_its_state(make_ckpt):
    """A per-member predicate in a scan (every member runs every iteration): member 1
    never asks, and step 4 holds its true state there; the restart keeps it, at step 4,
    and `restore(step=4)` says nothing (only members not at the step are named)."""
    ckpt = make_ckpt(every=5)

    def train(x, every):
        def body(x, i):
            x = x + 1.0
            ckpt.maybe_save(x, i + 1, when=(i + 1) % every == 0)
            return x, None

        return jax.lax.scan(body, x, jnp.arange(5))[0]

    jax.jit(jax.vmap(train))(jnp.zeros(2), jnp.asarray([4, 7]))
    ckpt.wait()
    assert ckpt.all_steps() == [4] and "left" not in ckpt.metadata(4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert np.asarray(jax_cb_ckpt.restore(ckpt.directory, jnp.zeros(2), step=4)).tolist() == [
            4.0,
            4.0,
        ]
        state, start = ckpt.restore_or_init(lambda: jnp.zeros(2))
    assert np.asarray(state).tolist() == [4.0, 4.0] and np.asarray(start).tolist() == [4, 4]


def test_a_plain_while_loop_s_frozen_member_is_told_the_loop_to_use(make_ckpt):
    """`lax.while_loop` cannot be made exact (nothing the save receives tells a finished
    member from a live one): the run's failure, and the repeats of its frozen step,
    name `ckpt.while_loop`."""
    ckpt = make_ckpt(every=5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(Exception, match=r"different steps \[5, 10\]"):
            while_batch(ckpt, [4, 10], plain=True)
        with pytest.raises(jax_cb_ckpt.InvalidStateError, match=r"ckpt\.while_loop / ckpt\."):
            ckpt.close()
    repeats = [str(w.message) for w in caught if w.category is jax_cb_ckpt.DuplicateStepWarning]
    assert repeats and all("loop with ckpt.while_loop" in m for m in repeats), repeats


def test_the_loops_refuse_what_is_not_a_function(make_ckpt):
    ckpt = make_ckpt(every=5)
    with pytest.raises(ConfigError, match=r"while_loop\(body_fun=3\): body_fun must be a"):
        ckpt.while_loop(lambda c: c < 3, 3, 0)
    with pytest.raises(ConfigError, match=r"fori_loop\(body_fun=None\)"):
        ckpt.fori_loop(0, 3, None, 0)


@pytest.mark.slow
def test_the_page_s_example_runs_twice_and_each_member_ends_as_its_own_run(tmp_path):
    """docs/transforms.md's vmap-of-a-while_loop block, run twice: the second run
    restarts member 0 (it asked for no step) from init_fn and member 1 from step 10."""
    page = Path(__file__).parent.parent / "docs" / "transforms.md"
    blocks = re.findall(r"^```python\n(.*?)^```$", page.read_text(), re.M | re.S)
    (code,) = [block for block in blocks if "ckpt.while_loop(" in block]
    assert run_twice(tmp_path, code).stdout.split("\n")[0] == "[0, 10] [4.0, 10.0]"
