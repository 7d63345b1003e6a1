"""`Checkpointer.while_loop` and `Checkpointer.fori_loop`: JAX's loops, with every save
in the body held to the members that are still in the loop; and, with `every=`, a
`fori_loop` that saves its carry every N iterations with no conditional per iteration.

Under `vmap`, a `while_loop` whose predicate differs across members runs its body for
every member while any of them goes on; JAX's lowering then keeps, per member, the body's
result or the carry it had, by the predicate (a `select` after the body, which no save
in the body can see). A finished member's body still runs, on its frozen carry: a
`maybe_save` there would hand over a state the member never had, at a step its frozen
counter asks in every later iteration. No save can tell such a member from a live one
by what it hands over (the first step a frozen counter asks is one the member never
reached). The loop's predicate can: evaluated on the carry the body gets, it is that
`select`'s mask. So the body evaluates it once more and every save traced in the body
holds only where it holds (`_traced.members_live`). Unbatched it holds in every
iteration the body runs, and the saves are the ones `lax.while_loop` makes.

A `maybe_save` in a loop body is also a `lax.cond` evaluated at every iteration; on a
GPU, XLA's conditional copies its predicate to the host and blocks the host until it
has it, so the host can no longer run ahead of the device (2.6x a tiny bare step on an
H200, docs/benchmarks.md). `fori_loop(..., every=N)` (`saving_fori_loop`) cuts the loop
at the multiples of a chunk instead: the iterations before the first multiple run one at
a time (a resume from a step that is no multiple), then whole chunks, each a loop of a
static trip count with no conditional in it (a scan), the decision between two chunks,
then the iterations after the last whole chunk one at a time again. The body runs in the
same order on the same values as in one `lax.fori_loop`; its loops with traced bounds
are the member-holding loops above, so under `vmap` with per-member bounds a member
saves only while it is in the loop. Checkpoint `i + 1` holds the carry after iteration
`i` (the convention of `maybe_save(state, i + 1)`). With every_seconds the chunks end
every `check` iterations too, and ask the clock there; with `stoppable=True` they read
the stop request there and, when one came, save and end the loop.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, SupportsIndex, TypeVar

import jax
import jax.numpy as jnp
from jax.core import Tracer

from .._base._errors import ConfigError
from .._base._types import JsonExtra, PyTree, Saver
from .._save import _traced
from . import _with_extra
from ._metrics import check_metrics, metrics_at_save
from ._options import When

if TYPE_CHECKING:
    from jax.typing import ArrayLike

Carry = TypeVar("Carry")
# The user's loop body, `body_fun(i, val) -> val`, as `lax.fori_loop` takes it.
ForiBody = Callable[[Any, Any], Any]


def while_loop(
    cond_fun: Callable[[Carry], ArrayLike], body_fun: Callable[[Carry], Carry], init_val: Carry
) -> Carry:
    """`jax.lax.while_loop(cond_fun, body_fun, init_val)`, whose body's saves are those
    of the members for which `cond_fun` holds (see the module's docstring)."""
    _check_callable("while_loop", cond_fun=cond_fun, body_fun=body_fun)

    def body_of_live_members(carry: Carry) -> Carry:
        with _traced.members_live(cond_fun(carry)):
            return body_fun(carry)

    return jax.lax.while_loop(cond_fun, body_of_live_members, init_val)


def fori_loop(
    lower: ArrayLike, upper: ArrayLike, body_fun: Callable[[Any, Carry], Carry], init_val: Carry
) -> Carry:
    """`jax.lax.fori_loop(lower, upper, body_fun, init_val)`. With bounds Python knows it
    is JAX's (a `scan`: every member runs every iteration, nothing is thrown away); with
    a traced bound (a `while_loop`, per member under `vmap`: a batched start from
    `restore_or_init`), the saves in the body hold where `i < upper`, the predicate of
    the `while_loop` JAX makes of it."""
    _check_callable("fori_loop", body_fun=body_fun)
    if not isinstance(lower, Tracer) and not isinstance(upper, Tracer):
        return jax.lax.fori_loop(lower, upper, body_fun, init_val)

    def body_of_live_members(i: jax.Array, value: Carry) -> Carry:
        with _traced.members_live(i < upper):
            return body_fun(i, value)

    return jax.lax.fori_loop(lower, upper, body_of_live_members, init_val)


def _check_callable(name: str, **functions: object) -> None:
    for argument, function in functions.items():
        if not callable(function):
            raise ConfigError(
                f"{name}({argument}={function!r}): {argument} must be a function, as for "
                f"jax.lax.{name}. Fix: pass the function itself, not its result."
            )


def checkpointed_fori_loop(
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
    extra: JsonExtra = None,
) -> PyTree:
    """`Checkpointer.fori_loop` (its docstring); `when`: the Checkpointer's options;
    `ckpt`'s saves given `extra`."""
    _with_extra.refuse_without_saves(extra, every, check_every)
    ckpt = _with_extra.with_extra(ckpt, extra, "fori_loop")
    if every is None and check_every is None:  # the loop saves nothing itself
        _check_nothing_to_save_by(stoppable, save_last, shardings, metrics)
        return fori_loop(lower, upper, body_fun, init_val)
    _check_callable("fori_loop", body_fun=body_fun)
    by_clock = when.every_seconds is not None
    check = _checked(every, check_every, stoppable, save_last, metrics, by_clock, when)
    reads = by_clock or stoppable  # decisions that need the host, every `check` iterations
    chunk = check if every is None else (math.gcd(every, check) if reads else every)

    lower, upper, first, chunks, head, tail = _cuts(lower, upper, chunk)
    after = _after(ckpt, upper, every, check, stoppable, save_last, by_clock, shardings, metrics)

    def one(i: jax.Array, val: PyTree) -> tuple[PyTree, jax.Array]:
        val = body_fun(i, val)
        return val, after(i + 1, val, always=False)

    def whole(base: jax.Array, val: PyTree) -> tuple[PyTree, jax.Array]:
        # A static trip count: a scan, which loops on the device with no readback.
        val = jax.lax.fori_loop(0, chunk, lambda k, v: body_fun(base + k, v), val)
        return val, after(base + chunk, val, always=not reads)

    last = first + chunks * chunk
    if not stoppable:
        val = init_val
        if head:
            val = fori_loop(lower, first, lambda i, v: one(i, v)[0], val)
        val = fori_loop(0, chunks, lambda c, v: whole(first + c * chunk, v)[0], val)
        if tail:
            val = fori_loop(last, upper, lambda i, v: one(i, v)[0], val)
        return val
    val, stop = _until_stopped(lower, first, 1, one, (init_val, jnp.asarray(False)))
    val, stop = _until_stopped(first, last, chunk, whole, (val, stop))
    val, _ = _until_stopped(last, upper, 1, one, (val, stop))
    return val


def _after(
    ckpt: Saver,
    upper: ArrayLike,
    every: int | None,
    check: int,
    stoppable: bool,
    save_last: bool,
    by_clock: bool,
    shardings: PyTree,
    metrics: Callable[[PyTree], PyTree] | None,
) -> Callable[..., jax.Array]:
    """`after(i, val, always)`: what follows iteration `i - 1` (checkpoint `i`) of
    `checkpointed_fori_loop`."""

    def no(i: jax.Array) -> jax.Array:
        return jnp.asarray(False)

    def after(i: jax.Array, val: PyTree, always: bool) -> jax.Array:
        """Save at the multiples of `every`, at `upper` with save_last, when the time
        has come or a stop was requested (both read every `check` iterations). The
        stop read, or False."""
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

    return after


def _cuts(
    lower: ArrayLike, upper: ArrayLike, chunk: int
) -> tuple[ArrayLike, ArrayLike, int | jax.Array, int | jax.Array, bool, bool]:
    """(lower, upper, first, chunks, head, tail): the bounds, the first multiple of
    `chunk` from `lower` on (in bounds), the number of whole chunks from there, and
    whether iterations come before them (`head`) and after (`tail`). Python ints when
    the bounds are (every loop a scan, so reverse-mode differentiable, as
    lax.fori_loop is), traced otherwise; a loop known to be empty is left out."""
    known = _known_bounds(lower, upper)
    if known is None:
        low, high = jnp.asarray(lower), jnp.asarray(upper)
        first = jnp.maximum(low, jnp.minimum(-(-low // chunk) * chunk, high))
        chunks = jnp.maximum((high - first) // chunk, 0)
        return lower, upper, first, chunks, True, True
    low, high = known
    first_ = max(low, min(-(-low // chunk) * chunk, high))
    chunks_ = max((high - first_) // chunk, 0)
    return low, high, first_, chunks_, first_ > low, high > first_ + chunks_ * chunk


def _known_bounds(lower: ArrayLike, upper: ArrayLike) -> tuple[int, int] | None:
    """The bounds as Python ints where Python knows them (ints, numpy integers, concrete
    integer arrays: what `lax.fori_loop` turns into a scan), else None."""
    if isinstance(lower, Tracer) or isinstance(upper, Tracer):
        return None
    if not isinstance(lower, SupportsIndex) or not isinstance(upper, SupportsIndex):
        return None
    try:  # (a jax.Array has __index__, which refuses a float one)
        return operator.index(lower), operator.index(upper)
    except TypeError:  # (a float array bound, which lax.fori_loop refuses in its words)
        return None


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
    _, val, stop = while_loop(go_on, step, (i0, *carry))
    return val, stop


def _checked(
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
    if every is not None and (isinstance(every, bool) or not isinstance(every, int) or every <= 0):
        raise ConfigError(
            f"fori_loop: every must be a positive int (iterations between saves), got "
            f"{every!r}. Fix: pass every=N, a positive int."
        )
    if every is None and not by_clock and stoppable is not True:
        raise ConfigError(
            f"fori_loop(check_every={check_every!r}): nothing to decide at the asks: the "
            "Checkpointer has no every_seconds and stoppable is False. Fix: pass every=N "
            "(save every N iterations), or stoppable=True, or create the Checkpointer with "
            "every_seconds=T."
        )
    for name, value in (("stoppable", stoppable), ("save_last", save_last)):
        if not isinstance(value, bool):
            raise ConfigError(f"fori_loop: {name} must be True or False, got {value!r}.")
    check_metrics("fori_loop", metrics, "carry", "metrics=lambda val: {'loss': val.loss}")
    check = check_every
    if check is None:
        check = every if every is not None and not by_clock else when.check
    if isinstance(check, bool) or not isinstance(check, int) or check <= 0:
        raise ConfigError(f"fori_loop: check_every must be a positive int, got {check_every!r}.")
    return check


def _check_nothing_to_save_by(stoppable: object, save_last: object, *others: object) -> None:
    """A `fori_loop` without `every=`/`check_every=` saves nothing itself (the body's
    saves do): the options of a loop that saves its carry mean nothing there."""
    given = [
        name
        for name, value, default in (
            ("stoppable", stoppable, False),
            ("save_last", save_last, False),
            ("shardings", others[0], None),
            ("metrics", others[1], None),
        )
        if value is not default
    ]
    if given:
        raise ConfigError(
            f"fori_loop({given[0]}=...): {', '.join(given)} "
            f"{'is an option' if len(given) == 1 else 'are options'} of a loop that saves "
            "its carry itself, and this one saves nothing itself (no every= or "
            "check_every=: only the saves in its body). Fix: pass every=N to save the carry "
            "every N iterations, or leave them out."
        )
