"""Counters of a Checkpointer: what was saved, dropped and how long each part took."""

from __future__ import annotations

import collections
import dataclasses
import statistics
import threading

_RECENT = 1024  # per-save records kept for medians; totals cover every save


@dataclasses.dataclass(frozen=True)
class SaveRecord:
    """Timing of one save that reached the disk."""

    step: int
    nbytes: int
    blocking_s: float  # time the device waited in the library's callback, queue wait included
    handoff_s: float  # the part of blocking_s spent taking the data (queue wait excluded)
    write_s: float  # time the writer thread spent in Orbax for this save


@dataclasses.dataclass(frozen=True)
class Stats:
    """A snapshot of a Checkpointer's counters (`ckpt.stats`).

    Attributes:
        saves: checkpoints written to disk.
        skipped: saves dropped because the queue was full (`on_full="skip"`).
        duplicates: saves dropped because their step was already handed over or
            already on disk.
        failed: saves the writer could not write (the first error is re-raised).
        crossings: times a device program handed data to the host (one per saving
            step, whatever the batch; the rest of the steps cross nothing).
        bytes: bytes of array data written.
        blocking_total_s / blocking_max_s: time the device waited inside the library's
            hand-off (copying into host buffers plus any back-pressure wait), summed and
            worst. JAX's own transfer of the arguments to the callback comes before it.
        write_total_s / write_max_s: time the writer thread spent writing.
        queue_high_water: the most saves in flight (queued or being written) at once.
        recent: the last 1024 saves that reached disk, oldest first.
    """

    saves: int = 0
    skipped: int = 0
    duplicates: int = 0
    failed: int = 0
    crossings: int = 0
    bytes: int = 0
    blocking_total_s: float = 0.0
    blocking_max_s: float = 0.0
    write_total_s: float = 0.0
    write_max_s: float = 0.0
    queue_high_water: int = 0
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
        """One line for logs and the demo."""
        return (
            f"saves={self.saves} skipped={self.skipped} duplicates={self.duplicates} "
            f"failed={self.failed} bytes={self.bytes} "
            f"blocking/save={self.blocking_per_save_s * 1e3:.3f} ms "
            f"(hand-off {self.handoff_per_save_s * 1e3:.3f} ms) "
            f"write/save={self.write_per_save_s * 1e3:.1f} ms "
            f"queue_high_water={self.queue_high_water}"
        )


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else 0.0


class StatsRecorder:
    """Thread-safe counters, updated by the callback and the writer thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: collections.defaultdict[str, float] = collections.defaultdict(float)
        self._blocking_max = 0.0
        self._write_max = 0.0
        self._high_water = 0
        self._recent: collections.deque[SaveRecord] = collections.deque(maxlen=_RECENT)

    def count(self, what: str, n: int = 1) -> None:
        with self._lock:
            self._counts[what] += n

    def in_flight(self, n: int) -> None:
        with self._lock:
            self._high_water = max(self._high_water, n)

    def handed_off(self, blocking_s: float) -> None:
        with self._lock:
            self._counts["blocking_total_s"] += blocking_s
            self._blocking_max = max(self._blocking_max, blocking_s)

    def written(self, record: SaveRecord) -> None:
        with self._lock:
            self._counts["saves"] += 1
            self._counts["bytes"] += record.nbytes
            self._counts["write_total_s"] += record.write_s
            self._write_max = max(self._write_max, record.write_s)
            self._recent.append(record)

    def snapshot(self) -> Stats:
        with self._lock:
            c = self._counts
            return Stats(
                saves=int(c["saves"]),
                skipped=int(c["skipped"]),
                duplicates=int(c["duplicates"]),
                failed=int(c["failed"]),
                crossings=int(c["crossings"]),
                bytes=int(c["bytes"]),
                blocking_total_s=float(c["blocking_total_s"]),
                blocking_max_s=self._blocking_max,
                write_total_s=float(c["write_total_s"]),
                write_max_s=self._write_max,
                queue_high_water=self._high_water,
                recent=tuple(self._recent),
            )
