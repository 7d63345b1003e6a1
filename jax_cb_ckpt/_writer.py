"""The writer thread: takes handed-off states off the exchange and writes Orbax checkpoints.

One thread per Checkpointer owns one synchronous `orbax.checkpoint.Checkpointer` for its
whole life (Orbax objects are not thread-safe, and a save blocks, so it must never run
in JAX's callback thread). This thread *is* the background, and a synchronous save means
the host buffers of a save are free again as soon as it returns.

Steps, retention and atomicity are ours, not a CheckpointManager's (see `_format`): a
manager lists any integer-named folder as a step (and its retention deletes it), deletes
a complete step to write it again (`force=True`), and shares one temporary name between
writers. Here a step is written under a unique temporary name, fsynced, renamed into
place, and the directory fsynced: after `wait()` returns, a listed step survives a power
loss. A complete step is only ever removed by retention or by an explicit replace.
"""

from __future__ import annotations

import concurrent.futures.thread
import dataclasses
import logging
import os
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from . import _format
from ._errors import SaveError, SaveFailedWarning, UnflushedSaveWarning
from ._exchange import Exchange
from ._lock import DirectoryLock
from ._processes import OK, Group
from ._shards import ShardedArray
from ._stats import SaveRecord, StatsRecorder

logger = logging.getLogger("jax_cb_ckpt")


@dataclasses.dataclass
class SaveItem:
    """One state handed off by the callback, waiting to be written."""

    step: int
    tree: dict[str, Any]  # nested dict of host numpy arrays (or per-device blocks)
    meta: dict[str, Any]  # JSON-able description (leaf specs, step, version)
    nbytes: int
    blocking_s: float
    handoff_s: float
    release: Callable[[], None]  # give the host buffers back (staging pool)
    replace: tuple[int, ...] = ()  # another run's steps to delete first (on_existing)
    ready: Callable[[], None] | None = None  # wait until the host arrays hold the data


def make_checkpointer(*, compression: bool) -> Any:
    """The Orbax checkpointer the writer owns. Numpy arrays are not deep-copied by Orbax:
    the buffers handed to it stay untouched until the synchronous save returns."""
    handler = ocp.CompositeCheckpointHandler(
        **{
            _format.STATE_ITEM: state_handler(compression=compression),
            _format.META_ITEM: ocp.JsonCheckpointHandler(),
        }
    )
    return ocp.Checkpointer(handler)


def state_handler(*, compression: bool) -> Any:
    """Orbax's handler of the state item, with our type handlers."""
    registry = ocp.type_handlers.create_type_handler_registry(
        (np.ndarray, ocp.type_handlers.NumpyHandler(deepcopy_host_arrays=False)),
        # Per-device leaves. No replica-parallel writes: those slice replicated arrays
        # with a jitted computation, which waits for devices the running program holds.
        (jax.Array, ocp.type_handlers.ArrayHandler(use_replica_parallel=False)),
    )
    return ocp.PyTreeCheckpointHandler(use_compression=compression, type_handler_registry=registry)


class Writer:
    """Background writer of one Checkpointer.

    Opening it removes what a killed writer of ours left in the directory. `stop`
    drains the queue (every submitted save is written or fails), closes Orbax and ends
    the thread; the thread also ends by itself after `finish` (used when the owning
    Checkpointer is garbage collected unclosed).
    """

    def __init__(
        self,
        directory: str,
        exchange: Exchange,
        lock: DirectoryLock,
        *,
        max_to_keep: int | None,
        compression: bool,
        stats: StatsRecorder,
        on_exit: Callable[[], None],
        group: Group | None = None,
    ) -> None:
        self.directory = directory
        self._on_exit = on_exit  # marks the Checkpointer closed
        self._exchange = exchange
        self._lock = lock
        self._max_to_keep = max_to_keep
        self._stats = stats
        self._identity = _format.identity(directory)
        self._group = group
        if group is None:
            _format.clean_leftovers(directory)
            self._checkpointer = make_checkpointer(compression=compression)
        else:  # one part of each checkpoint (see _processes.py); the primary cleans up
            if group.primary:
                _format.clean_leftovers(directory)
            self._checkpointer = state_handler(compression=compression)
            self._meta_handler = ocp.JsonCheckpointHandler()
        self._thread = threading.Thread(
            target=self._run,
            name=f"jax_cb_ckpt-writer:{os.path.basename(directory)}",
            # Daemon so that a thread blocked elsewhere never hangs interpreter exit; the
            # exit hook below drains and stops every writer first (see _flush_at_exit).
            daemon=True,
        )
        _LIVE.add(self)
        self._thread.start()

    def flush_at_exit(self) -> None:
        """Interpreter exit with saves possibly in flight: write them all, then stop.
        What cannot be raised any more is reported as warnings."""
        self._on_exit()
        pending = self._exchange.pending
        if pending:
            warnings.warn(
                f"jax_cb_ckpt: {pending} save(s) to {self.directory!r} were still "
                "pending at interpreter exit and were written now. Fix: call "
                "ckpt.close() or use `with ckpt:` to flush explicitly.",
                UnflushedSaveWarning,
                stacklevel=2,
            )
        self.stop()  # the thread reports what is left as it ends (_report_unclaimed)

    def finish(self) -> None:
        """Ask the thread to end once the saves queued before this call are written."""
        self._lock.finishing = True  # a new Checkpointer on the directory waits for us
        self._exchange.stop_writer()

    def stop(self) -> None:
        """`finish`, then wait for the thread (blocks the calling thread)."""
        if self._thread.is_alive():
            self.finish()
            if threading.current_thread() is not self._thread:
                self._thread.join()

    # -- the writer thread ------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                item = self._exchange.next_item()
                if item is None:
                    break
                error = None
                try:
                    if self._group is None:
                        error = self._write(item)
                    else:
                        error = self._write_shared(item, self._group)
                finally:
                    item.release()
                    self._exchange.finished(item.step, item.replace, error)
        finally:
            _LIVE.discard(self)
            self._checkpointer.close()
            if self._group is not None:
                self._meta_handler.close()
                self._group.close()
            self._lock.release()
            self._report_unclaimed()

    def _report_unclaimed(self) -> None:
        """A writer that ends while warnings or an error are still pending was finished
        by garbage collection or interpreter exit (close() takes them first): nobody will
        ask any more, so report them now rather than lose them."""
        emit_notes(self._exchange, stacklevel=1)
        error = self._exchange.take_error()
        if error is not None:
            warnings.warn(f"jax_cb_ckpt: {error}", SaveFailedWarning, stacklevel=1)

    def _write(self, item: SaveItem) -> SaveError | None:
        step = item.step
        temp = _format.temp_name(step)
        final = os.path.join(self.directory, str(step))
        try:
            self._make_room(item, final)
            start = time.perf_counter()
            if item.ready is not None:  # copies from a GPU still in flight
                item.ready()
            self._checkpointer.save(
                os.path.join(self.directory, temp),
                args=ocp.args.Composite(
                    **{
                        _format.STATE_ITEM: _state_save(item.tree),
                        _format.META_ITEM: ocp.args.JsonSave(item.meta),
                    }
                ),
            )
            self._commit(os.path.join(self.directory, temp), final)
            write_s = time.perf_counter() - start
            self._retain()
        except BaseException as e:
            _format.remove_temp(self.directory, temp)
            return self._failed(step, e)
        self._stats.written(SaveRecord(step, item.nbytes, item.blocking_s, item.handoff_s, write_s))
        return None

    def _make_room(self, item: SaveItem, final: str) -> None:
        """Before a step is written: the directory is still ours, the other run's steps
        it replaces are deleted, and nothing stands where the step will go."""
        self._check_directory()
        for old in item.replace:  # on_existing='replace': the other run's steps
            _format.remove_step(self.directory, old)
        if os.path.lexists(final):
            raise FileExistsError(_in_the_way(final))

    def _commit(self, temp: str, final: str) -> None:
        """A complete step: fsynced, then renamed into place (atomic)."""
        _format.fsync_tree(temp)
        if os.path.lexists(final):  # appeared while writing: keep what is there
            raise FileExistsError(_in_the_way(final))
        os.rename(temp, final)
        _format.fsync_dir(self.directory)

    def _failed(self, step: int, e: BaseException) -> SaveError:
        self._stats.failed()
        kept = " Earlier checkpoints in it are untouched." if os.path.isdir(self.directory) else ""
        error = SaveError(
            f"saving step {step} to {self.directory!r} failed: {type(e).__name__}: "
            f"{str(e).rstrip('.')}.{kept}"
        )
        error.__cause__ = e
        logger.debug("%s", error)  # reported to the user by wait()/close()/exit
        return error

    def _write_shared(self, item: SaveItem, group: Group) -> SaveError | None:
        """One process's part of a multi-process step (the protocol in _processes.py):
        the primary prepares, every process writes its blocks, the primary commits only
        when every process reports success, and every process learns the verdict."""
        try:
            return self._write_part(item, group)
        finally:
            group.writing = None  # peers waiting for this process wait on while set

    def _write_part(self, item: SaveItem, group: Group) -> SaveError | None:
        step = item.step
        group.begin(step)
        temp = os.path.join(self.directory, group.temp_name(step))
        final = os.path.join(self.directory, str(step))
        start = time.perf_counter()
        verdict_due = False  # the primary owes the others a verdict on this step
        try:
            if group.primary:
                try:
                    self._make_room(item, final)
                    os.makedirs(os.path.join(temp, _format.STATE_ITEM))
                    os.makedirs(os.path.join(temp, _format.META_ITEM))
                except BaseException as e:
                    group.tell(step, "ready", _reason(e))
                    raise
                group.tell(step, "ready", OK)
                verdict_due = True
            else:
                ready = group.hear(step, "ready", f"process 0 to start step {step}", 0)
                if ready != OK:
                    raise SaveError(f"process 0 could not start step {step}: {ready}")
            mine: BaseException | None = None
            try:
                if item.ready is not None:  # copies from a GPU still in flight
                    item.ready()
                self._checkpointer.save(
                    epath.Path(temp) / _format.STATE_ITEM, args=_state_save(item.tree)
                )
                if group.primary:
                    self._meta_handler.save(
                        epath.Path(temp) / _format.META_ITEM, args=ocp.args.JsonSave(item.meta)
                    )
            except BaseException as e:
                mine = e
            group.tell(step, f"wrote/{group.index}", OK if mine is None else _reason(mine))
            if mine is not None:
                raise mine
            if group.primary:
                problems = []
                for other in range(1, group.count):
                    what = f"process {other} to write its part of step {step}"
                    said = group.hear(step, f"wrote/{other}", what, other)
                    if said != OK:
                        problems.append(f"process {other}: {said}")
                group.heard_all(step)
                if problems:
                    raise SaveError("; ".join(problems))
                self._checkpointer.finalize(epath.Path(temp) / _format.STATE_ITEM)
                _format.write_step_file(temp, self._checkpointer, self._meta_handler)
                self._commit(temp, final)
                self._retain()
                group.tell(step, "commit", OK)
                verdict_due = False
            else:
                verdict = group.hear(step, "commit", f"process 0 to commit step {step}", 0)
                if verdict != OK:
                    raise group.refuse(step, verdict)
        except BaseException as e:
            if group.primary:
                _format.remove_temp(self.directory, os.path.basename(temp))
                if verdict_due:
                    group.tell(step, "commit", _reason(e))
            return self._failed(step, e)
        write_s = time.perf_counter() - start
        self._stats.written(SaveRecord(step, item.nbytes, item.blocking_s, item.handoff_s, write_s))
        return None

    def _check_directory(self) -> None:
        """The directory we opened is still there, and is still the same directory: one
        removed (Orbax would silently re-create it) or replaced by another is an error,
        and nothing is written into the replacement."""
        if os.path.lexists(self.directory) and not os.path.isdir(self.directory):
            raise NotADirectoryError(f"{self.directory!r} is no longer a directory")
        if not os.path.isdir(self.directory):
            raise FileNotFoundError(
                f"the checkpoint directory {self.directory!r} no longer exists (it was "
                "removed while the run was saving)"
            )
        if _format.identity(self.directory) != self._identity or not self._lock.still_ours():
            raise FileNotFoundError(
                f"the checkpoint directory {self.directory!r} was replaced while the run "
                "was saving (removed and re-created, or its lock file removed); nothing "
                "is written into the replacement. Fix: do not remove the directory of a "
                "running Checkpointer; create a new Checkpointer to write there"
            )

    def _retain(self) -> None:
        if self._max_to_keep is None:
            return
        steps = _format.list_steps(self.directory)
        for old in steps[: max(0, len(steps) - self._max_to_keep)]:
            _format.remove_step(self.directory, old)


def _state_save(tree: dict[str, Any]) -> Any:
    """Orbax's save arguments for the state item. Per-device leaves (`shardings=`)
    become sharded jax.Arrays aliasing their host blocks on a CPU (Orbax writes them
    shard by shard, with its sharding file), host arrays put together elsewhere."""

    def is_leaf(x: Any) -> bool:
        return isinstance(x, ShardedArray)

    def convert(x: Any) -> Any:
        if not is_leaf(x):
            return x
        if jax.default_backend() == "cpu" and x.aliasable():
            array = x.to_jax(_format.storable)
            if array is not None:
                return array
        if x.layout.spans_processes:
            raise SaveError(
                f"a leaf of dtype {x.dtype} sharded over several processes cannot be "
                "written on this backend yet (it would be put together from this "
                "process's blocks only). Fix: store it widened (e.g. int8 for int4), or "
                "save it replicated."
            )
        return x.assemble(_format.storable)

    return ocp.args.PyTreeSave(jax.tree_util.tree_map(convert, tree, is_leaf=is_leaf))


def _reason(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


def _in_the_way(final: str) -> str:
    if _format.is_checkpoint(final):
        return (
            f"step directory {final!r} already exists (written by another writer "
            "since this Checkpointer opened the directory); it was kept"
        )
    return (
        f"{final!r} already exists and is not a checkpoint (a user's file or folder?); "
        "it was left untouched. Fix: move it out of the checkpoint directory"
    )


def emit_notes(exchange: Exchange, *, stacklevel: int) -> None:
    """Issue the warnings the callback side and the writer noted, in this thread."""
    for category, message in exchange.take_notes():
        warnings.warn(message, category, stacklevel=stacklevel + 1)


# -- interpreter exit ------------------------------------------------------------------

# Every writer whose thread runs, held strongly: a Checkpointer that was garbage
# collected unclosed still has its saves written (weak references here lost them).
_LIVE: set[Writer] = set()


def _flush_at_exit() -> None:
    """Write what every unclosed Checkpointer was handed, before the interpreter ends.

    Threads that are still training (non-daemon, not the main thread) are waited for
    first, whether or not they hold a Checkpointer yet: theirs must not be closed under
    them, and one they create later must still be able to write (Orbax needs the thread
    pools that shut down after this hook). Python joins those threads at exit anyway;
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
    if not _LIVE:
        return
    try:
        jax.effects_barrier()  # saves of jitted code still running reach the queue
    except BaseException as e:  # never raise during interpreter shutdown
        logger.error("jax_cb_ckpt: waiting for running callbacks at exit failed: %s", e)
    for writer in list(_LIVE):
        try:
            writer.flush_at_exit()
        except BaseException as e:
            logger.error("jax_cb_ckpt: flushing %s at exit failed: %s", writer.directory, e)


# threading's exit hooks run before concurrent.futures shuts its executors down (they run
# in reverse order of registration, and orbax imported concurrent.futures before us), so
# Orbax can still write. Plain atexit runs after that shutdown: too late.
threading._register_atexit(_flush_at_exit)  # type: ignore[attr-defined]
