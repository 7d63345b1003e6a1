"""Reading checkpoints back: which steps exist, and one step into the types of `like`.

Runs in the caller's thread and blocks it until the arrays are in memory. Reads go
through Orbax (a read-only checkpointer), so anything Orbax can read, we can; and the
JSON `meta` item says how each leaf was stored, so nothing is unpickled and no code
runs. A checkpoint is trusted no further than its files: a `meta` item that does not
match the arrays (hand-edited, corrupt, another program's) is a `RestoreError`.

A step may be removed while it is read (`max_to_keep` retention of a writer running in
another thread or process, or a replacing save): the read then fails the way a corrupt
file would, or could even return a mix. So a step is identified (device, inode) before
reading and checked after: a step that is gone, or is another directory now, is a
`NoCheckpointError` that says so, whatever the read gave.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import threading
import warnings
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from . import _dtypes, _format, _remote, _store, _tree, _verify
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


def _is_stale_wakeup(unraisable: Any) -> bool:
    """The report a failed Orbax read leaves behind, and nothing else: Orbax runs each
    read in a fresh asyncio loop and closes it as soon as one TensorStore read fails,
    while the other reads of the same restore are still in flight; when one of those
    finishes, TensorStore's thread calls `loop.call_soon_threadsafe` on the closed loop
    to wake a task nobody waits for any more. The RuntimeError ("Event loop is closed")
    has nowhere to go and Python prints it as a traceback, long after our RestoreError
    was raised. Recognised by its exact shape: raised by asyncio's own
    `call_soon_threadsafe`, called from native code (no Python caller), with no object."""
    exc = unraisable.exc_value
    if unraisable.object is not None or not isinstance(exc, RuntimeError):
        return False
    tb = exc.__traceback__
    return (
        str(exc) == "Event loop is closed"
        and tb is not None
        and tb.tb_frame.f_code.co_name == "call_soon_threadsafe"
        and str(tb.tb_frame.f_globals.get("__name__", "")).startswith("asyncio.")
    )


_quiet_lock = threading.Lock()
_quiet = False


def _quiet_stale_wakeups() -> None:
    """Drop the stale wake-ups of `_is_stale_wakeup` from `sys.unraisablehook` (every
    other report goes to the hook that was there). Installed before the first read,
    not after a failure: the wake-ups can come before the RestoreError is raised, and
    as late as any time after it. Process-wide, and kept: the loop they aim at is gone,
    so dropping them loses nothing, and the failure itself is raised as our error."""
    global _quiet
    with _quiet_lock:
        if _quiet:
            return
        previous = sys.unraisablehook

        def hook(unraisable: Any) -> None:
            if not (_is_stale_wakeup(unraisable) or _is_orphaned_read(unraisable)):
                previous(unraisable)

        sys.unraisablehook = hook
        logging.getLogger("asyncio").addFilter(_orphaned_read_failure)
        _quiet = True


def _is_orphaned_read(unraisable: Any) -> bool:
    """The other report a failed Orbax read can leave: one of the same restore's reads,
    a coroutine of Orbax's that nobody awaits once the first failure was raised, closed
    when it is garbage collected; its own read failure ("Encountered error while
    reading array index") then has nowhere to go. Recognised by the coroutine's name
    and module (Orbax's `_read_array_index_and_device_put`)."""
    code = getattr(unraisable.object, "cr_code", None)
    return (
        code is not None
        and code.co_name == "_read_array_index_and_device_put"
        and "orbax" in code.co_filename
        and "Encountered error while reading" in str(unraisable.exc_value)
    )


def _orphaned_read_failure(record: logging.LogRecord) -> bool:
    """A logging filter for asyncio's logger: False (drop) for its "exception was never
    retrieved" report of a TensorStore read that failed in the same Orbax restore as
    another one (Orbax raised the first failure, which we raise as a RestoreError, and
    left the other reads' futures unread). Every other record passes."""
    exc = record.exc_info[1] if record.exc_info else None
    return not (
        isinstance(exc, ValueError)
        and "tensorstore_spec" in str(exc)
        and "exception was never retrieved" in record.getMessage()
    )


def _read_item(handler: Any, path: str, step: int, item: str, args: Any) -> Any:
    """One item of a checkpoint, read by its Orbax handler directly. Not through an
    Orbax `Checkpointer`: in a multi-process run its restore ends in a device barrier
    of every process, which hangs a process that reads alone (process 0 reading
    metadata, say) and waits on devices a running program holds."""
    _quiet_stale_wakeups()
    try:
        return handler.restore(epath.Path(path) / str(step) / item, args=args)
    finally:
        handler.close()


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
    if isinstance(e, _verify.LayoutError):
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


def _restore_args(
    saved_specs: tuple[_tree.LeafSpec, ...], placed: dict[tuple[str, ...], Any]
) -> dict[str, Any]:
    """Orbax restore arguments for every stored leaf: a sharded `jax.Array` (each device
    reads only its slices) where `placed` gives a sharding, a numpy array otherwise."""
    args: dict[str, Any] = {}
    for saved in saved_specs:
        shape = saved.stored_shape
        if 0 in shape:
            continue  # not stored
        sharding = placed.get(saved.name)
        if sharding is not None:
            arg = ocp.ArrayRestoreArgs(
                sharding=sharding, global_shape=shape, dtype=np.dtype(saved.dtype)
            )
        else:
            arg = ocp.RestoreArgs(restore_type=np.ndarray)
        _tree.put(args, saved.name, arg)
    if not args:
        args[_tree.EMPTY_NAME] = ocp.RestoreArgs(restore_type=np.ndarray)
    return args


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


def _read_state(
    path: str, step: int, where: str, seen: tuple[int, int], restore_args: dict[str, Any]
) -> dict[str, Any]:
    args = ocp.args.PyTreeRestore(restore_args=restore_args)
    return _read_arrays(
        path,
        step,
        where,
        seen,
        lambda: _read_item(ocp.PyTreeCheckpointHandler(), path, step, STATE_ITEM, args),
    )


def _read_arrays(path: str, step: int, where: str, seen: Any, read: Any) -> dict[str, Any]:
    """`read()` the step's arrays; a failure, or a step that went away meanwhile, is
    our error. (Read without error, but perhaps while the step was renamed away:
    TensorStore reads a missing file as an absent key, and zarr an absent chunk as its
    fill value; so the step is checked after the read too.)"""
    try:
        tree = read()
    except Exception as e:
        if not _still_there(path, step, seen):
            raise _removed(path, step, where) from e
        raise RestoreError(f"{where}: cannot read the checkpoint's arrays: {_readable(e)}") from e
    if not _still_there(path, step, seen):
        raise _removed(path, step, where)
    return tree


_SPEC_DUMP = "See full TensorStore details:"  # Orbax's text, then a repr of the store


def _readable(e: BaseException) -> str:
    """A read failure as a message: Orbax's "Encountered error while reading array
    index: ... See full TensorStore details: <bound method ... of TensorStore({...})>"
    loses the dump (a page of a spec's repr, not its content) and gains the TensorStore
    error it wraps (its first line), which says what was wrong (a truncated file, a
    missing key)."""
    text = str(e)
    if _SPEC_DUMP not in text:
        return text
    text = text.split(_SPEC_DUMP)[0].rstrip(" .")
    cause = e.__cause__
    if cause is not None:
        text += f" ({type(cause).__name__}: {str(cause).splitlines()[0][:300]})"
    return text


def _read_state_directly(
    path: str,
    step: int,
    where: str,
    seen: Any,
    saved_specs: tuple[_tree.LeafSpec, ...],
    placed: dict[tuple[str, ...], Any],
) -> dict[str, Any]:
    """The arrays of a step in object storage, read with TensorStore (Orbax cannot read
    s3://): the nested dict Orbax's handler returns. A leaf `placed` gives a sharding
    becomes a `jax.Array` whose devices each read only their slices."""
    step_dir = os.path.join(path, str(step))

    def read() -> dict[str, Any]:
        tree: dict[str, Any] = {}
        for saved in saved_specs:
            shape = saved.stored_shape
            if 0 in shape:
                continue  # not stored
            store = _verify.open_leaf(step_dir, saved)
            sharding = placed.get(saved.name)
            if sharding is not None:
                array = jax.make_array_from_callback(
                    shape, sharding, lambda index, s=store: s[index].read().result()
                )
            else:
                array = store.read().result()
            _tree.put(tree, saved.name, array)
        return tree

    return _read_arrays(path, step, where, seen, read)


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
    placed = {}
    for leaf, spec in zip(like_leaves, like_specs, strict=True):
        sharding = _placement(leaf, spec, by_name[spec.name])
        if sharding is not None:
            placed[spec.name] = sharding
    try:
        _verify.check_layouts(os.path.join(path, str(step)), saved_specs)
    except Exception as e:
        raise _read_failure(e, path, step, seen, where, "the checkpoint's arrays") from e
    if _remote.is_url(path):
        tree = _read_state_directly(path, step, where, seen, saved_specs, placed)
    else:
        tree = _read_state(path, step, where, seen, _restore_args(saved_specs, placed))
    checks = _checksums(meta, os.path.join(path, str(step)), where) if verify else None
    leaves = []
    for leaf, spec in zip(like_leaves, like_specs, strict=True):
        saved = by_name[spec.name]
        array = _stored_array(tree, saved, where, checks)
        leaves.append(_tree.rebuild(leaf, spec, saved, array, where))
    return treedef.unflatten(leaves)


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
    step_dir = os.path.join(path, str(step))
    sums = meta.checksums if verify else None
    leaves = []
    for leaf, spec in zip(like_leaves, like_specs, strict=True):
        saved = by_name[spec.name]
        try:
            array = _member_leaf(step_dir, saved, batch, index, saved.name in batched, sums, where)
        except RestoreError:
            raise
        except Exception as e:
            raise _read_failure(e, path, step, seen, where, f"leaf {saved.path}") from e
        leaves.append(_tree.rebuild(leaf, spec, saved, array, where))
    if not _still_there(path, step, seen):
        raise _removed(path, step, where)
    return treedef.unflatten(leaves)


def _member_leaf(
    step_dir: str,
    saved: _tree.LeafSpec,
    batch: tuple[int, ...],
    index: tuple[int, ...],
    batched: bool,
    sums: dict[str, Any] | None,
    where: str,
) -> Any:
    """One leaf of one member (`saved`: its description without the batch axes)."""
    stored = saved.stored_shape
    dtype = np.dtype(saved.dtype)
    if 0 in stored or 0 in batch:
        return np.zeros(stored, dtype)
    name = _store.param_name(saved.name)
    leaf_sums = None if sums is None else _leaf_sums(sums, saved, where)

    def report(key: str) -> RestoreError:
        return _verify.mismatch(where, name, saved.path, key, step_dir)

    if batched:
        full = batch + stored
        array = _verify.read_member(step_dir, saved, full, index, leaf_sums, report)
    else:
        array = _verify.read_leaf(step_dir, saved)
        if leaf_sums is not None:
            _verify.check_host(array, leaf_sums, report)
    return _as_described(array, saved, stored, where)


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


def _checksums(meta: _format.StepMeta, step_dir: str, where: str) -> Any:
    """`check(saved, array)`: verifies a leaf's stored data against its checksums."""
    sums = meta.checksums
    if sums is None:  # written before checksums were recorded
        return None

    def check(saved: _tree.LeafSpec, array: Any) -> None:
        name = _store.param_name(saved.name)
        leaf_sums = _leaf_sums(sums, saved, where)

        def report(key: str) -> RestoreError:
            return _verify.mismatch(where, name, saved.path, key, step_dir)

        def read_host() -> np.ndarray:
            return _verify.read_leaf(step_dir, saved)

        _verify.check_leaf(array, leaf_sums, read_host, report)

    return check


def _stored_array(
    tree: dict[str, Any], saved: _tree.LeafSpec, where: str, check: Any = None
) -> Any:
    """The data of one leaf, checked against its description (and its checksums)."""
    shape = saved.stored_shape
    dtype = np.dtype(saved.dtype)
    if 0 in shape:  # zero-size leaves are described, not stored (Orbax cannot store them)
        return np.zeros(shape, dtype)
    array = _tree.unnest(tree, saved)
    if array is None:
        raise RestoreError(
            f"{where}: leaf {saved.path} is described in the checkpoint but has no data; "
            "the checkpoint was edited or corrupted. Fix: restore another step."
        )
    if not isinstance(array, jax.Array):  # read sharded: never gathered here
        array = np.asarray(array)
    if check is not None and array.shape == shape:
        check(saved, array)
    return _as_described(array, saved, shape, where)


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
        # Without checksums (an older version's step) every byte is still read: a cut
        # or missing file fails here, where it would fail a restore.
        check = _checksums(meta, os.path.join(path, str(one)), where)
        for saved in meta.leaves:
            shape = saved.stored_shape
            if 0 in shape:
                continue  # described, not stored
            try:
                array = _verify.read_leaf(os.path.join(path, str(one)), saved)
            except Exception as e:
                raise _read_failure(e, path, one, seen, where, f"leaf {saved.path}") from e
            if check is not None:
                check(saved, array)
    return steps
