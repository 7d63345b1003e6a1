"""The writer thread: takes handed-off states off a queue and writes Orbax checkpoints.

One thread per Checkpointer owns one `orbax.checkpoint.CheckpointManager` for its whole
life: the manager is not thread-safe, and its `save` blocks until the previous save
finishes, so it must never be called from JAX's callback thread. The manager runs with
Orbax's own async machinery off (`enable_async_checkpointing=False`): this thread *is*
the background, and a synchronous save means the host buffers of a save are free again
as soon as `save` returns. Orbax writes each step into a temporary directory and renames
it, so a step directory on disk is complete or absent.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import shutil
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from ._errors import DuplicateStepWarning, SaveError
from ._stats import SaveRecord, StatsRecorder

logger = logging.getLogger("jax_cb_ckpt")

STATE_ITEM = "state"  # Orbax item holding the arrays, as a nested dict
META_ITEM = "meta"  # Orbax item holding the JSON description of the leaves
# Retention renames a step here (atomic) before deleting it, so a kill in the middle of
# a deletion never leaves a half-deleted step that looks like a checkpoint.
DELETED_SUBDIR = "_jax_cb_ckpt_deleted"


@dataclasses.dataclass
class SaveItem:
    """One state handed off by the callback, waiting to be written."""

    step: int
    tree: dict[str, Any]  # nested dict of host numpy arrays
    meta: dict[str, Any]  # JSON-able description (leaf specs, step, version)
    nbytes: int
    blocking_s: float
    handoff_s: float
    release: Callable[[], None]  # give the host buffers back (staging pool)


_STOP = object()


def make_manager(directory: str, *, max_to_keep: int | None, compression: bool):
    """The Orbax manager the writer owns. Numpy arrays are not deep-copied by Orbax:
    the buffers handed to it stay untouched until the synchronous save returns."""
    registry = ocp.type_handlers.create_type_handler_registry(
        (np.ndarray, ocp.type_handlers.NumpyHandler(deepcopy_host_arrays=False)),
        (jax.Array, ocp.type_handlers.ArrayHandler()),  # unused; keeps Orbax's metadata on
    )
    options = ocp.CheckpointManagerOptions(
        max_to_keep=max_to_keep,
        enable_async_checkpointing=False,
        create=True,
        # A killed run leaves `<step>.orbax-checkpoint-tmp*` directories; remove them
        # when the directory is opened again (they are never listed as steps).
        cleanup_tmp_directories=True,
        todelete_subdir=DELETED_SUBDIR,
    )
    handlers = {
        STATE_ITEM: ocp.PyTreeCheckpointHandler(
            use_compression=compression, type_handler_registry=registry
        ),
        META_ITEM: ocp.JsonCheckpointHandler(),
    }
    return ocp.CheckpointManager(directory, options=options, item_handlers=handlers)


class Writer:
    """Background writer of one Checkpointer.

    `submit` never blocks (the bound on in-flight saves is enforced by the caller with
    `slots`); `drain` blocks the calling thread until every submitted save is written
    or has failed; `stop` drains, closes the manager and ends the thread.
    """

    def __init__(
        self,
        directory: str,
        *,
        max_to_keep: int | None,
        compression: bool,
        queue_size: int,
        stats: StatsRecorder,
    ) -> None:
        self.directory = directory
        self.slots = threading.BoundedSemaphore(queue_size)
        self._stats = stats
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._cond = threading.Condition()
        self._pending = 0
        self._error: SaveError | None = None
        self._notes: list[tuple[type[Warning], str]] = []
        self._ready = threading.Event()
        self._init_error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._run,
            args=(max_to_keep, compression),
            name=f"jax_cb_ckpt-writer:{os.path.basename(directory)}",
            # Daemon so that a forgotten Checkpointer never hangs interpreter exit; the
            # exit hook below flushes it first.
            daemon=True,
        )
        self._thread.start()
        self._ready.wait()
        if self._init_error is not None:
            raise SaveError(
                f"could not open a checkpoint manager on {directory!r}: {self._init_error}"
            ) from self._init_error

    # -- called from the callback or user thread -------------------------------------

    @property
    def pending(self) -> int:
        with self._cond:
            return self._pending

    def submit(self, item: SaveItem) -> int:
        """Queue a save; returns how many saves are now in flight."""
        with self._cond:
            self._pending += 1
            in_flight = self._pending
        self._queue.put(item)
        return in_flight

    def drain(self) -> None:
        """Block until every submitted save has been written or has failed."""
        with self._cond:
            while self._pending:
                self._cond.wait()

    def peek_error(self) -> SaveError | None:
        with self._cond:
            return self._error

    def take_error(self) -> SaveError | None:
        """The first writer error since the last call, cleared (re-raise it)."""
        with self._cond:
            error, self._error = self._error, None
            return error

    def note(self, category: type[Warning], message: str) -> None:
        """A warning to emit in the user's thread at the next wait()/close()."""
        logger.warning(message)
        with self._cond:
            self._notes.append((category, message))

    def take_notes(self) -> list[tuple[type[Warning], str]]:
        with self._cond:
            notes, self._notes = self._notes, []
            return notes

    def stop(self) -> None:
        if self._thread.is_alive():
            self._queue.put(_STOP)
            self._thread.join()

    # -- the writer thread ------------------------------------------------------------

    def _run(self, max_to_keep: int | None, compression: bool) -> None:
        try:
            manager = make_manager(self.directory, max_to_keep=max_to_keep, compression=compression)
        except BaseException as e:  # reported by __init__ in the user's thread
            self._init_error = e
            self._ready.set()
            return
        self._ready.set()
        _empty_deleted(self.directory)
        try:
            while True:
                item = self._queue.get()
                if item is _STOP:
                    break
                try:
                    self._write(manager, item)
                finally:
                    item.release()
                    self.slots.release()
                    with self._cond:
                        self._pending -= 1
                        self._cond.notify_all()
        finally:
            manager.close()

    def _write(self, manager: Any, item: SaveItem) -> None:
        step = item.step
        try:
            _check_directory(self.directory)
            if step in manager.all_steps():
                self._stats.count("duplicates")
                self.note(
                    DuplicateStepWarning,
                    f"jax_cb_ckpt: step {step} already exists in {self.directory}; the "
                    "checkpoint on disk was kept and this save was dropped.",
                )
                return
            start = time.perf_counter()
            manager.save(
                step,
                args=ocp.args.Composite(
                    **{
                        STATE_ITEM: ocp.args.PyTreeSave(item.tree),
                        META_ITEM: ocp.args.JsonSave(item.meta),
                    }
                ),
                force=True,
            )
            manager.wait_until_finished()
            write_s = time.perf_counter() - start
            _empty_deleted(self.directory)
        except BaseException as e:
            self._stats.count("failed")
            kept = (
                " Earlier checkpoints in it are untouched." if os.path.isdir(self.directory) else ""
            )
            error = SaveError(
                f"saving step {step} to {self.directory!r} failed: {type(e).__name__}: {e}.{kept}"
            )
            error.__cause__ = e
            logger.error("%s", error)
            _remove_partial(self.directory, step)
            with self._cond:
                if self._error is None:
                    self._error = error
            return
        self._stats.written(SaveRecord(step, item.nbytes, item.blocking_s, item.handoff_s, write_s))


def _check_directory(directory: str) -> None:
    """Orbax would silently re-create a removed directory; a vanished run is an error."""
    if not os.path.exists(directory):
        raise FileNotFoundError(
            f"the checkpoint directory {directory!r} no longer exists (it was removed "
            "while the run was saving)"
        )
    if not os.path.isdir(directory):
        raise NotADirectoryError(f"{directory!r} is no longer a directory")


def _empty_deleted(directory: str) -> None:
    """Finish deletions: steps that retention renamed into DELETED_SUBDIR."""
    deleted = os.path.join(directory, DELETED_SUBDIR)
    try:
        names = os.listdir(deleted)
    except OSError:
        return
    for name in names:
        shutil.rmtree(os.path.join(deleted, name), ignore_errors=True)


def _remove_partial(directory: str, step: int) -> None:
    """Delete the temporary directory a failed save left, so it does not hold disk space.

    Only `<step>.orbax-checkpoint-tmp*` of the failed step is touched; complete
    checkpoints are never removed here."""
    try:
        names = os.listdir(directory)
    except OSError:
        return
    for name in names:
        if name.startswith(f"{step}.orbax-checkpoint-tmp"):
            shutil.rmtree(os.path.join(directory, name), ignore_errors=True)


# -- interpreter exit ------------------------------------------------------------------

_LIVE: weakref.WeakSet[Any] = weakref.WeakSet()


def register_for_exit(checkpointer: Any) -> None:
    _LIVE.add(checkpointer)


def unregister_for_exit(checkpointer: Any) -> None:
    _LIVE.discard(checkpointer)


def _flush_at_exit() -> None:
    for checkpointer in list(_LIVE):
        try:
            checkpointer._flush_at_exit()
        except BaseException as e:  # never raise during interpreter shutdown
            logger.error("jax_cb_ckpt: flushing %r at exit failed: %s", checkpointer, e)


def _install_exit_hook() -> None:
    # threading's exit hooks run before concurrent.futures shuts its executors down
    # (they run in reverse order of registration, and orbax imported concurrent.futures
    # before us), so Orbax can still write. Plain atexit runs after that shutdown.
    register = getattr(threading, "_register_atexit", None)
    if register is not None:
        register(_flush_at_exit)
    else:  # pragma: no cover - CPython has had _register_atexit since 3.9
        import atexit

        atexit.register(_flush_at_exit)


_install_exit_hook()
