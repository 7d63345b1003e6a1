"""`Checkpointer`: the one object users hold. Ties the traced side, the host hand-off,
the writer thread and restore together; each lives in its own module."""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import weakref
from collections.abc import Callable, Hashable
from types import TracebackType
from typing import TYPE_CHECKING, Any, NoReturn, SupportsIndex

import jax
import jax.numpy as jnp
import numpy as np

from .._base import _warn
from .._base._errors import (
    CheckpointerClosedError,
    CheckpointError,
    CheckpointWarning,
    ConfigError,
    NoCheckpointError,
    SaveError,
    calling,
    entry,
    shown,
    where,
)
from .._base._types import (
    BestMode,
    Crossing,
    Gather,
    JsonExtra,
    OnDamaged,
    OnError,
    OnExisting,
    OnFull,
    PyTree,
)
from .._layout import _format
from .._read import _rebuild, _restore, _resume, _steps
from .._save import _route, _traced, _values
from .._save._exchange import Closed, Exchange
from .._save._host import HostSide, probe_callback_arrays
from .._save._stats import Stats, StatsRecorder
from .._storage import _places, _remote
from .._write import _processes
from .._write._writer import Writer
from . import _loops, _options, _run, _scan, _with_extra
from ._clock import SaveClock
from ._preempt import StopFlag

if TYPE_CHECKING:
    from jax.typing import ArrayLike

logger = logging.getLogger("jax_cb_ckpt")


class Checkpointer:
    """Saves checkpoints from inside jitted code and restores them.

    Example:
        ```python
        ckpt = jax_cb_ckpt.Checkpointer("/tmp/run", every=1000, max_to_keep=3)

        @jax.jit
        def train(state):
            def body(state, i):
                state = update(state)
                ckpt.maybe_save(state, i + 1)  # after i + 1 updates; fine inside jit
                return state, None
            return jax.lax.scan(body, state, jnp.arange(10_000))[0]

        with ckpt:  # exit waits for the writes and re-raises any writer error
            state = train(state)
        state = ckpt.restore(state)  # the latest checkpoint, same pytree types
        ```

    What blocks and what runs in the background: on a step that saves, the device
    program waits only while the state is handed to host memory the library keeps (and,
    with `on_full="block"`, while the queue is full). A writer thread (one per
    Checkpointer) writes standard Orbax checkpoints in the background. `wait()`,
    `close()`, `restore()` and context exit block the calling thread until pending
    saves are on disk, and re-raise the first writer error.

    Args:
        directory: where the step directories go; created if missing. Existing
            checkpoints there are kept (and count towards `max_to_keep`).
        every: default predicate of `maybe_save`: save when `step % every == 0`.
        max_to_keep: keep only the newest this many checkpoints (None: keep all).
        queue_size: at most this many saves in flight (handed over, not yet written).
        on_full: when `queue_size` saves are in flight, `"block"` makes the device
            wait (nothing lost); `"skip"` drops the save, counts it in `stats.skipped`
            and warns with its step at the next `wait()`/`close()`; `"newest"` keeps
            the device going and the newest saves: the new save takes the place of the
            oldest one still waiting (dropped unwritten, counted in
            `stats.superseded`), so the last save of a run is always written. With
            `"newest"`, `queue_size` saves wait and one more may be being written.
        compression: compress arrays with zstd (costs CPU the training may need).
        on_error: what a failed write (disk full, directory removed, ...) does.
            `"raise"`: the next hand-off fails the running computation, and `wait()` /
            `close()` raise `SaveError`. `"continue"`: training goes on without that
            checkpoint; failures are counted in `stats.failed`, the partial write is
            removed, and `wait()` / `close()` warn (`SaveFailedWarning`) instead.
        on_existing: a save at or below a step another run left in the directory:
            `"raise"` refuses it (`StepExistsError`), `"replace"` deletes that run's
            steps from the saved step on, then writes.
        crossing: how traced saves reach the host ([handoff.md](handoff.md)). `"buffer"`: the
            device program's own buffers are copied once into reused host memory
            (`jax.experimental.buffer_callback`; on CPU, and on CUDA GPUs by
            `cudaMemcpyAsync` on XLA's stream into pinned memory). `"callback"`:
            `jax.debug.callback`, which copies the state into fresh memory first (any
            backend; about 10x slower per byte on CPU, 20-50x on an H200). `"auto"`
            (default): `"buffer"` on CPU and CUDA GPUs, `"callback"` elsewhere.
        peer_timeout: in a multi-process run (`jax.distributed`), how many seconds a
            process waits for another with no sign of work from it on the same step
            (each writer sends a heartbeat about once a second from a background
            thread) before the save fails with an error naming that process
            ([multiprocess.md](multiprocess.md)).
            Every process creates a Checkpointer on the same directory; each writes
            its own devices' blocks and process 0 commits.
        every_seconds: also save when this many seconds have passed since the last
            save (or since the opening), for runs whose step time varies. Nothing
            crosses to the host for it on the steps in between: a `maybe_save` without
            `when=` asks the host every `check_every` steps (one scalar read under a
            `lax.cond`); `run()` and `ckpt.scan` ask at their chunk boundaries.
        check_every: how often (in steps) a `maybe_save` asks whether `every_seconds`
            have passed (default 100).
        initial_save: save the starting state of a fresh run too: `run()` and
            `restore_or_init` save step 0 when the directory has no checkpoint, and
            `ckpt.scan` saves its `init` at `start` when `start` is the Python int 0
            and the directory had no checkpoint when it was traced.
        keep_every: retention: keep every step that is a multiple of this, forever
            (a learning curve's checkpoints). Orbax: `EveryNSteps`.
        keep_every_seconds: retention: keep one step per this many seconds (the
            first step saved at least this long after the previous one so kept).
            Orbax: `EveryNSeconds`.
        keep_best: retention: keep the `keep_best` best steps by the metric `best`
            (a name given in `metrics=`), the highest with `mode="max"`, the lowest
            with `mode="min"`; under vmap, a step is kept while it is among any
            member's best. A step without that metric, or whose value is NaN, never
            counts as best. Orbax: `BestN` (`best_fn`, `best_mode`).
        best: the metric `keep_best` ranks by.
        mode: `"max"` (default) or `"min"`.
        on_damaged: what a restart (`restore_or_init`, `run`, `restore` without
            `step=`) does when its newest step is damaged (a flipped bit, a cut or
            edited file). `"fall_back"` (default): resume from the newest step that
            passes its checks; each newer step passed over is set aside under a name
            that is not a step (`<step>.jax_cb_ckpt-damaged-<hex>`, never deleted, shown
            by `jax-cb-ckpt ls`) and named in a `DamagedStepWarning`. `"raise"`: stop
            with a `DamagedStepError` instead, touching nothing.

    Retention: with no rule (`max_to_keep`, `keep_every`, `keep_every_seconds`,
    `keep_best`) every step is kept. With rules, a step is kept if any rule keeps it
    (Orbax's `AnyPreservationPolicy`), and the newest step always is; the writer
    applies them after each commit, in the background, to the library's own complete
    steps only. Rules changed between runs on one directory apply from the next commit;
    a step the previous rules kept and the new ones delete is named in a warning log.
    See [usage.md](usage.md#what-is-kept).
    """

    @_options.orbax_names
    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        every: int | None = None,
        max_to_keep: int | None = None,
        queue_size: int = 2,
        on_full: OnFull = "block",
        compression: bool = False,
        on_error: OnError = "raise",
        on_existing: OnExisting = "raise",
        crossing: Crossing = "auto",
        peer_timeout: float = 60.0,
        every_seconds: float | None = None,
        check_every: int | None = None,
        initial_save: bool = False,
        keep_every: int | None = None,
        keep_every_seconds: float | None = None,
        keep_best: int | None = None,
        best: str | None = None,
        mode: BestMode = "max",
        on_damaged: OnDamaged = "fall_back",
    ) -> None:
        # The parameters by name (`locals()` holds nothing else yet: no `super()` or
        # `__class__` in this method, which would add `__class__` to it): each goes to
        # the group with a field of its name, so the signature above is the only list.
        given = {name: value for name, value in locals().items() if name != "self"}
        options = self._options = _options.checked(**given)
        path = options.where.directory
        self._storage = _places.at(path)  # where the steps live: chosen once
        self._run_loops: dict[Hashable, _run.Loop] = {}  # run()'s jitted loops, reused on resume
        probe_callback_arrays()  # once per process; decides copy-free hand-off
        try:
            self._storage.make()
        except OSError as e:
            raise ConfigError(
                f"Checkpointer(directory={path!r}): cannot create the directory: {e}. "
                "Fix: check the path (a parent that is a file, permissions, a read-only "
                "mount), or pass a directory this process can create."
            ) from e
        self._stop = StopFlag()
        self._closed = False
        self._stats = StatsRecorder()
        self._told_best: set[tuple[str, ...]] = set()  # (_cross: metrics without `best`)
        seconds = options.when.every_seconds
        self._clock = None if seconds is None else SaveClock(seconds, self._stats)
        # refuses a second live writer of this directory (one per process of a run)
        lock = self._storage.lock(_lock_name())
        self._group = None
        try:
            list_steps = self._storage.list_steps
            self._group = _processes.current(path, options.failures.peer_timeout, list_steps)
            old_steps = self._steps_on_disk() if self._group is None else self._group.old_steps
            self._exchange = Exchange(
                path,
                queue_size=options.queue.slots,
                on_existing=options.failures.on_existing,
                old_steps=old_steps,
                on_full=options.queue.on_full,
                on_error=options.failures.on_error,
                stats=self._stats,
            )
            self._host = HostSide(self._exchange, options.queue.queue_size)
            if self._group is not None:
                self._host.on_step = self._group.hand_over
            self._writer = Writer(
                self._exchange,
                lock,
                path,
                rules=options.keep.rules,
                compression=options.where.compression,
                # Not a bound method: the writer must not keep this object alive.
                on_exit=functools.partial(self._exchange.close, Closed.AT_EXIT),
                group=self._group,
            )
        except BaseException as e:
            lock.release()
            if self._group is not None:
                self._group.close()
            if isinstance(e, CheckpointError):
                raise
            text = _remote.scrub(str(e))  # storage's answers may echo a credential
            raise SaveError(f"could not open {path!r} for checkpoints: {text}") from (
                _remote.scrubbed(e)
            )
        # Unclosed and garbage collected (a local of `main()`, `del ckpt`): the writer
        # still writes every save handed over, then stops; interpreter exit flushes it.
        self._finalizer = weakref.finalize(self, _collected, self._exchange, self._writer)
        self._finalizer.atexit = False

    # -- configuration (the options are fixed when the writer starts; users read this)

    @property
    def directory(self) -> str:
        """The checkpoint directory, absolute (or its gs:// / s3:// URL)."""
        return self._options.where.directory

    def __copy__(self) -> Checkpointer:
        return self  # one writer and one lock per directory: a copy is the same object

    def __deepcopy__(self, memo: dict[int, object]) -> Checkpointer:
        # Config objects holding a Checkpointer (dataclasses.asdict, copy.deepcopy of a
        # frozen config) get the same Checkpointer, not a second writer of the directory.
        return self

    def __reduce_ex__(self, protocol: SupportsIndex) -> NoReturn:
        raise ConfigError(
            f"a Checkpointer (on {self.directory!r}) cannot be pickled: it owns a writer "
            "thread and the directory's lock. Fix: pickle its directory and settings, and "
            "create a Checkpointer from them where they are unpickled."
        )

    def __repr__(self) -> str:
        state, options = "closed" if self._closed else "open", self._options
        return (
            f"Checkpointer({self.directory!r}, every={options.when.every}, "
            f"max_to_keep={options.keep.max_to_keep}, queue_size={options.queue.queue_size}, "
            f"on_full={options.queue.on_full!r}; {state})"
        )

    # -- saving ---------------------------------------------------------------------

    @entry("maybe_save")  # (the name every message of the call starts with)
    def maybe_save(
        self,
        state: PyTree,
        step: ArrayLike,
        *,
        when: ArrayLike | None = None,
        axis_name: Hashable | None = None,
        gather: Gather = "stack",
        shardings: PyTree = None,
        metrics: PyTree = None,
        last_step: ArrayLike | None = None,
        extra: JsonExtra = None,
    ) -> None:
        """Save `state` as checkpoint `step` if `when` holds (default: `step % every == 0`,
        or `every_seconds` passed since the last save, asked every `check_every` steps),
        or `step` is `last_step`.

        Convention: checkpoint `k` holds the state after `k` updates. Call it at the end
        of an update with the number of updates done (`i + 1` for a scan index `i`, or
        `TrainState.step` after `apply_gradients`): then the final state is saved, and
        `restore` / `run` continue exactly where training stopped.

        Safe anywhere in traced code (jit, scan, fori_loop, while_loop, cond, nested),
        under vmap, grad/jvp/vjp, remat and donation, and eagerly. The predicate is
        evaluated on the device; steps that do not save move no data to the host. On a
        step that saves, the device waits only for the hand-off of the state to host
        memory; the write runs in the writer thread. Outside any trace the state is
        copied before `maybe_save` returns: changing a numpy array afterwards does not
        change the checkpoint. Every call checks its arguments, state and metrics, also
        at a step that does not save.

        Under `vmap` one checkpoint holds the whole batch (a leading axis per vmap); it
        is made on a step where any member's predicate holds, and records which members
        asked (`metadata(step)["members"]`). See [transforms.md](transforms.md).

        Args:
            state: a pytree of arrays (jax or numpy, any numeric dtype, typed PRNG keys)
                and Python numbers.
            step: integer scalar >= 0, the checkpoint's step number. A step at or below
                a step another run left in the directory is refused (`on_existing`).
            when: optional boolean scalar (traced or Python) overriding `every` and
                `every_seconds`.
            axis_name: inside `pmap`/`shard_map`, the mapped axis (or a tuple of
                axes) the state is split over; one checkpoint per saving step. Naming
                all of the map's axes, every device hands over its own block, nothing is
                gathered (`gather="replicated"`: the first device hands over its copy);
                under `vmap` inside the map, or naming only some of the map's axes, the
                state is gathered along `axis_name` and the first device hands it over.
            gather: with `axis_name`, how the devices' values form the saved state:
                `"stack"` (default) on a new leading axis (what `pmap` returns);
                `"concat"` along the first axis (the global array of a `shard_map` leaf
                sharded on its first axis, as `lax.all_gather(tiled=True)`);
                `"replicated"`: the state is the same on every device, save the first
                device's copy without gathering (not checked: the other devices' copies
                are not read). With `"stack"` a leaf that is the same on every device
                (parameters after a `pmean`) is stored once per device, as `pmap`
                returns it ([transforms.md](transforms.md#restarting-a-pmap-run) says why).
            shardings: under `jit` with a sharded state, a pytree of
                `jax.sharding.NamedSharding` (or a prefix of the state's pytree, or one
                for every leaf) giving each leaf's sharding: every device then hands
                over only its own block (one replica of each) and nothing is gathered;
                the checkpoint stores the arrays as Orbax stores sharded `jax.Array`s
                (plain Orbax reads it with any sharding).
                Inferred from the leaves' types on meshes with explicit axes
                (`jax.make_mesh` default); otherwise the state is gathered first.
                On a CPU this always uses the "buffer" crossing. Required in a
                multi-process run: a mesh over every process's devices, each process
                writing its own devices' blocks ([multiprocess.md](multiprocess.md)).
            metrics: optional small pytree of real scalars (traced or not), e.g.
                `{"return": ret, "loss": loss}`, recorded with the step: they cross in
                the same hand-off as the state (no other transfer), are stored in the
                step's `meta` item as JSON (NaN and inf as they are), and are read by
                `metrics(step)`, shown by `jax-cb-ckpt ls` and ranked by `keep_best`.
                Named by their keys joined with "/" (`{"eval": {"return": r}}` and
                `{"eval/return": r}` are `"eval/return"`); under vmap each has one value
                per member. A function of the state (`metrics=lambda s: {"eval": ...}`)
                is computed on the device only at the steps that save (inside the
                save's `cond`), as `run` and `scan` compute theirs.
            last_step: the loop's last step (an int, or a traced integer scalar such
                as `num_updates`): that step is saved whatever `every`,
                `every_seconds` or `when` say, so the final state of a loop of your own
                is on disk (`run` saves its last step by itself). Without it, a loop
                whose length is not a multiple of `every` (or one saving by the clock)
                ends with an older checkpoint: `close()` warns when it can tell (with
                `every_seconds`, from the steps the clock was asked at).
            extra: host data stored beside the state as an Orbax JSON item (Orbax's
                `Composite(extra=JsonSave(...))`): a dict of JSON values (a config, a
                git hash), taken as it is at this call (inside `jit`: when it is
                traced), or a function of the step, `extra=lambda step: {"data_position":
                loader.position}`, called on the host with the step (an int) each time
                a save fires, never while tracing. At most 1 MiB as JSON; read back by
                `restore_extra(step)` and `metadata(step)["extra"]`
                ([usage.md](usage.md#json-beside-the-state-extra)).
        """
        self._check_usable()
        step_value = _traced.check_step(step)
        if when is None:
            wanted, condition = self._default_predicate(step, step_value)
        elif isinstance(when, bool):  # decided in Python too
            wanted, condition = when, None
        else:
            wanted, condition = True, _traced.check_when(when)
        if step_value is not None and (when is None or isinstance(when, bool)):
            # (with every_seconds the clock's condition is traced, yet the step is not)
            _traced.warn_if_constant_in_loop(step_value, due=wanted)
        if last_step is not None:
            wanted, condition = _or_last(step, step_value, last_step, wanted, condition)
        # In a ckpt.while_loop's body: only the members still in the loop (_loops.py).
        wanted, condition, step, step_value = _traced.only_live(wanted, condition, step, step_value)
        self._cross(
            _route.Request(
                state, step, step_value, condition, axis_name, gather, shardings, metrics, extra
            ),
            wanted=wanted,
        )

    def _default_predicate(
        self, step: ArrayLike, step_value: int | None
    ) -> tuple[bool, jax.Array | None]:
        """`maybe_save` without `when=`: `step % every == 0`, or (`every_seconds`) the
        clock says a save is due, asked every `check_every` steps. (wanted, condition):
        decided in Python where it can be (no cond in the program)."""
        every, clock = self._options.when.every, self._clock
        if every is None and clock is None:
            raise ConfigError(
                f"{where()}: no predicate. Fix: pass when=<bool scalar>, or create the "
                "Checkpointer with every=N to save when step % N == 0 (or "
                "every_seconds=T to save when T seconds have passed since the last save)."
            )
        check = self._options.when.check
        if step_value is not None:
            if every is not None and step_value % every == 0:
                return True, None
            if clock is None or step_value % check != 0:
                return False, None
            return True, clock.traced(jnp.asarray(step_value), in_loop=True)  # asked at run
        traced = _values.traced_step(step, None)
        conditions = []
        if every is not None:
            conditions.append(traced % every == 0)
        if clock is not None:
            conditions.append(clock.guarded(traced, check))
        return True, functools.reduce(jnp.logical_or, conditions)

    @entry("save")
    def save(
        self,
        state: PyTree,
        step: ArrayLike,
        *,
        axis_name: Hashable | None = None,
        gather: Gather = "stack",
        shardings: PyTree = None,
        metrics: PyTree = None,
        extra: JsonExtra = None,
    ) -> None:
        """Save `state` as checkpoint `step` unconditionally (traced code or eagerly).

        Same hand-off, blocking behaviour and arguments (`metrics=` included, a
        function of the state too, and `extra=`) as `maybe_save`.
        """
        self._check_usable()
        step_value = _traced.check_step(step)
        if step_value is not None:
            _traced.warn_if_constant_in_loop(step_value, due=True)
        # In a ckpt.while_loop's body: only the members still in the loop (_loops.py).
        _, condition, step, step_value = _traced.only_live(True, None, step, step_value)
        self._cross(
            _route.Request(
                state, step, step_value, condition, axis_name, gather, shardings, metrics, extra
            )
        )

    def _cross(self, request: _route.Request, *, wanted: bool = True) -> None:
        """One save on its way: its metrics computed (a function of the state: on the
        device, only where it saves), planned (`_route`: checked and described, also
        when not `wanted`; metrics without `keep_best`'s are warned about), then through
        the traced crossing or handed over eagerly."""
        if callable(request.metrics):
            metrics = None
            if wanted:
                metrics = _scan.metrics_at_save(request.metrics, request.state, request.condition)
            request = dataclasses.replace(request, metrics=metrics)
        processes = 1 if self._group is None else self._group.count
        route = _route.plan(request, processes=processes, wanted=wanted)
        names, best = route.metrics, self._options.keep.best
        if names and best is not None and best not in names and names not in self._told_best:
            # Once per set of names: a misspelt `best` would keep none of the steps.
            self._told_best.add(names)
            _warn.warn(
                f"{where()}(metrics=...): the metrics are {list(names)}, without {best!r}, "
                f"the metric keep_best ranks by (best={best!r}): these steps never count as "
                f"best. Fix: pass best= the name of one of them, or add {best!r} to metrics.",
                CheckpointWarning,
            )
        if isinstance(route, _route.Traced):
            crossing = self._options.where.crossing
            by_buffer = crossing == "buffer" or (crossing == "auto" and _traced.buffer_by_default())
            if route.layout is not None:
                assert route.mesh is not None  # (a route's layout and mesh are set together)
                _traced.cross_sharded(
                    self._host,
                    route.signature,
                    route.layout,
                    route.mesh,
                    route.step,
                    route.payload,
                    request.condition,
                    by_buffer=by_buffer,
                )
                return
            _traced.cross(
                self._host,
                route.signature,
                route.step,
                route.payload,
                request.condition,
                axis_name=request.axis_name,
                gather=request.gather,
                by_buffer=by_buffer,
            )
        elif isinstance(route, _route.Eager):
            # No JAX callback: every leaf is copied into host memory the library keeps,
            # with its exact dtype, before this call returns.
            self._host.eager(route.signature, route.step, route.hosts)
            self._raise_writer_error()

    def _ours_instead(self, failure: Exception) -> None:
        """A program the library runs itself (`run`'s loop, an eager `scan`) failed: an
        error of ours raised in its callback reaches Python wrapped by JAX
        (`JaxRuntimeError: INTERNAL: Error when calling buffer callback: ...`, our text
        at the end of a traceback); ours is raised instead, JAX's chained to it. Returns
        when the failure is not ours (the caller re-raises it). (Not a context manager:
        contextlib's frame would take the user's line from a warning issued here.)"""
        error = self._exchange.peek_error()
        if error is None or not self._exchange.stops_saving(error):
            return  # (a failed write under on_error="continue" fails no program)
        try:
            self._raise_writer_error()
        except CheckpointError as ours:
            raise ours from failure

    def _check_usable(self) -> None:
        if self._closed:
            raise CheckpointerClosedError(
                f"{where()}: this Checkpointer on {self.directory!r} is closed. Fix: "
                "create a new Checkpointer (it continues after the latest step on disk)."
            )
        # A writer failure surfaces at the next hand-off; in the user's thread when the
        # call happens here (eagerly or while tracing).
        self._raise_writer_error()

    def _raise_writer_error(self) -> None:
        """Issue pending warnings (at the user's line, `_warn`) and raise (or warn
        about) the first writer error (`Exchange.report`)."""
        self._exchange.report()

    # -- waiting and closing --------------------------------------------------------

    def wait(self) -> None:
        """Block until every save handed over so far is on disk; re-raise writer errors.

        Also waits for callbacks of jitted code still running (`jax.effects_barrier()`:
        every program this thread dispatched, whatever it returns), so call it from your
        own thread, never from inside a callback. A save that failed inside a callback is
        raised here with its text, whether or not the jitted call raised JAX's error (on
        an accelerator it may have returned before the program ran). When it returns,
        every checkpoint written so far is fsynced: it survives a crash or power loss.
        """
        self._wait()

    def _wait(self) -> None:
        failure = None
        if not self._closed:
            try:
                jax.effects_barrier()
            except jax.errors.JaxRuntimeError as e:
                # A program whose callback raised: ours was kept for this thread
                # (`_host._reported`) and is raised below, chained to JAX's; a failure
                # of the user's own code is theirs (JAX raises it from every barrier).
                failure = e
            self._exchange.drain()
            self._exchange.settle()  # later lower steps: a restarted counter (StepOrderWarning)
            # A per-device save that failed mid-step can no longer complete: give back
            # its memory and slot. (Saves still assembling are left alone: a program
            # another thread started since the barrier may be filling them.)
            self._host.settle_failed_assemblies()
        try:
            self._raise_writer_error()
        except CheckpointError as error:
            if failure is not None and error.__cause__ is None:
                raise error from failure
            raise

    def close(self) -> None:
        """`wait()`, then stop the writer thread and release the directory. Idempotent;
        blocks the calling thread."""
        self._close()

    def _close(self) -> None:
        if self._closed:
            # Idempotent; but a close cut short (Ctrl-C while it waited) left the
            # writer's error for the next close() or wait().
            self._raise_writer_error()
            return
        cut_short: BaseException | None = None
        try:
            self._wait()
            self._say_if_behind()
        except CheckpointError:
            raise
        except BaseException as e:  # Ctrl-C: the writer still finishes what it was given
            cut_short = e
            raise
        finally:
            self._closed = True
            self._exchange.close(Closed.BY_USER)
            self._finalizer.detach()
            # Nobody asks a stopped writer, so at its end it reports an error still
            # pending as a warning (for garbage collection and interpreter exit). After
            # an interrupted wait, wait here for the writer instead (stop() would as
            # long), take its error and notes first, and keep them for the next call.
            try:
                self._exchange.drain()
            finally:
                error, notes = self._exchange.take_error(), self._exchange.take_notes()
                self._writer.stop()
                for category, message in notes:
                    self._exchange.note(category, message)
                if error is not None:
                    self._exchange.record(error)
                    if cut_short is not None:
                        cut_short.add_note(
                            "jax_cb_ckpt: close() was interrupted with a writer error "
                            "pending (the next close() or wait() raises it): "
                            f"{type(error).__name__}: {error}"
                        )

    def _say_if_behind(self) -> None:
        """At close: the clock (every_seconds) was asked at a step after the newest one
        saved, so the loop went on past its last checkpoint and its final state is not
        on disk (a loop of one's own that saves by `every` or the clock only)."""
        seen = None if self._clock is None else self._clock.seen
        # The highest step written, not the last: one program's saves may reach the
        # host in any order (issue 54).
        saved = max((record.step for record in self._stats.snapshot().recent), default=None)
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

    def __enter__(self) -> Checkpointer:
        if self._closed:
            raise CheckpointerClosedError(
                f"with ckpt: this Checkpointer on {self.directory!r} is closed (a `with` "
                "block closes it at its end; so does close()). Fix: create a new "
                "Checkpointer for the new block (it continues after the latest step on "
                "disk)."
            )
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is None:
            self._close()
            return
        try:
            self._close()
        except CheckpointError as error:
            if isinstance(exc, jax.errors.JaxRuntimeError) and type(error).__name__ in str(exc):
                # The body failed *because* a callback raised our error, which JAX wrapped:
                # raise ours (chained to JAX's), so `except StepExistsError:` works. Its
                # own frames (inside the callback, the exchange) are JAX's traceback's
                # already: dropped, so the message is not buried under them twice.
                raise error.with_traceback(None) from exc
            # Otherwise the body's exception wins; the writer error goes along, once.
            exc.add_note(f"jax_cb_ckpt writer error: {error}")

    # -- runs that resume themselves ------------------------------------------------

    @entry("run")
    def run(
        self,
        body: _run.Body,
        init: PyTree,
        num_steps: int,
        *,
        batched: bool = False,
        sigint: bool = False,
        check_every: int | None = None,
        progress: bool = False,
        metrics: Callable[[PyTree], PyTree] | None = None,
        quiet: bool = False,
        extra: JsonExtra = None,
    ) -> PyTree:
        """Run `num_steps` of `state = body(state, step)`, resuming from the latest checkpoint.

        Restores the latest checkpoint of this directory if there is one (checkpoint `k`
        holds the state after `k` steps) and runs only the remaining steps, in one jitted
        `lax.while_loop`; saves every `every` steps, at the end, and when stopped. The
        result equals, bit for bit, an uninterrupted run: a fresh run and a resumed one
        execute the same compiled program.

        Blocks until the loop has finished and its last save is on disk. While it runs,
        SIGTERM (and SIGINT with `sigint=True`) is recorded instead of killing the
        process; the loop reads the request every `check_every` steps (default: `every`;
        each read is one host crossing), saves, stops, and `run` raises `Preempted` (a
        `SystemExit`) once the save is on disk. Run the same script again to continue.
        Ctrl-C with the default `sigint=False` stops the loop the same way (one note on
        stderr; more presses change nothing, Ctrl-\\ quits unsaved) and `run` then
        raises `KeyboardInterrupt`, as a Ctrl-C does; with `sigint=True` it raises
        `Preempted` with code 130, for schedulers that stop jobs by SIGINT.

        Args:
            body: one step, `body(state, step) -> state`; `step` is the int32 index of
                the step being taken (0-based).
            init: the initial state; also the `like` of restore.
            num_steps: total steps of the run.
            batched: `init` has a leading axis (seeds, say) and `body` is written for
                one member: the loop runs `vmap(body)` and saves the whole batch.
            sigint: SIGINT (Ctrl-C) stops the run as SIGTERM does, with `Preempted`
                (code 130), for schedulers that stop jobs by SIGINT; by default a Ctrl-C
                stops it too, but raises `KeyboardInterrupt`.
            check_every: read the stop request every this many steps (default:
                `every`); each read is one host crossing of a bool, and a stop is
                noticed (and saved) at the next read.
            progress: show a progress bar (tqdm: `pip install 'jax_cb_ckpt[progress]'`)
                with steps/s and the last saved step. It moves every `check_every`
                steps, from the stop-flag read the loop makes anyway: nothing more
                crosses to the host.
            metrics: `metrics(state) -> {name: scalar}`, recorded with each save (see
                `maybe_save`); computed on the device only at the steps that save.
                With `batched=True`, written for one member (it is vmapped).
            quiet: leave out the one line on stderr that says where the run starts
                ("jax_cb_ckpt: run resumed from step N of DIR", or "starting fresh at
                step 0 in DIR"): a mistyped directory trains from step 0 again, and
                this line shows it.
            extra: JSON stored with each save, as `maybe_save`'s (a function of the
                step is called at each save; a resumed run reads its step's back with
                `restore_extra(latest_step())` before calling `run`).

        With `every_seconds`, the loop also saves when that long has passed since the
        last save, asked at the stop-flag reads (every `check_every` steps, default
        `every`, or the Checkpointer's `check_every` without `every`). With
        `initial_save`, a fresh run saves `init` as step 0 first.

        Example:
            ```python
            ckpt = jax_cb_ckpt.Checkpointer("runs/ppo", every=50, max_to_keep=3)
            final = ckpt.run(update, init_state, num_steps=1000)
            ```
        """
        self._check_usable()
        try:
            return _run.run(
                self,
                self._options.when,
                self._stop,
                body,
                init,
                num_steps,
                batched=batched,
                sigint=sigint,
                check_every=check_every,
                progress=progress,
                loops=self._run_loops,
                metrics=metrics,
                quiet=quiet,
                extra=extra,
                resume=lambda like: self._resume(lambda: like),
            )
        except jax.errors.JaxRuntimeError as failure:
            self._ours_instead(failure)
            raise

    def scan(
        self,
        f: Callable[[PyTree, PyTree], tuple[PyTree, PyTree]],
        init: PyTree,
        xs: PyTree = None,
        length: int | None = None,
        reverse: bool = False,
        unroll: int | bool = 1,
        *,
        every: int | None = None,
        start: ArrayLike = 0,
        shardings: PyTree = None,
        metrics: Callable[[PyTree], PyTree] | None = None,
        extra: JsonExtra = None,
    ) -> tuple[PyTree, PyTree]:
        """`jax.lax.scan(f, init, xs, length, reverse, unroll)`, saving the carry every
        `every` iterations (default: the Checkpointer's `every`), with no conditional
        in the loop.

        Same results as `lax.scan`, bit for bit, under `jit`, `vmap` and `grad`. The
        scan is nested: chunks of `every` iterations, a save between two chunks (one
        unconditional crossing each), the iterations that fill no chunk in a scan of
        their own. Checkpoint `start + k` holds the carry after `k` iterations (`start`:
        the step of `init`, an int or a traced int). Use it instead of a `maybe_save`
        in the body when the saves come every N iterations of one scan: no predicate is
        evaluated per step (on a GPU, each one is a device-to-host copy the host waits
        for). What blocks and what runs in the background: as `maybe_save`.

        `metrics(carry) -> {name: scalar}` is recorded with each save (computed at the
        saves only). With the Checkpointer's `every_seconds` and no `every` here or
        on the Checkpointer, the chunks are `check_every` iterations long and a save
        is made between two of them when that long has passed since the last save (one
        host query per chunk); with both, at every `every`-th iteration as well. With
        `initial_save`, `init` is saved at `start` first. `extra=`: JSON stored with
        each save, as `maybe_save`'s.

        Example:
            ```python
            state, losses = ckpt.scan(train_step, state, batches, every=100)
            ```
        """
        every = self._options.when.every if every is None else every
        if every is None and self._clock is None:
            raise ConfigError(
                "scan: no every. Fix: pass every=N, or create the Checkpointer with "
                "every=N (or every_seconds=T)."
            )
        try:
            return _scan.scan(
                _with_extra.with_extra(self, extra, "scan"),
                self._options.when,
                f,
                init,
                xs,
                length,
                reverse,
                unroll,
                every=every,
                start=start,
                shardings=shardings,
                metrics=metrics,
            )
        except jax.errors.JaxRuntimeError as failure:
            self._ours_instead(failure)
            raise

    def fori_loop(
        self,
        lower: ArrayLike,
        upper: ArrayLike,
        body_fun: _loops.ForiBody,
        init_val: PyTree,
        *,
        every: int | None = None,
        check_every: int | None = None,
        stoppable: bool = False,
        save_last: bool = False,
        shardings: PyTree = None,
        metrics: Callable[[PyTree], PyTree] | None = None,
        extra: JsonExtra = None,
    ) -> PyTree:
        """`jax.lax.fori_loop(lower, upper, body_fun, init_val)`, bit for bit, in two
        forms.

        Without `every=`: JAX's loop for a body that saves (`maybe_save(s, i + 1)`).
        With a traced bound (under `vmap`, a batched `start` from `restore_or_init`, or
        per-member `upper`) it is a `while_loop`, and a member saves only while
        `i < upper` holds for it, as in `while_loop`; with bounds Python knows it is
        `lax.fori_loop` itself (a `scan`).

        With `every=N`: the loop saves its carry itself, after iteration `i` as
        checkpoint `i + 1` whenever `i + 1` is a multiple of `N`, with no conditional per
        iteration (on a GPU each one is a copy the host waits for). The loop is cut at
        the multiples of `N`: whole chunks of `N` iterations, each a loop of a static
        trip count (a scan) followed by one save; the iterations before the first
        multiple (a resume from another step) and after the last whole chunk run one at
        a time, deciding after each. Same results under `jit`, `vmap` and (bounds Python
        knows) `grad`. `lower` and `upper` may be traced: pass the restored step as
        `lower` and one program serves the fresh run and every resume. What blocks and
        what runs in the background: as `maybe_save`.

        Args:
            every: save the carry when `i + 1` is a multiple of it.
            check_every: with the Checkpointer's `every_seconds` or `stoppable`, ask the
                host (the clock, the stop request) every this many iterations, at a
                chunk end (default: `every`, or the Checkpointer's `check_every`
                without `every`); each ask is one host crossing of a bool.
            stoppable: read the stop request (`request_stop()`, or a signal handler of
                yours that calls it) at those asks; when one came, save and end the loop
                there, returning the carry saved. Check `ckpt.stop_requested` after the
                jitted call (`ckpt.run` does all of this for you).
            save_last: save after the last iteration too (checkpoint `upper`).
            shardings: as `maybe_save`.
            metrics: as `maybe_save`, a function of the carry (computed at saves only).
            extra: as `maybe_save`, stored with each save the loop makes (with `every=`
                or `check_every=`).

        Example:
            ```python
            @jax.jit
            def train(state, start):
                return ckpt.fori_loop(start, 10_000, lambda i, s: update(s), state, every=100)
            ```
        """
        if extra is not None and every is None and check_every is None:
            raise ConfigError(
                "fori_loop(extra=...): extra is an option of a loop that saves its carry "
                "itself, and this one saves nothing itself (no every= or check_every=). "
                "Fix: pass every=N, or pass extra= to the saves in its body."
            )
        return _loops.checkpointed_fori_loop(
            _with_extra.with_extra(self, extra, "fori_loop"),
            self._options.when,
            lower,
            upper,
            body_fun,
            init_val,
            every=every,
            check_every=check_every,
            stoppable=stoppable,
            save_last=save_last,
            shardings=shardings,
            metrics=metrics,
        )

    def while_loop(
        self,
        cond_fun: Callable[[_loops.Carry], ArrayLike],
        body_fun: Callable[[_loops.Carry], _loops.Carry],
        init_val: _loops.Carry,
    ) -> _loops.Carry:
        """`jax.lax.while_loop(cond_fun, body_fun, init_val)` for a loop that saves in its
        body: under `vmap`, a member saves only while `cond_fun` holds for it.

        Under `vmap` of a `while_loop` whose members stop at different iterations, JAX
        runs the body of a member that is done (and throws its result away after the
        body): a `maybe_save` there would save a state that member never had. In this
        loop every `maybe_save`/`save` (of any Checkpointer) traced in the body holds
        only for the members for which `cond_fun(carry)` holds, the body's carry; the
        body evaluates `cond_fun` once more for that. Unvmapped, or when every member
        goes on, it saves what `lax.while_loop` would. Same results as
        `lax.while_loop`, bit for bit
        ([transforms.md](transforms.md#vmap-of-a-while_loop-whose-members-stop-at-different-steps)).

        Example:
            ```python
            def run(x, start, n):
                def body(c):
                    i, x = c
                    ckpt.maybe_save(x + 1.0, i + 1)
                    return i + 1, x + 1.0

                return ckpt.while_loop(lambda c: c[0] < n, body, (start, x))[1]

            jax.jit(jax.vmap(run))(x, start, n)  # members stop at their own n
            ```
        """
        return _loops.while_loop(cond_fun, body_fun, init_val)

    def should_stop(self, step: ArrayLike) -> jax.Array:
        """Traced: has a stop been requested (signal during `run`, or `request_stop()`)?

        Each evaluation is one host crossing; guard it, e.g.
        `lax.cond(step % 100 == 0, ckpt.should_stop, lambda s: False, step)`. `step`
        must be the loop counter (an input that varies), so the read is not hoisted.
        """
        return self._stop.traced(step)

    def save_due(self, step: ArrayLike) -> jax.Array:
        """Traced: have `every_seconds` passed since the last save (or the opening)?

        One host crossing per evaluation, as `should_stop`; guard it, e.g.
        `lax.cond(step % 100 == 0, ckpt.save_due, lambda s: False, step)`, and pass
        the loop counter as `step`, so the read is not hoisted. A `maybe_save` without
        `when=` asks it by itself every `check_every` steps."""
        if self._clock is None:
            raise ConfigError(
                "save_due: this Checkpointer has no every_seconds. Fix: "
                "Checkpointer(directory, every_seconds=T)."
            )
        return self._clock.traced(step)

    def request_stop(self) -> None:
        """Ask running loops to save and stop, as SIGTERM would (thread-safe)."""
        self._stop.request()

    @property
    def stop_requested(self) -> bool:
        return self._stop.requested

    # -- reading --------------------------------------------------------------------

    @property
    def stats(self) -> Stats:
        """A snapshot of the counters and timings (see `Stats`)."""
        return self._stats.snapshot()

    def all_steps(self) -> list[int]:
        """Steps with a complete checkpoint on disk, ascending (pending saves excluded):
        ours, and the plain Orbax steps a restart resumes from (`jax_cb_ckpt.all_steps`)."""
        return _steps.all_steps(self.directory)

    def latest_step(self) -> int | None:
        """The newest complete step on disk (ours, or a plain Orbax step), or None."""
        return _steps.latest_step(self.directory)

    def metadata(self, step: int | None = None) -> dict[str, Any]:
        """The JSON description saved with `step` (default: the latest).

        Keys: `step`, `leaves` (path, stored dtype and shape, key impl of each leaf),
        `library_version`, and for saves made under `vmap`: `batch_shape` and `members`
        (which batch members' predicate held). A plain Orbax step says `format`
        "orbax" and `checksums` None (`jax_cb_ckpt.metadata`). A step saved with
        `extra=` has its JSON under `extra`. Does not wait for pending saves.
        """
        return _steps.metadata(self.directory, step=step)

    def restore_extra(self, step: int | None = None) -> dict[str, Any] | None:
        """The JSON saved with `step` (default: the latest) by `extra=`, or None when it
        was saved without (`jax_cb_ckpt.restore_extra`); checked against its CRC-32.
        Waits for pending saves first, as `restore` does; pair it with `restore(like,
        step=step)` for the state of the same step."""
        self.wait()
        return _steps.restore_extra(self.directory, step=step)

    def best_step(self, member: int | tuple[int, ...] | None = None) -> int | None:
        """The step with the best value of the metric `best` (the Checkpointer's, with
        its `mode`) among the complete steps on disk, or None when none has a valid
        one (missing or NaN values never count). Under vmap, `member=k` gives member
        k's best step; without it, the step holding the best value of any member.
        Reads each step's meta (one small file per step); does not wait for pending
        saves. Example: `ckpt.restore(like, step=ckpt.best_step())`."""
        keep = self._options.keep
        if keep.best is None:
            raise ConfigError(
                "best_step: this Checkpointer ranks no metric. Fix: create it with "
                "keep_best=N, best='<metric name>' (and mode='max' or 'min'), or use "
                "jax_cb_ckpt.best_step(directory, best=..., mode=...)."
            )
        return _steps.best_step(
            self.directory, best=keep.best, mode=keep.mode, member=member, ignore_recorded=True
        )

    def metrics(self, step: int | None = None) -> dict[str, Any]:
        """The metrics saved with `step` (default: the latest): {name: value}, a Python
        number for a plain save, a numpy array of the batch's shape (one value per
        member) for a save under vmap; {} when it was saved without `metrics=`. Does not
        wait for pending saves."""
        return _steps.metrics(self.directory, step=step)

    def metrics_table(self) -> list[dict[str, Any]]:
        """The metrics of every complete step on disk as one table (a row per step, and
        under vmap per member: step, member, metrics, which rules keep it), as
        `jax_cb_ckpt.metrics_table(directory)` gives it. Does not wait for pending
        saves."""
        return _steps.metrics_table(self.directory)

    @_steps.step_by_keyword
    @entry("restore")
    def restore(
        self,
        like: PyTree,
        *,
        step: int | None = None,
        verify: bool = True,
        member: int | tuple[int, ...] | None = None,
    ) -> PyTree:
        """Restore `step` (default: the newest that passes its checks) into the pytree
        types of `like`.

        Waits for pending saves first (see `wait()`), then blocks while reading. `like`
        may hold concrete arrays or `jax.ShapeDtypeStruct`s. `verify=False` skips the
        checksums; `member=k` restores member k of a batch saved under vmap (reading
        only its chunks). Without `step=` this is a restart, as in `restore_or_init`: a
        newer damaged step is passed over and set aside (see `on_damaged`), and the run
        continues from the step restored. See `jax_cb_ckpt.restore`.
        """
        self.wait()
        if step is None:
            resumed = self._resume(lambda: like, verify=verify, member=member)
            if resumed is None:
                # Nothing to resume from: the read says what the directory holds.
                _steps.pick_step(self._storage, None, "restore")
                raise NoCheckpointError(f"restore: no checkpoint in {self.directory!r}")
            return resumed[0]
        restored = _restore.restore(self.directory, like, step=step, verify=verify, member=member)
        self._continue_from(step)
        return restored

    def _continue_from(self, step: int) -> None:
        """The run goes on from the restored `step`: every step on disk now belongs to
        the past, and a save at or below one of them is a conflict (see `on_existing`);
        one at or below `step` itself is told that the loop's counter started again."""
        self._exchange.forget(self._steps_on_disk(), restored=step)

    def _steps_on_disk(self) -> list[int]:
        """The steps a save must not mix with: ours, and plain Orbax steps a restart
        would resume from (a save at or below one is a conflict, as with ours)."""
        return _steps.listing(self._storage, self._storage.examine_all()).steps

    def _resume(
        self,
        like: Callable[[], PyTree],
        *,
        verify: bool = True,
        member: int | tuple[int, ...] | None = None,
        fresh: Callable[[], PyTree] | None = None,
    ) -> tuple[PyTree, int | np.ndarray] | None:
        """A restart: (the state, its step) of the newest step that passes its checks
        (ours, or a plain Orbax step), the newer damaged ones passed over and set aside
        (`on_damaged`), said in one INFO line; None when there is nothing to resume from.
        `like()` is what the step is read into (made only when there is one to read).
        Members of a vmap batch that asked for no step of their own start again from
        `fresh()`'s state at step 0 (`restore_or_init`, said in the INFO line); without
        `fresh` they keep what the step holds, said in a `MemberStateWarning`. Waits for
        pending saves first."""
        self.wait()
        storage = self._storage
        resumed = _restore.resume(
            storage,
            like,
            verify=verify,
            member=member,
            on_damaged=self._options.failures.on_damaged,
        )
        if resumed.step is None:
            if resumed.error is not None and where() == "restore":
                raise resumed.refusal()  # asked to restore, and nothing can be: nothing moved
            _resume.report(storage, resumed, set_aside=True)  # a fresh start
            self._exchange.forget(self._steps_on_disk())
            return None
        resumed = _resume.report(storage, resumed, set_aside=True)
        step = resumed.step
        assert step is not None  # (report keeps the step read)
        self._continue_from(step)
        why = "the newest step that passes its checks"
        if resumed.passed:
            why += ", passing over " + ", ".join(str(p.step) for p in resumed.passed)
        if resumed.source == "orbax":
            why += "; a plain Orbax checkpoint, read unverified (Orbax keeps no checksums)"
        verb = "restored step" if where() == "restore" else "resumed from step"
        restart = resumed.value
        assert restart is not None
        start: int | np.ndarray = step
        state = restart.state
        if restart.unowned and fresh is None:
            _restore.say_unowned(restart.unowned, step)
        elif restart.unowned and fresh is not None:
            # Asked for no step: they start again, as a fresh run does.
            assert restart.member_steps is not None  # (set wherever members are unowned)
            state = _restore.members_from(storage, step, state, fresh(), restart.unowned)
            for index in restart.unowned:
                restart.member_steps[index] = 0
        if restart.member_steps is not None:  # members of a batch resume from their own
            start = restart.member_steps
            why += f"; the batch's members from their own newest steps {start.tolist()}"
        if restart.unowned and fresh is not None:
            why += (
                f"; member(s) {_restore.members_text(restart.unowned)} asked for no step "
                "and start again from init_fn's state at step 0"
            )
        logger.info("%s: %s %d of %s (%s)", where(), verb, step, self.directory, why)
        return state, start

    @entry("restore_or_init")
    def restore_or_init(
        self, init_fn: Callable[..., PyTree], *args: object, like: PyTree = None
    ) -> tuple[PyTree, int | np.ndarray]:
        """The state to start a run from, and its step: the newest checkpoint that
        passes its checks and its step, or `init_fn(*args)` and 0 when there is none.

        For a loop of your own, so that a fresh run and every resumed run execute one
        compiled program, bit for bit: compute the initial state here, in a call of its
        own (`init_fn`: jitted, or `jax.vmap`ped over seeds), and pass it to your jitted
        training function as an argument, with the returned step as a traced argument
        too (a `lax.fori_loop(start, num_updates, ...)`, saving `i + 1`). A training
        function that builds its initial state inside is another program than the one a
        resume runs (XLA compiles init-plus-updates differently from updates alone: the
        last bits of the trained values differ), so its runs can never be resumed
        exactly. `like` (default: the shapes of `init_fn(*args)`, by `jax.eval_shape`:
        nothing computed) is what the checkpoint is restored into; given, a weakly typed
        leaf of a fresh `init_fn(*args)` (a Python number) is cast to like's dtype there,
        so a fresh and a resumed run pass one signature. With `initial_save`, a
        fresh start saves the initial state as step 0 (on disk before it returns).
        A newer damaged step is passed over and set aside (see `on_damaged`); a plain
        Orbax checkpoint is resumed from too. Under vmap, a member that did not ask for
        the newest step (its predicate was false there: a finished member of a vmapped
        `ckpt.while_loop`) is restored from the newest step it asked for (one that asked
        for none, and was not at the newest step, from `init_fn(*args)` at step 0), and
        the step returned is then an int array of each member's step (pass it batched:
        `jax.vmap(train, in_axes=(0, 0))`, looping with `ckpt.fori_loop(start, ...)`;
        [transforms.md](transforms.md#vmap-of-a-while_loop-whose-members-stop-at-different-steps)).
        Waits for pending saves first;
        blocks while it restores or initialises.

        Example:
            ```python
            init = jax.jit(jax.vmap(init_one))  # one state per seed
            state, start = ckpt.restore_or_init(init, jax.random.split(key, 4))
            state = train(state, start)  # jit(vmap(...)): fori_loop(start, N, update)
            ```
        """
        self._check_usable()
        if not callable(init_fn):
            raise ConfigError(
                f"restore_or_init(init_fn={shown(init_fn)}): init_fn must be the "
                "function that makes the initial state, called as init_fn(*args) when "
                "there is no checkpoint. Fix: pass the function, then its arguments: "
                "restore_or_init(init, key)."
            )
        given = like

        @functools.cache
        def made_like() -> PyTree:  # (args closed over: Python numbers stay numbers)
            return jax.eval_shape(lambda: init_fn(*args)) if given is None else given

        def fresh() -> PyTree:
            init = init_fn(*args)
            if given is not None:  # a weakly typed leaf in like's (the loop's) dtype
                init = _rebuild.as_carried(init, given)
            return init

        resumed = self._resume(made_like, fresh=fresh)
        if resumed is not None:
            return resumed
        init = fresh()
        if self._options.when.initial_save:
            self.save(init, 0)
            self.wait()  # on disk before the run goes on (and lists its steps)
        return init, 0


def _or_last(
    step: ArrayLike,
    step_value: int | None,
    last_step: ArrayLike,
    wanted: bool,
    condition: jax.Array | None,
) -> tuple[bool, jax.Array | None]:
    """`maybe_save`'s (wanted, condition), or `step == last_step`: decided in Python
    where both are known, else one more term of the traced condition."""
    with calling(f"{where()}(last_step=...)"):
        last_value = _traced.check_step(last_step)
    if wanted and condition is None:
        return True, None  # saved anyway
    if step_value is not None and last_value is not None:
        return (True, None) if step_value == last_value else (wanted, condition)
    is_last = _values.traced_step(step, step_value) == _values.traced_step(last_step, last_value)
    if not wanted:
        return True, is_last
    assert condition is not None
    return True, condition | is_last


def _lock_name() -> str:
    """Process 0's lock file is the one of single-process runs; others have their own."""
    index = jax.process_index()
    return _format.LOCK_NAME if index == 0 else f"{_format.LOCK_NAME}.process_{index}"


def _collected(exchange: Exchange, writer: Writer) -> None:
    """The Checkpointer was garbage collected without `close()` (weakref finalizer)."""
    exchange.close(Closed.COLLECTED)
    writer.finish()  # writes what was handed over, then ends the thread
