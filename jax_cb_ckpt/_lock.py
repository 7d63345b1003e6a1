"""One live writer per checkpoint directory.

Two writers on one directory (two Checkpointers, two processes, two jobs pointed at the
same path) would race on step names and retention. The first Checkpointer to open a
directory holds an exclusive `flock` on `<dir>/.jax_cb_ckpt.lock` for its whole life;
a second one is refused with an error naming the holder (pid, host, since when).

Why `flock`: the kernel drops it when its holder dies (SIGKILL included), so a stale
lock never needs cleaning, and two open file descriptions conflict even inside one
process. The file's text (pid, host, time) is only for the message; it is left in
place, emptied, on release (unlinking it would let two openers lock two inodes).

The lock file is only ever written after checking that it is a regular file with one
link: a symlink, a hard link to a file elsewhere, or a FIFO planted under its name is
refused, never written through (or blocked on).
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import stat
import threading
import time

from ._errors import ConfigError, DirectoryLockedError
from ._format import LOCK_NAME

_HELD: dict[str, DirectoryLock] = {}  # path -> the lock a Checkpointer of ours holds
_HELD_LOCK = threading.Lock()


class DirectoryLock:
    """Held from construction until `release()` (idempotent)."""

    def __init__(self, directory: str, name: str = LOCK_NAME) -> None:
        self.directory = directory
        self.path = os.path.join(directory, name)
        self.finishing = False  # its Checkpointer was collected; it releases when drained
        self._released = threading.Event()
        while True:
            with _HELD_LOCK:
                other = _HELD.get(directory)
                if other is None:
                    self._acquire()
                    _HELD[directory] = self
                    return
                if not other.finishing:
                    raise DirectoryLockedError(
                        f"Checkpointer({directory!r}): another Checkpointer in this "
                        f"process ({other.description}) is still open on that directory; "
                        "two writers on one directory would race. Fix: close the other "
                        "one first (ckpt.close(), or `with Checkpointer(...) as ckpt:`), "
                        "or use another directory."
                    )
            # A garbage-collected Checkpointer still writing what it was handed: wait for
            # it (it ends by itself), then take the directory over.
            other._released.wait()

    def _acquire(self) -> None:
        directory = self.directory
        # O_NOFOLLOW: a symlink under our lock's name is refused, not followed.
        # O_NONBLOCK: opening a FIFO planted there must not block. Read-only: a file held
        # open for writing would stop the file system from being remounted read-only.
        flags = os.O_RDONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        try:
            fd = os.open(self.path, flags, 0o644)
        except OSError as e:
            if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
                raise ConfigError(
                    f"Checkpointer({directory!r}): the directory is not writable: cannot "
                    f"create the lock file {self.path!r} ({e}). Fix: make it writable "
                    "(permissions, owner, a read-only mount), or pass a directory this "
                    "process can write."
                ) from e
            raise DirectoryLockedError(
                f"Checkpointer({directory!r}): cannot open the lock file {self.path!r}: "
                f"{e}. Fix: make the directory writable, and remove {LOCK_NAME} if it is "
                "not a regular file."
            ) from e
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
            os.close(fd)
            raise DirectoryLockedError(
                f"Checkpointer({directory!r}): the lock file {self.path!r} is not a plain "
                "file of its own (a FIFO, device, or a hard link to a file elsewhere), so "
                f"it is not used. Fix: remove {LOCK_NAME} from the directory."
            )
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = _read_holder(fd)
            os.close(fd)
            raise DirectoryLockedError(
                f"Checkpointer({directory!r}): another live writer holds this directory "
                f"({holder}); two writers on one directory would race on steps and "
                "retention. Fix: stop the other run, or point this run at another "
                "directory. (The lock is released automatically when its holder exits or "
                "is killed.)"
            ) from e
        self.identity = st.st_ino
        since = time.strftime("%Y-%m-%d %H:%M:%S")
        host = socket.gethostname()
        self.description = f"pid {os.getpid()} on host {host} since {since}"
        self._fd: int | None = fd
        self._write_text(json.dumps({"pid": os.getpid(), "host": host, "since": since}))

    def still_ours(self) -> bool:
        """Our lock file is still at its place (the directory was not replaced)."""
        try:
            st = os.lstat(self.path)
        except OSError:
            return False
        return st.st_ino == self.identity

    def release(self) -> None:
        with _HELD_LOCK:
            fd, self._fd = self._fd, None
            if fd is None:
                return
            if _HELD.get(self.directory) is self:
                del _HELD[self.directory]
            self._write_text("")  # released: no holder to name
            os.close(fd)  # drops the flock
        self._released.set()

    def _write_text(self, text: str) -> None:
        """Replace the lock file's text through a second, short-lived descriptor (the flock
        belongs to the read-only one), after checking it is still our file and has no
        other link. Best effort: the text is only for messages."""
        flags = os.O_WRONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        try:
            fd = os.open(self.path, flags)
        except OSError:
            return
        try:
            st = os.fstat(fd)
            if st.st_ino == self.identity and st.st_nlink == 1 and stat.S_ISREG(st.st_mode):
                os.ftruncate(fd, 0)
                os.write(fd, text.encode())
        except OSError:
            pass
        finally:
            os.close(fd)


def _read_holder(fd: int) -> str:
    try:
        data = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
        return f"pid {data['pid']} on host {data['host']} since {data['since']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "holder unknown"
