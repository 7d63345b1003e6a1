"""`_save/_cuda.py`: the GPU copies. Without a GPU: `gpu_present` is False, so no buffer
is a device buffer and nothing asks the buffer (no ~60 us exception per leaf); without
a CUDA runtime, asking for it is a `SaveError` that says how to fix it; the pinned pool
is a `StagingPool` with its own allocator. With a GPU (skipped here otherwise): pinned
allocation, and `copy_async` / `read_now` copy device buffers bit for bit."""

import jax
import numpy as np
import pytest

from jax_cb_ckpt import SaveError
from jax_cb_ckpt._save import _cuda
from jax_cb_ckpt._save._staging import StagingPool


def _has_gpu():
    try:
        return bool(jax.devices("gpu"))
    except RuntimeError:
        return False


needs_gpu = pytest.mark.skipif(not _has_gpu(), reason="needs a CUDA GPU (pinned memory, copies)")
cpu_only = pytest.mark.skipif(_has_gpu(), reason="checks the behaviour without a GPU")


@cpu_only
def test_no_gpu_means_no_device_buffers_and_the_buffer_is_never_asked():
    assert _cuda.gpu_present() is False

    asked = []

    class Asked:
        @property
        def __cuda_array_interface__(self):
            asked.append(1)
            return {}

    assert _cuda.is_device_buffer(Asked()) is False
    assert asked == []
    assert _cuda.is_device_buffer(np.zeros(2)) is False


def test_loaded_finds_only_libraries_of_the_prefix():
    found = _cuda._loaded("libc.so")
    assert found and all(p.split("/")[-1].startswith("libc.so") for p in found)
    assert _cuda._loaded("libno-such-library-here") == []


def _runtime_or_none():
    try:
        return _cuda.runtime()
    except SaveError as e:
        assert "needs the CUDA runtime" in str(e) and "crossing='callback'" in str(e)
        return None


def test_the_runtime_is_loaded_once_or_refused_saying_how_to_fix_it():
    lib = _runtime_or_none()
    if lib is None:
        with pytest.raises(SaveError, match=r"needs the CUDA runtime.*crossing='callback'"):
            _cuda.runtime()
    else:
        assert _cuda.runtime() is lib
        assert hasattr(lib, "cudaMemcpyAsync") and hasattr(lib, "cudaEventSynchronize")


def test_a_cuda_error_code_is_a_save_error_with_cudas_message():
    if _runtime_or_none() is None:
        pytest.skip("no CUDA runtime (libcudart) here")
    _cuda._check(0, "cudaNothing")  # success: no error
    with pytest.raises(SaveError, match=r"^CUDA cudaMemcpyAsync failed: .+ \(error 1\)\.$"):
        _cuda._check(1, "cudaMemcpyAsync")


def test_the_pinned_pool_is_a_staging_pool_with_the_pinned_allocator():
    pool = _cuda.pinned_pool(3)
    assert isinstance(pool, StagingPool)
    assert pool._allocate is _cuda._allocate_pinned
    assert pool._keep == 3 and pool._layouts == 64


@needs_gpu
def test_pinned_allocation_has_the_shape_and_dtype():
    for shape, dtype in [((3, 5), np.float32), ((0,), np.int8), ((), np.uint16)]:
        array = _cuda._allocate_pinned(shape, dtype)
        assert array.shape == shape and array.dtype == dtype
        array[...] = 1


@needs_gpu
def test_read_now_copies_device_buffers():
    x = jax.device_put(np.arange(12, dtype=np.float32).reshape(3, 4), jax.devices("gpu")[0])
    (host,) = _cuda.read_now([x], 0)
    np.testing.assert_array_equal(host, np.asarray(x))
