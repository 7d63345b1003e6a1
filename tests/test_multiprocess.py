"""Multi-process runs: 2 processes x 4 CPU devices on 127.0.0.1 (jax.distributed, gloo
collectives), a 32 MiB state sharded over all 8 devices, saved with
`maybe_save(..., shardings=...)` from a jitted scan (tests/multiprocess_worker.py does
the work and reports what it found as one JSON line per process):

- both processes list the same steps, and each wrote its own shard files;
- the checkpoint is the final state bit for bit, read back by `restore(like)` on both
  processes (each reading only its own devices' blocks: bytes counted by the kernel)
  and by plain Orbax's multi-process reader;
- a single process with 8 or with 2 devices restores it exactly;
- a process killed mid-run makes the other fail with our error within `peer_timeout`,
  and the last complete checkpoint still restores exactly;
- SIGTERM to both processes of `ckpt.run` (or to one) stops both at the same step,
  with that step saved;
- a directory that is not shared (process 1 in a mount namespace of its own, with a
  private tmpfs at the same path) is refused at opening, on both processes.

Before this, the first save hung forever: process 0's writer waited in Orbax's device
barrier, which process 1 never joined. Every run here has a hard timeout that kills
both process groups."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import ProcessGroup, free_port, json_lines, same_as_tensorstore

import jax_cb_ckpt

WORKER = Path(__file__).with_name("multiprocess_worker.py")
TIMEOUT = 240  # a 2-process run takes ~15 s here; a hang never ends
PEER_TIMEOUT = 8  # the kill case's wait for the dead process
MIB = 32  # the state's size (multiprocess_worker.MIB)


class Group(ProcessGroup):
    """The processes of one run of tests/multiprocess_worker.py in `mode`."""

    def __init__(
        self,
        tmp_path,
        mode,
        directory,
        nproc=2,
        devices=4,
        victim=1,
        prefix=None,
        env=None,
        directories=None,
    ):
        """`prefix`: {process id: argv to run that process's command under}; `env`:
        variables added to the processes' environment; `directories`: {process id: the
        directory that process is given instead of `directory`}."""
        port = free_port()
        env = dict(
            env or {},
            WORKER_DEVICES=str(devices),
            WORKER_PEER_TIMEOUT=str(PEER_TIMEOUT),
            WORKER_VICTIM=str(victim),
        )
        commands = [
            [
                *(prefix or {}).get(pid, []),
                *[sys.executable, str(WORKER), mode, str(pid), str(nproc), str(port)],
                str((directories or {}).get(pid, directory)),
            ]
            for pid in range(nproc)
        ]
        super().__init__(tmp_path, mode, commands, env=env)

    def wait(self, timeout=TIMEOUT):
        return super().wait(timeout)


def run_group(tmp_path, mode, directory, **kwargs):
    return Group(tmp_path, mode, directory, **kwargs).wait()


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One 2-process run that saved steps 2 and 4, with each process's findings."""
    tmp_path = tmp_path_factory.mktemp("multiprocess")
    directory = tmp_path / "ckpt"
    start = time.perf_counter()
    results = run_group(tmp_path, "train", directory)
    wall_s = time.perf_counter() - start
    for i, (rc, found) in enumerate(results):
        assert rc == 0 and found is not None, (i, rc, found)
    print(
        f"\n2-process test run: {wall_s:.1f} s wall; in it, train + save "
        f"{[round(f['train_and_save_s'], 2) for _, f in results]} s, plain Orbax outer loop "
        f"{[round(f['plain_orbax_outer_loop_s'], 2) for _, f in results]} s"
    )
    return directory, [found for _, found in results]


def test_each_process_writes_its_shards_and_both_restore_exactly(trained):
    directory, findings = trained
    for i, found in enumerate(findings):
        assert found["process"] == i and found["devices"] == 8, found
        assert found["steps"] == [2, 4], found  # the same list on every process
        assert found["kv_steps"] == ["4.0"], found  # step 2's keys deleted
        # process 0's arrays are in the root database, process 1's in its own
        assert found["shard_dirs"] == ["ocdbt.process_1"], found
        assert found["exact"] is True, found
        # Each process read its own half of the 32 MiB state (its 4 devices' blocks),
        # not the whole of it.
        assert 0.4 * MIB <= found["restore_read_mib"] <= 0.6 * MIB, found
        assert found["plain_orbax_exact"] is True, found
        assert found["plain_orbax_sharding"] == ["d"], found
        assert found["extra"] == {"process": 0, "step": 4}, found  # the primary's
    # Process 0 read metadata and a step alone, while process 1 went on.
    assert findings[0]["metadata_step"] == 4 and findings[0]["restored_alone"] == 2
    assert jax_cb_ckpt.all_steps(directory) == [2, 4]
    # The merged index (process 1's nodes and values in its own folder) is read by the
    # package's own reader as TensorStore reads it, and verify (which uses it) passes.
    assert same_as_tensorstore(directory / "4" / "state") > 0
    assert jax_cb_ckpt.verify(directory) == [2, 4]
    # Nothing left behind: no temporary directories, one lock per process at most.
    leftovers = [p.name for p in directory.iterdir() if not p.name.isdigit()]
    assert all(name.startswith(".jax_cb_ckpt.lock") for name in leftovers), leftovers


@pytest.mark.slow
@pytest.mark.parametrize("devices", [8, 2])
def test_one_process_restores_what_two_wrote(tmp_path, trained, devices):
    directory, _ = trained
    [(rc, found)] = run_group(tmp_path, "restore", directory, nproc=1, devices=devices)
    assert rc == 0 and found is not None, (rc, found)
    assert found == {
        "process": 0,
        "devices": devices,
        "step": 4,
        "exact": True,
        "sharding": ["d"],
    }


@pytest.mark.slow
@pytest.mark.parametrize("victim", [1, 0])
def test_a_killed_process_fails_the_other_in_bounded_time(tmp_path, victim):
    directory = tmp_path / "ckpt"
    group = Group(tmp_path, "kill", directory, victim=victim)
    results = group.wait()
    (rc_dead, dead), (rc, found) = results[victim], results[1 - victim]
    assert rc_dead == 17 and dead is None, (rc_dead, dead)  # died hard mid-run
    if victim == 0 and rc == -signal.SIGABRT:
        # Process 0 also ran JAX's coordination service: the survivor's JAX client may
        # end it before our error surfaces (its own message, at once).
        assert "JAX distributed service detected fatal errors" in group.errors(1)
    else:
        assert rc == 0 and found is not None, (rc, group.errors(1 - victim))
        # The survivor's next save waited for the dead process in vain, or could not
        # reach the coordination service process 0 ran, or (process 0 died after the
        # survivor wrote its part) heard no verdict, and said so, in bounded time.
        # (It fails the running program, so JAX's runtime error carries our SaveError.)
        error = found["second_run"]
        assert "SaveError" in error and f"process {victim}" in error, found
        said = ("in vain", "could not tell the others", "heard no verdict on it from process 0")
        assert any(words in error for words in said), found
        assert found["failed_after_s"] < PEER_TIMEOUT + 30, found
    # Steps of the first run and the one the victim saw on disk, none half-written.
    steps = jax_cb_ckpt.all_steps(directory)
    assert steps[:3] == [2, 4, 6], steps
    if found is not None:
        assert found["steps_after"] == steps, found
    [(rc, restored)] = run_group(tmp_path, "restore", directory, nproc=1, devices=8)
    assert rc == 0 and restored is not None and restored["exact"] is True, (rc, restored)
    assert restored["step"] == steps[-1], restored


@pytest.mark.slow
@pytest.mark.parametrize("signalled", [(0, 1), (1,)], ids=["both", "one"])
def test_sigterm_stops_every_process_at_the_same_saved_step(tmp_path, signalled):
    directory = tmp_path / "ckpt"
    group = Group(tmp_path, "run", directory)
    try:
        deadline = time.monotonic() + TIMEOUT
        while (jax_cb_ckpt.latest_step(directory) or 0) < 100:  # two saves done
            assert time.monotonic() < deadline, "no save"
            assert all(c.poll() is None for c in group.children), group.errors(0)
            time.sleep(0.05)
        for pid in signalled:
            group.signal(pid, signal.SIGTERM)
    except BaseException:
        group.kill()
        raise
    results = group.wait()
    (rc0, first), (rc1, second) = results
    assert rc0 == 0 and rc1 == 0 and first and second, results
    at = first["preempted_at"]
    assert second["preempted_at"] == at and at % 10 == 0, results  # one agreed step
    assert first["steps"] == second["steps"] and first["steps"][-1] == at, results
    assert jax_cb_ckpt.all_steps(directory) == first["steps"]
    for found in (first, second):  # the saved step carries on from the one before
        assert found["ints_exact"] is True and found["w_close"] is True, found
        assert found["key_sharding"] in ("PartitionSpec()", "P()"), found  # placed as like


def test_what_a_multi_process_run_refuses(tmp_path):
    """Refused with errors that say why and what to do, the same on both processes; a
    write that fails fails everywhere and lists nothing, and the step can be saved
    again (a new attempt, which must not read the failed attempt's verdicts)."""
    results = run_group(tmp_path, "refusals", tmp_path / "ckpt")
    for rc, found in results:
        assert rc == 0 and found is not None, results
        assert found["on_full_skip"].startswith("ConfigError"), found
        assert "on_full='block'" in found["on_full_skip"], found
        assert found["persistent"].startswith("ConfigError"), found
        assert "multi-process run cannot keep a persistent tier" in found["persistent"], found
        assert found["eager_save"].startswith("InvalidStateError"), found
        assert "shardings=" in found["eager_save"], found
        assert found["gathered"].startswith("ConfigError"), found
        assert "needs shardings=" in found["gathered"], found
        assert found["run_host_leaf"].startswith("ConfigError"), found
        assert "['h']" in found["run_host_leaf"], found
        assert "SaveError" in found["blocked"] and "step 3" in found["blocked"], found
        assert found["steps"] == [], found
        assert found["retry"] == "accepted" and found["steps_after_retry"] == [3], found
        assert found["packed"] == "accepted" and found["packed_exact"], found
    assert jax_cb_ckpt.all_steps(tmp_path / "ckpt") == [3, 5]


@pytest.mark.slow
def test_a_slow_peer_at_work_is_waited_for_beyond_peer_timeout(tmp_path):
    """Process 0 writes a 256 MiB replicated leaf alone, with peer_timeout=0.5 s:
    process 1 waits for the commit while process 0's heartbeat says it works on that
    step (a single timeout made process 1 fail a step that process 0 committed)."""
    results = run_group(tmp_path, "slow", tmp_path / "ckpt")
    for rc, found in results:
        assert rc == 0 and found is not None, results
        assert found["error"] is None and found["failed"] == 0, found
        assert found["steps"] == [1, 2], found
    assert results[0][1]["write_max_s"] > 0.5, results  # outlasted peer_timeout


@pytest.mark.slow
def test_a_save_made_by_one_process_only_fails_there_in_bounded_time(tmp_path):
    (rc0, first), (rc1, second) = run_group(tmp_path, "diverge", tmp_path / "ckpt")
    assert rc0 == 0 and rc1 == 0 and first and second, (first, second)
    assert first["error"] is None and first["steps"] == [], first
    assert "SaveError" in second["error"] and "process 0 to start step 7" in second["error"]
    assert second["failed_after_s"] < PEER_TIMEOUT + 30, second
    assert second["steps"] == [], second


def process_state(pid):
    """The state letter of a process (`T` when stopped), or None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


@pytest.mark.slow
def test_a_stopped_process_0_leaves_the_verdict_unknown_in_bounded_time(tmp_path):
    """Issue 18 7(a): process 0 stops (SIGSTOP) just before it commits step 2. Before,
    process 1's calls to the coordination service (which runs in process 0) blocked for
    the whole stop, so peer_timeout bounded nothing, and it then said step 2 was "not
    committed" although process 0 committed it once it ran again. Now process 1 gives
    up within peer_timeout while process 0 is still stopped, saying the outcome is
    unknown; once continued, process 0 commits and both list step 2."""
    directory = tmp_path / "ckpt"
    group = Group(tmp_path, "stopped", directory)
    pid0 = group.children[0].pid
    try:
        deadline = time.monotonic() + TIMEOUT
        while process_state(pid0) != "T":
            assert time.monotonic() < deadline, "process 0 never stopped\n" + group.errors(0)
            assert all(c.poll() is None for c in group.children), group.errors(1)
            time.sleep(0.05)
        stopped = time.monotonic()
        while not json_lines(group.printed(1)):  # process 1's verdict, while 0 is stopped
            assert time.monotonic() < stopped + PEER_TIMEOUT + 30, (
                "process 1 said nothing while process 0 was stopped (a call blocked)\n"
                + group.errors(1)
            )
            assert group.children[1].poll() is None, group.errors(1)
            time.sleep(0.05)
        assert process_state(pid0) == "T"  # still stopped when process 1 spoke
    finally:
        if group.children[0].poll() is None:
            group.signal(0, signal.SIGCONT)
    early = json_lines(group.printed(1))[0]
    (rc0, first), (rc1, second) = group.wait()
    assert rc0 == 0 and rc1 == 0 and first and second, (group.errors(0), group.errors(1))
    error = early["error"]
    assert "SaveError" in error and "ended with an unknown outcome" in error, error
    assert "Whether step 2 was committed is unknown" in error, error
    assert "not committed" not in error, error
    assert first["error"] is None, first  # process 0 committed step 2 once continued
    assert first["steps"] == second["steps"] == [1, 2], (first, second)
    assert jax_cb_ckpt.all_steps(directory) == [1, 2]


@pytest.mark.slow
def test_a_late_process_leaves_no_temporary_directory_behind(tmp_path):
    """Issue 18 7(b): process 1 comes to step 1 after process 0 gave up on it and
    removed its temporary directory. Before, process 1 re-created that directory
    (TensorStore makes the folders it writes into) and it stayed until the next
    opening; now process 1 refuses to write into a removed attempt, and process 0
    removes what is left of the run's attempts at each commit."""
    directory = tmp_path / "ckpt"
    results = run_group(tmp_path, "late", directory)
    for rc, found in results:
        assert rc == 0 and found is not None, results
        assert found["temps_after_step_1"] == [], found
        assert found["temps_after_step_2"] == [], found
        assert found["error"] is None and found["steps"] == [2], found
    first, second = results[0][1], results[1][1]
    assert "in vain" in first["late_error"] and "process 1" in first["late_error"], first
    assert "process 0 had given up on this step" in second["late_error"], second


def private_mount(directory):
    """An argv prefix that runs a command in a mount namespace of its own, with a
    private tmpfs at `directory` (the same path, another directory: a host whose
    "shared" path is a local disk). Needs root, or user namespaces; else skipped."""
    directory.mkdir(parents=True, exist_ok=True)
    script = 'd="$1"; shift; mount -t tmpfs jax_cb_ckpt_test "$d" && exec "$@"'
    why = ""
    for user in ([], ["--map-root-user"]):
        prefix = ["unshare", *user, "--mount", "--propagation", "private"]
        prefix += ["sh", "-c", script, "sh", str(directory)]
        try:
            probe = subprocess.run([*prefix, "true"], capture_output=True, text=True)
        except OSError as e:  # no unshare here
            pytest.skip(f"cannot make a private mount: {e}")
        if probe.returncode == 0:
            return prefix
        why = probe.stderr.strip()
    pytest.skip(f"cannot make a private mount here: {why}")


def test_a_directory_that_is_not_shared_is_refused_at_opening(tmp_path):
    """Process 1 sees a private tmpfs at the checkpoint path. Before the opening checked
    it, both processes saved "successfully", process 0 listed every step, and none
    restored (process 1's blocks were where process 0 never looks)."""
    directory = tmp_path / "ckpt"
    prefix = {1: private_mount(directory)}
    results = run_group(tmp_path, "unshared", directory, prefix=prefix)
    for rc, found in results:
        assert rc == 0 and found is not None, results
        opening = found["opening"]
        assert opening.startswith("ConfigError: Checkpointer(directory="), found
        assert str(directory.resolve()) in opening, found
        assert "process 1 finds no file '.jax_cb_ckpt.nonce-" in opening, found
        assert "Fix: put the directory on a file system that every process" in opening, found
    assert results[0][1]["opening"] == results[1][1]["opening"]  # the same error everywhere
    # Nothing listed, and the check file is gone (process 0 removes it).
    assert jax_cb_ckpt.all_steps(directory) == []
    assert [n for n in os.listdir(directory) if "nonce" in n] == []


@pytest.mark.slow
def test_a_process_given_another_path_is_refused_at_opening(tmp_path):
    """docs/multiprocess.md: the same directory path in every process. Process 1 given
    another path (a typo in its launch line) waits for process 0 to open it, and
    process 0 for process 1 to check its directory: both fail within peer_timeout,
    saying what every process must do; nothing is listed."""
    directory = tmp_path / "ckpt"
    other = tmp_path / "ckpt-typo"
    results = run_group(tmp_path, "unshared", directory, directories={1: other})
    for pid, (rc, found) in enumerate(results):
        assert rc == 0 and found is not None, results
        opening = found["opening"]
        waited = "process 1 to check" if pid == 0 else "process 0 to open"
        assert opening.startswith(f"SaveError: process {pid} waited for {waited}"), found
        assert "on the same directory path, in the same order" in opening, found
    assert jax_cb_ckpt.all_steps(directory) == [] and jax_cb_ckpt.all_steps(other) == []
