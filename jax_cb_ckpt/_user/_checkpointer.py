"""`Checkpointer`, the one object users hold: a façade whose parts `_wiring.wire` makes
from the options; each public method is one call into the module that does the work
(`_when`, `_wiring`, `_restart`, `_read`, `_run`, `_scan`, `_loops`)."""

from __future__ import annotations

import os
from collections.abc import Callable, Hashable, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any, NoReturn, SupportsIndex

import jax
import numpy as np

from .._base._errors import entry
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
from .._handoff._stats import Stats
from .._layout._rule import Rule
from .._read import _steps
from . import _loops, _options, _restart, _run, _scan, _when, _wiring

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
        directory: where the step directories go; created if missing (steps there kept).
        every: default predicate of `maybe_save`: save when `step % every == 0`.
        max_to_keep: keep only the newest this many checkpoints (None: keep all).
        queue_size: at most this many saves in flight (handed over, not yet written).
        on_full: with `queue_size` saves in flight, `"block"` (the device waits), `"skip"`
            or `"newest"` ([usage.md](usage.md#queue-back-pressure-and-memory)).
        compression: compress arrays with zstd (costs CPU the training may need).
        on_error: a failed write: `"raise"` (`SaveError`) or `"continue"` (counted and
            warned) ([usage.md](usage.md#failures)).
        on_existing: a save at or below a step another run left there: `"raise"`
            (`StepExistsError`) or `"replace"` (that run's steps from there on deleted).
        crossing: how traced saves reach the host: `"buffer"` (one copy of the program's
            own buffers; CPU, CUDA), `"callback"` (`jax.debug.callback`, any backend,
            slower), `"auto"`: `"buffer"` where it can ([handoff.md](handoff.md)).
        peer_timeout: multi-process runs: seconds to wait for a silent process before
            the save fails naming it ([multiprocess.md](multiprocess.md)).
        every_seconds: also save when this many seconds have passed since the last save
            ([usage.md](usage.md#choosing-when-to-save)).
        check_every: how often (in steps) a bare `maybe_save` asks the clock (100).
        initial_save: `run()`, `restore_or_init` and `ckpt.scan` save a fresh start.
        keep_every: retention ([usage.md](usage.md#what-is-kept)): every multiple of this
            (a step any rule keeps is kept, and the newest always is).
        keep_every_seconds: retention: one step per this many seconds.
        keep_best: retention: this many best steps by the metric `best`.
        best: the metric `keep_best` ranks by (a name given in `metrics=`).
        mode: whether a higher (`"max"`) or lower (`"min"`) `best` is better.
        keep: the rules as objects instead of keywords, e.g. `keep=[jax_cb_ckpt.LatestN(3),
            jax_cb_ckpt.BestN("loss", 2, "min")]` (also `EveryNSteps`, `EveryNSeconds`).
        on_damaged: a restart whose newest step is damaged: `"fall_back"` to the newest
            step that passes its checks, the newer ones set aside, or `"raise"`
            (`DamagedStepError`) ([resume.md](resume.md#the-restarts-rules)).
        persistent: a second, persistent tier (a bucket URL or a directory): every
            `persistent_every`-th step (or one per `persistent_every_seconds`) saved in
            `directory`, the fast local tier, is also copied there by the writer, kept
            by `persistent_keep` (rule objects; None: all); a restart takes the newest
            intact step of either ([usage.md](usage.md#two-tiers-local-and-persistent)).
        incremental: a step links the chunks that did not change since the step before
            it; every step stays a whole Orbax checkpoint ([usage.md](usage.md#incremental-saves)).
        full_every: incremental saves: one save in this many is written whole (the 1st,
            17th, ... with 16; None: only the first).
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
        keep: Sequence[Rule] | None = None,
        on_damaged: OnDamaged = "fall_back",
        persistent: str | os.PathLike[str] | None = None,
        persistent_every: int | None = None,
        persistent_every_seconds: float | None = None,
        persistent_keep: Sequence[Rule] | None = None,
        incremental: bool = False,
        full_every: int | None = 16,
    ) -> None:
        # The parameters by name (`locals()` holds nothing else yet: no `super()` or
        # `__class__` in this method, which would add `__class__` to it): each goes to
        # the group with a field of its name, so the signature above is the only list.
        given = {name: value for name, value in locals().items() if name != "self"}
        self._options = _options.checked(**given)
        self._parts = _wiring.wire(self._options, owner=self)

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
        raise self._parts.not_pickled()

    def __repr__(self) -> str:
        return self._parts.shown()

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
        or `every_seconds` passed), or `step` is `last_step`. Checkpoint `k` holds the
        state after `k` updates: save `i + 1` after update `i`.

        Safe anywhere in traced code, under vmap, grad, remat and donation, and eagerly
        ([transforms.md](transforms.md)). Steps that do not save move no data to the
        host. On a step that saves, the device waits only for the hand-off of the state
        to host memory (eagerly: a copy); the write runs in the writer thread.

        Args:
            state: a pytree of arrays (jax or numpy, typed PRNG keys) and numbers.
            step: integer scalar >= 0.
            when: optional boolean scalar overriding `every` and `every_seconds`.
            axis_name: inside `pmap`/`shard_map`, the mapped axis (or axes) the state is
                split over ([transforms.md](transforms.md#restarting-a-pmap-run)).
            gather: with `axis_name`: `"stack"` (as `pmap` returns it), `"concat"`
                (`shard_map`), or `"replicated"` (the first device's copy).
            shardings: each leaf's `NamedSharding` under `jit`: every device hands over
                its own block, nothing is gathered ([usage.md](usage.md#sharded-states)).
            metrics: scalars recorded with the step, or a function of the state
                computed only where it saves ([usage.md](usage.md#metrics-with-a-step)).
            last_step: the loop's last step, saved whatever `every` or `when` say.
            extra: JSON stored beside the state as an Orbax JSON item: a dict (taken at
                this call; in `jit`, when traced) or a function of the step called on
                the host at each save, never traced; read back by `restore_extra`
                ([usage.md](usage.md#json-beside-the-state-extra)).
        """
        return _when.maybe_save(
            self._parts, state, step, when, axis_name, gather, shardings, metrics, last_step, extra
        )

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

        Same hand-off, blocking behaviour and arguments as `maybe_save`.
        """
        return _when.save(self._parts, state, step, axis_name, gather, shardings, metrics, extra)

    # -- waiting and closing --------------------------------------------------------

    def wait(self) -> None:
        """Block until every save handed over so far is on disk (fsynced) and re-raise
        writer errors. Waits for this thread's programs too (`jax.effects_barrier()`):
        call it from your own thread, never from inside a callback."""
        return self._parts.wait()

    def close(self) -> None:
        """`wait()`, then stop the writer thread and release the directory. Idempotent;
        blocks the calling thread."""
        return self._parts.close()

    def __enter__(self) -> Checkpointer:
        self._parts.enter()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        return self._parts.exit(exc)

    # -- loops ------------------------------------------------------------------------

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

        Runs the steps after the latest checkpoint in one jitted loop, saving every
        `every` steps (or by `every_seconds`), at the end and when stopped; the result
        equals an uninterrupted run bit for bit. Blocks until the loop has finished and
        its last save is on disk. SIGTERM (or SIGINT with `sigint=True`) saves, stops
        and raises `Preempted`; a Ctrl-C otherwise raises `KeyboardInterrupt` after the
        save ([resume.md](resume.md#ckptrun-the-loop-that-resumes-itself)).

        `body(state, step) -> state` is one step (`step`: int32, 0-based); `init` is
        also restore's `like`; `batched`: `init` has a leading axis, `body` is written
        for one member; `check_every`: read the stop request every this many steps
        (default: `every`); `progress`: a tqdm bar; `metrics(state)`: recorded with each
        save; `quiet`: no line on stderr saying where the run starts; `extra`: JSON
        stored with each save, as `maybe_save`'s.
        Example: `final = ckpt.run(update, init_state, num_steps=1000)`.
        """
        return _run.run(self, self._parts, **_given(locals()))

    def scan(
        self,
        f: _scan.ScanBody,
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
        """`jax.lax.scan(f, init, xs, length, reverse, unroll)`, bit for bit, saving the
        carry as checkpoint `start + k` after every `every`-th iteration `k` (default:
        the Checkpointer's `every`) with no conditional in the loop; `metrics(carry)` is
        recorded with each save, `extra=` as `maybe_save`'s. What blocks: as `maybe_save`
        ([usage.md](usage.md#choosing-when-to-save))."""
        return _scan.scan(self, self._parts, **_given(locals()))

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
        """`jax.lax.fori_loop(lower, upper, body_fun, init_val)`, bit for bit.

        Without `every=`: for a body that saves (under `vmap` with traced bounds, a
        member saves only while `i < upper`). With `every=N`: saves the carry as
        checkpoint `i + 1` at the multiples of `N`, with no conditional per iteration.
        `lower` and `upper` may be traced (one program for a fresh run and a resume).
        `check_every`: with `every_seconds` or `stoppable`, ask the host every this many
        iterations; `stoppable`: save and end the loop when a stop was requested;
        `save_last`: save checkpoint `upper` too; `extra`: as `maybe_save`'s, with
        `every=` or `check_every=`. What blocks: as `maybe_save`.
        Example: `ckpt.fori_loop(start, 10_000, lambda i, s: update(s), s, every=100)`.
        """
        return _loops.checkpointed_fori_loop(self, self._options.when, **_given(locals()))

    def while_loop(
        self,
        cond_fun: Callable[[_loops.Carry], ArrayLike],
        body_fun: Callable[[_loops.Carry], _loops.Carry],
        init_val: _loops.Carry,
    ) -> _loops.Carry:
        """`jax.lax.while_loop(cond_fun, body_fun, init_val)`, bit for bit, for a loop that
        saves in its body: under `vmap`, a member saves only while `cond_fun` holds for
        it (JAX runs the body of finished members too, and throws the result away)
        ([transforms.md](transforms.md#vmap-of-a-while_loop-whose-members-stop-at-different-steps))."""
        return _loops.while_loop(cond_fun, body_fun, init_val)

    def should_stop(self, step: ArrayLike) -> jax.Array:
        """Traced: has a stop been requested (signal during `run`, or `request_stop()`)?

        One host crossing per evaluation: guard it, e.g. `lax.cond(step % 100 == 0,
        ckpt.should_stop, lambda s: False, step)`, with the loop counter as `step`."""
        return self._parts.stop.traced(step)

    def save_due(self, step: ArrayLike) -> jax.Array:
        """Traced: have `every_seconds` passed since the last save (or the opening)?
        One host crossing per evaluation: guard it as `should_stop`."""
        return self._parts.save_due(step)

    def request_stop(self) -> None:
        """Ask running loops to save and stop, as SIGTERM would (thread-safe)."""
        return self._parts.stop.request()

    @property
    def stop_requested(self) -> bool:
        return self._parts.stop.requested

    # -- reading (none of these waits for pending saves, except restore) ------------

    @property
    def stats(self) -> Stats:
        """A snapshot of the counters and timings (see `Stats`)."""
        return self._parts.stats.snapshot()

    def all_steps(self) -> list[int]:
        """Steps with a complete checkpoint on disk, ascending: ours, and the plain
        Orbax steps a restart resumes from (`jax_cb_ckpt.all_steps`)."""
        return _steps.all_steps(self.directory)

    def latest_step(self) -> int | None:
        """The newest complete step on disk (ours, or a plain Orbax step), or None."""
        return _steps.latest_step(self.directory)

    def metadata(self, step: int | None = None) -> dict[str, Any]:
        """The JSON description saved with `step` (default: the latest), as
        `jax_cb_ckpt.metadata` gives it (with `extra=`'s JSON under `extra`)."""
        return _steps.metadata(self.directory, step=step)

    def restore_extra(self, step: int | None = None) -> dict[str, Any] | None:
        """The JSON saved with `step` (default: the latest) by `extra=`, or None; checked
        against its CRC-32. Waits for pending saves first, as `restore` does."""
        return _restart.restore_extra(self._parts, step)

    def best_step(self, member: int | tuple[int, ...] | None = None) -> int | None:
        """The step with the best value of the metric `best` (by `mode`) on disk, or
        None (missing or NaN values never count); `member=k`: member k's best under
        vmap. Does not wait for pending saves: `ckpt.restore(like, step=ckpt.best_step())`."""
        return _restart.best_step(self._parts, member)

    def metrics(self, step: int | None = None) -> dict[str, Any]:
        """The metrics saved with `step` (default: the latest): {name: value}, one value
        per member under vmap; {} when saved without `metrics=`."""
        return _steps.metrics(self.directory, step=step)

    def metrics_table(self) -> list[dict[str, Any]]:
        """The metrics of every step on disk, a row per step (and member), as
        `jax_cb_ckpt.metrics_table(directory)` gives them."""
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
        partial_restore: bool = False,
    ) -> PyTree:
        """Restore `step` (default: the newest that passes its checks) into the pytree
        types of `like` (arrays or `jax.ShapeDtypeStruct`s).

        Waits for pending saves (`wait()`), then blocks while reading. `verify=False`
        skips the checksums; `member=k` reads member k of a batch saved under vmap.
        Without `step=`, a restart (`on_damaged`). `partial_restore=True`: `like` holds
        only some of the saved leaves (a TrainState's `{"params": ...}`); only they are
        read and checked. See `jax_cb_ckpt.restore`."""
        return _restart.restore(self._parts, like, step, verify, member, partial_restore)

    @entry("restore_or_init")
    def restore_or_init(
        self, init_fn: Callable[..., PyTree], *args: object, like: PyTree = None
    ) -> tuple[PyTree, int | np.ndarray]:
        """The state to start a run from, and its step: the newest checkpoint that
        passes its checks, or `init_fn(*args)` and 0 (saved as step 0 with
        `initial_save`). Waits for pending saves, then blocks while it restores or
        initialises. Pass both to your jitted training function as arguments: a fresh
        run and every resume then execute one program, bit for bit. `like` (default:
        the shapes of `init_fn(*args)`) is what the checkpoint is restored into. Under
        vmap, the step may be an array of each member's step
        ([resume.md](resume.md#a-loop-of-your-own-restore_or_init)).

        Example: `state, start = ckpt.restore_or_init(jax.jit(init), key)`.
        """
        return _restart.restore_or_init(self, self._parts, init_fn, args, like)


def _given(arguments: dict[str, Any]) -> dict[str, Any]:
    """A method's arguments by name (its `locals()` on entry), less `self`: the loops'
    façades pass them on whole, so their signatures are the only list."""
    return {name: value for name, value in arguments.items() if name != "self"}
