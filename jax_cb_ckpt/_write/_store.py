"""The state item's arrays, written with TensorStore in the layout Orbax reads.

Orbax's `PyTreeCheckpointHandler` stores a tree of arrays as zarr (v2) arrays inside one
OCDBT database (TensorStore's key-value store packed into a few files) per item; plain
Orbax reads it back with any reader of that handler. Writing through Orbax costs ~30 ms
of Python machinery per save (event loops, threads, signalling, a merge, renames, ~42
fsyncs in serial chains: docs/writer.md), where the disk commits a small step in ~2 ms.
So the writer writes the same layout itself, with TensorStore (Orbax's own storage
engine), and reading stays Orbax's:

    <state>/_METADATA                 the tree (Orbax's JSON; every leaf a numpy array)
    <state>/manifest.ocdbt, d/...      the root database: process 0's arrays
    <state>/ocdbt.process_<i>/...      process i's arrays (several processes), whose
                                       index process 0 merges into the root database

Inside the database a leaf at tree path ('params', 'w') is the zarr array `params.w/`
(`.zarray` JSON, chunks `params.w/0.0`, ...), as Orbax names it. One transaction per
process and save; TensorStore's own fsyncs are off (the writer makes the files of a
step durable before its rename, `_durable.StepSync`).

Chunks: a sharded leaf is written block by block, one chunk per device's block (each
process writes only the blocks whose lowest-numbered holder it is); a leaf written
whole is split along its leading axes into chunks of at most `CHUNK_BYTES`, so that
TensorStore copies and compresses chunks on every core. Leaves under `SMALL_BYTES` are
written as raw chunk bytes (no zarr driver), and not compressed.

Checksums: a CRC-32 of every chunk's bytes as written (C order, the stored dtype),
computed in this thread from the host copy while TensorStore writes it (zlib releases
the GIL), kept in the `meta` item and checked on restore (`_arrays.py`).
"""

from __future__ import annotations

import concurrent.futures
import functools
import itertools
import json
import math
import os
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import numpy as np
import tensorstore as ts

from .._handoff._shards import ShardedArray
from .._layout._format import (
    CHUNK_BYTES,
    CHUNK_BYTES_FEWEST,
    CHUNKS_PER_LEAF,
    PROCESS_PREFIX,
    SMALL_BYTES,
    Region,
    checksum,
    param_name,
    region_key,
)

# Larger leaves are split into chunks of at most CHUNK_BYTES (the on-disk format's:
# `_format`), so chunks are copied in parallel.
DATA_FILE_BYTES = 32 << 20  # values are spread over data files of about this size

# Orbax's OCDBT settings, so that what we write is what Orbax would have written and
# what it expects to merge (values up to 1 KiB sit inline in the B-tree).
_OCDBT_CONFIG = {
    "max_inline_value_bytes": 1024,
    "max_decoded_node_bytes": 100000000,
    "manifest_kind": "single",
    # The manifest and B-tree nodes uncompressed (Orbax's default compresses them
    # with zstd; every reader of OCDBT reads either, each node says which): a few
    # hundred bytes per step more, and the package's own reader (`_ocdbt`) reads them
    # without TensorStore, whose import `jax-cb-ckpt verify` would otherwise wait on.
    "compression": None,
}


KvstoreSpec = Callable[[str], dict[str, Any]]  # a path -> its key-value store's spec


def ocdbt_spec(plain: dict[str, Any]) -> dict[str, Any]:
    """An OCDBT database in the key-value store `plain` (where the steps live says how
    it is written: `ChunkStore.kvstore_spec`)."""
    return {
        "driver": "ocdbt",
        "base": plain,
        "manifest": plain,
        "config": dict(_OCDBT_CONFIG),
        # Values go into data files of about this size, which TensorStore writes in
        # parallel (one file per thread): one 256 MiB leaf on tmpfs 103 -> 70 ms, on
        # ext4 with its files kept 1.7x a plain write+fsync of one file. Orbax's
        # option of the same name; any reader of OCDBT reads any number of files.
        "target_data_file_size": DATA_FILE_BYTES,
        "assume_config": True,
        "cache_pool": "cache_pool#ocdbt",
    }


@functools.lru_cache(maxsize=4096)
def _zarr_dtype(dtype: np.dtype) -> str:
    if dtype.type.__module__ == "numpy":
        return dtype.str  # '<f4', '|i1', '|b1', ...
    return dtype.name  # ml_dtypes: 'bfloat16', 'float8_e4m3fn', ...


def zarray(shape: tuple[int, ...], dtype: np.dtype, chunks: tuple[int, ...], compress: bool):
    """The `.zarray` of a leaf, as TensorStore's zarr driver writes it for Orbax."""
    return {
        "chunks": list(chunks),
        "compressor": {"id": "zstd", "level": 1} if compress else None,
        "dimension_separator": ".",
        "dtype": _zarr_dtype(dtype),
        "fill_value": None,
        "filters": None,
        "order": "C",
        "shape": list(shape),
        "zarr_format": 2,
    }


@functools.lru_cache(maxsize=4096)
def _zarray_json(
    shape: tuple[int, ...], dtype: np.dtype, chunks: tuple[int, ...], compress: bool
) -> str:
    return json.dumps(zarray(shape, dtype, chunks, compress))


def chunks_of(shape: tuple[int, ...], itemsize: int) -> tuple[int, ...]:
    """Chunk shape of a leaf written whole: split along the leading axes so that a
    chunk holds at most CHUNK_BYTES."""
    return _cut(shape, itemsize, CHUNK_BYTES, range(len(shape)))


def chunks_to_link(shape: tuple[int, ...], itemsize: int) -> tuple[int, ...]:
    """Chunk shape of a leaf written whole by an incremental save (`Checkpointer(...,
    incremental=True)`): about `CHUNKS_PER_LEAF` chunks (none under
    `CHUNK_BYTES_FEWEST` bytes, none over `CHUNK_BYTES`), split along the longest axis
    first. A replay buffer's longest axis is its capacity (flashbax's `(add_batch,
    time, ...)`, a flat `(capacity, ...)` ring): what one save changes along it, a slice
    of the ring, falls in a few chunks, and the rest are linked."""
    nbytes = itemsize * math.prod(shape)
    target = min(CHUNK_BYTES, max(CHUNK_BYTES_FEWEST, nbytes // CHUNKS_PER_LEAF))
    return _cut(shape, itemsize, target, sorted(range(len(shape)), key=lambda a: (-shape[a], a)))


def _cut(
    shape: tuple[int, ...], itemsize: int, target: int, axes: Iterable[int]
) -> tuple[int, ...]:
    """A chunk shape of at most `target` bytes (where the axes allow), each axis of
    `axes` in turn cut until the chunk fits."""
    chunks = [max(1, n) for n in shape]
    for axis in axes:
        nbytes = itemsize * math.prod(chunks)
        if nbytes <= target:
            break
        per_unit = nbytes // chunks[axis]
        chunks[axis] = max(1, min(chunks[axis], target // max(1, per_unit)))
    return tuple(chunks)


def split(array: np.ndarray, chunks: tuple[int, ...]) -> Iterator[tuple[Region, np.ndarray]]:
    """The chunks of `array` (views), with their regions."""
    if array.ndim == 0:
        yield (), array
        return
    starts = [range(0, n, c) for n, c in zip(array.shape, chunks, strict=True)]
    for corner in itertools.product(*starts):
        region = tuple(
            (s, min(s + c, n)) for s, c, n in zip(corner, chunks, array.shape, strict=True)
        )
        yield region, array[tuple(slice(a, b) for a, b in region)]


def _chunk_key(region: Region, chunks: tuple[int, ...]) -> str:
    if not region:
        return "0"
    return ".".join(str(a // c) for (a, _), c in zip(region, chunks, strict=True))


def _padded(block: np.ndarray, chunks: tuple[int, ...]) -> np.ndarray:
    """zarr v2 stores edge chunks at full chunk size."""
    if block.shape == chunks or block.ndim == 0:
        return np.ascontiguousarray(block)
    full = np.zeros(chunks, block.dtype)
    full[tuple(slice(0, n) for n in block.shape)] = block
    return full


# An incremental writer's copy of the chunks it wrote last: (leaf, region key) -> (the
# chunk's CRC-32, its bytes: a C-ordered copy).
Kept = dict[tuple[str, str], tuple[int, np.ndarray]]


class StoreWriter:
    """Writes state items. Holds one TensorStore context (thread pools) for its whole
    life and no global state (two writers in one process never meet); not thread-safe:
    one per writer thread."""

    def __init__(
        self, *, compression: bool, kvstore_spec: KvstoreSpec, incremental: bool = False
    ) -> None:
        """`kvstore_spec`: the key-value store of a path where the steps live (the chunk
        store's, `ChunkStore.kvstore_spec`: TensorStore is the default chunk store's
        engine; a storage TensorStore cannot reach needs an array writer of its own).
        `incremental`: chunks cut to be linked (`chunks_to_link`), and a copy of each
        write's chunks kept (`kept`) for the next write to compare with."""
        self.compression = compression
        self.incremental = incremental
        # Of the last `write`: a copy of every chunk (incremental), the bytes written.
        self.kept: Kept = {}
        self.written_bytes = 0
        self._kvstore_spec = kvstore_spec
        self._context = ts.Context(
            {
                "file_io_concurrency": {"limit": 32},
                "data_copy_concurrency": {"limit": os.cpu_count() or 1},
                "cache_pool": {"total_bytes_limit": 0},
                "cache_pool#ocdbt": {"total_bytes_limit": 0},
                "file_io_sync": False,  # the writer syncs the step before its rename
            }
        )

    def _ocdbt(self, path: str) -> dict[str, Any]:
        return ocdbt_spec(self._kvstore_spec(path))

    def layout(self, flat: Mapping[tuple[str, ...], np.ndarray | ShardedArray]) -> tuple:
        """What a write of `flat` stores, leaf by leaf: name, shape, dtype, chunks and
        the chunks' regions. Two writes of one layout store the same keys."""
        out = []
        for path, leaf in flat.items():
            pieces, shape, dtype, chunks = _pieces(leaf, self.incremental)
            regions = tuple(region_key(region) for region, _ in pieces)
            out.append((param_name(path), tuple(shape), dtype.str, dtype.name, chunks, regions))
        return tuple(out)

    def write(
        self,
        state_dir: str,
        flat: Mapping[tuple[str, ...], np.ndarray | ShardedArray],
        *,
        index: int,
        zarrays: bool,
        previous: Kept | None = None,
    ) -> Callable[..., tuple[dict[str, dict[str, int]], float]]:
        """Start writing this process's arrays (`flat`: tree path -> numpy array or
        `ShardedArray`) as one transaction: process 0 into the root database of `state_dir`,
        process `index` > 0 into its own. `zarrays`: also write every leaf's `.zarray`
        (the primary).

        `previous`: an incremental write into a database that already holds the
        previous write of the same layout (its files linked there, `_incremental`), whose
        `kept` chunks these are: only the chunks whose bytes differ are written (and no
        `.zarray`); they are compared first, on every core (`_compare`).

        Returns once the transaction is committing (the data copied into TensorStore,
        the large leaves' checksums computed meanwhile); then call the returned
        `finish(during_commit)`: it computes the small leaves' checksums, calls
        `during_commit(checksums)` (the caller's small files, written while the transaction
        commits), waits for the commit, and returns the checksums, {name: {region key:
        crc32}}, and the seconds spent computing them."""
        part = state_dir if index == 0 else os.path.join(state_dir, f"{PROCESS_PREFIX}{index}")
        kv = ts.KvStore.open(self._ocdbt(part), context=self._context).result()
        txn = ts.Transaction(atomic=False)
        kvt = kv.with_transaction(txn)
        pending: list[ts.WriteFutures] = []  # writes through the zarr driver
        staged: list[ts.Future[ts.KvStore.TimestampedStorageGeneration]] = []  # key-value writes
        sums: dict[str, dict[str, int]] = {}
        self.written_bytes = 0
        self.kept = {} if previous is None else previous
        if previous is not None:
            checksum_s = self._changed(kv, kvt, txn, flat, previous, sums, staged, pending)
            small: list[tuple[str, list[tuple[Region, np.ndarray]]]] = []
        else:
            large, small = [], []
            for path, leaf in flat.items():
                name = param_name(path)
                is_small, pieces = self._stage(kv, kvt, txn, name, leaf, zarrays, staged, pending)
                (small if is_small else large).append((name, pieces))
                self.written_bytes += sum(block.nbytes for _, block in pieces)
            kept = self.kept if self.incremental else None
            checksum_s = _checksums(large, sums, kept)  # while TensorStore copies
            if kept is not None:  # (the next write compares with every chunk)
                checksum_s += _checksums(small, sums, kept)
                small = []
        for future in pending:
            future.copy.result()
        return _finisher(txn.commit_async(), staged, small, sums, checksum_s)

    def _changed(
        self,
        kv: ts.KvStore,
        kvt: ts.KvStore,
        txn: ts.Transaction,
        flat: Mapping[tuple[str, ...], np.ndarray | ShardedArray],
        previous: Kept,
        sums: dict[str, dict[str, int]],
        staged: list[ts.Future[ts.KvStore.TimestampedStorageGeneration]],
        pending: list[ts.WriteFutures],
    ) -> float:
        """An incremental write's chunks: each compared with its kept copy (on every
        core; `_compare`: a changed one's checksum computed and its copy updated), then
        the writes of those that changed. The seconds the comparison took."""
        start = time.perf_counter()
        leaves = [(param_name(path), leaf) for path, leaf in flat.items()]
        every = [
            (name, region_key(region), block)
            for name, leaf in leaves
            for region, block in _pieces(leaf, self.incremental)[0]
        ]
        workers = min(len(every), os.cpu_count() or 1) or 1
        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            found = list(pool.map(lambda piece: _compare(previous, *piece), every, chunksize=4))
        changed: dict[str, set[str]] = {}
        for (name, key, _), is_new in zip(every, found, strict=True):
            sums.setdefault(name, {})[key] = previous[(name, key)][0]
            if is_new:
                changed.setdefault(name, set()).add(key)
        seconds = time.perf_counter() - start
        for name, leaf in leaves:
            if name in changed:
                only = changed[name]
                _, pieces = self._stage(kv, kvt, txn, name, leaf, False, staged, pending, only)
                self.written_bytes += sum(b.nbytes for r, b in pieces if region_key(r) in only)
        return seconds

    def _stage(
        self,
        kv: ts.KvStore,
        kvt: ts.KvStore,
        txn: ts.Transaction,
        name: str,
        leaf: np.ndarray | ShardedArray,
        zarrays: bool,
        staged: list[ts.Future[ts.KvStore.TimestampedStorageGeneration]],
        pending: list[ts.WriteFutures],
        only: set[str] | None = None,
    ) -> tuple[bool, list[tuple[Region, np.ndarray]]]:
        """One leaf's writes started in the transaction (`staged`: key-value writes of
        small leaves' raw chunks and `.zarray`s; `pending`: writes through the zarr
        driver), of every chunk or `only` those (region keys): (whether it is small, its
        pieces)."""
        pieces, shape, dtype, chunks = _pieces(leaf, self.incremental)
        nbytes = dtype.itemsize * math.prod(shape)
        is_small = nbytes <= SMALL_BYTES
        compress = self.compression and not is_small
        if zarrays:
            meta = _zarray_json(tuple(shape), dtype, tuple(chunks), compress)
            staged.append(kvt.write(f"{name}/.zarray", meta))
        written = [p for p in pieces if only is None or region_key(p[0]) in only]
        if is_small:  # raw chunk bytes: no zarr driver to open
            for region, block in written:
                data = _padded(block, chunks).tobytes()
                staged.append(kvt.write(f"{name}/{_chunk_key(region, chunks)}", data))
            return True, pieces
        store = ts.open(
            {"driver": "zarr", "metadata": zarray(shape, dtype, chunks, compress)},
            kvstore=kv / f"{name}/",
            context=self._context,
            transaction=txn,
            open=True,
            assume_metadata=True,
        ).result()
        for region, block in written:
            target = store[tuple(slice(a, b) for a, b in region)] if region else store
            pending.append(target.write(block, can_reference_source_data_indefinitely=True))
        return False, pieces

    def merge(self, state_dir: str, count: int) -> None:
        """The primary, once every process wrote: copy processes 1..count-1's database
        index into the root database (one transaction; the data stays in their files),
        as Orbax's finalize does."""
        if count <= 1:
            return
        root = ts.KvStore.open(self._ocdbt(state_dir), context=self._context).result()
        txn = ts.Transaction(atomic=True)
        copies = []
        for index in range(1, count):
            part = os.path.join(state_dir, f"{PROCESS_PREFIX}{index}")
            child = ts.KvStore.open(self._ocdbt(part), context=self._context).result()
            copies.append(child.experimental_copy_range_to(root.with_transaction(txn)))
        for copy in copies:
            copy.result()
        txn.commit_async().result()


def _checksums(
    leaves: list[tuple[str, list[tuple[Region, np.ndarray]]]],
    sums: dict,
    kept: Kept | None = None,
) -> float:
    """Add the CRC-32 of every piece of `leaves` to `sums` (and, where `kept` is given,
    a copy of the piece with it); the seconds it took (zlib releases the GIL:
    TensorStore's threads write meanwhile)."""
    start = time.perf_counter()
    for name, pieces in leaves:
        leaf_sums = sums.setdefault(name, {})
        for region, block in pieces:
            key = region_key(region)
            if kept is None:
                leaf_sums[key] = checksum(block)
            else:
                leaf_sums[key] = _keep(kept, name, key, block)
    return time.perf_counter() - start


def _compare(kept: Kept, name: str, key: str, block: np.ndarray) -> bool:
    """Whether the chunk `block` of leaf `name` at region `key` differs, byte for byte,
    from its copy in `kept` (NaNs of other bits differ; a chunk `kept` lacks differs);
    if so, its checksum is computed and its copy in `kept` made its bytes. Chunks are
    compared in threads (numpy releases the GIL), each its own entry."""
    old = kept.get((name, key))
    if old is not None and old[1].shape == block.shape and old[1].dtype == block.dtype:
        if _same_bytes(old[1], block):
            return False
        np.copyto(old[1], block, casting="no")
        kept[(name, key)] = (checksum(old[1]), old[1])
        return True
    _keep(kept, name, key, block)
    return True


def _keep(kept: Kept, name: str, key: str, block: np.ndarray) -> int:
    """Put a C-ordered copy of `block` with its checksum into `kept`; the checksum."""
    copy = np.array(block, order="C", copy=True)
    kept[(name, key)] = (checksum(copy), copy)
    return kept[(name, key)][0]


def _same_bytes(copy: np.ndarray, block: np.ndarray) -> bool:
    """`block` (any strides) holds the bytes of `copy` (C order, same shape and dtype)."""
    unsigned = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}.get(copy.dtype.itemsize)
    if unsigned is None or copy.dtype.kind == "V" and copy.dtype.fields:
        return np.ascontiguousarray(block).tobytes() == copy.tobytes()
    return bool(np.array_equal(copy.view(unsigned), block.view(unsigned)))


def _pieces(
    leaf: np.ndarray | ShardedArray, incremental: bool = False
) -> tuple[list[tuple[Region, np.ndarray]], tuple[int, ...], np.dtype, tuple[int, ...]]:
    """(region, block) pieces of a leaf, its shape, dtype and chunk shape (an incremental
    save's: `chunks_to_link`)."""
    if isinstance(leaf, ShardedArray):
        pieces = sorted(leaf.blocks.items())
        first = pieces[0][1] if pieces else np.empty(leaf.shape, leaf.dtype)
        chunks = tuple(max(1, n) for n in np.shape(first))
        if incremental and math.prod(chunks) * leaf.dtype.itemsize > SMALL_BYTES:
            chunks = _block_chunks(chunks, leaf.dtype.itemsize)
            pieces = [
                (_shifted(region, corner), piece)
                for corner, block in pieces
                for region, piece in split(block, chunks)
            ]
        return pieces, leaf.shape, leaf.dtype, chunks
    array = np.asarray(leaf)
    if incremental and array.nbytes > SMALL_BYTES:
        chunks = chunks_to_link(array.shape, array.dtype.itemsize)
        return list(split(array, chunks)), array.shape, array.dtype, chunks
    if array.nbytes <= CHUNK_BYTES:  # one chunk, the whole array
        chunks = tuple(max(1, n) for n in array.shape)
        return [(tuple((0, n) for n in array.shape), array)], array.shape, array.dtype, chunks
    chunks = chunks_of(array.shape, array.dtype.itemsize)
    return list(split(array, chunks)), array.shape, array.dtype, chunks


def _block_chunks(block: tuple[int, ...], itemsize: int) -> tuple[int, ...]:
    """An incremental save's chunks of a leaf written block by block (sharded): each
    device's block cut as a leaf written whole is (`chunks_to_link`), each side a
    divisor of the block's, so that the chunk grid is the same in every block (every
    block of a leaf has one shape: `_shards` refuses uneven splits). A ring buffer split
    along its batch axis changes a slice of every block per save: with one chunk per
    block (the format of a save that links nothing) nothing could be linked."""
    cut = chunks_to_link(block, itemsize)
    chunks = tuple(_divisor_at_most(n, c) for n, c in zip(block, cut, strict=True))
    if math.prod(block) // math.prod(chunks) > 4 * CHUNKS_PER_LEAF:  # (a prime side)
        return block
    return chunks


def _divisor_at_most(n: int, most: int) -> int:
    """The largest divisor of `n` that is at most `most` (>= 1)."""
    divisors = (x for d in range(1, math.isqrt(n) + 1) if n % d == 0 for x in (d, n // d))
    return max((x for x in divisors if x <= most), default=1)


def _shifted(region: Region, corner: Region) -> Region:
    """`region` (within a block) in the leaf's coordinates, the block at `corner`."""
    return tuple((a + s, b + s) for (a, b), (s, _) in zip(region, corner, strict=True))


@functools.lru_cache(maxsize=64)
def state_metadata(paths: tuple[tuple[str, ...], ...]) -> str:
    """The `_METADATA` JSON of a state item: every leaf a numpy array (plain Orbax
    restores numpy, or jax.Arrays where the caller passes shardings)."""
    tree = {
        str(tuple(path)): {
            "key_metadata": [{"key": k, "key_type": 2} for k in path],
            "value_metadata": {"value_type": "np.ndarray", "skip_deserialize": False},
        }
        for path in paths
    }
    return json.dumps(
        {
            "tree_metadata": tree,
            "use_ocdbt": True,
            "use_zarr3": False,
            "store_array_data_equal_to_fill_value": True,
            "custom_metadata": None,
        }
    )


def _finisher(
    committed: ts.Future[None],
    staged: list[ts.Future[ts.KvStore.TimestampedStorageGeneration]],
    small: list[tuple[str, Any]],
    sums: dict[str, dict[str, int]],
    checksum_s: float,
) -> Callable[..., tuple[dict[str, dict[str, int]], float]]:
    """`StoreWriter.write`'s `finish(during_commit)`, for a transaction `committed`."""

    def finish(
        during_commit: Callable[[dict[str, dict[str, int]]], None] | None = None,
    ) -> tuple[dict[str, dict[str, int]], float]:
        try:  # while the transaction commits:
            seconds = checksum_s + _checksums(small, sums)
            if during_commit is not None:
                during_commit(sums)
        finally:
            committed.result()  # ended, whatever happened
        for future in staged:  # staged in the transaction (done by now): any failure?
            if future.exception() is not None:
                raise future.exception()  # type: ignore[misc]
        return sums, seconds

    return finish
