"""`_base/_heartbeat.py`: `Heartbeat` calls `beat()` every `period_s` seconds in a daemon
thread of its name once started, and stops when `beat()` returns False or at `stop()`,
which returns at once even while a beat is in progress."""

import threading
import time

from jax_cb_ckpt._base._heartbeat import Heartbeat


def _wait_for(predicate, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_nothing_beats_before_start_and_the_first_beat_waits_a_period():
    beats = []
    heart = Heartbeat("hb-test", 0.2, lambda: beats.append(time.monotonic()) or True)
    time.sleep(0.05)
    assert beats == []
    started = time.monotonic()
    heart.start()
    _wait_for(lambda: len(beats) >= 1)
    heart.stop()
    assert beats[0] - started >= 0.19


def test_it_beats_every_period_in_a_daemon_thread_of_its_name_until_stopped():
    beats, names = [], []

    def beat():
        beats.append(time.monotonic())
        names.append(threading.current_thread())
        return True

    heart = Heartbeat("hb-named", 0.02, beat)
    heart.start()
    _wait_for(lambda: len(beats) >= 5)
    heart.stop()
    assert heart.stopped.is_set()
    thread = names[0]
    assert thread.name == "hb-named" and thread.daemon
    assert thread is not threading.current_thread()
    thread.join(1.0)
    assert not thread.is_alive()
    count = len(beats)
    time.sleep(0.1)
    assert len(beats) == count
    gaps = [b - a for a, b in zip(beats, beats[1:], strict=False)]
    assert min(gaps) >= 0.015


def test_a_beat_that_returns_false_is_the_last():
    beats = []

    def beat():
        beats.append(1)
        return len(beats) < 3

    heart = Heartbeat("hb-false", 0.01, beat)
    heart.start()
    _wait_for(lambda: not heart._thread.is_alive())
    time.sleep(0.05)
    assert len(beats) == 3


def test_stop_returns_at_once_while_a_beat_is_in_progress():
    entered, release = threading.Event(), threading.Event()
    beats = []

    def beat():
        beats.append(1)
        entered.set()
        release.wait(5.0)
        return True

    heart = Heartbeat("hb-slow", 0.01, beat)
    heart.start()
    assert entered.wait(5.0)
    started = time.monotonic()
    heart.stop()
    assert time.monotonic() - started < 0.1
    release.set()
    heart._thread.join(2.0)
    assert not heart._thread.is_alive()
    assert len(beats) == 1
