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

import os
from typing import Any

import jax
import numpy as np
import tensorstore as ts

from ._errors import RestoreError
from ._format import STATE_ITEM
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
    name: tuple[str, ...],
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
    data = open_leaf(step_dir, name)[box].read().result()
    for key, region in held:
        local = tuple(
            slice(r.start - b.start, r.stop - b.start) for r, b in zip(region, box, strict=True)
        )
        if checksum(data[local]) != known[key]:
            raise report(key)
    return data[tuple(i - b.start for i, b in zip(member, box, strict=False))]


def read_leaf(step_dir: str, name: tuple[str, ...]) -> np.ndarray:
    """One stored leaf, read whole into host memory with TensorStore (no Orbax)."""
    return open_leaf(step_dir, name).read().result()


def open_leaf(step_dir: str, name: tuple[str, ...]) -> Any:
    state = os.path.join(step_dir, STATE_ITEM)
    return ts.open(
        {
            "driver": "zarr",
            "kvstore": {
                "driver": "ocdbt",
                "base": base_spec(state),
                "path": f"{param_name(name)}/",
            },
            "open": True,
        },
        read=True,
        context=ts.Context({"cache_pool": {"total_bytes_limit": 0}}),
    ).result()
