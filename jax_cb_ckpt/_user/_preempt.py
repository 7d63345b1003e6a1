"""Preemption: a stop request recorded on the host, readable from traced code.

A SIGTERM (or SIGINT, when asked) only sets a flag; nothing is interrupted. Traced code
reads the flag with `should_stop(step)` and decides on the device to save and leave its
loop; the Python side then waits for that last save before the process exits. Ctrl-C
without `sigint=True` also sets the flag, and is recorded as an interrupt: once the save
is on disk `run` raises KeyboardInterrupt, as Ctrl-C would have at once.

Python runs signal handlers in the main thread, between bytecodes. A main thread blocked
inside a long C++ call (`block_until_ready` on a jitted loop) would run the handler only
when the loop ends, so `Checkpointer.run` waits for its loop by polling with short sleeps.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator
from types import FrameType
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np

if TYPE_CHECKING:
    from jax.typing import ArrayLike

# What Python calls a signal handler with: the signal, and the frame it interrupted.
_Handler = Callable[[int, FrameType | None], object]


class Preempted(SystemExit):
    """Raised by `Checkpointer.run` after a stop request, once the last save is on disk.

    A `SystemExit`: uncaught, the process exits quietly with `code` (128 + the signal
    number, as a shell reports a death by that signal; 1 for `request_stop()`), and the
    scheduler can restart it; the next `run` resumes from that save.
    """

    def __init__(self, step: int, signum: int | None) -> None:
        self.step = step
        self.signum = signum
        self.reason = signal.Signals(signum).name if signum else "request_stop()"
        super().__init__(128 + signum if signum else 1)
        self.message = f"jax_cb_ckpt: stopped at step {step} after {self.reason}; checkpoint saved"

    def __str__(self) -> str:
        return self.message


Preempted.__module__ = "jax_cb_ckpt"  # (where users import it from: `_base/_errors.py`)


class StopFlag:
    """Thread-safe record of a stop request (and which signal asked)."""

    def __init__(self) -> None:
        # Reentrant: our signal handlers take it, and Python runs a handler in the main
        # thread between two bytecodes, possibly while that thread already holds it.
        self._lock = threading.RLock()
        self.requested = False
        self.signum: int | None = None
        # Ctrl-C with sigint=False: `run` raises KeyboardInterrupt (or `deferred`, what a
        # SIGINT handler of the user's own raised) once the loop has stopped and saved.
        self.interrupted = False
        self.deferred: BaseException | None = None
        self.reached: int | None = None  # the last step a loop read the flag at

    def request(self, signum: int | None = None) -> None:
        with self._lock:
            if not self.requested:
                self.requested, self.signum = True, signum

    def interrupt(self, error: BaseException | None = None) -> None:
        """Ctrl-C with `sigint=False`: stop at the next check; raise once saved."""
        with self._lock:
            self.interrupted = True
            if self.deferred is None:
                self.deferred = error
            self.request(signal.SIGINT)

    def clear(self) -> None:
        with self._lock:
            self.requested, self.signum = False, None
            self.interrupted, self.deferred = False, None

    def take(self) -> tuple[bool, int | None]:
        """Consume the request: whether one was made, and by which signal (None for
        `request_stop()`); the flag is cleared in the same step."""
        with self._lock:
            taken = self.requested, self.signum
            self.clear()
            return taken

    @contextlib.contextmanager
    def signals(self, *, sigint: bool) -> Iterator[None]:
        """While the block runs, turn signals into stop requests (main thread only;
        elsewhere Python cannot install handlers and the block runs without them).

        SIGTERM, and SIGINT with `sigint=True`, request a stop. With `sigint=False` a
        Ctrl-C is an `interrupt()` instead: Python's default handler would raise
        KeyboardInterrupt in the main thread at once, and `run` would leave while the
        loop runs on in its helper thread. A SIGINT handler of the user's own still runs,
        but what it raises is deferred the same way. SIG_IGN and SIG_DFL stay as they are.
        """
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        handlers: dict[int, _Handler] = {signal.SIGTERM: self._on_signal}
        previous_sigint = signal.getsignal(signal.SIGINT)
        if sigint:
            handlers[signal.SIGINT] = self._on_signal
        elif previous_sigint is signal.default_int_handler:
            handlers[signal.SIGINT] = self._on_ctrl_c
        elif callable(previous_sigint):
            handlers[signal.SIGINT] = self._deferring(previous_sigint)
        previous = {s: signal.getsignal(s) for s in handlers}
        for s, handler in handlers.items():
            signal.signal(s, handler)
        try:
            yield
        finally:
            for s, old in previous.items():
                signal.signal(s, old)

    # Our signal handlers only record: Python runs them in the main thread at whatever
    # bytecode it is at, so what they raise could escape anywhere (also from the code
    # that waits for the loop's thread), and they must not block or print.
    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.request(signum)

    def _on_ctrl_c(self, signum: int, frame: FrameType | None) -> None:
        self.interrupt()

    def _deferring(self, handler: _Handler) -> _Handler:
        def on_sigint(signum: int, frame: FrameType | None) -> None:
            try:
                handler(signum, frame)
            except BaseException as e:  # raised once the loop has stopped and saved
                self.interrupt(e)

        return on_sigint

    def traced(self, step: ArrayLike) -> jax.Array:
        """A traced bool: has a stop been requested? One host crossing per evaluation.

        `step` must vary between evaluations (the loop counter): a callback without
        varying inputs could be hoisted out of the loop and read only once.
        """

        # pure_callback: no effect to order, DCE may drop an unused read, and it batches
        # (vmap_method) and differentiates (no inputs need tangents) without trouble.
        def read(step: np.ndarray) -> np.ndarray:
            self.reached = int(np.max(step)) if np.size(step) else self.reached
            return np.full(np.shape(step), self.requested, dtype=bool)

        step = jnp.asarray(step)
        return jax.pure_callback(
            read,
            jax.ShapeDtypeStruct(step.shape, jnp.bool_),
            jax.lax.stop_gradient(step),
            vmap_method="broadcast_all",
        )
