"""`_user/_checkpointer.py`, a few contracts of the façade itself: a closed Checkpointer
refuses saves and `with` (`CheckpointerClosedError`, saying to create a new one) while
`close()` stays idempotent; the `with` block waits for every save before it returns;
`save_due` needs `every_seconds`; a copy is the same object and pickling is refused; a
second Checkpointer on an open directory is refused, and allowed once it is closed;
`request_stop` sets the flag loops read; a `maybe_save` at a step that does not save
still refuses what a save would."""

import copy
import pickle

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_cb_ckpt
from jax_cb_ckpt import (
    CheckpointerClosedError,
    ConfigError,
    DirectoryLockedError,
    InvalidStateError,
)

STATE = {"w": jnp.arange(4.0)}


def test_a_closed_checkpointer_refuses_saves_and_with(make_ckpt):
    ckpt = make_ckpt()
    ckpt.close()
    ckpt.close()  # idempotent
    assert "closed)" in repr(ckpt)
    with pytest.raises(
        CheckpointerClosedError,
        match=r"^save: this Checkpointer on .* is "
        r"closed\. Fix: create a new Checkpointer",
    ):
        ckpt.save(STATE, 1)
    with pytest.raises(CheckpointerClosedError, match=r"^maybe_save: .*is closed"):
        ckpt.maybe_save(STATE, 1)
    with pytest.raises(CheckpointerClosedError, match=r"^with ckpt: .*create a new Checkpointer"):
        with ckpt:
            pass


def test_the_with_block_waits_for_every_save(ckpt_dir):
    big = {"w": jnp.ones((1 << 20,))}
    with jax_cb_ckpt.Checkpointer(ckpt_dir, queue_size=8) as ckpt:
        for step in range(5):
            ckpt.save(big, step)
    assert ckpt.stats.saves == 5
    assert jax_cb_ckpt.all_steps(ckpt_dir) == list(range(5))


def test_a_save_inside_jit_is_on_disk_after_wait(make_ckpt, ckpt_dir):
    ckpt = make_ckpt()

    @jax.jit
    def step_fn(state, step):
        ckpt.maybe_save(state, step, when=step % 2 == 0)
        return jax.tree.map(lambda x: x + 1, state)

    state = STATE
    for step in range(4):
        state = step_fn(state, jnp.int32(step))
    ckpt.wait()
    assert jax_cb_ckpt.all_steps(ckpt_dir) == [0, 2]
    restored = ckpt.restore(STATE)
    np.testing.assert_array_equal(restored["w"], STATE["w"] + 2)


def test_a_step_that_does_not_save_refuses_what_a_save_would(make_ckpt, ckpt_dir):
    """A `maybe_save` at a step that does not save (eager, or a Python step under jit)
    still checks its arguments, state and metrics: the mistake shows at the first call,
    and nothing reaches the disk. What is fine passes, and keep_best's missing metric is
    warned about there too."""
    ckpt = make_ckpt(every=1000, keep_best=2, best="return")
    good = {"w": np.ones(3, np.float32)}
    with pytest.raises(InvalidStateError, match=r"^maybe_save: .*state\['w'\]"):
        ckpt.maybe_save({"w": "text"}, 3)
    with pytest.raises(ConfigError, match=r"^maybe_save\(gather='sum'\)"):
        ckpt.maybe_save(good, 3, gather="sum")
    with pytest.raises(InvalidStateError, match=r"^maybe_save\(metrics=\.\.\.\).*a metric is"):
        ckpt.maybe_save(good, 3, metrics={"return": np.ones((2, 2))})
    with pytest.raises(InvalidStateError, match=r"^maybe_save\(axis_name='i'\): no axis"):
        ckpt.maybe_save(good, 3, axis_name="i")
    with pytest.raises(InvalidStateError, match="not a prefix"):
        jax.jit(lambda s: ckpt.maybe_save(s, 3, shardings=[None, None]))(good)
    with pytest.warns(jax_cb_ckpt.CheckpointWarning, match="without 'return'"):
        ckpt.maybe_save(good, 3, metrics={"loss": 1.0})
    ckpt.maybe_save(good, 3, metrics=lambda s: {"return": s["w"].sum()})  # not called
    ckpt.wait()
    assert jax_cb_ckpt.all_steps(ckpt_dir) == [] and ckpt.stats.saves == 0


def test_save_due_needs_every_seconds(make_ckpt):
    ckpt = make_ckpt()
    with pytest.raises(
        ConfigError,
        match=r"save_due: this Checkpointer has no every_seconds\. "
        r"Fix: Checkpointer\(directory, every_seconds=T\)",
    ):
        ckpt.save_due(jnp.int32(0))


def test_save_due_reads_the_clock_from_the_opening(make_ckpt, tmp_path):
    slow = make_ckpt(every_seconds=3600.0)
    assert not bool(jax.jit(slow.save_due)(jnp.int32(1)))
    fast = make_ckpt(tmp_path / "fast", every_seconds=1e-6)
    assert bool(jax.jit(fast.save_due)(jnp.int32(1)))


def test_a_copy_is_the_same_checkpointer_and_pickling_is_refused(make_ckpt):
    ckpt = make_ckpt()
    assert copy.copy(ckpt) is ckpt and copy.deepcopy({"c": ckpt})["c"] is ckpt
    with pytest.raises(ConfigError, match="cannot be pickled: it owns a writer thread"):
        pickle.dumps(ckpt)


def test_one_open_checkpointer_per_directory(make_ckpt, ckpt_dir):
    first = make_ckpt()
    with pytest.raises(DirectoryLockedError, match="another Checkpointer in this process"):
        jax_cb_ckpt.Checkpointer(ckpt_dir)
    first.close()
    make_ckpt().close()


def test_request_stop_sets_the_flag_loops_read(make_ckpt):
    ckpt = make_ckpt()
    assert not ckpt.stop_requested and not bool(ckpt.should_stop(jnp.int32(0)))
    ckpt.request_stop()
    assert ckpt.stop_requested and bool(ckpt.should_stop(jnp.int32(1)))


def test_the_repr_shows_every_retention_rule(tmp_path):
    """The repr showed `max_to_keep` alone: rules given as objects (or keep_every,
    keep_best) were hidden."""
    import jax_cb_ckpt

    rules = [jax_cb_ckpt.LatestN(3), jax_cb_ckpt.BestN("loss", 2, "min")]
    with jax_cb_ckpt.Checkpointer(tmp_path / "a", keep=rules) as ckpt:
        shown = repr(ckpt)
    assert "max_to_keep=3" in shown and "keep_best=2" in shown and "'loss'" in shown, shown
    with jax_cb_ckpt.Checkpointer(tmp_path / "b") as ckpt:
        assert "keep='all'" in repr(ckpt), repr(ckpt)
