"""`Checkpointer`: the one object users hold. Ties the traced side, the host hand-off,
the writer thread and restore together; each lives in its own module."""

from __future__ import annotations

import functools
import os
import weakref
from collections.abc import Callable, Hashable
from types import TracebackType
from typing import TYPE_CHECKING, Any, NoReturn, SupportsIndex

import jax

from . import (
    _format,
    _options,
    _processes,
    _remote,
    _restore,
    _route,
    _run,
    _scan,
    _steps,
    _storage,
    _traced,
    _tree,
)
from ._errors import (
    CheckpointerClosedError,
    CheckpointError,
    ConfigError,
    SaveError,
    shown,
)
from ._exchange import Closed, Exchange
from ._host import HostSide, probe_callback_arrays
from ._preempt import StopFlag
from ._stats import Stats, StatsRecorder
from ._types import Crossing, Gather, OnError, OnExisting, OnFull, PyTree
from ._writer import Writer

if TYPE_CHECKING:
    from jax.typing import ArrayLike


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
    """

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
    ) -> None:
        options = _options.checked(
            directory,
            every=every,
            max_to_keep=max_to_keep,
            queue_size=queue_size,
            on_full=on_full,
            compression=compression,
            on_error=on_error,
            on_existing=on_existing,
            crossing=crossing,
            peer_timeout=peer_timeout,
        )
        path = options.directory
        self._options = options
        self._storage = _storage.at(path)  # where the steps live: chosen once
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
        # refuses a second live writer of this directory (one per process of a run)
        lock = self._storage.lock(_lock_name())
        self._group = None
        try:
            list_steps = self._storage.list_steps
            self._group = _processes.current(path, options.peer_timeout, list_steps)
            old_steps = list_steps() if self._group is None else self._group.old_steps
            self._exchange = Exchange(
                path,
                queue_size=options.slots,
                on_existing=options.on_existing,
                old_steps=old_steps,
                on_full=options.on_full,
                on_error=options.on_error,
                stats=self._stats,
            )
            self._host = HostSide(self._exchange, options)
            if self._group is not None:
                self._host.on_step = self._group.hand_over
            self._writer = Writer(
                self._exchange,
                lock,
                options,
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

    # -- configuration (read-only: fixed when the writer starts) ---------------------

    @property
    def directory(self) -> str:
        """The checkpoint directory, absolute (or its gs:// / s3:// URL)."""
        return self._options.directory

    @property
    def every(self) -> int | None:
        return self._options.every

    @property
    def max_to_keep(self) -> int | None:
        return self._options.max_to_keep

    @property
    def queue_size(self) -> int:
        return self._options.queue_size

    @property
    def on_full(self) -> OnFull:
        return self._options.on_full

    @property
    def on_error(self) -> OnError:
        return self._options.on_error

    @property
    def on_existing(self) -> OnExisting:
        return self._options.on_existing

    @property
    def crossing(self) -> Crossing:
        return self._options.crossing

    def __copy__(self) -> Checkpointer:
        return self  # one writer and one lock per directory: a copy is the same object

    def __deepcopy__(self, memo: dict[int, object]) -> Checkpointer:
        # Config objects holding a Checkpointer (dataclasses.asdict, copy.deepcopy of a
        # frozen config) get the same Checkpointer, not a second writer of the directory.
        return self

    def __reduce_ex__(self, protocol: SupportsIndex) -> NoReturn:
        raise ConfigError(
            f"a Checkpointer (on {self._options.directory!r}) cannot be pickled: it owns a writer "
            "thread and the directory's lock. Fix: pickle its directory and settings, and "
            "create a Checkpointer from them where they are unpickled."
        )

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return (
            f"Checkpointer({self.directory!r}, every={self._options.every}, "
            f"max_to_keep={self._options.max_to_keep}, queue_size={self.queue_size}, "
            f"on_full={self.on_full!r}; {state})"
        )

    # -- saving ---------------------------------------------------------------------

    def maybe_save(
        self,
        state: PyTree,
        step: ArrayLike,
        *,
        when: ArrayLike | None = None,
        axis_name: Hashable | None = None,
        gather: Gather = "stack",
        shardings: PyTree = None,
    ) -> None:
        """Save `state` as checkpoint `step` if `when` holds (default: `step % every == 0`).

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
        change the checkpoint.

        Under `vmap` one checkpoint holds the whole batch (a leading axis per vmap); it
        is made on a step where any member's predicate holds, and records which members
        asked (`metadata(step)["members"]`). See [transforms.md](transforms.md).

        Args:
            state: a pytree of arrays (jax or numpy, any numeric dtype, typed PRNG keys)
                and Python numbers.
            step: integer scalar >= 0, the checkpoint's step number. A step at or below
                a step another run left in the directory is refused (`on_existing`).
            when: optional boolean scalar (traced or Python) overriding `every`.
            axis_name: inside `pmap`/`shard_map`, the mapped axis the state is split
                over: every leaf is gathered along it and the state is saved once, by
                the first device.
            gather: with `axis_name`, how the devices' values form the saved state:
                `"stack"` (default) on a new leading axis (what `pmap` returns);
                `"concat"` along the first axis (the global array of a `shard_map` leaf
                sharded on its first axis, as `lax.all_gather(tiled=True)`);
                `"replicated"`: the state is the same on every device, save the first
                device's copy without gathering.
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
        """
        where = "maybe_save"
        self._check_usable(where)
        step_value = _traced.check_step(step, where)
        if when is None:
            if self._options.every is None:
                raise ConfigError(
                    "maybe_save: no predicate. Fix: pass when=<bool scalar>, or create "
                    "the Checkpointer with every=N to save when step % N == 0."
                )
            if step_value is not None:  # decided in Python: no cond in the program
                wanted, condition = step_value % self._options.every == 0, None
            else:
                traced = _traced.traced_step(step, None, where)
                wanted, condition = True, traced % self._options.every == 0
        elif isinstance(when, bool):  # decided in Python too
            wanted, condition = when, None
        else:
            wanted, condition = True, _traced.check_when(when, where)
        if not wanted:
            _tree.describe_state(state, where)  # still check the state
            return
        self._cross(
            _route.Request(where, state, step, step_value, condition, axis_name, gather, shardings)
        )

    def save(
        self,
        state: PyTree,
        step: ArrayLike,
        *,
        axis_name: Hashable | None = None,
        gather: Gather = "stack",
        shardings: PyTree = None,
    ) -> None:
        """Save `state` as checkpoint `step` unconditionally (traced code or eagerly).

        Same hand-off, blocking behaviour and arguments as `maybe_save`.
        """
        where = "save"
        self._check_usable(where)
        step_value = _traced.check_step(step, where)
        self._cross(
            _route.Request(where, state, step, step_value, None, axis_name, gather, shardings)
        )

    def _cross(self, request: _route.Request) -> None:
        """One save on its way: planned (`_route`), then handed over eagerly or through
        the traced crossing."""
        processes = 1 if self._group is None else self._group.count
        route = _route.plan(request, processes=processes)
        if route is None:
            return
        if isinstance(route, _route.Eager):
            # No JAX callback: every leaf is copied into host memory the library keeps,
            # with its exact dtype, before this call returns.
            self._host.eager(route.signature, route.step, route.hosts)
            self._raise_writer_error()
            return
        by_buffer = self._options.crossing == "buffer" or (
            self._options.crossing == "auto" and _traced.buffer_by_default()
        )
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

    def _check_usable(self, where: str) -> None:
        if self._closed:
            raise CheckpointerClosedError(
                f"{where}: this Checkpointer on {self.directory!r} is closed. Fix: "
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

        Also waits for callbacks of jitted code still running (`jax.effects_barrier()`),
        so call it from your own thread, never from inside a callback. When it returns,
        every checkpoint written so far is fsynced: it survives a crash or power loss.
        """
        self._wait()

    def _wait(self) -> None:
        failure = None
        if not self._closed:
            try:
                jax.effects_barrier()
            except jax.errors.JaxRuntimeError as e:
                # A program whose callback raised (JAX raises the same failure from
                # every later barrier; the caller of that program has seen it already).
                failure = e
            self._exchange.drain()
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
                # raise ours (chained to JAX's), so `except StepExistsError:` works.
                raise error from exc
            # Otherwise the body's exception wins; the writer error goes along, once.
            exc.add_note(f"jax_cb_ckpt writer error: {error}")

    # -- runs that resume themselves ------------------------------------------------

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

        Example:
            ```python
            ckpt = jax_cb_ckpt.Checkpointer("runs/ppo", every=50, max_to_keep=3)
            final = ckpt.run(update, init_state, num_steps=1000)
            ```
        """
        self._check_usable("run")
        return _run.run(
            self,
            self._stop,
            body,
            init,
            num_steps,
            batched=batched,
            sigint=sigint,
            check_every=check_every,
            progress=progress,
            loops=self._run_loops,
        )

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

        Example:
            ```python
            state, losses = ckpt.scan(train_step, state, batches, every=100)
            ```
        """
        every = self._options.every if every is None else every
        if every is None:
            raise ConfigError(
                "scan: no every. Fix: pass every=N, or create the Checkpointer with every=N."
            )
        return _scan.scan(
            self,
            f,
            init,
            xs,
            length,
            reverse,
            unroll,
            every=every,
            start=start,
            shardings=shardings,
        )

    def should_stop(self, step: ArrayLike) -> jax.Array:
        """Traced: has a stop been requested (signal during `run`, or `request_stop()`)?

        Each evaluation is one host crossing; guard it, e.g.
        `lax.cond(step % 100 == 0, ckpt.should_stop, lambda s: False, step)`. `step`
        must be the loop counter (an input that varies), so the read is not hoisted.
        """
        return self._stop.traced(step)

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
        """Steps with a complete checkpoint on disk, ascending (pending saves excluded)."""
        return _steps.all_steps(self.directory)

    def latest_step(self) -> int | None:
        """The newest complete step on disk, or None."""
        return _steps.latest_step(self.directory)

    def metadata(self, step: int | None = None) -> dict[str, Any]:
        """The JSON description saved with `step` (default: the latest).

        Keys: `step`, `leaves` (path, stored dtype and shape, key impl of each leaf),
        `library_version`, and for saves made under `vmap`: `batch_shape` and `members`
        (which batch members' predicate held). Does not wait for pending saves.
        """
        return _steps.metadata(self.directory, step=step)

    @_steps.step_by_keyword
    def restore(
        self,
        like: PyTree,
        *,
        step: int | None = None,
        verify: bool = True,
        member: int | tuple[int, ...] | None = None,
    ) -> PyTree:
        """Restore `step` (default: the latest) into the pytree types of `like`.

        Waits for pending saves first (see `wait()`), then blocks while reading. `like`
        may hold concrete arrays or `jax.ShapeDtypeStruct`s. `verify=False` skips the
        checksums; `member=k` restores member k of a batch saved under vmap (reading
        only its chunks). See `jax_cb_ckpt.restore`.
        """
        self.wait()
        restored = _restore.restore(self.directory, like, step=step, verify=verify, member=member)
        # The run goes on from the restored step: every step on disk now belongs to the
        # past, and saving at or below one of them is a conflict (see `on_existing`).
        self._exchange.forget(self._storage.list_steps())
        return restored

    def restore_or_init(
        self, init_fn: Callable[..., PyTree], *args: object, like: PyTree = None
    ) -> tuple[PyTree, int]:
        """The state to start a run from, and its step: the latest checkpoint and its
        step, or `init_fn(*args)` and 0 when there is none.

        For a loop of your own, so that a fresh run and every resumed run execute one
        compiled program, bit for bit: compute the initial state here, in a call of its
        own (`init_fn`: jitted, or `jax.vmap`ped over seeds), and pass it to your jitted
        training function as an argument, with the returned step as a traced argument
        too (a `lax.fori_loop(start, num_updates, ...)`). A training function that
        builds its initial state inside is another program than the one a resume runs
        (XLA compiles init-plus-updates differently from updates alone: the last bits of
        the trained values differ), so its runs can never be resumed exactly.
        `like` (default: the shapes of `init_fn(*args)`, by `jax.eval_shape`: nothing
        computed) is what the checkpoint is restored into. Waits for pending saves
        first; blocks while it restores or initialises.

        Example:
            ```python
            init = jax.jit(jax.vmap(init_one))  # one state per seed
            state, start = ckpt.restore_or_init(init, jax.random.split(key, 4))
            state = train(state, start)  # jit(vmap(...)): fori_loop(start, N, update)
            ```
        """
        self._check_usable("restore_or_init")
        if not callable(init_fn):
            raise ConfigError(
                f"restore_or_init(init_fn={shown(init_fn)}): init_fn must be the "
                "function that makes the initial state, called as init_fn(*args) when "
                "there is no checkpoint. Fix: pass the function, then its arguments: "
                "restore_or_init(init, key)."
            )
        self.wait()
        latest = self.latest_step()
        if latest is None:
            return init_fn(*args), 0
        if like is None:  # (args closed over: Python numbers among them stay numbers)
            like = jax.eval_shape(lambda: init_fn(*args))
        return self.restore(like, step=latest), latest


def _lock_name() -> str:
    """Process 0's lock file is the one of single-process runs; others have their own."""
    index = jax.process_index()
    return _format.LOCK_NAME if index == 0 else f"{_format.LOCK_NAME}.process_{index}"


def _collected(exchange: Exchange, writer: Writer) -> None:
    """The Checkpointer was garbage collected without `close()` (weakref finalizer)."""
    exchange.close(Closed.COLLECTED)
    writer.finish()  # writes what was handed over, then ends the thread
