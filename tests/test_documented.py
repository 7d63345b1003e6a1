"""Promises of the docs that had no test of their own when the promise table
(docs/promises.md) was built (issue 42): each test here is named in the table's row of
the promise it holds. Grouped by the page the promise is on."""

import json
import logging
import os
import signal
import socket
import sys
import time
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    kill_group,
    run_child,
    run_script,
    start_process,
    state_at,
    wait_for_step,
    while_batch,
)

import jax_cb_ckpt
from jax_cb_ckpt import ConfigError
from jax_cb_ckpt._handoff import _stats
from jax_cb_ckpt._save import _route
from jax_cb_ckpt._storage import _remote

CLI = Path(sys.executable).with_name("jax-cb-ckpt")
HERE = os.path.dirname(os.path.abspath(__file__))


# -- usage.md ------------------------------------------------------------------------------


def test_a_python_int_step_or_bool_when_adds_no_cond_to_the_program(make_ckpt):
    """A step (or `when=`) Python knows is decided in Python: the compiled program of a
    save that is due has no conditional, and one that is not due crosses nothing."""
    ckpt = make_ckpt(every=5)

    def hlo(fn):
        return jax.jit(fn).lower(jnp.zeros(3)).compile().as_text()

    due = hlo(lambda s: (ckpt.maybe_save(s, 10), s)[1])
    told = hlo(lambda s: (ckpt.maybe_save(s, 7, when=True), s)[1])
    traced = hlo(lambda s: (ckpt.maybe_save(s, jnp.int32(10) + jnp.int32(s[0])), s)[1])
    assert "conditional" not in due and "conditional" not in told
    assert "conditional" in traced  # (the same save with a traced step has one)
    jax.jit(lambda s: ckpt.maybe_save(s, 7))(jnp.zeros(3))  # not due: nothing crosses
    jax.jit(lambda s: ckpt.maybe_save(s, 10))(jnp.zeros(3))
    ckpt.wait()
    assert ckpt.all_steps() == [10] and ckpt.stats.crossings == 1


def test_save_due_is_the_clock_query_for_a_loop_of_ones_own(make_ckpt):
    """`ckpt.save_due(step)`: True once every_seconds have passed since the last save
    (here a tiny interval: every time it is asked), False before (an hour)."""
    quick = make_ckpt(every_seconds=1e-6)
    slow = make_ckpt(quick.directory + "-slow", every_seconds=3600)

    def loop(ckpt):
        def body(i, s):
            due = jax.lax.cond(i % 5 == 0, ckpt.save_due, lambda j: False, i)
            ckpt.maybe_save(s, i, when=due)
            return s + 1.0

        return jax.jit(lambda s: jax.lax.fori_loop(1, 21, body, s))

    loop(quick)(jnp.zeros(2))
    loop(slow)(jnp.zeros(2))
    quick.wait()
    slow.wait()
    assert quick.all_steps() == [5, 10, 15, 20] and slow.all_steps() == []


def test_a_bare_scalar_metric_is_named_value(make_ckpt, ckpt_dir):
    ckpt = make_ckpt()
    ckpt.save({"w": np.zeros(2)}, 1, metrics=jnp.float32(0.5))
    jax.jit(lambda s: ckpt.save(s, 2, metrics=jnp.float32(0.25)))({"w": np.zeros(2)})
    ckpt.wait()
    assert jax_cb_ckpt.metrics(ckpt_dir, step=1) == {"value": 0.5}
    assert jax_cb_ckpt.metrics(ckpt_dir, step=2) == {"value": 0.25}


def test_integer_metrics_above_2_53_rank_as_float64(make_ckpt):
    """keep_best ranks as float64: 2**53 + 1 and 2**53 + 2 are one value there, a tie,
    and the step saved first keeps its place."""
    ckpt = make_ckpt(keep_best=1, best="n")
    ckpt.save({"w": np.zeros(2)}, 1, metrics={"n": 2**53})
    ckpt.save({"w": np.zeros(2)}, 2, metrics={"n": 2**53 + 1})  # the same float64
    ckpt.save({"w": np.zeros(2)}, 3, metrics={"n": 0})
    ckpt.wait()
    assert ckpt.all_steps() == [1, 3] and ckpt.best_step() == 1


def test_metrics_are_refused_in_a_multi_process_run():
    """The route of a save (`_route.plan`) in a run of 2 processes refuses metrics=
    with a ConfigError that says why (each process would record its own)."""
    request = _route.Request({"w": jnp.zeros(2)}, 1, 1, None, None, "stack", None, 1.0)
    with pytest.raises(ConfigError, match=r"metrics are not recorded in a multi-process run"):
        _route.plan(request, processes=2)


def test_low_bit_dtypes_are_what_plain_orbax_sees(make_ckpt, ckpt_dir):
    """What TensorStore cannot store reaches plain Orbax widened exactly (uint2 and
    uint4 as uint8, float6 as float32) or as its bits (float8_e4m3 as uint8); restore
    gives every dtype back."""
    import ml_dtypes
    import orbax.checkpoint as ocp

    state = {
        "u2": np.arange(4).astype(ml_dtypes.uint2),
        "u4": np.arange(8).astype(ml_dtypes.uint4),
        "f6": np.linspace(-2, 2, 8).astype(ml_dtypes.float6_e2m3fn),
        "f8": np.linspace(-2, 2, 8).astype(ml_dtypes.float8_e4m3),
    }
    ckpt = make_ckpt()
    ckpt.save(state, 1)
    ckpt.wait()
    plain = ocp.PyTreeCheckpointer().restore(ckpt_dir / "1" / "state")
    for name, n in (("u2", 4), ("u4", 8)):
        assert np.asarray(plain[name]).dtype == np.uint8
        np.testing.assert_array_equal(np.asarray(plain[name]), np.arange(n))
    assert np.asarray(plain["f6"]).dtype == np.float32
    np.testing.assert_array_equal(np.asarray(plain["f6"]), state["f6"].astype(np.float32))
    assert np.asarray(plain["f8"]).dtype == np.uint8
    np.testing.assert_array_equal(np.asarray(plain["f8"]), state["f8"].view(np.uint8))
    restored = ckpt.restore(state)
    assert {k: v.dtype for k, v in restored.items()} == {k: v.dtype for k, v in state.items()}
    assert jax_cb_ckpt.same_bits(restored, state)


def test_the_lock_file_names_its_holder_while_held_and_is_empty_after(ckpt_dir):
    ckpt = jax_cb_ckpt.Checkpointer(ckpt_dir)
    held = (ckpt_dir / ".jax_cb_ckpt.lock").read_text()
    assert str(os.getpid()) in held and socket.gethostname() in held, held
    assert str(time.gmtime().tm_year) in held, held  # (the start time)
    ckpt.close()
    assert (ckpt_dir / ".jax_cb_ckpt.lock").read_text() == ""


_SYNCED = """
import sys, jax_cb_ckpt, numpy as np
with jax_cb_ckpt.Checkpointer(sys.argv[1], max_to_keep=5) as ckpt:
    ckpt.save({"w": np.ones(1 << 16, np.float32)}, 7)
    ckpt.wait()
    print("waited", flush=True)
"""


@pytest.mark.slow
def test_a_step_is_synced_before_it_is_renamed_and_the_directory_after(tmp_path):
    """When wait() returns the step survives a crash: its files reached the disk (a
    syncfs of their file system, or an fsync of each) before the rename that lists it,
    and the directory was fsynced after the rename. Traced with strace in a child."""
    if run_child(["strace", "-V"]).returncode != 0:
        pytest.skip("strace is not installed")
    script = tmp_path / "synced.py"
    script.write_text(_SYNCED)
    log = tmp_path / "trace"
    directory = tmp_path / "ckpt"
    result = run_child(
        [
            "strace",
            "-f",
            "-qq",
            "-e",
            "trace=fsync,fdatasync,syncfs,rename,renameat,renameat2",
            "-o",
            log,
            sys.executable,
            script,
            directory,
        ],
        timeout=240,
    )
    assert result.returncode == 0 and "waited" in result.stdout, result.stderr[-2000:]
    calls = [line.split(None, 1)[1] for line in log.read_text().splitlines() if " " in line]
    renamed = [i for i, c in enumerate(calls) if "rename" in c and f'{directory}/7"' in c]
    assert renamed, calls
    before, after = calls[: renamed[0]], calls[renamed[0] + 1 :]
    assert any(c.startswith(("syncfs", "fsync", "fdatasync")) for c in before), calls
    assert any(c.startswith("fsync") for c in after), calls


def test_a_plain_orbax_step_is_said_unverified_when_resumed_from(tmp_path, caplog):
    import logging

    import orbax.checkpoint as ocp

    d = tmp_path / "plain"
    with ocp.CheckpointManager(d) as manager:
        manager.save(4, args=ocp.args.StandardSave({"w": np.ones(2, np.float32)}))
    caplog.set_level(logging.INFO, logger="jax_cb_ckpt")
    with jax_cb_ckpt.Checkpointer(d) as ckpt:
        state, start = ckpt.restore_or_init(lambda: {"w": np.zeros(2, np.float32)})
    assert start == 4
    lines = [r.getMessage() for r in caplog.records if "resumed" in r.getMessage()]
    assert len(lines) == 1 and "a plain Orbax checkpoint, read unverified" in lines[0], lines


def test_stats_keep_the_last_1024_saves():
    recorder = _stats.StatsRecorder()
    for step in range(1100):
        recorder.written(_stats.SaveRecord(step, 8, 0.0, 0.0, 0.0, 0.0, 0.0))
    recent = recorder.snapshot().recent
    assert len(recent) == 1024 and recent[0].step == 1100 - 1024 and recent[-1].step == 1099


_UNCLOSED_FAILING = """
import os, sys, jax_cb_ckpt, numpy as np
d = sys.argv[1]
os.makedirs(os.path.join(d, "5"))  # a user's folder where the step goes
CKPT = jax_cb_ckpt.Checkpointer(d)  # never closed
CKPT.save({"w": np.zeros(2)}, 5)
print("exiting", flush=True)
"""


@pytest.mark.slow
def test_a_write_that_fails_at_exit_is_reported_as_a_warning(tmp_path):
    result = run_script(tmp_path, _UNCLOSED_FAILING, tmp_path / "ckpt")
    assert result.returncode == 0 and "exiting" in result.stdout, result.stderr[-2000:]
    assert "SaveFailedWarning" in result.stderr and "saving step 5" in result.stderr, result.stderr[
        -2000:
    ]


# -- resume.md ------------------------------------------------------------------------------


def test_should_stop_reads_the_stop_request_in_a_loop_of_ones_own(make_ckpt):
    ckpt = make_ckpt()

    def loop(state):
        def cond(c):
            i, _, stop = c
            return (i < 1000) & ~stop

        def body(c):
            i, s, _ = c
            stop = jax.lax.cond(i % 10 == 0, ckpt.should_stop, lambda j: False, i)
            return i + 1, s + 1.0, stop

        return jax.lax.while_loop(cond, body, (0, state, False))

    run = jax.jit(loop)
    assert int(run(jnp.zeros(2))[0]) == 1000  # no request: to the end
    ckpt.request_stop()
    assert int(run(jnp.zeros(2))[0]) == 1  # stopped at the first check


@pytest.mark.slow
def test_sigquit_quits_at_once_without_saving(tmp_path):
    directory = tmp_path / "ckpt"
    child = start_process(
        [sys.executable, os.path.join(HERE, "crash_worker.py"), directory], ready="started"
    )
    try:
        wait_for_step(directory, 5, child)
        child.send_signal(signal.SIGQUIT)
        child.wait(timeout=30)
    finally:
        out, err = kill_group(child)
    assert child.returncode == -signal.SIGQUIT, (child.returncode, err[-2000:])
    assert "Preempted" not in err and "KeyboardInterrupt" not in err


# -- transforms.md --------------------------------------------------------------------------


def test_a_step_handed_over_again_by_one_crossing_is_dropped_counted_and_said(make_ckpt, ckpt_dir):
    """What a remat recomputation would do (JAX 0.10 does not recompute the crossing:
    tests/test_transforms.py), with either crossing: the same crossing hands the same
    step over again; the first save is kept, the repeat dropped, counted, and said."""
    for crossing in ("callback", "buffer"):
        ckpt = make_ckpt(ckpt_dir / crossing, crossing=crossing)
        save = jax.jit(lambda s, ckpt=ckpt: ckpt.save(s, 5))
        save(jnp.zeros(2))
        save(jnp.ones(2))
        with pytest.warns(jax_cb_ckpt.DuplicateStepWarning, match=r"step 5 was handed over again"):
            ckpt.wait()
        assert ckpt.stats.duplicates == 1 and ckpt.all_steps() == [5]
        assert float(ckpt.restore(jnp.zeros(2))[0]) == 0.0  # the first


def test_axis_name_over_some_of_a_shard_map_s_axes_saves_per_group(make_ckpt):
    """shard_map over a 2x2 mesh ('a', 'b'), maybe_save(axis_name='a'): each group of
    devices along 'b' gathers its state along 'a' and hands it over at index 0 of 'a';
    the first group's is written, the others' are repeats of the same step: dropped,
    counted and said (a state split over 'b' needs every axis named, or shardings=)."""
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("a", "b"))
    ckpt = make_ckpt(every=2)

    def train(x):
        def body(x, i):
            x = x + 1.0
            ckpt.maybe_save({"x": x}, i + 1, axis_name="a", gather="concat")
            return x, None

        return jax.lax.scan(body, x, jnp.arange(4))[0]

    x = jax.device_put(jnp.zeros((4, 2)), NamedSharding(mesh, P("a", "b")))
    jax.jit(jax.shard_map(train, mesh=mesh, in_specs=P("a", "b"), out_specs=P("a", "b")))(x)
    with pytest.warns(jax_cb_ckpt.DuplicateStepWarning, match="handed over again"):
        ckpt.wait()
    assert ckpt.all_steps() == [2, 4]
    assert ckpt.stats.crossings == 2 and ckpt.stats.duplicates == 2  # 2nd group: repeats
    restored = ckpt.restore({"x": np.zeros((4, 1), np.float32)}, step=4)
    np.testing.assert_array_equal(restored["x"], np.full((4, 1), 4.0))  # a group's column


def test_a_member_that_never_asked_starts_again_from_init_fn(make_ckpt, caplog):
    """It kept what the newest step holds (a state it never had), said in a warning."""
    ckpt = make_ckpt(every=5)
    while_batch(ckpt, [3, 10])  # member 0 stops at 3
    assert ckpt.all_steps() == [5, 10]
    caplog.set_level(logging.INFO, logger="jax_cb_ckpt")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        state, start = ckpt.restore_or_init(lambda: jnp.full(2, -1.0))
    assert np.asarray(start).tolist() == [0, 10]
    assert np.asarray(state).tolist() == [-1.0, 10.0]
    said = [r.getMessage() for r in caplog.records if "resumed" in r.getMessage()]
    assert "member(s) 0 asked for no step and start again from init_fn's state" in said[0]
    with pytest.warns(jax_cb_ckpt.MemberStateWarning, match=r"member\(s\) 0 .* asked for no"):
        state = ckpt.restore(jnp.zeros(2))  # no init_fn: as stored, said
    assert np.asarray(state).tolist() == [4.0, 10.0]


# -- storage.md ----------------------------------------------------------------------------


def test_readers_take_no_lock_on_a_bucket_prefix(remote):
    with jax_cb_ckpt.Checkpointer(remote.url) as ckpt:
        ckpt.save(state_at(1), 1)
        ckpt.wait()
        lock = _remote.read(f"{remote.url}/.jax_cb_ckpt.lock")[0]
        assert jax_cb_ckpt.all_steps(remote.url) == [1]
        assert jax_cb_ckpt.metadata(remote.url)["step"] == 1
        assert jax_cb_ckpt.verify(remote.url) == [1]
        assert jax_cb_ckpt.same_bits(jax_cb_ckpt.restore(remote.url, state_at(0)), state_at(1))
        assert _remote.read(f"{remote.url}/.jax_cb_ckpt.lock")[0] == lock  # untouched
        ckpt.save(state_at(2), 2)  # the writer goes on
    assert jax_cb_ckpt.all_steps(remote.url) == [1, 2]


def test_a_bucket_deletion_cut_short_is_finished_by_the_next_opening(remote):
    """A step whose commit marker went (unlisted) and whose objects were partly deleted,
    our marker last: the next opening removes the rest; the other steps stay."""
    with jax_cb_ckpt.Checkpointer(remote.url) as ckpt:
        for step in (1, 2):
            ckpt.save(state_at(step), step)
    keys = _remote.list_keys(f"{remote.url}/1")
    _remote.delete(f"{remote.url}/1/commit_success.txt")
    for key in keys[: len(keys) // 2]:
        if key not in (".jax_cb_ckpt", "commit_success.txt"):
            _remote.delete(f"{remote.url}/1/{key}")
    assert jax_cb_ckpt.all_steps(remote.url) == [2]
    with jax_cb_ckpt.Checkpointer(remote.url):
        pass
    assert _remote.list_keys(f"{remote.url}/1") == []
    assert jax_cb_ckpt.all_steps(remote.url) == [2]


def test_tensorstore_s_low_speed_time_is_set_at_import_unless_set():
    """Set when the storage layer is imported (any Checkpointer, restore or listing),
    unless the user set it."""
    code = (
        "import os, jax_cb_ckpt; jax_cb_ckpt.all_steps('.'); "
        "print(os.environ['TENSORSTORE_CURL_LOW_SPEED_TIME_SECONDS'])"
    )
    env = {k: v for k, v in os.environ.items() if k != "TENSORSTORE_CURL_LOW_SPEED_TIME_SECONDS"}
    unset = run_child(["python", "-c", code], env={}, timeout=120)
    assert unset.returncode == 0, unset.stderr
    preset = run_child(
        ["python", "-c", code], env={"TENSORSTORE_CURL_LOW_SPEED_TIME_SECONDS": "20"}
    )
    assert preset.stdout.strip() == "20", preset
    if "TENSORSTORE_CURL_LOW_SPEED_TIME_SECONDS" not in env:
        assert unset.stdout.strip() == "6", unset


def test_resaving_another_run_s_bucket_step_is_refused(remote):
    with jax_cb_ckpt.Checkpointer(remote.url) as ckpt:
        for step in (1, 2, 3):
            ckpt.save(state_at(step), step)
    before = {
        k: _remote.read(f"{remote.url}/2/{k}")[0] for k in _remote.list_keys(f"{remote.url}/2")
    }
    with jax_cb_ckpt.Checkpointer(remote.url) as ckpt:
        with pytest.raises(jax_cb_ckpt.StepExistsError, match=r"saving step 2 .*step\(s\) 2, 3"):
            ckpt.save(state_at(20), 2)
    after = {
        k: _remote.read(f"{remote.url}/2/{k}")[0] for k in _remote.list_keys(f"{remote.url}/2")
    }
    assert after == before


@pytest.mark.slow
def test_the_cli_shows_no_sizes_for_a_bucket(remote):
    with jax_cb_ckpt.Checkpointer(remote.url) as ckpt:
        ckpt.save(state_at(1), 1)
    ls = run_child([CLI, "ls", remote.url], env=remote.env)
    assert ls.returncode == 0, ls.stderr
    row = [line for line in ls.stdout.splitlines() if line.strip().startswith("1 ")][0]
    assert " - " in row and "complete" in row, ls.stdout
    listed = json.loads(run_child([CLI, "ls", "--json", remote.url], env=remote.env).stdout)
    assert listed["steps"][0]["bytes"] is None


# -- cli.md ------------------------------------------------------------------------------


def test_the_cli_takes_no_lock_on_a_directory_being_written(make_ckpt, ckpt_dir):
    ckpt = make_ckpt()
    ckpt.save(state_at(1), 1)
    ckpt.wait()
    for command in (["ls"], ["show"], ["verify"]):
        run = run_child([CLI, *command, ckpt_dir])
        assert run.returncode == 0, (command, run.stderr)
    ckpt.save(state_at(2), 2)  # the writer goes on
    ckpt.wait()
    assert ckpt.all_steps() == [1, 2]


def test_ls_shows_a_batch_s_metric_as_its_members_range(make_ckpt, ckpt_dir):
    ckpt = make_ckpt()
    ckpt.save({"w": np.zeros((8, 2))}, 1, metrics={"r": np.linspace(12.5, 90, 8)})
    ckpt.save({"w": np.zeros((8, 2))}, 2)
    ckpt.wait()
    ls = run_child([CLI, "ls", ckpt_dir]).stdout
    rows = {line.split()[0]: line for line in ls.splitlines() if line.split()[0].isdigit()}
    assert "12.5..90 (x8)" in rows["1"] and " - " in rows["2"], ls


@pytest.mark.slow
def test_verify_reads_a_large_step_in_bounded_memory(tmp_path):
    """verify reads a step's leaves in groups of up to 256 MiB: a 768 MiB step (three
    256 MiB leaves) is verified with the process growing well under its size."""
    d = tmp_path / "ckpt"
    state = {k: np.full(64 << 20, i, np.float32) for i, k in enumerate("abc")}
    with jax_cb_ckpt.Checkpointer(d) as ckpt:
        ckpt.save(state, 1)
    del state
    probe = (
        "import resource, sys, jax_cb_ckpt\n"
        "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "jax_cb_ckpt.verify(sys.argv[1])\n"
        "print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) >> 10)\n"
    )
    result = run_child(["python", "-c", probe, d], timeout=240)
    assert result.returncode == 0, result.stderr[-2000:]
    assert int(result.stdout.split()[-1]) < 600, result.stdout  # MiB, of a 768 MiB step


# -- frameworks.md ---------------------------------------------------------------------------


def test_an_nnx_module_declared_as_no_pytree_is_refused_with_the_fix(make_ckpt):
    from flax import nnx

    class Opaque(nnx.Module, pytree=False):
        def __init__(self):
            self.w = nnx.Param(jnp.zeros(2))

    ckpt = make_ckpt()
    with pytest.raises(jax_cb_ckpt.InvalidStateError, match=r"nnx\.state\(model\)"):
        ckpt.save({"model": Opaque()}, 1)


# -- multiprocess.md ---------------------------------------------------------------------------

_HOLDER = """
import sys, time, jax_cb_ckpt
ckpt = jax_cb_ckpt.Checkpointer(sys.argv[1])
print("holding", flush=True)
time.sleep(60)
"""


@pytest.mark.slow
def test_a_second_process_without_jax_distributed_is_told_to_initialize_it(tmp_path):
    """Two processes of one run that did not call jax.distributed.initialize each think
    they are alone: the second one's Checkpointer is refused, naming the fix."""
    script = tmp_path / "holder.py"
    script.write_text(_HOLDER)
    holder = start_process([sys.executable, script, tmp_path / "ckpt"], ready="holding")
    try:
        with pytest.raises(jax_cb_ckpt.DirectoryLockedError, match=r"jax\.distributed\.initialize"):
            jax_cb_ckpt.Checkpointer(tmp_path / "ckpt")
    finally:
        kill_group(holder)


# -- README.md, handoff.md: a GPU, and what the hand-off never calls -----------------------

_ON_GPU = """
import sys, jax, jax.numpy as jnp, numpy as np, jax_cb_ckpt
from jax_cb_ckpt._save import _route
if not any(d.platform == "gpu" for d in jax.devices()):
    print("no gpu"); sys.exit(0)
assert _route.buffer_by_default(), "auto is not the buffer crossing on this GPU"
n = 16 << 20  # 64 MiB of float32
with jax_cb_ckpt.Checkpointer(sys.argv[1], every=2) as ckpt:
    def body(x, i):
        x = x * 0.5 + i.astype(jnp.float32)
        ckpt.maybe_save(x, i + 1)
        return x, None
    train = jax.jit(lambda x: jax.lax.scan(body, x, jnp.arange(6))[0])
    train(jnp.arange(n, dtype=jnp.float32))
x = np.arange(n, dtype=np.float32)
for i in range(6):
    x = x * np.float32(0.5) + np.float32(i)
    if (i + 1) % 2 == 0:
        got = jax_cb_ckpt.restore(sys.argv[1], np.zeros(n, np.float32), step=i + 1)
        assert got.tobytes() == x.tobytes(), i + 1
print("exact")
"""


def test_on_a_cuda_gpu_the_auto_crossing_saves_bit_for_bit(tmp_path):
    """On a CUDA GPU, crossing='auto' is the buffer crossing (copies into pinned memory
    on XLA's stream, the writer waiting for them) and every saved step restores bit for
    bit. Run in a child with the GPU backend; skipped where there is none (CPU CI)."""
    if not os.path.exists("/dev/nvidiactl"):  # (no NVIDIA driver: no child to start)
        pytest.skip("no CUDA GPU here")
    script = tmp_path / "on_gpu.py"
    script.write_text(_ON_GPU)
    # (the tests' children run on the CPU backend: this one takes JAX's default)
    result = run_child(["python", script, tmp_path / "ckpt"], env={"JAX_PLATFORMS": ""})
    if "no gpu" in result.stdout or "Unable to initialize backend" in result.stderr:
        pytest.skip("no CUDA GPU here")
    assert result.returncode == 0 and "exact" in result.stdout, result.stderr[-3000:]


_NO_ORBAX = """
import sys, jax, jax.numpy as jnp, jax_cb_ckpt
with jax_cb_ckpt.Checkpointer(sys.argv[1], every=2) as ckpt:
    jax.jit(lambda s: jax.lax.fori_loop(
        0, 6, lambda i, s: (ckpt.maybe_save(s, i + 1), s + 1.0)[1], s))(jnp.zeros(3))
    ckpt.save(jnp.ones(3), 10)
    ckpt.restore(jnp.zeros(3))
print(sorted(m for m in sys.modules if m.split(".")[0] == "orbax"))
"""


@pytest.mark.slow
def test_saving_and_restoring_never_call_orbax(tmp_path):
    """The hand-off never calls Orbax (nor does the writer, nor restore of the
    library's own steps): a run that saves and restores never even imports it."""
    result = run_script(tmp_path, _NO_ORBAX, tmp_path / "ckpt")
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == "[]", result.stdout
