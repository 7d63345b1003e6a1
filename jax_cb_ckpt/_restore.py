"""Reading checkpoints back: which steps exist, and one step into the types of `like`.

Runs in the caller's thread and blocks it until the arrays are in memory. Reads go
through Orbax (a read-only manager), so anything Orbax can read, we can; and the JSON
`meta` item says how each leaf was stored, so nothing is unpickled and no code runs.
"""

from __future__ import annotations

import os
from typing import Any

import orbax.checkpoint as ocp

from . import _tree
from ._errors import NoCheckpointError, RestoreError
from ._writer import META_ITEM, STATE_ITEM


def all_steps(directory: str | os.PathLike[str]) -> list[int]:
    """Steps with a complete checkpoint in `directory`, ascending.

    Orbax writes a step into a temporary directory and renames it when complete, so a
    step that is listed here restores. Does not wait for pending saves.
    """
    path = os.fspath(directory)
    if not os.path.isdir(path):
        return []
    steps = []
    for name in os.listdir(path):
        if name.isdigit() and os.path.isdir(os.path.join(path, name)):
            steps.append(int(name))
    return sorted(steps)


def latest_step(directory: str | os.PathLike[str]) -> int | None:
    """The newest complete step in `directory`, or None when there is none."""
    steps = all_steps(directory)
    return steps[-1] if steps else None


def _read(path: str, step: int) -> tuple[dict[str, Any], dict[str, Any]]:
    handler = ocp.CompositeCheckpointHandler(
        **{STATE_ITEM: ocp.PyTreeCheckpointHandler(), META_ITEM: ocp.JsonCheckpointHandler()}
    )
    with ocp.Checkpointer(handler) as checkpointer:
        restored = checkpointer.restore(
            os.path.join(path, str(step)),
            args=ocp.args.Composite(
                **{STATE_ITEM: ocp.args.PyTreeRestore(), META_ITEM: ocp.args.JsonRestore()}
            ),
        )
    return restored[META_ITEM], restored[STATE_ITEM]


def _pick_step(path: str, step: int | None, what: str) -> int:
    steps = all_steps(path)
    if not steps:
        raise NoCheckpointError(
            f"{what}: no checkpoint in {path!r}. Fix: check the directory, or start "
            "from the initial state when latest_step() is None."
        )
    if step is None:
        return steps[-1]
    if step not in steps:
        raise NoCheckpointError(
            f"{what}: no checkpoint for step {step} in {path!r}; the steps there are "
            f"{_short(steps)}."
        )
    return step


def metadata(directory: str | os.PathLike[str], *, step: int | None = None) -> dict[str, Any]:
    """The JSON `meta` item of checkpoint `step` (default: the latest) in `directory`."""
    path = os.fspath(directory)
    step = _pick_step(path, step, "metadata")
    with ocp.Checkpointer(ocp.JsonCheckpointHandler()) as checkpointer:
        return checkpointer.restore(
            os.path.join(path, str(step), META_ITEM), args=ocp.args.JsonRestore()
        )


def restore(directory: str | os.PathLike[str], like: Any, *, step: int | None = None) -> Any:
    """Restore checkpoint `step` (default: the latest) of `directory` into the shape of `like`.

    `like` is a pytree like the saved state: concrete arrays, or `jax.ShapeDtypeStruct`s
    (e.g. from `jax.eval_shape`). The result has `like`'s pytree types (TrainState,
    NamedTuple, dataclass, dict, ...), dtypes, typed PRNG keys (re-wrapped with the
    recorded implementation) and Python scalar types; jax.Array leaves are placed with
    the sharding of the `like` leaf when it has one. Blocks until the data is loaded.

    Raises:
        NoCheckpointError: no complete checkpoint for that step.
        StructureMismatchError: `like` differs from the checkpoint; names the first leaf.
    """
    path = os.fspath(directory)
    step = _pick_step(path, step, "restore")
    where = f"restore(step={step}) from {path!r}"
    treedef, like_specs, like_leaves = _tree.describe_state(
        like, where, prefix="like", abstract_ok=True
    )
    meta, tree = _read(path, step)
    try:
        saved_specs = tuple(_tree.LeafSpec.from_json(leaf) for leaf in meta["leaves"])
    except (KeyError, TypeError, ValueError) as e:
        raise RestoreError(
            f"{where}: the checkpoint has no valid jax_cb_ckpt '{META_ITEM}' item, so "
            "it was not written by jax_cb_ckpt. Read it with orbax.checkpoint directly."
        ) from e
    _tree.check_like(like_specs, saved_specs, where)
    by_name = {spec.name: spec for spec in saved_specs}
    leaves = []
    for leaf, spec in zip(like_leaves, like_specs, strict=True):
        saved = by_name[spec.name]
        array = _tree.unnest(tree, saved)
        if array is None:
            raise RestoreError(f"{where}: leaf {spec.path} is listed but has no data.")
        leaves.append(_tree.rebuild(leaf, spec, saved, array))
    return treedef.unflatten(leaves)


def _short(steps: list[int]) -> str:
    if len(steps) <= 10:
        return str(steps)
    return f"[{', '.join(map(str, steps[:5]))}, ..., {', '.join(map(str, steps[-3:]))}]"
