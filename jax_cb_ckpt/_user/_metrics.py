"""`metrics=` of the loops the library runs (`run`, `ckpt.scan`, `ckpt.fori_loop`) and of
a `maybe_save` given a function of the state: the argument's check, and the metrics of
a save computed only where it saves (a `lax.cond` in traced code). Runs while tracing."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from .._base._errors import ConfigError
from .._base._types import PyTree


def check_metrics(call: str, metrics: object, of: str, example: str, more: str = "") -> None:
    """The `metrics=` of a loop the library runs (`run`, `scan`, `fori_loop`), refused
    by name unless it is None or a function of `of` (the state or the carry)."""
    if metrics is not None and not callable(metrics):
        raise ConfigError(
            f"{call}(metrics={metrics!r}): metrics must be a function of the {of} that "
            f"returns the metrics to record with each save{more}, e.g. {example}."
        )


def metrics_at_save(
    metrics: Callable[[PyTree], PyTree] | None, carry: PyTree, when: jax.Array | None
) -> PyTree:
    """The metrics to record with a save of `carry` (`ckpt.scan`'s and `ckpt.run`'s):
    computed only where `when` holds (None: a save that always happens)."""
    if metrics is None:
        return None
    if when is None:
        return metrics(carry)
    shapes = jax.eval_shape(metrics, carry)
    return jax.lax.cond(
        when,
        metrics,
        lambda _: jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), shapes),
        carry,
    )
