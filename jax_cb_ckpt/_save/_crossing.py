"""How a traced save's arrays reach the host: one `Crossing` object per way, holding
both halves of it.

A crossing's traced half (`emit`, `emit_blocks`) puts the callback(s) into the device
program, inside the save's guarded branch (_traced.py builds the branch, the `vmap`
rules and the gathering around it); the callback it compiles in calls the host side
(`Host`: `_host.HostSide`) with the crossing's own host half (`receive`,
`receive_blocks`), which reads what that callback got (XLA's buffers, or `jax.Array`s)
and returns what arrived. Both halves are methods of one class, so what the sender puts
in and what the receiver reads agree by construction (e.g. the dtypes a buffer
crossing widens, `_buffer.widen`, and turns back, `_buffer.as_saved_dtypes`).

The crossings (`_route.chosen_crossing` picks one per save, from
`Checkpointer(crossing=...)` and the backend):

- `_buffer.CpuBuffer`: a pure `buffer_callback` copies XLA's own buffers once.
- `_cuda.CudaBuffer`: the same callback in a process with a GPU; the host queues the
  copies on XLA's stream into pinned memory.
- `_callback.DebugCallback`: `jax.debug.callback` with the leaves (the fallback).

The host side only ever sees an `Arrival` (a gathered save) or `Blocks` (one device's
part of a per-device save): it never asks which crossing made it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import numpy as np

from .._handoff import _shards
from ._staging import StagingPool

if TYPE_CHECKING:
    import jax
    from numpy.typing import ArrayLike

    from .._layout._spec import Signature


class HostCopy(NamedTuple):
    """What a crossing's `copy_out` gives the hand-off: the leaves in host memory the
    library may keep, how to give that memory back once written, and (copies from a
    GPU still in flight) how to wait until they hold the data."""

    arrays: Sequence[np.ndarray | _shards.ShardedArray]
    release: Callable[[], None]
    ready: Callable[[], None] | None = None


class Arrival(NamedTuple):
    """A gathered save as a crossing's `receive` read it: the step(s) and the per-member
    mask as they crossed, the copy of the leaves into host memory the library may keep
    (run by the exchange once the step is admitted, still inside the callback), and the
    owner the exchange keys the step by (`Exchange.hand_over`): the save's `Signature`
    for a crossing whose copies of one step in one run are replicas (it reports the
    run's end, `HostSide.end_run`), None where a second copy is a repeat."""

    step: ArrayLike
    wanted: ArrayLike
    copy_out: Callable[[], HostCopy]
    owner: object


class Blocks(NamedTuple):
    """One device's part of a per-device save as a crossing's `receive_blocks` read it:
    its step, mask and mesh coordinates, its blocks in host memory as their saved
    dtypes (readable until `release`, which the host calls once it copied the blocks
    it writes)."""

    step: ArrayLike
    wanted: ArrayLike
    coords: ArrayLike
    arrays: list[np.ndarray]
    release: Callable[[], None]


@dataclasses.dataclass
class Pools:
    """The reused host memory a crossing's `receive` copies into, one set per
    `HostSide`: `staging` (touched host memory), `pinned` (page-locked, for copies from
    a GPU; made by the CUDA crossing when first needed, `keep` sets per layout)."""

    staging: StagingPool
    keep: int
    pinned: StagingPool | None = None


class Host(Protocol):
    """What a crossing's callbacks call on the host side (`_host.HostSide`), inside JAX's
    callbacks: each entry point is given the crossing's own reader (`receive`,
    `receive_blocks`, or one that reads the end of a run), then the callback's
    arguments; every failure in either is kept for `wait()`."""

    def receive(self, read: Callable[..., Arrival], signature: Signature, *args: Any) -> None: ...

    def receive_blocks(
        self,
        read: Callable[..., Blocks],
        signature: Signature,
        layout: _shards.Layout,
        *args: Any,
    ) -> None: ...

    def end_run(
        self,
        read: Callable[..., tuple[np.ndarray, np.ndarray]],
        signature: Signature,
        *args: Any,
    ) -> None: ...


class Crossing(Protocol):
    """One way a traced save's arrays reach the host (see module doc; how to add one:
    _save/README.md). Stateless: one object serves every save that takes it.

    The traced half runs while tracing, inside the save's branch (no `cond` of its own):
    `step` and `wanted` are the save's step(s) and per-member mask, the whole batch under
    `vmap`. The host half runs inside the callback the traced half compiled in, with the
    arguments it was given after the crossing's reader (see `Host`)."""

    def emit(
        self,
        host: Host,
        signature: Signature,
        step: jax.Array,
        wanted: jax.Array,
        payload: list[jax.Array],
    ) -> None:
        """Compile in the callback(s) that hand `payload` (the leaves that cross) to
        `host.receive(self.receive, signature, ...)`."""
        ...

    def emit_blocks(
        self,
        host: Host,
        signature: Signature,
        layout: _shards.Layout,
        step: jax.Array,
        mask: jax.Array,
        coords: jax.Array,
        blocks: list[jax.Array],
    ) -> None:
        """In a manual context (`shard_map`, `pmap`): compile in one device's callback
        that hands its `blocks` and mesh `coords` to
        `host.receive_blocks(self.receive_blocks, signature, layout, ...)`."""
        ...

    def per_device(self) -> Crossing:
        """The crossing a per-device save takes (itself, or one that works there)."""
        ...

    def receive(self, pools: Pools, signature: Signature, *args: Any) -> Arrival:
        """On the host, inside the callback `emit` compiled in: what arrived. XLA's
        buffers are valid only during the call: `copy_out` copies them, or reads a
        copy made here."""
        ...

    def receive_blocks(self, pools: Pools, *args: Any) -> Blocks:
        """On the host, inside the callback `emit_blocks` compiled in: what arrived."""
        ...


def noop() -> None:
    pass
