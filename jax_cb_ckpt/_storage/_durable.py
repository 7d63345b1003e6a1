"""Making a written step durable on a local disk before it is renamed into place.

Nothing is synced while a step is written (TensorStore's own fsyncs are off, the JSON
files are plain writes); then, before the rename, every file and directory of the step
must reach the disk. Two ways, the same guarantee:

- an fsync of each file and directory, concurrently (the file system commits them
  together): works on every file system, ~2.5-3 ms for a step of 5 files and 4
  directories on the 2-core VM's ext4, because each fsync waits for its own journal
  commit and cache flush;
- one `syncfs(2)` of the file system: every dirty file and directory of it written and
  committed at once, ~1-1.3 ms for the same step. But it writes *everything* unwritten
  on that file system, so it is used only where that is known to be cheap and safe: a
  local file system whose syncfs writes and commits every file (ext4, XFS, btrfs), a
  kernel whose syncfs reports write errors (Linux >= 5.8; before, it returned 0 even
  when a write failed), and little unwritten data in the system besides the step's own
  (`/proc/meminfo`), so that another program's writes never make a save wait.

Object storage needs neither: an object is durable once its write returns
(`NoSync`: `_bucket.Bucket.step_sync`).
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import functools
import os
import sys

# File systems whose syncfs writes back and commits every dirty file and directory
# (network and FUSE file systems are left to per-file fsync: their syncfs may do less).
SYNCFS_TYPES = frozenset({"ext4", "ext3", "xfs", "btrfs"})
# Unwritten data in the system beyond the step's own under which one syncfs is taken:
# at ~1 GB/s 2 MiB more costs ~2 ms, about what syncfs saves over per-file fsyncs.
OTHER_UNWRITTEN_MAX = 2 << 20


class StepSync:
    """How one step is made durable; made before the step's first file is written.

    It opens the checkpoint directory then, because the kernel samples a file system's
    write-error state when a descriptor is opened: a `syncfs` through it reports every
    failed write since, also one that another program's syncfs has seen first (a
    descriptor opened after the step's files were written could miss that error, and
    a step with lost data would be listed). Close it once the step is committed or
    failed (`with StepSync(directory) as sync:`).
    """

    def __init__(self, directory: str) -> None:
        self._fd: int | None = None
        if _SYNCFS is not None:
            try:
                self._fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
            except OSError:  # (the writer's directory checks say what is wrong)
                self._fd = None

    def tree(self, path: str, nbytes: int) -> None:
        """Make every file and directory under `path`, written since this was made
        (about `nbytes` bytes), durable: one syncfs where `syncfs_fits`, else
        `fsync_tree`. Blocks the calling thread (the writer's) until the disk has
        them."""
        if self._fd is not None and syncfs_fits(path, nbytes):
            syncfs(self._fd, path)
        else:
            fsync_tree(path)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> StepSync:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class NoSync:
    """A bucket's step sync: nothing to do, an object is durable once written."""

    def tree(self, path: str, nbytes: int) -> None:
        pass

    def __enter__(self) -> NoSync:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


Sync = StepSync | NoSync  # how a step is made durable (`Storage.step_sync`)


def syncfs_fits(path: str, nbytes: int) -> bool:
    """Does one syncfs make `path` durable at no more cost than fsyncing its files?"""
    if _SYNCFS is None:
        return False
    try:
        if fs_type(os.stat(path).st_dev) not in SYNCFS_TYPES:
            return False
    except OSError:
        return False
    return unwritten_bytes() - nbytes <= OTHER_UNWRITTEN_MAX


def syncfs(fd: int, path: str) -> None:
    """syncfs(2) of the file system of descriptor `fd` (which holds `path`, named in
    the error); OSError if it reports a failed write since `fd` was opened or last
    synced (Linux >= 5.8, the only kernels it is used on)."""
    assert _SYNCFS is not None
    if _SYNCFS(fd) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"syncfs of the file system of {path!r}: {os.strerror(errno)}")


@functools.lru_cache(maxsize=64)
def fs_type(device: int) -> str | None:
    """The type of the mounted file system with device number `device` (`st_dev`), from
    /proc/self/mountinfo; None where it cannot be told."""
    wanted = f"{os.major(device)}:{os.minor(device)}"
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                fields, _, rest = line.partition(" - ")
                parts = fields.split()
                if len(parts) > 2 and parts[2] == wanted and rest:
                    return rest.split()[0]
    except OSError:
        pass
    return None


def unwritten_bytes() -> int:
    """Bytes in the system written to files and not yet on disk (Dirty + Writeback of
    /proc/meminfo); a huge number where that cannot be read."""
    total = 0
    seen = 0
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith(("Dirty:", "Writeback:")):
                    total += int(line.split()[1]) << 10  # kB
                    seen += 1
    except (OSError, ValueError, IndexError):
        return sys.maxsize
    return total if seen == 2 else sys.maxsize


def fsync_dir(path: str) -> None:
    _fsync(path, directory=True)


def _fsync(path: str, directory: bool) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# fsyncs of one step's files run concurrently: the file system commits them together
# (measured: 1.5-1.9 ms for a small step against 3.3 ms one after another).
_FSYNC_POOL = concurrent.futures.ThreadPoolExecutor(8, thread_name_prefix="jax_cb_ckpt-fsync")


def fsync_tree(path: str) -> None:
    """fsync every file and directory under `path` (nothing was synced while writing)."""
    todo = []
    for root, _dirs, files in os.walk(path):
        todo += [(os.path.join(root, n), False) for n in files]
        todo.append((root, True))
    todo = [(p, d) for p, d in todo if not os.path.islink(p)]
    futures = []
    for i, (p, d) in enumerate(todo):
        try:
            futures.append(_FSYNC_POOL.submit(_fsync, p, d))
        except RuntimeError:
            # The pool could not start a thread: Python 3.12.0/3.12.1 refuse new threads
            # once the main thread has ended, while the exit hook still writes unclosed
            # Checkpointers' saves (_write/_exit.py). The rest are synced here, one after
            # another; what was submitted has a thread (the first submit starts one).
            for p, d in todo[i:]:
                _fsync(p, d)
            break
    for future in futures:
        future.result()


def _load_syncfs():
    """libc's syncfs on Linux >= 5.8 (whose syncfs reports write errors), else None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        release = tuple(int(n) for n in os.uname().release.split("-")[0].split(".")[:2])
        if release < (5, 8):
            return None
        function = ctypes.CDLL(None, use_errno=True).syncfs
    except (OSError, AttributeError, ValueError):
        return None
    function.argtypes = [ctypes.c_int]
    function.restype = ctypes.c_int
    return function


_SYNCFS = _load_syncfs()
