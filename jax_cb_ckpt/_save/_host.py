"""The host side of a save: runs inside JAX's callbacks while the device program waits.

It does the least it can: copy the leaves into host memory the library may keep, put
one item on the writer's queue, return. It never calls JAX transformations or Orbax
(calling JAX from a callback can deadlock; Orbax runs barriers and blocks on the previous
save), and it never touches the disk.

Three entry points, one per kind of callback a crossing compiles in (_crossing.py; the
crossings' traced halves are called by _traced.py): each is given the crossing's own
reader of the callback's arguments, which says what arrived, so nothing here asks which
crossing made the call:

- `receive`: a gathered save (`Arrival`): its step is admitted and its leaves copied
  into host memory the library may keep (the crossing's `copy_out`), then queued.
- `receive_blocks` (per device: `shardings=`, or `pmap`/`shard_map` with `axis_name=`):
  one device's blocks and mesh coordinates (`Blocks`); the blocks it owns are copied,
  and the device that completes the step queues it (_assembly.py).
- `end_run` (the buffer crossings): runs after `receive`, once per program run, to
  report repeated steps.

`eager` takes a save made outside any trace: no callback, no crossing.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import jax
import numpy as np
from jax.core import Tracer

from .._base import _warn
from .._base._errors import (
    CheckpointerClosedError,
    CheckpointError,
    InvalidStateError,
    UnflushedSaveWarning,
)
from .._handoff import _shards
from .._handoff._exchange import Closed, Exchange
from .._handoff._items import Claim, SaveItem
from .._layout._spec import Signature
from . import _assembly
from ._callback import probe_callback_arrays as probe_callback_arrays  # (the façade's one call)
from ._crossing import Arrival, Blocks, HostCopy, Pools
from ._staging import StagingPool

if TYPE_CHECKING:
    from numpy.typing import ArrayLike


def _reported(entry: Callable[..., None]) -> Callable[..., None]:
    """A callback entry point whose every failure is kept for the user's thread: JAX
    wraps an exception raised in a callback into the program's failure, which a program
    with no outputs on an accelerator may never show (the jitted call has returned
    before it ran; the H200 run of 2026-12-04). Ours is recorded as it is; anything
    else (a CUDA call, a buffer the host cannot read) as a `CheckpointError` naming the
    directory and the cause. `wait()`, `close()`, the next save from Python and the next
    crossing raise it."""

    @functools.wraps(entry)
    def reported(self: HostSide, *args: Any) -> None:
        try:
            entry(self, *args)
        except CheckpointError as e:
            self._exchange.record(e)
            raise
        except Exception as e:
            error = CheckpointError(
                f"a save to {self.directory!r} failed while the device program handed "
                f"its state over (in JAX's callback): {type(e).__name__}: {e}. Nothing of "
                "that save was written; earlier checkpoints are untouched."
            )
            self._exchange.record(error)
            raise error from e

    return reported


class HostSide:
    """The callback target of one Checkpointer (see module doc for what it may do)."""

    def __init__(self, exchange: Exchange, queue_size: int):
        self._exchange = exchange
        self._stats = exchange.stats
        self._queue_size = queue_size
        self._pools = Pools(StagingPool(keep=queue_size), keep=queue_size)  # the crossings'
        self._shard_pool: StagingPool | None = None  # per-device blocks, made when needed
        self._assemblies = _assembly.Assemblies()
        # Told the step of each per-device hand-off as it begins (multi-process runs:
        # the others wait for a process that is handing a save over).
        self.on_step: Callable[[int], None] | None = None

    @property
    def directory(self) -> str:
        return self._exchange.directory

    @_reported
    def receive(self, read: Callable[..., Arrival], signature: Signature, *args: Any) -> None:
        """A gathered save's callback (`Crossing.emit`): `read`, the crossing's own
        `receive`, says from the callback's `args` what arrived; its step is admitted,
        its leaves copied out and queued, while the device program waits."""
        arrival = read(self._pools, signature, *args)
        self._in_callback(signature, arrival.step, arrival.wanted, arrival.copy_out, arrival.owner)

    @_reported
    def receive_blocks(
        self,
        read: Callable[..., Blocks],
        signature: Signature,
        layout: _shards.Layout,
        *args: Any,
    ) -> None:
        """One device's part of a per-device save (`Crossing.emit_blocks`; see
        _shards.py): `read`, the crossing's own `receive_blocks`, gives its blocks of
        the crossing leaves in host memory. The blocks it owns are copied into staging;
        the device that completes the step queues the save."""
        start = time.perf_counter()
        blocks = read(self._pools, *args)
        try:
            self._deposit_shard(signature, layout, start, blocks)
        finally:
            blocks.release()  # the blocks it owns were copied into staging

    def _deposit_shard(
        self, signature: Signature, layout: _shards.Layout, start: float, blocks: Blocks
    ) -> None:
        members = np.asarray(blocks.wanted).astype(bool)  # a device mask under pmap "stack"
        if not members.any():
            return
        # (a refusal is the same on every device, nothing added; kept by `_reported`)
        step = _one_step(np.asarray(blocks.step), np.asarray(True))
        if self.on_step is not None:
            self.on_step(step)
        position = tuple(int(c) for c in np.asarray(blocks.coords).reshape(-1))
        arrays = blocks.arrays
        shapes = [layout.global_shape(i, a.shape) for i, a in enumerate(arrays)]
        if self._shard_pool is None:
            self._shard_pool = StagingPool(keep=self._queue_size * layout.devices, layouts=64)
        key = (signature, step)
        assembly, first, stale = self._assemblies.join(key, layout.reporting, len(arrays), position)
        if stale is not None:
            self._settle(stale)
        try:
            if first:
                claim = None
                try:
                    claim = self._decide(step)
                finally:  # also when it raised: the other devices wait for it
                    assembly.decide(claim)
            else:
                assembly.wait_decided()
            if assembly.saving:
                self._copy_blocks(assembly, layout, position, arrays, shapes)
        except BaseException:
            assembly.failed = True  # the step is given back once every device reported
            raise
        finally:
            blocking_s = time.perf_counter() - start
            if self._assemblies.finish(key, assembly, blocking_s):
                self._complete(signature, step, members, assembly, layout, arrays, shapes)

    def _decide(self, step: int) -> Claim | None:
        """The first device's decision on a per-device save: the other run's steps it
        replaces (it then holds a slot until the writer is done), or None (a repeated
        step, or skipped: the queue is full and on_full="skip")."""
        self._refuse_if_failed()
        # owner=None: a step is complete once per run, so a second one is a duplicate.
        return self._exchange.admit(step, owner=None, in_callback=True)

    def _copy_blocks(
        self,
        assembly: _assembly.Assembly,
        layout: _shards.Layout,
        position: tuple[int, ...],
        arrays: Sequence[np.ndarray],
        shapes: Sequence[tuple[int, ...]],
    ) -> None:
        """Copy the blocks this device writes into staging and add them to the step.
        Several processes: every process keeps its own devices' replicas, once."""
        spans = layout.spans_processes
        owned = []
        for i, array in enumerate(arrays):
            index = layout.index(i, position, array.shape, spans)
            if index is None:
                continue
            key = _shards.block_key(index, shapes[i])
            if not spans or assembly.reserve(i, key):
                owned.append((i, key))
        assert self._shard_pool is not None
        copies, release = self._shard_pool.copy_in([arrays[i] for i, _ in owned])
        assembly.add([(i, k, c) for (i, k), c in zip(owned, copies, strict=True)], release)

    def _complete(
        self,
        signature: Signature,
        step: int,
        members: np.ndarray,
        assembly: _assembly.Assembly,
        layout: _shards.Layout,
        arrays: Sequence[np.ndarray],
        shapes: Sequence[tuple[int, ...]],
    ) -> None:
        """Every device has reported: queue the save, or give back what it holds."""
        claim = assembly.claim
        if claim is None or not assembly.saving:
            self._settle(assembly)
            return

        def copy_out() -> HostCopy:
            crossed = [
                _shards.ShardedArray(shapes[i], arrays[i].dtype, layout, i, assembly.blocks[i])
                for i in range(len(arrays))
            ]
            return HostCopy(crossed, assembly.release)

        item = functools.partial(
            self._item, signature, members, copy_out, blocking_s=assembly.blocking_s
        )
        self._stats.in_flight(self._exchange.fill(claim, item))

    def _settle(self, assembly: _assembly.Assembly) -> None:
        """A per-device save that will not be written: its staging and its slot (and the
        claim of its step) are given back, once."""
        if not self._assemblies.take_settled(assembly):
            return
        assembly.release()
        if assembly.claim is not None:
            self._exchange.unclaim_slot(assembly.claim)

    def settle_failed_assemblies(self) -> None:
        """Give back per-device saves that failed and never completed (a program that
        ended early); called by `wait()`. Saves still in progress are left alone: a
        program in another thread may be filling them."""
        for assembly in self._assemblies.take_failed():
            self._settle(assembly)

    @_reported
    def end_run(
        self,
        read: Callable[..., tuple[np.ndarray, np.ndarray]],
        signature: Signature,
        *args: Any,
    ) -> None:
        """Runs once per program run and save, after `receive` (its callback reads the
        buffer crossing's token): a step whose data was dropped because this crossing
        handed it over in an earlier run is reported here, once, however many devices
        deposited it. `read`, the crossing's own, gives the steps and the mask from the
        callback's `args`."""
        step, members = read(*args)
        if not members.any():
            return
        try:
            step = _one_step(np.asarray(step), members)
        except CheckpointError:
            return  # receive raised it already and the program failed there
        if not self._exchange.end_run(step, signature):
            self._stats.duplicate()

    def _in_callback(
        self,
        signature: Signature,
        step: ArrayLike,
        wanted: ArrayLike,
        copy_out: Callable[[], HostCopy],
        owner: object,
    ) -> None:
        start = time.perf_counter()
        self._refuse_if_failed()
        members = np.asarray(wanted).astype(bool)
        steps = np.asarray(step)
        step = _one_step(steps, members)  # (a refusal is kept for wait() by `_reported`)
        own, left = _member_steps(steps, members, step)
        self._hand_over(
            signature,
            step,
            members,
            start,
            copy_out,
            in_callback=True,
            owner=owner,
            member_steps=own,
            left=left,
        )

    def eager(self, signature: Signature, step: int, hosts: list[np.ndarray | jax.Array]) -> None:
        """A save made outside any trace: `hosts` are every leaf's value (numpy arrays,
        or jax arrays, read here). Numpy arrays are copied into staging buffers before
        returning, so a caller that mutates them afterwards does not change the save; a
        jax.Array on the CPU is kept as it is (`_immutable_view`), with no copy."""
        start = time.perf_counter()
        self._check_open()
        copy_out = self._staged(hosts)
        self._hand_over(
            signature, step, np.asarray(True), start, copy_out, in_callback=False, owner=None
        )

    def _staged(self, arrays: Sequence[np.ndarray | jax.Array]) -> Callable[[], HostCopy]:
        """A `copy_out` that copies `arrays` into staging buffers, but for those it may keep
        as they are (`_immutable_view`)."""

        def copy_out() -> HostCopy:
            views = [_immutable_view(a) for a in arrays]
            owned = [a for a, v in zip(arrays, views, strict=True) if v is None]
            copies, release = self._pools.staging.copy_in(owned)
            copied = iter(copies)
            return HostCopy([next(copied) if v is None else v for v in views], release)

        return copy_out

    def _refuse_if_failed(self) -> None:
        """Raise (in a callback: fail the running computation, so no hours of training
        go unsaved) when closed or after an error that stops saving."""
        self._check_open()
        self._exchange.refuse_if_failed()

    def _check_open(self) -> None:
        closed = self._exchange.closed
        if closed is not None:
            if closed is Closed.AT_EXIT:
                # Raised in a thread nobody may be listening to (a pool worker still
                # training after interpreter exit began): say it where it is seen.
                _warn.warn(
                    f"jax_cb_ckpt: a save reached the Checkpointer on {self.directory!r} "
                    "after interpreter exit closed it and was not written. Fix: wait for "
                    "your training threads and futures before the main thread returns.",
                    UnflushedSaveWarning,
                )
            raise CheckpointerClosedError(
                f"a save reached the Checkpointer on {self.directory!r}, which "
                f"{closed.value}. Fix: keep the Checkpointer open (e.g. `with "
                "ckpt:`) until the jitted function that saves has finished; a jitted "
                "function traced with an earlier Checkpointer keeps using that one, so "
                "re-create the jitted function (or pass the new Checkpointer in) after "
                "making a new Checkpointer."
            )

    def _hand_over(
        self,
        signature: Signature,
        step: int,
        members: np.ndarray,
        start: float,
        copy_out: Callable[[], HostCopy],
        *,
        in_callback: bool,
        owner: object,
        member_steps: np.ndarray | None = None,
        left: np.ndarray | None = None,
    ) -> None:
        """Hand one save to the exchange, which admits its step, has `copy_out` run (in
        this thread, while the device waits) and queues it (`Exchange.hand_over`)."""
        item = functools.partial(
            self._item,
            signature,
            members,
            copy_out,
            start=start,
            member_steps=member_steps,
            left=left,
        )
        in_flight = self._exchange.hand_over(step, owner, item, in_callback=in_callback)
        if in_flight is not None:
            self._stats.in_flight(in_flight)

    def _item(
        self,
        signature: Signature,
        members: np.ndarray,
        copy_out: Callable[[], HostCopy],
        claim: Claim,
        *,
        start: float | None = None,
        blocking_s: float = 0.0,
        member_steps: np.ndarray | None = None,
        left: np.ndarray | None = None,
    ) -> SaveItem:
        """The item of a claimed save, its leaves in host memory (`copy_out`) as the
        writer takes them (`Signature.assemble`). The device waited `blocking_s`, or
        from `start` until now. `member_steps`: each member's own step, where some
        differ from the save's; `left`: the members that had left their
        `ckpt.while_loop`, where some had. The `extra` item's bytes are made first
        (`Extra.bytes_at`: a function's `ConfigError` fails the save, reported as the
        callback's other failures are)."""
        # The save's extra= first (a function of the step: called here, on the host, as
        # the save fires), so that a refusal leaves nothing copied to give back.
        extra = None if signature.extra is None else signature.extra.bytes_at(claim.step)
        copying = time.perf_counter()
        crossed, release, ready = copy_out()
        hosts = signature.assemble(crossed, members.shape)
        nbytes = sum(h.nbytes for h in hosts)
        saved_at = time.time()
        end = time.perf_counter()
        if start is not None:
            blocking_s = end - start
        self._stats.handed_off(blocking_s)
        return SaveItem(
            claim,
            signature,
            hosts,
            members,
            saved_at,
            nbytes,
            blocking_s,
            end - copying,
            release,
            ready,
            member_steps,
            left,
            extra,
        )


def _immutable_view(array: np.ndarray | jax.Array) -> np.ndarray | None:
    """A jax.Array on one CPU device as numpy without a copy (its own buffer), or None
    for anything else. A save may keep such a view instead of a copy: nothing writes a
    buffer an array holds, and while a view of it lives JAX neither frees it (`delete()`
    leaves the memory to the view) nor reuses it for a jit given it donated (jax 0.10
    copies and keeps the array, 0.12 marks it deleted and writes elsewhere:
    tests/test_values.py checks both on every JAX we test). The
    256 MiB eager save spends ~20 ms less (one copy at the memory's speed)."""
    if not isinstance(array, jax.Array) or isinstance(array, Tracer):
        return None
    devices = array.sharding.device_set
    if len(devices) != 1 or next(iter(devices)).platform != "cpu":
        return None
    view = np.asarray(array)
    return view if view.ctypes.data == array.unsafe_buffer_pointer() else None


def _one_step(steps: np.ndarray, members: np.ndarray) -> int:
    """The checkpoint's step. Under vmap each member may carry its own step (e.g.
    TrainState.step); the members that save must agree on it."""
    if steps.ndim == 0:
        return _non_negative(int(steps))
    if steps.ndim < members.ndim:  # vmap inside pmap: the gathered mask has a device axis
        steps = steps.reshape(steps.shape + (1,) * (members.ndim - steps.ndim))
    steps = np.broadcast_to(steps, np.broadcast_shapes(steps.shape, members.shape))
    saving = np.unique(steps[np.broadcast_to(members, steps.shape)])
    if saving.size != 1:
        raise InvalidStateError(
            f"maybe_save under vmap: the members that save at once have different "
            f"steps {saving.tolist()[:8]}; one checkpoint holds one step. Fix: pass a "
            "step that is the same for every member (e.g. the scan index). In a vmapped "
            "lax.while_loop (or a fori_loop with traced bounds) whose members stop at "
            "different iterations, a member that is done still runs the body and asks "
            "its frozen step again: loop with ckpt.while_loop / ckpt.fori_loop, whose "
            "saves are only those of the members still in the loop."
        )
    return _non_negative(int(saving[0]))


def _member_steps(
    steps: np.ndarray, members: np.ndarray, step: int
) -> tuple[np.ndarray | None, np.ndarray | None]:
    """(each member's own step, which members had left their loop) under vmap, in the
    batch's shape. Own steps: a batched step, where a member whose predicate does not
    hold may be elsewhere (a finished member of a vmapped while_loop, whose body still
    runs); None when every member is at `step`. Left: in a `ckpt.while_loop`, a member
    that had left it crosses its step as `-1 - step` (`_traced.only_live`); None when
    none had."""
    if steps.ndim == 0 or steps.ndim < members.ndim or steps.shape != members.shape:
        return None, None
    steps = steps.astype(np.int64)
    gone = steps < 0
    left = gone if bool(gone.any()) else None
    steps = np.where(gone, -1 - steps, steps)
    return (None if bool(np.all(steps == step)) else steps), left


def _non_negative(step: int) -> int:
    if step < 0:
        raise InvalidStateError(
            f"maybe_save/save: step {step} is negative; checkpoint steps are integers "
            ">= 0 (they name the step directories). Fix: pass the loop counter, e.g. the "
            "scan index or TrainState.step."
        )
    return step
