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
import functools
import json
import logging
import os
import socket
import stat
import threading
import time
import uuid

from .._base._errors import ConfigError, DirectoryLockedError
from .._base._heartbeat import Heartbeat
from .._layout._format import LOCK_NAME
from . import _remote

logger = logging.getLogger("jax_cb_ckpt")

_HELD: dict[str, DirectoryLock] = {}  # path -> the lock a Checkpointer of ours holds
_HELD_LOCK = threading.Lock()


class DirectoryLock:
    """Held from construction until `release()` (idempotent)."""

    token = ""  # object storage: this writer's identity in the lock and its steps
    # Object storage: the token of the holder this lock was taken over from (judged
    # dead): the steps it left uncommitted are removed at the opening, whole or not.
    taken_over_from = ""

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
            if e.errno not in (errno.ELOOP, errno.EISDIR, errno.ENXIO):
                # Not a lock held by anyone: a directory nobody can write (permissions,
                # a read-only mount, /proc), or one that went away.
                name = errno.errorcode.get(e.errno or 0, str(e.errno))
                raise ConfigError(
                    f"Checkpointer({directory!r}): the directory is not writable: cannot "
                    f"create the lock file {self.path!r} (errno {e.errno}, {name}: "
                    f"{e.strerror}). Fix: make it writable (permissions, owner, a "
                    "read-only mount), or pass a directory this process can write."
                ) from e
            # Something planted under the lock's name: a symlink (O_NOFOLLOW), a folder.
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
                "directory; in a multi-process run, call jax.distributed.initialize(...) "
                "in every process before creating its Checkpointer (each process then "
                "writes its own part). (The lock is released automatically when its "
                "holder exits or is killed.)"
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


class ObjectLock(DirectoryLock):
    """One live writer per object-storage prefix, without flock.

    The lock is the object `<prefix>/.jax_cb_ckpt.lock` holding JSON: who (a random
    token, pid, host), since when, and a heartbeat. It is created with an if-absent
    precondition (GCS `ifGenerationMatch=0`, S3 `If-None-Match: *`), so of two writers
    racing to create it one wins; the holder rewrites it every `BEAT_S` seconds under an
    if-generation-matches precondition, and marks it released when it closes. Every write is
    read back (an emulator may ignore preconditions), and the writer checks the lock is
    still its own before each step it commits.

    A lock that is held when a Checkpointer opens the prefix is judged by this rule
    (docs/storage.md): its holder is dead when it names this host and a process id that
    no longer runs; otherwise it is watched for up to `STALE_S` seconds. A heartbeat in
    that time means a live writer: `DirectoryLockedError`; a release, a hand-over (taken
    at once; the holder is not dead, so nothing it left is removed as a dead writer's).
    Neither means the holder died (a killed VM cannot clean up): the lock is taken
    over, with a WARNING naming the previous holder, never silently.
    """

    BEAT_S = 5.0
    STALE_S = 30.0

    def _acquire(self) -> None:
        self.token = uuid.uuid4().hex
        self._heartbeat = Heartbeat("jax_cb_ckpt-lock", self.BEAT_S, self._beat)
        self._lost = False
        self._io = threading.Lock()  # one write of the lock object at a time
        since = time.strftime("%Y-%m-%d %H:%M:%S")
        host = socket.gethostname()
        self.description = f"pid {os.getpid()} on host {host} since {since}"
        self._record = {
            "token": self.token,
            "pid": os.getpid(),
            "host": host,
            "since": since,
            "pid_space": _pid_space(),
        }
        for _ in range(3):  # a racing writer won the create: look again
            data, generation = self._read()
            holder = _holder(data)
            taken_from = None
            if holder is not None:
                generation, dead = self._wait_for(holder, data, generation)
                taken_from = holder if dead else None
            written = self._write(generation)
            if written is not None:
                self._generation = written
                break
            if generation == _remote.ABSENT and self._read()[1] == _remote.ABSENT:
                # Refused to create an object that is still absent: S3 answers a
                # conditional write into a missing bucket so.
                scheme, bucket, _ = _remote.split(self.directory)
                raise self._unreachable(
                    _remote.StorageError(
                        f"the bucket {scheme}://{bucket} does not exist or is not writable "
                        "with these credentials"
                    )
                )
        else:
            raise DirectoryLockedError(
                f"Checkpointer({self.directory!r}): other writers keep taking the lock "
                f"object {self.path}. Fix: stop the other runs on that location."
            )
        if _holder(self._read()[0]) != self._record:
            raise DirectoryLockedError(
                f"Checkpointer({self.directory!r}): another writer created the lock "
                f"object {self.path} at the same time and holds it. Fix: stop the other "
                "run, or point this run at another location."
            )
        if taken_from is not None:
            token = taken_from.get("token")
            self.taken_over_from = token if isinstance(token, str) else ""
            logger.warning(
                "took over the lock of %s from %s: it showed no heartbeat "
                "for %.0f s (or its process is gone from this host), so its writer is "
                "taken to be dead (docs/storage.md, 'One writer').",
                self.directory,
                _holder_text(taken_from),
                self.STALE_S,
            )
        self._heartbeat.start()

    def _read(self) -> tuple[bytes | None, bytes]:
        try:
            return _remote.read(self.path)
        except _remote.StorageError as e:
            raise self._unreachable(e) from e

    def _beat_record(self) -> bytes:
        """The lock object's content: our record and the time of this beat."""
        return json.dumps(dict(self._record, beat=time.time())).encode()

    def _write(self, generation: bytes) -> bytes | None:
        try:
            return _remote.write(self.path, self._beat_record(), if_equal=generation)
        except _remote.StorageError as e:
            raise self._unreachable(e) from e

    def _unreachable(self, e: Exception) -> ConfigError:
        return ConfigError(
            f"Checkpointer({self.directory!r}): cannot use the location: {e}. Fix: check "
            "the bucket name, that it exists, the credentials and endpoint in the "
            "environment (docs/storage.md)."
        )

    def _wait_for(
        self, holder: dict[str, object], seen: bytes | None, generation: bytes
    ) -> tuple[bytes, bool]:
        """The generation to take the lock from, and whether its holder is judged dead
        (False: it released the lock meanwhile, a clean hand-over: nothing it left is
        a dead writer's); a `DirectoryLockedError` when it shows a heartbeat."""
        if holder.get("pid_space") == _pid_space() and not _alive(holder.get("pid")):
            return generation, True  # a process id of this very machine and pid namespace
        logger.info(
            "the lock of %s is held by %s: waiting up to %.0f s for a heartbeat (a live "
            "writer) or its release",
            self.directory,
            _holder_text(holder),
            self.STALE_S,
        )
        deadline = time.monotonic() + self.STALE_S
        while time.monotonic() < deadline:
            time.sleep(min(0.5, self.BEAT_S / 4))
            data, now = self._read()
            # A heartbeat changes the object: its generation, and its content (the beat
            # time), which is all there is to see where the server reports no
            # generation (`_remote.UNKNOWN`).
            if now == generation and data == seen:
                continue
            if _holder(data) is None:  # released meanwhile: handed over, not dead
                return now, False
            raise DirectoryLockedError(
                f"Checkpointer({self.directory!r}): another live writer holds this "
                f"location ({_holder_text(_holder(data) or holder)}); two writers would race "
                "on steps and retention. Fix: stop the other run, or point this run at "
                "another location."
            )
        return generation, True

    def _beat(self) -> bool:
        """Rewrite the lock object with a new beat time; False once it is no longer
        ours (or released): no more beats."""
        with self._io:  # not while release() marks it released
            if self._heartbeat.stopped.is_set():
                return False
            try:
                written = _remote.write(self.path, self._beat_record(), if_equal=self._generation)
            except _remote.StorageError:
                return True  # the next beat tries again; each step checks still_ours()
            if written is None:
                self._lost = True
                return False
            self._generation = written
            return True

    def still_ours(self) -> bool:
        """Our record is in the lock object (a `StorageError` when it cannot be read:
        the step fails at once rather than after each of its operations' retries)."""
        if self._lost:
            return False
        data, _ = _remote.read(self.path)
        return _holder(data) == self._record

    def release(self) -> None:
        with _HELD_LOCK:
            if self._heartbeat.stopped.is_set():
                return
            self._heartbeat.stop()
            if _HELD.get(self.directory) is self:
                del _HELD[self.directory]
        with self._io:  # after a heartbeat in flight: its generation is the one to match
            if not self._lost:
                try:  # released, not deleted: a writer waiting on it sees the release
                    _remote.write(
                        self.path, _released(), if_equal=self._generation, timeout=_RELEASE_S
                    )
                except (_remote.StorageError, TimeoutError):
                    pass  # the next opener finds no heartbeat and takes it over
        self._released.set()


_RELEASE_S = 5.0  # close() does not wait longer to release the lock (storage may be away)
_RECORD = ("token", "pid", "host", "since", "pid_space")


def _released() -> bytes:
    """A released lock object's content. Not empty: gcp-storage-emulator never answers
    an upload of no bytes (close() waited `_RELEASE_S` and the next opener `STALE_S`)."""
    return json.dumps({"released": time.strftime("%Y-%m-%d %H:%M:%S")}).encode()


def _holder(data: bytes | None) -> dict[str, object] | None:
    """The record of a held lock object; None when absent or released (emptied, as
    earlier versions left it, or a `_released` record)."""
    if not data:
        return None
    try:
        record = json.loads(data)
    except ValueError:
        record = None
    if not isinstance(record, dict):  # not ours to read: judged by its heartbeat
        return {"token": "?", "pid": "?", "host": "?", "since": "unreadable lock object"}
    if set(record) == {"released"}:
        return None
    return {k: record.get(k) for k in _RECORD}


@functools.cache
def _pid_space() -> str:
    """This machine and pid namespace: the boot id and the namespace's inode. Two
    processes with equal values can see each other's process ids; a hostname alone
    cannot say that (containers share one, and so can two machines)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        return f"{boot}/{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:
        return f"unknown-{uuid.uuid4().hex}"  # never equal to another process's


def _holder_text(holder: dict[str, object]) -> str:
    return f"pid {holder.get('pid')} on host {holder.get('host')} since {holder.get('since')}"


def _alive(pid: object) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return True  # unknown: watch its heartbeat
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True
