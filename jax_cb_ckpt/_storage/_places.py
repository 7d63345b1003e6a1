"""Where checkpoints live, chosen once: a local directory or a prefix in a bucket.

`at(directory)` (a path or URL `resolve` made canonical) gives the one object
that knows where the steps are: `Local` (a POSIX directory: real directories, temporary
names, renames, lstat before every deletion) or `Bucket` (`gs://`, `s3://`: keys under a
prefix, our marker and Orbax's commit marker, no rename). Both have the same verbs, and
the modules that read checkpoints (`_steps`, `_restore`, `_arrays`, the CLI), the writer,
the lock and the multi-process check call them without a branch of their own:

- what each step-named entry is: `examine`, `examine_all`, `list_steps`, ...;
- a step read before its arrays and checked after: `open_step` (its identity and its
  checked description at once), `still_there`, `symlinks_inside`;
- its arrays' database, opened for reading: `database`;
- a step written: `lock`, `step_sync`, `temp_path`, `kvstore_spec` (TensorStore's
  store for its arrays), `begin`, `enter_attempt`, `write_file`, `write_meta`, `fence`,
  `check_directory`, `commit`, `clean_failed`;
- small files of the directory (the multi-process check's nonce): `names`,
  `create_file`, `read_file`, `remove_file`;
- how steps go away: `set_aside`, `remove_aside`, `remove_step`,
  `remove_temp`, `clean_leftovers`, `remove_run_temps`; and how a damaged step a
  restart passed over is kept out of the way: `set_aside_damaged`, `set_aside_steps`.

What counts as a step (names, the files of a whole step and their bytes, the checks of
its description) is `_format`'s; the one place that asks which kind a location is,
is `at`.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import re
import shutil
import stat
import threading
import uuid
from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING, Any

from .._base._errors import ConfigError
from .._layout import _format, _ocdbt
from .._layout._format import (
    COMMIT_NAME,
    COMPLETE,
    FORMAT,
    GONE,
    ITEMS,
    META_FILE,
    META_ITEM,
    META_MAX_BYTES,
    ORBAX_STEP_FILE,
    OURS_NAME,
    SMALL_FILE_MAX_BYTES,
    STATE_ITEM,
    STATE_METADATA,
    DamagedStep,
    Examined,
)
from . import _remote
from ._durable import StepSync, fsync_dir
from ._lock import DirectoryLock, ObjectLock

if TYPE_CHECKING:
    import tensorstore

# The OCDBT database's root, read once per step from a bucket (`Bucket.database`).
_MANIFEST = _ocdbt.MANIFEST
_MANIFEST_KEY = f"{STATE_ITEM}/{_MANIFEST}"  # under the step
# A bucket's step of at most this many bytes in its database is read at once, its index
# by `_ocdbt` (`Bucket.index`); a larger one by TensorStore, range by range.
HELD_BYTES = 8 << 20

# What a step is, taken before it is read and compared after (a step replaced under its
# name, or removed, is another): (device, inode) of its directory; in a bucket
# ("object", its commit marker's generation).
StepIdentity = tuple[int, int] | tuple[str, bytes]


_URL = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)://")  # gs://, s3://, file://, ...

# A storage URL with a slash missing (s3:/x, gs:bucket), not a local name like "exp:1".
_URL_SLIP = re.compile(r"(gs|gcs|s3|s3a|hdfs|file|az|abfs|https?):/?(?!/)", re.IGNORECASE)


def resolve(directory: object, where: str) -> str:
    """The absolute path of a checkpoint directory argument, or a `ConfigError`.

    Every public function takes the same forms: a non-empty str or os.PathLike,
    absolute or relative to the working directory (Orbax itself wants absolute paths).
    """
    if not isinstance(directory, (str, os.PathLike)):
        raise ConfigError(
            f"{where}: directory must be a str or os.PathLike, got "
            f"{type(directory).__name__} ({directory!r})."
        )
    path = os.fspath(directory)
    if not isinstance(path, str) or not path:
        raise ConfigError(
            f"{where}: directory is empty ({directory!r}). Fix: name the checkpoint "
            "directory, e.g. 'runs/exp1' (use '.' to mean the working directory)."
        )
    if "\0" in path:
        raise ConfigError(f"{where}: directory {path!r} contains a NUL character.")
    if _URL.match(path):
        return _remote.canonical(path, where)
    slip = _URL_SLIP.match(path)
    if slip:
        # Taken as a local path, "s3:/bucket/run" is a folder "s3:" in the working
        # directory: a run that looks checkpointed until its machine is gone.
        raise ConfigError(
            f"{where}: directory {path!r} looks like a {slip.group(1)}:// URL with a "
            f"slash missing, and would be taken for a local folder named "
            f"{slip.group(1) + ':'!r}. Fix: write {slip.group(1)}://bucket/path, or "
            "./" + f"{path} if a local folder of that name is really meant."
        )
    # realpath, not abspath: `link/../x` must name the directory the OS means (abspath
    # would drop `link/..` without following the link).
    return os.path.realpath(path)


def at(directory: str) -> Local | Bucket:
    """The storage of a checkpoint directory (canonical: `resolve`)."""
    return Bucket(directory) if _remote.is_url(directory) else Local(directory)


class _Steps:
    """What both kinds of storage derive from `examine_all`."""

    path: str

    def examine_all(self) -> dict[int, Examined]:
        raise NotImplementedError

    def examine(self, step: int) -> Examined:
        raise NotImplementedError

    def step_path(self, step: int | str) -> str:
        raise NotImplementedError

    def list_steps(self) -> list[int]:
        """Steps with a complete checkpoint here, ascending."""
        return sorted(s for s, found in self.examine_all().items() if found.kind == "complete")

    def is_checkpoint(self, step: int) -> bool:
        """`step` is a complete checkpoint of ours (`examine`)."""
        return self.examine(step).kind == "complete"

    def foreign_steps(self) -> list[int]:
        """Step-like names that are not complete checkpoints of ours (for messages: a
        plain Orbax checkpoint, an empty or half-copied directory)."""
        try:
            found = self.examine_all()
        except ConfigError:
            return []
        return sorted(s for s, f in found.items() if f.kind != "complete")

    def damaged_steps(self) -> dict[int, str]:
        """{step: what is wrong} for the steps of ours that are damaged."""
        return {s: f.why for s, f in sorted(self.examine_all().items()) if f.kind == "damaged"}

    def remove_step(self, step: int) -> bool:
        """Delete checkpoint `step`: unlisted first (atomic), then removed. False (and
        nothing touched) when `step` is not a checkpoint of ours."""
        aside = self.set_aside(step)
        if aside is None:
            return False
        self._after_set_aside()
        self.remove_aside(aside)
        return True

    def set_aside(self, step: int) -> str | None:
        raise NotImplementedError

    def remove_aside(self, aside: str) -> None:
        raise NotImplementedError

    def set_aside_damaged(self, step: int, why: str) -> str | None:
        """Move the damaged step `step` out of the steps, whole, under a name that is not
        a step (`_format.set_aside_name`), with a note saying `why`: the name, or None
        (nothing touched) when `step` is not a step folder of ours."""
        raise NotImplementedError

    def set_aside_steps(self) -> list[tuple[int, str, str]]:
        """(step, name, why) of every damaged step set aside here, by step."""
        raise NotImplementedError

    def step_file(self, step: int, name: str, limit: int) -> bytes | None:
        """The small file `name` (a path inside the step folder) of the step-named
        entry `step`, whoever wrote it, read within `limit` bytes (`DamagedStep`
        beyond); None when it is not there (or, locally, not a regular file reached
        without a link)."""
        raise NotImplementedError

    def _after_set_aside(self) -> None:
        pass

    def write_file(self, path: str, data: bytes) -> None:
        raise NotImplementedError

    def write_meta(self, temp: str, meta: dict[str, Any]) -> None:
        """A step's `meta` item, then Orbax's step file holding our record of it
        (`_format.meta_files`), into the step being written at `temp`."""
        for name, data in _format.meta_files(meta).items():
            self.write_file(os.path.join(temp, name), data)


# -- a local directory ------------------------------------------------------------------


class Local(_Steps):
    """A checkpoint directory on a POSIX file system. A step is a real directory named
    by the step (`_format`'s module doc); a step being written or deleted has a
    temporary name of ours; every deletion checks with lstat that it removes a real
    directory, and `shutil.rmtree` follows no link inside it."""

    def __init__(self, path: str) -> None:
        self.path = path

    def step_path(self, step: int | str) -> str:
        return os.path.join(self.path, str(step))

    # -- what is there ------------------------------------------------------------------

    def examine_all(self) -> dict[int, Examined]:
        """{step: what its entry is} for every step-named entry (`examine`); empty when
        the directory does not exist. Nothing in one entry stops the others from being
        examined; an entry removed while it is examined is left out."""
        try:
            names = os.listdir(self.path)
        except (FileNotFoundError, NotADirectoryError):
            return {}
        except OSError as e:
            raise ConfigError(f"cannot list the checkpoint directory {self.path!r}: {e}") from e
        found = {int(n): self.examine(int(n)) for n in names if _format.is_step_name(n)}
        return {s: f for s, f in found.items() if f is not GONE}

    def examine(self, step: int) -> Examined:
        """What the entry of `step` is: a real directory (no symlinks on the way) holding
        our `state` and `meta` items and the file Orbax writes when it finalizes a save,
        whose meta carries our format tag and the step of its folder's name, and matches
        the size and CRC-32 our record in the step file gives (steps written before the
        record: parsed whole, within `META_MAX_BYTES`). Remembered per file identity, so
        a step listed at every save's retention is read once."""
        path = self.step_path(step)
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

    def exists(self, name: str) -> bool:
        """Something (a file, directory or link) is at `name` in the directory."""
        return os.path.lexists(os.path.join(self.path, name))

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

    def entry_bytes(self, name: str) -> int | None:
        """Bytes on disk under the entry `name`."""
        total = 0
        for root, _dirs, files in os.walk(os.path.join(self.path, name)):
            for file in files:
                try:
                    total += os.lstat(os.path.join(root, file)).st_size
                except OSError:  # removed meanwhile
                    pass
        return total

    def entry_time(self, name: str) -> str | None:
        """When the entry `name` was last changed (UTC, ISO 8601), or None."""
        try:
            seconds = os.stat(os.path.join(self.path, name)).st_mtime
        except OSError:
            return None
        return datetime.datetime.fromtimestamp(seconds, datetime.UTC).isoformat(
            timespec="milliseconds"
        )

    # -- one step, read -----------------------------------------------------------------

    # `open_step` does not check that the step is complete: `_steps.pick_step` lists.
    open_checks_step = False

    def open_step(self, step: int) -> tuple[StepIdentity, dict[str, Any]]:
        """(the identity of checkpoint `step`, its `meta` item read within
        `META_MAX_BYTES` and checked as `examine` checks it: `DamagedStep`), taken
        before its arrays are read. `FileNotFoundError` when it is gone."""
        path = self.step_path(step)
        seen = self.step_identity(step)
        record = _format.record_of(
            _read_file(os.path.join(path, ORBAX_STEP_FILE), SMALL_FILE_MAX_BYTES)
        )
        text = _read_file(os.path.join(path, META_ITEM, META_FILE), META_MAX_BYTES)
        return seen, _format.check_meta_bytes(text, step, record)

    def step_identity(self, step: int) -> StepIdentity:
        """(device, inode) of the step's directory: tells it from one re-created under
        its name (a replacing save)."""
        st = os.stat(self.step_path(step))
        return st.st_dev, st.st_ino

    def still_there(self, step: int, seen: StepIdentity) -> bool:
        """Checkpoint `step` is still a checkpoint of ours, the same directory it was when
        a read began (not set aside by retention, nor replaced under its name)."""
        try:
            return self.is_checkpoint(step) and self.step_identity(step) == seen
        except OSError:
            return False

    def symlinks_inside(self, step: int) -> list[str]:
        """Symlinks anywhere in the step (one of ours has none: reading one could read
        outside the directory)."""
        found = []
        for root, dirs, files in os.walk(self.step_path(step)):
            found += [
                os.path.join(root, n) for n in dirs + files if os.path.islink(os.path.join(root, n))
            ]
        return found

    def index(self, step: int) -> _ocdbt.Database:
        """The step's state item's index, read without TensorStore (`_ocdbt`); raises
        `_ocdbt.Unsupported` for a database that reader does not read."""
        return _ocdbt.Database(os.path.join(self.step_path(step), STATE_ITEM))

    def database(
        self, step: int, ts: ModuleType, context: tensorstore.Context, leaves: int = 1
    ) -> tensorstore.KvStore:
        """The step's state item (its OCDBT database), opened for reading (`leaves`:
        how many the read will ask for, for `Bucket.database`)."""
        state = os.path.join(self.step_path(step), STATE_ITEM)
        spec = {
            "driver": "ocdbt",
            "base": {"driver": "file", "path": state + "/"},
            "cache_pool": "cache_pool#nodes",
        }
        return ts.KvStore.open(spec, context=context).result()

    # -- a step written -----------------------------------------------------------------

    # The primary writes Orbax's description files while the arrays commit (a local
    # step is listed only by its rename, after everything): see the writer.
    describes_early = True

    def lock(self, name: str) -> DirectoryLock:
        """The directory's writer lock (`flock` on the file `name`)."""
        return DirectoryLock(self.path, name)

    def step_sync(self) -> StepSync:
        """How the next step is made durable (made before its first file is written)."""
        return StepSync(self.path)

    def temp_path(self, step: int, temp_name: str) -> str:
        """Where a step is written: a temporary name of ours, renamed at its commit."""
        return os.path.join(self.path, temp_name)

    def kvstore_spec(self, path: str) -> dict[str, Any]:
        """TensorStore's key-value store for writing under `path` (a step's item). Files
        are written non-atomically: data files are named by a random hash and referenced
        only once complete, and the whole step is a temporary directory."""
        return {
            "driver": "file",
            "path": path.rstrip("/") + "/",
            "file_io_locking": {"mode": "non_atomic"},
        }

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

    def write_file(self, path: str, data: bytes) -> None:
        """A small file of a step (not fsynced here: `commit` syncs the step)."""
        with open(path, "wb") as f:
            f.write(data)

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

    # -- small files of the directory ---------------------------------------------------

    def names(self, prefix: str) -> list[str]:
        """The entries of the directory whose names start with `prefix`."""
        return [n for n in os.listdir(self.path) if n.startswith(prefix)]

    def create_file(self, name: str, data: bytes) -> None:
        """A new file `name` in the directory holding `data` (never through a link)."""
        self._write_file(name, data, os.O_EXCL)

    def put_file(self, name: str, data: bytes) -> None:
        """The file `name` of the directory now holds `data` (never through a link; a
        report, read by `jax-cb-ckpt ls`: a torn write is an unreadable report, not a
        step)."""
        self._write_file(name, data, os.O_TRUNC)

    def _write_file(self, name: str, data: bytes, how: int) -> None:
        """`data` into the file `name` opened with `how` (O_EXCL: new; O_TRUNC: anew)."""
        flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | how
        fd = os.open(os.path.join(self.path, name), flags, 0o644)
        try:
            os.write(fd, data)
        finally:
            os.close(fd)

    def read_file(self, name: str, limit: int) -> bytes | None:
        """Up to `limit` bytes of the file `name` (None when there is none)."""
        try:
            with open(os.path.join(self.path, name), "rb") as f:
                return f.read(limit)
        except FileNotFoundError:
            return None

    def remove_file(self, name: str) -> None:
        """Remove the file `name`: a regular file only (lstat: never a link)."""
        path = os.path.join(self.path, name)
        if stat.S_ISREG(os.lstat(path).st_mode):
            os.unlink(path)

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
        os.rename(self.step_path(step), aside)
        # What is remembered of it goes with it: the memory holds the kept steps only.
        _TAGS.pop(os.path.join(self.step_path(step), META_ITEM, META_FILE), None)
        return aside

    def _after_set_aside(self) -> None:
        fsync_dir(self.path)

    def set_aside_damaged(self, step: int, why: str) -> str | None:
        """`_Steps.set_aside_damaged`: renamed (atomic, then the directory fsynced), the
        note written inside. Only a real directory that is ours (complete or damaged)."""
        path = self.step_path(step)
        if not _is_real_dir(path) or self.examine(step).kind == "foreign":
            return None
        name = _format.set_aside_name(step)
        os.rename(path, os.path.join(self.path, name))
        fsync_dir(self.path)
        _TAGS.pop(os.path.join(path, META_ITEM, META_FILE), None)
        note = os.path.join(self.path, name, _format.SET_ASIDE_NOTE)
        try:  # (moved already: a note that cannot be written does not undo that)
            with open(note, "wb") as f:
                f.write(_format.set_aside_note(step, why))
        except OSError:
            pass
        return name

    def step_file(self, step: int, name: str, limit: int) -> bytes | None:
        parts = [str(step), *name.split("/")]
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

    def set_aside_steps(self) -> list[tuple[int, str, str]]:
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

    def step_writer(self, name: str) -> str | None:
        return None  # a local step has no marker: it is ours by its temporary name

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


def _is_real_dir(path: str) -> bool:
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def _remove_ours(path: str) -> None:
    """Delete a directory we made (never a symlink: lstat, and rmtree refuses links)."""
    if _is_real_dir(path):
        shutil.rmtree(path, ignore_errors=True)


def _read_file(path: str, limit: int) -> bytes:
    """A small file of a step, read no further than `limit` (`DamagedStep` beyond)."""
    with open(path, "rb") as f:
        return _format.within(path, f.read(limit + 1), limit)


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
    """What the step directory open as `fd` is, from its files (`Local.examine`)."""
    record = None
    if st_step is not None and stat.S_ISREG(st_step.st_mode):
        try:
            record = _format.record_of(_read_in(fd, ORBAX_STEP_FILE, SMALL_FILE_MAX_BYTES))
        except PermissionError:
            raise  # (`examine`: unreadable, not damaged)
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
        raise  # (`examine`: unreadable, not damaged)
    except OSError as e:
        return Examined("damaged", f"'{META_ITEM}/{META_FILE}' cannot be read ({e.strerror})")
    return COMPLETE


# -- a prefix in a bucket ---------------------------------------------------------------


class Bucket(_Steps):
    """A checkpoint directory that is a prefix in a GCS or S3 bucket (`_remote`). A
    step's objects are written under its final name, our marker first and Orbax's
    commit marker last; only a step holding both (and the files of a whole step) is
    listed. Deleting a step removes its commit marker first (unlisted at once), our
    marker last (`_format`'s module doc)."""

    def __init__(self, url: str) -> None:
        self.path = url
        # (step, its OCDBT manifest, its keys) of the step `open_step` read last, for
        # `index` and `database`.
        self._opened: tuple[int, bytes | None, list[str]] | None = None
        self._manifests_lock = threading.Lock()

    def step_path(self, step: int | str) -> str:
        return f"{self.path}/{step}"

    # -- what is there ------------------------------------------------------------------

    def examine_all(self) -> dict[int, Examined]:
        return {int(n): _examine_keys(keys) for n, keys in self._objects_by_step().items()}

    def examine(self, step: int) -> Examined:
        """From the keys under the step: every object of a complete step is there; one
        with our marker or commit marker and not all of them is damaged; `open_step`
        checks the description files as `Local.examine` does."""
        return _examine_keys(set(_remote.list_keys(self.step_path(step))))

    def _objects_by_step(self) -> dict[str, set[str]]:
        """{step name: the keys under it} for every step-named prefix."""
        try:
            keys = _remote.list_keys(self.path)
        except _remote.StorageError as e:
            raise ConfigError(f"cannot list the checkpoint directory {self.path!r}: {e}") from e
        by_step: dict[str, set[str]] = {}
        for key in keys:
            name, _, rest = key.partition("/")
            if rest and _format.is_step_name(name):
                by_step.setdefault(name, set()).add(rest)
        return by_step

    def exists(self, name: str) -> bool:
        """Any object is under the prefix `name`."""
        return bool(_remote.list_keys(f"{self.path}/{name}"))

    def is_directory(self) -> bool:
        return True  # a prefix needs no making

    def make(self) -> None:
        pass  # a prefix needs no making

    def identity(self) -> tuple[int, int] | None:
        return None  # a prefix is not re-created: the lock object says whose it is

    def unfinished_steps(self) -> list[tuple[int, str]]:
        """(step, URL) of every step with our marker and no commit marker: being
        written, or left by a killed writer."""
        return [
            (int(name), self.step_path(name))
            for name, keys in sorted(self._objects_by_step().items())
            if OURS_NAME in keys and COMMIT_NAME not in keys
        ]

    def entry_bytes(self, name: str) -> int | None:
        return None  # a listing gives no sizes

    def entry_time(self, name: str) -> str | None:
        return None

    # -- one step, read -----------------------------------------------------------------

    # `open_step` examines the step from a listing of its own objects, sent with its
    # reads: `_steps.pick_step` need not list the directory first for a named step.
    open_checks_step = True

    def open_step(self, step: int) -> tuple[StepIdentity, dict[str, Any]]:
        """`Local.open_step`, in one round trip: the step's objects are listed (the step
        is complete: `examine`) while its commit marker (whose generation is the step's
        identity), Orbax's step file, the meta item and the OCDBT manifest are read.
        `FileNotFoundError` for a step that is not there, `DamagedStep` for a damaged
        one. The manifest is kept for `database`, which reads the step next. An object
        is read whole before its size is checked (TensorStore refuses a byte range past
        an object's end, and a listing gives no sizes)."""
        path = self.step_path(step)
        names = [COMMIT_NAME, ORBAX_STEP_FILE, f"{META_ITEM}/{META_FILE}", _MANIFEST_KEY]
        keys, (marker, (step_bytes, _), (text, _), (manifest, _)) = _remote.list_and_read(
            path, names
        )
        found = _examine_keys(set(keys))
        if found.kind == "damaged":
            raise _format.DamagedStep(found.why)
        if found.kind != "complete" or marker[0] is None:
            raise FileNotFoundError(f"{path} is not a complete step")
        step_file, meta = f"{path}/{ORBAX_STEP_FILE}", f"{path}/{META_ITEM}/{META_FILE}"
        for name, data in ((step_file, step_bytes), (meta, text)):
            if data is None:
                raise FileNotFoundError(f"{name} does not exist")
        step_bytes = _format.within(step_file, step_bytes or b"", SMALL_FILE_MAX_BYTES)
        record = _format.record_of(step_bytes)
        text = _format.within(meta, text or b"", META_MAX_BYTES)
        described = _format.check_meta_bytes(text, step, record)
        with self._manifests_lock:  # one, the step read next: threads may share this
            self._opened = (step, manifest, keys)
        return ("object", marker[1]), described

    def step_identity(self, step: int) -> StepIdentity:
        """The generation of the step's commit marker (a step is committed once)."""
        data, generation = _remote.read(f"{self.step_path(step)}/{COMMIT_NAME}")
        if data is None:
            raise FileNotFoundError(f"{self.step_path(step)} is not a complete step")
        return ("object", generation)

    def still_there(self, step: int, seen: StepIdentity) -> bool:
        """Its commit marker is the one the read began with: nothing is unlisted or
        replaced without removing it first."""
        try:
            return self.step_identity(step) == seen
        except (OSError, _remote.StorageError):
            return False

    def symlinks_inside(self, step: int) -> list[str]:
        return []  # object storage has none

    def index(self, step: int) -> _ocdbt.Database:
        """The index of a small step just opened (`open_step`, whose listing and
        manifest are kept), read with `_ocdbt` from the data object that holds its
        B-tree's root, read up to the root's end at once (one round trip: the writer
        writes a small step's values before its root, in the same object, in most
        saves; values elsewhere are read as the index gives them, in a second), where
        TensorStore reads the root, then the values it points at (two in turn). Never
        more bytes than the manifest and the index give. `_ocdbt.Unsupported` for any
        other step (more than `HELD_BYTES`, a node in another object, an object shorter
        than the index says, a damaged index, not just opened): it is read by
        TensorStore, which reports what is wrong with it."""
        with self._manifests_lock:
            opened = self._opened
        if opened is None or opened[0] != step:
            raise _ocdbt.Unsupported("a step not just opened")
        _, manifest, keys = opened
        if manifest is None:
            raise _ocdbt.Unsupported("a step without its manifest")
        state = f"{self.step_path(step)}/{STATE_ITEM}"
        total, root, root_end = _ocdbt.indexed_bytes(
            manifest, f"the manifest '{state}/{_MANIFEST}'"
        )
        if total > HELD_BYTES or root_end > HELD_BYTES:  # (claims: bounded before a read)
            raise _ocdbt.Unsupported(f"a step of {max(total, root_end)} bytes")
        if f"{STATE_ITEM}/{root}" not in keys:
            raise _ocdbt.Unsupported("a step whose objects are not what its manifest says")
        try:
            [held] = _remote.read_ranges([(f"{state}/{root}", 0, root_end)])
            parts = {_MANIFEST: {0: manifest}} | ({} if held is None else {root: {0: held}})
            source = _ocdbt.Held(parts, state)
            index = _ocdbt.Database(state, source)
            # Values the writer put in another object (1 save in 5 or so): read at once,
            # exactly the bytes the index gives (a second round trip).
            others = source.missing(index)
            if sum(v.length for v in others) > HELD_BYTES:
                raise _ocdbt.Unsupported("values beyond the manifest's count")
            ranges = [(f"{state}/{v.path}", v.offset, v.offset + v.length) for v in others]
            for value, got in zip(others, _remote.read_ranges(ranges), strict=True):
                if got is None:
                    raise _ocdbt.Unsupported(f"data object '{value.path}' is missing")
                source.add(value, got)
        except (_remote.StorageError, _ocdbt.Damaged, FileNotFoundError) as e:
            raise _ocdbt.Unsupported(f"{e}") from e
        return index

    def database(
        self, step: int, ts: ModuleType, context: tensorstore.Context, leaves: int = 1
    ) -> tensorstore.KvStore:
        """The step's state item, opened for reading, for a read of `leaves` leaves.

        A committed step never changes: its manifest is read once (by `open_step`, with
        the step's description; else here), and the database reads it from memory;
        else every batch of reads would first ask the server whether it changed (a
        round trip), a question a server that sends no generation
        (gcp-storage-emulator) cannot answer. Reads of nearby small values issued close
        together are merged into one request (at most a chunk's size: large chunks are
        read in parallel): 80 leaves from moto 181 -> 30 ms. Each read waits that long
        for others to merge with, so the wait is about what issuing the read's leaves
        takes, not more (`_coalescing_us`)."""
        state = f"{self.step_path(step)}/{STATE_ITEM}"
        with self._manifests_lock:
            kept, self._opened = self._opened, None
        if kept is not None and kept[0] == step:
            manifest = kept[1]  # read with the step's description (`open_step`)
        else:
            manifest, _ = _remote.read(f"{state}/{_MANIFEST}")
        if manifest is None:
            raise FileNotFoundError(f"{state}/{_MANIFEST} does not exist")
        manifest = _format.within(f"{state}/{_MANIFEST}", manifest, SMALL_FILE_MAX_BYTES)
        memory = ts.KvStore.open({"driver": "memory"}, context=context).result()
        memory.write(_MANIFEST, manifest).result()
        spec = {
            "driver": "ocdbt",
            "base": _remote.kvstore_spec(state),
            "manifest": {"driver": "memory"},
            "cache_pool": "cache_pool#nodes",
            "experimental_read_coalescing_threshold_bytes": 1 << 20,
            "experimental_read_coalescing_merged_bytes": _format.CHUNK_BYTES,
            "experimental_read_coalescing_interval": f"{_coalescing_us(leaves)}us",
        }
        return ts.KvStore.open(spec, context=context).result()

    # -- a step written -----------------------------------------------------------------

    # A step is written under its final name, and listed once its commit marker is:
    # the primary writes the description files after the fence (it still holds the
    # lock and the step is the one it began), not while the arrays commit.
    describes_early = False

    def lock(self, name: str) -> ObjectLock:
        """The prefix's writer lock: the object `name`, written under preconditions."""
        return ObjectLock(self.path, name)

    def step_sync(self) -> _NoSync:
        return _NoSync()  # an object is durable once written

    def temp_path(self, step: int, temp_name: str) -> str:
        """Where a step is written: its final name (no rename in a bucket)."""
        return self.step_path(step)

    def kvstore_spec(self, path: str) -> dict[str, Any]:
        return _remote.kvstore_spec(path)

    def begin(self, temp: str, token: str = "") -> None:
        """Our marker object, written before any other object of the step (only if
        absent), naming the writer `token` (its lock's: `step_writer`)."""
        marker = json.dumps({"format": FORMAT, "writer": token}).encode()
        if _remote.write(f"{temp}/{OURS_NAME}", marker, if_equal=_remote.ABSENT) is None:
            raise FileExistsError(f"{temp} was begun by another writer meanwhile")

    def enter_attempt(self, temp: str, part: str) -> None:
        pass  # no folders in a bucket

    def write_file(self, path: str, data: bytes) -> None:
        """An object of a step, created only if absent: a writer that lost the location
        while paused never overwrites the new holder's step."""
        if _remote.write(path, data, if_equal=_remote.ABSENT) is None:
            raise FileExistsError(f"{path} was written by another writer meanwhile")

    def fence(self, name: str, token: str, check: Callable[[], None]) -> None:
        """Before a step's files and its commit: this writer still holds the lock
        (`check()`), and the step is still the one it began. A writer paused longer
        than the lock's stale time (a stopped VM) may have been taken over meanwhile; it
        must not write into the new holder's steps."""
        check()
        if self.step_writer(name) != token:
            raise FileExistsError(
                f"step {self.step_path(name)} is no longer the one this writer began "
                "(another writer removed or rewrote it after taking the location's lock "
                "over)"
            )

    def check_directory(self, identity: tuple[int, int] | None, lock: DirectoryLock) -> None:
        """Our lock object is still ours."""
        if not lock.still_ours():
            raise FileNotFoundError(
                f"the lock object of {self.path!r} is no longer ours (removed, or taken "
                "over by another writer that found it stale); nothing more is written. "
                "Fix: make sure one run writes to a location at a time"
            )

    def commit(self, temp: str, final: str, nbytes: int, sync: Sync) -> None:
        """Its commit marker written (last), after the items' own markers: Orbax on GCS
        reads a directory only with its marker, so plain Orbax restores `<step>/state`
        as it does on a local disk (docs/storage.md)."""
        marker = b"Checkpoint commit was successful."
        _remote.write_many({f"{final}/{item}/{COMMIT_NAME}": marker for item in ITEMS})
        if _remote.write(f"{final}/{COMMIT_NAME}", marker, if_equal=_remote.ABSENT) is None:
            raise FileExistsError(f"{final} was committed by another writer meanwhile")

    def clean_failed(self, name: str, token: str, error: BaseException) -> str | None:
        """A step that failed: its objects are removed later (`remove_temp`), after the
        failure is reported, unless the storage is out of reach (the next opening removes
        them then): the name to remove, or None."""
        return None if _remote.out_of_reach(error) else name

    # -- small objects of the prefix ----------------------------------------------------

    def names(self, prefix: str) -> list[str]:
        return [n for n in _remote.list_keys(self.path) if n.startswith(prefix) and "/" not in n]

    def create_file(self, name: str, data: bytes) -> None:
        _remote.write(f"{self.path}/{name}", data)

    def put_file(self, name: str, data: bytes) -> None:
        _remote.write(f"{self.path}/{name}", data)

    def read_file(self, name: str, limit: int) -> bytes | None:
        data, _ = _remote.read(f"{self.path}/{name}")
        return None if data is None else data[:limit]

    def remove_file(self, name: str) -> None:
        _remote.delete(f"{self.path}/{name}")

    # -- steps going away ---------------------------------------------------------------

    def set_aside(self, step: int) -> str | None:
        """Unlist checkpoint `step` (its commit marker goes); None when it is not one of
        ours."""
        if not self.is_checkpoint(step):
            return None
        _remote.delete(f"{self.step_path(step)}/{COMMIT_NAME}")
        return self.step_path(step)

    def remove_aside(self, aside: str) -> None:
        try:
            _remove_step_objects(aside)
        except _remote.StorageError:
            pass  # unlisted already; the next opening removes the rest

    def set_aside_damaged(self, step: int, why: str) -> str | None:
        """`_Steps.set_aside_damaged`: there is no rename, so each object is copied under
        the new name (one at a time: a damaged step may be large), the note written, and
        only then is the step unlisted (its commit marker first) and removed. A failure
        before that leaves the step as it was; a copy cut short stays under its name
        (never a step) and is shown by `jax-cb-ckpt ls`."""
        url = self.step_path(step)
        keys = _remote.list_keys(url)
        if OURS_NAME not in keys and COMMIT_NAME not in keys:
            return None
        name = _format.set_aside_name(step)
        for key in keys:
            data, _ = _remote.read(f"{url}/{key}")
            if data is not None:
                _remote.write(f"{self.path}/{name}/{key}", data)
        _remote.write(
            f"{self.path}/{name}/{_format.SET_ASIDE_NOTE}", _format.set_aside_note(step, why)
        )  # (before the step goes: a failure up to here leaves it as it was)
        _remote.delete(f"{url}/{COMMIT_NAME}")
        _remove_step_objects(url)
        return name

    def step_file(self, step: int, name: str, limit: int) -> bytes | None:
        data, _ = _remote.read(f"{self.step_path(step)}/{name}")
        return None if data is None else _format.within(name, data, limit)

    def set_aside_steps(self) -> list[tuple[int, str, str]]:
        names = set()
        for key in _remote.list_keys(self.path):
            name = key.partition("/")[0]
            if _format.SET_ASIDE_PATTERN.fullmatch(name):
                names.add(name)
        found = []
        for name in names:
            try:
                note, _ = _remote.read(f"{self.path}/{name}/{_format.SET_ASIDE_NOTE}")
            except _remote.StorageError:
                note = None
            step = int(name.partition(".")[0])
            found.append((step, name, _format.read_set_aside_note(note)))
        return sorted(found)

    def step_writer(self, name: str) -> str | None:
        """The writer (lock token) that began the step `name`; None when there is no
        marker, or the object under its name is not our marker (our format tag and a
        token as a lock makes them)."""
        return _format.marker_writer(_remote.read(f"{self.step_path(name)}/{OURS_NAME}")[0])

    def remove_temp(self, name: str, writer: str = "") -> None:
        """The objects of the step `name` (written under its final name), if the
        `writer` (its lock token) began it and it was not committed; a prefix that was
        there before (a step copied there) or another writer's is never deleted."""
        url = self.step_path(name)
        try:
            keys = set(_remote.list_keys(url))
            if OURS_NAME in keys and COMMIT_NAME not in keys and self.step_writer(name) == writer:
                _remove_step_objects(url)
        except _remote.StorageError:
            pass  # storage gone: the next opening removes what is left (unlisted)

    def remove_run_temps(self, run: str) -> None:
        pass  # no temporary names in a bucket

    def clean_leftovers(self, dead_writer: str = "") -> list[str]:
        """Every uncommitted step prefix our marker says a writer of ours began
        (`step_writer`) is deleted if it lacks a file of a whole step (a write cut short)
        or was begun by `dead_writer` (the token of the lock's holder this opening took
        over: it died at its commit). Returns the uncommitted prefixes left in place that
        hold a whole step (copied there without a commit marker, or begun by a writer
        not known to be dead), for the caller to report: nothing without our marker is
        deleted."""
        untouched = []
        for name, keys in sorted(self._objects_by_step().items(), key=lambda x: int(x[0])):
            if COMMIT_NAME in keys:
                continue
            url = self.step_path(name)
            writer = self.step_writer(name) if OURS_NAME in keys else None
            whole = _format.STEP_FILES <= keys
            if writer is not None and (not whole or writer == dead_writer):
                _remove_step_objects(url)
            elif whole:
                untouched.append(url)
        return untouched


class _NoSync:
    """A bucket's step sync: nothing to do, an object is durable once written."""

    def tree(self, path: str, nbytes: int) -> None:
        pass

    def __enter__(self) -> _NoSync:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


logger = logging.getLogger("jax_cb_ckpt")


def _coalescing_us(leaves: int) -> int:
    """How long a read from a bucket waits for others to merge with, for a read of
    `leaves` leaves: about what issuing their reads takes. A tiny step's read waited a
    fixed 1 ms at each of its two rounds (its B-tree root, then its values): gs://
    3 leaves 5.4 -> 3.9 ms at 100 us, while 80 leaves lost their merging at 0."""
    return min(1000, max(100, 12 * leaves))


def _examine_keys(keys: set[str]) -> Examined:
    if _format.COMPLETE_KEYS <= keys:
        return COMPLETE
    if OURS_NAME in keys and COMMIT_NAME in keys:
        missing = sorted(_format.COMPLETE_KEYS - keys)
        return Examined("damaged", f"committed, but {', '.join(missing)} missing")
    if OURS_NAME in keys:
        return _format.UNFINISHED
    return Examined("foreign", "not a complete jax_cb_ckpt checkpoint")


def _remove_step_objects(url: str) -> None:
    """Delete an unlisted step of ours from object storage: our marker last, so that a
    deletion cut short is still recognised as ours (and finished by the next opening)."""
    _remote.delete_prefix(url, keep=OURS_NAME)
    _remote.delete(f"{url}/{OURS_NAME}")


Storage = Local | Bucket  # the two kinds, with the same verbs
Sync = StepSync | _NoSync  # how a step is made durable (`step_sync`)
