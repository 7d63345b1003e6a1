"""`_save/_staging.py`: `StagingPool` gives a set of buffers per layout, reuses a set given
back for the same layout (same shapes and dtypes), never across dtypes that share a
`.str` (the float8 types are all "<f1"), keeps at most `keep` free sets per layout and
`layouts` layouts (the oldest dropped), allocates with the allocator it is given, and
`copy_in` copies exactly."""

import threading

import ml_dtypes
import numpy as np
import pytest

from jax_cb_ckpt._base._aligned import ALIGNMENT
from jax_cb_ckpt._save._staging import StagingPool

F32 = (((3,), np.dtype(np.float32)), ((2, 2), np.dtype(np.int32)))


def _counting():
    made = []

    def allocate(shape, dtype):
        made.append((shape, dtype))
        return np.empty(shape, dtype)

    return allocate, made


def test_a_set_given_back_is_reused_for_the_same_layout():
    allocate, made = _counting()
    pool = StagingPool(keep=2, allocate=allocate)
    first, release = pool.take(F32)
    assert [(b.shape, b.dtype) for b in first] == list(F32)
    assert len(made) == 2
    release()
    second, release2 = pool.take(F32)
    assert all(a is b for a, b in zip(first, second, strict=True))
    assert len(made) == 2
    third, _ = pool.take(F32)  # the one free set is taken: a new one
    assert not any(a is b for a, b in zip(second, third, strict=True))
    assert len(made) == 4


@pytest.mark.parametrize(
    "one, other",
    [
        (ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2fnuz),
        (ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e4m3),
        (ml_dtypes.int4, ml_dtypes.float8_e4m3fn),
    ],
)
def test_types_with_the_same_str_never_share_buffers(one, other):
    first = (((4,), np.dtype(one)),)
    second = (((4,), np.dtype(other)),)
    assert first[0][1].str == second[0][1].str
    pool = StagingPool(keep=2)
    buffers, release = pool.take(first)
    release()
    got, _ = pool.take(second)
    assert got[0] is not buffers[0]
    assert got[0].dtype == np.dtype(other)


def test_free_sets_per_layout_are_capped_at_keep():
    allocate, made = _counting()
    pool = StagingPool(keep=1, allocate=allocate)
    (a, ra), (_, rb) = pool.take(F32), pool.take(F32)
    ra()
    rb()  # the second free set is over `keep`: dropped
    first, _ = pool.take(F32)
    assert first[0] is a[0]
    made.clear()
    pool.take(F32)
    assert len(made) == 2


def test_the_oldest_layout_is_dropped_past_layouts():
    pool = StagingPool(keep=2, layouts=2)
    sets = {}
    for n in (1, 2, 3):
        layout = (((n,), np.dtype(np.float32)),)
        buffers, release = pool.take(layout)
        release()
        sets[n] = (layout, buffers)
    for n, reused in ((3, True), (2, True), (1, False)):
        layout, buffers = sets[n]
        again, _ = pool.take(layout)
        assert (again[0] is buffers[0]) is reused, n


def test_copy_in_copies_exactly_into_aligned_buffers():
    pool = StagingPool(keep=1)
    arrays = [
        np.arange(6, dtype=np.float32).reshape(2, 3),
        np.array([1, 2], ml_dtypes.bfloat16),
        np.int64(7),
    ]
    copies, release = pool.copy_in(arrays)
    for copy, array in zip(copies, arrays, strict=True):
        assert copy is not array and copy.dtype == array.dtype
        assert copy.tobytes() == np.asarray(array).tobytes()
        assert copy.ctypes.data % ALIGNMENT == 0 or copy.nbytes == 0
    arrays[0][0, 0] = 99  # the copy is the pool's, not a view of the source
    assert copies[0][0, 0] == 0
    release()
    again, _ = pool.copy_in([np.ones((2, 3), np.float32), np.zeros(2, ml_dtypes.bfloat16), 1])
    assert again[0] is copies[0]
    np.testing.assert_array_equal(again[0], np.ones((2, 3)))


def test_take_and_give_back_from_many_threads():
    pool = StagingPool(keep=4)
    errors = []

    def work():
        try:
            for _ in range(200):
                buffers, release = pool.take(F32)
                buffers[0][...] = 1
                release()
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert len(pool._free[F32]) <= 4
