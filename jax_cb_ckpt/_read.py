"""The one read path: a step's arrays, read with TensorStore in the layout the writer
writes (`_store.py`), checked while they are read.

`restore`, `restore(member=)`, `verify` and the command line read through `StepArrays`:

1. `StepArrays(step_dir, meta)` opens the state item's OCDBT database once (local
   files or a bucket prefix: `_store.base_spec`), with a context of its own (no data
   cached across reads: a step replaced under its name is never read from a cache).
2. `check_layouts()` reads every stored leaf's `.zarray` at once (raw bytes, each
   within 64 KiB) and checks it against the step's description (`LeafSpec`: dtype,
   shape, chunks) before anything is allocated on a file's claim (`LayoutError`).
3. `read(requests)` issues every read of every requested leaf (or region of one:
   a member, a device's block) before it waits on any, so chunks are read in
   parallel on TensorStore's threads; each piece is checked against its CRC-32 as
   soon as it arrives, while the others are still being read (zlib releases the
   GIL). A leaf is read into one array allocated once, of its stored dtype: no copy
   that the result does not need.

How a leaf is read follows what its `.zarray` says: a small uncompressed leaf (the
writer's raw chunks, <= `_store.SMALL_BYTES`) as the raw bytes of its chunks (no zarr
driver to open); any other through TensorStore's zarr driver, given the checked
`.zarray` (not read twice), writing each piece straight into the result.

A piece is a checksummed region when the step's checksums tile the leaf (the writer's
chunks or device blocks), else the region asked for; a region asked for that cuts
through checksummed regions is widened to them, so that every byte returned was
checked. Blocks the calling thread until the data is read; nothing runs after it
returns.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import itertools
import json
import math
import os
from collections.abc import Iterable
from typing import Any

import numpy as np

from . import _dtypes, _remote
from ._format import SMALL_FILE_MAX_BYTES, STATE_ITEM, read_bytes
from ._spec import LeafSpec
from ._staging import empty_aligned
from ._store import CHUNK_BYTES, SMALL_BYTES, base_spec, checksum, param_name

Box = tuple[tuple[int, int], ...]  # (start, stop) per dimension; () for a scalar

_ZARRAY_MAX_BYTES = 64 << 10  # the writer's are ~200 B
_MANIFEST = "manifest.ocdbt"  # the OCDBT database's root (`_store.ocdbt_spec`)
# A step's OCDBT B-tree nodes and manifest, cached for the reads of one StepArrays only.
_NODE_CACHE_BYTES = 64 << 20


# In a bucket, reads of values near each other in one data file (small leaves' chunks,
# written one after the other) issued within a millisecond are merged into one read:
# one request instead of one per chunk (80 leaves from moto: 181 -> 30 ms). Local
# files gain nothing from it (each read is a system call, not a round trip) and lose
# the millisecond.
_COALESCING = {
    "experimental_read_coalescing_threshold_bytes": 1 << 20,
    "experimental_read_coalescing_merged_bytes": CHUNK_BYTES,  # large chunks: in parallel
    "experimental_read_coalescing_interval": "1ms",
}


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


def _ts() -> Any:
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


def _hull(boxes: Iterable[Box], rank: int) -> Box:
    boxes = list(boxes)
    return tuple((min(b[d][0] for b in boxes), max(b[d][1] for b in boxes)) for d in range(rank))


@functools.cache
def _threads() -> Any:
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

    def __init__(self, step_dir: str, leaves: tuple[LeafSpec, ...]) -> None:
        ts = _ts()
        self.step_dir = step_dir
        self.leaves = {spec.name: spec for spec in leaves}
        self._context = ts.Context(
            ts.Context.Spec(
                {
                    "cache_pool": {"total_bytes_limit": 0},
                    "cache_pool#nodes": {"total_bytes_limit": _NODE_CACHE_BYTES},
                }
            ),
            _threads(),
        )
        state = os.path.join(step_dir, STATE_ITEM)
        spec: dict[str, Any] = {
            "driver": "ocdbt",
            "base": base_spec(state),
            "cache_pool": "cache_pool#nodes",
        }
        if _remote.is_url(state):
            spec.update(_COALESCING)
            # A committed step never changes: its manifest is read once, here, and the
            # database reads it from memory. Else every batch of reads would first ask
            # the server whether it changed (a round trip), a question a server that
            # sends no generation (gcp-storage-emulator) cannot answer.
            manifest = read_bytes(f"{state}/{_MANIFEST}", SMALL_FILE_MAX_BYTES)
            memory = ts.KvStore.open({"driver": "memory"}, context=self._context).result()
            memory.write(_MANIFEST, manifest).result()
            spec["manifest"] = {"driver": "memory"}
        self._kv = ts.KvStore.open(spec, context=self._context).result()
        self.layouts: dict[tuple[str, ...], Layout] = {}

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
        reads = [(s, self._kv.read(f"{param_name(s.name)}/.zarray")) for s in wanted]
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
        sums: dict[str, dict[str, int]] | None,
    ) -> list[np.ndarray]:
        """The stored data of each (leaf, box) of `requests` (box None: the whole leaf),
        as new arrays of the stored dtype, read concurrently. With `sums` ({leaf name:
        {region key: CRC-32}}), every region read is checked: `ChecksumMismatch` for the
        first that differs. A failed read is a `LeafReadError`. The same (leaf, box)
        asked for twice is read once (the same array is returned). `check_layouts`
        first."""
        pending: dict[tuple[tuple[str, ...], Box], _RawLeaf | _ZarrBox] = {}
        order = []
        for saved, box in requests:
            layout = self.layouts[saved.name]
            box = whole(layout.shape) if box is None else box
            key = (saved.name, box)
            if key not in pending:
                leaf_sums = None if sums is None else sums.get(param_name(saved.name))
                try:
                    pending[key] = self._start(saved, layout, box, leaf_sums)
                except Exception as e:
                    raise LeafReadError(saved, e) from e
            order.append(key)
        done: dict[tuple[tuple[str, ...], Box], np.ndarray] = {}
        for key, one in pending.items():
            try:
                done[key] = one.finish()
            except ChecksumMismatch:
                raise
            except Exception as e:
                raise LeafReadError(one.saved, e) from e
        return [done[key] for key in order]

    def _start(
        self,
        saved: LeafSpec,
        layout: Layout,
        box: Box,
        sums: dict[str, int] | None,
    ) -> _RawLeaf | _ZarrBox:
        nbytes = layout.dtype.itemsize * math.prod(layout.shape)
        if layout.raw and nbytes <= SMALL_BYTES:
            return _RawLeaf(self._kv, saved, layout, box, sums or {})
        # Every checksummed region meeting the box is read whole, so that each byte
        # returned is checked (a region of the writer's is a chunk or a device's block).
        hit = [(k, r) for k, r in ((k, parse_region(k)) for k in sums or {}) if _meets(r, box)]
        outer = _hull([box] + [r for _, r in hit], len(box))
        return _ZarrBox(self._zarr(saved, layout), saved, box, outer, hit, sums or {})

    def _zarr(self, saved: LeafSpec, layout: Layout) -> Any:
        """The leaf's zarr array, opened on its checked `.zarray` (not read again)."""
        return (
            _ts()
            .open(
                {"driver": "zarr", "metadata": layout.zarray},
                kvstore=self._kv / f"{param_name(saved.name)}/",
                context=self._context,
                open=True,
                assume_metadata=True,
                read=True,
            )
            .result()
        )


class _ZarrBox:
    """A box of a leaf read through the zarr driver, widened to `outer` (whole
    checksummed regions): one read, whose chunks TensorStore reads in parallel and
    decodes straight into one new 64-byte-aligned array (JAX adopts such an array on a
    CPU without a copy, `_tree.rebuild`); then each region's checksum, on every core.
    (One read of the box was steadier here than a read per chunk into the same array,
    which halved or doubled with the allocator's state: 95-530 ms for 256 MiB against
    100-135 ms.)"""

    def __init__(
        self,
        store: Any,
        saved: LeafSpec,
        box: Box,
        outer: Box,
        hit: list[tuple[str, Box]],
        sums: dict[str, int],
    ) -> None:
        self.saved, self.box, self.outer, self.hit, self.sums = saved, box, outer, hit, sums
        source = (store[_slices(outer)] if outer else store).translate_to[0]
        self.data = empty_aligned(tuple(b - a for a, b in outer), store.dtype.numpy_dtype)
        self.future = _ts().array(self.data, copy=False, write=True).write(source)

    def finish(self) -> np.ndarray:
        self.future.result()
        data = self.data
        regions = [data[_slices(region, self.outer)] for _, region in self.hit]
        crcs = _checksums(regions)
        for (key, _), crc in zip(self.hit, crcs, strict=True):
            if crc != self.sums[key]:
                raise ChecksumMismatch(self.saved, key)
        if self.outer == self.box:
            return data
        return data[_slices(self.box, self.outer)].copy()


def _checksums(arrays: list[np.ndarray]) -> list[int]:
    """The CRC-32 of each array; large ones on every core (the CRC releases the GIL)."""
    if sum(a.nbytes for a in arrays) < _PARALLEL_CHECKSUM_BYTES or len(arrays) < 2:
        return [checksum(a) for a in arrays]
    return list(_checksum_pool().map(checksum, arrays))


_PARALLEL_CHECKSUM_BYTES = 8 << 20


@functools.cache
def _checksum_pool() -> concurrent.futures.ThreadPoolExecutor:
    return concurrent.futures.ThreadPoolExecutor(
        max_workers=os.cpu_count() or 1, thread_name_prefix="jax_cb_ckpt-checksum"
    )


class _RawLeaf:
    """A small uncompressed leaf, read whole as the raw bytes of its chunks (the writer
    pads edge chunks to the full chunk size, as zarr does)."""

    def __init__(
        self,
        kv: Any,
        saved: LeafSpec,
        layout: Layout,
        box: Box,
        sums: dict[str, int],
    ) -> None:
        self.saved, self.layout, self.box, self.sums = saved, layout, box, sums
        name = param_name(saved.name)
        self.chunks = list(_chunk_boxes(layout.shape, layout.chunks))
        self.futures = [
            kv.read(f"{name}/{_chunk_key(c, layout.chunks, layout.separator)}") for c in self.chunks
        ]

    def finish(self) -> np.ndarray:
        layout = self.layout
        dest = empty_aligned(layout.shape, layout.dtype)
        size = layout.dtype.itemsize * math.prod(layout.chunks)
        for chunk, future in zip(self.chunks, self.futures, strict=True):
            result = future.result()
            where = f"{param_name(self.saved.name)}/" + _chunk_key(
                chunk, layout.chunks, layout.separator
            )
            if result.state != "value":
                raise ChunkError(f"its chunk '{where}' is missing")
            data = result.value
            if len(data) != size:
                raise ChunkError(
                    f"its chunk '{where}' holds {len(data)} bytes where its layout gives {size}"
                )
            block = np.frombuffer(data, layout.dtype).reshape(layout.chunks)
            dest[_slices(chunk)] = block[tuple(slice(0, b - a) for a, b in chunk)]
        for key, crc in self.sums.items():
            if checksum(dest[_slices(parse_region(key))]) != crc:
                raise ChecksumMismatch(self.saved, key)
        return dest if self.box == whole(layout.shape) else dest[_slices(self.box)].copy()


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


def _layout(saved: LeafSpec, result: Any) -> Layout:
    """The `.zarray` a read gave for `saved`, parsed and checked against it."""
    name = param_name(saved.name)
    if result.state != "value":
        raise LayoutError(
            f"leaf {saved.path}: its stored array ('{name}/.zarray') is missing: the step "
            "was edited or corrupted; nothing was read from it"
        )
    value = bytes(result.value)
    try:
        if len(value) > _ZARRAY_MAX_BYTES:
            raise ValueError(f"larger than {_ZARRAY_MAX_BYTES >> 10} KiB")
        zarray = json.loads(value)
        if not isinstance(zarray, dict):
            raise ValueError("not a JSON object")
        stored = np.dtype(zarray["dtype"])
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
    dtype = np.dtype(saved.dtype)
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
