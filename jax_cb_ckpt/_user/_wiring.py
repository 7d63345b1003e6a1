"""The parts a Checkpointer is made of, built once by `wire` from its options: the
storage, the exchange, the host side, the writer thread, the process group, the
directory's lock, the stop flag and the clock; and what the façade asks of them as a
whole (is it usable, wait, close, report the writer's first error).

`Parts` holds no reference to the Checkpointer: a Checkpointer nobody holds is garbage
collected as before, and its finalizer (`_collected`) hands the writer what was handed
over. The crossing of one save (`Parts.cross`, its own section below) is the host-side
wiring of the save path: the route planned, then the traced crossing or the eager copy.
"""

from __future__ import annotations

import dataclasses
import functools
import weakref
from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING, Any, TypeVar

import jax

from .._base import _warn
from .._base._errors import (
    CheckpointerClosedError,
    CheckpointError,
    CheckpointWarning,
    ConfigError,
    SaveError,
    where,
)
from .._handoff._exchange import Closed, Exchange
from .._handoff._stats import StatsRecorder
from .._layout import _format
from .._read import _plain, _steps
from .._save import _route, _traced
from .._save._host import HostSide, probe_callback_arrays
from .._storage import _faults, _places
from .._write import _processes
from .._write._persistent import Persistent
from .._write._writer import Writer
from . import _metrics
from ._clock import SaveClock
from ._options import Options
from ._preempt import StopFlag

if TYPE_CHECKING:
    from jax.typing import ArrayLike

    from .._storage._lock import DirectoryLock
    from .._storage._protocol import Storage

_T = TypeVar("_T")


def wire(options: Options, owner: object) -> Parts:
    """The parts of `owner` (a Checkpointer) for `options`: the directory made, its lock
    taken, the process group joined, the exchange, host side and writer started. On a
    failure, what was taken is given back and the error names the directory."""
    path = options.where.directory
    storage = _places.at(path)  # where the steps live: chosen once
    probe_callback_arrays()  # once per process; decides copy-free hand-off
    _make(storage, path)
    stats = StatsRecorder()
    seconds = options.when.every_seconds
    clock = None if seconds is None else SaveClock(seconds, stats)
    # refuses a second live writer of this directory (one per process of a run)
    lock = storage.lock(_lock_name())
    group = tier = None
    try:
        group = _processes.current(path, options.failures.peer_timeout, storage.list_steps)
        old_steps = _steps_on_disk(storage) if group is None else group.old_steps
        tier = _tier(options, storage)  # (its steps a save must not mix with either)
        if tier is not None:
            old_steps = sorted({*old_steps, *_steps_on_disk(tier.storage)})
        exchange = Exchange(
            path,
            queue_size=options.queue.slots,
            on_existing=options.failures.on_existing,
            old_steps=old_steps,
            on_full=options.queue.on_full,
            on_error=options.failures.on_error,
            stats=stats,
            is_plain=lambda step: _is_plain(storage, tier, step),
        )
        host = HostSide(exchange, options.queue.queue_size)
        if group is not None:
            host.on_step = group.hand_over
        if tier is not None:
            tier.note = exchange.note
        writer = _writer(options, exchange, lock, group, tier)
    except BaseException as e:
        lock.release()
        if tier is not None:
            tier.close()
        if group is not None:
            group.close()
        if isinstance(e, CheckpointError):
            raise
        text = _faults.scrub(str(e))  # storage's answers may echo a credential
        raise SaveError(f"could not open {path!r} for checkpoints: {text}") from (
            _faults.scrubbed(e)
        )
    # Unclosed and garbage collected (a local of `main()`, `del ckpt`): the writer
    # still writes every save handed over, then stops; interpreter exit flushes it.
    finalizer = weakref.finalize(owner, _collected, exchange, writer)
    finalizer.atexit = False
    parts = Parts(
        options, storage, stats, clock, StopFlag(), group, exchange, host, writer, finalizer
    )
    parts.persistent = None if tier is None else tier.storage
    return parts


def _tier(options: Options, local: Storage) -> Persistent | None:
    """The persistent tier of `persistent=` (`_write/_persistent.py`): its directory
    made and its own writer lock taken; None without one."""
    tiers = options.tiers
    if tiers.persistent is None:
        return None
    storage = _places.at(tiers.persistent)
    _make(storage, tiers.persistent, "persistent")
    lock = storage.lock(_format.LOCK_NAME)  # (one process: `Options` refuses more)
    try:
        return Persistent(
            local,
            tiers.persistent,
            lock,
            rules=tiers.rules,
            every=tiers.persistent_every,
            every_seconds=tiers.persistent_every_seconds,
        )
    except BaseException:
        lock.release()
        raise


def _make(storage: Storage, path: str, name: str = "directory") -> None:
    try:
        storage.make()
    except OSError as e:
        raise ConfigError(
            f"Checkpointer({name}={path!r}): cannot create the directory: {e}. "
            "Fix: check the path (a parent that is a file, permissions, a read-only "
            "mount), or pass a directory this process can create."
        ) from e


def _writer(
    options: Options,
    exchange: Exchange,
    lock: DirectoryLock,
    group: _processes.Group | None,
    tier: Persistent | None,
) -> Writer:
    return Writer(
        exchange,
        lock,
        options.where.directory,
        rules=options.keep.rules,
        compression=options.where.compression,
        incremental=options.where.incremental,
        full_every=options.where.full_every,
        # Not a bound method: the writer must not keep the Checkpointer alive.
        on_exit=functools.partial(exchange.close, Closed.AT_EXIT),
        group=group,
        persistent=tier,
    )


def _lock_name() -> str:
    """Process 0's lock file is the one of single-process runs; others have their own."""
    index = jax.process_index()
    return _format.LOCK_NAME if index == 0 else f"{_format.LOCK_NAME}.process_{index}"


def _collected(exchange: Exchange, writer: Writer) -> None:
    """The Checkpointer was garbage collected without `close()` (weakref finalizer)."""
    exchange.close(Closed.COLLECTED)
    writer.finish()  # writes what was handed over, then ends the thread


def _steps_on_disk(storage: Storage) -> list[int]:
    """The steps a save must not mix with: ours, and plain Orbax steps a restart
    would resume from (a save at or below one is a conflict, as with ours)."""
    return _steps.listing(storage, storage.examine_all()).steps


def _is_plain(storage: Storage, tier: Persistent | None, step: int) -> bool:
    """Is `step` a plain Orbax step of either tier (one that is never deleted)?"""
    tiers = [storage] if tier is None else [storage, tier.storage]
    return any(_plain.find(one, step) is not None for one in tiers)


@dataclasses.dataclass(eq=False)
class Parts:
    """A Checkpointer's parts (made by `wire`), and its state: closed or open."""

    options: Options
    storage: Storage
    stats: StatsRecorder
    clock: SaveClock | None  # with every_seconds
    stop: StopFlag
    group: _processes.Group | None  # a multi-process run's
    exchange: Exchange
    host: HostSide
    writer: Writer
    finalizer: weakref.finalize[Any, Any]
    closed: bool = False
    persistent: Storage | None = None  # the persistent tier's, with persistent=
    resumed_from: str | None = None  # the directory the last restart read (either tier)
    run_loops: dict[Hashable, Any] = dataclasses.field(default_factory=dict)  # run()'s, reused
    told_best: set[tuple[str, ...]] = dataclasses.field(default_factory=set)  # (cross)

    @property
    def directory(self) -> str:
        return self.options.where.directory

    def shown(self) -> str:
        """The Checkpointer's repr: its directory, main options, and open or closed."""
        options, state = self.options, "closed" if self.closed else "open"
        rules = options.keep.rules
        return (
            f"Checkpointer({self.directory!r}, every={options.when.every}, "
            f"keep={'all' if rules is None else rules.describe()!r}, "
            f"queue_size={options.queue.queue_size}, on_full={options.queue.on_full!r}; {state})"
        )

    def not_pickled(self) -> ConfigError:
        return ConfigError(
            f"a Checkpointer (on {self.directory!r}) cannot be pickled: it owns a writer "
            "thread and the directory's lock. Fix: pickle its directory and settings, and "
            "create a Checkpointer from them where they are unpickled."
        )

    # -- the user's thread: is it usable, what failed ----------------------------------

    def check_usable(self) -> None:
        if self.closed:
            raise CheckpointerClosedError(
                f"{where()}: this Checkpointer on {self.directory!r} is closed. Fix: "
                "create a new Checkpointer (it continues after the latest step on disk)."
            )
        # A writer failure surfaces at the next hand-off; in the user's thread when the
        # call happens here (eagerly or while tracing).
        self.report()

    def enter(self) -> None:
        """The start of a `with` block: refused once closed."""
        if self.closed:
            raise CheckpointerClosedError(
                f"with ckpt: this Checkpointer on {self.directory!r} is closed (a `with` "
                "block closes it at its end; so does close()). Fix: create a new "
                "Checkpointer for the new block (it continues after the latest step on "
                "disk)."
            )

    def report(self) -> None:
        """Issue pending warnings (at the user's line, `_warn`) and raise (or warn
        about) the first writer error (`Exchange.report`)."""
        self.exchange.report()

    def running(self, loop: Callable[[], _T]) -> _T:
        """`loop()`, a program the library runs itself (`run`'s loop, an eager `scan`),
        whose failure is ours when a callback of ours raised (`ours_instead`)."""
        try:
            return loop()
        except jax.errors.JaxRuntimeError as failure:
            self.ours_instead(failure)
            raise

    def ours_instead(self, failure: Exception) -> None:
        """A program the library runs itself failed: an error of ours raised in its
        callback reaches Python wrapped by JAX (`JaxRuntimeError: INTERNAL: Error when
        calling buffer callback: ...`, our text at the end of a traceback); ours is
        raised instead, JAX's chained to it. Returns when the failure is not ours (the
        caller re-raises it). (Not a context manager: contextlib's frame would take the
        user's line from a warning issued here.)"""
        error = self.exchange.peek_error()
        if error is None or not self.exchange.stops_saving(error):
            return  # (a failed write under on_error="continue" fails no program)
        try:
            self.report()
        except CheckpointError as ours:
            raise ours from failure

    def save_due(self, step: ArrayLike) -> jax.Array:
        if self.clock is None:
            raise ConfigError(
                "save_due: this Checkpointer has no every_seconds. Fix: "
                "Checkpointer(directory, every_seconds=T)."
            )
        return self.clock.traced(step)

    # -- the steps on disk, as the exchange sees them ----------------------------------

    def steps_on_disk(self) -> list[int]:
        """The steps of both tiers (with persistent=): a save mixes with neither."""
        steps = _steps_on_disk(self.storage)
        if self.persistent is not None:
            steps = sorted({*steps, *_steps_on_disk(self.persistent)})
        return steps

    def continue_from(self, step: int) -> None:
        """The run goes on from the restored `step`: every step on disk now belongs to
        the past, and a save at or below one of them is a conflict (see `on_existing`);
        one at or below `step` itself is told that the loop's counter started again."""
        self.exchange.forget(self.steps_on_disk(), restored=step)

    # -- waiting and closing -------------------------------------------------------------

    def wait(self) -> None:
        failure = None
        if not self.closed:
            try:
                jax.effects_barrier()
            except jax.errors.JaxRuntimeError as e:
                # A program whose callback raised: ours was kept for this thread
                # (`_host._reported`) and is raised below, chained to JAX's; a failure
                # of the user's own code is theirs (JAX raises it from every barrier).
                failure = e
            self.exchange.drain()
            self.exchange.settle()  # later lower steps: a restarted counter (StepOrderWarning)
            # A per-device save that failed mid-step can no longer complete: give back
            # its memory and slot. (Saves still assembling are left alone: a program
            # another thread started since the barrier may be filling them.)
            self.host.settle_failed_assemblies()
        try:
            self.report()
        except CheckpointError as error:
            if failure is not None and error.__cause__ is None:
                raise error from failure
            raise

    def close(self) -> None:
        if self.closed:
            # Idempotent; but a close cut short (Ctrl-C while it waited) left the
            # writer's error for the next close() or wait().
            self.report()
            return
        cut_short: BaseException | None = None
        try:
            self.wait()
            self._say_if_behind()
        except CheckpointError:
            raise
        except BaseException as e:  # Ctrl-C: the writer still finishes what it was given
            cut_short = e
            raise
        finally:
            self.closed = True
            self.exchange.close(Closed.BY_USER)
            self.finalizer.detach()
            self._stop_writer(cut_short)

    def _stop_writer(self, cut_short: BaseException | None) -> None:
        """Nobody asks a stopped writer, so at its end it reports an error still pending
        as a warning (for garbage collection and interpreter exit). After an interrupted
        wait, wait here for the writer instead (stop() would as long), take its error and
        notes first, and keep them for the next call."""
        try:
            self.exchange.drain()
        finally:
            error, notes = self.exchange.take_error(), self.exchange.take_notes()
            self.writer.stop()
            for category, message in notes:
                self.exchange.note(category, message)
            if error is not None:
                self.exchange.record(error)
                if cut_short is not None:
                    cut_short.add_note(
                        "jax_cb_ckpt: close() was interrupted with a writer error "
                        "pending (the next close() or wait() raises it): "
                        f"{type(error).__name__}: {error}"
                    )

    def exit(self, exc: BaseException | None) -> None:
        """The end of a `with` block: close; the body's exception wins over a writer
        error, unless the body failed because a callback raised that error."""
        if exc is None:
            self.close()
            return
        try:
            self.close()
        except CheckpointError as error:
            if isinstance(exc, jax.errors.JaxRuntimeError) and type(error).__name__ in str(exc):
                # The body failed *because* a callback raised our error, which JAX wrapped:
                # raise ours (chained to JAX's), so `except StepExistsError:` works. Its
                # own frames (inside the callback, the exchange) are JAX's traceback's
                # already: dropped, so the message is not buried under them twice.
                raise error.with_traceback(None) from exc
            # Otherwise the body's exception wins; the writer error goes along, once.
            exc.add_note(f"jax_cb_ckpt writer error: {error}")

    def _say_if_behind(self) -> None:
        """At close: the clock (every_seconds) was asked at a step after the newest one
        saved, so the loop went on past its last checkpoint and its final state is not
        on disk (a loop of one's own that saves by `every` or the clock only)."""
        seen = None if self.clock is None else self.clock.seen
        # The highest step written, not the last: one program's saves may reach the
        # host in any order (issue 54).
        saved = max((record.step for record in self.stats.snapshot().recent), default=None)
        if seen is None or (saved is not None and saved >= seen):
            return
        newest = "no step" if saved is None else f"step {saved}"
        _warn.warn(
            f"close: the loop reached step {seen} at least (asked the clock there), but "
            f"the newest checkpoint this Checkpointer saved in {self.directory!r} is "
            f"{newest}: the final state is not on disk, and a restore gives the older "
            "one. Fix: maybe_save(state, step, last_step=num_steps) saves the loop's last "
            "step whatever every/every_seconds say (ckpt.run saves it by itself).",
            CheckpointWarning,
        )

    # -- the crossing: how one save reaches the host side --------------------------------

    def cross(self, request: _route.Request, *, wanted: bool = True) -> None:
        """One save on its way: its metrics computed (a function of the state: on the
        device, only where it saves), planned (`_route`: checked and described, also
        when not `wanted`; metrics without `keep_best`'s are warned about), then through
        the traced crossing or handed over eagerly."""
        if callable(request.metrics):
            metrics = None
            if wanted:
                metrics = _metrics.metrics_at_save(
                    request.metrics, request.state, request.condition
                )
            request = dataclasses.replace(request, metrics=metrics)
        processes = 1 if self.group is None else self.group.count
        route = _route.plan(
            request, processes=processes, wanted=wanted, crossing=self.options.where.crossing
        )
        self._warn_without_best(route.metrics)
        if isinstance(route, _route.Traced):
            _traced.send(self.host, route)
        elif isinstance(route, _route.Eager):
            # No JAX callback: every leaf is copied into host memory the library keeps,
            # with its exact dtype, before this call returns.
            self.host.eager(route.signature, route.step, route.hosts)
            self.report()

    def _warn_without_best(self, names: tuple[str, ...]) -> None:
        """Once per set of metric names: a misspelt `best` would keep none of the steps."""
        best = self.options.keep.best
        if not names or best is None or best in names or names in self.told_best:
            return
        self.told_best.add(names)
        _warn.warn(
            f"{where()}(metrics=...): the metrics are {list(names)}, without {best!r}, "
            f"the metric the best-N rule ranks by (best={best!r}, or BestN({best!r}, ...)): "
            "these steps never count as best. Fix: rank by the name of one of them, or "
            f"add {best!r} to metrics.",
            CheckpointWarning,
        )
