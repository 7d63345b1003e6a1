"""Which way a save goes: planned from its arguments, before anything crosses.

The façade builds one frozen `Request` per call of `save`/`maybe_save`; `plan(request)`
checks its arguments (gather, axis_name, shardings), describes its state, and returns
its route:

- `Eager`: outside any trace. Every leaf's value is read on the host (copied into
  memory the library keeps by the host side before the save returns); no JAX callback.
- `Traced`: inside a trace. Leaves Python knows are constants of the program are copied
  now and never cross; the rest (`payload`) cross in one guarded callback, gathered or
  (`layout`) device by device (`_traced.cross` / `_traced.cross_sharded`).

Multi-process runs (`processes` > 1) refuse what cannot be saved there: an eager save
of a state spanning processes, and a traced save that is not per device over every
process's devices.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING, cast

import jax
from jax.core import Tracer
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec, Sharding

from .._base._errors import ConfigError, InvalidStateError, where
from .._base._types import Gather, PyTree
from .._layout import _describe
from .._layout._spec import LeafSpec, Signature
from . import _shards, _traced, _values

if TYPE_CHECKING:
    import numpy as np
    from jax.typing import ArrayLike

_GATHER = typing.get_args(Gather)


@dataclasses.dataclass(frozen=True)
class Request:
    """One save as the façade received it, built once per call and never changed. (The
    public call, "save" or "maybe_save", that errors name is `_errors.where()`.)"""

    state: PyTree
    step: ArrayLike  # as given: a Python int, or a traced integer scalar
    step_value: int | None  # the step as a Python int, where it is known while tracing
    condition: jax.Array | None = None  # None: unconditional; else a bool scalar
    axis_name: Hashable | None = None
    gather: Gather = "stack"
    shardings: PyTree = None
    metrics: PyTree = None  # scalars recorded with the step (None: none)


@dataclasses.dataclass(frozen=True)
class Eager:
    signature: Signature
    step: int
    hosts: list[np.ndarray | jax.Array]  # every leaf's value, on the host


@dataclasses.dataclass(frozen=True)
class Traced:
    signature: Signature
    step: jax.Array  # the step, traced
    payload: list[jax.Array]  # the leaves that cross
    layout: _shards.Layout | None = None  # per device: the blocks' layout and mesh
    mesh: Mesh | AbstractMesh | None = None  # (None: gathered)


def plan(request: Request, *, processes: int) -> Eager | Traced | None:
    """The route of one save (None: an eager save whose condition is false)."""
    state, axis_name, gather = request.state, request.axis_name, request.gather
    shardings, step_value, condition = request.shardings, request.step_value, request.condition
    _check_arguments(axis_name, gather, shardings)
    _, specs, leaves = _describe.describe_state(state)
    per_leaf = _per_leaf_shardings(shardings, state, len(leaves))
    names: tuple[str, ...] = ()
    n_state = len(specs)
    if request.metrics is not None:
        names, metric_specs, metric_leaves = _check_metrics(request, processes)
        specs, leaves = specs + metric_specs, leaves + metric_leaves
    if axis_name is None and step_value is not None and not _traced.is_tracing(leaves, condition):
        if condition is not None and not bool(condition):
            return None
        if processes > 1:
            raise InvalidStateError(
                f"{where()}: outside jit in a multi-process run: a state that spans "
                "the devices of several processes cannot be read whole by any of "
                "them, and host values (numpy, Python numbers, one process's "
                "arrays) may differ between processes, while the checkpoint would "
                "keep process 0's. Fix: save inside the jitted program with "
                f"shardings=, e.g. jax.jit(lambda s: ckpt.{where()}(s, step, "
                "shardings=jax.tree.map(lambda x: x.sharding, state)))(state); keep "
                "per-process host data in files of your own."
            )
        hosts = [_values.eager_value(spec, leaf) for spec, leaf in zip(specs, leaves, strict=True)]
        ndims = tuple(h.ndim for h in hosts)  # arrays all (eager_value)
        return Eager(Signature(specs, ndims, metrics=names), step_value, hosts)
    # Traced: leaves Python knows are constants of the program are copied now and never
    # cross through JAX (which would narrow 64-bit dtypes). Concatenated over devices
    # they must cross, to be concatenated like the rest.
    constants, payload, crossing_leaves = [], [], []
    for index, (spec, leaf) in enumerate(zip(specs, leaves, strict=True)):
        if _values.is_constant(leaf) and gather != "concat":
            constants.append((index, _values.host_copy(spec, leaf)))
        elif 0 in spec.shape:  # only a shape: nothing to cross (nor to all_gather,
            # which crashes some XLA versions on zero-size operands)
            shape = spec.shape
            if gather == "concat":  # the global shape: blocks along the first axis
                shape = (shape[0] * _traced.axis_size(axis_name), *shape[1:])
            constants.append((index, _values.empty_data(spec, shape)))
        else:
            payload.append(_values.to_payload(spec, leaf))
            crossing_leaves.append(index)
    crossing = iter(payload)
    constant = dict(constants)
    ndims = tuple(
        constant[i].ndim if i in constant else next(crossing).ndim for i in range(len(specs))
    )
    signature = Signature(specs, ndims, tuple(constants), metrics=names)
    traced_step = _traced.traced_step(request.step, step_value)
    chosen = None
    if axis_name is None and payload:
        # The state's leaves choose the layout; the metrics (scalars, last) go along,
        # replicated on the same mesh.
        of_state = [i for i in crossing_leaves if i < n_state]
        if per_leaf is not None:
            chosen = [per_leaf[i] for i in of_state]
        else:
            chosen = _explicit_shardings([leaves[i] for i in of_state])
        if chosen and len(of_state) < len(crossing_leaves):
            mesh = getattr(chosen[0], "mesh", None)
            extra = len(crossing_leaves) - len(of_state)
            chosen = (
                None if mesh is None else [*chosen, *[NamedSharding(mesh, PartitionSpec())] * extra]
            )
        elif not chosen:
            chosen = None
    if chosen is not None:
        paths = [specs[i].path for i in crossing_leaves]
        layout, mesh = _shards.layout_of(chosen, payload, paths)
        # (Across processes only a mesh over every process's devices; refused below.)
        if layout.devices > 1 and (processes == 1 or layout.spans_processes):
            return Traced(signature, traced_step, payload, layout, mesh)
    if processes > 1 and payload:
        raise ConfigError(
            f"{where()}: in a multi-process run (jax.distributed, "
            f"{processes} processes) every process writes its own devices' "
            "blocks, so a traced save needs shardings= (NamedShardings of one Mesh "
            "over the devices of every process, e.g. jax.tree.map(lambda x: "
            "x.sharding, state)). A gathered save, one under pmap/shard_map "
            "(axis_name=) and one on a mesh of this process's devices alone are not "
            "supported there (docs/multiprocess.md)."
        )
    return Traced(signature, traced_step, payload)


def _check_metrics(
    request: Request, processes: int
) -> tuple[tuple[str, ...], tuple[LeafSpec, ...], list[object]]:
    """`metrics=` described (`_describe.describe_metrics`), where it can be recorded."""
    if request.gather == "concat":
        raise ConfigError(
            f"{where()}(metrics=...): with gather='concat' every leaf is joined along its "
            "first axis, which a scalar metric does not have. Fix: reduce the metric "
            "over the devices first (lax.pmean) and save with gather='replicated', or "
            "pass gather='stack' (one value per device)."
        )
    if processes > 1:
        raise ConfigError(
            f"{where()}(metrics=...): metrics are not recorded in a multi-process run yet "
            "(each process holds its own devices' part of a step; the step's description "
            "is process 0's). Fix: save without metrics= and log them yourself."
        )
    return _describe.describe_metrics(request.metrics)


def _check_arguments(axis_name: Hashable | None, gather: Gather, shardings: PyTree) -> None:
    if gather not in _GATHER:
        raise ConfigError(
            f"{where()}(gather={gather!r}): gather must be one of {_GATHER}: 'stack' the "
            "devices' values on a new axis, 'concat' their blocks along the first "
            "axis, or 'replicated' to save the first device's copy."
        )
    if axis_name is None and gather != "stack":
        raise ConfigError(
            f"{where()}: gather={gather!r} says how to gather over a device axis; it "
            "needs axis_name= (the pmap/shard_map axis name)."
        )
    _traced.check_axis_name(axis_name)
    if shardings is not None and axis_name is not None:
        raise ConfigError(
            f"{where()}: shardings= is for a sharded state under jit; inside pmap/"
            "shard_map (axis_name=) each device already holds its block. Pass one "
            "of the two."
        )


def _per_leaf_shardings(shardings: PyTree, state: PyTree, n: int) -> list[Sharding] | None:
    """`shardings=` (a pytree prefix of the state) as one sharding per leaf, or None."""
    if shardings is None:
        return None

    def is_sharding(x: object) -> bool:
        return isinstance(x, Sharding)

    try:
        full = jax.tree.broadcast(shardings, state, is_leaf=is_sharding)
    except (ValueError, TypeError) as e:
        raise InvalidStateError(
            f"{where()}(shardings=...): the shardings' pytree is not a prefix of the "
            f"state's: {e}. Fix: pass a NamedSharding per leaf in the state's structure, "
            "a prefix of it (one per subtree), or a single NamedSharding."
        ) from e
    flat = jax.tree_util.tree_leaves(full, is_leaf=is_sharding)
    if len(flat) != n:
        raise InvalidStateError(
            f"{where()}(shardings=...): got {len(flat)} shardings for the state's {n} "
            "leaves. Fix: give one NamedSharding per leaf (or a prefix of the state)."
        )
    return flat


def _explicit_shardings(leaves: Sequence[object]) -> list[NamedSharding] | None:
    """The leaves' shardings when the trace knows them (a mesh with explicit axes, as
    `jax.make_mesh` makes by default) and at least one leaf is split; else None."""
    if jax.sharding.get_abstract_mesh().manual_axes:
        return None  # inside shard_map: the gather path (axis_name=)
    found: list[NamedSharding | None] = []
    split = False
    for leaf in leaves:
        sharding = None
        if isinstance(leaf, (Tracer, jax.Array)):
            try:
                sharding = jax.typeof(leaf).sharding
            except (AttributeError, TypeError):
                sharding = None
        if not isinstance(sharding, NamedSharding):
            found.append(None)
            continue
        explicit = jax.sharding.AxisType.Explicit in tuple(sharding.mesh.axis_types)
        if not explicit:
            found.append(None)
            continue
        split = split or any(entry is not None for entry in sharding.spec)
        found.append(sharding)
    if not split:
        return None
    meshes = {(s.mesh.axis_names, s.mesh.axis_sizes) for s in found if s is not None}
    if len(meshes) != 1 or any(s is None for s in found):
        return None  # mixed: save gathered
    return cast(list[NamedSharding], found)  # (no None in it: checked above)
