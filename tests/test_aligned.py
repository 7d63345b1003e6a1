"""`_base/_aligned.py`: `empty_aligned` returns an array of the asked shape and dtype
whose data starts on a 64-byte boundary, for any shape and dtype, that owns no more
than it needs and is writable. Zero-size arrays are not aligned today (numpy keeps an
empty slice's pointer at the slice's base): an expected failure, reported."""

import ml_dtypes
import numpy as np
import pytest

from jax_cb_ckpt._base._aligned import ALIGNMENT, empty_aligned

SHAPES = [(), (1,), (3,), (7, 5), (13, 1, 3), (1000,), (2, 3, 5, 7)]
ZERO_SIZE = [(0,), (0, 3), (2, 0, 4)]
DTYPES = [
    np.bool_,
    np.int8,
    np.uint16,
    np.float16,
    np.int32,
    np.float32,
    np.float64,
    np.complex128,
    ml_dtypes.bfloat16,
    ml_dtypes.float8_e4m3fn,
    ml_dtypes.int4,
]


def test_alignment_is_a_cache_line():
    assert ALIGNMENT == 64


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_every_shape_and_dtype_starts_on_the_boundary(shape, dtype):
    for _ in range(3):  # several allocations: not aligned by luck of the allocator
        array = empty_aligned(shape, dtype)
        assert array.shape == shape
        assert array.dtype == np.dtype(dtype)
        assert array.ctypes.data % ALIGNMENT == 0
        assert array.flags.c_contiguous and array.flags.writeable
        assert array.nbytes == int(np.prod(shape)) * np.dtype(dtype).itemsize


def test_the_array_holds_what_is_written_into_it():
    array = empty_aligned((5, 3), np.float32)
    array[...] = np.arange(15, dtype=np.float32).reshape(5, 3)
    np.testing.assert_array_equal(array, np.arange(15, dtype=np.float32).reshape(5, 3))


def test_its_buffer_is_at_most_one_alignment_larger():
    array = empty_aligned((100,), np.float64)
    assert array.base is not None
    owner = array
    while owner.base is not None:
        owner = owner.base
    assert owner.nbytes <= array.nbytes + ALIGNMENT


@pytest.mark.parametrize("dtype", [np.int8, np.float32], ids=lambda d: np.dtype(d).name)
def test_zero_size_arrays_start_on_the_boundary(dtype):
    arrays = [empty_aligned(shape, dtype) for shape in ZERO_SIZE for _ in range(20)]
    assert all(a.size == 0 for a in arrays)
    assert [a.ctypes.data % ALIGNMENT for a in arrays] == [0] * len(arrays)
