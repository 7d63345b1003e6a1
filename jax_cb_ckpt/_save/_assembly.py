"""The host side of a per-device save (`shardings=`; see `_handoff/_shards.py`): the
blocks of one step arriving from the devices of a mesh, each in its own callback, until
the last one completes the step.

Every device's call copies the blocks it owns (one replica of each block: the device
whose coordinates are 0 along the mesh axes the leaf is not split over) into staging
memory and adds them to the step's `Assembly`. The first device to report decides for
all; the device that completes the assembly (every device of the mesh has reported)
queues one save. Thread-safe: the devices' callbacks run at once.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from .._handoff._items import Claim

if TYPE_CHECKING:
    from .._handoff._shards import BlockKey


class Assembly:
    """The blocks of one step arriving from the devices of a mesh.

    The first device to report decides for every device (`Assemblies.join`): whether
    the step is saved and, if it is, the save holds one of the exchange's slots from
    then until the writer is done with it. The other devices wait for that decision
    before they copy anything, so devices that run ahead of the others (an update with
    no collective keeps nothing in step) wait with the first one: staging memory is
    held by at most `queue_size` steps, plus the one being decided.
    """

    def __init__(self, devices: int, leaves: int) -> None:
        self.expected = devices
        self.seen: set[tuple[int, ...]] = set()
        self.lock = threading.Lock()
        self.blocks: list[dict[BlockKey, np.ndarray]] = [{} for _ in range(leaves)]
        self._reserved: list[set[BlockKey]] = [set() for _ in range(leaves)]
        self.releases: list[Callable[[], None]] = []
        self.blocking_s = 0.0  # the longest any device waited in its own call
        self.claim: Claim | None = None  # the first device's decision: None saves nothing
        self.failed = False  # a device's report raised, or the run ended without it
        self.settled = False  # given back (buffers, slot) without being saved
        self._decided = threading.Event()

    def decide(self, claim: Claim | None) -> None:
        self.claim = claim
        self._decided.set()

    def wait_decided(self) -> None:
        self._decided.wait()

    @property
    def saving(self) -> bool:
        return self.claim is not None and not self.failed

    def add(
        self, blocks: Sequence[tuple[int, BlockKey, np.ndarray]], release: Callable[[], None]
    ) -> None:
        """One device's copies: (leaf, block key, copy) each, and how to give them back."""
        with self.lock:
            self.releases.append(release)
            for leaf, key, copy in blocks:
                self.blocks[leaf][key] = copy

    def reserve(self, leaf: int, key: BlockKey) -> bool:
        """Claim the copy of a block (several processes: each keeps one replica of a
        replicated block); False when another device of this process has claimed it.
        Devices report at once, so without this each would copy the block."""
        with self.lock:
            if key in self._reserved[leaf]:
                return False
            self._reserved[leaf].add(key)
            return True

    def release(self) -> None:
        with self.lock:
            releases, self.releases = self.releases, []
        for release in releases:
            release()


class Assemblies:
    """The steps being assembled, keyed by (crossing, step); thread-safe.

    An assembly is removed when every device has reported, never earlier: a `wait()`
    in another thread may run while a program is still saving, and what that program
    fills must stay where it is. One that failed and will never complete (its run
    ended early) is given back by `take_failed`, but stays open, so that late reports
    of it are still recognised and dropped.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: dict[tuple[object, int], Assembly] = {}

    def join(
        self, key: tuple[object, int], devices: int, leaves: int, coords: tuple[int, ...]
    ) -> tuple[Assembly, bool, Assembly | None]:
        """One device's report of `key`: (its assembly, whether this device is the first
        and must `decide`, an assembly left from an earlier run to settle, or None)."""
        stale = None
        with self._lock:
            assembly = self._open.get(key)
            if assembly is not None and coords in assembly.seen:
                # This device reported the step already: the open assembly is left from
                # a run that ended before every device reported (the buffer crossing is
                # never recomputed). Drop it; a new run's blocks never mix with it.
                assembly.failed = True
                stale, assembly = assembly, None
            first = assembly is None
            if assembly is None:
                assembly = self._open[key] = Assembly(devices, leaves)
            assembly.seen.add(coords)
        return assembly, first, stale

    def finish(self, key: tuple[object, int], assembly: Assembly, blocking_s: float) -> bool:
        """A device's report is over; True for the one that completed the assembly
        (it is no longer open then)."""
        with self._lock:
            assembly.blocking_s = max(assembly.blocking_s, blocking_s)
            assembly.expected -= 1
            if assembly.expected:
                return False
            if self._open.get(key) is assembly:
                del self._open[key]
            return True

    def take_settled(self, assembly: Assembly) -> bool:
        """True once per assembly: the caller gives back what it holds (not saved)."""
        with self._lock:
            if assembly.settled:
                return False
            assembly.settled = True
            return True

    def take_failed(self) -> list[Assembly]:
        """Failed assemblies still open, to be given back (each returned once)."""
        with self._lock:
            failed = [a for a in self._open.values() if a.failed and not a.settled]
            for assembly in failed:
                assembly.settled = True
            return failed
