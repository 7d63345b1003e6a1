"""The writer thread: takes handed-off states off the exchange and writes Orbax checkpoints.

One thread per Checkpointer writes each step in Orbax's standard layout (the `state`
item's arrays with TensorStore, `_store.py`; the JSON files as plain files), so plain
Orbax reads every step, but no Orbax object runs here: Orbax's save machinery cost ~30
ms a step and collided between two Checkpointers of one process (docs/writer.md). This
thread *is* the background: a save's host buffers are free again once it is written.

Steps, retention and atomicity are ours (see `_format`): a step is written under a
unique temporary name, its files fsynced (in parallel), renamed into place, and the
directory fsynced: after `wait()` returns, a listed step survives a power loss. A
complete step is only ever removed by retention or by an explicit replace.

One path for one process and many: each step is a round (`_processes.GroupRound`; a
single process plays a `SoloRound`): the primary makes the step's place and starts the
round, every process writes its own arrays and reports them, the primary collects the
reports, merges, writes the small files, commits and decides; a peer waits for the
start and for the decision. With one process nobody is told or waited for. Where the
steps live is `_storage/`'s (the writer calls its verbs, never asks which kind).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from .._base import _dtypes, _warn
from .._base._errors import (
    ForeignStepWarning,
    SaveError,
    SaveFailedWarning,
    UnflushedSaveWarning,
)
from .._handoff._exchange import Exchange
from .._handoff._items import SaveItem
from .._handoff._shards import ShardedArray
from .._handoff._stats import SaveRecord
from .._layout import _format, _spec
from .._layout._policy import AnyOf
from .._storage import _faults, _places
from .._storage._durable import Sync
from .._storage._lock import DirectoryLock
from .._version import version
from . import _exit, _incremental, _store
from ._persistent import Persistent
from ._processes import Group, Processes, Round, Solo, VerdictUnknown
from ._retention import Retention

logger = logging.getLogger("jax_cb_ckpt")


class Writer:
    """Background writer of one Checkpointer.

    Opening it removes what a killed writer of ours left in the directory. `stop`
    drains the queue (every submitted save is written or fails), releases the lock and
    ends the thread; the thread also ends by itself after `finish` (used when the owning
    Checkpointer is garbage collected unclosed).
    """

    def __init__(
        self,
        exchange: Exchange,
        lock: DirectoryLock,
        directory: str,
        *,
        rules: AnyOf | None,
        compression: bool,
        on_exit: Callable[[], None],
        group: Group | None = None,
        persistent: Persistent | None = None,
        incremental: bool = False,
        full_every: int | None = _incremental.FULL_EVERY,
    ) -> None:
        self.directory = directory
        self._persistent = persistent  # the persistent tier (`_persistent.py`), if any
        self._on_exit = on_exit  # marks the Checkpointer closed
        self._exchange = exchange
        self._lock = lock
        self._rules = rules
        self._stats = exchange.stats  # (the Checkpointer's, shared with the host side)
        self._storage = _places.at(directory)  # where the steps live: chosen once
        self._identity = self._storage.identity()
        self._group: Processes = group or Solo()
        # What is kept (None: every step); the steps it unlisted, to delete (_sweep).
        self._retention = None if rules is None else Retention(rules, self._storage, exchange.note)
        self._aside: list[str] = []
        self._retention_s = 0.0  # of the step just written (SaveRecord.retention_s)
        self._log = SaveLog(directory)  # what the log says of the saves
        self._unfinished: list[str] = []  # failed steps in object storage (_sweep)
        if self._group.primary:  # the primary cleans up after killed writers
            untouched = self._storage.clean_leftovers(lock.taken_over_from)
            if untouched:
                _warn.warn(_untouched_message(untouched), ForeignStepWarning)
        self._store = _store.StoreWriter(
            compression=compression,
            kvstore_spec=self._storage.kvstore_spec,
            incremental=incremental,
        )
        # Incremental saves: the step the next one links from; this save's links.
        self._chain = _incremental.Chain(full_every) if incremental else None
        self._links: _Links | None = None
        self._thread = threading.Thread(
            target=self._run,
            name=f"jax_cb_ckpt-writer:{os.path.basename(directory)}",
            # Daemon so that a thread blocked elsewhere never hangs interpreter exit; the
            # exit hook drains and stops every writer first (_exit.py).
            daemon=True,
        )
        _exit.LIVE.add(self)
        try:
            self._thread.start()
        except RuntimeError as e:
            _exit.LIVE.discard(self)
            raise SaveError(_no_thread_message(directory, e)) from e

    def flush_at_exit(self) -> None:
        """Interpreter exit with saves possibly in flight: write them all, then stop.
        What cannot be raised any more is reported as warnings."""
        self._on_exit()
        pending = self._exchange.pending
        if pending:
            _warn.warn(
                f"jax_cb_ckpt: {pending} save(s) to {self.directory!r} were still "
                "pending at interpreter exit and were written now. Fix: call "
                "ckpt.close() or use `with ckpt:` to flush explicitly.",
                UnflushedSaveWarning,
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
                error = late = None
                try:
                    error = self._write(item)
                finally:
                    item.release()
                    if error is None and self._persistent is not None:
                        late = self._copy(item)
                    if late is not None:  # before the save is done: wait() raises it
                        self._exchange.record(late)  # (the local step stays: claim kept)
                    self._exchange.finished(item.claim, error)
                self._sweep()
        finally:
            self._sweep()
            self._log.flush()
            _exit.LIVE.discard(self)
            self._group.close()
            self._lock.release()
            if self._persistent is not None:
                self._persistent.close()
            self._report_unclaimed()

    def _copy(self, item: SaveItem) -> SaveError | None:
        """The persistent tier, after the local step is committed: another run's steps
        that the save replaces removed there too, and the step copied when it is due.
        A failure is a failed write (`on_error`); the local step is kept."""
        tier = self._persistent
        assert tier is not None
        try:
            tier.replaced(item.replace)
            if tier.due(item.step):
                tier.copy(item.step)
        except Exception as e:
            self._stats.failed()
            error = SaveError(
                f"copying step {item.step} to the persistent directory {tier.directory!r} "
                f"failed: {type(e).__name__}: {_faults.scrub(str(e)).rstrip('.')}. The "
                f"local step {item.step} in {self.directory!r} is saved."
            )
            error.__cause__ = _faults.scrubbed(e)
            return error
        return None

    def _report_unclaimed(self) -> None:
        """A writer that ends while warnings or an error are still pending was finished
        by garbage collection or interpreter exit (close() takes them first): nobody will
        ask any more, so report them now rather than lose them."""
        self._exchange.emit_notes()
        error = self._exchange.take_error()
        if error is not None:
            _warn.warn(f"jax_cb_ckpt: {error}", SaveFailedWarning)

    def _make_room(self, item: SaveItem, final: str) -> None:
        """Before a step is written: the directory is still ours, the other run's steps
        it replaces are deleted, and nothing stands where the step will go."""
        self._check_directory()
        for old in item.replace:  # on_existing='replace': the other run's steps
            self._storage.remove_step(old)
            if self._retention is not None:
                self._retention.removed(old)
        if self._storage.exists(os.path.basename(final)):
            raise FileExistsError(self._in_the_way(final))

    def _in_the_way(self, final: str) -> str:
        """What stands where the step `final` is to be written, said."""
        step = os.path.basename(final)
        ours = _format.is_step_name(step) and self._storage.is_checkpoint(int(step))
        return _in_the_way_message(final, ours)

    def _commit(self, temp: str, final: str, nbytes: int, sync: Sync) -> None:
        """A complete step: made durable, then renamed into place (atomic); in object
        storage, its commit marker written."""
        if temp != final and os.path.lexists(final):  # appeared while writing: keep it
            raise FileExistsError(self._in_the_way(final))
        self._fence(final)
        self._storage.commit(temp, final, nbytes, sync)

    def _failed(self, step: int, e: BaseException) -> SaveError:
        self._stats.failed()
        there = self._storage.is_directory()
        kept = " Earlier checkpoints in it are untouched." if there else ""
        outcome = "ended with an unknown outcome" if isinstance(e, VerdictUnknown) else "failed"
        # TensorStore's errors of the arrays' writes carry what the server answered,
        # which may echo a credential: scrubbed, and the cause too (a traceback prints it).
        error = SaveError(
            f"saving step {step} to {self.directory!r} {outcome}: {type(e).__name__}: "
            f"{_faults.scrub(str(e)).rstrip('.')}.{kept}"
        )
        error.__cause__ = _faults.scrubbed(e)
        logger.debug("%s", error)  # reported to the user by wait()/close()/exit
        return error

    def _write(self, item: SaveItem) -> SaveError | None:
        """Write one step (this process's part of it, with several processes): the
        round of `_processes.py`, which in a group of one tells and hears nothing."""
        round_ = self._group.begin(item.step)
        temp = self._storage.temp_path(item.step, round_.temp_name)
        start = time.perf_counter()
        try:
            chain = None
            if self._retention is not None and self._group.primary:
                chain = self._retention.decisions
            step = _Described(item, self._rules, chain)  # (built on first use, in the round)
            with self._storage.step_sync() as sync:  # before the step's files
                if round_.primary:
                    checksum_s = self._write_as_primary(item, step, round_, temp, sync)
                else:
                    checksum_s = self._write_as_peer(item, step, round_, temp, sync)
        except BaseException as e:
            if self._chain is not None:
                self._chain.broken()
            return self._failed(item.step, e)
        finally:
            self._group.writing = None  # peers waiting for this process wait on while set
        if self._chain is not None and self._links is not None:
            links = self._links
            kept, linked = self._store.kept, bool(links.names)
            written = (links.manifest, links.files)
            self._chain.written(item.step, links.layout, kept, written, linked)
        self._written(item, time.perf_counter() - start, checksum_s)
        try:  # what the log says never stops the writer (a thread that dies hangs saves)
            linked = None if self._chain is None else item.nbytes - self._store.written_bytes
            metrics = step.meta.get("metrics", {})
            self._log.saved(item, time.perf_counter() - start, metrics, linked)
        except Exception:
            logger.debug("the log line of step %d failed", item.step, exc_info=True)
        return None

    def _write_as_primary(
        self, item: SaveItem, step: _Described, round_: Round, temp: str, sync: Sync
    ) -> float:
        """Process 0 (or the only one): start the step, write its part, collect the
        others', write the step's description, commit, decide. The seconds spent on
        checksums."""
        final = os.path.join(self.directory, str(item.step))
        try:
            try:
                self._make_room(item, final)
                self._storage.begin(temp, self._lock.token)
            except BaseException as e:
                round_.start(e)
                raise
            round_.start(None)
            # The description files while the arrays commit where the step is written
            # under a temporary name (local): nothing can list it, or write into it,
            # before its commit renames it. A step written under its final name (a
            # bucket) is described after the fence, which says the step is still the
            # one this writer began. The meta needs every process's checksums, so with
            # several processes it waits for them.
            described_during_commit = temp != final
            alone = round_.count == 1

            def during_commit(sums: _format.Sums) -> None:
                self._write_descriptions(temp, step)
                if alone:
                    self._storage.write_meta(temp, dict(step.meta, checksums=sums), item.extra)

            sums, checksum_s = self._write_part(
                item, step, round_, temp, sync, during_commit if described_during_commit else None
            )
            sums = round_.collect(sums)
            self._fence(final)  # (object storage: still ours, before its files)
            self._store.merge(os.path.join(temp, _format.STATE_ITEM), round_.count)
            if round_.count > 1:  # (the root database's last version: the merge's)
                self._prune(temp)
            if not described_during_commit:
                self._write_descriptions(temp, step)
            if not (described_during_commit and alone):
                self._storage.write_meta(temp, dict(step.meta, checksums=sums), item.extra)
            self._commit(temp, final, self._unwritten(item, round_.count), sync)
            round_.committed(self._storage)
            self._retain(item, step)  # before the decision: every process lists the same
        except BaseException as e:  # its files removed now, or once the failure is reported
            later = self._storage.clean_failed(os.path.basename(temp), self._lock.token, e)
            if later is not None:
                self._unfinished.append(later)
            round_.decide(e)
            raise
        round_.decide(None)
        return checksum_s

    def _write_as_peer(
        self, item: SaveItem, step: _Described, round_: Round, temp: str, sync: Sync
    ) -> float:
        """Another process: once process 0 started the step, write this process's part,
        then wait for process 0's decision. The seconds spent on checksums."""
        round_.await_start()
        _, checksum_s = self._write_part(item, step, round_, temp, sync, None)
        round_.await_verdict()
        return checksum_s

    def _write_part(
        self,
        item: SaveItem,
        step: _Described,
        round_: Round,
        temp: str,
        sync: Sync,
        during_commit: Callable[[_format.Sums], None] | None,
    ) -> tuple[_format.Sums, float]:
        """This process's arrays of the step, reported to the others (or why they could
        not be written); `during_commit(sums)` runs while they commit. Their checksums and
        the seconds spent on them."""
        try:
            if item.ready is not None:  # copies from a GPU still in flight
                item.ready()
            if not round_.primary:
                self._enter_attempt(temp, round_)
            finish = self._write_arrays(temp, step, round_)
            sums, checksum_s = finish(during_commit)
            if round_.count == 1 or not round_.primary:
                self._prune(temp)
            if not round_.primary:  # (the primary's files are synced with the step's)
                part = os.path.join(temp, _format.STATE_ITEM, _part(round_))
                sync.tree(part, self._unwritten(item, 1))
        except BaseException as e:
            round_.report(e)
            raise
        round_.report(None, sums)
        return sums, checksum_s

    def _unwritten(self, item: SaveItem, processes: int) -> int:
        """The bytes of the step the syncs wait for, as `_durable` weighs them against
        the system's unwritten data: the array bytes, or those an incremental save
        wrote (its linked files are on disk already), by each of `processes`."""
        if self._chain is None:
            return item.nbytes
        return min(item.nbytes, self._store.written_bytes * processes)

    def _written(self, item: SaveItem, write_s: float, checksum_s: float) -> None:
        step = item.step
        retention_s, self._retention_s = self._retention_s, 0.0
        self._stats.written(
            SaveRecord(
                step,
                item.nbytes,
                item.blocking_s,
                item.handoff_s,
                write_s,
                checksum_s,
                retention_s,
                self._store.written_bytes if self._chain is not None else None,
            )
        )

    def _write_descriptions(self, temp: str, step: _Described) -> None:
        """The primary's file of a step that depends on no array written: Orbax's
        description of the tree (`state/_METADATA`). (Orbax's step file,
        `_CHECKPOINT_METADATA`, holds our record of the meta item: `write_meta`.)"""
        text = _store.state_metadata(tuple(path for path, _ in step.leaves))
        path = os.path.join(temp, _format.STATE_ITEM, _format.STATE_METADATA)
        self._storage.write_file(path, text.encode())

    def _write_arrays(
        self, temp: str, step: _Described, round_: Round
    ) -> Callable[..., tuple[_format.Sums, float]]:
        """Start writing this process's arrays of the step; returns once they are
        committing. The returned `finish(during_commit)` (`StoreWriter.write`) waits for
        the commit and gives their checksums and the time spent computing them."""
        flat = {}
        for path, leaf in step.leaves:
            if isinstance(leaf, ShardedArray):
                blocks = {k: _dtypes.storable(b) for k, b in leaf.written_here().items()}
                stored = _dtypes.storage_dtype(leaf.dtype)
                if round_.count == 1 and leaf.nbytes <= _format.SMALL_BYTES:
                    # A small leaf this process holds whole: one chunk (a memcpy costs
                    # less than a key per block).
                    flat[path] = _assemble(leaf.shape, stored, blocks)
                else:
                    flat[path] = dataclasses.replace(leaf, dtype=stored, blocks=blocks)
            elif round_.primary:  # host arrays (replicated): process 0 writes them
                flat[path] = leaf
        state = os.path.join(temp, _format.STATE_ITEM)
        previous = self._linked_from(flat, temp, round_.index)
        return self._store.write(
            state, flat, index=round_.index, zarrays=round_.primary, previous=previous
        )

    def _linked_from(
        self, flat: dict[tuple[str, ...], Any], temp: str, index: int
    ) -> _store.Kept | None:
        """Incremental saves: link the previous step's database into this one's, where
        the chain says to (`_incremental`); the copy of its chunks the writer kept, or
        None (this step is written whole: no previous step of this layout, a whole one
        due, or its files could not be linked; the kept copy is then let go before this
        step's is made)."""
        self._links = None
        if self._chain is None:
            return None
        layout = self._store.layout(flat)
        previous = self._chain.previous(layout)
        name, part = _incremental.relative(self.directory, temp), _incremental.part_of(index)
        self._links = _Links(layout, name, part, [])
        if previous is None:
            self._chain.broken()
            return None
        try:
            self._links.names = _incremental.link(self._storage, previous, name, part)
        except (OSError, _faults.StorageError) as e:
            logger.info("written whole: linking from step %d failed: %s", previous.step, e)
            self._chain.broken()
            return None
        return previous.kept

    def _prune(self, temp: str) -> None:
        """Incremental saves, once this process's database is final: the linked files it
        does not read removed, its manifest's digest and data files kept (the next save
        links from it only if it is still this one, and links those files)."""
        links = self._links
        if links is None:
            return
        if links.names:
            _incremental.prune(self._storage, links.name, links.part, links.names)
        links.manifest = _incremental.manifest_digest(self._storage, links.name, links.part)
        links.files = _incremental.files_of(self._storage, links.name, links.part)

    def _fence(self, final: str) -> None:
        """Object storage, before a step's files and its commit: this writer still
        holds the lock, and the step is still the one it began (`Bucket.fence`)."""
        self._storage.fence(os.path.basename(final), self._lock.token, self._check_directory)

    def _check_directory(self) -> None:
        """The directory we opened is still there and still the same directory (in
        object storage: our lock object is still ours); else nothing more is written."""
        self._storage.check_directory(self._identity, self._lock)

    def _retain(self, item: SaveItem, step: _Described) -> None:
        """Unlist the steps the rules no longer keep (`_retention`); their files are
        deleted by `_sweep` once the save is reported (a few ms per step the waiter
        need not wait for)."""
        if self._retention is not None:
            start = time.perf_counter()
            asides = self._retention.committed(item.step, step.meta)
            self._aside += asides
            self._retention_s = time.perf_counter() - start
            self._log.deleted([_format.step_of_aside(a) for a in asides], self._rules)

    def _enter_attempt(self, temp: str, round_: Round) -> None:
        """This process's part's folder in the attempt's temporary directory, which
        process 0 made: refused when process 0 has removed it again (it gave up on the
        step before this process came to it), rather than re-create a folder nobody
        removes (TensorStore creates the folders it writes into)."""
        try:
            self._storage.enter_attempt(temp, _part(round_))
        except FileNotFoundError:
            raise SaveError(
                f"process 0 had given up on this step before process {round_.index} began "
                f"to write its part (its temporary directory {os.path.basename(temp)!r} "
                "is gone); nothing was written"
            ) from None

    def _sweep(self) -> None:
        """Delete the steps retention set aside: after the save is reported, so the
        waiter does not wait for the few ms of unlinking a step's files."""
        if self._persistent is not None:
            self._persistent.sweep()
        while self._aside:
            self._storage.remove_aside(self._aside.pop())
        while self._unfinished:  # best effort: else the next opening removes it
            self._storage.remove_temp(self._unfinished.pop(), self._lock.token)


@dataclasses.dataclass
class _Links:
    """An incremental save's links: its layout, its name and database folder, the
    files linked into it (none: written whole)."""

    layout: tuple
    name: str
    part: str
    names: list[str]
    manifest: bytes = b""  # the digest of its database's manifest, once final
    files: tuple[str, ...] = ()  # its database's data files, once final


class SaveLog:
    """What the log (`logging.getLogger("jax_cb_ckpt")`) says of the saves: every save,
    and every step retention deletes, at DEBUG; at INFO the first save, then at most one
    line per `interval` seconds summing up the saves since the last one (the newest
    with its size, times and metrics, and the steps retention deleted), so that a long
    run saving every second writes a few lines a minute, not one per save (600 in 60
    s before); `flush` says what is left when the writer ends. The writer thread's own."""

    def __init__(self, directory: str, interval: float = 10.0) -> None:
        self.directory = directory
        self.interval = interval
        self._said_at: float | None = None  # monotonic time of the last INFO line
        self._since = 0  # saves since it
        self._newest = ""  # the newest save, said
        self._deleted: list[int] = []  # steps retention deleted since it

    def saved(
        self, item: SaveItem, write_s: float, metrics: dict[str, Any], linked: int | None = None
    ) -> None:
        """A step saved (`linked`: an incremental save's array bytes not written)."""
        shown = "".join(f", {name}={_brief(value)}" for name, value in metrics.items())
        some = "" if not linked else f", {_size(linked)} of it linked"
        self._newest = (
            f"step {item.step} ({_size(item.nbytes)}{some}, written in {write_s * 1e3:.1f} ms, "
            f"device waited {item.blocking_s * 1e3:.2f} ms{shown})"
        )
        logger.debug("saved %s to %s", self._newest, self.directory)
        self._since += 1
        now = time.monotonic()
        if self._said_at is None or now - self._said_at >= self.interval:
            self._say(now)

    def deleted(self, steps: list[int], rules: AnyOf | None) -> None:
        for step in steps:
            logger.debug("retention (%s): step %d deleted", rules and rules.describe(), step)
        self._deleted += steps

    def flush(self) -> None:
        if self._since or self._deleted:
            self._say(time.monotonic())

    def _say(self, now: float) -> None:
        if self._since > 1:
            line = f"saved {self._since} steps to {self.directory}, the newest {self._newest}"
        elif self._since == 1:
            line = f"saved {self._newest} to {self.directory}"
        else:
            line = f"saved nothing more to {self.directory}"
        if self._deleted:
            line += f"; retention deleted step(s) {_steps_text(self._deleted)}"
        logger.info("%s", line)
        self._said_at, self._since, self._newest, self._deleted = now, 0, "", []


def _brief(value: Any) -> str:
    """A metric as the log line shows it (under vmap: its members' range)."""
    values = np.asarray(value, dtype=np.float64).ravel()
    if values.size == 1:
        return f"{values[0]:.6g}"
    counted = values[~np.isnan(values)]  # (nanmin warns on all NaN: the writer's thread
    if counted.size == 0:  # would die of it where warnings are errors)
        return f"[nan x{values.size}]" if values.size else "[]"
    return f"[{counted.min():.6g} .. {counted.max():.6g}]"


def _size(nbytes: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024 or unit == "GiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024  # type: ignore[assignment]
    return f"{nbytes} B"


def _steps_text(steps: list[int]) -> str:
    if len(steps) <= 6:
        return ", ".join(map(str, steps))
    return f"{', '.join(map(str, steps[:3]))}, ..., {steps[-1]} ({len(steps)} in all)"


class _Described:
    """A step as it is written: its stored leaves, (name, array or per-device blocks)
    in the order of Orbax's nested dict (`_spec.stored_leaves`), and its `meta` record
    (without the checksums). Built from the item here, where they are written (in the
    writer thread: off the device's path), on first use: within the round, so a failure
    to build them is reported to the other processes like any failure of the step."""

    def __init__(
        self,
        item: SaveItem,
        rules: AnyOf | None,
        chain: Callable[[int, float | None, bool], dict[str, Any]] | None = None,
    ):
        self._item = item
        self._rules = rules
        self._chain = chain  # the rules' decisions (the seconds chain's), recorded with them

    @functools.cached_property
    def _built(
        self,
    ) -> tuple[list[tuple[tuple[str, ...], np.ndarray | ShardedArray]], dict[str, Any]]:
        item = self._item
        n = item.signature.state_leaves  # the state's leaves; the metrics follow
        specs, hosts = item.signature.stored(item.hosts)[:n], item.hosts[:n]
        meta = _format.meta_record(
            item.step,
            [s.to_json() for s in specs],
            _versions(),
            shardings=_described_shardings(specs, hosts),
            batch_shape=item.members.shape,
            members=item.members.tolist(),
            member_steps=None if item.member_steps is None else item.member_steps.tolist(),
            left=None if item.left is None else item.left.tolist(),
            saved_at=item.saved_at,
            metrics={
                name: _metric_value(host)
                for name, host in zip(item.signature.metrics, item.hosts[n:], strict=True)
            },
            retention=None if self._rules is None else self._rules.to_json(),
        )
        if self._chain is not None and meta.get("retention") is not None:
            seconds = _format.saved_seconds(meta["saved_at"])  # (as a later run reads it)
            meta["retention"].update(self._chain(item.step, seconds, not item.members.all()))
        return _spec.stored_leaves(specs, hosts), meta

    @property
    def leaves(self) -> list[tuple[tuple[str, ...], np.ndarray | ShardedArray]]:
        return self._built[0]

    @property
    def meta(self) -> dict[str, Any]:
        return self._built[1]


@functools.cache
def _versions() -> dict[str, str]:
    """What wrote a step, for `metadata()` and `jax-cb-ckpt show` (read once)."""
    import jaxlib

    def installed(name: str) -> str:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return "unknown"

    return {
        "library_version": version(),
        "jax_version": jax.__version__,
        "jaxlib_version": getattr(jaxlib, "__version__", installed("jaxlib")),
        "orbax_version": installed("orbax-checkpoint"),
        "tensorstore_version": installed("tensorstore"),
    }


def _described_shardings(
    specs: tuple[_spec.LeafSpec, ...], hosts: list[np.ndarray | ShardedArray]
) -> dict[str, dict[str, Any]]:
    """How each leaf saved per device was split: the mesh's axes and, per dimension,
    the mesh axes it is split over (`jax-cb-ckpt show` prints them)."""
    out = {}
    for spec, host in zip(specs, hosts, strict=True):
        if isinstance(host, ShardedArray):
            layout = host.layout
            out[spec.path] = {
                "mesh": dict(zip(layout.axis_names, layout.axis_sizes, strict=True)),
                "spec": [list(axes) for axes in layout.dims[host.leaf]],
            }
    return out


def _metric_value(host: np.ndarray | ShardedArray) -> bool | int | float | list[Any]:
    """A metric as JSON: a number (NaN and inf as Python's json writes them, which
    Orbax's JsonRestore and `json.loads` read back), or nested lists of them under vmap."""
    if isinstance(host, ShardedArray):
        host = _assemble(host.shape, host.dtype, host.written_here())
    value = np.asarray(host)
    kind = value.dtype.kind
    as_type = bool if kind == "b" else int if kind in "iu" else float
    return np.asarray(value, dtype=np.float64 if as_type is float else value.dtype).tolist()


def _assemble(
    shape: tuple[int, ...], dtype: np.dtype, blocks: dict[tuple[tuple[int, int], ...], np.ndarray]
) -> np.ndarray:
    out = np.empty(shape, dtype)
    for key, block in blocks.items():
        out[tuple(slice(a, b) for a, b in key)] = block
    return out


def _part(round_: Round) -> str:
    return f"{_format.PROCESS_PREFIX}{round_.index}"


def _in_the_way_message(final: str, is_checkpoint: bool) -> str:
    if is_checkpoint:
        return (
            f"step directory {final!r} already exists (written by another writer "
            "since this Checkpointer opened the directory); it was kept"
        )
    return (
        f"{final!r} already exists and is not a checkpoint (a user's file or folder?); "
        "it was left untouched. Fix: move it out of the checkpoint directory"
    )


def _untouched_message(urls: list[str]) -> str:
    shown = ", ".join(repr(u) for u in urls[:5]) + (", ..." if len(urls) > 5 else "")
    return (
        f"jax_cb_ckpt: {shown} hold{'s' if len(urls) == 1 else ''} the files of a whole "
        "step but no commit marker (commit_success.txt), and no writer of this location "
        "that is known to have died began it: a step copied there (`aws s3 cp "
        "--recursive`, `gsutil cp -r`), or one whose writer was cut short at its commit "
        "and whose lock was released since. It is not a step (never listed, restored "
        "or deleted) and was left untouched. Fix: remove it (or move it elsewhere); to "
        "have it as a step here, restore it where it came from and save it with a "
        "Checkpointer on this location."
    )


def _no_thread_message(directory: str, e: RuntimeError) -> str:
    """Why a Checkpointer cannot open: its writer thread could not start."""
    if sys.version_info[:3] in ((3, 12, 0), (3, 12, 1)) and "shutdown" in str(e):
        why = (
            f"Python {sys.version.split()[0]} refuses to start a thread once the main "
            "thread has ended (3.12.2 and later allow it while other threads run), and "
            "the writer is one. Fix: create the Checkpointer before the main thread ends "
            "(and hand it to the thread that trains), join the training threads at the "
            "end of the main thread, or use Python >= 3.12.2"
        )
    else:
        why = f"its writer thread could not start ({e})"
    return f"could not open {directory!r} for checkpoints: {why}."
