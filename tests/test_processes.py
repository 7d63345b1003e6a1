"""Unit tests of the process group's parts that need no second process (`_processes.py`):
the bounded call to the coordination service, the check file with which every process
checks it sees process 0's directory, and the group of one. The group itself runs in
test_multiprocess.py with real processes."""

import os
import threading
import time

import pytest

from jax_cb_ckpt import _processes, _storage
from jax_cb_ckpt._processes import OK, Solo, _bounded, _read_nonce, _remove_nonce, _write_nonce


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
    storage = _storage.at(str(tmp_path))
    nonce, trouble = _write_nonce(storage, "run-1")
    assert trouble is None and not leftover.exists()
    file = str(tmp_path / (_processes.NONCE_PREFIX + "run-1"))
    assert _read_nonce(storage, _processes.NONCE_PREFIX + "run-1", nonce) == OK
    again, _ = _write_nonce(storage, "run-2")
    assert again != nonce and not os.path.exists(file)  # each opening its own nonce


def test_a_process_that_sees_another_directory_says_how_it_differs(tmp_path):
    storage = _storage.at(str(tmp_path))
    nonce, _ = _write_nonce(storage, "run")
    assert "finds other content" in _read_nonce(storage, _processes.NONCE_PREFIX + "run", "0" * 32)
    assert "finds no file" in _read_nonce(storage, "elsewhere", nonce)
    message = _processes._not_shared(str(tmp_path), "x", ["process 1 finds no file 'x'"])
    assert "not every process of this run sees the same directory" in message
    assert "Fix: put the directory on a file system that every process mounts" in message


def test_an_unwritable_directory_is_reported_not_raised(tmp_path):
    missing = str(tmp_path / "gone")
    _, trouble = _write_nonce(_storage.at(missing), "run")
    assert trouble is not None and "cannot write the check file" in trouble and "Fix:" in trouble


def test_only_a_regular_file_is_removed_never_what_a_link_points_to(tmp_path):
    target = tmp_path / "precious"
    target.write_text("keep")
    link = tmp_path / (_processes.NONCE_PREFIX + "link")
    link.symlink_to(target)
    storage = _storage.at(str(tmp_path))
    _remove_nonce(storage, link.name)
    assert target.read_text() == "keep"
    _remove_nonce(storage, "never-there")  # gone already: no error


def test_a_group_of_one_has_no_one_to_tell_or_hear():
    solo = Solo()
    assert (solo.index, solo.count, solo.primary) == (0, 1, True)
    solo.begin(4)
    assert solo.writing == 4
    assert solo.temp_name(4).startswith("4.jax_cb_ckpt-tmp-")
    solo.tell(4, "wrote", "x")
    solo.heard_all(4)
    with pytest.raises(AssertionError, match="a group of one waited for"):
        solo.hear(4, "wrote", "its part", 1)
    with pytest.raises(AssertionError, match="its own verdict"):
        solo.verdict(4)
