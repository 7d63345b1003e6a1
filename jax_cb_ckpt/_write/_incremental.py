"""Incremental saves (`Checkpointer(..., incremental=True)`): a step links what did not
change since the step before it, and is still a whole plain Orbax checkpoint.

The writer keeps, in memory, of the step it wrote last (this process's part of it):
its layout (`StoreWriter.layout`: leaves, shapes, dtypes, chunks) and a copy of every
chunk with its CRC-32 (`StoreWriter.kept`: one state's bytes). At the next save of the
same layout, before
TensorStore opens the new step's database, `link` puts the previous step's database
into it: its data files (`d/`) linked (a hard link in a folder, a server-side copy in a
bucket: `ChunkStore.link`), its manifest copied (TensorStore rewrites a manifest in
place; it never changes a data file once written). The new step's database then *is*
the previous one, and the write adds a version holding only the chunks whose bytes
differ from their kept copy (`StoreWriter.write(previous=...)`: compared byte for byte,
which costs less than a checksum, and is proof where a matching CRC-32 is not; a
changed chunk's copy and checksum are updated). After its commit, `prune` removes from the new
step the linked files its latest version no longer reads (every value in them
replaced): a local folder's, read with the package's own reader; a bucket keeps them
until the next whole save (reading its index is a round trip per node).

So each step's folder holds every file its index points at: copied alone elsewhere,
with every other step deleted, it restores with plain Orbax; deleting any step (any
order) removes its names only. Steps share the bytes of linked files: a bit flipped in
one damages every step that links it, which `full_every` bounds (every `full_every`-th
save is written whole, as are a writer's first save, a save whose layout differs and
any save after one that failed).

Runs in the writer thread (links, one at a time in a folder and 16 at a time in a
bucket, where each is a request); nothing in the background.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib

from .._layout import _format, _ocdbt
from .._layout._ocdbt import MANIFEST
from .._storage._protocol import Storage
from ._store import Kept

FULL_EVERY = 16  # `Checkpointer(full_every=...)`'s default
_DATA = "d"  # the folder of an OCDBT database's data files
_MANIFEST_BYTES = 64 << 20  # a larger manifest is not one of ours: written whole
_LINKS_AT_ONCE = 16


@dataclasses.dataclass(frozen=True)
class Previous:
    """The step this process wrote last: its number, layout and chunks."""

    step: int
    layout: tuple
    kept: Kept  # a copy of its chunks, with their checksums (`StoreWriter.kept`)
    manifest: bytes  # the SHA-256 of its database's manifest, as written
    files: tuple[str, ...] = ()  # its database's data files, as written (`files_of`)


class Chain:
    """Which step the next save links from (`previous`), and after how many linked
    saves one is written whole (`full_every`; None: only when it must be)."""

    def __init__(self, full_every: int | None) -> None:
        self.full_every = full_every
        self._last: Previous | None = None
        self._linked = 0  # saves linked since the last whole one

    def previous(self, layout: tuple) -> Previous | None:
        """The step to link from for a save of `layout`, or None: write it whole."""
        last = self._last
        if last is None or last.layout != layout:
            return None
        if self.full_every is not None and self._linked + 1 >= self.full_every:
            return None
        return last

    def written(
        self,
        step: int,
        layout: tuple,
        kept: Kept,
        written: tuple[bytes, tuple[str, ...]],
        linked: bool,
    ) -> None:
        """A step committed (`written`: its manifest's digest and its data files,
        `manifest_digest` and `files_of`; `linked`: from the previous one)."""
        self._last = Previous(step, layout, kept, *written)
        self._linked = self._linked + 1 if linked else 0

    def broken(self) -> None:
        """A save failed: the next one is written whole."""
        self._last = None


def part_of(index: int) -> str:
    """The folder of process `index`'s database in a step's state item."""
    return (
        _format.STATE_ITEM
        if index == 0
        else f"{_format.STATE_ITEM}/{_format.PROCESS_PREFIX}{index}"
    )


def manifest_digest(storage: Storage, name: str, part: str) -> bytes:
    """The SHA-256 of the manifest of the database `part` of the step `name` (b"" when
    it has none): what a step's database is, as a later `link` checks it."""
    manifest = storage.read_file(f"{name}/{part}/{MANIFEST}", _MANIFEST_BYTES)
    return b"" if manifest is None else hashlib.sha256(manifest).digest()


def files_of(storage: Storage, name: str, part: str) -> tuple[str, ...]:
    """The data files of the database `part` of the step `name`, relative to its folder:
    what a later `link` links (those, not what the folder holds then)."""
    return tuple(f"{_DATA}/{n}" for n in storage.files_in(f"{name}/{part}/{_DATA}"))


def link(storage: Storage, previous: Previous, temp: str, part: str) -> list[str]:
    """Put the `previous` step's database `part` (`part_of`) into the step being written
    under the name `temp` (relative to the directory): its data files as written
    (`previous.files`) linked, its manifest copied. The linked names (relative to the
    database's folder). A step whose manifest is not the one written (replaced
    meanwhile), one of whose data files is gone or no longer a file, or whose index no
    longer reads (its files cut: read where the store can, `needed`, as TensorStore
    will read it), is not linked from (`OSError`: the new step would point at a file
    it does not hold, or its write fail; files planted there since are not linked
    either). On any failure what was linked is removed again and the error raised (the
    caller writes the step whole)."""
    source, target = f"{previous.step}/{part}", f"{temp}/{part}"
    manifest = storage.read_file(f"{source}/{MANIFEST}", _MANIFEST_BYTES)
    if manifest is None or hashlib.sha256(manifest).digest() != previous.manifest:
        raise FileNotFoundError(f"step {previous.step}'s {part} is not the one written")
    files = list(previous.files)
    if not files:
        raise FileNotFoundError(f"step {previous.step} has no data files in {part}")
    done: list[str] = []

    def one(name: str) -> None:
        storage.link(f"{source}/{name}", f"{target}/{name}")
        done.append(name)

    try:
        with concurrent.futures.ThreadPoolExecutor(min(_LINKS_AT_ONCE, len(files))) as pool:
            list(pool.map(one, files))
        storage.write_file(storage.step_path(f"{target}/{MANIFEST}"), manifest)
        done.append(MANIFEST)
        storage.needed(target)
    except _ocdbt.Damaged as e:
        _unlink(storage, target, done)
        raise OSError(f"step {previous.step}'s {part} is damaged: {e}") from e
    except BaseException:
        _unlink(storage, target, done)
        raise
    return files


def _unlink(storage: Storage, target: str, done: list[str]) -> None:
    """Remove what `link` put into the database `target` (the step is written whole)."""
    for name in done:
        storage.remove_file(f"{target}/{name}")


def prune(storage: Storage, temp: str, part: str, linked: list[str]) -> int:
    """Remove from the database `part` of the step being written under `temp` the linked
    files its latest version does not read (where the store can tell: `needed`). The
    number removed."""
    database = f"{temp}/{part}"
    needed = storage.needed(database)
    if needed is None:
        return 0
    gone = [name for name in linked if name not in needed]
    for name in gone:
        storage.remove_file(f"{database}/{name}")
    return len(gone)


def relative(directory: str, temp: str) -> str:
    """The name of the step being written at `temp` (a path or URL under `directory`)."""
    if not temp.startswith(directory.rstrip("/") + "/"):
        raise ValueError(f"{temp} is not under {directory}")  # (a bug of ours)
    return temp[len(directory.rstrip("/")) + 1 :].strip("/")
