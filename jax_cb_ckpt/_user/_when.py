"""`Checkpointer.maybe_save` and `save` up to the crossing: the step and the predicate
checked; whether the save happens decided in Python where it can be (no `cond` in the
program), else a traced condition (`every`, the clock every `check_every` steps,
`when=`, `last_step=`); in a `ckpt.while_loop`'s body, held to the members still in the
loop (`_loops.py`); then the request handed to the crossing (`Parts.cross`)."""

from __future__ import annotations

import functools
from collections.abc import Hashable
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp

from .._base._errors import ConfigError, calling, where
from .._base._types import Gather, JsonExtra, PyTree
from .._save import _route, _traced, _values

if TYPE_CHECKING:
    from jax.typing import ArrayLike

    from ._wiring import Parts


def maybe_save(
    parts: Parts,
    state: PyTree,
    step: ArrayLike,
    when: ArrayLike | None,
    axis_name: Hashable | None,
    gather: Gather,
    shardings: PyTree,
    metrics: PyTree,
    last_step: ArrayLike | None,
    extra: JsonExtra = None,
) -> None:
    """`Checkpointer.maybe_save` (its docstring)."""
    parts.check_usable()
    step_value = _traced.check_step(step)
    if when is None:
        wanted, condition = _default_predicate(parts, step, step_value)
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
    parts.cross(
        _route.Request(
            state, step, step_value, condition, axis_name, gather, shardings, metrics, extra
        ),
        wanted=wanted,
    )


def save(
    parts: Parts,
    state: PyTree,
    step: ArrayLike,
    axis_name: Hashable | None,
    gather: Gather,
    shardings: PyTree,
    metrics: PyTree,
    extra: JsonExtra = None,
) -> None:
    """`Checkpointer.save` (its docstring)."""
    parts.check_usable()
    step_value = _traced.check_step(step)
    if step_value is not None:
        _traced.warn_if_constant_in_loop(step_value, due=True)
    # In a ckpt.while_loop's body: only the members still in the loop (_loops.py).
    _, condition, step, step_value = _traced.only_live(True, None, step, step_value)
    parts.cross(
        _route.Request(
            state, step, step_value, condition, axis_name, gather, shardings, metrics, extra
        )
    )


def _default_predicate(
    parts: Parts, step: ArrayLike, step_value: int | None
) -> tuple[bool, jax.Array | None]:
    """`maybe_save` without `when=`: `step % every == 0`, or (`every_seconds`) the
    clock says a save is due, asked every `check_every` steps. (wanted, condition):
    decided in Python where it can be (no cond in the program)."""
    every, clock = parts.options.when.every, parts.clock
    if every is None and clock is None:
        raise ConfigError(
            f"{where()}: no predicate. Fix: pass when=<bool scalar>, or create the "
            "Checkpointer with every=N to save when step % N == 0 (or "
            "every_seconds=T to save when T seconds have passed since the last save)."
        )
    check = parts.options.when.check
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
