"""What was written is what is read: the checksums of a step, checked.

Orbax and TensorStore keep no checksum of zarr chunks, so one flipped byte in a data
file restores as a wrong number. The writer records a CRC-32 of every chunk it writes
(`_store.py`) in the step's `meta` item, as {leaf name: {region: crc}}, computed from
the host copy of the state. They are checked:

- by `restore` on the arrays it read (unless `verify=False`): a numpy leaf region by
  region; a sharded `jax.Array` shard by shard where the shards are the written blocks
  (the same sharding as the save), else by reading the leaf once more on the host;
- by `jax_cb_ckpt.verify(directory)`, which reads every leaf of every step (or one).

A mismatch is a `RestoreError` naming the leaf, the step, the region and the item's
directory. Steps written before checksums existed (no `checksums` in `meta`) pass.
"""

from __future__ import annotations

import json
import os
from typing import Any

import jax
import numpy as np
import tensorstore as ts

from . import _dtypes
from ._errors import RestoreError
from ._format import STATE_ITEM
from ._spec import LeafSpec
from ._store import base_spec, checksum, param_name, region_key


def _region(key: str) -> tuple[slice, ...]:
    if not key:
        return ()
    return tuple(slice(int(a), int(b)) for a, b in (part.split(":") for part in key.split(",")))


def mismatch(where: str, path: str, leaf: str, key: str, step_dir: str) -> RestoreError:
    region = f"elements [{key.replace(',', ', ')}]" if key else "its value"
    return RestoreError(
        f"{where}: leaf {leaf} is corrupted: the checksum of {region} does not match "
        f"the one recorded when it was written (stored as zarr array '{path}' in "
        f"{os.path.join(step_dir, STATE_ITEM)!r}). A file of the step was changed on "
        "disk after it was written (bad disk or memory, a partial copy, a hand edit). "
        "Nothing was returned. Fix: restore another step (all_steps()); "
        "jax_cb_ckpt.verify(directory) checks every step."
    )


def check_host(array: np.ndarray, sums: dict[str, int], report: Any) -> None:
    """Check a leaf read whole into host memory; `report(key)` makes the error."""
    for key, crc in sums.items():
        if checksum(array[_region(key)]) != crc:
            raise report(key)


def check_leaf(array: Any, sums: dict[str, int], read_host: Any, report: Any) -> None:
    """Check a leaf as restored: numpy, or a jax.Array (its local shards)."""
    if not isinstance(array, jax.Array):
        check_host(np.asarray(array), sums, report)
        return
    seen = set()
    for shard in array.addressable_shards:
        key = region_key(_shard_region(shard.index, array.shape))
        if key in seen:
            continue
        if key not in sums:  # read with another sharding than it was written with
            check_host(read_host(), sums, report)
            return
        seen.add(key)
        if checksum(np.asarray(shard.data)) != sums[key]:
            raise report(key)


def _shard_region(index: tuple[slice, ...], shape: tuple[int, ...]) -> Any:
    return tuple(s.indices(n)[:2] for s, n in zip(index, shape, strict=True))


def read_member(
    step_dir: str,
    saved: LeafSpec,
    shape: tuple[int, ...],
    member: tuple[int, ...],
    sums: dict[str, int] | None,
    report: Any,
) -> np.ndarray:
    """Member `member` of a stored leaf saved under vmap (an index into its leading
    axes), read without the rest of the batch. TensorStore reads whole chunks, so the
    chunks (or device blocks) holding the member are read and, with `sums`, checked
    against their checksums; the member is cut out of them."""
    n = len(member)
    known = sums or {}
    box = tuple(slice(i, i + 1) for i in member) + tuple(slice(0, d) for d in shape[n:])
    held = []
    if known:
        for key in known:
            region = _region(key)
            if all(r.start <= i < r.stop for r, i in zip(region[:n], member, strict=True)):
                held.append((key, region))
        if held:  # the chunks or blocks holding the member: a box of the grid
            box = tuple(
                slice(min(r[d].start for _, r in held), max(r[d].stop for _, r in held))
                for d in range(len(shape))
            )
    data = open_leaf(step_dir, saved, shape)[box].read().result()
    for key, region in held:
        local = tuple(
            slice(r.start - b.start, r.stop - b.start) for r, b in zip(region, box, strict=True)
        )
        if checksum(data[local]) != known[key]:
            raise report(key)
    return data[tuple(i - b.start for i, b in zip(member, box, strict=False))]


def read_leaf(step_dir: str, saved: LeafSpec) -> np.ndarray:
    """One stored leaf, read whole into host memory with TensorStore (no Orbax)."""
    return open_leaf(step_dir, saved).read().result()


def open_leaf(step_dir: str, saved: LeafSpec, shape: tuple[int, ...] | None = None) -> Any:
    """A stored leaf's zarr array, opened for reading once its stored layout (its
    `.zarray`: dtype, shape, chunks) is the one the step's description `saved` gives
    (`shape`: the stored shape, when `saved` is one member's description), so that
    nothing is read or allocated on a claim of the file alone; else `LayoutError`."""
    state = os.path.join(step_dir, STATE_ITEM)
    store = ts.open(
        {
            "driver": "zarr",
            "kvstore": {
                "driver": "ocdbt",
                "base": base_spec(state),
                "path": f"{param_name(saved.name)}/",
            },
            "open": True,
        },
        read=True,
        context=ts.Context({"cache_pool": {"total_bytes_limit": 0}}),
    ).result()
    expected = saved.stored_shape if shape is None else shape
    chunks = tuple(int(c or 0) for c in store.chunk_layout.read_chunk.shape or ())
    _check_layout(saved, expected, tuple(store.shape), store.dtype.numpy_dtype, chunks)
    return store


def check_layouts(step_dir: str, specs: tuple[LeafSpec, ...]) -> None:
    """Every stored leaf's `.zarray` (read as raw bytes, all at once, each within 64 KiB)
    agrees with the step's description: before a reader (Orbax's among them) allocates
    what a `.zarray` claims. `LayoutError` naming the first leaf that does not."""
    stored = [s for s in specs if 0 not in s.stored_shape]
    if not stored:
        return
    kv = ts.KvStore.open(
        {"driver": "ocdbt", "base": base_spec(os.path.join(step_dir, STATE_ITEM))}
    ).result()
    reads = [(s, kv.read(f"{param_name(s.name)}/.zarray")) for s in stored]
    for saved, future in reads:
        value = future.result().value
        try:
            if len(value) > 64 << 10:
                raise ValueError("larger than 64 KiB")
            zarray = json.loads(bytes(value))
            dtype = np.dtype(zarray["dtype"])
            shape, chunks = tuple(zarray["shape"]), tuple(zarray["chunks"])
        except (ValueError, TypeError, KeyError, RecursionError) as e:
            raise LayoutError(
                f"leaf {saved.path}: its stored array's description "
                f"('{param_name(saved.name)}/.zarray') cannot be read ({e}): the step was "
                "edited or corrupted; nothing was read from it"
            ) from None
        _check_layout(saved, saved.stored_shape, shape, dtype, chunks)


def _check_layout(
    saved: LeafSpec,
    expected: tuple[int, ...],
    shape: tuple[int, ...],
    stored: np.dtype,
    chunks: tuple[int, ...],
) -> None:
    dtype = np.dtype(saved.dtype)
    problem = None
    if tuple(shape) != tuple(expected):
        problem = f"shape {list(shape)}, where the description gives {list(expected)}"
    elif _dtypes.from_storage(np.zeros(0, stored), dtype) is None:
        problem = f"dtype {stored.name}, where the description gives {dtype.name}"
    elif len(chunks) != len(expected) or not all(
        isinstance(c, int) and 1 <= c <= max(1, n) for c, n in zip(chunks, expected, strict=False)
    ):
        problem = f"chunks {list(chunks)}, which do not fit its shape {list(expected)}"
    if problem is not None:
        raise LayoutError(
            f"leaf {saved.path}: its stored array ('{param_name(saved.name)}/.zarray') has "
            f"{problem}: the step was edited or corrupted; nothing was read from it"
        )


class LayoutError(ValueError):
    """A leaf's stored layout is not the one its description gives."""
