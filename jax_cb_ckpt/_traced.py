"""The traced side of a save: checks in Python while tracing, then one guarded crossing.

Why `io_callback(ordered=True)` and not the other callbacks:
- `jax.pure_callback` may be removed by dead-code elimination (its result is unused) or
  run more than once; a save is a side effect.
- `jax.debug.callback` may be dropped, duplicated or reordered, and inside a vmapped
  `lax.cond` it fires for every batch element on every step.
- `ordered=True` makes the saves run in program order, so the writer sees steps in the
  order the loop produced them, and `jax.effects_barrier()` waits for all of them.

Why `lax.cond`: the predicate is evaluated on the device, and only the true branch holds
the callback, so steps that do not save move no data to the host.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import io_callback

from ._errors import InvalidStateError


def _describe(x: Any) -> str:
    dtype = getattr(x, "dtype", None)
    shape = getattr(x, "shape", None)
    if dtype is not None and shape is not None:
        return f"{dtype}[{','.join(str(d) for d in shape)}]"
    return f"{type(x).__name__} ({x!r})"


def check_step(step: Any, where: str) -> jax.Array:
    """`step` as an integer scalar array, or an error that says how to fix it."""
    ok = not isinstance(step, bool) and (
        isinstance(step, int)
        or (hasattr(step, "dtype") and jnp.issubdtype(step.dtype, jnp.integer))
    )
    if ok and jnp.shape(step) != ():
        ok = False
    if not ok:
        raise InvalidStateError(
            f"{where}: step must be an integer scalar (a Python int or an integer array "
            f"of shape ()), got {_describe(step)}. Fix: pass the loop counter (e.g. the "
            "scan index or TrainState.step), cast with step.astype(jnp.int32) if it is "
            "a float, or index out a single element if it is batched."
        )
    return jnp.asarray(step)


def check_when(when: Any, where: str) -> jax.Array:
    """`when` as a boolean scalar array, or an error that says how to fix it."""
    ok = isinstance(when, bool) or (
        hasattr(when, "dtype") and jnp.issubdtype(when.dtype, jnp.bool_)
    )
    if ok and jnp.shape(when) != ():
        ok = False
    if not ok:
        raise InvalidStateError(
            f"{where}: when must be a boolean scalar (a Python bool or a bool array of "
            f"shape ()), got {_describe(when)}. Fix: compare to get a bool, e.g. "
            "when=(step % 500 == 0) | done."
        )
    return jnp.asarray(when)


def cross(host_fn: Any, signature: Any, step: jax.Array, payload: list[Any], pred: Any) -> None:
    """Hand `payload` to `host_fn(signature, step, *payload)` on the host, if `pred`.

    With `pred=None` the crossing is unconditional. Blocks the device program (not the
    Python caller) until the host side has taken the data.
    """
    callback = functools.partial(host_fn, signature)

    def crossing(step, payload):
        io_callback(callback, None, step, *payload, ordered=True)

    if pred is None:
        crossing(step, payload)
    else:
        jax.lax.cond(pred, crossing, lambda step, payload: None, step, payload)
