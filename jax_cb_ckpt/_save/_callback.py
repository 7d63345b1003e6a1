"""The debug-callback crossing: the fallback where the buffer crossing is not built.

Traced half: `jax.debug.callback` with the leaves, which JAX first copies by value into
fresh memory (and, on jax 0.10.2, waits for while other devices sit in a collective:
multi-device programs abort). Its effect is kept under jit, scan, grad and remat. Why
not `io_callback`: it refuses JVP and remat, and under `grad` of a `lax.scan` with
stop-gradient inputs it is silently dropped. Why not `pure_callback`: it has no effect,
so dead-code elimination removes it.

Host half: the callback hands over `jax.Array`s that JAX copied from XLA's buffers
(`jax.device_put` to the CPU device) into fresh memory it owns;
`probe_callback_arrays()` checks once per process that they do not alias XLA's memory,
so they are kept without a second copy (else copied into staging). Reading them waits
for that copy, which may still be running: JAX's copy into fresh memory (~2 GB/s here)
is what made this path slow.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING

import jax
import numpy as np

from . import _cuda
from ._crossing import Arrival, Blocks, Crossing, Host, HostCopy, Pools, noop

if TYPE_CHECKING:
    from .._handoff._shards import Layout
    from .._layout._spec import Signature

_OWNED: bool | None = None  # set by probe_callback_arrays(); None: not probed, so copy


def probe_callback_arrays() -> bool:
    """Whether the arrays a JAX callback receives are JAX-owned copies (see module doc).

    Runs once per process, in the user's thread (never inside a callback): a tiny jitted
    callback, made the way the library makes its crossings, receives a parameter buffer,
    and we check that the array the callback sees does not alias it. If it did, holding
    on to callback arguments would mean holding on to XLA's memory, and the library
    copies into staging buffers instead.
    """
    global _OWNED
    _cuda.gpu_present()  # (cached: asked here, never first inside a callback)
    if _OWNED is None:
        seen: list[int] = []

        def probe(x: jax.Array) -> None:
            seen.append(x.unsafe_buffer_pointer())

        with jax.ensure_compile_time_eval():
            cpu = jax.local_devices(backend="cpu")[0]
            param = jax.device_put(np.arange(1024, dtype=np.float32), cpu)
            jax.jit(lambda x: jax.debug.callback(probe, x))(param)
            jax.effects_barrier()
        _OWNED = bool(seen) and seen[0] != param.unsafe_buffer_pointer()
    return bool(_OWNED)


@dataclasses.dataclass(frozen=True)
class DebugCallback:
    """The `jax.debug.callback` crossing (see module doc). `blocks_by`: the crossing a
    per-device save takes instead (`_route.chosen_crossing`: the buffer crossing on a
    CPU, where with this one each device's callback waits for JAX's copy while the
    others are blocked in theirs, and jax 0.10.2 hangs; measured: a 16 MiB leaf on 4
    devices); None: this one."""

    blocks_by: Crossing | None = None

    def emit(
        self,
        host: Host,
        signature: Signature,
        step: jax.Array,
        wanted: jax.Array,
        payload: list[jax.Array],
    ) -> None:
        callback = functools.partial(host.receive, self.receive, signature)
        jax.debug.callback(callback, step, wanted, *payload)

    def emit_blocks(
        self,
        host: Host,
        signature: Signature,
        layout: Layout,
        step: jax.Array,
        mask: jax.Array,
        coords: jax.Array,
        blocks: list[jax.Array],
    ) -> None:
        read = self.receive_blocks
        deposit = functools.partial(host.receive_blocks, read, signature, layout)
        jax.debug.callback(deposit, step, mask, coords, *blocks)

    def per_device(self) -> Crossing:
        return self if self.blocks_by is None else self.blocks_by

    def receive(
        self,
        pools: Pools,
        signature: Signature,
        step: jax.Array,
        wanted: jax.Array,
        *arrays: jax.Array,
    ) -> Arrival:
        """`arrays` are the leaves that crossed through JAX, as JAX's own copies."""
        del signature

        def copy_out() -> HostCopy:
            if _OWNED:
                # np.asarray waits until JAX's copy of the argument is complete (it may
                # still be in flight), so what we keep is a finished, owned snapshot.
                return HostCopy([np.asarray(a) for a in arrays], noop)
            return HostCopy(*pools.staging.copy_in(arrays))

        return Arrival(step, wanted, copy_out, owner=None)

    def receive_blocks(
        self,
        pools: Pools,
        step: jax.Array,
        wanted: jax.Array,
        coords: jax.Array,
        *blocks: jax.Array,
    ) -> Blocks:
        del pools
        return Blocks(step, wanted, coords, [np.asarray(b) for b in blocks], noop)
