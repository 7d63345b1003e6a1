"""`_handoff/_stats.py`: `StatsRecorder` counts each event once under its own name, keeps
totals and maxima of blocking and write times, the queue's high-water mark, the last
saved step and the last 1024 records (totals over every save); `snapshot()` is a frozen
copy that later events do not change; `Stats`' medians and summary line."""

import dataclasses
import threading
import time

import pytest

from jax_cb_ckpt._handoff import _stats
from jax_cb_ckpt._handoff._stats import SaveRecord, Stats, StatsRecorder


def _record(step, write_s=0.01, nbytes=100, blocking_s=0.002, handoff_s=0.001):
    return SaveRecord(step, nbytes, blocking_s, handoff_s, write_s)


def test_each_event_counts_under_its_own_name():
    rec = StatsRecorder()
    rec.crossed()
    rec.crossed()
    rec.duplicate()
    rec.skipped()
    rec.superseded()
    rec.superseded()
    rec.superseded()
    rec.queue_wait()
    rec.failed()
    snap = rec.snapshot()
    assert (snap.crossings, snap.duplicates, snap.skipped, snap.superseded) == (2, 1, 1, 3)
    assert (snap.queue_waits, snap.failed, snap.saves) == (1, 1, 0)
    assert snap.last_saved_step is None and snap.recent == ()


def test_totals_maxima_and_high_water():
    rec = StatsRecorder()
    for n in (2, 5, 3):
        rec.in_flight(n)
    rec.handed_off(0.5)
    rec.handed_off(0.25)
    rec.written(_record(3, write_s=0.1, nbytes=10))
    rec.written(_record(7, write_s=0.3, nbytes=20))
    snap = rec.snapshot()
    assert snap.queue_high_water == 5
    assert snap.blocking_total_s == pytest.approx(0.75)
    assert snap.blocking_max_s == 0.5
    assert snap.write_total_s == pytest.approx(0.4)
    assert snap.write_max_s == 0.3
    assert (snap.saves, snap.bytes, snap.last_saved_step) == (2, 30, 7)
    assert [r.step for r in snap.recent] == [3, 7]


def test_handed_off_moves_the_clock():
    rec = StatsRecorder()
    before = rec.last_handoff
    time.sleep(0.01)
    rec.handed_off(0.0)
    assert rec.last_handoff > before


def test_recent_keeps_the_last_records_and_totals_cover_every_save(monkeypatch):
    rec = StatsRecorder()
    for step in range(_stats._RECENT + 10):
        rec.written(_record(step, nbytes=1))
    snap = rec.snapshot()
    assert len(snap.recent) == _stats._RECENT
    assert snap.recent[0].step == 10 and snap.recent[-1].step == _stats._RECENT + 9
    assert snap.saves == snap.bytes == _stats._RECENT + 10


def test_a_snapshot_is_frozen_and_not_changed_by_later_events():
    rec = StatsRecorder()
    rec.written(_record(1))
    snap = rec.snapshot()
    rec.written(_record(2))
    rec.skipped()
    assert snap.saves == 1 and snap.skipped == 0 and len(snap.recent) == 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        snap.saves = 5  # type: ignore[misc]


def test_medians_and_the_summary_line():
    empty = Stats()
    assert empty.blocking_per_save_s == empty.write_per_save_s == 0.0
    records = tuple(
        SaveRecord(i, 1, blocking, handoff, write)
        for i, (blocking, handoff, write) in enumerate(
            [(0.003, 0.001, 0.010), (0.001, 0.0005, 0.030), (0.002, 0.002, 0.020)]
        )
    )
    stats = Stats(saves=3, bytes=3, recent=records, queue_waits=1, last_saved_step=2)
    assert stats.blocking_per_save_s == 0.002
    assert stats.handoff_per_save_s == 0.001
    assert stats.write_per_save_s == 0.020
    line = stats.summary()
    assert line.startswith("saves=3 skipped=0 superseded=0 duplicates=0 failed=0 bytes=3;")
    assert "device waited 2.000 ms (copy 1.000 ms, hand-off and queue 1.000 ms)" in line
    assert "in 20.0 ms; queue_high_water=0 queue_waits=1" in line
    assert repr(stats).endswith("last_saved_step=2; 3 records in .recent)")
    assert "last_saved_step=none" in repr(Stats())


def test_counters_from_many_threads_are_not_lost():
    rec = StatsRecorder()

    def work():
        for _ in range(2000):
            rec.crossed()
            rec.written(_record(0, nbytes=1))

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    snap = rec.snapshot()
    assert snap.crossings == snap.saves == snap.bytes == 8000


def test_stats_and_the_counts_have_the_same_fields():
    counts = {f.name for f in dataclasses.fields(_stats._Counts)}
    assert counts | {"recent"} == {f.name for f in dataclasses.fields(Stats)}
