"""`_user/_run.py`: `ckpt.run`'s own contract. Its arguments are checked before anything
runs (every/every_seconds needed, num_steps, check_every, a body whose result is not
shaped like `init`, named by leaf); a run resumed from its checkpoint ends with the
bits of an uninterrupted one; a stop request saves and raises `Preempted` (code 1);
a directory past `num_steps` is refused; a complete run does nothing; `_in_thread`
returns the helper thread's result and re-raises its error in the caller's thread."""

import os
import time

import jax.numpy as jnp
import pytest
from helpers import data_files, flip

import jax_cb_ckpt
from jax_cb_ckpt import ConfigError, Preempted
from jax_cb_ckpt._user._preempt import StopFlag
from jax_cb_ckpt._user._run import _in_thread

INIT = {"x": jnp.arange(3, dtype=jnp.float32), "n": jnp.int32(0)}


def body(state, step):
    return {"x": state["x"] * 0.5 + step.astype(jnp.float32), "n": state["n"] + step}


def test_run_needs_every_or_every_seconds(make_ckpt):
    with pytest.raises(ConfigError, match=r"^run: the Checkpointer needs every=N .*every_seconds"):
        make_ckpt().run(body, INIT, 4)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"num_steps": -1}, r"run: num_steps must be a non-negative int, got -1"),
        ({"num_steps": 2.0}, r"run: num_steps must be a non-negative int, got 2\.0"),
        ({"check_every": 0}, r"run: check_every must be a positive int, got 0"),
        ({"metrics": 3}, r"run\(metrics=3\): metrics must be a function of the state"),
    ],
)
def test_arguments_are_checked_before_anything_runs(make_ckpt, ckpt_dir, kwargs, match):
    args = {"num_steps": 4, **kwargs}
    with pytest.raises(ConfigError, match=match):
        make_ckpt(every=2).run(body, INIT, **args)
    assert jax_cb_ckpt.all_steps(ckpt_dir) == []


def test_a_body_whose_result_is_not_shaped_like_init_is_named_by_leaf(make_ckpt):
    ckpt = make_ckpt(every=2)

    def wrong(state, step):
        return {"x": state["x"].astype(jnp.bfloat16), "n": state["n"]}

    with pytest.raises(
        ConfigError,
        match=r"leaf init\['x'\] is float32\[3\] in init and "
        r"bfloat16\[3\] in what body returns",
    ):
        ckpt.run(wrong, INIT, 4)
    with pytest.raises(ConfigError, match=r"it returned .* instead of .*scan_body\(s, i\)\[0\]"):
        ckpt.run(lambda s, i: (body(s, i), i), INIT, 4)


def test_a_resumed_run_ends_with_the_bits_of_an_uninterrupted_one(make_ckpt, tmp_path):
    whole = make_ckpt(tmp_path / "whole", every=2).run(body, INIT, 7)
    part = tmp_path / "part"
    ckpt = make_ckpt(part, every=2)
    ckpt.run(body, INIT, 4)
    ckpt.close()
    assert jax_cb_ckpt.all_steps(part) == [2, 4]
    resumed = make_ckpt(part, every=2).run(body, INIT, 7)
    assert jax_cb_ckpt.all_steps(part) == [2, 4, 6, 7]
    assert jax_cb_ckpt.same_bits(resumed, whole)


def test_a_stop_request_saves_and_raises_preempted(make_ckpt, ckpt_dir):
    ckpt = make_ckpt(every=100)
    ckpt.request_stop()
    with pytest.raises(Preempted, match=r"stopped at step 2 after request_stop\(\)") as info:
        ckpt.run(body, INIT, 10, check_every=2)
    assert info.value.code == 1
    assert jax_cb_ckpt.all_steps(ckpt_dir) == [2]
    assert not ckpt.stop_requested  # consumed: a later run starts afresh


def test_a_directory_past_num_steps_is_refused_and_a_complete_run_does_nothing(make_ckpt, ckpt_dir):
    ckpt = make_ckpt(every=3)
    done = ckpt.run(body, INIT, 3)
    with pytest.raises(
        ConfigError,
        match=r"the latest checkpoint in .* is step 3, past "
        r"num_steps=2",
    ):
        ckpt.run(body, INIT, 2)
    again = ckpt.run(body, INIT, 3)
    assert jax_cb_ckpt.same_bits(again, done)
    assert ckpt.stats.saves == 1


def test_in_thread_returns_the_result_and_reraises_the_error():
    flag = StopFlag()
    assert _in_thread(lambda: 41 + 1, flag) == 42

    def fails():
        raise ValueError("in the helper")

    with pytest.raises(ValueError, match="in the helper"):
        _in_thread(fails, flag)
    ticks = []
    assert _in_thread(lambda: time.sleep(0.2) or 7, flag, lambda: ticks.append(1)) == 7
    assert len(ticks) >= 2  # the caller waited in short steps, ticking


def test_run_says_where_it_starts_on_stderr_unless_quiet(make_ckpt, ckpt_dir, capfd):
    """Issue 52 item 8: a mistyped directory trains from step 0 again; run says so in one
    line on stderr, without any logging configured (and resumed runs say from where)."""
    ckpt = make_ckpt(every=2)
    ckpt.run(body, INIT, 4)
    err = capfd.readouterr().err
    assert f"jax_cb_ckpt: run starting fresh at step 0 in {ckpt_dir} (no checkpoint there)" in err
    ckpt.run(body, INIT, 6)
    assert f"jax_cb_ckpt: run resumed from step 4 of {ckpt_dir}\n" in capfd.readouterr().err
    ckpt.run(body, INIT, 6)
    assert "resumed from step 6 of" in capfd.readouterr().err  # (and nothing to do)
    ckpt.run(body, INIT, 6, quiet=True)
    assert "jax_cb_ckpt" not in capfd.readouterr().err
    with pytest.raises(ConfigError, match=r"run: quiet must be True or False, got 'yes'"):
        ckpt.run(body, INIT, 6, quiet="yes")


def test_run_s_start_line_says_its_damaged_steps_were_passed_over(make_ckpt, ckpt_dir, capfd):
    """A directory whose every step is damaged: the start line said "no checkpoint
    there"; it says the run starts fresh because its steps were damaged, naming them."""
    ckpt = make_ckpt(every=2)
    ckpt.run(body, INIT, 4, quiet=True)
    steps = ckpt.all_steps()
    assert steps
    for step in steps:
        path = data_files(os.path.join(ckpt_dir, str(step)))[0]
        flip(path, os.path.getsize(path) // 2)
    with pytest.warns(jax_cb_ckpt.DamagedStepWarning):
        ckpt.run(body, INIT, 4)
    err = capfd.readouterr().err
    assert "no checkpoint there" not in err, err
    listed = ", ".join(str(s) for s in steps)
    assert (
        f"jax_cb_ckpt: run starting fresh at step 0 in {ckpt_dir} (no step there passes its "
        f"checks: {len(steps)} damaged step(s) passed over, {listed};"
    ) in err, err


def test_an_error_of_ours_in_run_s_loop_is_raised_as_ours(make_ckpt, ckpt_dir):
    """Issue 52 item 7: a save refused inside run's jitted loop (here: the writer failed
    on a directory replaced mid-run) reached the user as `JaxRuntimeError: INTERNAL:
    ...`; run raises our SaveError with its text, JAX's error chained."""
    import shutil

    import jax
    import numpy as np

    ckpt = make_ckpt(every=2)

    def at_step(i):
        if int(i) == 1:  # before step 2 is saved: the directory replaced under the writer
            shutil.rmtree(ckpt_dir)
            ckpt_dir.mkdir()
        if int(i) == 3:  # step 2's write has failed by now: step 4's crossing refuses
            ckpt._parts.exchange.drain()
        return np.float32(0)

    def watched(state, step):  # (the state depends on the callback: it runs in order)
        zero = jax.pure_callback(at_step, jax.ShapeDtypeStruct((), jnp.float32), step)
        return {"x": state["x"] + zero, "n": state["n"] + step}

    with pytest.raises(jax_cb_ckpt.SaveError, match=r"^saving step 2 .*was replaced") as info:
        ckpt.run(watched, INIT, 8)
    assert isinstance(info.value.__cause__, jax.errors.JaxRuntimeError)
