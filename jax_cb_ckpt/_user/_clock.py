"""`every_seconds`: whether a save is due by the wall clock, asked from the device.

The device cannot read a clock, and asking the host at every step would be a host
crossing per step (on a GPU, a copy the host waits for). So the question is asked only
where the loop stops anyway: `maybe_save` asks every `check_every` steps (one
`pure_callback` of a scalar under a `lax.cond`), and `run()` and `ckpt.scan` ask at the
chunk boundaries they already have. The time counts from the last save handed over
(any save, whatever decided it), or from the Checkpointer's opening.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from .._handoff._stats import StatsRecorder


class SaveClock:
    """Is a save due: have `every_seconds` passed since the last hand-off?"""

    def __init__(self, every_seconds: float, stats: StatsRecorder) -> None:
        self.every_seconds = every_seconds
        self._stats = stats
        # The highest step a bare maybe_save asked the clock at: its loop reached it
        # (for the warning at close that the loop went on past its newest checkpoint).
        self.seen: int | None = None

    def due(self) -> bool:
        return time.monotonic() - self._stats.last_handoff >= self.every_seconds

    def read(self, step: np.ndarray) -> np.ndarray:
        """The host side of `traced`: `due()` in the shape of `step` (vmap broadcasts)."""
        return np.full(np.shape(step), self.due(), dtype=bool)

    def _read_in_loop(self, step: np.ndarray) -> np.ndarray:
        """`read`, asked by a bare `maybe_save` at its loop's step: recorded (`seen`)."""
        if np.size(step):
            highest = int(np.max(step))
            self.seen = highest if self.seen is None else max(self.seen, highest)
        return self.read(step)

    def traced(self, step: ArrayLike, *, in_loop: bool = False) -> jax.Array:
        """A traced bool: is a save due? One host crossing per evaluation; guard it
        (`lax.cond(step % check_every == 0, ...)`). `step` must vary between
        evaluations (the loop counter), so the read is not hoisted out of the loop.
        `in_loop`: a bare `maybe_save`'s own question (its step is recorded)."""
        # pure_callback, as StopFlag.traced: no effect to order, and it batches and
        # differentiates; a read nobody uses may be dropped, which is what we want.
        step = jnp.asarray(step)
        return jax.pure_callback(
            self._read_in_loop if in_loop else self.read,
            jax.ShapeDtypeStruct(step.shape, jnp.bool_),
            jax.lax.stop_gradient(step),
            vmap_method="broadcast_all",
        )

    def guarded(self, step: jax.Array, check_every: int) -> jax.Array:
        """`traced(step)` every `check_every` steps, False in between (no crossing)."""
        return self._ask(step % check_every == 0, step)

    @functools.cached_property
    def _ask(self) -> Callable[[jax.Array, jax.Array], jax.Array]:
        """`ask(flag, step)`: the clock read under `lax.cond(flag, ...)`. Under vmap a
        batched `flag` would turn the cond into a select that reads the clock at every
        step, so the batching rule asks once for the batch (when any member's flag
        holds) and gives each member its flag's answer; nested vmaps recurse."""

        @jax.custom_batching.custom_vmap
        def ask(flag: jax.Array, step: jax.Array) -> jax.Array:
            return jax.lax.cond(
                flag,
                functools.partial(self.traced, in_loop=True),
                lambda s: jnp.zeros((), bool),
                step,
            )

        @ask.def_vmap
        def batched(
            axis_size: int, in_batched: list[bool], flag: jax.Array, step: jax.Array
        ) -> tuple[jax.Array, bool]:
            flag_batched, step_batched = in_batched
            one_flag = jnp.any(flag) if flag_batched else flag
            due = ask(one_flag, jnp.max(step) if step_batched else step)
            return (flag & due, True) if flag_batched else (due, False)

        return ask
