"""The verbs every stage asks of where the steps live: one narrow protocol, `Storage`.

`_places.at(directory)` gives a `Local` (`_local.py`: a POSIX directory) or a `Bucket`
(`_bucket.py`: a prefix in GCS or S3); the modules that read checkpoints (`_steps`,
`_restore`, `_arrays`, `_plain`, `_resume`, the CLI), the writer, retention and the
multi-process check call only the verbs below, typed with this protocol, and never ask
which kind they hold. The protocol is stateless between calls: what a verb learns is
returned (`open_step` -> `OpenedStep`, which `index` and `database` take), and a
difference of the kinds is a difference of what a verb does, never a flag a caller
reads. `tests/test_storage_protocol.py` runs its contract against a local directory and
both object-storage servers. What counts as a step (names, the files of a whole step,
the checks of its description) is `_layout/_format.py`'s.

`StepsBase` holds the verbs both kinds derive from their own (`list_steps` from
`examine_all`, `remove_step` from `set_aside` and `remove_aside`, ...). Any thread;
each verb blocks on its I/O.
"""

from __future__ import annotations

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


class Storage(Protocol):
    """Where the steps of one checkpoint directory live (`_places.at`)."""

    path: str  # the directory: an absolute path or a canonical URL (`_places.resolve`)

    # -- listing and examining (readers, the CLI, retention, the writer's checks) ------

    def examine_all(self) -> dict[int, Examined]: ...
    def list_steps(self) -> list[int]: ...
    def is_checkpoint(self, step: int) -> bool: ...
    def foreign_steps(self) -> list[int]: ...
    def damaged_steps(self) -> dict[int, str]: ...
    def unfinished_steps(self) -> list[tuple[int, str]]: ...
    def set_aside_steps(self) -> list[tuple[int, str, str]]: ...
    def step_path(self, step: int | str) -> str: ...
    def exists(self, name: str) -> bool: ...  # an entry or step (a bucket: a prefix)
    def entry_bytes(self, name: str) -> int | None: ...
    def entry_time(self, name: str) -> str | None: ...
    def is_directory(self) -> bool: ...
    def make(self) -> None: ...
    def identity(self) -> tuple[int, int] | None: ...

    # -- reading one step (`_steps`, `_restore`, `_arrays`, `_plain`) ------------------

    def open_step(self, step: int) -> OpenedStep: ...
    def open_steps(self, steps: list[int]) -> dict[int, OpenedStep | Exception]: ...
    def still_there(self, step: int, seen: StepIdentity) -> bool: ...
    def symlinks_inside(self, step: int) -> list[str]: ...
    def step_file(self, step: int, name: str, limit: int) -> bytes | None: ...
    def index(self, opened: OpenedStep) -> _ocdbt.Database: ...
    def database(
        self,
        opened: OpenedStep,
        ts: ModuleType,
        context: tensorstore.Context,
        leaves: int = 1,
    ) -> tensorstore.KvStore: ...

    # -- writing and committing a step (the writer) ------------------------------------

    def step_sync(self) -> Sync: ...
    def temp_path(self, step: int, temp_name: str) -> str: ...
    def kvstore_spec(self, path: str) -> dict[str, Any]: ...
    def begin(self, temp: str, token: str = "") -> None: ...
    def enter_attempt(self, temp: str, part: str) -> None: ...
    def write_file(self, path: str, data: bytes) -> None: ...
    def write_meta(self, temp: str, meta: dict[str, Any], extra: bytes | None = None) -> None: ...
    def commit(self, temp: str, final: str, nbytes: int, sync: Sync) -> None: ...
    def clean_failed(self, name: str, token: str, error: BaseException) -> str | None: ...

    # -- the lock and the fences (the Checkpointer, the writer) ------------------------

    def lock(self, name: str) -> DirectoryLock: ...
    def fence(self, name: str, token: str, check: Callable[[], None]) -> None: ...
    def check_directory(self, identity: tuple[int, int] | None, lock: DirectoryLock) -> None: ...

    # -- small files of the directory (the multi-process check's nonce, reports) -------

    def names(self, prefix: str) -> list[str]: ...
    def create_file(self, name: str, data: bytes) -> None: ...
    def put_file(self, name: str, data: bytes) -> None: ...
    def read_file(self, name: str, limit: int) -> bytes | None: ...
    def remove_file(self, name: str) -> None: ...

    # -- removing and setting aside (retention, a replacing save, a restart) -----------

    def set_aside(self, step: int) -> str | None: ...
    def remove_aside(self, aside: str) -> None: ...
    def remove_step(self, step: int) -> bool: ...
    def set_aside_damaged(self, step: int, why: str) -> str | None: ...

    # -- leftovers (the writer's opening, failed steps, the multi-process round) -------

    def remove_temp(self, name: str, writer: str = "") -> None: ...
    def remove_run_temps(self, run: str) -> None: ...
    def clean_leftovers(self, dead_writer: str = "") -> list[str]: ...


class StepsBase:
    """The verbs both kinds derive from their own (`_examine_all`, `_examine`, ...)."""

    path: str

    def examine_all(self) -> dict[int, Examined]:
        raise NotImplementedError

    def _examine(self, step: int) -> Examined:
        raise NotImplementedError

    def list_steps(self) -> list[int]:
        """Steps with a complete checkpoint here, ascending."""
        return sorted(s for s, found in self.examine_all().items() if found.kind == "complete")

    def is_checkpoint(self, step: int) -> bool:
        """`step` is a complete checkpoint of ours (what `examine_all` says of it)."""
        return self._examine(step).kind == "complete"

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

    def open_step(self, step: int) -> OpenedStep:
        raise NotImplementedError

    def _open_or_error(self, step: int) -> OpenedStep | Exception:
        try:
            return self.open_step(step)
        except Exception as e:  # (removed meanwhile, damaged: the caller says which)
            return e

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

    def _after_set_aside(self) -> None:
        pass

    def write_file(self, path: str, data: bytes) -> None:
        raise NotImplementedError

    def write_meta(self, temp: str, meta: dict[str, Any], extra: bytes | None = None) -> None:
        """A step's `meta` item (and `extra` item, where it has one), then Orbax's step
        file holding our record of them (`_format.meta_files`), into the step being
        written at `temp`."""
        for name, data in _format.meta_files(meta, extra).items():
            self.write_file(os.path.join(temp, name), data)
