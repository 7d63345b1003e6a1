"""The one read path: a step's arrays, read in the layout the writer writes
(`_store.py`), checked while they are read.

`restore`, `restore(member=)`, `verify` and the command line read through `StepArrays`:

1. `StepArrays(storage, opened, leaves, light=True)` reads the state item's OCDBT index
   with the package's own reader where the storage gives one (`Storage.index`: a
   local step, a small bucket step read at once; `_ocdbt`), and opens TensorStore's
   database only for what needs it (`LocalChunks.database`, `BucketChunks.database`), with a
   context of its own (no data cached across reads: a step replaced under its name is
   never read from a cache).
2. `check_layouts()` reads every stored leaf's `.zarray` at once (raw bytes, each
   within 64 KiB) and checks it against the step's description (`LeafSpec`: dtype,
   shape, chunks) before anything is allocated on a file's claim (`LayoutError`).
3. `read(requests)` issues every read of every requested leaf (or region of one:
   a member, a device's block) before it waits on any, so chunks are read in
   parallel; each piece is checked against its CRC-32 as soon as it arrives, while
   the others are still being read (zlib releases the GIL). A leaf is read into one
   array allocated once, of its stored dtype: no copy that the result does not need.
   `read(..., keep=False)` (verify) checks and keeps nothing.

How a leaf is read follows what its `.zarray` says: a small uncompressed leaf (the
writer's raw chunks, <= `_format.SMALL_BYTES`) as the raw bytes of its chunks (no zarr
driver to open), and so is any uncompressed leaf whose bytes are held in memory (a
bucket step) or that is only checked; any other through TensorStore's zarr driver,
given the checked `.zarray` (not read twice), writing each piece straight into the
result, once the index says no chunk is longer than its layout allows.

A piece is a checksummed region when the step's checksums tile the leaf (the writer's
chunks or device blocks), else the region asked for; a region asked for that cuts
through checksummed regions is widened to them, so that every byte returned was
checked. Blocks the calling thread until the data is read; nothing runs after it
returns.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import dataclasses
import functools
import itertools
import json
import math
import mmap
import os
import sys
import threading
from collections.abc import Iterable
from types import ModuleType
from typing import TYPE_CHECKING, Any

import numpy as np

from .._base import _dtypes
from .._base._aligned import empty_aligned
from .._layout import _ocdbt
from .._layout._format import SMALL_BYTES, Sums, checksum, checksum_bytes, param_name, region_key
from .._layout._spec import LeafSpec

if TYPE_CHECKING:
    import tensorstore

    from .._storage._protocol import OpenedStep, Storage

Box = tuple[tuple[int, int], ...]  # (start, stop) per dimension; () for a scalar

_ZARRAY_MAX_BYTES = 64 << 10  # the writer's are ~200 B
# A step's OCDBT B-tree nodes and manifest, cached for the reads of one StepArrays only.
_NODE_CACHE_BYTES = 64 << 20


class LayoutError(ValueError):
    """A leaf's stored layout is not the one its description gives."""


class ChunkError(ValueError):
    """A raw chunk of a leaf is missing or not the size its layout gives."""


class ChecksumMismatch(Exception):
    """The data read of `leaf` in the region `region` (a checksum's key) does not have
    the CRC-32 recorded when it was written."""

    def __init__(self, leaf: LeafSpec, region: str) -> None:
        super().__init__(f"leaf {leaf.path}: the checksum of region {region!r} does not match")
        self.leaf, self.region = leaf, region


class LeafReadError(Exception):
    """Reading `leaf` failed with `cause` (TensorStore's error, or a `ChunkError`)."""

    def __init__(self, leaf: LeafSpec, cause: Exception) -> None:
        super().__init__(f"leaf {leaf.path}: {cause}")
        self.leaf, self.cause = leaf, cause


@dataclasses.dataclass(frozen=True)
class Layout:
    """A leaf's stored layout as its `.zarray` gives it, checked against its description."""

    shape: tuple[int, ...]
    dtype: np.dtype
    chunks: tuple[int, ...]
    raw: bool  # uncompressed, unfiltered, C order: the chunks' bytes are the elements
    separator: str  # between a chunk key's indices ('.' or '/')
    zarray: dict[str, Any]  # what TensorStore's zarr driver is given


def _ts() -> ModuleType:
    import tensorstore

    return tensorstore


def whole(shape: tuple[int, ...]) -> Box:
    return tuple((0, n) for n in shape)


def parse_region(key: str) -> Box:
    """A checksum's region key ('0:4,8:16'; '' for a scalar) as a box (the keys were
    checked against the leaf's shape when the step's description was read)."""
    if not key:
        return ()
    return tuple((int(a), int(b)) for a, b in (part.split(":") for part in key.split(",")))


def _slices(box: Box, origin: Box | None = None) -> tuple[slice, ...]:
    if origin is None:
        return tuple(slice(a, b) for a, b in box)
    return tuple(slice(a - o, b - o) for (a, b), (o, _) in zip(box, origin, strict=True))


def _meets(a: Box, b: Box) -> bool:
    return all(x0 < y1 and y0 < x1 for (x0, x1), (y0, y1) in zip(a, b, strict=True))


def _inside(a: Box, b: Box) -> bool:
    return all(y0 <= x0 and x1 <= y1 for (x0, x1), (y0, y1) in zip(a, b, strict=True))


def _clip(box: Box, outer: Box) -> Box:
    return tuple((max(a, c), min(b, d)) for (a, b), (c, d) in zip(box, outer, strict=True))


def _hull(boxes: Iterable[Box], rank: int) -> Box:
    boxes = list(boxes)
    return tuple((min(b[d][0] for b in boxes), max(b[d][1] for b in boxes)) for d in range(rank))


@functools.cache
def _threads() -> tensorstore.Context:
    """TensorStore's thread pools for reading, made once per process (each read's
    own context holds only its caches): pools made anew for every read start cold."""
    return _ts().Context(
        {
            "data_copy_concurrency": {"limit": os.cpu_count() or 1},
            "file_io_concurrency": {"limit": 64},
        }
    )


class StepArrays:
    """The arrays of one step (its `state` item), opened for reading; one per read
    of a step, used by one thread."""

    def __init__(
        self,
        storage: Storage,
        opened: OpenedStep,
        leaves: tuple[LeafSpec, ...],
        *,
        light: bool = False,
    ) -> None:
        """`storage`: where the step lives (`_places.at`), which opens its database;
        `opened`: the step, as `storage.open_step` returned it.
        `light`: read its index with `_ocdbt` where that reader can (a local step the
        writer wrote; a small step in a bucket, read in one round trip:
        `BucketChunks.index`), and TensorStore's database is opened only for what needs it (a
        large or compressed leaf): `verify` then starts without TensorStore's import,
        and a small step from a bucket is read in one round trip after its opening."""
        self.leaves = {spec.name: spec for spec in leaves}
        self._storage, self._step, self._count = storage, opened, len(leaves)  # (an OpenedStep)
        self.layouts: dict[tuple[str, ...], Layout] = {}
        self._opened: tensorstore.KvStore | None = None
        # Where keys are read, chosen once: the index `_ocdbt` read, else TensorStore's
        # database (a compressed index, or one that reader does not fully understand).
        self._keys: OwnIndex | TensorStoreKeys | None = None
        if light:
            try:
                self._keys = OwnIndex(storage.index(opened))
            except _ocdbt.Unsupported:
                pass
        if self._keys is None:
            self._keys = TensorStoreKeys(self._open())

    def _open(self) -> tensorstore.KvStore:
        """The step's database opened by TensorStore (once)."""
        if self._opened is not None:
            return self._opened
        ts = _ts()
        self._context = ts.Context(
            ts.Context.Spec(
                {
                    "cache_pool": {"total_bytes_limit": 0},
                    "cache_pool#nodes": {"total_bytes_limit": _NODE_CACHE_BYTES},
                    # A bucket's manifest is held in memory (`BucketChunks.database`): in a
                    # store of this read's own, not the shared parent's, which another
                    # thread's read of another step would overwrite.
                    "memory_key_value_store": {},
                }
            ),
            _threads(),
        )
        self._opened = self._storage.database(self._step, ts, self._context, self._count)
        return self._opened

    # -- layouts -------------------------------------------------------------------------

    def check_layouts(self, specs: Iterable[LeafSpec] | None = None) -> None:
        """Read the `.zarray` of every stored leaf of `specs` (default: all) at once
        and check it against the leaf's description; `LayoutError` naming the first
        leaf that does not agree, `LeafReadError` for one that cannot be read. Nothing
        is read of a leaf before this."""
        wanted = [
            s
            for s in (self.leaves.values() if specs is None else specs)
            if 0 not in s.stored_shape and s.name not in self.layouts
        ]
        keys = self._keys
        assert keys is not None
        reads = [(s, keys.read(f"{param_name(s.name)}/.zarray", _ZARRAY_MAX_BYTES)) for s in wanted]
        for saved, future in reads:
            try:
                result = future.result()
            except Exception as e:
                raise LeafReadError(saved, e) from e
            self.layouts[saved.name] = _layout(saved, result)

    # -- reading -------------------------------------------------------------------------

    def read(
        self,
        requests: list[tuple[LeafSpec, Box | None]],
        sums: Sums | None,
        *,
        keep: bool = True,
    ) -> list[np.ndarray]:
        """The stored data of each (leaf, box) of `requests` (box None: the whole leaf),
        as new arrays of the stored dtype, read concurrently. With `sums` ({leaf name:
        {region key: CRC-32}}), every region read is checked: `ChecksumMismatch` for the
        first that differs. A failed read is a `LeafReadError`. The same (leaf, box)
        asked for twice is read once (the same array is returned). `check_layouts`
        first. `keep=False`: read and check only, and return nothing (`verify`: a raw
        leaf's chunks are then checked as they are, never copied into an array)."""
        pending: dict[tuple[tuple[str, ...], Box], _RawLeaf | _ZarrBox] = {}
        order = []
        for saved, box in requests:
            layout = self.layouts[saved.name]
            box = whole(layout.shape) if box is None else box
            key = (saved.name, box)
            if key not in pending:
                leaf_sums = None if sums is None else sums.get(param_name(saved.name))
                try:
                    pending[key] = self._start(saved, layout, box, leaf_sums, whole=not keep)
                except Exception as e:
                    raise LeafReadError(saved, e) from e
            order.append(key)
        done: dict[tuple[tuple[str, ...], Box], np.ndarray] = {}
        for key, one in pending.items():
            try:
                if keep:
                    done[key] = one.finish()
                elif isinstance(one, _RawLeaf):
                    one.check()
                else:
                    one.finish()
            except ChecksumMismatch:
                raise
            except Exception as e:
                raise LeafReadError(one.saved, e) from e
        return [done[key] for key in order] if keep else []

    def _start(
        self,
        saved: LeafSpec,
        layout: Layout,
        box: Box,
        sums: dict[str, int] | None,
        *,
        whole: bool,
    ) -> _RawLeaf | _ZarrBox:
        """How a leaf is read: as its chunks' bytes (a small raw leaf; any raw leaf
        through the package's own index when its values are held in memory, or when
        only checked, `whole`), else through TensorStore's zarr driver, which reads
        into the result without a copy."""
        nbytes = layout.dtype.itemsize * math.prod(layout.shape)
        keys = self._keys
        assert keys is not None
        own = isinstance(keys, OwnIndex)
        if layout.raw and (nbytes <= SMALL_BYTES or (own and (whole or keys.held))):
            return _RawLeaf(keys, saved, layout, box, sums or {})
        # Every checksummed region meeting the box is read whole, so that each byte
        # returned is checked (a region of the writer's is a chunk or a device's block).
        if own:  # TensorStore would read a chunk as long as it claims
            keys.check_chunks(saved, layout)
        hit = [(k, r) for k, r in ((k, parse_region(k)) for k in sums or {}) if _meets(r, box)]
        outer = _hull([box] + [r for _, r in hit], len(box))
        return _ZarrBox(self._zarr(saved, layout), saved, layout, box, outer, hit, sums or {})

    def _zarr(self, saved: LeafSpec, layout: Layout) -> tensorstore.TensorStore:
        """The leaf's zarr array, opened on its checked `.zarray` (not read again)."""
        return (
            _ts()
            .open(
                {"driver": "zarr", "metadata": layout.zarray},
                kvstore=self._open() / f"{param_name(saved.name)}/",
                context=self._context,
                open=True,
                assume_metadata=True,
                read=True,
            )
            .result()
        )


class _ZarrBox:
    """A box of a leaf read through the zarr driver, widened to `outer` (whole
    checksummed regions), into one new 64-byte-aligned array (JAX adopts such an array
    on a CPU without a copy, `_rebuild.rebuild`). When the checksummed regions tile
    `outer` (the writer's chunks or device blocks), each is read as a piece of its own,
    all at once, and checked as soon as it arrives (on the thread that completed it),
    while the others are read; else the chunks meeting `outer` are the pieces, and the
    regions are checked once all are read."""

    def __init__(
        self,
        store: tensorstore.TensorStore,
        saved: LeafSpec,
        layout: Layout,
        box: Box,
        outer: Box,
        hit: list[tuple[str, Box]],
        sums: dict[str, int],
    ) -> None:
        self.saved, self.box, self.outer, self.sums = saved, box, outer, sums
        shape, chunks = layout.shape, layout.chunks
        destination = _Destination(tuple(b - a for a, b in outer), store.dtype.numpy_dtype)
        self.data = destination.array
        target = _ts().array(self.data, copy=False, write=True)
        if outer and len(hit) > 1 and tiles([r for _, r in hit], outer):
            pieces = [(r, [(k, r)]) for k, r in hit]
        elif outer:  # the chunks meeting `outer`, then every region checked at the end
            cells = [_clip(c, outer) for c in _chunk_boxes(shape, chunks) if _meets(c, outer)]
            pieces = [(c, []) for c in cells[:-1]] + [(cells[-1], hit)]
        else:  # a scalar
            pieces = [(outer, hit)]
        self.crcs: dict[str, int] = {}  # computed as each piece arrives
        self.pending = []
        for piece, checked in pieces:
            if piece:
                destination.populate(
                    tuple((a - o, b - o) for (a, b), (o, _) in zip(piece, outer, strict=True))
                )
                source = store[_slices(piece)].translate_to[0]
                into = target[_slices(piece, outer)].translate_to[0]
            else:  # a scalar
                source, into = store, target
            future, done = into.write(source), threading.Event()
            # The checksums of a piece are computed on the thread that completes its
            # read, as soon as it does, while this thread populates the next pieces.
            future.add_done_callback(functools.partial(self._check, checked, done))
            self.pending.append((future, done, checked))

    def _check(
        self, checked: list[tuple[str, Box]], done: threading.Event, future: tensorstore.Future
    ) -> None:
        try:
            if future.exception() is None:
                for key, region in checked:
                    self.crcs[key] = checksum(self.data[_slices(region, self.outer)])
        finally:
            done.set()

    def finish(self) -> np.ndarray:
        for future, done, checked in self.pending:
            future.result()
            done.wait()
            for key, region in checked:
                crc = self.crcs.get(key)
                if crc is None:  # the callback could not compute it: compute it here
                    crc = checksum(self.data[_slices(region, self.outer)])
                if crc != self.sums[key]:
                    raise ChecksumMismatch(self.saved, key)
        if self.outer == self.box:
            return self.data
        return self.data[_slices(self.box, self.outer)].copy()


class _Destination:
    """The new array a box is read into: 64-byte aligned (JAX adopts it on a CPU
    without a copy). A large one is an anonymous mapping whose pages are populated
    piece by piece just before each piece's read is issued (Linux's
    MADV_POPULATE_WRITE), so that TensorStore's threads copy into memory that is there
    while this thread populates the next piece. A whole 256 MiB restore, checks
    included: faulting the pages in while copying, 60-220 ms and 300-480 ms in a third
    of the benchmark's runs; populated all at once first, a steady 127-168 ms; piece by
    piece, 105-132 ms (a read into an array TensorStore allocates: 104-134 ms, which
    JAX then copies: ~100 ms more)."""

    def __init__(self, shape: tuple[int, ...], dtype: np.dtype) -> None:
        nbytes = math.prod(shape) * dtype.itemsize
        self._region: mmap.mmap | None = None
        if nbytes >= _POPULATE_BYTES and _populate_ok and hasattr(mmap, "MAP_ANONYMOUS"):
            self._region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            self.array = np.frombuffer(self._region, np.uint8).view(dtype).reshape(shape)
        else:
            self.array = empty_aligned(shape, dtype)
        self._row = dtype.itemsize * math.prod(shape[1:])  # bytes per index of axis 0

    def populate(self, piece: Box) -> None:
        """Populate the pages of `piece` (local coordinates) before it is written; all
        of them when the piece is not one run of bytes (it spans only part of an axis
        after the first)."""
        global _populate_ok
        if self._region is None:
            return
        shape = self.array.shape
        if piece and all(p == (0, n) for p, n in zip(piece[1:], shape[1:], strict=True)):
            start, stop = piece[0][0] * self._row, piece[0][1] * self._row
        else:  # once, all of it
            start, stop = 0, len(self._region)
            self._region = None
        first = start - start % mmap.PAGESIZE
        # Through ctypes, which lets go of the GIL while the kernel populates (mmap's
        # madvise holds it): the checks of the pieces already read run meanwhile.
        address = self.array.ctypes.data + first
        if _libc().madvise(ctypes.c_void_p(address), stop - first, _MADV_POPULATE_WRITE):
            # a kernel before 5.14: pages are faulted in as they are written
            _populate_ok = False
            self._region = None


@functools.cache
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    return libc


_POPULATE_BYTES = 4 << 20
_MADV_POPULATE_WRITE = 23  # <linux/mman.h>; Python's mmap does not name it
_populate_ok = sys.platform == "linux"


def tiles(regions: list[Box], outer: Box) -> bool:
    """The regions are exactly the cells of a grid over `outer` (each cell once, nothing
    outside it): reading them fills every element of `outer` once."""
    edges = [sorted({r[d][0] for r in regions} | {stop}) for d, (_, stop) in enumerate(outer)]
    if any(e[0] != start for e, (start, _) in zip(edges, outer, strict=True)):
        return False
    cells = {
        tuple(zip(starts, stops, strict=True))
        for starts, stops in zip(
            itertools.product(*(e[:-1] for e in edges)),
            itertools.product(*(e[1:] for e in edges)),
            strict=True,
        )
    }
    return len(cells) == len(regions) and cells == set(regions)


class _RawLeaf:
    """A small uncompressed leaf, read whole as the raw bytes of its chunks (the writer
    pads edge chunks to the full chunk size, as zarr does)."""

    def __init__(
        self,
        keys: OwnIndex | TensorStoreKeys,
        saved: LeafSpec,
        layout: Layout,
        box: Box,
        sums: dict[str, int],
    ) -> None:
        self.saved, self.layout, self.box, self.sums = saved, layout, box, sums
        self._size = layout.dtype.itemsize * math.prod(layout.chunks)
        name = param_name(saved.name)
        self.chunks = list(_chunk_boxes(layout.shape, layout.chunks))
        self.futures = [
            keys.read(f"{name}/{_chunk_key(c, layout.chunks, layout.separator)}", self._size)
            for c in self.chunks
        ]

    def finish(self) -> np.ndarray:
        layout = self.layout
        full = whole(layout.shape)
        blocks = [
            self._bytes(chunk, future)
            for chunk, future in zip(self.chunks, self.futures, strict=True)
        ]
        if self.chunks == [full] and list(self.sums) in ([], [region_key(full)]):
            # The common case (a leaf written whole): its one chunk's bytes are the
            # leaf's, checked as they are, then copied once into memory of its own.
            for key, crc in self.sums.items():
                if checksum_bytes(blocks[0]) != crc:
                    raise ChecksumMismatch(self.saved, key)
            dest = np.frombuffer(blocks[0], layout.dtype).reshape(layout.shape).copy()
        else:
            dest = empty_aligned(layout.shape, layout.dtype)
            for chunk, data in zip(self.chunks, blocks, strict=True):
                dest[_slices(chunk)] = _unpadded(data, layout, chunk)
            for key, crc in self.sums.items():
                if checksum(dest[_slices(parse_region(key))]) != crc:
                    raise ChecksumMismatch(self.saved, key)
        return dest if self.box == full else dest[_slices(self.box)].copy()

    def check(self) -> None:
        """Read every chunk and check each checksummed region that is a chunk as its
        bytes are (an edge chunk without its padding), keeping no array; a step whose
        regions are not its chunks is checked as `finish` reads it."""
        layout = self.layout
        regions = {parse_region(key): (key, crc) for key, crc in self.sums.items()}
        for chunk, future in zip(self.chunks, self.futures, strict=True):
            data = self._bytes(chunk, future)
            hit = regions.pop(chunk, None)
            if hit is None:
                continue
            if all(b - a == c for (a, b), c in zip(chunk, layout.chunks, strict=True)):
                crc = checksum_bytes(data)
            else:  # an edge chunk
                crc = checksum(_unpadded(data, layout, chunk))
            if crc != hit[1]:
                raise ChecksumMismatch(self.saved, hit[0])
        if regions:
            self.finish()

    def _bytes(self, chunk: Box, future: concurrent.futures.Future[bytes | None]) -> bytes:
        """A chunk's bytes, once they are there and the size its layout gives."""
        layout = self.layout
        data = future.result()
        if data is not None and len(data) == self._size:
            return data
        where = f"{param_name(self.saved.name)}/" + _chunk_key(
            chunk, layout.chunks, layout.separator
        )
        if data is None:
            raise ChunkError(f"its chunk '{where}' is missing")
        raise ChunkError(
            f"its chunk '{where}' holds {len(data)} bytes where its layout gives {self._size}"
        )


def _unpadded(data: bytes, layout: Layout, chunk: Box) -> np.ndarray:
    """The elements of `chunk` in its stored bytes (an edge chunk is stored padded to
    the full chunk shape, as zarr stores it)."""
    block = np.frombuffer(data, layout.dtype).reshape(layout.chunks)
    return block[tuple(slice(0, b - a) for a, b in chunk)]


# -- where keys are read: one interface, two implementations --------------------------------
#
# `read(key, at_most)` gives a future of the key's value (bytes; None when the key is not
# there). A StepArrays chooses one implementation once, for the whole read.


class OwnIndex:
    """The values of a database whose index `_ocdbt` read: each value's size is known
    before it is read, so one longer than its layout allows is refused unread. Inline
    and small values are read at once, larger ones by `os.pread` on a pool of threads
    (which lets go of the GIL), all at once. (Handing a small read to the pool costs
    more than the read: 80 leaves of 13 KiB, 6.4 ms all on the pool.)"""

    def __init__(self, index: _ocdbt.Database) -> None:
        self.index = index
        self.held = isinstance(index.files, _ocdbt.Held)  # values in memory already

    def check_chunks(self, saved: LeafSpec, layout: Layout) -> None:
        """Every stored chunk of `saved` is at most as long as its layout allows
        (`ChunkError` else), before TensorStore reads one (it allocates what a value
        claims)."""
        bound, name = _chunk_bound(layout), param_name(saved.name)
        for chunk in _chunk_boxes(layout.shape, layout.chunks):
            key = f"{name}/{_chunk_key(chunk, layout.chunks, layout.separator)}"
            where = self.index.locate(key)
            if isinstance(where, _ocdbt.Indirect) and where.length > bound:
                raise ChunkError(f"'{key}' is {where.length} bytes, where at most {bound} can be")

    def read(self, key: str, at_most: int) -> concurrent.futures.Future[bytes | None]:
        """The value of `key`, read only if it is at most `at_most` bytes (what its
        layout gives: a longer one is damage, and nothing is allocated for it)."""
        where = self.index.locate(key)
        if isinstance(where, _ocdbt.Indirect) and where.length > at_most:
            refused: concurrent.futures.Future[bytes | None] = concurrent.futures.Future()
            refused.set_exception(
                ChunkError(f"'{key}' is {where.length} bytes, where at most {at_most} can be")
            )
            return refused
        if isinstance(where, _ocdbt.Indirect) and where.length > _AT_ONCE_BYTES:
            return _pool().submit(self.index.read_range, where)
        future: concurrent.futures.Future[bytes | None] = concurrent.futures.Future()
        try:
            if isinstance(where, _ocdbt.Indirect):
                where = self.index.read_range(where)
            future.set_result(where)
        except Exception as e:
            future.set_exception(e)
        return future


class TensorStoreKeys:
    """The values of a database TensorStore opened (`Storage.database`): a read is as
    long as the value, whose size is checked once it is read (`at_most` is not known
    to TensorStore beforehand)."""

    def __init__(self, store: tensorstore.KvStore) -> None:
        self.store = store

    def read(self, key: str, at_most: int) -> concurrent.futures.Future[bytes | None]:
        del at_most  # (checked by the caller, once read)
        future: concurrent.futures.Future[bytes | None] = concurrent.futures.Future()

        def done(read: tensorstore.Future[tensorstore.KvStore.ReadResult]) -> None:
            try:
                result = read.result()
            except BaseException as e:  # (TensorStore's error, raised by .result())
                future.set_exception(e)
            else:
                future.set_result(bytes(result.value) if result.state == "value" else None)

        self.store.read(key).add_done_callback(done)
        return future


_AT_ONCE_BYTES = 256 << 10  # values up to this size are read by the calling thread


def _chunk_bound(layout: Layout) -> int:
    """The most bytes a stored chunk of `layout` can be: its elements' bytes, plus
    zstd's worst case for incompressible data when it is compressed."""
    size = layout.dtype.itemsize * math.prod(layout.chunks)
    return size if layout.raw else size + (size >> 7) + 1024


@functools.cache
def _pool() -> concurrent.futures.ThreadPoolExecutor:
    return concurrent.futures.ThreadPoolExecutor(
        max_workers=min(16, 2 * (os.cpu_count() or 1)), thread_name_prefix="jax_cb_ckpt-read"
    )


def _chunk_boxes(shape: tuple[int, ...], chunks: tuple[int, ...]) -> Iterable[Box]:
    if not shape:
        yield ()
        return
    starts = [range(0, n, c) for n, c in zip(shape, chunks, strict=True)]
    for corner in itertools.product(*starts):
        yield tuple((s, min(s + c, n)) for s, c, n in zip(corner, chunks, shape, strict=True))


def _chunk_key(box: Box, chunks: tuple[int, ...], separator: str) -> str:
    if not box:
        return "0"
    return separator.join(str(a // c) for (a, _), c in zip(box, chunks, strict=True))


# -- a leaf's .zarray, checked --------------------------------------------------------------


def _layout(saved: LeafSpec, value: bytes | None) -> Layout:
    """The `.zarray` a read gave for `saved`, parsed and checked against it."""
    name = param_name(saved.name)
    if value is None:
        raise LayoutError(
            f"leaf {saved.path}: its stored array ('{name}/.zarray') is missing: the step "
            "was edited or corrupted; nothing was read from it"
        )
    try:
        if len(value) > _ZARRAY_MAX_BYTES:
            raise ValueError(f"larger than {_ZARRAY_MAX_BYTES >> 10} KiB")
        zarray = json.loads(value)
        if not isinstance(zarray, dict):
            raise ValueError("not a JSON object")
        stored = _dtypes.named(zarray["dtype"])
        shape, chunks = tuple(zarray["shape"]), tuple(zarray["chunks"])
        separator = zarray.get("dimension_separator", ".")
        if separator not in (".", "/"):
            raise ValueError(f"dimension_separator {separator!r}")
    except (ValueError, TypeError, KeyError, RecursionError) as e:
        raise LayoutError(
            f"leaf {saved.path}: its stored array's description ('{name}/.zarray') cannot "
            f"be read ({e}): the step was edited or corrupted; nothing was read from it"
        ) from None
    check_layout(saved, saved.stored_shape, shape, stored, chunks)
    raw = (
        zarray.get("compressor") is None
        and not zarray.get("filters")
        and zarray.get("order", "C") == "C"
    )
    kept = {k: zarray[k] for k in _ZARRAY_KEYS if k in zarray}
    return Layout(tuple(shape), stored, tuple(chunks), raw, separator, kept)


_ZARRAY_KEYS = (
    "chunks",
    "compressor",
    "dimension_separator",
    "dtype",
    "fill_value",
    "filters",
    "order",
    "shape",
    "zarr_format",
)


def check_layout(
    saved: LeafSpec,
    expected: tuple[int, ...],
    shape: tuple[Any, ...],
    stored: np.dtype,
    chunks: tuple[Any, ...],
) -> None:
    """A stored array of `shape`, `stored` dtype and `chunks` holds leaf `saved` (of
    stored shape `expected`); else `LayoutError` saying what differs."""
    dtype = _dtypes.named(saved.dtype)
    problem = None
    if tuple(shape) != tuple(expected):
        problem = f"shape {list(shape)}, where the description gives {list(expected)}"
    elif _dtypes.from_storage(np.zeros(0, stored), dtype) is None:
        problem = f"dtype {stored.name}, where the description gives {dtype.name}"
    elif len(chunks) != len(expected) or not all(
        isinstance(c, int) and not isinstance(c, bool) and 1 <= c <= max(1, n)
        for c, n in zip(chunks, expected, strict=False)
    ):
        problem = f"chunks {list(chunks)}, which do not fit its shape {list(expected)}"
    if problem is not None:
        raise LayoutError(
            f"leaf {saved.path}: its stored array ('{param_name(saved.name)}/.zarray') has "
            f"{problem}: the step was edited or corrupted; nothing was read from it"
        )
