"""Unit tests of the process group's parts that need no second process (`_processes.py`):
the bounded call to the coordination service, the check file with which every process
checks it sees process 0's directory, the round of one step (`GroupRound`, `SoloRound`)
with a group of one and with a group of two threads that each hold a client of one real
coordination service. Whole runs of real processes are test_multiprocess.py's."""

import os
import threading
import time

import pytest

from jax_cb_ckpt._storage import _places
from jax_cb_ckpt._write import _processes
from jax_cb_ckpt._write._processes import (
    OK,
    Solo,
    _bounded,
    _read_nonce,
    _remove_nonce,
    _write_nonce,
)


def test_a_bounded_call_returns_its_value_or_raises_its_error():
    assert _bounded(lambda a, b: a + b, 2, 3, bound_s=5) == 5
    with pytest.raises(KeyError, match="missing"):
        _bounded(lambda: {}["missing"], bound_s=5)


def test_a_call_that_does_not_return_is_given_up_after_its_bound():
    release = threading.Event()
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"no answer from the coordination service in 0.3 s"):
        _bounded(release.wait, bound_s=0.3)
    assert time.monotonic() - start < 5
    release.set()  # the abandoned call ends whenever it does


def test_the_check_file_holds_a_fresh_nonce_and_replaces_leftovers(tmp_path):
    leftover = tmp_path / (_processes.NONCE_PREFIX + "old-run")
    leftover.write_text("stale")
    storage = _places.at(str(tmp_path))
    nonce, trouble = _write_nonce(storage, "run-1")
    assert trouble is None and not leftover.exists()
    file = str(tmp_path / (_processes.NONCE_PREFIX + "run-1"))
    assert _read_nonce(storage, _processes.NONCE_PREFIX + "run-1", nonce) == OK
    again, _ = _write_nonce(storage, "run-2")
    assert again != nonce and not os.path.exists(file)  # each opening its own nonce


def test_a_process_that_sees_another_directory_says_how_it_differs(tmp_path):
    storage = _places.at(str(tmp_path))
    nonce, _ = _write_nonce(storage, "run")
    assert "finds other content" in _read_nonce(storage, _processes.NONCE_PREFIX + "run", "0" * 32)
    assert "finds no file" in _read_nonce(storage, "elsewhere", nonce)
    message = _processes._not_shared(str(tmp_path), "x", ["process 1 finds no file 'x'"])
    assert "not every process of this run sees the same directory" in message
    assert "Fix: put the directory on a file system that every process mounts" in message


def test_an_unwritable_directory_is_reported_not_raised(tmp_path):
    missing = str(tmp_path / "gone")
    _, trouble = _write_nonce(_places.at(missing), "run")
    assert trouble is not None and "cannot write the check file" in trouble and "Fix:" in trouble


def test_only_a_regular_file_is_removed_never_what_a_link_points_to(tmp_path):
    target = tmp_path / "precious"
    target.write_text("keep")
    link = tmp_path / (_processes.NONCE_PREFIX + "link")
    link.symlink_to(target)
    storage = _places.at(str(tmp_path))
    _remove_nonce(storage, link.name)
    assert target.read_text() == "keep"
    _remove_nonce(storage, "never-there")  # gone already: no error


def test_a_group_of_one_plays_the_whole_round_alone():
    solo = Solo()
    assert (solo.index, solo.count, solo.primary) == (0, 1, True)
    round_ = solo.begin(4)
    assert solo.writing == 4
    assert (round_.index, round_.count, round_.primary) == (0, 1, True)
    assert round_.temp_name.startswith("4.jax_cb_ckpt-tmp-")
    assert solo.begin(4).temp_name != round_.temp_name  # each attempt its own place
    round_.start(None)
    round_.await_start()  # (the one process is the one that starts it)
    round_.report(None, {"w": {"0": 7}})
    assert round_.collect({"w": {"0": 7}}) == {"w": {"0": 7}}  # its own sums are all
    round_.decide(None)
    round_.await_verdict()


# -- a group of two, as two threads with a client each of one real coordination service


@pytest.fixture
def pair(tmp_path):
    """Process 0 and process 1 of a run, as two Groups in threads of this process, each
    with its own client of a coordination service on 127.0.0.1 (jax.distributed's)."""
    import socket

    from jax._src.lib import _jax

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
    service = _jax.get_distributed_runtime_service(address, 2)
    clients = [_jax.get_distributed_runtime_client(address, i, init_timeout=30) for i in (0, 1)]
    _in_threads(lambda i: clients[i].connect())
    groups = _in_threads(
        lambda i: _processes.Group(str(tmp_path), 1.0, list, client=clients[i], index=i, count=2)
    )
    yield groups
    for group in groups:
        group.close()
    _in_threads(lambda i: clients[i].shutdown())
    service.shutdown()


def _in_threads(fn, timeout_s=60):
    """fn(0) and fn(1) at once, each in a thread; their results (or the first error)."""
    results, errors = [None, None], []

    def run(i):
        try:
            results[i] = fn(i)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout_s)
        assert not thread.is_alive(), "a side of the round hangs"
    if errors:
        raise errors[0]
    return results


def _play(pair, step, primary, peer):
    """One round of `step`: primary(round) and peer(round), each in its thread; what
    each returned or raised."""
    rounds = [group.begin(step) for group in pair]
    outcomes = [None, None]

    def side(i):
        try:
            outcomes[i] = (primary, peer)[i](rounds[i])
        except Exception as e:
            outcomes[i] = e

    _in_threads(side)
    return rounds, outcomes


def test_a_round_of_two_merges_the_sums_and_both_hear_the_commit(pair):
    def primary(r):
        r.start(None)
        r.report(None, {"a": {"0": 1}})
        sums = r.collect({"a": {"0": 1}})
        r.decide(None)
        return sums

    def peer(r):
        r.await_start()
        r.report(None, {"a": {"1": 2}, "b": {"0": 3}})
        r.await_verdict()
        return "committed"

    rounds, (sums, heard) = _play(pair, 5, primary, peer)
    assert sums == {"a": {"0": 1, "1": 2}, "b": {"0": 3}}
    assert heard == "committed"
    assert rounds[0].temp_name == rounds[1].temp_name  # one place for every process
    assert [r.primary for r in rounds] == [True, False]


def test_a_peer_that_failed_is_named_and_hears_the_step_was_not_committed(pair):
    def primary(r):
        r.start(None)
        r.report(None, {})
        try:
            r.collect({})
        except _processes.SaveError as e:
            r.decide(e)
            return str(e)

    def peer(r):
        r.await_start()
        r.report(OSError("No space left on device"))
        r.await_verdict()

    _, (said, heard) = _play(pair, 6, primary, peer)
    assert said == "process 1: OSError: No space left on device"
    assert isinstance(heard, _processes.SaveError)
    assert "step 6 was not committed: SaveError: process 1: OSError" in str(heard)


def test_a_step_process_0_could_not_start_is_refused_and_owes_no_decision(pair):
    def primary(r):
        r.start(FileExistsError("step directory '7' already exists"))
        r.decide(FileExistsError("step directory '7' already exists"))  # not owed

    def peer(r):
        r.await_start()

    rounds, (_, heard) = _play(pair, 7, primary, peer)
    assert isinstance(heard, _processes.SaveError)
    assert "process 0 could not start step 7: FileExistsError" in str(heard)
    with pytest.raises(Exception, match="NOT_FOUND|not found"):  # no decision was told
        pair[0]._client.key_value_try_get(f"{rounds[0]._prefix}/commit")


def test_a_peer_that_hears_no_decision_says_the_outcome_is_unknown(pair):
    def primary(r):
        r.start(None)
        r.report(None, {})
        r.collect({})
        pair[0].writing = None  # stopped working on the step without deciding

    def peer(r):
        r.await_start()
        r.report(None, {})
        r.await_verdict()

    _, (_, heard) = _play(pair, 8, primary, peer)
    assert isinstance(heard, _processes.VerdictUnknown)
    assert "Whether step 8 was committed is unknown" in str(heard)


def test_a_second_attempt_at_a_step_does_not_read_the_first_ones_keys(pair):
    def fails(r):
        r.start(OSError("disk"))

    _play(pair, 9, fails, lambda r: r.await_start())

    def primary(r):
        r.start(None)
        r.report(None, {})
        r.collect({})
        r.decide(None)

    def peer(r):
        r.await_start()  # the first attempt's 'ready' said it failed
        r.report(None, {})
        r.await_verdict()

    rounds, outcomes = _play(pair, 9, primary, peer)
    assert outcomes == [None, None]
