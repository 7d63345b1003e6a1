"""One live writer per checkpoint directory.

Two writers on one directory (two Checkpointers, two processes, two jobs pointed at the
same path) would race on step names and retention. The first Checkpointer to open a
directory holds an exclusive `flock` on `<dir>/.jax_cb_ckpt.lock` for its whole life;
a second one is refused with an error naming the holder (pid, host, since when).

Why `flock`: the kernel drops it when its holder dies (SIGKILL included), so a stale
lock never needs cleaning, and two open file descriptions conflict even inside one
process. The file's text (pid, host, time) is only for the message; it is left in
place, emptied, on release (unlinking it would let two openers lock two inodes).
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import threading
import time

from ._errors import DirectoryLockedError
from ._format import LOCK_NAME

_HELD: dict[str, str] = {}  # path -> description, for Checkpointers of this process
_HELD_LOCK = threading.Lock()


class DirectoryLock:
    """Held from construction until `release()` (idempotent)."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.path = os.path.join(directory, LOCK_NAME)
        with _HELD_LOCK:
            if directory in _HELD:
                raise DirectoryLockedError(
                    f"Checkpointer({directory!r}): another Checkpointer in this process "
                    f"({_HELD[directory]}) is still open on that directory; two writers "
                    "on one directory would race. Fix: close the other one first "
                    "(ckpt.close(), or `with Checkpointer(...) as ckpt:`), or use another "
                    "directory."
                )
            # O_NOFOLLOW: a symlink planted under our lock's name is refused, not followed.
            # Read-only: a file held open for writing would stop the file system from
            # being remounted read-only (and flock needs no write access).
            flags = os.O_RDONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
            try:
                fd = os.open(self.path, flags, 0o644)
            except OSError as e:
                raise DirectoryLockedError(
                    f"Checkpointer({directory!r}): cannot open the lock file "
                    f"{self.path!r}: {e}. Fix: make the directory writable, and remove "
                    f"{LOCK_NAME} if it is not a regular file."
                ) from e
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                holder = _read_holder(fd)
                os.close(fd)
                raise DirectoryLockedError(
                    f"Checkpointer({directory!r}): another live writer holds this "
                    f"directory ({holder}); two writers on one directory would race on "
                    "steps and retention. Fix: stop the other run, or point this run "
                    "at another directory. (The lock is released automatically when "
                    "its holder exits or is killed.)"
                ) from e
            self.identity = os.fstat(fd).st_ino
            since = time.strftime("%Y-%m-%d %H:%M:%S")
            description = f"pid {os.getpid()} on host {socket.gethostname()} since {since}"
            text = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": since})
            _write_text(self.path, text)
            self._fd: int | None = fd
            _HELD[directory] = description

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
            _HELD.pop(self.directory, None)
            if self.still_ours():
                _write_text(self.path, "")  # released: no holder to name
            os.close(fd)  # drops the flock


def _write_text(path: str, text: str) -> None:
    """Replace the lock file's text through a second, short-lived descriptor (the flock
    belongs to the read-only one and stays). Best effort: the text is only for messages."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return
    try:
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
