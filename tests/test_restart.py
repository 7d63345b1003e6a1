"""A restart always resumes (issue 41): from the newest intact step, in the shapes users
write, from plain Orbax too. One kill-and-resume test per item, each a real child
process SIGKILLed mid-run and started again (tests/restart_worker.py), its final state
compared bit for bit with an uninterrupted run's (with `-m slow`, as CI runs them:
each item also has quick tests in this process, run by default), and the rules around
them. Each test was seen failing on the code before the issue."""

import json
import logging
import os
import sys
import typing
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import data_files, flip, json_lines, run_child, state_at, while_batch

import jax_cb_ckpt
from jax_cb_ckpt import DamagedStepError, DamagedStepWarning, StepExistsError

WORKER = os.path.join(os.path.dirname(__file__), "restart_worker.py")
SCRIPT = Path(sys.executable).with_name("jax-cb-ckpt")


def _worker(scenario, directory, kill_at=None, option=""):
    """Run the worker to its end (or its kill): (return code, its last JSON line, stderr)."""
    args = ["python", WORKER, scenario, directory, "-" if kill_at is None else kill_at]
    result = run_child(args + ([option] if option else []), timeout=240)
    lines = json_lines(result.stdout)
    return result.returncode, (lines[-1] if lines else None), result.stderr


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """{scenario: the digest of its final state, run to its end in one go}."""
    cache = {}
    root = tmp_path_factory.mktemp("uninterrupted")

    def get(scenario, option=""):
        key = (scenario, option)
        if key not in cache:
            code, line, err = _worker(scenario, root / f"{scenario}-{option}", option=option)
            assert code == 0 and line is not None, err[-3000:]
            cache[key] = line["digest"]
        return cache[key]

    return get


def _killed(scenario, directory, kill_at, option=""):
    code, _, err = _worker(scenario, directory, kill_at, option)
    assert code == -9, err[-3000:]  # SIGKILL, mid-run


# -- item 1: one damaged latest step -----------------------------------------------------


def _flip_newest(directory):
    newest = jax_cb_ckpt.latest_step(directory)
    path = data_files(os.path.join(directory, str(newest)))[0]
    flip(path, os.path.getsize(path) // 2)
    return newest


@pytest.mark.slow
def test_a_flipped_bit_in_the_newest_step_resumes_from_the_one_before(tmp_path, uninterrupted):
    """Steps 5..20 on disk, one bit of step 20 flipped: every restart raised "leaf
    state['w'] is corrupted" (a scheduler restarts it forever). Now it resumes from 15,
    names 20 in a DamagedStepWarning, sets it aside (never deleted, `ls` shows it),
    writes step 20 again, and ends as the uninterrupted run, bit for bit."""
    d = tmp_path / "run"
    _killed("loop", d, 22)
    bad = _flip_newest(d)
    assert bad == 20
    code, line, err = _worker("loop", d)
    assert code == 0, err[-3000:]
    assert line["start"] == 15 and line["digest"] == uninterrupted("loop")
    assert "DamagedStepWarning" in err and "passing over 1 newer step(s): step 20: " in err, err
    [aside] = [n for n in os.listdir(d) if n.startswith("20.jax_cb_ckpt-damaged-")]
    note = json.loads((d / aside / ".jax_cb_ckpt-set-aside.json").read_text())
    assert note["step"] == 20 and ("corrupted" in note["why"] or "cannot read" in note["why"])
    assert jax_cb_ckpt.all_steps(d)[-1] == 40 and 20 in jax_cb_ckpt.all_steps(d)
    ls = run_child([SCRIPT, "ls", d], timeout=120)
    assert ls.returncode == 0 and f"set aside by a restart as {aside}" in ls.stdout, ls.stdout


@pytest.mark.slow
def test_on_damaged_raise_stops_and_touches_nothing(tmp_path):
    d = tmp_path / "run"
    _killed("loop", d, 22)
    _flip_newest(d)
    before = sorted(os.listdir(d))
    code, _, err = _worker("loop", d, option="raise")
    assert code == 1 and "DamagedStepError" in err and "on_damaged='raise'" in err, err[-2000:]
    assert sorted(os.listdir(d)) == before


def _saved(directory, steps=(300, 400, 500)):
    with jax_cb_ckpt.Checkpointer(directory) as ckpt:
        for step in steps:
            ckpt.save({"w": np.full(1000, float(step), np.float32)}, step)


def _flip_step(directory, step):
    path = data_files(os.path.join(directory, str(step)))[0]
    flip(path, os.path.getsize(path) // 2)


LIKE = {"w": np.zeros(1000, np.float32)}


def test_a_named_step_never_falls_back_and_a_plain_read_moves_nothing(tmp_path):
    d = tmp_path / "ckpt"
    _saved(d)
    _flip_step(d, 500)
    with pytest.raises(DamagedStepError, match=r"restore\(step=500\)"):
        jax_cb_ckpt.restore(d, LIKE, step=500)
    with pytest.warns(DamagedStepWarning, match=r"read step 400 .*step 500: .*left in place"):
        assert jax_cb_ckpt.restore(d, LIKE)["w"][0] == 400
    with pytest.raises(DamagedStepError, match="on_damaged='raise'"):
        jax_cb_ckpt.restore(d, LIKE, on_damaged="raise")
    assert sorted(os.listdir(d)) == [".jax_cb_ckpt.lock", "300", "400", "500"]  # untouched
    with jax_cb_ckpt.Checkpointer(d) as ckpt, pytest.raises(DamagedStepError):
        ckpt.restore(LIKE, step=500)
    assert "500" in os.listdir(d)


def test_a_like_that_does_not_fit_is_raised_not_fallen_back(tmp_path):
    """Only damage is passed over: a `like` of another shape must not send the run back
    to an older step (nor set anything aside)."""
    d = tmp_path / "ckpt"
    _saved(d)
    with jax_cb_ckpt.Checkpointer(d) as ckpt:
        with pytest.raises(jax_cb_ckpt.StructureMismatchError, match=r"leaf like\['w'\]"):
            ckpt.restore_or_init(lambda: {"w": np.zeros(999, np.float32)})
    assert sorted(os.listdir(d)) == [".jax_cb_ckpt.lock", "300", "400", "500"]


def test_every_step_damaged_starts_afresh_and_a_restore_says_why(tmp_path):
    d = tmp_path / "ckpt"
    _saved(d, (300, 400))
    for step in (300, 400):
        _flip_step(d, step)
    with pytest.raises(DamagedStepError, match=r"step=400.*No older step .*step 300: "):
        jax_cb_ckpt.restore(d, LIKE)
    with jax_cb_ckpt.Checkpointer(d) as ckpt:
        with pytest.warns(DamagedStepWarning, match=r"no step .* passes its checks"):
            state, start = ckpt.restore_or_init(lambda: LIKE)
        assert start == 0 and state is LIKE
        ckpt.save(state_at(1), 300)  # the numbers are free again
    assert jax_cb_ckpt.all_steps(d) == [300]
    assert len([n for n in os.listdir(d) if "-damaged-" in n]) == 2


def test_a_damaged_bucket_step_is_set_aside_whole(remote):
    """The same in object storage: the step's objects are copied under the set-aside
    name, then the step is unlisted and removed; the run writes that step again."""
    _saved(remote.url, (300, 400))
    from jax_cb_ckpt._storage import _places, _remote

    storage = _places.at(remote.url)
    keys = [k for k in _remote.list_keys(f"{remote.url}/400") if "/d/" in k]
    big = max(keys, key=lambda k: len(_remote.read(f"{remote.url}/400/{k}")[0]))
    data = bytearray(_remote.read(f"{remote.url}/400/{big}")[0])
    data[len(data) // 2] ^= 1
    _remote.write(f"{remote.url}/400/{big}", bytes(data))
    with jax_cb_ckpt.Checkpointer(remote.url) as ckpt:
        with pytest.warns(DamagedStepWarning, match=r"passing over 1 newer step\(s\): step 400"):
            state, start = ckpt.restore_or_init(lambda: LIKE)
        assert start == 300 and state["w"][0] == 300
        ckpt.save({"w": np.full(1000, 401.0, np.float32)}, 400)
    assert jax_cb_ckpt.all_steps(remote.url) == [300, 400]
    [(step, name, why)] = storage.set_aside_steps()
    assert step == 400 and "-damaged-" in name and why
    moved = _remote.list_keys(f"{remote.url}/{name}")
    assert bytes(data) == _remote.read(f"{remote.url}/{name}/{big}")[0]  # kept as it was
    assert ".jax_cb_ckpt-set-aside.json" in moved


# A restart that sets step 400 aside, SIGKILLed at the instant given as argv[2]: in a
# bucket, just after our marker was rewritten to name the copy ("named"), after the
# step's commit marker was deleted ("unlisted"), or after its other objects were
# ("emptied"); "local": just after the rename of a local step (issue 53, item 3).
KILLED_SETTING_ASIDE = """
import os, signal, sys
import numpy as np
import jax_cb_ckpt
from jax_cb_ckpt._storage import _remote

def killed():
    print("killed", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)

write, delete, delete_prefix, rename = (
    _remote.write, _remote.delete, _remote.delete_prefix, os.rename
)

def written(url, data, **kwargs):
    done = write(url, data, **kwargs)
    if url.endswith("/400/.jax_cb_ckpt") and b"set_aside_as" in data:
        killed()
    return done

def deleted(url):
    delete(url)
    if url.endswith("/400/commit_success.txt"):
        killed()

def emptied(url, **kwargs):
    delete_prefix(url, **kwargs)
    if url.endswith("/400"):
        killed()

def renamed(source, target):
    rename(source, target)
    if "-damaged-" in str(target):
        killed()

if sys.argv[2] == "named":
    _remote.write = written
elif sys.argv[2] == "unlisted":
    _remote.delete = deleted
elif sys.argv[2] == "emptied":
    _remote.delete_prefix = emptied
else:
    os.rename = renamed
with jax_cb_ckpt.Checkpointer(sys.argv[1]) as ckpt:
    ckpt.restore_or_init(lambda: {"w": np.zeros(1000, np.float32)})
print("not killed", flush=True)
"""


def _corrupt_bucket_step(url, step):
    from jax_cb_ckpt._storage import _remote

    keys = [k for k in _remote.list_keys(f"{url}/{step}") if "/d/" in k]
    big = max(keys, key=lambda k: len(_remote.read(f"{url}/{step}/{k}")[0]))
    data = bytearray(_remote.read(f"{url}/{step}/{big}")[0])
    data[len(data) // 2] ^= 1
    _remote.write(f"{url}/{step}/{big}", bytes(data))
    return big, bytes(data)


def _restart_killed_setting_aside(tmp_path, directory, where, env=None):
    from helpers import kill_group, start_script

    child = start_script(tmp_path, KILLED_SETTING_ASIDE, directory, where, env=env)
    out, err = child.communicate(timeout=240)
    kill_group(child)
    assert child.returncode == -9 and out.strip() == "killed", err[-3000:]


@pytest.mark.parametrize(
    "remote, point",
    [
        ("gs", "unlisted"),
        ("s3", "unlisted"),
        ("gcp-storage-emulator", "unlisted"),
        ("s3", "named"),
        ("gs", "emptied"),
    ],
    indirect=["remote"],
)
def test_a_restart_killed_while_setting_a_bucket_step_aside_is_finished_by_the_next(
    remote, point, tmp_path
):
    """Killed just after the set-aside deleted the step's commit marker: every later
    run resumed from the step before, then failed `SaveError: ... '.../400' already exists
    and is not a checkpoint`, with a ForeignStepWarning calling the half-moved step "a
    step copied there" (a crash loop only a hand edit ended). Now our marker names the
    whole copy before the step is unlisted: the next opening (or, killed before the
    step was unlisted, the next restart, which reuses the copy) finishes the move, the
    run writes step 400 again, and the damaged step is kept, set aside, with its note."""
    from jax_cb_ckpt._storage import _places, _remote

    url = remote.url
    _saved(url, (300, 400))
    big, data = _corrupt_bucket_step(url, 400)
    _restart_killed_setting_aside(tmp_path, url, point, env=remote.env)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with jax_cb_ckpt.Checkpointer(url) as ckpt:
            state, start = ckpt.restore_or_init(lambda: LIKE)
            assert start == 300 and state["w"][0] == 300
            ckpt.save({"w": np.full(1000, 401.0, np.float32)}, 400)
    ours = [str(w.message) for w in seen if issubclass(w.category, jax_cb_ckpt.CheckpointWarning)]
    if point == "named":  # still listed, and damaged: passed over again, its copy reused
        [said] = ours
        assert "step 400: " in said and "(set aside as '400.jax_cb_ckpt-damaged-" in said
    else:
        assert ours == [], ours
    assert jax_cb_ckpt.all_steps(url) == [300, 400]
    assert jax_cb_ckpt.restore(url, LIKE)["w"][0] == 401
    [(step, name, why)] = _places.at(url).set_aside_steps()
    assert step == 400 and "checksum" in why
    assert _remote.read(f"{url}/{name}/{big}")[0] == data  # kept as it was


def test_a_restart_killed_while_setting_a_local_step_aside_leaves_its_reason(tmp_path):
    """Killed just after the rename: the note saying why was written after it, so the
    folder set aside had none ("no reason recorded"); now it is written first."""
    d = tmp_path / "ckpt"
    _saved(d, (300, 400))
    _flip_step(d, 400)
    _restart_killed_setting_aside(tmp_path, d, "local")
    from jax_cb_ckpt._storage import _places

    [(step, name, why)] = _places.at(str(d)).set_aside_steps()
    assert step == 400 and "checksum" in why, why
    with jax_cb_ckpt.Checkpointer(d) as ckpt:
        assert ckpt.restore_or_init(lambda: LIKE)[1] == 300
        ckpt.save({"w": np.full(1000, 401.0, np.float32)}, 400)
    assert jax_cb_ckpt.all_steps(d) == [300, 400]


# -- item 2: a loop whose counter restarts -----------------------------------------------


@pytest.mark.slow
def test_a_counter_that_restarts_after_a_resume_is_named(tmp_path):
    """The README's first example with restore_or_init added: the resumed run's scan
    index starts at 0 again. It failed with "already holds step(s) ... resume from the
    latest step", after the user had just resumed; now the error says so, and the fix."""
    d = tmp_path / "run"
    _killed("scan_restarting", d, 22)
    code, _, err = _worker("scan_restarting", d)
    assert code == 1, err[-2000:]
    assert "StepExistsError: saving step 5 " in err, err[-3000:]
    assert "resumed from step 20" in err and "counter started again" in err
    assert "start + i + 1" in err and "fori_loop(start, num_updates" in err


def test_the_restart_message_in_process(make_ckpt):
    ckpt = make_ckpt(every=1)
    ckpt.save(state_at(5), 5)
    ckpt.wait()
    state, start = ckpt.restore_or_init(lambda: state_at(0))
    assert start == 5
    try:  # on a CPU the call raises the callback's error, wrapped; on an accelerator a
        # program with no outputs may fail after the call returned (the H200 run)
        jax.jit(lambda s: ckpt.save(s, 3))(state)
    except jax.errors.JaxRuntimeError as e:
        assert "StepExistsError" in str(e)
    with pytest.raises(StepExistsError, match=r"resumed from step 5.*step 3 is not after it"):
        ckpt.wait()  # ours, with its text, on every backend


@pytest.mark.slow
def test_the_resumable_form_resumes_bit_for_bit(tmp_path, uninterrupted):
    """The form the README shows next to its first example (fori_loop from the step
    restore_or_init returns, saving i + 1): killed and run again, as if never killed."""
    d = tmp_path / "run"
    _killed("loop", d, 27)
    code, line, err = _worker("loop", d)
    assert code == 0 and line["start"] == 25, err[-2000:]
    assert line["digest"] == uninterrupted("loop")


# -- item 3: plain Orbax checkpoints ------------------------------------------------------


@pytest.mark.slow
def test_a_plain_orbax_directory_is_resumed_from(tmp_path, uninterrupted):
    """A run that saved with Orbax's CheckpointManager until step 20, then switched: it
    restarted at 0 with no warning. Now it resumes from 20 (said, unverified), saves its
    own steps beside Orbax's without touching them, and ends as a run that never
    switched."""
    d = tmp_path / "run"
    before = run_child(["python", WORKER, "orbax_run", d], timeout=240)
    assert json_lines(before.stdout)[-1]["orbax_steps"] == [5, 10, 15, 20], before.stderr
    orbax_files = {p: (d / p).read_bytes() for p in _files(d)}
    _killed("orbax", d, 32)
    code, line, err = _worker("orbax", d)
    assert code == 0 and line["start"] == 30, err[-2000:]
    assert line["digest"] == uninterrupted("orbax")
    assert {p: (d / p).read_bytes() for p in orbax_files} == orbax_files  # untouched
    assert jax_cb_ckpt.all_steps(d) == [5, 10, 15, 20, 25, 30, 35, 40]  # Orbax's, then ours


def _files(directory):
    return sorted(
        os.path.relpath(os.path.join(root, f), directory)
        for root, _, files in os.walk(directory)
        for f in files
    )


# -- item 4: a weakly typed leaf of the initial state -------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("option", ["", "run"])
def test_a_python_number_in_the_initial_state_resumes(tmp_path, uninterrupted, option):
    """gymnax's LogWrapper starts `episode_returns` as a Python 0: the loop carries it as
    float32, and the resume refused the checkpoint ("the checkpoint has float32[], like
    has int32[]"); `run` refused the state at once without naming the leaf."""
    d = tmp_path / "run"
    _killed("weak", d, 22, option)
    code, line, err = _worker("weak", d, option=option)
    assert code == 0, err[-3000:]
    assert line["digest"] == uninterrupted("weak", option)


def test_run_names_the_leaf_and_both_dtypes(make_ckpt):
    ckpt = make_ckpt(every=2)
    with pytest.raises(jax_cb_ckpt.ConfigError, match=r"leaf init\['n'\] is int32\[\] in init "):
        ckpt.run(lambda s, i: {"n": s["n"] + 0.5}, {"n": jnp.int32(0)}, 4)


def test_a_weak_like_restores_as_stored_and_real_mismatches_are_refused(make_ckpt):
    ckpt = make_ckpt()
    ckpt.save({"ret": jnp.float32(1.5)}, 1)
    ckpt.wait()
    weak = jax.eval_shape(jax.jit(lambda: {"ret": 0}))
    restored = jax_cb_ckpt.restore(ckpt.directory, weak)
    assert restored["ret"].dtype == jnp.float32 and restored["ret"] == 1.5
    strong = {"ret": jax.ShapeDtypeStruct((), jnp.int32)}
    with pytest.raises(jax_cb_ckpt.StructureMismatchError, match="float32"):
        jax_cb_ckpt.restore(ckpt.directory, strong)
    weak_float = jax.eval_shape(jax.jit(lambda: {"ret": 0.0}))
    ckpt.save({"ret": jnp.int32(2)}, 2)
    ckpt.wait()
    with pytest.raises(jax_cb_ckpt.StructureMismatchError):  # a float never becomes int32
        jax_cb_ckpt.restore(ckpt.directory, weak_float, step=2)


# -- item 5: the final state of a loop of one's own ----------------------------------------


@pytest.mark.slow
def test_last_step_saves_the_final_state_of_a_loop_of_ones_own(tmp_path, uninterrupted):
    """Saves by the clock alone never saved the final state (the newest step was an
    older one, silently). With last_step=N the last step is saved, across a kill."""
    d = tmp_path / "run"
    _killed("clock", d, 22)
    assert jax_cb_ckpt.all_steps(d) == [0]  # (initial_save; the clock saved nothing)
    code, line, err = _worker("clock", d)
    assert code == 0 and line["start"] == 0, err[-2000:]
    assert line["latest"] == 40 and line["digest"] == uninterrupted("clock")
    like = {"w": np.zeros(1000, np.float32), "key": jax.random.key(0)}
    final = jax_cb_ckpt.restore(d, like)
    assert line["digest"] == _digest(final)


def _digest(state):
    import restart_worker

    return restart_worker.digest(state)


@pytest.mark.slow
def test_close_says_when_the_loop_went_past_its_newest_checkpoint(tmp_path):
    code, line, err = _worker("clock", tmp_path / "run", option="unsaid")
    assert code == 0 and line["latest"] == 0, err
    assert "CheckpointWarning: close: the loop reached step 40" in err, err[-2000:]
    assert "last_step=num_steps" in err


def test_close_is_quiet_when_the_newest_step_was_written_before_a_lower_one(make_ckpt):
    """Issue 54: one program's saves may reach the host in any order; close() compared
    the clock's last step with the step written *last* and said the final state was not
    on disk when step 4 was written before step 3. It compares with the highest step
    written. (Step 3's state takes longer to compute: on XLA:CPU it arrives second.)"""
    ckpt = make_ckpt(every_seconds=1e-6, check_every=1)

    @jax.jit
    def one_program(x, i):
        y = x
        for _ in range(3):
            y = jnp.tanh(y @ jnp.ones((64, 64)))
        ckpt.maybe_save({"x": y}, i + 3)
        ckpt.maybe_save({"x": x}, i + 4)

    one_program(jnp.zeros((64, 64)), jnp.int32(0))
    ckpt.wait()
    arrived = [r.step for r in ckpt.stats.recent]
    assert arrived == [4, 3], f"the premise: step 4 reached the host first ({arrived})"
    ckpt.close()  # no CheckpointWarning (warnings are errors in the tests)
    assert ckpt.all_steps() == [3, 4]


def test_last_step_in_python_and_traced(make_ckpt):
    ckpt = make_ckpt(every=100)
    ckpt.maybe_save(state_at(7), 7, last_step=7)  # decided in Python
    jax.jit(lambda s, i: ckpt.maybe_save(s, i, last_step=9))(state_at(9), jnp.int32(9))
    jax.jit(lambda s, i: ckpt.maybe_save(s, i, last_step=9))(state_at(8), jnp.int32(8))
    ckpt.wait()
    assert ckpt.all_steps() == [7, 9]


# -- item 6: vmap of a while_loop whose members stop at different steps -----------------


@pytest.mark.slow
def test_members_of_a_vmapped_while_loop_resume_each_from_their_own_step(tmp_path, uninterrupted):
    """Member 0 stops at step 5, the others later; the step-10 checkpoint held member 0
    after a 6th iteration it never made (the body runs on for finished members). Now
    the step records each member's own step, the restart resumes member 0 from step 5
    (the newest it asked for), and every member ends as in the uninterrupted run."""
    d = tmp_path / "run"
    _killed("while", d, 12)
    meta = jax_cb_ckpt.metadata(d, step=10)
    assert meta["members"] == [False, True, True, True]
    assert meta["member_steps"] == [6, 10, 10, 10]
    code, line, err = _worker("while", d)
    assert code == 0 and line["start"] == [5, 10, 10, 10], err[-2000:]
    assert line["digest"] == uninterrupted("while")


def test_retention_keeps_each_members_newest_step(make_ckpt):
    """max_to_keep=1 deleted step 5, member 0's only state of its own."""
    ckpt = make_ckpt(every=5, max_to_keep=1)
    while_batch(ckpt, [5, 10, 15])
    assert ckpt.all_steps() == [5, 10, 15]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        state, start = ckpt.restore_or_init(lambda: jnp.zeros(3))
    assert np.asarray(start).tolist() == [5, 10, 15]
    assert np.asarray(state).tolist() == [5.0, 10.0, 15.0]


# -- item 7: what a restart says -----------------------------------------------------------


def test_a_restart_says_where_it_resumed_from_in_one_info_line(make_ckpt, caplog):
    ckpt = make_ckpt(every=1)
    ckpt.save(state_at(5), 5)
    ckpt.wait()
    caplog.set_level(logging.INFO, logger="jax_cb_ckpt")
    ckpt.restore_or_init(lambda: state_at(0))
    lines = [r.getMessage() for r in caplog.records if "resumed" in r.getMessage()]
    assert lines == [
        f"restore_or_init: resumed from step 5 of {ckpt.directory} (the newest step that "
        "passes its checks)"
    ]


def test_saves_are_summed_up_at_info_and_every_one_is_at_debug(make_ckpt, caplog):
    caplog.set_level(logging.DEBUG, logger="jax_cb_ckpt")
    ckpt = make_ckpt(max_to_keep=2)
    for step in range(1, 31):
        ckpt.save(state_at(step), step, metrics={"loss": 1.0 / step})
    ckpt.close()
    info = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    debug = [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG]
    assert len([m for m in debug if m.startswith("saved step")]) == 30
    assert len([m for m in debug if "deleted" in m]) == 28
    assert info[0].startswith("saved step 1 (") and "loss=1)" in info[0], info
    # One line per 10 s at most after the first (this run: one more, at close), each
    # saying how many saves it sums up, the newest with its metrics, and the deletions.
    counted = sum(
        1 if m.startswith("saved step") else int(m.split()[1]) for m in info if "saved" in m
    )
    assert counted == 30 and len(info) < 10, info
    assert "the newest step 30 (" in info[-1] and "loss=0.0333333" in info[-1], info
    assert "retention deleted step(s)" in info[-1] and "28 (" in info[-1], info


class _Pair(typing.NamedTuple):
    a: np.ndarray
    b: int


def _orbax_saved(directory, tree, *, composite=True, extra=None):
    import orbax.checkpoint as ocp

    with ocp.CheckpointManager(directory) as manager:
        if composite:
            items = {"state": ocp.args.StandardSave(tree)}
            if extra is not None:
                items |= {"metadata": ocp.args.JsonSave(extra)}
            manager.save(7, args=ocp.args.Composite(**items))
        else:
            manager.save(7, args=ocp.args.PyTreeSave(tree))
        manager.wait_until_finished()


@pytest.mark.parametrize("composite", [True, False])
def test_plain_orbax_layouts_restore_into_likes_types(tmp_path, composite):
    """`Composite(state=StandardSave)` with a JSON item beside it, and a single
    `PyTreeSave` item ('default'): a NamedTuple's fields, a Python int, a typed key's
    raw data, restored into like's types."""
    d = tmp_path / "plain"
    key = jax.random.key(3)
    saved = {"pair": {"a": np.arange(3.0, dtype=np.float32), "b": 4}, "key": key}
    _orbax_saved(d, saved, composite=composite, extra={"note": 1})
    like = {"pair": _Pair(np.zeros(3, np.float32), 0), "key": jax.random.key(0)}
    restored = jax_cb_ckpt.restore(d, like)
    assert isinstance(restored["pair"], _Pair) and restored["pair"].b == 4
    assert type(restored["pair"].b) is int
    np.testing.assert_array_equal(restored["pair"].a, np.arange(3.0))
    assert jax_cb_ckpt.same_bits(restored["key"], key)


@pytest.mark.parametrize(
    "like, words",
    [
        ({"w": np.zeros(3, np.int32)}, r"leaf like\['w'\] differs: the step holds float32\[3\]"),
        ({"w": np.zeros(4, np.float32)}, r"holds float32\[3\], like has float32\[4\]"),
        ({"v": np.zeros(3, np.float32)}, r"leaf like\['v'\] .* is not in it"),
        ({"w": np.zeros(3, np.float32), "x": 1}, r"leaf like\['x'\]"),
    ],
)
def test_plain_orbax_mismatches_are_refused_not_cast(tmp_path, like, words):
    """Orbax casts float32 into an int32 target (0.7 -> 0) and checks no shape for a
    numpy one: neither reaches like."""
    d = tmp_path / "plain"
    _orbax_saved(d, {"w": np.full(3, 0.7, np.float32)})
    with pytest.raises(jax_cb_ckpt.StructureMismatchError, match=words):
        jax_cb_ckpt.restore(d, like)


def test_a_plain_orbax_step_that_cannot_be_resumed_from_is_named(tmp_path):
    """Two pytree items, neither 'state' nor 'default': which is the state is not
    known; the restart names it and starts afresh (never silently)."""
    import orbax.checkpoint as ocp

    d = tmp_path / "plain"
    with ocp.CheckpointManager(d) as manager:
        manager.save(
            3,
            args=ocp.args.Composite(
                one=ocp.args.StandardSave({"w": np.ones(2)}),
                two=ocp.args.StandardSave({"w": np.ones(2)}),
            ),
        )
    with jax_cb_ckpt.Checkpointer(d) as ckpt:
        with pytest.warns(DamagedStepWarning, match=r"step 3: .*several pytree items"):
            state, start = ckpt.restore_or_init(lambda: {"w": np.zeros(2)})
    assert start == 0


def test_restore_or_init_with_like_gives_a_fresh_start_the_loop_s_dtypes(make_ckpt):
    """A Python number in init: with like= the loop's dtypes, the fresh state has them
    too (one signature for a fresh and a resumed run); a real mismatch stays as it is."""
    ckpt = make_ckpt()

    def init():
        return {"ret": 0, "n": 0, "w": jnp.zeros(2)}

    like = {
        "ret": jax.ShapeDtypeStruct((), jnp.float32),
        "n": jax.ShapeDtypeStruct((), jnp.int32),
        "w": jax.ShapeDtypeStruct((2,), jnp.float32),
    }
    state, start = ckpt.restore_or_init(jax.jit(init), like=like)
    assert start == 0 and state["ret"].dtype == jnp.float32 and not state["ret"].weak_type
    assert not state["n"].weak_type  # like (the loop) has it strongly typed
    ckpt.save(state, 1)
    ckpt.wait()
    resumed, start = ckpt.restore_or_init(jax.jit(init), like=like)
    assert start == 1
    assert jax.tree.map(lambda x: (x.dtype, x.weak_type), resumed) == jax.tree.map(
        lambda x: (x.dtype, x.weak_type), state
    )


# -- what an adversarial pass found (issue 41), each seen failing before its fix --------


def test_damage_in_a_members_older_step_does_not_pass_over_the_newest(make_ckpt):
    """A bit of step 5 (member 0's newest own step) flipped: the restart blamed step 10
    (intact), set both aside and started from 0. Now step 10 is read, member 0 (no
    readable step of its own) starts again from init_fn at step 0, and nothing is
    moved."""
    ckpt = make_ckpt(every=5)
    while_batch(ckpt, [5, 10, 10, 10])
    _flip_step(ckpt.directory, 5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state, start = ckpt.restore_or_init(lambda: jnp.zeros(4))
    said = " ".join(str(w.message) for w in caught)
    assert "passing over damaged ones (step 5: " in said
    assert np.asarray(start).tolist() == [0, 10, 10, 10]
    assert np.asarray(state).tolist() == [0.0, 10.0, 10.0, 10.0]
    assert sorted(n for n in os.listdir(ckpt.directory) if n[0].isdigit()) == ["10", "5"]


def test_one_member_without_step_comes_from_its_newest_own_step(make_ckpt):
    """restore(member=0) without step= refused "member (0,) did not save at step 10";
    a restart reads each member from the newest step it asked for, one member too."""
    ckpt = make_ckpt(every=5)
    while_batch(ckpt, [5, 10, 10, 10])
    one = jax.ShapeDtypeStruct((), jnp.float32)
    assert float(jax_cb_ckpt.restore(ckpt.directory, one, member=0)) == 5.0
    assert float(jax_cb_ckpt.restore(ckpt.directory, one, member=1)) == 10.0
    with pytest.raises(jax_cb_ckpt.RestoreError, match=r"member \(0,\) did not save at step 10"):
        jax_cb_ckpt.restore(ckpt.directory, one, member=0, step=10)


_UNREADABLE = """
import os, sys, warnings
import numpy as np, jax_cb_ckpt
warnings.simplefilter("error")
d, what = sys.argv[1], sys.argv[2]
with jax_cb_ckpt.Checkpointer(d) as ckpt:
    for step in (1, 2, 3):
        ckpt.save({"w": np.full(4, float(step), np.float32)}, step)
paths = {"meta": f"{d}/3/meta/metadata", "dir": f"{d}/3", "item": f"{d}/3/meta"}
os.chmod((paths | {"orbax": f"{d}/3/state/_METADATA"})[what], 0)
try:
    with jax_cb_ckpt.Checkpointer(d) as ckpt:
        ckpt.restore_or_init(lambda: {"w": np.zeros(4, np.float32)})
except jax_cb_ckpt.RestoreError as e:
    print(type(e).__name__, e)
print(sorted(os.listdir(d)))
"""


@pytest.mark.parametrize(
    "what",
    [
        pytest.param("meta", marks=pytest.mark.slow),
        "dir",
        pytest.param("item", marks=pytest.mark.slow),
        "orbax",  # Orbax's description, which a restart checks plain Orbax can read
    ],
)
def test_a_refused_permission_stops_a_restart_and_moves_nothing(tmp_path, what):
    """chmod 000 on the newest step (its folder, an item, its meta file): a restart
    set it aside as damaged, or went back to step 2 in silence. A refused permission
    is raised as it is; nothing moves. (Run without root's CAP_DAC_OVERRIDE, so that
    permissions apply.)"""
    script = tmp_path / "unreadable.py"
    script.write_text(_UNREADABLE)
    drop = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search"]
    if run_child(drop + ["true"]).returncode != 0:
        pytest.skip("setpriv cannot drop capabilities here")
    result = run_child(drop + [sys.executable, script, tmp_path / "d", what])
    assert result.returncode == 0, result.stderr[-2000:]
    printed = result.stdout
    assert "RestoreError" in printed and "step 3" in printed and "cannot be read" in printed, (
        printed
    )
    assert "'1', '2', '3']" in printed and "damaged" not in printed.splitlines()[-1]


def test_a_plain_orbax_step_counts_as_another_runs_step(tmp_path):
    """Orbax saved step 30; a Checkpointer that did not resume saved step 20, and the
    next restart took Orbax's 30, dropping 20. A save at or below it is refused."""
    d = tmp_path / "mixed"
    _orbax_saved(d, {"w": np.zeros(3, np.float32)}, composite=False)  # (step 7)
    with jax_cb_ckpt.Checkpointer(d) as ckpt:
        with pytest.raises(StepExistsError, match=r"step\(s\) 7 >= 5"):
            ckpt.save({"w": np.ones(3, np.float32)}, 5)
    with jax_cb_ckpt.Checkpointer(d) as ckpt:
        ckpt.save({"w": np.ones(3, np.float32)}, 8)  # after it: fine
    assert jax_cb_ckpt.all_steps(d) == [7, 8]  # (Orbax's step listed beside ours)


def test_a_step_renamed_back_after_being_set_aside_is_set_aside_again_and_said(tmp_path):
    """The note of an earlier set-aside was in the way: the step was moved, and the
    warning said it "stays where it is"."""
    d = tmp_path / "ckpt"
    _saved(d, (300, 400))
    _flip_step(d, 400)
    for _ in range(2):
        with jax_cb_ckpt.Checkpointer(d) as ckpt:
            with pytest.warns(DamagedStepWarning, match=r"step 400: .*\(set aside as "):
                ckpt.restore_or_init(lambda: LIKE)
        [aside] = [n for n in os.listdir(d) if "-damaged-" in n]
        os.rename(d / aside, d / "400")  # "renamed back by the user"
    assert "400" in os.listdir(d)


def test_ls_shows_which_folders_are_plain_orbax_steps_a_restart_reads(tmp_path):
    d = tmp_path / "plain"
    _orbax_saved(d, {"w": np.zeros(3, np.float32)})
    ls = run_child([SCRIPT, "ls", d], timeout=120)
    assert "a plain Orbax step: a restart resumes from it (unverified)" in ls.stdout, ls.stdout
    os.remove(d / "7" / "_CHECKPOINT_METADATA")  # an Orbax step without its step file
    restored = jax_cb_ckpt.restore(d, {"w": np.zeros(3, np.float32)})  # still read
    np.testing.assert_array_equal(restored["w"], 0.0)


def test_a_restart_s_errors_name_the_call_that_was_made(tmp_path):
    """restore_or_init takes no step: its messages name the step read as such, not as
    an argument ("restore_or_init(step=300)" read as if the user had passed one)."""
    d = tmp_path / "ckpt"
    _saved(d, (300,))
    with jax_cb_ckpt.Checkpointer(d) as ckpt:
        with pytest.raises(
            jax_cb_ckpt.StructureMismatchError, match=r"^restore_or_init: step 300 of '.*': leaf"
        ):
            ckpt.restore_or_init(lambda: {"w": np.zeros(9, np.float32)})


def test_restore_or_init_names_itself_when_init_fn_returns_no_arrays(tmp_path):
    """An init_fn whose state holds a string failed with JAX's bare TypeError from
    jax.eval_shape, naming neither restore_or_init nor init_fn."""
    d = tmp_path / "ckpt"
    _saved(d, (300,))
    with jax_cb_ckpt.Checkpointer(d) as ckpt:
        with pytest.raises(jax_cb_ckpt.InvalidStateError, match=r"^restore_or_init: init_fn"):
            ckpt.restore_or_init(lambda: {"w": "not an array"})


def test_restore_of_a_step_set_aside_names_where_it_went(tmp_path):
    """After a restart set step 400 aside, restore(step=400) answered "the steps there
    are [300]" without naming the folder it went to; now it names it, and why."""
    d = tmp_path / "ckpt"
    _saved(d, (300, 400))
    _flip_step(d, 400)
    with jax_cb_ckpt.Checkpointer(d) as ckpt:
        with pytest.warns(DamagedStepWarning):
            ckpt.restore_or_init(lambda: LIKE)
    [aside] = [n for n in os.listdir(d) if "-damaged-" in n]
    with pytest.raises(jax_cb_ckpt.NoCheckpointError) as raised:
        jax_cb_ckpt.restore(d, LIKE, step=400)
    text = str(raised.value)
    assert "the steps there are [300]" in text
    assert f"set it aside as '{aside}'" in text and "checksum" in text, text
