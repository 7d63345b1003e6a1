"""The buffer crossing on a CPU: XLA's own buffers, copied once by the host.

Traced half: a *pure* `jax.experimental.buffer_callback` gets XLA's own buffers
(zero-copy views, valid during the call). Being pure, it would be removed as dead code;
its one-element token is read by a `jax.debug.callback`, an effect that JAX keeps under
jit, scan, grad (partial evaluation keeps debug effects on primals) and remat, so the
buffer callback stays too. `has_side_effect=True` instead is dropped under `grad`,
refused under remat and by the GSPMD partitioner. The debug callback of a gathered save
also reports the end of the run (`HostSide.end_run`): a step this crossing handed over
in an earlier run is said once, however many devices deposited it.

Host half: each buffer copied once into a reused, already touched staging buffer
(`StagingPool`) while the device program waits. Leaves of a dtype the crossing cannot
hand over on every backend cross as another one (`widen`) and are turned back here
(`as_saved_dtypes`). The CUDA crossing (_cuda.py) has the same traced half.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.buffer_callback import buffer_callback

from .._base._dtypes import PACKED_AS, packed
from ._crossing import Arrival, Blocks, Crossing, Host, HostCopy, Pools, noop

if TYPE_CHECKING:
    from .._handoff._shards import Layout
    from .._layout._spec import Signature

_TOKEN = jax.ShapeDtypeStruct((), jnp.int32)


class CpuBuffer:
    """The buffer crossing, reading XLA's buffers from numpy (see module doc)."""

    def emit(
        self,
        host: Host,
        signature: Signature,
        step: jax.Array,
        wanted: jax.Array,
        payload: list[jax.Array],
    ) -> None:
        # The data goes through a pure buffer_callback (XLA's buffers, copied once by
        # the host side); its token feeds a debug.callback, whose effect keeps both
        # alive in a program that uses neither result.
        widened, crossing = widen(payload)
        deposit = functools.partial(host.receive, self.receive, signature, widened)
        token = buffer_callback(deposit, _TOKEN)(step, wanted, *crossing)
        shapes = (jnp.shape(step), jnp.shape(wanted))
        ended = functools.partial(host.end_run, self.ended, signature, shapes)
        jax.debug.callback(ended, _packed(token, step, wanted))

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
        widened, crossing = widen(blocks)
        read = self.receive_blocks
        deposit = functools.partial(host.receive_blocks, read, signature, layout, widened)
        token = buffer_callback(deposit, _TOKEN)(step, mask, coords, *crossing)
        jax.debug.callback(_keep_alive, token)

    def per_device(self) -> Crossing:
        return self

    def receive(
        self,
        pools: Pools,
        signature: Signature,
        widened: dict[int, np.dtype],
        ctx: Any,
        out: Any,
        step: Any,
        wanted: Any,
        *buffers: Any,
    ) -> Arrival:
        """`buffers` are XLA's own buffers, valid only during this call: each is copied
        once, by `copy_out`, into a staging buffer the library reuses. `out` is the
        crossing's one-element token. (`ctx`, `out` and the buffers are XLA's objects,
        left untyped: jaxlib has no types to name them by; see _cuda.py.)"""
        del ctx
        np.asarray(out)[...] = 0
        arrays = as_saved_dtypes([np.asarray(b) for b in buffers], widened)

        def copy_out() -> HostCopy:
            return HostCopy(*pools.staging.copy_in(arrays))

        return Arrival(step, wanted, copy_out, owner=signature)

    def receive_blocks(
        self,
        pools: Pools,
        widened: dict[int, np.dtype],
        ctx: Any,
        out: Any,
        step: Any,
        wanted: Any,
        coords: Any,
        *blocks: Any,
    ) -> Blocks:
        del pools, ctx
        np.asarray(out)[...] = 0
        arrays = as_saved_dtypes([np.asarray(b) for b in blocks], widened)
        return Blocks(step, wanted, coords, arrays, noop)

    def ended(
        self, shapes: tuple[tuple[int, ...], tuple[int, ...]], packed: jax.Array
    ) -> tuple[np.ndarray, np.ndarray]:
        """The steps and the mask of a run that ended, from `_packed`'s one operand
        (`shapes`: theirs)."""
        step_shape, wanted_shape = shapes
        flat = np.asarray(packed)[1:]  # [0] is the token
        n = math.prod(step_shape)
        return flat[:n].reshape(step_shape), flat[n:].reshape(wanted_shape).astype(bool)


def _keep_alive(token: jax.Array) -> None:
    """The effect that keeps a per-device crossing (and its token) in the program."""
    del token


def _packed(token: jax.Array, step: jax.Array, wanted: jax.Array) -> jax.Array:
    """`end_run`'s one operand: the token (the dependence that keeps the buffer callback
    alive), then the steps and the mask, flat, in the step's dtype (`CpuBuffer.ended`).
    `debug.callback` puts each operand on a device again before calling (~60-130 us per
    operand on a CPU): one operand instead of three saves ~0.1 ms per crossing."""
    dtype = jnp.result_type(step)
    flat = [token.reshape(1), jnp.ravel(step), jnp.ravel(wanted)]
    return jnp.concatenate([x.astype(dtype) for x in flat])


# The dtypes jaxlib's `Buffer.__cuda_array_interface__` serves (jaxlib/ffi.cc): the GPU
# buffer crossing reads every operand through it (_cuda.py), and refused any other dtype
# (float8_*: the H200 run of 2026-12-04 saved nothing from a jitted save of one).
_SERVED = frozenset(
    ["bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"]
    + ["bfloat16", "float16", "float32", "float64", "complex64", "complex128"]
)
_BITS = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}


def widen(values: Sequence[jax.Array]) -> tuple[dict[int, np.dtype], list[jax.Array]]:
    """Every leaf as a dtype the buffer crossing can hand over on every backend; returns
    `widened`, {index: original dtype} of the leaves that cross as another dtype (for the
    host to turn back, `as_saved_dtypes`), and the values to cross.

    XLA packs sub-byte types (int4: two per byte) and numpy views them one per byte, so
    those cross widened to a byte-per-element dtype that holds their values exactly. Any
    other dtype outside `_SERVED` (float8_*, float6_*) crosses as its bits (an unsigned
    integer of its width, `bitcast_convert_type`: NaN payloads kept), the same on a CPU
    as on a GPU, so the CPU tests cover the GPU's path."""
    widened = {i: np.dtype(v.dtype) for i, v in enumerate(values) if _crosses_as_other(v)}
    crossing = [_as_crossing(v) if i in widened else v for i, v in enumerate(values)]
    return widened, crossing


def _crosses_as_other(value: jax.Array) -> bool:
    return packed(value.dtype) or np.dtype(value.dtype).name not in _SERVED


def _as_crossing(value: jax.Array) -> jax.Array:
    dtype = np.dtype(value.dtype)
    if packed(dtype):
        return value.astype(PACKED_AS.get(dtype.name, np.float32))
    return jax.lax.bitcast_convert_type(value, _BITS[dtype.itemsize])


def as_saved_dtypes(arrays: list[np.ndarray], widened: dict[int, np.dtype]) -> list[np.ndarray]:
    """`arrays` with the leaves that crossed as another dtype (`widen`) turned back into
    their dtype {index: dtype}, exactly: packed sub-byte types cast back from the bytes
    they were widened to, every other one viewed as the bits it crossed as."""
    for index, dtype in widened.items():
        if packed(dtype):
            arrays[index] = arrays[index].astype(dtype)
        else:
            arrays[index] = arrays[index].view(dtype)
    return arrays
