"""A heartbeat: a daemon thread that calls `beat()` every `period_s` seconds until it
is stopped or `beat()` returns False.

Two things show that they live while a run writes: a bucket's lock object
(`_lock.ObjectLock`, rewritten every 5 s) and each process of a multi-process run
(`_processes.Group`, a key of the coordination service). Both beat through this one
class. `stop()` returns at once (a beat in progress finishes in the background); the
thread is a daemon, so a process never waits for it at exit.
"""

from __future__ import annotations

import threading
from collections.abc import Callable


class Heartbeat:
    """`beat()` every `period_s` seconds in the thread `name`, once `start()`ed."""

    def __init__(self, name: str, period_s: float, beat: Callable[[], bool]):
        self.stopped = threading.Event()
        self._period_s = period_s
        self._beat = beat
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self.stopped.set()

    def _run(self) -> None:
        while not self.stopped.wait(self._period_s):
            if not self._beat():
                return
