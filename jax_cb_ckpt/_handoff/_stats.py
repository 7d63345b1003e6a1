"""Counters of a Checkpointer: what was saved, dropped and how long each part took."""

from __future__ import annotations

import collections
import dataclasses
import statistics
import threading
import time

_RECENT = 1024  # per-save records kept for medians; totals cover every save


@dataclasses.dataclass(frozen=True)
class SaveRecord:
    """Timing of one save that reached the disk."""

    step: int
    nbytes: int
    blocking_s: float  # time the device waited in the library's callback, queue wait included
    handoff_s: float  # the part of blocking_s spent taking the data (queue wait excluded)
    write_s: float  # time the writer thread spent writing this save (fsync, commit)
    checksum_s: float = 0.0  # the part of write_s spent computing checksums
    retention_s: float = 0.0  # the part of write_s spent deciding and unlisting old steps
    # Incremental saves (`incremental=True`): the array bytes this process wrote, the
    # rest of `nbytes` linked from the step before (None: not an incremental Checkpointer).
    written_bytes: int | None = None


@dataclasses.dataclass(frozen=True, repr=False)
class Stats:
    """A snapshot of a Checkpointer's counters (`ckpt.stats`).

    Attributes:
        saves: checkpoints written to disk.
        skipped: saves dropped because the queue was full (`on_full="skip"`).
        superseded: saves dropped, before being written, for a newer one that found the
            queue full (`on_full="newest"`).
        duplicates: saves dropped because their step was already handed over or
            already on disk.
        failed: saves the writer could not write (the first error is re-raised).
        crossings: times a device program handed data to the host (one per saving
            step, whatever the batch; the rest of the steps cross nothing).
        bytes: bytes of array data saved (the states' sizes; what incremental saves
            wrote of them is each record's `written_bytes`).
        blocking_total_s / blocking_max_s: time the device waited inside the library's
            hand-off (copying into host buffers plus any back-pressure wait), summed and
            worst. JAX's own transfer of the arguments to the callback comes before it.
        write_total_s / write_max_s: time the writer thread spent writing.
        queue_high_water: the most saves in flight (queued or being written) at once.
        queue_waits: saves for which the device waited for a free place in the queue
            (`on_full="block"` with the queue full; with `on_full="newest"` only when every
            save in flight was already being written, never in a plain save loop).
        last_saved_step: the step of the last save that reached disk (None before).
        recent: the last 1024 saves that reached disk, oldest first.

    Reading `ckpt.stats` is thread-safe and cheap (a copy taken under a lock): another
    thread may poll it while a jitted run trains, e.g. to log `last_saved_step`.
    `print(ckpt.stats)` shows one line (`summary()`); the records are in `recent`.
    """

    saves: int = 0
    skipped: int = 0
    superseded: int = 0
    duplicates: int = 0
    failed: int = 0
    crossings: int = 0
    bytes: int = 0
    blocking_total_s: float = 0.0
    blocking_max_s: float = 0.0
    write_total_s: float = 0.0
    write_max_s: float = 0.0
    queue_high_water: int = 0
    queue_waits: int = 0
    last_saved_step: int | None = None
    recent: tuple[SaveRecord, ...] = ()

    @property
    def blocking_per_save_s(self) -> float:
        """Median device-blocking time per save over `recent` (0 when none)."""
        return _median([r.blocking_s for r in self.recent])

    @property
    def handoff_per_save_s(self) -> float:
        """Median hand-off time per save (blocking minus back-pressure wait) over `recent`."""
        return _median([r.handoff_s for r in self.recent])

    @property
    def write_per_save_s(self) -> float:
        """Median writer time per save over `recent` (0 when none)."""
        return _median([r.write_s for r in self.recent])

    def summary(self) -> str:
        """One line for logs and the demo: per save (medians), how long the device
        waited (its copy; the rest of the hand-off, and any wait for a free place in the
        queue: `queue_waits` counts those), and how long the writer thread took in the
        background."""
        wait = self.blocking_per_save_s
        copy = self.handoff_per_save_s
        return (
            f"saves={self.saves} skipped={self.skipped} superseded={self.superseded} "
            f"duplicates={self.duplicates} failed={self.failed} bytes={self.bytes}; per "
            f"save: device waited {wait * 1e3:.3f} ms (copy {copy * 1e3:.3f} ms, hand-off and "
            f"queue {max(0.0, wait - copy) * 1e3:.3f} ms), written in the background in "
            f"{self.write_per_save_s * 1e3:.1f} ms; queue_high_water={self.queue_high_water} "
            f"queue_waits={self.queue_waits}"
        )

    def __repr__(self) -> str:
        last = "none" if self.last_saved_step is None else self.last_saved_step
        return (
            f"Stats({self.summary()}; last_saved_step={last}; {len(self.recent)} "
            "records in .recent)"
        )


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else 0.0


@dataclasses.dataclass
class _Counts:
    """The running totals (a typo in a field name fails in pyright, not at run time)."""

    saves: int = 0
    skipped: int = 0
    superseded: int = 0
    duplicates: int = 0
    failed: int = 0
    crossings: int = 0
    bytes: int = 0
    blocking_total_s: float = 0.0
    blocking_max_s: float = 0.0
    write_total_s: float = 0.0
    write_max_s: float = 0.0
    queue_high_water: int = 0
    queue_waits: int = 0
    last_saved_step: int | None = None


class StatsRecorder:
    """Thread-safe counters, updated by the callback side and the writer thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = _Counts()
        self._recent: collections.deque[SaveRecord] = collections.deque(maxlen=_RECENT)
        # time.monotonic() of the last hand-off (a save's start), or of the opening:
        # `every_seconds` counts from it (`_user/_clock.SaveClock`).
        self.last_handoff = time.monotonic()

    def crossed(self) -> None:
        with self._lock:
            self._counts.crossings += 1

    def duplicate(self) -> None:
        with self._lock:
            self._counts.duplicates += 1

    def skipped(self) -> None:
        with self._lock:
            self._counts.skipped += 1

    def superseded(self) -> None:
        with self._lock:
            self._counts.superseded += 1

    def queue_wait(self) -> None:
        with self._lock:
            self._counts.queue_waits += 1

    def failed(self) -> None:
        with self._lock:
            self._counts.failed += 1

    def in_flight(self, n: int) -> None:
        with self._lock:
            self._counts.queue_high_water = max(self._counts.queue_high_water, n)

    def handed_off(self, blocking_s: float) -> None:
        self.last_handoff = time.monotonic()  # (one float: read without the lock)
        with self._lock:
            self._counts.blocking_total_s += blocking_s
            self._counts.blocking_max_s = max(self._counts.blocking_max_s, blocking_s)

    def written(self, record: SaveRecord) -> None:
        with self._lock:
            c = self._counts
            c.saves += 1
            c.bytes += record.nbytes
            c.write_total_s += record.write_s
            c.write_max_s = max(c.write_max_s, record.write_s)
            c.last_saved_step = record.step
            self._recent.append(record)

    def snapshot(self) -> Stats:
        with self._lock:
            return Stats(**dataclasses.asdict(self._counts), recent=tuple(self._recent))
