"""Which way a save goes: planned from its arguments, before anything crosses.

The façade builds one frozen `Request` per call of `save`/`maybe_save`; `plan(request)`
checks its arguments (gather, axis_name, shardings, metrics), describes its state and
metrics in one pass, and returns its route:

- `Skip`: nothing is saved (`maybe_save` at a step that does not save, or an eager save
  whose condition is false); the state and metrics were checked all the same.
- `Eager`: outside any trace. Every leaf's value is read on the host (copied into
  memory the library keeps by the host side before the save returns); no JAX callback.
- `Traced`: inside a trace. Leaves Python knows are constants of the program are copied
  now and never cross; the rest (`payload`) cross in one guarded callback, gathered or
  (`layout`) device by device (`_traced.send`), by the `Crossing` chosen here
  (`chosen_crossing`: `Checkpointer(crossing=...)` and the backend), once per save.

Multi-process runs (`processes` > 1) refuse what cannot be saved there: an eager save
of a state spanning processes, and a traced save that is not per device over every
process's devices.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from collections.abc import Hashable
from typing import TYPE_CHECKING, Any

import jax
from jax.sharding import AbstractMesh, Mesh, Sharding

from .._base._errors import ConfigError, InvalidStateError, where
from .._base._types import Crossing as CrossingName
from .._base._types import Gather, PyTree
from .._handoff import _shards
from .._layout import _describe, _extra
from .._layout._extra import Extra
from .._layout._spec import LeafSpec, Signature
from . import _cuda, _values
from ._buffer import CpuBuffer
from ._callback import DebugCallback
from ._crossing import Crossing

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
    # Scalars recorded with the step (None: none); from the façade also a function of the
    # state, which `Parts.cross` (`_user/_wiring.py`) computes before `plan` sees it.
    metrics: PyTree = None
    # JSON stored beside the state (`_layout/_extra`): a dict, or a function of the step
    # called on the host when the save fires; checked by `plan`, never traced.
    extra: object = None


@dataclasses.dataclass(frozen=True)
class Eager:
    signature: Signature
    step: int
    hosts: list[np.ndarray | jax.Array]  # every leaf's value, on the host

    @property
    def metrics(self) -> tuple[str, ...]:
        return self.signature.metrics


@dataclasses.dataclass(frozen=True)
class Skip:
    """Nothing is saved: the metrics' names (for `keep_best`'s check), if any."""

    metrics: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class Traced:
    signature: Signature
    step: jax.Array  # the step, traced
    payload: list[jax.Array]  # the leaves that cross
    crossing: Crossing  # how they reach the host (`chosen_crossing`)
    condition: jax.Array | None  # the request's: None, unconditional
    axis_name: Hashable | None  # the request's (inside pmap/shard_map)
    gather: Gather  # the request's
    layout: _shards.Layout | None = None  # per device: the blocks' layout and mesh
    mesh: Mesh | AbstractMesh | None = None  # (None: gathered)

    @property
    def metrics(self) -> tuple[str, ...]:
        return self.signature.metrics


def plan(
    request: Request, *, processes: int, wanted: bool = True, crossing: CrossingName = "auto"
) -> Eager | Traced | Skip:
    """The route of one save: checked, described, then `Skip` (not `wanted`, or an eager
    save whose condition is false), `Eager` or `Traced` (which crosses by the crossing
    named, `Checkpointer(crossing=...)`).

    Each stage sees the state once, in this order: the arguments are checked here, the
    state and metrics described (`_describe`), the leaves' values taken (`_values`), the
    per-device layout chosen (`_shards`)."""
    state, step_value = request.state, request.step_value
    axis_name, gather, condition = request.axis_name, request.gather, request.condition
    _check_arguments(axis_name, gather, request.shardings, request.metrics, processes)
    extra = _extra.of(request.extra, where())  # (a dict: encoded now, as it is now)
    per_leaf = _per_leaf_shardings(request.shardings, state)
    described = _describe.describe_save(state, request.metrics)
    specs, leaves, names, n_state = described
    _check_count(per_leaf, n_state)
    if not wanted:
        return Skip(names)
    if axis_name is None and step_value is not None and not _values.is_tracing(leaves, condition):
        if condition is not None and not bool(condition):
            return Skip(names)
        return _eager_route(specs, leaves, names, step_value, processes, extra)
    crossing_ = chosen_crossing(crossing)
    return _traced_route(request, described, per_leaf, processes, crossing_, extra)


def _eager_route(
    specs: tuple[LeafSpec, ...],
    leaves: list[Any],
    names: tuple[str, ...],
    step: int,
    processes: int,
    extra: Extra | None,
) -> Eager:
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
    hosts = _values.eager_values(specs, leaves)
    ndims = tuple(h.ndim for h in hosts)  # arrays all (eager_value)
    return Eager(Signature(specs, ndims, metrics=names, extra=extra), step, hosts)


def _traced_route(
    request: Request,
    described: _describe.Described,
    per_leaf: list[Sharding] | None,
    processes: int,
    crossing: Crossing,
    extra: Extra | None,
) -> Traced:
    """A traced save's route: its leaves split (constants, payload), then gathered or,
    with a layout, device by device."""
    specs, leaves, names, n_state = described
    axis_name, gather = request.axis_name, request.gather
    split = _values.split(specs, leaves, gather, axis_name)
    signature = Signature(specs, split.ndims, split.constants, metrics=names, extra=extra)
    step = _values.traced_step(request.step, request.step_value)
    traced = functools.partial(
        Traced, signature, step, split.payload, crossing, request.condition, axis_name, gather
    )
    chosen = None
    if axis_name is None and split.payload:
        chosen = _shards.chosen(per_leaf, leaves, split.crossing, n_state)
    if chosen is not None:
        paths = [specs[i].path for i in split.crossing]
        layout, mesh = _shards.layout_of(chosen, split.payload, paths)
        # (Across processes only a mesh over every process's devices; refused below.)
        if layout.devices > 1 and (processes == 1 or layout.spans_processes):
            return traced(layout, mesh)
    if processes > 1 and split.payload:
        raise ConfigError(
            f"{where()}: in a multi-process run (jax.distributed, "
            f"{processes} processes) every process writes its own devices' "
            "blocks, so a traced save needs shardings= (NamedShardings of one Mesh "
            "over the devices of every process, e.g. jax.tree.map(lambda x: "
            "x.sharding, state)). A gathered save, one under pmap/shard_map "
            "(axis_name=) and one on a mesh of this process's devices alone are not "
            "supported there (docs/multiprocess.md)."
        )
    return traced()


def chosen_crossing(name: CrossingName) -> Crossing:
    """The crossing a traced save takes (_crossing.py): `name` is
    `Checkpointer(crossing=...)`. The buffer crossing reads XLA's buffers from numpy on
    a CPU and copies them on XLA's stream in a process with a GPU (its host half still
    reads buffers in host memory, a program on the CPU device, the CPU way). A
    per-device save on a CPU always takes the buffer crossing (`DebugCallback`'s
    `blocks_by`). A new crossing is a class of `Crossing` and one line here."""
    buffer = _cuda.CudaBuffer() if _cuda.gpu_present() else CpuBuffer()
    if name == "buffer" or (name == "auto" and buffer_by_default()):
        return buffer
    return DebugCallback(blocks_by=buffer if jax.default_backend() == "cpu" else None)


def buffer_by_default() -> bool:
    """What `crossing="auto"` picks: the buffer crossing where it is built and checked,
    on CPU and on CUDA GPUs (benchmarks/gpu_check.py, bit for bit on an H200); the
    `debug.callback` crossing elsewhere (ROCm GPUs, TPU)."""
    backend = jax.default_backend()
    if backend == "cpu":
        return True
    if backend != "gpu":
        return False
    version = getattr(jax.devices()[0].client, "platform_version", "")
    return "rocm" not in str(version).lower()


def _check_count(per_leaf: list[Sharding] | None, n_state: int) -> None:
    """One sharding per leaf of the state as described (`shardings=`, where given)."""
    if per_leaf is not None and len(per_leaf) != n_state:
        raise InvalidStateError(
            f"{where()}(shardings=...): got {len(per_leaf)} shardings for the state's "
            f"{n_state} leaves. Fix: give one NamedSharding per leaf (or a prefix of the "
            "state)."
        )


def _check_arguments(
    axis_name: Hashable | None, gather: Gather, shardings: PyTree, metrics: PyTree, processes: int
) -> None:
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
    if shardings is not None and axis_name is not None:
        raise ConfigError(
            f"{where()}: shardings= is for a sharded state under jit; inside pmap/"
            "shard_map (axis_name=) each device already holds its block. Pass one "
            "of the two."
        )
    check_axis_name(axis_name)
    if metrics is None:
        return
    if gather == "concat":
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


def check_axis_name(axis_name: Hashable | None) -> None:
    """Inside `pmap`/`shard_map` every device would save its own part as the same step:
    require `axis_name`, and that it names a mapped axis; outside, refuse an
    `axis_name` no transformation binds."""
    manual = tuple(jax.sharding.get_abstract_mesh().manual_axes)
    if axis_name is None and manual:
        raise InvalidStateError(
            f"{where()} is inside pmap/shard_map over axes {manual}: every device would "
            f"save its own part of the state as the same step. Fix: pass "
            f"axis_name={manual[0]!r} (add gather='replicated' if the state is the same "
            "on every device, gather='concat' to concatenate shard_map blocks)."
        )
    if axis_name is None:
        return
    names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
    if manual and not set(names) <= set(manual):
        raise InvalidStateError(
            f"{where()}: axis_name={axis_name!r} is not a pmap/shard_map axis here; the "
            f"mapped axes are {manual}."
        )
    if not manual:  # outside any map: a named axis (vmap's) may still be bound
        for name in names:
            try:
                jax.lax.axis_size(name)
            except NameError as e:  # JAX's "unbound axis name", raised at the save
                raise InvalidStateError(
                    f"{where()}(axis_name={axis_name!r}): no axis {name!r} is mapped here "
                    "(outside pmap/shard_map). Fix: leave axis_name out, or call it "
                    "inside the pmap/shard_map over that axis."
                ) from e


def _per_leaf_shardings(shardings: PyTree, state: PyTree) -> list[Sharding] | None:
    """`shardings=` (a pytree prefix of the state) as one sharding per leaf, or None
    (`plan` checks there is one per leaf of the state as described)."""
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
    return jax.tree_util.tree_leaves(full, is_leaf=is_sharding)
