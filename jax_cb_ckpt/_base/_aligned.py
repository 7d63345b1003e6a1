"""Host memory whose data starts on a cache line: the staging buffers a save copies
into (`_save/_staging.py`, also what XLA needs to alias host memory) and the arrays a
read allocates (`_read/_arrays.py`, which `jax.device_put` adopts on a CPU without a
copy). Numpy only; allocates, never blocks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from numpy.typing import DTypeLike

ALIGNMENT = 64  # staging starts on a cache line (also what XLA needs to alias host memory)


def empty_aligned(shape: tuple[int, ...], dtype: DTypeLike) -> np.ndarray:
    """An uninitialised array whose data starts on an ALIGNMENT-byte boundary."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(max(nbytes, 1) + ALIGNMENT, np.uint8)
    start = -raw.ctypes.data % ALIGNMENT
    # (an empty slice keeps its base's pointer: a zero-size array is cut from one byte)
    return raw[start : start + max(nbytes, 1)][:nbytes].view(dtype).reshape(shape)
