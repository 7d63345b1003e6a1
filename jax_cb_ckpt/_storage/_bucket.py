"""A checkpoint directory that is a prefix in a GCS or S3 bucket: its steps (`Bucket`,
a `StepStore`) and its objects (`BucketChunks`, a `ChunkStore`).

A step's objects are written under its final name (no rename in a bucket), our marker
first and Orbax's commit marker last; only a step holding both (and the files of a
whole step) is listed. Deleting a step removes its commit marker first (unlisted at
once), our marker last (`_format`'s module doc). The operations on objects are
`_remote`'s. Any thread; each verb blocks on its I/O.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING, Any

from .._base._errors import ConfigError
from .._layout import _format, _ocdbt
from .._layout._format import (
    COMMIT_NAME,
    COMPLETE,
    FORMAT,
    ITEMS,
    META_FILE,
    META_ITEM,
    META_MAX_BYTES,
    ORBAX_STEP_FILE,
    OURS_NAME,
    SMALL_FILE_MAX_BYTES,
    STATE_ITEM,
    Examined,
)
from . import _copy, _faults, _remote
from ._durable import NoSync, Sync
from ._lock import DirectoryLock, ObjectLock
from ._protocol import OpenedStep, StepIdentity

if TYPE_CHECKING:
    import tensorstore

# The OCDBT database's root, read once per step from a bucket (`BucketChunks.database`).
_MANIFEST = _ocdbt.MANIFEST
_MANIFEST_KEY = f"{STATE_ITEM}/{_MANIFEST}"  # under the step
# A bucket's step of at most this many bytes in its database is read at once, its index
# by `_ocdbt` (`BucketChunks.index`); a larger one by TensorStore, range by range.
HELD_BYTES = 8 << 20
# Steps opened at a time (`Bucket.opened_at_once`): each is one round trip.
_OPENED_AT_ONCE = 16


class Bucket:
    """The steps of a checkpoint directory that is a prefix in a GCS or S3 bucket (a
    `StepStore`, over `_remote`). A step's objects are written under its final name,
    our marker first and Orbax's commit marker last; only a step holding both (and the
    files of a whole step) is listed. Deleting a step removes its commit marker first
    (unlisted at once), our marker last (`_format`'s module doc)."""

    opened_at_once = _OPENED_AT_ONCE  # each is one round trip (`Storage.open_steps`)
    marks_items = True  # each item its own commit marker, as Orbax on GCS writes them

    def __init__(self, url: str) -> None:
        self.path = url

    def _step_path(self, step: int | str) -> str:
        return f"{self.path}/{step}"

    # -- what is there ------------------------------------------------------------------

    def examine_all(self) -> dict[int, Examined]:
        return {int(n): _examine_keys(keys) for n, keys in self._objects_by_step().items()}

    def is_checkpoint(self, step: int) -> bool:
        return self._examine(step).kind == "complete"

    def _examine(self, step: int) -> Examined:
        """From the keys under the step: every object of a complete step is there; one
        with our marker or commit marker and not all of them is damaged; `open_step`
        checks the description files as `Local._examine` does."""
        return _examine_keys(set(_remote.list_keys(self._step_path(step))))

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
            (int(name), self._step_path(name))
            for name, keys in sorted(self._objects_by_step().items())
            if OURS_NAME in keys and COMMIT_NAME not in keys
        ]

    # -- one step, read -----------------------------------------------------------------

    def open_step(self, step: int) -> OpenedStep:
        """`Local.open_step`, in one round trip: the step's objects are listed (the step
        is complete: `_examine`) while its commit marker (whose generation is the step's
        identity), Orbax's step file, the meta item and the OCDBT manifest are read.
        `FileNotFoundError` for a step that is not there, `DamagedStep` for a damaged
        one. The keys and the manifest come back with it, for `index` and `database`,
        which read the step next (no second listing, no second read). An object
        is read whole before its size is checked (TensorStore refuses a byte range past
        an object's end, and a listing gives no sizes)."""
        path = self._step_path(step)
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
        return OpenedStep(step, ("object", marker[1]), described, tuple(keys), manifest)

    def _step_identity(self, step: int) -> StepIdentity:
        """The generation of the step's commit marker (a step is committed once)."""
        data, generation = _remote.read(f"{self._step_path(step)}/{COMMIT_NAME}")
        if data is None:
            raise FileNotFoundError(f"{self._step_path(step)} is not a complete step")
        return ("object", generation)

    def still_there(self, step: int, seen: StepIdentity) -> bool:
        """Its commit marker is the one the read began with: nothing is unlisted or
        replaced without removing it first."""
        try:
            return self._step_identity(step) == seen
        except (OSError, _remote.StorageError):
            return False

    # -- a step written -----------------------------------------------------------------

    def lock(self, name: str) -> ObjectLock:
        """The prefix's writer lock: the object `name`, written under preconditions."""
        return ObjectLock(self.path, name)

    def step_sync(self) -> NoSync:
        return NoSync()  # an object is durable once written

    def temp_path(self, step: int, temp_name: str) -> str:
        """Where a step is written: its final name (no rename in a bucket)."""
        return self._step_path(step)

    def begin(self, temp: str, token: str = "") -> None:
        """Our marker object, written before any other object of the step (only if
        absent), naming the writer `token` (its lock's: `_step_writer`)."""
        marker = json.dumps({"format": FORMAT, "writer": token}).encode()
        if _remote.write(f"{temp}/{OURS_NAME}", marker, if_equal=_remote.ABSENT) is None:
            raise FileExistsError(f"{temp} was begun by another writer meanwhile")

    def enter_attempt(self, temp: str, part: str) -> None:
        pass  # no folders in a bucket

    def fence(self, name: str, token: str, check: Callable[[], None]) -> None:
        """Before a step's files and its commit: this writer still holds the lock
        (`check()`), and the step is still the one it began. A writer paused longer
        than the lock's stale time (a stopped VM) may have been taken over meanwhile; it
        must not write into the new holder's steps."""
        check()
        if self._step_writer(name) != token:
            raise FileExistsError(
                f"step {self._step_path(name)} is no longer the one this writer began "
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
        marker = _format.COMMITTED
        _remote.write_many({f"{final}/{item}/{COMMIT_NAME}": marker for item in ITEMS})
        if _remote.write(f"{final}/{COMMIT_NAME}", marker, if_equal=_remote.ABSENT) is None:
            raise FileExistsError(f"{final} was committed by another writer meanwhile")

    def clean_failed(self, name: str, token: str, error: BaseException) -> str | None:
        """A step that failed: its objects are removed later (`remove_temp`), after the
        failure is reported, unless the storage is out of reach (the next opening removes
        them then): the name to remove, or None."""
        return None if _faults.out_of_reach(error) else name

    # -- steps going away ---------------------------------------------------------------

    def set_aside(self, step: int) -> str | None:
        """Unlist checkpoint `step` (its commit marker goes); None when it is not one of
        ours."""
        if not self.is_checkpoint(step):
            return None
        _remote.delete(f"{self._step_path(step)}/{COMMIT_NAME}")
        return self._step_path(step)

    def remove_step(self, step: int) -> bool:
        """Delete checkpoint `step`: unlisted first (its commit marker), then removed.
        False (and nothing touched) when `step` is not a checkpoint of ours."""
        aside = self.set_aside(step)
        if aside is None:
            return False
        self.remove_aside(aside)
        return True

    def remove_aside(self, aside: str) -> None:
        try:
            _remove_step_objects(aside)
        except _remote.StorageError:
            pass  # unlisted already; the next opening removes the rest

    def set_aside_damaged(self, step: int, why: str) -> str | None:
        """`Local.set_aside_damaged`: there is no rename, so each object is copied under
        the new name (one at a time: a damaged step may be large) and the note written;
        then our marker is rewritten to name where the step went (`_format.aside_marker`),
        and only then is the step unlisted (its commit marker first) and removed (our
        marker last). A failure before the marker is rewritten leaves the step as it was
        (a copy cut short stays under its name, never a step, shown by `jax-cb-ckpt
        ls`); one after it leaves a step that names a whole copy of itself, which the
        next set-aside or opening finishes (`clean_leftovers`): the run can write that
        step number again at any instant, without a hand edit."""
        url = self._step_path(step)
        keys = _remote.list_keys(url)
        if OURS_NAME not in keys and COMMIT_NAME not in keys:
            return None
        marker = _remote.read(f"{url}/{OURS_NAME}")[0] if OURS_NAME in keys else None
        name = self._moved_to(step, marker)  # a set-aside cut short: its copy is whole
        if name is None:
            name = _format.set_aside_name(step)
            for key in keys:
                data, _ = _remote.read(f"{url}/{key}")
                if data is not None:
                    _remote.write(f"{self.path}/{name}/{key}", data)
            _remote.write(
                f"{self.path}/{name}/{_format.SET_ASIDE_NOTE}",
                _format.set_aside_note(step, why),
            )
            _remote.write(f"{url}/{OURS_NAME}", _format.aside_marker(marker, name))
        _remote.delete(f"{url}/{COMMIT_NAME}")
        _remove_step_objects(url)
        return name

    def _moved_to(self, step: int, marker: bytes | None) -> str | None:
        """The set-aside name our marker of `step` names (`_format.moved_to`), when a
        whole copy of the step is there: its note, naming that step, is written after
        every object is copied. None otherwise."""
        name = _format.moved_to(marker, step)
        if name is None:
            return None
        note, _ = _remote.read(f"{self.path}/{name}/{_format.SET_ASIDE_NOTE}")
        return name if _format.note_step(note) == step else None

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

    def _step_writer(self, name: str) -> str | None:
        """The writer (lock token) that began the step `name`; None when there is no
        marker, or the object under its name is not our marker (our format tag and a
        token as a lock makes them)."""
        return _format.marker_writer(_remote.read(f"{self._step_path(name)}/{OURS_NAME}")[0])

    def remove_temp(self, name: str, writer: str = "") -> None:
        """The objects of the step `name` (written under its final name), if the
        `writer` (its lock token) began it and it was not committed; a prefix that was
        there before (a step copied there) or another writer's is never deleted."""
        url = self._step_path(name)
        try:
            keys = set(_remote.list_keys(url))
            if OURS_NAME in keys and COMMIT_NAME not in keys and self._step_writer(name) == writer:
                _remove_step_objects(url)
        except _remote.StorageError:
            pass  # storage gone: the next opening removes what is left (unlisted)

    def remove_run_temps(self, run: str) -> None:
        pass  # no temporary names in a bucket

    def clean_leftovers(self, dead_writer: str = "") -> list[str]:
        """Every uncommitted step prefix our marker says a writer of ours began
        (`_step_writer`) is deleted if it lacks a file of a whole step (a write cut short)
        or was begun by `dead_writer` (the token of the lock's holder this opening took
        over: it died at its commit); so is one our marker says was being set aside, once
        the whole copy it names is there (`_moved_to`: a restart killed while setting
        it aside). Returns the uncommitted prefixes left in place that hold a whole step
        (copied there without a commit marker, or begun by a writer not known to be
        dead), for the caller to report: nothing without our marker is deleted."""
        untouched = []
        for name, keys in sorted(self._objects_by_step().items(), key=lambda x: int(x[0])):
            if COMMIT_NAME in keys:
                continue
            url = self._step_path(name)
            marker = _remote.read(f"{url}/{OURS_NAME}")[0] if OURS_NAME in keys else None
            writer = _format.marker_writer(marker)
            whole = _format.STEP_FILES <= keys
            if self._moved_to(int(name), marker) is not None:
                _remove_step_objects(url)
            elif writer is not None and (not whole or writer == dead_writer):
                _remove_step_objects(url)
            elif whole:
                untouched.append(url)
        return untouched


class BucketChunks:
    """The objects of a checkpoint directory that is a prefix in a GCS or S3 bucket (a
    `ChunkStore`, over `_remote`): a step's objects created only if absent, a link made
    as a server-side copy (`_copy`), TensorStore's `gcs` and `s3` drivers for the arrays."""

    def __init__(self, url: str) -> None:
        self.path = url

    def location(self, name: str) -> str:
        return f"{self.path}/{name}"

    def names(self, prefix: str) -> list[str]:
        return [n for n in _remote.list_keys(self.path) if n.startswith(prefix) and "/" not in n]

    def exists(self, name: str) -> bool:
        """Any object is under the prefix `name`."""
        return bool(_remote.list_keys(f"{self.path}/{name}"))

    def size(self, name: str) -> int | None:
        return None  # a listing gives no sizes

    def changed(self, name: str) -> str | None:
        return None

    def links_under(self, name: str) -> list[str]:
        return []  # object storage has none

    def files_in(self, folder: str) -> list[str]:
        """The names of the objects right under the prefix `folder/`."""
        return [n for n in _remote.list_keys(self.location(folder)) if "/" not in n]

    def get(self, name: str, limit: int) -> bytes | None:
        data, _ = _remote.read(f"{self.path}/{name}")
        return None if data is None else data[:limit]

    def get_within(self, name: str, limit: int) -> bytes | None:
        data, _ = _remote.read(self.location(name))
        return None if data is None else _format.within(name, data, limit)

    def put(self, name: str, data: bytes) -> None:
        _remote.write(f"{self.path}/{name}", data)

    def create(self, name: str, data: bytes) -> None:
        _remote.write(f"{self.path}/{name}", data)

    def write(self, path: str, data: bytes) -> None:
        """An object of a step, created only if absent: a writer that lost the location
        while paused never overwrites the new holder's step."""
        if _remote.write(path, data, if_equal=_remote.ABSENT) is None:
            raise FileExistsError(f"{path} was written by another writer meanwhile")

    def link(self, source: str, target: str) -> None:
        """The object `target` holds the bytes of the object `source` (both names
        under the prefix): a server-side copy (GCS's rewrite, S3's CopyObject: `_copy`),
        the bytes never passing through this process. `FileNotFoundError` when
        `source` is not there, `FileExistsError` when `target` is (created only if
        absent), `ConfigError` when the scheme's client library (an extra) is not
        installed."""
        _copy.copy(self.location(source), self.location(target))

    def delete(self, name: str) -> None:
        _remote.delete(f"{self.path}/{name}")

    def kvstore_spec(self, path: str) -> dict[str, Any]:
        return _remote.kvstore_spec(path)

    def needed(self, database: str) -> set[str] | None:
        """None: which objects a database's latest version needs is not read from a
        bucket (its index, node by node, a round trip each, for objects that cost
        little to keep: a linked step keeps them until the next whole one)."""
        return None

    def index(self, opened: OpenedStep) -> _ocdbt.Database:
        """The index of a small step opened (`open_step`, which returns its listing and
        manifest), read with `_ocdbt` from the data object that holds its
        B-tree's root, read up to the root's end at once (one round trip: the writer
        writes a small step's values before its root, in the same object, in most
        saves; values elsewhere are read as the index gives them, in a second), where
        TensorStore reads the root, then the values it points at (two in turn). Never
        more bytes than the manifest and the index give. `_ocdbt.Unsupported` for any
        other step (more than `HELD_BYTES`, a node in another object, an object shorter
        than the index says, a damaged index): it is read by TensorStore, which
        reports what is wrong with it; but `_ocdbt.Inflated` for an index whose data
        file tables would expand past their bound (TensorStore would expand them too)."""
        step, manifest, keys = opened.step, opened.manifest, opened.keys
        if manifest is None:
            raise _ocdbt.Unsupported("a step without its manifest")
        state = f"{self.location(str(step))}/{STATE_ITEM}"
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
        except _ocdbt.Inflated:  # (damage TensorStore would expand too: never its to read)
            raise
        except (_remote.StorageError, _ocdbt.Damaged, FileNotFoundError) as e:
            raise _ocdbt.Unsupported(f"{e}") from e
        return index

    def database(
        self,
        opened: OpenedStep,
        ts: ModuleType,
        context: tensorstore.Context,
        leaves: int = 1,
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
        state = f"{self.location(str(opened.step))}/{STATE_ITEM}"
        manifest = opened.manifest  # read with the step's description (`open_step`)
        if manifest is None:
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
