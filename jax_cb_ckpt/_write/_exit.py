"""Writing what unclosed Checkpointers were handed before the interpreter ends: the exit
hook, registered when the package is imported.

Not in `_writer.py`, which the package imports on first use (with JAX): the hook must
be registered before the interpreter starts to shut down, or a Checkpointer first
created then (by a non-daemon thread still running when the main thread ends) cannot
import its modules (`threading._register_atexit` refuses after shutdown began) and its
saves are lost. Needs nothing but the standard library.
"""

from __future__ import annotations

import concurrent.futures.thread
import logging
import threading
from typing import Protocol

logger = logging.getLogger("jax_cb_ckpt")


class Flushable(Protocol):
    directory: str

    def flush_at_exit(self) -> None: ...


# Every writer whose thread runs, held strongly: a Checkpointer that was garbage
# collected unclosed still has its saves written (weak references here lost them).
LIVE: set[Flushable] = set()


def _flush_at_exit() -> None:
    """Write what every unclosed Checkpointer was handed, before the interpreter ends.

    Threads that are still training (non-daemon, not the main thread) are waited for
    first, whether or not they hold a Checkpointer yet: theirs must not be closed under
    them, and one they create later must still be able to write (the writer's fsync
    pool, `_durable`, shuts down after this hook). Python joins those threads at exit anyway;
    this only does it before the pools go. Thread-pool workers are not waited for (they
    end only when their pools shut down, after this hook): a save that reaches a
    Checkpointer after this hook closed it warns (`UnflushedSaveWarning`) and raises.
    """
    pools = set(getattr(concurrent.futures.thread, "_threads_queues", {}))
    me = threading.current_thread()
    while True:
        training = [
            t
            for t in threading.enumerate()
            if t is not me and not t.daemon and t.is_alive() and t not in pools
        ]
        if not training:
            break
        for thread in training:
            thread.join()
    if not LIVE:
        return
    import jax  # imported by now: a live writer's Checkpointer needed it

    try:
        jax.effects_barrier()  # saves of jitted code still running reach the queue
    except BaseException as e:  # never raise during interpreter shutdown
        logger.error("waiting for running saves at interpreter exit failed: %s", e)
    for writer in list(LIVE):
        try:
            writer.flush_at_exit()
        except BaseException as e:
            logger.error("writing the saves to %s at exit failed: %s", writer.directory, e)


# threading's exit hooks run before concurrent.futures shuts its executors down (they run
# in reverse order of registration, and concurrent.futures.thread, imported above,
# registered its own first), so the writers' thread pools can still write. Plain atexit
# runs after that shutdown: too late.
threading._register_atexit(_flush_at_exit)  # type: ignore[attr-defined]
