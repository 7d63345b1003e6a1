"""The buffer crossing on a CUDA GPU: device-to-host copies on XLA's own stream.

`jax.experimental.buffer_callback` hands a GPU callback device buffers
(`__cuda_array_interface__`) and XLA's stream (`ctx.stream`). (Those stay untyped here:
jaxlib's `Buffer` and `ExecutionContext` have no stubs, and
`jax.experimental.buffer_callback` exports them as values, not as types.) Instead of
reading them from Python, the host side queues one `cudaMemcpyAsync` per leaf on that
stream, into page-locked (pinned) staging memory the library reuses, records a CUDA
event after them, and returns at once: the device runs the copies in stream order,
before anything that could overwrite the buffers, and the program continues without
waiting for Python. The writer thread waits for the event (`ready()`) before it reads
the staging memory.

`CudaBuffer` is that crossing: the buffer crossing's traced half (_buffer.py), and a
host half that copies this way when the buffers are in GPU memory (the CPU buffer
crossing's, when a program of this process runs on the CPU device). This calls the
CUDA runtime through ctypes (the `libcudart` that JAX's CUDA wheels install), so no
compiled extension is needed. `crossing="auto"` selects it on CUDA GPUs
(`_route.chosen_crossing`): benchmarks/gpu_check.py checked it bit for bit on an H200
(docs/benchmarks.md).
"""

from __future__ import annotations

import ctypes
import functools
import glob
import os
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

if TYPE_CHECKING:
    from numpy.typing import DTypeLike

    from .._layout._spec import Signature

from .._base._dtypes import packed
from .._base._errors import SaveError
from ._buffer import CpuBuffer, as_saved_dtypes
from ._crossing import Arrival, Blocks, HostCopy, Pools
from ._staging import StagingPool

_MEMCPY_DEVICE_TO_HOST = 2
_EVENT_DISABLE_TIMING = 2
_lib: ctypes.CDLL | None = None
_lib_lock = threading.Lock()


def runtime() -> ctypes.CDLL:
    """The CUDA runtime library, loaded once."""
    global _lib
    with _lib_lock:
        if _lib is None:
            names = _loaded("libcudart.so")  # JAX's own copy, when it is loaded
            try:
                import nvidia  # pyright: ignore[reportMissingImports]

                for path in nvidia.__path__:  # cuda_runtime/lib (CUDA 12), cu13/lib (13)
                    names += sorted(glob.glob(os.path.join(path, "*", "lib", "libcudart.so*")))
            except ImportError:
                pass
            names += ["libcudart.so.13", "libcudart.so.12", "libcudart.so"]
            for name in names:
                try:
                    _lib = ctypes.CDLL(name)
                    break
                except OSError:
                    continue
            if _lib is None:
                raise SaveError(
                    "crossing='buffer' on a GPU needs the CUDA runtime (libcudart), which "
                    "was not found. Fix: install JAX's CUDA wheels (jax[cuda12]), or use "
                    "crossing='callback'."
                )
        return _lib


def _loaded(prefix: str) -> list[str]:
    """Paths of already loaded shared libraries whose file name starts with `prefix`."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "/" in line}
    except OSError:
        return []
    return sorted(p for p in paths if os.path.basename(p).startswith(prefix))


def _check(code: int, what: str) -> None:
    if code != 0:
        lib = runtime()
        lib.cudaGetErrorString.restype = ctypes.c_char_p
        message = lib.cudaGetErrorString(code).decode()
        raise SaveError(f"CUDA {what} failed: {message} (error {code}).")


def pinned_pool(keep: int) -> StagingPool:
    """A staging pool of page-locked memory (never freed: it lives as long as the
    process, as the pool's own sets do)."""
    return StagingPool(keep, layouts=64, allocate=_allocate_pinned)


def _allocate_pinned(shape: tuple[int, ...], dtype: DTypeLike) -> np.ndarray:
    dtype = np.dtype(dtype)
    size = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    pointer = ctypes.c_void_p()
    _check(
        runtime().cudaMallocHost(ctypes.byref(pointer), ctypes.c_size_t(max(size, 1))),
        "cudaMallocHost",
    )
    raw = (ctypes.c_uint8 * max(size, 1)).from_address(pointer.value or 0)
    return np.ctypeslib.as_array(raw)[:size].view(dtype).reshape(shape)


def _queue_copies(
    lib: ctypes.CDLL, buffers: Sequence[Any], hosts: Sequence[np.ndarray], stream: ctypes.c_void_p
) -> None:
    """One device-to-host cudaMemcpyAsync per buffer into `hosts`, on `stream`."""
    for buffer, host in zip(buffers, hosts, strict=True):
        if host.nbytes:
            source = buffer.__cuda_array_interface__["data"][0]
            _check(
                lib.cudaMemcpyAsync(
                    ctypes.c_void_p(host.ctypes.data),
                    ctypes.c_void_p(source),
                    ctypes.c_size_t(host.nbytes),
                    ctypes.c_int(_MEMCPY_DEVICE_TO_HOST),
                    stream,
                ),
                "cudaMemcpyAsync",
            )


def copy_async(
    buffers: Sequence[Any], stream: Any, pool: StagingPool
) -> tuple[list[np.ndarray], Callable[[], None], Callable[[], None]]:
    """Queue the copies of `buffers` to pinned memory on `stream`; returns the host
    arrays (valid once `ready()` has returned), `release` and `ready`."""
    lib = runtime()
    layout = tuple((tuple(b.__cuda_array_interface__["shape"]), np.dtype(b.dtype)) for b in buffers)
    hosts, release = pool.take(layout)
    stream_ptr = ctypes.c_void_p(int(stream or 0))
    _queue_copies(lib, buffers, hosts, stream_ptr)
    event = ctypes.c_void_p()
    _check(
        lib.cudaEventCreateWithFlags(ctypes.byref(event), ctypes.c_uint(_EVENT_DISABLE_TIMING)),
        "cudaEventCreateWithFlags",
    )
    _check(lib.cudaEventRecord(event, stream_ptr), "cudaEventRecord")

    def ready() -> None:
        try:
            _check(lib.cudaEventSynchronize(event), "cudaEventSynchronize")
        finally:
            lib.cudaEventDestroy(event)

    return hosts, release, ready


def is_device_buffer(buffer: Any) -> bool:
    """A buffer_callback operand in GPU memory (not readable from numpy). (On a CPU,
    JAX's Buffer raises JaxRuntimeError for the attribute, not AttributeError; raising
    it costs ~60 us, a fifth of a small save's hand-off, so a process without a GPU
    never asks.)"""
    if not gpu_present():
        return False
    try:
        buffer.__cuda_array_interface__  # noqa: B018
    except Exception:
        return False
    return True


@functools.cache
def gpu_present() -> bool:
    """Whether JAX has a GPU backend in this process (all backends start together, so
    by the time a program calls back, the answer is final). First asked by
    `_callback.probe_callback_arrays`, outside any callback, and by
    `_route.chosen_crossing`, while tracing."""
    try:
        return bool(jax.devices("gpu"))
    except RuntimeError:  # no GPU backend
        return False


def read_now(buffers: Sequence[Any], stream: Any) -> list[np.ndarray]:
    """Small device buffers (the step, the mask) copied to host, waiting for the
    stream: the host side needs them to decide what to do with the save."""
    lib = runtime()
    stream_ptr = ctypes.c_void_p(int(stream or 0))
    hosts = [np.empty(tuple(b.shape), np.dtype(b.dtype)) for b in buffers]
    _queue_copies(lib, buffers, hosts, stream_ptr)
    _check(lib.cudaStreamSynchronize(stream_ptr), "cudaStreamSynchronize")
    return hosts


class CudaBuffer(CpuBuffer):
    """The buffer crossing in a process with a GPU (see module doc): the same traced
    half as `CpuBuffer`; the host half copies on XLA's stream what is in GPU memory."""

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
        """The copies to pinned memory are queued on XLA's stream and the writer waits
        for them. The token is left as it is: nobody reads its value."""
        if not is_device_buffer(out):  # (the token: always there, an int32)
            return super().receive(pools, signature, widened, ctx, out, step, wanted, *buffers)
        step, wanted = read_now([step, wanted], ctx.stream)
        pinned = _pinned(pools)

        def copy_out() -> HostCopy:
            hosts, release, ready = copy_async(buffers, ctx.stream, pinned)
            if not any(packed(dtype) for dtype in widened.values()):
                # (leaves that crossed as bits are views: nothing is read before `ready`)
                return HostCopy(as_saved_dtypes(list(hosts), widened), release, ready)
            ready()  # packed dtypes are cast back here, so wait for their copies now
            return HostCopy(as_saved_dtypes(list(hosts), widened), release)

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
        """One device's blocks copied out now (the host copies the ones it writes
        into staging before it returns); the pinned memory is given back after."""
        if not (blocks and is_device_buffer(blocks[0])):
            return super().receive_blocks(pools, widened, ctx, out, step, wanted, coords, *blocks)
        step, wanted, coords = read_now([step, wanted, coords], ctx.stream)
        hosts, release, ready = copy_async(blocks, ctx.stream, _pinned(pools))
        ready()
        return Blocks(step, wanted, coords, as_saved_dtypes(list(hosts), widened), release)


def _pinned(pools: Pools) -> StagingPool:
    if pools.pinned is None:
        pools.pinned = pinned_pool(keep=pools.keep)
    return pools.pinned
