"""What every stage asks of where the steps live, split by what is stored: the steps
(`StepStore`: list, examine, open, commit, set aside, lock) and the bytes under their
names (`ChunkStore`: get, put, link, and TensorStore's way to the arrays), each a narrow
protocol a new kind of storage implements; `Storage` joins one of each for the callers.

`_places.at(directory)` gives a `Storage` of a `Local` and a `LocalChunks` (`_local.py`:
a POSIX directory) or of a `Bucket` and a `BucketChunks` (`_bucket.py`: a prefix in
GCS or S3); the modules that read checkpoints (`_steps`, `_restore`, `_arrays`,
`_plain`, `_resume`, the CLI), the writer, retention and the multi-process check call
only `Storage`'s verbs and never ask which kind they hold. The protocols are stateless
between calls: what a verb learns is returned (`open_step` -> `OpenedStep`, which
`index` and `database` take), and a difference of the kinds is a difference of what a
verb does, never a flag a caller reads. `tests/test_storage_protocol.py` runs their
contract against a local directory and both object-storage servers. What counts as a
step (names, the files of a whole step, the checks of its description) is
`_layout/_format.py`'s; what an error of a storage means is `_faults.py`'s.

`Storage` derives the verbs that need no kind of their own (`list_steps` from
`examine_all`, `open_steps` from `open_step`, `write_meta` from `write`, ...) and passes
the others on. Any thread; each verb blocks on its I/O.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING, Any, Protocol

from .._base._errors import ConfigError
from .._layout import _format, _ocdbt
from .._layout._format import Examined
from ._durable import Sync
from ._lock import DirectoryLock

if TYPE_CHECKING:
    import tensorstore

# What a step is, taken before it is read and compared after (a step replaced under its
# name, or removed, is another): (device, inode) of its directory; in a bucket
# ("object", its commit marker's generation).
StepIdentity = tuple[int, int] | tuple[str, bytes]


@dataclasses.dataclass(frozen=True)
class OpenedStep:
    """What `Storage.open_step` learned of a complete step, taken before its arrays are
    read: its identity (`still_there` compares it after the read), its checked `meta`
    item, and what a bucket read in the same round trip (the step's keys and its OCDBT
    manifest, for `index` and `database`; empty for a local step)."""

    step: int
    identity: StepIdentity
    meta: dict[str, Any]
    keys: tuple[str, ...] = ()
    manifest: bytes | None = None


class StepStore(Protocol):
    """The steps of one checkpoint directory: which there are and what each is, one
    opened, one written and committed, set aside and removed, the writer's lock.
    `Local` (a folder: a step is a directory, committed by a rename) and `Bucket` (a
    prefix: a step is its objects, committed by a marker written last)."""

    path: str  # the directory: an absolute path or a canonical URL (`_places.resolve`)
    opened_at_once: int  # steps `Storage.open_steps` opens at a time (threads)
    marks_items: bool  # each item of a step gets its own commit marker (a bucket)

    # -- what is there (readers, the CLI, retention, the writer's checks) --------------

    def examine_all(self) -> dict[int, Examined]: ...
    def is_checkpoint(self, step: int) -> bool: ...
    def unfinished_steps(self) -> list[tuple[int, str]]: ...
    def set_aside_steps(self) -> list[tuple[int, str, str]]: ...
    def is_directory(self) -> bool: ...
    def make(self) -> None: ...
    def identity(self) -> tuple[int, int] | None: ...

    # -- one step, read (`_steps`, `_restore`, `_arrays`, `_plain`) -------------------

    def open_step(self, step: int) -> OpenedStep: ...
    def still_there(self, step: int, seen: StepIdentity) -> bool: ...

    # -- one step, written and committed (the writer) ---------------------------------

    def step_sync(self) -> Sync: ...
    def temp_path(self, step: int, temp_name: str) -> str: ...
    def begin(self, temp: str, token: str = "") -> None: ...
    def enter_attempt(self, temp: str, part: str) -> None: ...
    def commit(self, temp: str, final: str, nbytes: int, sync: Sync) -> None: ...
    def clean_failed(self, name: str, token: str, error: BaseException) -> str | None: ...

    # -- the lock and the fences (the Checkpointer, the writer) -----------------------

    def lock(self, name: str) -> DirectoryLock: ...
    def fence(self, name: str, token: str, check: Callable[[], None]) -> None: ...
    def check_directory(self, identity: tuple[int, int] | None, lock: DirectoryLock) -> None: ...

    # -- steps going away (retention, a replacing save, a restart) --------------------

    def set_aside(self, step: int) -> str | None: ...
    def remove_aside(self, aside: str) -> None: ...
    def remove_step(self, step: int) -> bool: ...
    def set_aside_damaged(self, step: int, why: str) -> str | None: ...
    def remove_temp(self, name: str, writer: str = "") -> None: ...
    def remove_run_temps(self, run: str) -> None: ...
    def clean_leftovers(self, dead_writer: str = "") -> list[str]: ...


class ChunkStore(Protocol):
    """The bytes of one checkpoint directory under their names (`"4/meta/meta.json"`,
    a file of the directory): read, written, linked, listed, removed, and the key-value
    store TensorStore writes and reads the arrays through (TensorStore is the default
    chunk store's engine: `_write/_store.StoreWriter`, `_read/_arrays`). `LocalChunks`
    (files: never through a link) and `BucketChunks` (objects, `_remote`)."""

    path: str

    # -- names --------------------------------------------------------------------------

    def location(self, name: str) -> str: ...  # the path or URL of `name`
    def names(self, prefix: str) -> list[str]: ...  # files of the directory itself
    def exists(self, name: str) -> bool: ...  # a file or anything under `name/`
    def size(self, name: str) -> int | None: ...  # bytes under `name` (None: unknown)
    def changed(self, name: str) -> str | None: ...  # when (UTC, ISO 8601), or None
    def links_under(self, name: str) -> list[str]: ...  # symlinks (a bucket has none)
    def files_in(self, folder: str) -> list[str]: ...  # names of the files right in it

    # -- bytes --------------------------------------------------------------------------

    def get(self, name: str, limit: int) -> bytes | None: ...  # at most `limit` bytes
    def get_within(self, name: str, limit: int) -> bytes | None: ...  # `DamagedStep` beyond
    def put(self, name: str, data: bytes) -> None: ...  # whether there or not
    def create(self, name: str, data: bytes) -> None: ...  # a new file
    def write(self, path: str, data: bytes) -> None: ...  # a file of a step being written
    def link(self, source: str, target: str) -> None: ...  # `target` holds `source`'s bytes
    def delete(self, name: str) -> None: ...

    # -- the arrays, through TensorStore ------------------------------------------------

    def kvstore_spec(self, path: str) -> dict[str, Any]: ...
    def needed(self, database: str) -> set[str] | None: ...  # files its latest version reads
    def index(self, opened: OpenedStep) -> _ocdbt.Database: ...
    def database(
        self,
        opened: OpenedStep,
        ts: ModuleType,
        context: tensorstore.Context,
        leaves: int = 1,
    ) -> tensorstore.KvStore: ...


class Storage:
    """Where the steps of one checkpoint directory live (`_places.at`): a step store and
    a chunk store of the same directory, asked through one object. The verbs below
    are what every stage calls; each is passed on, or derived here once for every
    kind."""

    def __init__(self, steps: StepStore, chunks: ChunkStore) -> None:
        self.steps = steps
        self.chunks = chunks
        self.path = steps.path

    # -- listing and examining (readers, the CLI, retention, the writer's checks) ------

    def examine_all(self) -> dict[int, Examined]:
        return self.steps.examine_all()

    def list_steps(self) -> list[int]:
        """Steps with a complete checkpoint here, ascending."""
        return sorted(s for s, found in self.examine_all().items() if found.kind == "complete")

    def is_checkpoint(self, step: int) -> bool:
        """`step` is a complete checkpoint of ours (what `examine_all` says of it)."""
        return self.steps.is_checkpoint(step)

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

    def unfinished_steps(self) -> list[tuple[int, str]]:
        return self.steps.unfinished_steps()

    def set_aside_steps(self) -> list[tuple[int, str, str]]:
        return self.steps.set_aside_steps()

    def step_path(self, step: int | str) -> str:
        return self.chunks.location(str(step))

    def exists(self, name: str) -> bool:
        """An entry or step is at `name` (a bucket: anything under the prefix)."""
        return self.chunks.exists(name)

    def entry_bytes(self, name: str) -> int | None:
        return self.chunks.size(name)

    def entry_time(self, name: str) -> str | None:
        return self.chunks.changed(name)

    def is_directory(self) -> bool:
        return self.steps.is_directory()

    def make(self) -> None:
        self.steps.make()

    def identity(self) -> tuple[int, int] | None:
        return self.steps.identity()

    # -- reading one step (`_steps`, `_restore`, `_arrays`, `_plain`) ------------------

    def open_step(self, step: int) -> OpenedStep:
        return self.steps.open_step(step)

    def open_steps(self, steps: list[int]) -> dict[int, OpenedStep | Exception]:
        """{step: `open_step(step)`, or what it raised}, the step store's
        `opened_at_once` at a time (a bucket's: each is one round trip, which threads
        overlap; a local directory's one by one: there threads cost more than they
        save, 300 steps 42 ms one by one, 106 ms 16 at a time)."""
        at_once = self.steps.opened_at_once
        if len(steps) <= 1 or at_once <= 1:
            return {step: self._open_or_error(step) for step in steps}
        with concurrent.futures.ThreadPoolExecutor(at_once) as pool:
            found = list(pool.map(self._open_or_error, steps))
        return dict(zip(steps, found, strict=True))

    def _open_or_error(self, step: int) -> OpenedStep | Exception:
        try:
            return self.open_step(step)
        except Exception as e:  # (removed meanwhile, damaged: the caller says which)
            return e

    def still_there(self, step: int, seen: StepIdentity) -> bool:
        return self.steps.still_there(step, seen)

    def symlinks_inside(self, step: int) -> list[str]:
        return self.chunks.links_under(str(step))

    def step_file(self, step: int, name: str, limit: int) -> bytes | None:
        """The small file `name` (a path inside the step) of the step-named entry
        `step`, whoever wrote it, read within `limit` bytes (`DamagedStep` beyond);
        None when it is not there."""
        return self.chunks.get_within(f"{step}/{name}", limit)

    def index(self, opened: OpenedStep) -> _ocdbt.Database:
        return self.chunks.index(opened)

    def database(
        self,
        opened: OpenedStep,
        ts: ModuleType,
        context: tensorstore.Context,
        leaves: int = 1,
    ) -> tensorstore.KvStore:
        return self.chunks.database(opened, ts, context, leaves)

    # -- writing and committing a step (the writer) ------------------------------------

    def step_sync(self) -> Sync:
        return self.steps.step_sync()

    def temp_path(self, step: int, temp_name: str) -> str:
        return self.steps.temp_path(step, temp_name)

    def kvstore_spec(self, path: str) -> dict[str, Any]:
        return self.chunks.kvstore_spec(path)

    def begin(self, temp: str, token: str = "") -> None:
        self.steps.begin(temp, token)

    def enter_attempt(self, temp: str, part: str) -> None:
        self.steps.enter_attempt(temp, part)

    def write_file(self, path: str, data: bytes) -> None:
        self.chunks.write(path, data)

    def write_meta(self, temp: str, meta: dict[str, Any], extra: bytes | None = None) -> None:
        """A step's `meta` item (and `extra` item, where it has one), then Orbax's step
        file holding our record of them (`_format.meta_files`), into the step being
        written at `temp`; where the step store marks each item (`marks_items`: Orbax
        on GCS does), the `extra` item's own commit marker, which `commit` writes for
        the other items."""
        for name, data in _format.meta_files(meta, extra).items():
            self.chunks.write(os.path.join(temp, name), data)
        if extra is not None and self.steps.marks_items:
            marker = os.path.join(temp, _format.EXTRA_ITEM, _format.COMMIT_NAME)
            self.chunks.write(marker, _format.COMMITTED)

    def commit(self, temp: str, final: str, nbytes: int, sync: Sync) -> None:
        self.steps.commit(temp, final, nbytes, sync)

    def clean_failed(self, name: str, token: str, error: BaseException) -> str | None:
        return self.steps.clean_failed(name, token, error)

    # -- the lock and the fences (the Checkpointer, the writer) ------------------------

    def lock(self, name: str) -> DirectoryLock:
        return self.steps.lock(name)

    def fence(self, name: str, token: str, check: Callable[[], None]) -> None:
        self.steps.fence(name, token, check)

    def check_directory(self, identity: tuple[int, int] | None, lock: DirectoryLock) -> None:
        self.steps.check_directory(identity, lock)

    # -- small files of the directory (the multi-process check's nonce, reports) -------

    def names(self, prefix: str) -> list[str]:
        return self.chunks.names(prefix)

    def create_file(self, name: str, data: bytes) -> None:
        self.chunks.create(name, data)

    def put_file(self, name: str, data: bytes) -> None:
        self.chunks.put(name, data)

    def read_file(self, name: str, limit: int) -> bytes | None:
        return self.chunks.get(name, limit)

    def remove_file(self, name: str) -> None:
        self.chunks.delete(name)

    def files_in(self, folder: str) -> list[str]:
        return self.chunks.files_in(folder)

    def needed(self, database: str) -> set[str] | None:
        return self.chunks.needed(database)

    def link(self, source: str, target: str) -> None:
        """`target` (a name) holds the bytes of `source` (a name), without passing them
        through this process where the storage can: a hard link in a folder."""
        self.chunks.link(source, target)

    # -- removing and setting aside (retention, a replacing save, a restart) -----------

    def set_aside(self, step: int) -> str | None:
        return self.steps.set_aside(step)

    def remove_aside(self, aside: str) -> None:
        self.steps.remove_aside(aside)

    def remove_step(self, step: int) -> bool:
        return self.steps.remove_step(step)

    def set_aside_damaged(self, step: int, why: str) -> str | None:
        return self.steps.set_aside_damaged(step, why)

    # -- leftovers (the writer's opening, failed steps, the multi-process round) -------

    def remove_temp(self, name: str, writer: str = "") -> None:
        self.steps.remove_temp(name, writer)

    def remove_run_temps(self, run: str) -> None:
        self.steps.remove_run_temps(run)

    def clean_leftovers(self, dead_writer: str = "") -> list[str]:
        return self.steps.clean_leftovers(dead_writer)
