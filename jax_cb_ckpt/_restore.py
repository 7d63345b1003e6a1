"""Reading checkpoints back: which steps exist, and one step into the types of `like`.

Runs in the caller's thread and blocks it until the arrays are in memory. The arrays
are read by the one read path (`_read.StepArrays`: TensorStore on the layout the
writer writes, checked against the checksums while it reads), not by Orbax; plain
Orbax still reads every step (tests/test_orbax_reads.py). The JSON `meta` item says how
each leaf was stored, so nothing is unpickled and no code runs. A checkpoint is
trusted no further than its files: a `meta` item that does not match the arrays
(hand-edited, corrupt, another program's) is a `RestoreError`.

A step may be removed while it is read (`max_to_keep` retention of a writer running in
another thread or process, or a replacing save): the read then fails the way a corrupt
file would, or could even return a mix. So a step is identified (device, inode) before
reading and checked after: a step that is gone, or is another directory now, is a
`NoCheckpointError` that says so, whatever the read gave.
"""

from __future__ import annotations

import dataclasses
import math
import os
import warnings
from typing import Any

import jax
import numpy as np

from . import _dtypes, _format, _read, _store, _tree
from ._errors import (
    CheckpointError,
    ConfigError,
    DamagedStepWarning,
    NoCheckpointError,
    RestoreError,
    StructureMismatchError,
)
from ._format import META_ITEM, STATE_ITEM


def all_steps(directory: str | os.PathLike[str]) -> list[int]:
    """Steps with a complete checkpoint in `directory`, ascending.

    Only checkpoints written by jax_cb_ckpt count (see docs/usage.md, "What is in the
    directory"): other folders, even with integer names, are ignored. A step listed
    here is complete and restores. Does not wait for pending saves.
    """
    return _listed(_format.resolve(directory, "all_steps"), "all_steps")


def latest_step(directory: str | os.PathLike[str]) -> int | None:
    """The newest complete step in `directory`, or None when there is none. A damaged
    step is never the latest: it is reported (`DamagedStepWarning`)."""
    steps = _listed(_format.resolve(directory, "latest_step"), "latest_step")
    return steps[-1] if steps else None


def _listed(path: str, what: str) -> list[int]:
    """The complete steps of `path`; a `DamagedStepWarning` naming the damaged ones, so
    that a run never silently goes back to an older step."""
    found = _format.examine_all(path)
    damaged = {step: f.why for step, f in sorted(found.items()) if f.kind == "damaged"}
    if damaged:
        listed = "; ".join(f"step {step}: {why}" for step, why in damaged.items())
        warnings.warn(
            f"{what}: {len(damaged)} step folder(s) of {path!r} claim to be jax_cb_ckpt "
            f"checkpoints but are damaged and are not listed ({listed}). Nothing was "
            "deleted. Fix: restore the folder from a good copy, or move it out of the "
            "directory; `jax-cb-ckpt verify` checks every step.",
            DamagedStepWarning,
            stacklevel=3,
        )
    return sorted(step for step, f in found.items() if f.kind == "complete")


def _check_step_arg(step: Any, what: str) -> int | None:
    if step is None:
        return None
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
        raise ConfigError(
            f"{what}(step={step!r}): step must be a non-negative int (a step listed by "
            "all_steps()) or None for the latest."
        )
    return int(step)


def _pick_step(path: str, step: int | None, what: str) -> int:
    steps = _listed(path, what) if step is None else _format.list_steps(path)
    if step is not None and step in steps:
        return step
    if step is not None:
        damaged = _format.damaged_steps(path)
        if step in damaged:
            raise RestoreError(
                f"{what}: step {step} in {path!r} is damaged ({damaged[step]}); nothing "
                "was read from it. Fix: restore another step (all_steps()), or the "
                "folder from a good copy."
            )
    foreign = _format.foreign_steps(path)
    other = (
        f" The directory holds {len(foreign)} step-numbered folder(s) that are not "
        f"complete jax_cb_ckpt checkpoints ({_short(foreign)}): a plain Orbax "
        "checkpoint, a copy in progress, or an interrupted write. Read a plain Orbax "
        "checkpoint with orbax.checkpoint directly."
        if foreign
        else ""
    )
    if not steps:
        raise NoCheckpointError(
            f"{what}: no checkpoint in {path!r}.{other} Fix: check the directory, or "
            "start from the initial state when latest_step() is None."
        )
    if step is None:
        return steps[-1]
    raise NoCheckpointError(
        f"{what}: no checkpoint for step {step} in {path!r}; the steps there are "
        f"{_short(steps)}.{other}"
    )


def _identify(path: str, step: int, where: str) -> tuple[int, int]:
    """(device, inode) of checkpoint `step`, taken before reading it."""
    try:
        return _format.identity(os.path.join(path, str(step)))
    except OSError as e:
        raise _removed(path, step, where) from e


def _still_there(path: str, step: int, seen: tuple[int, int]) -> bool:
    """Checkpoint `step` is still a checkpoint of ours, the same directory it was when
    the read began (not renamed aside by retention, nor replaced under its name)."""
    step_dir = os.path.join(path, str(step))
    try:
        return _format.is_checkpoint(step_dir) and _format.identity(step_dir) == seen
    except OSError:
        return False


def _read_failure(
    e: Exception, path: str, step: int, seen: Any, where: str, what: str
) -> CheckpointError:
    """The error for a read of `what` (a leaf, the arrays) of checkpoint `step` that
    raised `e`: a stored layout unlike the step's description; the step removed while it
    was read; or the read's own failure."""
    if isinstance(e, _read.LayoutError):
        return RestoreError(f"{where}: {e}. Fix: restore another step.")
    if not _still_there(path, step, seen):
        return _removed(path, step, where)
    return RestoreError(f"{where}: cannot read {what}: {e}")


def _removed(path: str, step: int, where: str) -> NoCheckpointError:
    try:
        steps = _format.list_steps(path)
    except ConfigError:
        steps = []
    now = f"the steps there now are {_short(steps)}" if steps else "no step is there now"
    return NoCheckpointError(
        f"{where}: step {step} was removed while it was being read ({now}); nothing "
        "read from it is returned. A writer running on the directory deletes old steps "
        "(max_to_keep, or a save with on_existing='replace'). Fix: read another step, "
        "e.g. the latest (restore() without step=, after latest_step()), and retry on "
        "this error; to read an old step at leisure, raise max_to_keep or copy the "
        "step's folder first."
    )


def _read_meta(path: str, step: int, where: str, seen: tuple[int, int]) -> dict[str, Any]:
    links = _format.symlinks_inside(os.path.join(path, str(step)))
    if links:
        raise RestoreError(
            f"{where}: the checkpoint contains symlinks ({links[0]!r}, ...), which could "
            "make reading it read files outside the directory; the library never writes "
            "them, so it was altered. Fix: restore another step, or replace the links by "
            "the files they point to if you trust them."
        )
    try:
        meta = _format.load_meta(os.path.join(path, str(step)), step)
    except _format.DamagedStep as e:
        if not _still_there(path, step, seen):
            raise _removed(path, step, where) from e
        raise RestoreError(
            f"{where}: the step is damaged: {e}. Fix: restore another step "
            "(all_steps()), or the folder from a good copy."
        ) from e
    except Exception as e:
        if not _still_there(path, step, seen):
            raise _removed(path, step, where) from e
        raise RestoreError(f"{where}: cannot read the checkpoint's '{META_ITEM}' item: {e}") from e
    return meta


def metadata(directory: str | os.PathLike[str], *, step: int | None = None) -> dict[str, Any]:
    """The JSON `meta` item of checkpoint `step` (default: the latest) in `directory`."""
    return _metadata(directory, step)[0]


def step_meta(directory: str | os.PathLike[str], *, step: int | None = None) -> _format.StepMeta:
    """`metadata()` with its fields checked and read (`_format.StepMeta`); a
    RestoreError naming the field when the item was edited or corrupted."""
    meta, where = _metadata(directory, step)
    return _parsed(meta, where)


def _metadata(directory: str | os.PathLike[str], step: int | None) -> tuple[dict[str, Any], str]:
    path = _format.resolve(directory, "metadata")
    step = _pick_step(path, _check_step_arg(step, "metadata"), "metadata")
    where = f"metadata(step={step}) from {path!r}"
    return _read_meta(path, step, where, _identify(path, step, where)), where


def _parsed(meta: dict[str, Any], where: str) -> _format.StepMeta:
    """The fields of a step's `meta` item, or a RestoreError saying which is wrong."""
    try:
        return _format.StepMeta.parse(meta)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise RestoreError(
            f"{where}: the checkpoint's '{META_ITEM}' item is invalid ({type(e).__name__}: "
            f"{e}); it was edited or corrupted. Fix: restore another step."
        ) from e


def _placement(like_leaf: Any, spec: _tree.LeafSpec, saved: _tree.LeafSpec) -> Any:
    """The sharding to read a leaf with, when `like` places it on devices and the
    stored data can be read as is (not a PRNG key, a widened dtype or a number)."""
    sharding = getattr(like_leaf, "sharding", None)
    if not isinstance(sharding, jax.sharding.Sharding) or isinstance(like_leaf, np.ndarray):
        return None
    if saved.kind != _tree.ARRAY or spec.kind != _tree.ARRAY or saved.dtype != spec.dtype:
        return None
    dtype = np.dtype(saved.dtype)
    if _dtypes.storage_dtype(dtype) != dtype or 0 in saved.shape:
        return None
    return sharding


def restore(
    directory: str | os.PathLike[str],
    like: Any,
    *,
    step: int | None = None,
    verify: bool = True,
    member: int | tuple[int, ...] | None = None,
) -> Any:
    """Restore checkpoint `step` (default: the latest) of `directory` into the shape of `like`.

    `like` is a pytree like the saved state: concrete arrays, or `jax.ShapeDtypeStruct`s
    (e.g. from `jax.eval_shape`). The result has `like`'s pytree types (TrainState,
    NamedTuple, dataclass, dict, ...), dtypes, typed PRNG keys (re-wrapped with the
    recorded implementation) and Python scalar types; jax.Array leaves are placed with
    the sharding of the `like` leaf when it has one. Blocks until the data is loaded.
    With `verify` (default), every array read is checked against the checksums
    recorded when it was written: a corrupted file is a `RestoreError`, never numbers.
    `directory` may be relative (to the working directory), as everywhere.

    `member`: for a checkpoint saved under `vmap` (seeds, say; `metadata()["batch_shape"]`),
    restore one member of the batch: an int for one batch axis, a tuple of ints for
    several. `like` is then one member's state (without the batch axes). Only the
    chunks holding that member are read from disk (and, with `verify`, checked).

    Raises:
        NoCheckpointError: no complete checkpoint for that step, or it was removed
            while it was being read (by a writer's retention): read another one.
        StructureMismatchError: `like` differs from the checkpoint; names the first leaf.
        RestoreError: the checkpoint cannot be read, or its description does not match
            its data.
    """
    path = _format.resolve(directory, "restore")
    step = _pick_step(path, _check_step_arg(step, "restore"), "restore")
    where = f"restore(step={step}) from {path!r}"
    treedef, like_specs, like_leaves = _tree.describe_state(
        like, where, prefix="like", abstract_ok=True
    )
    seen = _identify(path, step, where)
    meta = _parsed(_read_meta(path, step, where, seen), where)
    saved_specs, batch = meta.leaves, meta.batch_shape
    if member is not None:
        index = _member_index(member, meta, where)
        return _restore_member(path, step, seen, meta, like, index, verify)
    if batch:
        _check_batched_like(like_specs, saved_specs, batch, where)
    _tree.check_like(like_specs, saved_specs, where)
    by_name = {spec.name: spec for spec in saved_specs}
    saved_of = [by_name[spec.name] for spec in like_specs]
    stored = [saved for saved in saved_of if 0 not in saved.stored_shape]
    sums = _sums(meta, stored, verify, where)
    arrays = _open_arrays(path, step, seen, where, meta, stored)
    requests: list[tuple[_tree.LeafSpec, _read.Box | None]] = []
    placements = []  # per like leaf: (sharding, {box: index into results}) or None
    for leaf, spec, saved in zip(like_leaves, like_specs, saved_of, strict=True):
        sharding = _placement(leaf, spec, saved)
        if 0 in saved.stored_shape:
            placements.append(None)
        elif sharding is None:
            placements.append(len(requests))
            requests.append((saved, None))
        else:  # each device reads its own block (each process: its devices' blocks)
            shape = saved.stored_shape
            boxes = {}
            for index in sharding.addressable_devices_indices_map(shape).values():
                box = _box(index, shape)
                if box not in boxes:
                    boxes[box] = len(requests)
                    requests.append((saved, box))
            placements.append((sharding, boxes))
    results = _read_leaves(arrays, requests, sums, path, step, seen, where)
    leaves = []
    together = zip(like_leaves, like_specs, saved_of, placements, strict=True)
    for leaf, spec, saved, placed in together:
        shape = saved.stored_shape
        if placed is None:  # zero-size leaves are described, not stored
            array = np.zeros(shape, np.dtype(saved.dtype))
        elif isinstance(placed, int):
            array = _as_described(results[placed], saved, shape, where)
        else:
            sharding, boxes = placed
            blocks = {box: results[i] for box, i in boxes.items()}
            array = jax.make_array_from_callback(
                shape, sharding, lambda index, b=blocks, n=shape: b[_box(index, n)]
            )
        leaves.append(_tree.rebuild(leaf, spec, saved, array, where))
    return treedef.unflatten(leaves)


def _box(index: Any, shape: tuple[int, ...]) -> _read.Box:
    """A device's index into a leaf (a tuple of slices) as a box."""
    return tuple(s.indices(n)[:2] for s, n in zip(index, shape, strict=True))


def _open_arrays(
    path: str,
    step: int,
    seen: Any,
    where: str,
    meta: _format.StepMeta,
    specs: list[_tree.LeafSpec],
) -> _read.StepArrays:
    """The step's arrays, opened, with the stored layouts of `specs` checked against
    their descriptions before anything of them is read."""
    try:
        arrays = _read.StepArrays(os.path.join(path, str(step)), meta.leaves)
        arrays.check_layouts(specs)
    except _read.LeafReadError as e:
        what = f"leaf {e.leaf.path}"
        raise _read_failure(e.cause, path, step, seen, where, what) from e.cause
    except Exception as e:
        raise _read_failure(e, path, step, seen, where, "the checkpoint's arrays") from e
    return arrays


def _sums(
    meta: _format.StepMeta, specs: list[_tree.LeafSpec], verify: bool, where: str
) -> dict[str, Any] | None:
    """The checksums to check the stored leaves `specs` against, or None to read them
    unchecked (`verify=False`, or a step written before checksums were kept). A step
    with checksums that lacks a leaf's was edited: an error, before anything is read."""
    if not verify or meta.checksums is None:
        return None
    for saved in specs:
        _leaf_sums(meta.checksums, saved, where)
    return meta.checksums


def _read_leaves(
    arrays: _read.StepArrays,
    requests: list[tuple[_tree.LeafSpec, _read.Box | None]],
    sums: dict[str, Any] | None,
    path: str,
    step: int,
    seen: Any,
    where: str,
) -> list[np.ndarray]:
    """`arrays.read(requests)`, its failures as our errors; and the step checked to
    be the one the read began on (TensorStore reads a file removed meanwhile as an
    absent key, and zarr an absent chunk as its fill value)."""
    step_dir = os.path.join(path, str(step))
    try:
        results = arrays.read(requests, sums)
    except _read.ChecksumMismatch as e:
        if not _still_there(path, step, seen):
            raise _removed(path, step, where) from e
        name = _store.param_name(e.leaf.name)
        raise _mismatch(where, name, e.leaf.path, e.region, step_dir) from None
    except _read.LeafReadError as e:
        what = f"leaf {e.leaf.path}"
        raise _read_failure(e.cause, path, step, seen, where, what) from e.cause
    if not _still_there(path, step, seen):
        raise _removed(path, step, where)
    return results


def _mismatch(where: str, name: str, leaf: str, key: str, step_dir: str) -> RestoreError:
    region = f"elements [{key.replace(',', ', ')}]" if key else "its value"
    return RestoreError(
        f"{where}: leaf {leaf} is corrupted: the checksum of {region} does not match "
        f"the one recorded when it was written (stored as zarr array '{name}' in "
        f"{os.path.join(step_dir, STATE_ITEM)!r}). A file of the step was changed on "
        "disk after it was written (bad disk or memory, a partial copy, a hand edit). "
        "Nothing was returned. Fix: restore another step (all_steps()); "
        "jax_cb_ckpt.verify(directory) checks every step."
    )


def _member_index(member: Any, meta: _format.StepMeta, where: str) -> tuple[int, ...]:
    """`member` as an index into the batch axes, checked (and saved: a member whose
    `maybe_save` predicate was false at this step holds no state of its own)."""
    batch = meta.batch_shape
    if not batch:
        raise ConfigError(
            f"{where}: member={member!r}, but step {meta.step} was not saved under "
            "vmap (it has no batch axes). Fix: restore without member=."
        )
    parts = (member,) if isinstance(member, int) else member
    index = tuple(parts) if isinstance(parts, tuple) else ()
    ok = (
        len(index) == len(batch)
        and all(isinstance(i, int) and not isinstance(i, bool) for i in index)
        and all(0 <= i < n for i, n in zip(index, batch, strict=True))
    )
    if not ok:
        kind = "an int" if len(batch) == 1 else f"a tuple of {len(batch)} ints"
        raise ConfigError(
            f"{where}: member={member!r} is not a member of the checkpoint's batch of "
            f"shape {batch}. Fix: pass {kind}, each in range(size of its batch axis)."
        )
    if not meta.members[index]:
        raise RestoreError(
            f"{where}: member {index} did not save at step {meta.step} (its "
            "maybe_save predicate was false), so the step holds no state of its own for "
            "it. Fix: restore another step, or another member."
        )
    return index


def _check_batched_like(
    like_specs: tuple[_tree.LeafSpec, ...],
    saved_specs: tuple[_tree.LeafSpec, ...],
    batch: tuple[int, ...],
    where: str,
) -> None:
    """A `like` of one member for a batched checkpoint: say so, and how to pick one."""
    by_name = {spec.name: spec for spec in saved_specs}
    for spec in like_specs:
        saved = by_name.get(spec.name)
        if saved is not None and saved.shape != spec.shape and saved.shape == batch + spec.shape:
            pick = "member=k" if len(batch) == 1 else f"member=(i, ..., k) ({len(batch)} ints)"
            raise StructureMismatchError(
                f"{where}: the checkpoint holds a batch saved under vmap, of shape {batch} "
                f"(the leading axes of every leaf: {spec.path} is stored as "
                f"{saved.describe()}), and like has one member's shapes "
                f"({spec.describe()}). Fix: restore one member with restore(like, "
                f"{pick}), or pass a like with the batch axes to restore the whole batch."
            )


def _restore_member(
    path: str,
    step: int,
    seen: tuple[int, int],
    meta: _format.StepMeta,
    like: Any,
    index: tuple[int, ...],
    verify: bool,
) -> Any:
    """One member of a batched checkpoint, read chunk by chunk (no Orbax, no batch)."""
    shown = index[0] if len(index) == 1 else index
    where = f"restore(step={step}, member={shown}) from {path!r}"
    treedef, like_specs, like_leaves = _tree.describe_state(
        like, where, prefix="like", abstract_ok=True
    )
    batch = meta.batch_shape
    n = len(batch)
    batched = {s.name for s in meta.leaves if s.shape[:n] == batch}
    one = tuple(
        dataclasses.replace(s, shape=s.shape[n:]) if s.name in batched else s for s in meta.leaves
    )
    by_name = {spec.name: spec for spec in one}
    for spec in like_specs:
        saved = by_name.get(spec.name)
        if saved is not None and spec.name in batched and spec.shape == batch + saved.shape:
            raise StructureMismatchError(
                f"{where}: like has the batch axes {batch} (leaf {spec.path} is "
                f"{spec.describe()}); with member=, like is one member's state "
                f"({saved.describe()}). Fix: pass one member's like (e.g. "
                "jax.tree.map(lambda x: x[0], like)), or restore without member=."
            )
    _tree.check_like(like_specs, one, where)
    full = {s.name: s for s in meta.leaves}
    stored = [full[spec.name] for spec in like_specs if 0 not in full[spec.name].stored_shape]
    sums = _sums(meta, stored, verify, where)
    arrays = _open_arrays(path, step, seen, where, meta, stored)
    requests = []
    for saved in stored:
        if saved.name in batched:  # only the chunks holding the member are read
            box = tuple((i, i + 1) for i in index) + _read.whole(saved.stored_shape[n:])
            requests.append((saved, box))
        else:
            requests.append((saved, None))
    results = iter(_read_leaves(arrays, requests, sums, path, step, seen, where))
    leaves = []
    for leaf, spec in zip(like_leaves, like_specs, strict=True):
        saved = by_name[spec.name]
        shape = saved.stored_shape
        if 0 in full[spec.name].stored_shape:
            array = np.zeros(shape, np.dtype(saved.dtype))
        else:
            array = _as_described(next(results).reshape(shape), saved, shape, where)
        leaves.append(_tree.rebuild(leaf, spec, saved, array, where))
    return treedef.unflatten(leaves)


def _as_described(array: Any, saved: _tree.LeafSpec, shape: tuple[int, ...], where: str) -> Any:
    """A leaf's stored data as the dtype it was saved with, once its shape (`shape`:
    the stored one, or one member's) is the described one; else an error."""
    dtype = np.dtype(saved.dtype)
    value = _dtypes.from_storage(array, dtype) if array.shape == shape else None
    if value is None:
        raise RestoreError(
            f"{where}: leaf {saved.path} is described as {dtype.name}{list(shape)} but "
            f"its data is {array.dtype.name}{list(array.shape)}; the checkpoint was edited "
            "or corrupted. Fix: restore another step."
        )
    return value


def _leaf_sums(sums: dict[str, Any], saved: _tree.LeafSpec, where: str) -> dict[str, int]:
    """A leaf's checksums, {region: CRC-32}; an error when the step has none for it."""
    leaf_sums = sums.get(_store.param_name(saved.name))
    if leaf_sums is None:
        raise RestoreError(
            f"{where}: leaf {saved.path} has no checksum in the checkpoint's "
            f"'{META_ITEM}' item; it was edited or corrupted. Fix: restore another step, "
            "or pass verify=False to read it unchecked."
        )
    return leaf_sums


def _short(steps: list[int]) -> str:
    if len(steps) <= 10:
        return str(steps)
    return f"[{', '.join(map(str, steps[:5]))}, ..., {', '.join(map(str, steps[-3:]))}]"


def verify(directory: str | os.PathLike[str], *, step: int | None = None) -> list[int]:
    """Check every stored byte of `step` (default: every step) against the checksums
    recorded when it was written, without a `like`: each leaf is read whole into host
    memory, one at a time, once its stored layout is the described one. A step written
    without checksums (an older version) is read whole too, so a cut or missing file
    fails, but cannot be verified (its `checksums` are None; the CLI exits 3). Returns
    the steps checked; raises `RestoreError` naming the first corrupted leaf (its step,
    region and directory), or a damaged step named by `step=`. Blocks while reading."""
    path = _format.resolve(directory, "verify")
    steps = _format.list_steps(path)
    if step is not None:
        steps = [_pick_step(path, _check_step_arg(step, "verify"), "verify")]
    for one in steps:
        where = f"verify(step={one}) of {path!r}"
        seen = _identify(path, one, where)
        meta = _parsed(_read_meta(path, one, where, seen), where)
        stored = [saved for saved in meta.leaves if 0 not in saved.stored_shape]
        # Without checksums (an older version's step) every byte is still read: a cut
        # or missing file fails here, where it would fail a restore.
        sums = _sums(meta, stored, True, where)
        arrays = _open_arrays(path, one, seen, where, meta, stored)
        for group in _by_size(stored, _VERIFY_GROUP_BYTES):
            _read_leaves(arrays, [(saved, None) for saved in group], sums, path, one, seen, where)
    return steps


# verify reads leaves in groups of about this many bytes at once (concurrently), so
# that its memory stays bounded whatever the step's size.
_VERIFY_GROUP_BYTES = 256 << 20


def _by_size(specs: list[_tree.LeafSpec], limit: int) -> list[list[_tree.LeafSpec]]:
    """`specs` in consecutive groups of at most `limit` stored bytes (a larger leaf
    alone)."""
    groups: list[list[_tree.LeafSpec]] = [[]]
    size = 0
    for spec in specs:
        nbytes = np.dtype(spec.dtype).itemsize * math.prod(spec.stored_shape)
        if groups[-1] and size + nbytes > limit:
            groups.append([])
            size = 0
        groups[-1].append(spec)
        size += nbytes
    return [g for g in groups if g]
