"""`Checkpointer.run`: a scan-shaped run that resumes itself, bit for bit.

The loop is one jitted program over the step counter, started at the restored step:
`lax.while_loop`s over chunks of steps, each chunk a scan with no conditional in it
(`make_loop`). The start is a traced argument, so a fresh run and every resumed run execute the
same compiled program: a resumed run computes exactly what the uninterrupted one would.
Checkpoint `k` holds the state after `k` steps.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import threading
import time
from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING, Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from .._base._errors import ConfigError
from .._base._types import JsonExtra, PyTree, Saver
from .._layout import _extra
from . import _restart
from ._metrics import check_metrics, metrics_at_save
from ._options import When
from ._preempt import Preempted, StopFlag

if TYPE_CHECKING:
    from tqdm.auto import tqdm

    from ._wiring import Parts

logger = logging.getLogger("jax_cb_ckpt")

# The user's step function, `body(state, step) -> state`.
Body = Callable[[PyTree, jax.Array], PyTree]
# The run's jitted loop, `loop(state, start) -> (state, steps done, stopped)`.
Loop = Callable[[PyTree, jax.Array], tuple[PyTree, jax.Array, jax.Array]]
_T = TypeVar("_T")


def run(ckpt: Saver, parts: Parts, **arguments: Any) -> PyTree:
    """`Checkpointer.run` (its docstring; `arguments`: its own, by name, checked by
    `_run`'s signature): `ckpt` saves, `parts` holds the Checkpointer's options, stop
    flag and cache of jitted loops (`_jitted_loop`). A failure of the loop that a
    callback of ours caused is raised as ours (`Parts.running`)."""
    parts.check_usable()
    return parts.running(lambda: _run(ckpt, parts, **arguments))


def _run(
    ckpt: Saver,
    parts: Parts,
    body: Body,
    init: PyTree,
    num_steps: int,
    *,
    batched: bool,
    sigint: bool,
    check_every: int | None,
    progress: bool,
    metrics: Callable[[PyTree], PyTree] | None,
    quiet: bool,
    extra: JsonExtra = None,
) -> PyTree:
    """The arguments checked, the run resumed (or started fresh), then the loop."""
    when = parts.options.when
    every, by_clock = when.every, when.every_seconds is not None
    check = _checked_arguments(when, num_steps, metrics, check_every, progress, quiet)
    extra = _extra.of(extra, "run")  # checked before anything runs; hashable (the key)
    bar_type = _progress_bar_type() if progress else None

    step_fn = jax.vmap(body, in_axes=(0, None)) if batched else body
    init = _check_body(step_fn, init, batched)
    damaged: list[int] = []
    resumed = _restart.resume(parts, lambda: init, damaged=damaged)
    state, start = _start(ckpt, when, init, resumed, num_steps, metrics, batched, extra)
    if not quiet:
        tier = None if parts.persistent is None else parts.persistent.path
        read = parts.resumed_from or ckpt.directory
        _say_where(read, start if resumed is not None else None, num_steps, damaged, tier)
    if start == num_steps:
        logger.info(
            "run: nothing to do, the latest checkpoint in %s is step %d of num_steps=%d "
            "(the run is complete; restore() gives its state)",
            ckpt.directory,
            start,
            num_steps,
        )
        return state
    shardings = None
    if jax.process_count() > 1:  # see docs/multiprocess.md
        shardings = _process_shardings(state)
    loop = _jitted_loop(
        parts.run_loops,
        ckpt,
        parts.stop,
        body,
        batched,
        num_steps,
        every,
        check,
        by_clock,
        shardings,
        metrics,
        extra,
    )
    return _until_done(ckpt, parts.stop, loop, state, start, num_steps, sigint, bar_type)


def _until_done(
    ckpt: Saver,
    stop_flag: StopFlag,
    loop: Loop,
    state: PyTree,
    start: int,
    num_steps: int,
    sigint: bool,
    bar_type: type[tqdm] | None,
) -> PyTree:
    """The loop from `start`, in a thread of its own while this one waits for signals;
    its last save on disk before it returns, or raises `Preempted` when stopped."""
    # Committed to their devices, as a restored state's arrays are: a fresh state's
    # uncommitted arrays would make the resumed call another entry of jit's cache, and
    # compile the same program again.
    state = jax.tree.map(
        lambda x: jax.device_put(x, x.sharding) if isinstance(x, jax.Array) else x, state
    )
    bar = None if bar_type is None else _Progress(bar_type, ckpt, stop_flag, start, num_steps)
    try:
        with stop_flag.signals(sigint=sigint):
            out = _in_thread(
                lambda: jax.block_until_ready(loop(state, jnp.int32(start))),
                stop_flag,
                None if bar is None else bar.tick,
            )
            ckpt.wait()  # the last save is on disk before we return or raise
    except BaseException:
        # The error wins over a stop request or Ctrl-C made meanwhile; the request is
        # consumed all the same, so a later run in this process starts afresh.
        stop_flag.clear()
        raise
    finally:
        if bar is not None:
            bar.close()
    state, i, stopped = out
    _raise_if_stopped(ckpt, stop_flag, int(i), bool(stopped), num_steps)
    return state


def _checked_arguments(
    when: When,
    num_steps: object,
    metrics: object,
    check_every: object,
    progress: object,
    quiet: object = False,
) -> int:
    """`run`'s arguments checked before anything is traced; the number of steps between
    two looks at the stop request and the clock."""
    every, by_clock = when.every, when.every_seconds is not None
    if every is None and not by_clock:
        raise ConfigError(
            "run: the Checkpointer needs every=N (run saves after every N steps, at the "
            "end and when stopped) or every_seconds=T. Fix: Checkpointer(directory, "
            "every=N)."
        )
    if isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps < 0:
        raise ConfigError(f"run: num_steps must be a non-negative int, got {num_steps!r}.")
    check_metrics(
        "run",
        metrics,
        "state",
        "metrics=lambda s: {'loss': s.loss}",
        more=" (a dict of scalars; for one member with batched=True)",
    )
    if check_every is not None:
        check = check_every
    else:
        check = every if every is not None else when.check
    if isinstance(check, bool) or not isinstance(check, int) or check <= 0:
        raise ConfigError(f"run: check_every must be a positive int, got {check_every!r}.")
    if not isinstance(progress, bool):
        raise ConfigError(f"run: progress must be True or False, got {progress!r}.")
    if not isinstance(quiet, bool):
        raise ConfigError(f"run: quiet must be True or False, got {quiet!r}.")
    return check


def _say_where(
    directory: str,
    start: int | None,
    num_steps: int,
    damaged: list[int],
    persistent: str | None = None,
) -> None:
    """One line on stderr: where the run starts (`start`: the step resumed from, None
    for a fresh start; `directory`: the tier it was read from; `damaged`: the steps it
    passed over), so that a mistyped directory (or `persistent`), which trains from
    step 0 again, is seen at once, without configuring logging. `quiet=True` leaves
    it out."""
    nor = "" if persistent is None else f" nor in {persistent}"
    if start is None and damaged:
        steps = ", ".join(str(s) for s in sorted(damaged))
        where = (
            f"starting fresh at step 0 in {directory} (no step there{nor} passes its "
            f"checks: {len(damaged)} damaged step(s) passed over, {steps}; the "
            "DamagedStepWarning says why and where each went)"
        )
    elif start is None:
        where = f"starting fresh at step 0 in {directory} (no checkpoint there{nor})"
    else:
        where = f"resumed from step {start} of {directory}"
        if start == num_steps:
            where += f" (num_steps={num_steps}: the run is complete, nothing to do)"
    print(f"jax_cb_ckpt: run {where}", file=sys.stderr, flush=True)


def _start(
    ckpt: Saver,
    when: When,
    init: PyTree,
    resumed: tuple[PyTree, int | np.ndarray] | None,
    num_steps: int,
    metrics: Callable[[PyTree], PyTree] | None,
    batched: bool,
    extra: JsonExtra = None,
) -> tuple[PyTree, int]:
    """The state and step the loop starts from: `init` at 0 (saved first with
    `initial_save`), or what the restart found, checked against the loop's one step and
    `num_steps`."""
    if resumed is None:
        if when.initial_save:
            _save_initial(ckpt, init, metrics, batched, extra)
        return init, 0
    state, start = resumed
    if not isinstance(start, int):
        raise ConfigError(
            f"run: the members of the batch in {ckpt.directory!r} resume from different "
            f"steps ({list(start.ravel())[:8]}: some stopped saving before the newest "
            "step), and run's loop has one step for the whole batch. Fix: resume with "
            "ckpt.restore_or_init and a loop of your own that takes each member's start "
            "(jax.vmap over the start too)."
        )
    if start > num_steps:
        raise ConfigError(
            f"run: the latest checkpoint in {ckpt.directory!r} is step {start}, past "
            f"num_steps={num_steps}. Fix: use another directory, or a larger num_steps."
        )
    return state, start


def _raise_if_stopped(
    ckpt: Saver, stop_flag: StopFlag, i: int, stopped: bool, num_steps: int
) -> None:
    """After the loop ended at step `i` (its last save on disk): the stop request is
    consumed, and a Ctrl-C or a stop (of this process, or `stopped`: another process was
    signalled) before `num_steps` is raised."""
    if stop_flag.interrupted:
        # Raised only now, with the loop ended and its save on disk: raised at the press
        # it would have left the loop running in the helper thread (saving into a closed
        # Checkpointer, or aborting the interpreter at exit from inside a callback).
        error = stop_flag.deferred or KeyboardInterrupt(
            f"jax_cb_ckpt: stopped at step {i} after Ctrl-C; checkpoint saved"
        )
        stop_flag.clear()  # consumed: a later run in this process starts afresh
        raise error
    # Consumed either way: a later run in this process starts afresh. A request the loop
    # never read (made after its last check: a SIGTERM while the final save was written)
    # is acted on all the same; that save is on disk now, and the process was asked to
    # stop. `stopped` without a request of ours: another process was signalled.
    requested, signum = stop_flag.take()
    if requested or (stopped and i < num_steps):
        preempted = Preempted(i, signum)
        logger.warning(
            "run stopped at step %d after %s; checkpoint saved in %s; exit code %s",
            preempted.step,
            preempted.reason,
            ckpt.directory,
            preempted.code,
        )
        raise preempted


def _progress_bar_type() -> type[tqdm]:
    try:
        from tqdm.auto import tqdm
    except ImportError:
        raise ConfigError(
            "run: progress=True needs tqdm, which is not installed. Fix: pip install "
            "'jax_cb_ckpt[progress]' (or pip install tqdm)."
        ) from None
    return tqdm


class _Progress:
    """A progress bar of a run inside one jit: steps/s and the last saved step.

    Nothing crosses to the host for it: the loop already reads the stop flag every
    `check_every` steps, and that read records the step (`StopFlag.reached`); the
    waiting thread moves the bar from it every 50 ms, with the writer's last step
    (`ckpt.stats.last_saved_step`). So the bar moves every `check_every` steps.
    Until the first check the bar says "compiling", and its clock starts there: the
    rate and the time left count steps run, not the compilation (a run whose compile
    took 5 s showed 176 steps/s and 1:47 left, where it ran 20,000 steps in 30 s).
    """

    def __init__(self, bar_type: type[tqdm], ckpt: Saver, flag: StopFlag, start: int, total: int):
        self._ckpt = ckpt
        self._flag = flag
        self._shown = start
        self._saved: int | None = None
        self._timing = False
        flag.reached = None
        resumed = f"resumed from {start}, " if start else ""
        # Described at creation: its first line (printed by the constructor) says
        # whose bar it is too, in a log that keeps every line.
        self._bar = bar_type(
            total=total,
            initial=start,
            unit="step",
            dynamic_ncols=True,
            desc=f"jax_cb_ckpt {os.path.basename(ckpt.directory)}",
            postfix=f"{resumed}compiling",
        )

    def tick(self) -> None:
        reached = self._flag.reached
        saved = self._ckpt.stats.last_saved_step
        if saved != self._saved:
            self._saved = saved
            self._bar.set_postfix_str(f"saved {saved}", refresh=False)
        if reached is None or reached <= self._shown:
            return
        if not self._timing:  # the first check: compiled and running; the clock starts
            self._timing = True
            bar = self._bar
            bar.n = bar.last_print_n = bar.initial = reached
            bar.start_t = bar.last_print_t = time.time()
            if self._saved is None:
                bar.set_postfix_str("running", refresh=False)
            bar.refresh()
        else:
            self._bar.update(reached - self._shown)
        self._shown = reached

    def close(self) -> None:
        self.tick()
        self._bar.close()


def _jitted_loop(
    loops: dict[Hashable, Loop],
    ckpt: Saver,
    stop_flag: StopFlag,
    body: Body,
    batched: bool,
    num_steps: int,
    every: int | None,
    check: int,
    by_clock: bool,
    shardings: PyTree,
    metrics: Callable[[PyTree], PyTree] | None = None,
    extra: JsonExtra = None,
) -> Loop:
    """`jax.jit(make_loop(...))`, made once per Checkpointer and loop: `loops` is the
    Checkpointer's {what the loop is made of: the jitted loop}, so that a fresh run and
    a resumed one (after a stop request, say) call the same jitted function, and the
    resumed one runs the executable compiled for the fresh one without compiling again."""
    leaves, treedef = jax.tree_util.tree_flatten(shardings)
    key = (body, batched, num_steps, every, check, tuple(leaves), treedef, metrics, extra)
    try:
        hash(key)
    except TypeError:  # a body that cannot be a dict key: a loop of its own every time
        key = None
    if key is None or key not in loops:
        step_fn = jax.vmap(body, in_axes=(0, None)) if batched else body
        reads = [stop_flag.traced]
        if by_clock:  # every_seconds: the clock is asked at the same reads
            reads.append(ckpt.save_due)
        if shardings is not None:
            reads = [_agreed(read, shardings) for read in reads]
        per_member = metrics if metrics is None or not batched else jax.vmap(metrics)
        loop = jax.jit(
            make_loop(
                ckpt,
                step_fn,
                num_steps,
                every,
                check,
                reads[0],
                shardings,
                read_due=reads[1] if len(reads) > 1 else None,
                metrics=per_member,
                extra=extra,
            )
        )
        if key is None:
            return loop
        loops[key] = loop
    return loops[key]


def make_loop(
    ckpt: Saver,
    step_fn: Body,
    num_steps: int,
    every: int | None,
    check: int,
    read_stop: Callable[[jax.Array], jax.Array],
    shardings: PyTree,
    *,
    read_due: Callable[[jax.Array], jax.Array] | None = None,
    metrics: Callable[[PyTree], PyTree] | None = None,
    extra: JsonExtra = None,
) -> Loop:
    """The run's loop, `loop(state, start) -> (state, steps done, stopped)`, to jit.
    `read_due` (every_seconds): has the time for a save come, asked with the stop flag;
    `metrics(state)`: recorded with each save, computed only at the steps that save;
    `extra`: stored with each save (`_layout/_extra`)."""
    # Steps run in chunks of `chunk` steps (it divides both `every` and `check`), each a
    # scan with no conditional inside: the save and the stop read sit between chunks, so
    # a step costs no predicate (on a GPU, each is a copy the host waits for). Steps
    # before the first chunk boundary (a resume from a step saved with other settings)
    # and after the last full chunk run one at a time, deciding after each step.
    chunk = check if every is None else math.gcd(every, check)
    after = _after(ckpt, num_steps, every, check, read_stop, shardings, read_due, metrics, extra)

    def loop(state: PyTree, start: jax.Array) -> tuple[PyTree, jax.Array, jax.Array]:
        def one_step(carry):
            i, state, _ = carry
            state = step_fn(state, i)
            return i + 1, state, after(i + 1, state)

        def whole_chunk(carry):
            i, state, _ = carry
            state = jax.lax.fori_loop(0, chunk, lambda k, s: step_fn(s, i + k), state)
            return i + chunk, state, after(i + chunk, state)

        def before(limit):
            return lambda carry: (carry[0] < limit) & jnp.logical_not(carry[2])

        carry = (jnp.asarray(start, jnp.int32), state, jnp.asarray(False))
        boundary = jnp.minimum((carry[0] + chunk - 1) // chunk * chunk, num_steps)
        carry = jax.lax.while_loop(before(boundary), one_step, carry)
        carry = jax.lax.while_loop(before(num_steps - chunk + 1), whole_chunk, carry)
        i, state, stop = jax.lax.while_loop(before(num_steps), one_step, carry)
        return state, i, stop

    return loop


def _after(
    ckpt: Saver,
    num_steps: int,
    every: int | None,
    check: int,
    read_stop: Callable[[jax.Array], jax.Array],
    shardings: PyTree,
    read_due: Callable[[jax.Array], jax.Array] | None,
    metrics: Callable[[PyTree], PyTree] | None,
    extra: JsonExtra = None,
) -> Callable[[jax.Array, PyTree], jax.Array]:
    """`after(i, state)`, what follows step `i` in `make_loop`'s loop: read the stop
    flag (and with every_seconds, the clock) every `check` steps, save at every `every`
    steps, at the end, when the time has come and when stopping. Returns the stop read."""

    def no(i: jax.Array) -> jax.Array:
        return jnp.asarray(False)

    def after(i: jax.Array, state: PyTree) -> jax.Array:
        at_save = i == num_steps
        if every is not None:
            at_save = at_save | (i % every == 0)
        stop = jax.lax.cond(i % check == 0, read_stop, no, i)
        save = at_save | stop
        if read_due is not None:
            save = save | jax.lax.cond(i % check == 0, read_due, no, i)
        recorded = metrics_at_save(metrics, state, save)  # only where a save is made
        ckpt.maybe_save(state, i, when=save, shardings=shardings, metrics=recorded, extra=extra)
        return stop

    return after


def _save_initial(
    ckpt: Saver,
    init: PyTree,
    metrics: Callable[[PyTree], PyTree] | None,
    batched: bool,
    extra: JsonExtra = None,
) -> None:
    """`initial_save`: a fresh run saves its starting state as step 0 first."""
    if metrics is None:
        recorded = None
    else:
        recorded = (jax.vmap(metrics) if batched else metrics)(init)
    if jax.process_count() > 1:  # a state across processes is saved inside jit
        shardings = _process_shardings(init)
        jax.jit(lambda s: ckpt.save(s, 0, shardings=shardings, extra=extra))(init)
    else:
        ckpt.save(init, 0, metrics=recorded, extra=extra)
    ckpt.wait()  # on disk before the loop (or an early return: num_steps=0)


def _process_shardings(state: PyTree) -> PyTree:
    """Each leaf's sharding, for the per-device save of a multi-process run: every
    process writes its own devices' blocks (a gathered save would reach process 0 only)."""

    def sharding(path: jax.tree_util.KeyPath, leaf: object) -> NamedSharding:
        if isinstance(leaf, jax.Array) and isinstance(leaf.sharding, NamedSharding):
            return leaf.sharding
        raise ConfigError(
            f"run: in a multi-process run every leaf of the state must be a jax.Array "
            f"with a NamedSharding (each process saves its own devices' blocks); leaf "
            f"{jax.tree_util.keystr(path)} is {type(leaf).__name__}"
            f"{'' if not isinstance(leaf, jax.Array) else ' on ' + repr(leaf.sharding)}. "
            "Fix: place init with jax.device_put(x, NamedSharding(mesh, spec)) or "
            "jax.make_array_from_callback."
        )

    return jax.tree_util.tree_map_with_path(sharding, state)


def _agreed(
    read: Callable[[jax.Array], jax.Array], shardings: PyTree
) -> Callable[[jax.Array], jax.Array]:
    """The stop request as one decision for all processes: every device reads its own
    process's flag and a `pmax` over all devices combines them, so every process stops
    at the same step (the first check after any of them was signalled). It runs on the
    state's own mesh: JAX allows one mesh per program."""
    mesh = jax.tree.leaves(shardings)[0].mesh
    if mesh.devices.size != jax.device_count():
        raise ConfigError(
            f"run: in a multi-process run the state's mesh must span every device of "
            f"every process (the stop decision is agreed over it); it has "
            f"{mesh.devices.size} of {jax.device_count()} devices. Fix: build the mesh "
            "from jax.devices()."
        )
    axes = tuple(mesh.axis_names)

    def per_device(i: jax.Array) -> jax.Array:
        requested = read(i).astype(jnp.int32)  # this process's flag
        return jax.lax.pmax(requested, axes) > 0

    def agreed(i: jax.Array) -> jax.Array:
        return jax.shard_map(
            per_device,
            mesh=mesh,
            in_specs=PartitionSpec(),
            out_specs=PartitionSpec(),
            check_vma=False,
        )(i)

    return agreed


def _check_body(step_fn: Body, state: PyTree, batched: bool) -> PyTree:
    """`state`, its weakly typed leaves promoted as JAX's loops promote a carry (a
    Python number in `init`, such as gymnax's `LogWrapper` `episode_returns = 0`, takes
    the dtype `body` gives it: `result_type(leaf, returned)`), so that a fresh run and
    a resumed one (whose state is read back in that dtype) pass the loop one signature
    and run one program. Then `body(state, step)` must return the next state, shaped
    like it: a mismatch, named by leaf, is a `ConfigError` here rather than JAX's
    carry-type error deep inside the while_loop."""
    returned = _returned(step_fn, state)
    given = jax.eval_shape(lambda: state)
    if jax.tree_util.tree_structure(returned) == jax.tree_util.tree_structure(given):
        state = jax.tree.map(_promoted, state, given, returned)
        given = jax.eval_shape(lambda: state)
        returned = _returned(step_fn, state)
    member = " (for one member: batched=True vmaps it)" if batched else ""
    fix = (
        " Fix: a lax.scan-style body that returns (state, aux) is wrapped as "
        "`body=lambda s, i: scan_body(s, i)[0]`; a leaf whose dtype the step changes "
        "starts in that dtype in init (e.g. jnp.float32(0))."
    )
    if jax.tree_util.tree_structure(returned) != jax.tree_util.tree_structure(given):
        raise ConfigError(
            "run: body(state, step) must return the next state, with the structure, "
            f"shapes and dtypes of `init`{member}; it returned "
            f"{jax.tree_util.tree_structure(returned)} instead of "
            f"{jax.tree_util.tree_structure(given)}." + fix
        )
    flat = jax.tree_util.tree_flatten_with_path(given)[0]
    for (path, a), b in zip(flat, jax.tree.leaves(returned), strict=True):
        if (a.shape, a.dtype) != (b.shape, b.dtype):
            raise ConfigError(
                f"run: body(state, step) must return the next state, with the shapes and "
                f"dtypes of `init`{member}; leaf init{jax.tree_util.keystr(path)} is "
                f"{_shown(a)} in init and {_shown(b)} in what body returns." + fix
            )
    return state


def _returned(step_fn: Body, state: PyTree) -> PyTree:
    try:
        return jax.eval_shape(step_fn, state, jnp.int32(0))
    except Exception as e:
        raise ConfigError(f"run: calling body(state, step) failed while tracing: {e}") from e


def _promoted(leaf: Any, given: jax.ShapeDtypeStruct, returned: object) -> Any:
    """`leaf` in the dtype a loop carries it in: JAX's rule for a weakly typed carry."""
    if not getattr(given, "weak_type", False) or not isinstance(returned, jax.ShapeDtypeStruct):
        return leaf
    if (given.shape, given.dtype) == (returned.shape, returned.dtype):
        return leaf
    # (the leaf, not `given`: result_type reads a ShapeDtypeStruct as strongly typed)
    return jax.lax.convert_element_type(leaf, jnp.result_type(leaf, returned.dtype))


def _shown(x: jax.ShapeDtypeStruct) -> str:
    return f"{x.dtype}{list(x.shape)}" + (
        " (weakly typed)" if getattr(x, "weak_type", False) else ""
    )


def _in_thread(fn: Callable[[], _T], stop: StopFlag, tick: Callable[[], None] | None = None) -> _T:
    """Run `fn` in a helper thread while this thread waits in short, interruptible steps.

    A jitted program with callbacks is dispatched synchronously: the calling thread stays
    inside C++ until the loop ends, and Python would run a SIGTERM handler only then.

    Never returns or raises while the thread runs: during `run`, a Ctrl-C (and whatever a
    SIGINT handler of the user's own raises) is only recorded, by `StopFlag.signals`,
    and turned into a stop request; the loop leaves at its next check, and this waits.
    """
    result: list[_T] = []
    error: list[BaseException] = []

    def target() -> None:
        try:
            result.append(fn())
        except BaseException as e:  # re-raised in the caller's thread
            error.append(e)

    thread = threading.Thread(target=target, name="jax_cb_ckpt-run", daemon=True)
    try:
        thread.start()
    except RuntimeError:
        # Python 3.12.0/3.12.1 start no thread once the main thread has ended ("can't
        # create new thread at interpreter shutdown"): a run called then, by a thread
        # still training, runs here. Such a thread receives no signal, so nothing is
        # lost by not waiting in steps (only a progress bar's ticks).
        return fn()
    noted = False
    while thread.is_alive():
        thread.join(0.05)
        if tick is not None:
            tick()
        if stop.interrupted and not noted:
            noted = True  # once, however many presses
            logger.warning(
                "Ctrl-C: run stops at the next check, saving first "
                "(Ctrl-\\ quits at once, without saving)"
            )
    if error:
        raise error[0]
    return result[0]
