"""Preemption: a stop request recorded on the host, readable from traced code.

A SIGTERM (or SIGINT, when asked) only sets a flag; nothing is interrupted. Traced code
reads the flag with `should_stop(step)` and decides on the device to save and leave its
loop; the Python side then waits for that last save before the process exits.

Python runs signal handlers in the main thread, between bytecodes. A main thread blocked
inside a long C++ call (`block_until_ready` on a jitted loop) would run the handler only
when the loop ends, so `Checkpointer.run` waits for its loop by polling with short sleeps.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


class Preempted(SystemExit):
    """Raised by `Checkpointer.run` after a stop request, once the last save is on disk.

    A `SystemExit`: uncaught, the process exits quietly with `code` (128 + the signal
    number, as a shell reports a death by that signal; 1 for `request_stop()`), and the
    scheduler can restart it; the next `run` resumes from that save.
    """

    def __init__(self, step: int, signum: int | None) -> None:
        self.step = step
        self.signum = signum
        name = signal.Signals(signum).name if signum else "request_stop()"
        super().__init__(128 + signum if signum else 1)
        self.message = f"jax_cb_ckpt: stopped at step {step} after {name}; checkpoint saved"

    def __str__(self) -> str:
        return self.message


class StopFlag:
    """Thread-safe record of a stop request (and which signal asked)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requested = False
        self.signum: int | None = None

    def request(self, signum: int | None = None) -> None:
        with self._lock:
            if not self.requested:
                self.requested, self.signum = True, signum

    def clear(self) -> None:
        with self._lock:
            self.requested, self.signum = False, None

    @contextlib.contextmanager
    def signals(self, signums: tuple[int, ...]) -> Iterator[None]:
        """Record `signums` as stop requests while the block runs (main thread only;
        elsewhere Python cannot install handlers and the block runs without them)."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {s: signal.getsignal(s) for s in signums}

        def handler(signum: int, frame: Any) -> None:
            self.request(signum)

        for s in signums:
            signal.signal(s, handler)
        try:
            yield
        finally:
            for s, old in previous.items():
                signal.signal(s, old)

    def traced(self, step: Any) -> jax.Array:
        """A traced bool: has a stop been requested? One host crossing per evaluation.

        `step` must vary between evaluations (the loop counter): a callback without
        varying inputs could be hoisted out of the loop and read only once.
        """

        # pure_callback: no effect to order, DCE may drop an unused read, and it batches
        # (vmap_method) and differentiates (no inputs need tangents) without trouble.
        def read(step: np.ndarray) -> np.ndarray:
            return np.full(np.shape(step), self.requested, dtype=bool)

        step = jnp.asarray(step)
        return jax.pure_callback(
            read,
            jax.ShapeDtypeStruct(step.shape, jnp.bool_),
            jax.lax.stop_gradient(step),
            vmap_method="broadcast_all",
        )
