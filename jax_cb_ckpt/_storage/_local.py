"""A checkpoint directory on a POSIX file system: its steps (`Local`, a `StepStore`)
and its files (`LocalChunks`, a `ChunkStore`).

A step is a real directory named by the step (`_format`'s module doc); a step being
written has a temporary name of ours, renamed into place at its commit (the rename is
what lists it); a step deleted is renamed aside first; every deletion checks with lstat
that it removes a real directory, and `shutil.rmtree` follows no link inside it. What
a step is, is remembered per file identity (`_TAGS`), so a step listed at every save's
retention is read once. Any thread; each verb blocks on its I/O.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import shutil
import stat
import uuid
from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING, Any, BinaryIO

from .._base._errors import ConfigError
from .._layout import _format, _ocdbt
from .._layout._format import (
    COMPLETE,
    GONE,
    META_FILE,
    META_ITEM,
    META_MAX_BYTES,
    ORBAX_STEP_FILE,
    SMALL_FILE_MAX_BYTES,
    STATE_ITEM,
    STATE_METADATA,
    DamagedStep,
    Examined,
)
from ._durable import StepSync, Sync, fsync_dir
from ._lock import DirectoryLock
from ._protocol import OpenedStep, StepIdentity

if TYPE_CHECKING:
    import tensorstore


class Local:
    """The steps of a checkpoint directory on a POSIX file system (a `StepStore`). A
    step is a real directory named by the step (`_format`'s module doc); a step being
    written or deleted has a temporary name of ours; every deletion checks with lstat
    that it removes a real directory, and `shutil.rmtree` follows no link inside it."""

    opened_at_once = 1  # threads cost more than they save here (`Storage.open_steps`)
    marks_items = False  # a step's rename commits its items

    def __init__(self, path: str) -> None:
        self.path = path

    def _step_path(self, step: int | str) -> str:
        return os.path.join(self.path, str(step))

    # -- what is there ------------------------------------------------------------------

    def examine_all(self) -> dict[int, Examined]:
        """{step: what its entry is} for every step-named entry (`_examine`); empty when
        the directory does not exist. Nothing in one entry stops the others from being
        examined; an entry removed while it is examined is left out, and the directory
        listed again: a writer's retention removes a step after it committed a newer one,
        which the first listing may not have named (with max_to_keep=1 the listing would
        hold no step at all, and a reader beside the run would say "no checkpoint")."""
        for _ in range(_LISTINGS):
            try:
                names = os.listdir(self.path)
            except (FileNotFoundError, NotADirectoryError):
                return {}
            except OSError as e:
                raise ConfigError(f"cannot list the checkpoint directory {self.path!r}: {e}") from e
            found = {int(n): self._examine(int(n)) for n in names if _format.is_step_name(n)}
            if all(f is not GONE for f in found.values()):
                break
        return {s: f for s, f in found.items() if f is not GONE}

    def _examine(self, step: int) -> Examined:
        """What the entry of `step` is: a real directory (no symlinks on the way) holding
        our `state` and `meta` items and the file Orbax writes when it finalizes a save,
        whose meta carries our format tag and the step of its folder's name, and matches
        the size and CRC-32 our record in the step file gives (steps written before the
        record: parsed whole, within `META_MAX_BYTES`). Remembered per file identity, so
        a step listed at every save's retention is read once."""
        path = self._step_path(step)
        try:  # every file is looked at through this descriptor: one directory throughout,
            # even if the step is renamed meanwhile (retention sets steps aside)
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        except FileNotFoundError:
            return GONE
        except PermissionError as e:
            return _unreadable(e)
        except OSError:
            return Examined("foreign", "not a directory")
        try:
            return _examine_dir(path, step, fd)
        except PermissionError as e:  # (a folder or file inside it this process may not read)
            return _unreadable(e)
        finally:
            os.close(fd)

    def is_checkpoint(self, step: int) -> bool:
        """`step` is a complete checkpoint of ours (what `examine_all` says of it)."""
        return self._examine(step).kind == "complete"

    def is_directory(self) -> bool:
        return os.path.isdir(self.path)

    def make(self) -> None:
        """Create the directory (and its parents) if it is not there."""
        os.makedirs(self.path, exist_ok=True)

    def identity(self) -> tuple[int, int] | None:
        """(device, inode) of the directory: tells it from one re-created in its place."""
        st = os.stat(self.path)
        return st.st_dev, st.st_ino

    def unfinished_steps(self) -> list[tuple[int, str]]:
        """(step, path) of every step of ours being written, or left by a killed writer:
        our temporary directories."""
        found = []
        for name in sorted(os.listdir(self.path)):
            match = _format.OURS_PATTERN.fullmatch(name)
            if match is not None and match.group(2) == "tmp" and not match.group(3):
                found.append((int(match.group(1)), os.path.join(self.path, name)))
        return found

    # -- one step, read -----------------------------------------------------------------

    def open_step(self, step: int) -> OpenedStep:
        """Checkpoint `step`, taken before its arrays are read: its identity and its
        `meta` item read within `META_MAX_BYTES` and checked as `_examine` checks it.
        `FileNotFoundError` when it is not a complete step of ours (gone, someone
        else's, unreadable), `DamagedStep` when it is damaged: the caller lists the
        directory to say which. `_examine` is remembered per file identity: a step
        just listed costs a few lstats more."""
        found = self._examine(step)
        if found.kind == "damaged":
            raise DamagedStep(found.why)
        path = self._step_path(step)
        if found.kind != "complete":
            raise FileNotFoundError(f"{path} is not a complete step")
        seen = self._step_identity(step)
        record = _format.record_of(
            _read_file(os.path.join(path, ORBAX_STEP_FILE), SMALL_FILE_MAX_BYTES)
        )
        text = _read_file(os.path.join(path, META_ITEM, META_FILE), META_MAX_BYTES)
        return OpenedStep(step, seen, _format.check_meta_bytes(text, step, record))

    def _step_identity(self, step: int) -> StepIdentity:
        """(device, inode) of the step's directory: tells it from one re-created under
        its name (a replacing save)."""
        st = os.stat(self._step_path(step))
        return st.st_dev, st.st_ino

    def still_there(self, step: int, seen: StepIdentity) -> bool:
        """Checkpoint `step` is still a checkpoint of ours, the same directory it was when
        a read began (not set aside by retention, nor replaced under its name)."""
        try:
            return self.is_checkpoint(step) and self._step_identity(step) == seen
        except OSError:
            return False

    # -- a step written -----------------------------------------------------------------

    def lock(self, name: str) -> DirectoryLock:
        """The directory's writer lock (`flock` on the file `name`)."""
        return DirectoryLock(self.path, name)

    def step_sync(self) -> StepSync:
        """How the next step is made durable (made before its first file is written)."""
        return StepSync(self.path)

    def temp_path(self, step: int, temp_name: str) -> str:
        """Where a step is written: a temporary name of ours, renamed at its commit."""
        return os.path.join(self.path, temp_name)

    def begin(self, temp: str, token: str = "") -> None:
        """Make the place a step is written to: its temporary directory and item folders
        (`token`, the lock's: for buckets only)."""
        os.makedirs(os.path.join(temp, STATE_ITEM))
        os.makedirs(os.path.join(temp, META_ITEM))

    def enter_attempt(self, temp: str, part: str) -> None:
        """A peer process's folder `part` in the attempt's temporary directory, which
        process 0 made: `FileNotFoundError` when process 0 has removed it again (it gave
        up on the step), rather than re-create a folder nobody removes."""
        try:
            os.mkdir(os.path.join(temp, STATE_ITEM, part))
        except FileExistsError:  # an earlier try of this process at this attempt
            pass

    def fence(self, name: str, token: str, check: Callable[[], None]) -> None:
        """Nothing to check locally: the `flock` is held for the Checkpointer's life."""

    def check_directory(self, identity: tuple[int, int] | None, lock: DirectoryLock) -> None:
        """The directory opened is still there, and is still the same directory: one
        removed (Orbax would silently re-create it) or replaced by another is an error,
        and nothing is written into the replacement."""
        if os.path.lexists(self.path) and not os.path.isdir(self.path):
            raise NotADirectoryError(f"{self.path!r} is no longer a directory")
        if not os.path.isdir(self.path):
            raise FileNotFoundError(
                f"the checkpoint directory {self.path!r} no longer exists (it was "
                "removed while the run was saving)"
            )
        if self.identity() != identity or not lock.still_ours():
            raise FileNotFoundError(
                f"the checkpoint directory {self.path!r} was replaced while the run "
                "was saving (removed and re-created, or its lock file removed); nothing "
                "is written into the replacement. Fix: do not remove the directory of a "
                "running Checkpointer; create a new Checkpointer to write there"
            )

    def commit(self, temp: str, final: str, nbytes: int, sync: Sync) -> None:
        """A complete step (of about `nbytes` bytes) becomes listed: its files made
        durable (`sync`, made before they were written), renamed into place (atomic),
        the directory fsynced."""
        sync.tree(temp, nbytes)
        os.rename(temp, final)
        fsync_dir(self.path)

    def clean_failed(self, name: str, token: str, error: BaseException) -> str | None:
        """A step that failed: its temporary directory removed now (a full disk is freed
        at once). None: nothing is left to remove later."""
        self.remove_temp(name, token)
        return None

    # -- steps going away ---------------------------------------------------------------

    def set_aside(self, step: int) -> str | None:
        """Unlist checkpoint `step`: renamed aside (atomic), for `remove_aside` to delete
        later. None (and nothing touched) when it is not a checkpoint of ours. Not
        fsynced: a crash that loses the rename gives the step back, complete, and the
        next retention sets it aside again; a crash after it leaves a leftover that the
        next opening removes."""
        if not self.is_checkpoint(step):
            return None
        aside = os.path.join(self.path, f"{step}.jax_cb_ckpt-deleting-{uuid.uuid4().hex}")
        os.rename(self._step_path(step), aside)
        # What is remembered of it goes with it: the memory holds the kept steps only.
        _TAGS.pop(os.path.join(self._step_path(step), META_ITEM, META_FILE), None)
        return aside

    def remove_step(self, step: int) -> bool:
        """Delete checkpoint `step`: unlisted first (atomic, made durable), then removed.
        False (and nothing touched) when `step` is not a checkpoint of ours."""
        aside = self.set_aside(step)
        if aside is None:
            return False
        fsync_dir(self.path)
        self.remove_aside(aside)
        return True

    def set_aside_damaged(self, step: int, why: str) -> str | None:
        """Move the damaged step `step` out of the steps, whole, under a name that is not
        a step (`_format.set_aside_name`), with a note saying `why`: the name, or None
        (nothing touched) when `step` is not a step folder of ours. The note is written
        inside first, then the folder renamed (atomic, then the directory fsynced): a
        kill at any instant leaves the step where it was (set aside again by the next
        restart, its note rewritten) or moved with its reason. Only a real directory
        that is ours (complete or damaged)."""
        path = self._step_path(step)
        if not _is_real_dir(path) or self._examine(step).kind == "foreign":
            return None
        name = _format.set_aside_name(step)
        note = os.path.join(path, _format.SET_ASIDE_NOTE)
        try:  # (never through a link; one that cannot be written keeps nothing in the way)
            _write_in(
                self.path,
                os.path.join(str(step), _format.SET_ASIDE_NOTE),
                _format.set_aside_note(step, why),
                os.O_TRUNC,
            )
        except OSError:
            pass
        try:
            os.rename(path, os.path.join(self.path, name))
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(note)  # the step stays as it was
            raise
        fsync_dir(self.path)
        _TAGS.pop(os.path.join(path, META_ITEM, META_FILE), None)
        return name

    def set_aside_steps(self) -> list[tuple[int, str, str]]:
        """(step, name, why) of every damaged step set aside here, by step."""
        try:
            names = os.listdir(self.path)
        except OSError:
            return []
        found = []
        for name in names:
            match = _format.SET_ASIDE_PATTERN.fullmatch(name)
            if match is None or not _is_real_dir(os.path.join(self.path, name)):
                continue
            try:
                note = _read_file(
                    os.path.join(self.path, name, _format.SET_ASIDE_NOTE), SMALL_FILE_MAX_BYTES
                )
            except (OSError, DamagedStep):
                note = None
            found.append((int(match.group(1)), name, _format.read_set_aside_note(note)))
        return sorted(found)

    def remove_aside(self, aside: str) -> None:
        _remove_ours(aside)

    def remove_temp(self, name: str, writer: str = "") -> None:
        """Delete one attempt's temporary directory and Orbax's inside-out temporary of
        it (`writer`: for buckets only)."""
        _remove_ours(os.path.join(self.path, name))
        _remove_ours(os.path.join(self.path, name + ".orbax-checkpoint-tmp"))

    def remove_run_temps(self, run: str) -> None:
        """Delete every temporary directory of the multi-process run `run`: called when a
        step was committed, after which none of its earlier attempts is written to (a
        late process may have re-created the one of an attempt that had failed)."""
        self._remove_our_temporaries(f".jax_cb_ckpt-tmp-{run[:24]}")

    def clean_leftovers(self, dead_writer: str = "") -> list[str]:
        """Remove what a killed writer of ours left: temporaries and half-done
        deletions. Nothing else is removed; nothing is left to report here."""
        self._remove_our_temporaries()
        legacy = os.path.join(self.path, _format.LEGACY_DELETED)
        if _is_real_dir(legacy):  # a symlink here is never followed, only ignored
            shutil.rmtree(legacy, ignore_errors=True)
        return []

    def _remove_our_temporaries(self, marker: str = "") -> None:
        """Delete our temporary names in the directory (those holding `marker`)."""
        try:
            names = os.listdir(self.path)
        except OSError:
            return
        for name in names:
            if marker in name and _format.OURS_PATTERN.fullmatch(name):
                _remove_ours(os.path.join(self.path, name))


class LocalChunks:
    """The files of a checkpoint directory on a POSIX file system (a `ChunkStore`):
    small files read and written never through a link, a link made as a hard link,
    and TensorStore's `file` driver for the arrays."""

    def __init__(self, path: str) -> None:
        self.path = path

    def location(self, name: str) -> str:
        return os.path.join(self.path, name)

    def names(self, prefix: str) -> list[str]:
        """The entries of the directory whose names start with `prefix`."""
        return [n for n in os.listdir(self.path) if n.startswith(prefix)]

    def exists(self, name: str) -> bool:
        """Something (a file, directory or link) is at `name` in the directory."""
        return os.path.lexists(os.path.join(self.path, name))

    def size(self, name: str) -> int | None:
        """Bytes on disk under the entry `name`."""
        total = 0
        for root, _dirs, files in os.walk(os.path.join(self.path, name)):
            for file in files:
                try:
                    total += os.lstat(os.path.join(root, file)).st_size
                except OSError:  # removed meanwhile
                    pass
        return total

    def changed(self, name: str) -> str | None:
        """When the entry `name` was last changed (UTC, ISO 8601), or None."""
        try:
            seconds = os.stat(os.path.join(self.path, name)).st_mtime
        except OSError:
            return None
        return datetime.datetime.fromtimestamp(seconds, datetime.UTC).isoformat(
            timespec="milliseconds"
        )

    def links_under(self, name: str) -> list[str]:
        """Symlinks anywhere under `name`, a step (one of ours has none: reading one
        could read outside the directory)."""
        found = []
        for root, dirs, files in os.walk(self.location(name)):
            found += [
                os.path.join(root, n) for n in dirs + files if os.path.islink(os.path.join(root, n))
            ]
        return found

    def files_in(self, folder: str) -> list[str]:
        """The names of the regular files right in the folder `folder` (a name; none
        when it is missing; never through a link)."""
        path = os.path.join(self.path, folder)
        _no_link_on_the_way(self.path, folder)
        try:
            entries = list(os.scandir(path))
        except FileNotFoundError:
            return []
        return sorted(e.name for e in entries if e.is_file(follow_symlinks=False))

    def get(self, name: str, limit: int) -> bytes | None:
        """Up to `limit` bytes of the file `name` (None when there is none; `OSError`
        when it is not a regular file: a FIFO planted there must not block a reader)."""
        try:
            with _open_regular(os.path.join(self.path, name)) as f:
                return f.read(limit)
        except FileNotFoundError:
            return None

    def get_within(self, name: str, limit: int) -> bytes | None:
        """The small file `name` (a path in the directory: `<step>/meta/...`), whoever
        wrote it, read within `limit` bytes (`DamagedStep` beyond); None when it is not
        there, or not a regular file reached without a link."""
        parts = name.split("/")
        flags = os.O_RDONLY | os.O_NOFOLLOW
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY)
        except OSError:
            return None
        try:
            for part in parts[:-1]:  # every folder on the way: a real one, no link
                inner = os.open(part, flags | os.O_DIRECTORY, dir_fd=fd)
                os.close(fd)
                fd = inner
            if not _is_in(fd, parts[-1], stat.S_ISREG):
                return None
            return _read_in(fd, parts[-1], limit)
        except OSError:
            return None
        finally:
            os.close(fd)

    def put(self, name: str, data: bytes) -> None:
        """The file `name` of the directory now holds `data` (never through a link; a
        report, read by `jax-cb-ckpt ls`: a torn write is an unreadable report, not a
        step)."""
        _write_in(self.path, name, data, os.O_TRUNC)

    def create(self, name: str, data: bytes) -> None:
        """A new file `name` in the directory holding `data` (never through a link)."""
        _write_in(self.path, name, data, os.O_EXCL)

    def write(self, path: str, data: bytes) -> None:
        """A small file of a step (not fsynced here: `commit` syncs the step), in its
        item's folder (made here for an item `begin` did not make: `extra`)."""
        folder = os.path.dirname(path)
        if not os.path.isdir(folder):
            os.mkdir(folder)
        with open(path, "wb") as f:
            f.write(data)

    def link(self, source: str, target: str) -> None:
        """The file `target` (a name in the directory, its folder made if missing) is a
        hard link to the file `source`: the same bytes, none copied (`FileExistsError`
        when `target` is there; never through a link: `source` must be a regular
        file, and no folder on the way to either is a link: a hostile directory's
        symlinked folder would link a file from outside in, or ours out)."""
        path = os.path.join(self.path, source)
        _no_link_on_the_way(self.path, source)
        if not stat.S_ISREG(os.lstat(path).st_mode):
            raise OSError(f"{path} is not a regular file: not linked")
        target_path = os.path.join(self.path, target)
        _no_link_on_the_way(self.path, target)
        os.makedirs(os.path.dirname(target_path), exist_ok=True)
        os.link(path, target_path, follow_symlinks=False)

    def delete(self, name: str) -> None:
        """Remove the file `name`: a regular file only (lstat: never a link)."""
        path = os.path.join(self.path, name)
        if stat.S_ISREG(os.lstat(path).st_mode):
            os.unlink(path)

    def kvstore_spec(self, path: str) -> dict[str, Any]:
        """TensorStore's key-value store for writing under `path` (a step's item). Files
        are written non-atomically: data files are named by a random hash and referenced
        only once complete, and the whole step is a temporary directory."""
        return {
            "driver": "file",
            "path": path.rstrip("/") + "/",
            "file_io_locking": {"mode": "non_atomic"},
        }

    def needed(self, database: str) -> set[str] | None:
        """The data files (relative to the folder `database`, an OCDBT database's) its
        latest version needs (`_ocdbt.Database.data_files`); None for an index the
        package's reader does not read (TensorStore's to read: nothing is known)."""
        try:
            return _ocdbt.Database(os.path.join(self.path, database)).data_files()
        except _ocdbt.Unsupported:
            return None

    def index(self, opened: OpenedStep) -> _ocdbt.Database:
        """The opened step's state item's index, read without TensorStore (`_ocdbt`);
        raises `_ocdbt.Unsupported` for a database that reader does not read."""
        return _ocdbt.Database(os.path.join(self.location(str(opened.step)), STATE_ITEM))

    def database(
        self,
        opened: OpenedStep,
        ts: ModuleType,
        context: tensorstore.Context,
        leaves: int = 1,
    ) -> tensorstore.KvStore:
        """The opened step's state item (its OCDBT database), opened for reading
        (`leaves`: how many the read will ask for, for `BucketChunks.database`)."""
        state = os.path.join(self.location(str(opened.step)), STATE_ITEM)
        spec = {
            "driver": "ocdbt",
            "base": {"driver": "file", "path": state + "/"},
            "cache_pool": "cache_pool#nodes",
        }
        return ts.KvStore.open(spec, context=context).result()


def _write_in(directory: str, name: str, data: bytes, how: int) -> None:
    """`data` into the file `name` of `directory` opened with `how` (O_EXCL: new;
    O_TRUNC: anew), never through a link."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | how
    fd = os.open(os.path.join(directory, name), flags, 0o644)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


def _is_real_dir(path: str) -> bool:
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def _no_link_on_the_way(root: str, name: str) -> None:
    """`OSError` when a folder on the way from `root` to the file `name` (a path in it)
    is there but is not a real folder (a symlink, a file); one not there yet passes."""
    folder = root
    for part in name.split("/")[:-1]:
        folder = os.path.join(folder, part)
        if os.path.lexists(folder) and not _is_real_dir(folder):
            raise OSError(f"{folder} is not a folder of the directory (a link?): not linked")


def _remove_ours(path: str) -> None:
    """Delete a directory we made (never a symlink: lstat, and rmtree refuses links)."""
    if _is_real_dir(path):
        shutil.rmtree(path, ignore_errors=True)


def _read_file(path: str, limit: int) -> bytes:
    """A small file of a step, read no further than `limit` (`DamagedStep` beyond)."""
    with _open_regular(path) as f:
        return _format.within(path, f.read(limit + 1), limit)


def _open_regular(path: str) -> BinaryIO:
    """`path` open for reading, or `OSError` when it is not a regular file: opened
    with O_NONBLOCK, so that a FIFO planted in its place (hostile input) is refused
    instead of blocking the reader until someone writes to it."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{path} is not a regular file: not read")
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


# How many times `examine_all` lists the directory when an entry listed was removed
# before it was examined (a writer's retention), before it keeps what it found.
_LISTINGS = 3

# {meta file: (its, the step file's and Orbax's state/_METADATA's lstat identities when
# read, what was found)}: a step whose files are unchanged since is what it was (the
# items' folders go with the files in them). A step set aside leaves it, so a writer's
# retention keeps it at the kept steps (a long run's memory does not grow with its
# saves); steps removed by hand leave it at the next clearing.
_TAGS: dict[str, tuple[tuple[Any, ...], Examined]] = {}


def _examine_dir(path: str, step: int, fd: int) -> Examined:
    meta = f"{META_ITEM}/{META_FILE}"
    st_meta, st_step = _lstat_in(fd, meta), _lstat_in(fd, ORBAX_STEP_FILE)
    st_state = _lstat_in(fd, f"{STATE_ITEM}/{STATE_METADATA}")
    seen = tuple(_stat_key(st) for st in (st_meta, st_step, st_state))
    key = os.path.join(path, META_ITEM, META_FILE)
    known = _TAGS.get(key)
    if known is not None and known[0] == seen:
        return known[1]
    found = _examine_files(fd, step, st_meta, st_step)
    if found.kind != "complete" and not _still_at(path, fd):
        # Removed or set aside while it was examined: say nothing of it.
        return GONE
    if len(_TAGS) >= 4096:
        _TAGS.clear()
    _TAGS[key] = (seen, found)
    return found


def _lstat_in(fd: int, name: str) -> os.stat_result | None:
    """`name`'s lstat in the directory open as `fd`; None when it is not there (a
    refused permission is raised: what is there cannot be told)."""
    try:
        return os.lstat(name, dir_fd=fd)
    except PermissionError:
        raise
    except OSError:
        return None


def _unreadable(e: PermissionError) -> Examined:
    where = f" ({e.filename})" if e.filename else ""
    return Examined("unreadable", f"this process may not read it: {e.strerror}{where}")


def _still_at(path: str, fd: int) -> bool:
    """The directory open as `fd` is still the one named `path`."""
    try:
        now, then = os.lstat(path), os.fstat(fd)
    except OSError:
        return False
    return (now.st_dev, now.st_ino) == (then.st_dev, then.st_ino)


def _stat_key(st: os.stat_result | None) -> tuple[int, ...] | None:
    if st is None:
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_mode)


def _read_in(fd: int, name: str, limit: int) -> bytes:
    """A small file `name` in the directory open as `fd` (not a link), read no further
    than `limit`."""
    file = os.open(name, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=fd)
    with os.fdopen(file, "rb") as f:
        return _format.within(name, f.read(limit + 1), limit)


def _is_in(fd: int, name: str, kind: Callable[[int], bool]) -> bool:
    st = _lstat_in(fd, name)
    return st is not None and kind(st.st_mode)


def _examine_files(
    fd: int, step: int, st_meta: os.stat_result | None, st_step: os.stat_result | None
) -> Examined:
    """What the step directory open as `fd` is, from its files (`Local._examine`)."""
    record = None
    if st_step is not None and stat.S_ISREG(st_step.st_mode):
        try:
            record = _format.record_of(_read_in(fd, ORBAX_STEP_FILE, SMALL_FILE_MAX_BYTES))
        except PermissionError:
            raise  # (`_examine`: unreadable, not damaged)
        except (OSError, ValueError):
            record = None
    if st_meta is None and record is None:
        return Examined("foreign", f"no '{META_ITEM}' item of jax_cb_ckpt")
    for item in (STATE_ITEM, META_ITEM):
        if not _is_in(fd, item, stat.S_ISDIR):
            return Examined("damaged", f"its '{item}' item is missing")
    if st_step is None or not stat.S_ISREG(st_step.st_mode):
        return Examined("damaged", f"Orbax's step file {ORBAX_STEP_FILE} is missing")
    if not _is_in(fd, f"{STATE_ITEM}/{STATE_METADATA}", stat.S_ISREG):
        return Examined("damaged", f"'{STATE_ITEM}/{STATE_METADATA}' is missing")
    if st_meta is None or not stat.S_ISREG(st_meta.st_mode):
        return Examined("damaged", f"'{META_ITEM}/{META_FILE}' is missing")
    try:
        text = _read_in(fd, f"{META_ITEM}/{META_FILE}", META_MAX_BYTES)
        _format.check_meta_bytes(text, step, record)
    except DamagedStep as e:
        return Examined(e.kind, str(e))
    except PermissionError:
        raise  # (`_examine`: unreadable, not damaged)
    except OSError as e:
        return Examined("damaged", f"'{META_ITEM}/{META_FILE}' cannot be read ({e.strerror})")
    return COMPLETE
