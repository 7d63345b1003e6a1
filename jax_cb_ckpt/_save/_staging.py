"""Host buffers reused across saves: what the hand-off copies into.

One pool per kind of memory (touched, 64-byte aligned host memory on a CPU; page-locked
memory for copies from a GPU, `_cuda.py`); the pool only differs in how it allocates.
"""

from __future__ import annotations

import collections
import functools
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from .._base._aligned import empty_aligned

if TYPE_CHECKING:
    from numpy.typing import ArrayLike

# (shape, dtype) per buffer. The dtype itself, not its `.str`: every float8 type's str
# is "<f1", and a buffer of one must never be reused for another (copyto would cast).
BufferLayout = tuple[tuple[tuple[int, ...], np.dtype], ...]


class StagingPool:
    """Host buffers reused across saves of the same layout (already touched memory).

    A set of buffers is taken for one save and given back by the writer once the save
    is on disk. At most `keep` free sets per layout and `layouts` layouts are cached.
    """

    def __init__(
        self,
        keep: int,
        layouts: int = 2,
        allocate: Callable[[tuple[int, ...], np.dtype], np.ndarray] = empty_aligned,
    ) -> None:
        self._keep = keep
        self._layouts = layouts
        self._allocate = allocate
        self._lock = threading.Lock()
        self._free: collections.OrderedDict[BufferLayout, list[list[np.ndarray]]] = (
            collections.OrderedDict()
        )

    def take(self, layout: BufferLayout) -> tuple[list[np.ndarray], Callable[[], None]]:
        """A set of buffers of `layout` (reused or new) and the call that gives it back."""
        with self._lock:
            free = self._free.get(layout)
            buffers = free.pop() if free else None
        if buffers is None:
            buffers = [self._allocate(shape, dtype) for shape, dtype in layout]
        return buffers, functools.partial(self._give_back, layout, buffers)

    def copy_in(self, arrays: Sequence[ArrayLike]) -> tuple[list[np.ndarray], Callable[[], None]]:
        """Copies of `arrays` in buffers of the pool, and the call that gives them back."""
        hosts = [np.asarray(a) for a in arrays]
        buffers, release = self.take(tuple((h.shape, h.dtype) for h in hosts))
        for buf, host in zip(buffers, hosts, strict=True):
            np.copyto(buf, host)
        return buffers, release

    def _give_back(self, layout: BufferLayout, buffers: list[np.ndarray]) -> None:
        with self._lock:
            free = self._free.setdefault(layout, [])
            self._free.move_to_end(layout)
            if len(free) < self._keep:
                free.append(buffers)
            while len(self._free) > self._layouts:
                self._free.popitem(last=False)
