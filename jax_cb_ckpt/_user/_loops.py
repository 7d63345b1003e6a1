"""`Checkpointer.fori_loop`: `lax.fori_loop` that saves every `every` iterations with no
conditional per iteration.

A `maybe_save` in a loop body is a `lax.cond` evaluated at every iteration; on a GPU,
XLA's conditional copies its predicate to the host and blocks the host until it has it,
so the host can no longer run ahead of the device (2.6x a tiny bare step on an H200,
docs/benchmarks.md). Here the loop is cut at the multiples of a chunk instead: the
iterations before the first multiple run one at a time (a resume from a step that is no
multiple), then whole chunks, each a loop of a static trip count with no conditional in
it (`lax.fori_loop` over `range(chunk)`: a scan), the decision between two chunks, then
the iterations after the last whole chunk one at a time again. The body runs in the same
order on the same values as in one `lax.fori_loop`.

Checkpoint `i + 1` holds the carry after iteration `i` (the convention of `maybe_save(
state, i + 1)`). With every_seconds the chunks end every `check` iterations too, and
ask the clock there; with `stoppable=True` they read the stop request there and, when
one came, save and end the loop (`while_loop`s then, so that it can end early).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp

from .._base._errors import ConfigError
from .._base._types import PyTree, Saver
from ._options import When
from ._scan import metrics_at_save

if TYPE_CHECKING:
    from jax.typing import ArrayLike

# The user's loop body, `body_fun(i, val) -> val`, as `lax.fori_loop` takes it.
ForiBody = Callable[[jax.Array, PyTree], PyTree]


def fori_loop(
    ckpt: Saver,
    when: When,
    lower: ArrayLike,
    upper: ArrayLike,
    body_fun: ForiBody,
    init_val: PyTree,
    *,
    every: int | None,
    check_every: int | None,
    stoppable: bool,
    save_last: bool,
    shardings: PyTree,
    metrics: Callable[[PyTree], PyTree] | None,
) -> PyTree:
    by_clock = when.every_seconds is not None
    check = _checked(body_fun, every, check_every, stoppable, save_last, metrics, by_clock, when)
    reads = by_clock or stoppable  # decisions that need the host, every `check` iterations
    chunk = check if every is None else (math.gcd(every, check) if reads else every)

    def no(i: jax.Array) -> jax.Array:
        return jnp.asarray(False)

    def after(i: jax.Array, val: PyTree, always: bool) -> jax.Array:
        """What follows iteration `i - 1` (checkpoint `i`): save at the multiples of
        `every`, at `upper` with save_last, when the time has come or a stop was
        requested (both read every `check` iterations). The stop read, or False."""
        if always:  # a whole chunk that ends at a multiple of `every`, nothing to ask
            ckpt.save(val, i, shardings=shardings, metrics=metrics_at_save(metrics, val, None))
            return jnp.asarray(False)
        save = jnp.asarray(False)
        if every is not None:
            save = save | (i % every == 0)
        if save_last:
            save = save | (i == upper)
        stop = jnp.asarray(False)
        if stoppable:
            stop = jax.lax.cond(i % check == 0, ckpt.should_stop, no, i)
        if by_clock:
            save = save | jax.lax.cond(i % check == 0, ckpt.save_due, no, i)
        save = save | stop
        recorded = metrics_at_save(metrics, val, save)  # computed only where it saves
        ckpt.maybe_save(val, i, when=save, shardings=shardings, metrics=recorded)
        return stop

    def one(i: jax.Array, val: PyTree) -> tuple[PyTree, jax.Array]:
        val = body_fun(i, val)
        return val, after(i + 1, val, always=False)

    def whole(base: jax.Array, val: PyTree) -> tuple[PyTree, jax.Array]:
        # A static trip count: a scan, which loops on the device with no readback.
        val = jax.lax.fori_loop(0, chunk, lambda k, v: body_fun(base + k, v), val)
        return val, after(base + chunk, val, always=not reads)

    # The cuts: Python ints when the bounds are (every loop a scan, so reverse-mode
    # differentiable, as lax.fori_loop is), traced otherwise.
    first: int | jax.Array  # (the first multiple of `chunk` from `lower` on, in bounds)
    chunks: int | jax.Array
    head = tail = True  # (a loop known to be empty is left out, not traced)
    if isinstance(lower, int) and isinstance(upper, int):
        first = max(lower, min(-(-lower // chunk) * chunk, upper))
        chunks = max((upper - first) // chunk, 0)
        head, tail = first > lower, upper > first + chunks * chunk
    else:
        low, high = jnp.asarray(lower), jnp.asarray(upper)
        first = jnp.maximum(low, jnp.minimum(-(-low // chunk) * chunk, high))
        chunks = jnp.maximum((high - first) // chunk, 0)
    last = first + chunks * chunk
    if not stoppable:
        val = init_val
        if head:
            val = jax.lax.fori_loop(lower, first, lambda i, v: one(i, v)[0], val)
        val = jax.lax.fori_loop(0, chunks, lambda c, v: whole(first + c * chunk, v)[0], val)
        if tail:
            val = jax.lax.fori_loop(last, upper, lambda i, v: one(i, v)[0], val)
        return val
    val, stop = _until_stopped(lower, first, 1, one, (init_val, jnp.asarray(False)))
    val, stop = _until_stopped(first, last, chunk, whole, (val, stop))
    val, _ = _until_stopped(last, upper, 1, one, (val, stop))
    return val


def _until_stopped(
    lo: ArrayLike,
    hi: ArrayLike,
    stride: int,
    fn: Callable[[jax.Array, PyTree], tuple[PyTree, jax.Array]],
    carry: tuple[PyTree, jax.Array],
) -> tuple[PyTree, jax.Array]:
    """`fn(i, val)` for i in range(lo, hi, stride), until the stop flag it returns is set
    (or was set already)."""

    def go_on(c: tuple[jax.Array, PyTree, jax.Array]) -> jax.Array:
        return (c[0] < hi) & jnp.logical_not(c[2])

    def step(c: tuple[jax.Array, PyTree, jax.Array]) -> tuple[jax.Array, PyTree, jax.Array]:
        i, val, _ = c
        val, stop = fn(i, val)
        return i + stride, val, stop

    i0 = jnp.asarray(lo, jnp.result_type(lo, hi))
    _, val, stop = jax.lax.while_loop(go_on, step, (i0, *carry))
    return val, stop


def _checked(
    body_fun: object,
    every: object,
    check_every: object,
    stoppable: object,
    save_last: object,
    metrics: object,
    by_clock: bool,
    when: When,
) -> int:
    """The arguments checked before anything is traced; the iterations between two
    reads of the host (the clock, the stop request)."""
    if not callable(body_fun):
        raise ConfigError(
            f"fori_loop: body_fun must be a function body_fun(i, val) -> val, as "
            f"lax.fori_loop takes it, got {body_fun!r}."
        )
    if every is not None and (isinstance(every, bool) or not isinstance(every, int) or every <= 0):
        raise ConfigError(
            f"fori_loop: every must be a positive int (iterations between saves), got "
            f"{every!r}. Fix: pass every=N, or create the Checkpointer with every=N."
        )
    if every is None and not by_clock:
        raise ConfigError(
            "fori_loop: no every. Fix: pass every=N, or create the Checkpointer with "
            "every=N (or every_seconds=T)."
        )
    for name, value in (("stoppable", stoppable), ("save_last", save_last)):
        if not isinstance(value, bool):
            raise ConfigError(f"fori_loop: {name} must be True or False, got {value!r}.")
    if metrics is not None and not callable(metrics):
        raise ConfigError(
            f"fori_loop(metrics={metrics!r}): metrics must be a function of the carry that "
            "returns the metrics to record with each save, e.g. "
            "metrics=lambda val: {'loss': val.loss}."
        )
    check = check_every
    if check is None:
        check = every if every is not None and not by_clock else when.check
    if isinstance(check, bool) or not isinstance(check, int) or check <= 0:
        raise ConfigError(f"fori_loop: check_every must be a positive int, got {check_every!r}.")
    return check
