"""`Checkpointer.scan`: `lax.scan` that saves every `every` iterations, with no
per-step conditional.

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

from collections.abc import Callable
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp

from ._errors import ConfigError
from ._types import PyTree, Saver

if TYPE_CHECKING:
    import numpy as np
    from jax.typing import ArrayLike


def scan(
    ckpt: Saver,
    f: Callable[[PyTree, PyTree], tuple[PyTree, PyTree]],
    init: PyTree,
    xs: PyTree,
    length: int | None,
    reverse: bool,
    unroll: int | bool,
    *,
    every: int,
    start: ArrayLike,
    shardings: PyTree,
) -> tuple[PyTree, PyTree]:
    if isinstance(every, bool) or not isinstance(every, int) or every <= 0:
        raise ConfigError(
            f"scan: every must be a positive int (iterations between saves), got {every!r}. "
            "Fix: pass every=N, or create the Checkpointer with every=N."
        )
    n = _length(xs, length)
    full, rest = divmod(n, every)
    if full == 0:  # not one save: the plain scan
        return jax.lax.scan(f, init, xs, length=n, reverse=reverse, unroll=unroll)
    cut = rest if reverse else full * every  # the chunks' iterations, and the rest's
    chunks = jax.tree.map(lambda x: _split(x, cut, reverse, full, every), xs)
    rest_xs = jax.tree.map(lambda x: x[:rest] if reverse else x[cut:], xs)

    def chunk(
        carry_done: tuple[PyTree, jax.Array], chunk_xs: PyTree
    ) -> tuple[tuple[PyTree, jax.Array], PyTree]:
        carry, done = carry_done
        carry, ys = jax.lax.scan(f, carry, chunk_xs, length=every, reverse=reverse, unroll=unroll)
        done = done + 1
        ckpt.save(carry, start + done * every, shardings=shardings)
        return (carry, done), ys

    (carry, _), chunk_ys = jax.lax.scan(
        chunk, (init, jnp.int32(0)), chunks, length=full, reverse=reverse
    )
    flat_ys = jax.tree.map(lambda y: y.reshape(full * every, *y.shape[2:]), chunk_ys)
    if not rest:
        return carry, flat_ys
    carry, rest_ys = jax.lax.scan(f, carry, rest_xs, length=rest, reverse=reverse, unroll=unroll)
    parts = (rest_ys, flat_ys) if reverse else (flat_ys, rest_ys)
    return carry, jax.tree.map(lambda a, b: jnp.concatenate([a, b]), *parts)


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
