"""Every warning the library issues points at the user's line, whichever public call
issues it (issue 29 item 5: a DuplicateStepWarning issued through `ckpt.restore()`
pointed at _checkpointer.py, through `ckpt.wait()` at the user's line: stack levels
were counted by hand)."""

import os
import shutil
import warnings

import jax
import numpy as np
import pytest
from helpers import ROOT, run_child

import jax_cb_ckpt
from jax_cb_ckpt import DamagedStepWarning, DuplicateStepWarning

STATE = {"w": np.arange(4, dtype=np.float32)}


def _issued(call):
    """The warnings `call()` issued (every one recorded, none raised)."""
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        call()
    return record


def _points_at_this_file(record, category):
    found = [w for w in record if issubclass(w.category, category)]
    assert found, [str(w.message) for w in record]
    assert all(w.filename == __file__ for w in found), [(w.filename, w.lineno) for w in found]


# Each one issues the DuplicateStepWarning noted when step 1 was handed over again.
CHECKPOINTER_CALLS = {
    "wait": lambda ckpt: ckpt.wait(),
    "restore": lambda ckpt: ckpt.restore(STATE),
    "close": lambda ckpt: ckpt.close(),
    "save": lambda ckpt: ckpt.save(STATE, 2),
    "maybe_save": lambda ckpt: ckpt.maybe_save(STATE, 3, when=True),
    "with": lambda ckpt: ckpt.__exit__(None, None, None),
}


@pytest.mark.parametrize("call", list(CHECKPOINTER_CALLS))
def test_a_noted_warning_points_at_the_user_s_call(tmp_path, call):
    ckpt = jax_cb_ckpt.Checkpointer(tmp_path / "ckpt")

    @jax.jit
    def twice(w):
        ckpt.save({"w": w}, 1)
        ckpt.save({"w": w}, 1)  # dropped in the callback: noted for the user's thread
        return w

    try:
        jax.block_until_ready(twice(STATE["w"]))
        jax.effects_barrier()
        _points_at_this_file(_issued(lambda: CHECKPOINTER_CALLS[call](ckpt)), DuplicateStepWarning)
    finally:
        ckpt.close()


def _with_a_damaged_step(directory):
    with jax_cb_ckpt.Checkpointer(directory) as ckpt:
        ckpt.save(STATE, 1)
        ckpt.save(STATE, 2)
    shutil.rmtree(os.path.join(directory, "2", "state"))


MODULE_CALLS = {
    "all_steps": lambda d: jax_cb_ckpt.all_steps(d),
    "latest_step": lambda d: jax_cb_ckpt.latest_step(d),
    "restore": lambda d: jax_cb_ckpt.restore(d, STATE),
    "verify": lambda d: jax_cb_ckpt.verify(d),
    "metadata": lambda d: jax_cb_ckpt.metadata(d),
}


@pytest.mark.parametrize("call", list(MODULE_CALLS))
def test_a_damaged_step_is_reported_at_the_user_s_call(tmp_path, call):
    directory = tmp_path / "ckpt"
    _with_a_damaged_step(directory)
    if call == "verify":  # a damaged step fails verify, as it fails the CLI's (an error)
        with pytest.raises(jax_cb_ckpt.DamagedStepError):
            MODULE_CALLS[call](directory)
        return
    record = _issued(lambda: MODULE_CALLS[call](directory))
    _points_at_this_file(record, DamagedStepWarning)


@pytest.mark.parametrize("call", ["all_steps", "latest_step", "restore"])
def test_a_damaged_step_is_reported_at_the_user_s_checkpointer_call(tmp_path, call):
    directory = tmp_path / "ckpt"
    _with_a_damaged_step(directory)
    with jax_cb_ckpt.Checkpointer(directory) as ckpt:
        calls = {
            "all_steps": ckpt.all_steps,
            "latest_step": ckpt.latest_step,
            "restore": lambda: ckpt.restore(STATE),
        }
        _points_at_this_file(_issued(calls[call]), DamagedStepWarning)


# -- a step that never changes (issue 52 item 6) ---------------------------------------


def _loop(kind, body, state, n):
    """`body(i, state) -> state` run n times by the loop `kind`, inside jit."""
    if kind == "scan":
        return jax.lax.scan(lambda s, i: (body(i, s), None), state, jax.numpy.arange(n))[0]
    if kind == "fori_loop":
        return jax.lax.fori_loop(0, n, body, state)
    return jax.lax.while_loop(
        lambda c: c[0] < n, lambda c: (c[0] + 1, body(c[0], c[1])), (0, state)
    )[1]


@pytest.mark.parametrize(
    "kind, named",
    [("scan", "lax.scan"), ("fori_loop", "lax.fori_loop"), ("while_loop", "lax.while_loop")],
)
def test_a_counter_bumped_in_a_loop_body_is_told_while_tracing(tmp_path, kind, named):
    """`step += 1` on a Python counter in a loop body is traced once: every iteration
    asks for step 1, which every=10 never saves. Said while tracing, at the user's line,
    with the fix; nothing is saved."""
    ckpt = jax_cb_ckpt.Checkpointer(tmp_path / "ckpt", every=10)
    step = 0

    def body(i, state):
        nonlocal step
        step += 1
        ckpt.maybe_save(state, step)
        return state + 1.0

    train = jax.jit(lambda s: _loop(kind, body, s, 30))
    with pytest.warns(
        jax_cb_ckpt.ConstantStepWarning,
        match=rf"step 1 is a Python number inside a {named} body.*no iteration saves"
        r".*Fix: pass the loop's counter, traced: `i \+ 1`",
    ) as record:
        train(np.zeros(2, np.float32))
    assert [w.filename for w in record] == [__file__]
    ckpt.close()
    assert ckpt.all_steps() == []


def test_a_fixed_step_in_a_scan_is_told_and_its_duplicates_name_the_cause(tmp_path):
    ckpt = jax_cb_ckpt.Checkpointer(tmp_path / "ckpt", every=10)

    def body(state, i):
        ckpt.maybe_save(state, 100)
        return state + 1.0, None

    with pytest.warns(jax_cb_ckpt.ConstantStepWarning, match=r"every iteration saves step 100"):
        train = jax.jit(lambda s: jax.lax.scan(body, s, jax.numpy.arange(3))[0])
        train(np.zeros(2, np.float32))
    with pytest.warns(
        DuplicateStepWarning,
        match=r"step 100 was handed over again .*most likely the same step at every "
        r"iteration of a loop.*`i \+ 1`",
    ):
        ckpt.close()
    assert ckpt.all_steps() == [100]


def test_concrete_steps_that_are_meant_are_not_warned_about(tmp_path):
    """Eagerly, in a jitted function without a loop, a traced step with last_step=, a
    traced when= and a save in a cond's branch inside a loop: no ConstantStepWarning."""
    ckpt = jax_cb_ckpt.Checkpointer(tmp_path / "ckpt", every=10)
    x = np.zeros(2, np.float32)

    def fori(body):
        return jax.jit(lambda s: jax.lax.fori_loop(0, 30, body, s))(x)

    def in_branch(i, s):
        jax.lax.cond(i == 29, lambda: ckpt.save(s, 5000), lambda: None)
        return s

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any warning of ours fails the test
        ckpt.maybe_save(x, 10)
        jax.jit(lambda s: ckpt.maybe_save(s, 20))(x)
        jax.jit(lambda s: ckpt.save(s, 21))(x)
        fori(lambda i, s: (ckpt.maybe_save(s, i + 1000, last_step=1029), s)[1])
        fori(lambda i, s: (ckpt.maybe_save(s, 4000, when=i == 29), s)[1])
        fori(in_branch)
        ckpt.close()
    assert ckpt.all_steps() == [10, 20, 21, 1000, 1010, 1020, 1029, 4000, 5000]


def test_a_constant_step_in_a_loop_that_runs_once_is_not_warned_about(tmp_path):
    """A scan of length 1 (or fori_loop(0, 1)) runs its body once: a constant step there
    is saved once, no mistake. One such loop inside a longer one still repeats it."""
    ckpt = jax_cb_ckpt.Checkpointer(tmp_path / "ckpt", every=10)
    x = np.zeros(2, np.float32)

    def saving(step):
        def body(state, i):
            ckpt.maybe_save(state, step)
            return state + 1.0, None

        return body

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any warning of ours fails the test
        jax.jit(lambda s: jax.lax.scan(saving(100), s, jax.numpy.arange(1))[0])(x)
        jax.jit(lambda s: jax.lax.scan(saving(110), s, length=1)[0])(x)
        jax.jit(lambda s: jax.lax.fori_loop(0, 1, lambda i, s: saving(120)(s, i)[0], s))(x)
        ckpt.wait()
    assert ckpt.all_steps() == [100, 110, 120]

    def outer(state, i):
        return jax.lax.scan(saving(130), state, length=1)[0], None

    with pytest.warns(jax_cb_ckpt.ConstantStepWarning, match=r"every iteration saves step 130"):
        jax.jit(lambda s: jax.lax.scan(outer, s, length=3)[0])(x)
    with pytest.warns(DuplicateStepWarning):
        ckpt.close()


# -- the suite's own warning filters (pyproject.toml) ------------------------------------
# Only our own warnings are errors: an upstream release that deprecates something at import
# (jax 0.12.1 + orbax-checkpoint 0.12.8: "SingleDeviceSharding is deprecated", raised while
# Orbax was imported) must not stop a user's `pytest` before one test ran.

_UPSTREAM = """
import warnings

warnings.warn("fake_upstream.OldThing is deprecated", DeprecationWarning, stacklevel=2)
"""

_TESTS = """
import warnings

import fake_upstream  # warns at import, that is while pytest collects this file

import jax_cb_ckpt


def test_an_upstream_warning_is_shown():
    warnings.warn("fake_upstream.call is deprecated", DeprecationWarning)


def test_a_warning_of_ours_fails():
    warnings.warn("ours", jax_cb_ckpt.DuplicateStepWarning)


def test_a_deprecated_call_from_our_code_fails():
    warnings.warn_explicit(
        "jax.old_api is deprecated", DeprecationWarning, "_traced.py", 1,
        module="jax_cb_ckpt._save._traced",
    )
"""


def test_an_upstream_deprecation_at_import_never_fails_the_suite_and_ours_do(tmp_path):
    (tmp_path / "fake_upstream.py").write_text(_UPSTREAM)
    (tmp_path / "test_fake.py").write_text(_TESTS)
    ran = run_child(
        [
            "python",
            "-m",
            "pytest",
            "-c",
            os.path.join(ROOT, "pyproject.toml"),
            "--rootdir",
            tmp_path,
            "-p",
            "no:cacheprovider",
            "-q",
            tmp_path / "test_fake.py",
        ],
        cwd=tmp_path,
    )
    out = ran.stdout + ran.stderr
    assert "error" not in out.splitlines()[-1], out  # collected: no collection error
    assert "2 failed, 1 passed" in out, out
    assert "fake_upstream.OldThing is deprecated" in out, out  # shown in the summary
    assert "fake_upstream.call is deprecated" in out, out
    assert "FAILED test_fake.py::test_a_warning_of_ours_fails" in out, out
    assert "FAILED test_fake.py::test_a_deprecated_call_from_our_code_fails" in out, out
