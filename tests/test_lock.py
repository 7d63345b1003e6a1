"""`_storage/_lock.py`: one live writer per directory. `DirectoryLock` holds an exclusive
`flock` on the lock file from construction to `release()`: a second lock in this
process, or any other open file description holding the flock (another process), is
refused with `DirectoryLockedError` naming the holder; release (idempotent) or the
holder's death frees it; a symlink, FIFO or hard link under the lock's name is refused,
never written through. (The bucket lock, `ObjectLock`, is tested in test_storage.py.)"""

import fcntl
import json
import os
import subprocess
import sys

import pytest

from jax_cb_ckpt import DirectoryLockedError
from jax_cb_ckpt._layout._format import LOCK_NAME
from jax_cb_ckpt._storage._lock import DirectoryLock


@pytest.fixture
def lock(tmp_path):
    made = DirectoryLock(str(tmp_path))
    yield made
    made.release()


def test_the_holder_is_written_in_the_lock_file(tmp_path, lock):
    holder = json.loads((tmp_path / LOCK_NAME).read_text())
    assert holder["pid"] == os.getpid()
    assert lock.description.startswith(f"pid {os.getpid()} on host ")
    assert lock.still_ours()


def test_a_second_lock_in_this_process_is_refused_until_the_first_is_released(tmp_path, lock):
    with pytest.raises(DirectoryLockedError, match="another Checkpointer in this process"):
        DirectoryLock(str(tmp_path))
    lock.release()
    lock.release()  # idempotent
    assert (tmp_path / LOCK_NAME).read_text() == ""  # no holder to name, file kept
    again = DirectoryLock(str(tmp_path))
    again.release()


def test_a_flock_held_elsewhere_refuses_with_the_holders_name(tmp_path):
    path = tmp_path / LOCK_NAME
    path.write_text(json.dumps({"pid": 4242, "host": "elsewhere", "since": "then"}))
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(
            DirectoryLockedError, match=r"another live writer .*pid 4242 on host elsewhere"
        ):
            DirectoryLock(str(tmp_path))
    finally:
        os.close(fd)  # the holder is gone: the flock goes with it
    DirectoryLock(str(tmp_path)).release()


def test_a_killed_holder_frees_the_directory(tmp_path):
    script = (
        "import fcntl, os, sys\n"
        f"fd = os.open({str(tmp_path / LOCK_NAME)!r}, os.O_RDONLY | os.O_CREAT)\n"
        "fcntl.flock(fd, fcntl.LOCK_EX)\n"
        "print('held', flush=True)\n"
        "sys.stdin.read()\n"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout.readline().strip() == "held"
        with pytest.raises(DirectoryLockedError, match="holder unknown"):
            DirectoryLock(str(tmp_path))
    finally:
        child.kill()
        child.communicate()
    DirectoryLock(str(tmp_path)).release()


def test_still_ours_is_false_once_the_lock_file_is_replaced(tmp_path, lock):
    os.rename(tmp_path / LOCK_NAME, tmp_path / "aside")
    (tmp_path / LOCK_NAME).write_text("")
    assert not lock.still_ours()


def test_a_symlink_under_the_lock_name_is_refused_and_not_written_through(tmp_path):
    target = tmp_path / "elsewhere.txt"
    target.write_text("precious")
    (tmp_path / LOCK_NAME).symlink_to(target)
    with pytest.raises(DirectoryLockedError, match="cannot open the lock file"):
        DirectoryLock(str(tmp_path))
    assert target.read_text() == "precious"


def test_a_hard_link_or_fifo_under_the_lock_name_is_refused(tmp_path):
    target = tmp_path / "elsewhere.txt"
    target.write_text("precious")
    os.link(target, tmp_path / LOCK_NAME)
    with pytest.raises(DirectoryLockedError, match="not a plain file of its own"):
        DirectoryLock(str(tmp_path))
    assert target.read_text() == "precious"
    os.unlink(tmp_path / LOCK_NAME)
    os.mkfifo(tmp_path / LOCK_NAME)
    with pytest.raises(DirectoryLockedError, match="not a plain file of its own"):
        DirectoryLock(str(tmp_path))
