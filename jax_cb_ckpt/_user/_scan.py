"""`Checkpointer.scan`: `lax.scan` that saves every `every` iterations, with no
per-step conditional (with `every_seconds`: one host query and one conditional per
chunk, none per step).

A `maybe_save` in a scan body is a `lax.cond` evaluated every step; on a GPU, XLA's
conditional copies the predicate to the host and waits for it each time, so the host can
no longer run ahead of the device (docs/benchmarks.md, the H200 run). Here the scan is
nested instead: an outer scan over chunks of `every` iterations, the save between two
chunks (one unconditional crossing per chunk), and the iterations that do not fill a
chunk in a plain scan of their own (after the chunks; before them with `reverse`, so
that saves still come every `every` iterations in the order the scan runs). The body
runs in the same order on the same values as in one `lax.scan`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp

from .._base._errors import ConfigError
from .._base._types import JsonExtra, PyTree, Saver
from . import _with_extra
from ._metrics import check_metrics, metrics_at_save
from ._options import When

if TYPE_CHECKING:
    import numpy as np
    from jax.typing import ArrayLike

    from ._wiring import Parts


# The user's scan body, `f(carry, x) -> (carry, y)`, as `lax.scan` takes it.
ScanBody = Callable[[PyTree, PyTree], tuple[PyTree, PyTree]]


def scan(
    ckpt: Saver,
    parts: Parts,
    f: ScanBody,
    init: PyTree,
    xs: PyTree,
    length: int | None,
    reverse: bool,
    unroll: int | bool,
    *,
    every: int | None,
    start: ArrayLike,
    shardings: PyTree,
    metrics: Callable[[PyTree], PyTree] | None,
    extra: JsonExtra = None,
) -> tuple[PyTree, PyTree]:
    """`Checkpointer.scan` (its docstring): `ckpt` saves (each save given `extra`),
    `every` defaults to the Checkpointer's; run eagerly, a failure that a callback of
    ours caused is raised as ours (`Parts.running`)."""
    ckpt = _with_extra.with_extra(ckpt, extra, "scan")
    when = parts.options.when
    every = when.every if every is None else every
    if every is None and parts.clock is None:
        raise ConfigError(
            "scan: no every. Fix: pass every=N, or create the Checkpointer with "
            "every=N (or every_seconds=T)."
        )
    return parts.running(
        lambda: _scan(
            ckpt,
            when,
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
    )


def _scan(
    ckpt: Saver,
    when: When,
    f: ScanBody,
    init: PyTree,
    xs: PyTree,
    length: int | None,
    reverse: bool,
    unroll: int | bool,
    *,
    every: int | None,
    start: ArrayLike,
    shardings: PyTree,
    metrics: Callable[[PyTree], PyTree] | None,
) -> tuple[PyTree, PyTree]:
    if every is not None and (isinstance(every, bool) or not isinstance(every, int) or every <= 0):
        raise ConfigError(
            f"scan: every must be a positive int (iterations between saves), got {every!r}. "
            "Fix: pass every=N, or create the Checkpointer with every=N."
        )
    check_metrics("scan", metrics, "carry", "metrics=lambda carry: {'loss': carry.loss}")
    by_clock = when.every_seconds is not None
    # Without the clock, a chunk is `every` iterations and each boundary saves; with
    # it, the boundaries come every `check_every` iterations too, and ask it.
    if every is None:
        size = when.check
    else:
        size = math.gcd(every, when.check) if by_clock else every
    if when.initial_save and isinstance(start, int) and start == 0 and ckpt.latest_step() is None:
        # A fresh run (decided while tracing): its starting state is step 0.
        ckpt.save(init, start, shardings=shardings, metrics=metrics_at_save(metrics, init, None))
    n = _length(xs, length)
    full, rest = divmod(n, size)
    if full == 0:  # not one save: the plain scan
        return jax.lax.scan(f, init, xs, length=n, reverse=reverse, unroll=unroll)
    cut = rest if reverse else full * size  # the chunks' iterations, and the rest's
    chunks = jax.tree.map(lambda x: _split(x, cut, reverse, full, size), xs)
    rest_xs = jax.tree.map(lambda x: x[:rest] if reverse else x[cut:], xs)

    def scanned(carry: PyTree, chunk_xs: PyTree) -> tuple[PyTree, PyTree]:
        return jax.lax.scan(f, carry, chunk_xs, length=size, reverse=reverse, unroll=unroll)

    chunk = _chunk(ckpt, scanned, size, start, every, by_clock, shardings, metrics)
    (carry, _), chunk_ys = jax.lax.scan(
        chunk, (init, jnp.int32(0)), chunks, length=full, reverse=reverse
    )
    flat_ys = jax.tree.map(lambda y: y.reshape(full * size, *y.shape[2:]), chunk_ys)
    if not rest:
        return carry, flat_ys
    carry, rest_ys = jax.lax.scan(f, carry, rest_xs, length=rest, reverse=reverse, unroll=unroll)
    parts = (rest_ys, flat_ys) if reverse else (flat_ys, rest_ys)
    return carry, jax.tree.map(lambda a, b: jnp.concatenate([a, b]), *parts)


def _chunk(
    ckpt: Saver,
    scanned: ScanBody,
    size: int,
    start: ArrayLike,
    every: int | None,
    by_clock: bool,
    shardings: PyTree,
    metrics: Callable[[PyTree], PyTree] | None,
) -> Callable[[tuple[PyTree, jax.Array], PyTree], tuple[tuple[PyTree, jax.Array], PyTree]]:
    """The outer scan's body: one chunk of `size` iterations (`scanned`), then the save
    at its end (with the clock: when it is due, or at a multiple of `every`)."""

    def chunk(
        carry_done: tuple[PyTree, jax.Array], chunk_xs: PyTree
    ) -> tuple[tuple[PyTree, jax.Array], PyTree]:
        carry, done = carry_done
        carry, ys = scanned(carry, chunk_xs)
        done = done + 1
        step = start + done * size
        if not by_clock:  # every boundary saves: no conditional
            ckpt.save(
                carry, step, shardings=shardings, metrics=metrics_at_save(metrics, carry, None)
            )
            return (carry, done), ys
        when = ckpt.save_due(step)  # one host query per chunk
        if every is not None:
            when = when | (done * size % every == 0)
        recorded = metrics_at_save(metrics, carry, when)
        ckpt.maybe_save(carry, step, when=when, shardings=shardings, metrics=recorded)
        return (carry, done), ys

    return chunk


def _length(xs: PyTree, length: int | None) -> int:
    """The number of iterations, as `lax.scan` takes it (its own checks follow)."""
    lengths = {int(jnp.shape(x)[0]) for x in jax.tree.leaves(xs) if jnp.ndim(x) > 0}
    if length is None:
        if len(lengths) != 1:
            raise ConfigError(
                "scan: the number of iterations is unknown: pass length=, or xs whose "
                f"leaves all have the same leading axis (got leading axes {sorted(lengths)})."
            )
        return lengths.pop()
    if isinstance(length, bool) or not isinstance(length, int) or length < 0:
        raise ConfigError(f"scan: length must be a non-negative int, got {length!r}.")
    if lengths and lengths != {length}:
        raise ConfigError(
            f"scan: length={length}, but xs has leaves with leading axes {sorted(lengths)}."
        )
    return length


def _split(
    x: jax.Array | np.ndarray, cut: int, reverse: bool, full: int, every: int
) -> jax.Array | np.ndarray:
    """The part of one xs leaf that the chunks take, as (full, every, ...)."""
    part = x[cut:] if reverse else x[:cut]
    return part.reshape(full, every, *part.shape[1:])
