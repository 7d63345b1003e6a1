"""Reading checkpoints back: which steps exist, and one step into the types of `like`.

Runs in the caller's thread and blocks it until the arrays are in memory. Reads go
through Orbax (a read-only checkpointer), so anything Orbax can read, we can; and the
JSON `meta` item says how each leaf was stored, so nothing is unpickled and no code
runs. A checkpoint is trusted no further than its files: a `meta` item that does not
match the arrays (hand-edited, corrupt, another program's) is a `RestoreError`.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from . import _format, _tree
from ._errors import ConfigError, NoCheckpointError, RestoreError
from ._format import META_ITEM, STATE_ITEM


def all_steps(directory: str | os.PathLike[str]) -> list[int]:
    """Steps with a complete checkpoint in `directory`, ascending.

    Only checkpoints written by jax_cb_ckpt count (see docs/usage.md, "What is in the
    directory"): other folders, even with integer names, are ignored. A step listed
    here is complete and restores. Does not wait for pending saves.
    """
    return _format.list_steps(_format.resolve(directory, "all_steps"))


def latest_step(directory: str | os.PathLike[str]) -> int | None:
    """The newest complete step in `directory`, or None when there is none."""
    steps = _format.list_steps(_format.resolve(directory, "latest_step"))
    return steps[-1] if steps else None


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
    steps = _format.list_steps(path)
    if step is not None and step in steps:
        return step
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


def _read_item(handler: Any, path: str, step: int, item: str, args: Any) -> Any:
    """One item of a checkpoint, read by its Orbax handler directly. Not through an
    Orbax `Checkpointer`: in a multi-process run its restore ends in a device barrier
    of every process, which hangs a process that reads alone (process 0 reading
    metadata, say) and waits on devices a running program holds."""
    try:
        return handler.restore(epath.Path(path) / str(step) / item, args=args)
    finally:
        handler.close()


def _read_meta(path: str, step: int, where: str) -> dict[str, Any]:
    links = _format.symlinks_inside(os.path.join(path, str(step)))
    if links:
        raise RestoreError(
            f"{where}: the checkpoint contains symlinks ({links[0]!r}, ...), which could "
            "make reading it read files outside the directory; the library never writes "
            "them, so it was altered. Fix: restore another step, or replace the links by "
            "the files they point to if you trust them."
        )
    try:
        meta = _read_item(
            ocp.JsonCheckpointHandler(), path, step, META_ITEM, ocp.args.JsonRestore()
        )
    except Exception as e:
        raise RestoreError(f"{where}: cannot read the checkpoint's '{META_ITEM}' item: {e}") from e
    if not isinstance(meta, dict) or meta.get("format") != _format.FORMAT:
        found = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise RestoreError(
            f"{where}: the checkpoint's '{META_ITEM}' item has format tag {found!r}, "
            f"not {_format.FORMAT!r}: it was not written by this version of "
            "jax_cb_ckpt (a newer version, another program, or a hand edit). Fix: "
            "read it with the jax_cb_ckpt version that wrote it, or with "
            "orbax.checkpoint directly."
        )
    return meta


def metadata(directory: str | os.PathLike[str], *, step: int | None = None) -> dict[str, Any]:
    """The JSON `meta` item of checkpoint `step` (default: the latest) in `directory`."""
    path = _format.resolve(directory, "metadata")
    step = _pick_step(path, _check_step_arg(step, "metadata"), "metadata")
    return _read_meta(path, step, f"metadata(step={step}) from {path!r}")


def _saved_specs(meta: dict[str, Any], where: str) -> tuple[_tree.LeafSpec, ...]:
    try:
        leaves = meta["leaves"]
        if not isinstance(leaves, list):
            raise TypeError(f"'leaves' is a {type(leaves).__name__}, not a list")
        return tuple(_tree.LeafSpec.from_json(leaf) for leaf in leaves)
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
        shape = saved.shape + (_tree.key_data_shape(saved.impl) if saved.kind == _tree.KEY else ())
        if 0 in shape:
            continue  # not stored
        node = args
        for part in saved.name[:-1]:
            node = node.setdefault(part, {})
        sharding = placed.get(saved.name)
        if sharding is not None:
            node[saved.name[-1]] = ocp.ArrayRestoreArgs(
                sharding=sharding, global_shape=shape, dtype=np.dtype(saved.dtype)
            )
        else:
            node[saved.name[-1]] = ocp.RestoreArgs(restore_type=np.ndarray)
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
    if _format.storage_dtype(dtype) != dtype or 0 in saved.shape:
        return None
    return sharding


def _read_state(path: str, step: int, where: str, restore_args: dict[str, Any]) -> dict[str, Any]:
    try:
        args = ocp.args.PyTreeRestore(restore_args=restore_args)
        return _read_item(ocp.PyTreeCheckpointHandler(), path, step, STATE_ITEM, args)
    except Exception as e:
        raise RestoreError(f"{where}: cannot read the checkpoint's arrays: {e}") from e


def restore(directory: str | os.PathLike[str], like: Any, *, step: int | None = None) -> Any:
    """Restore checkpoint `step` (default: the latest) of `directory` into the shape of `like`.

    `like` is a pytree like the saved state: concrete arrays, or `jax.ShapeDtypeStruct`s
    (e.g. from `jax.eval_shape`). The result has `like`'s pytree types (TrainState,
    NamedTuple, dataclass, dict, ...), dtypes, typed PRNG keys (re-wrapped with the
    recorded implementation) and Python scalar types; jax.Array leaves are placed with
    the sharding of the `like` leaf when it has one. Blocks until the data is loaded.
    `directory` may be relative (to the working directory), as everywhere.

    Raises:
        NoCheckpointError: no complete checkpoint for that step.
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
    meta = _read_meta(path, step, where)
    saved_specs = _saved_specs(meta, where)
    _tree.check_like(like_specs, saved_specs, where)
    by_name = {spec.name: spec for spec in saved_specs}
    placed = {}
    for leaf, spec in zip(like_leaves, like_specs, strict=True):
        sharding = _placement(leaf, spec, by_name[spec.name])
        if sharding is not None:
            placed[spec.name] = sharding
    tree = _read_state(path, step, where, _restore_args(saved_specs, placed))
    leaves = []
    for leaf, spec in zip(like_leaves, like_specs, strict=True):
        saved = by_name[spec.name]
        array = _stored_array(tree, saved, where)
        leaves.append(_tree.rebuild(leaf, spec, saved, array, where))
    return treedef.unflatten(leaves)


def _stored_array(tree: dict[str, Any], saved: _tree.LeafSpec, where: str) -> Any:
    """The data of one leaf, checked against its description."""
    shape = saved.shape + (_tree.key_data_shape(saved.impl) if saved.kind == _tree.KEY else ())
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
    value = _format.from_storage(array, dtype) if array.shape == shape else None
    if value is None:
        raise RestoreError(
            f"{where}: leaf {saved.path} is described as {dtype.name}{list(shape)} but "
            f"its data is {array.dtype.name}{list(array.shape)}; the checkpoint was edited "
            "or corrupted. Fix: restore another step."
        )
    return value


def _short(steps: list[int]) -> str:
    if len(steps) <= 10:
        return str(steps)
    return f"[{', '.join(map(str, steps[:5]))}, ..., {', '.join(map(str, steps[-3:]))}]"
