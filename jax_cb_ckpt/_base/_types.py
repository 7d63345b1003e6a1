"""The types several stages share, below all of them: the values a Checkpointer's
options take, the checked options (`Options`) that the façade builds once
(`_options.checked`) and hands to the host side, the exchange and the writer, and what
the loops `run` and `ckpt.scan` use of a Checkpointer (`Saver`).

Nothing here runs or blocks; it imports nothing of the package at run time (the
names under `TYPE_CHECKING` are for the type checker only).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypeAlias

if TYPE_CHECKING:
    import jax
    from jax.typing import ArrayLike

    from .._layout._policy import Rules
    from .._save._stats import Stats

# A user's pytree (a state, a `like`, a prefix tree of shardings): any nesting of
# containers JAX flattens, holding any leaves. Python's types cannot say more, so it is
# `Any`, under a name that says a pytree is meant.
PyTree: TypeAlias = Any

OnFull = Literal["block", "skip", "newest"]  # a save that finds the queue full
OnError = Literal["raise", "continue"]  # a write that failed
OnExisting = Literal["raise", "replace"]  # another run's steps at or above a save's
OnDamaged = Literal["fall_back", "raise"]  # a restart that finds its newest step damaged
Crossing = Literal["auto", "buffer", "callback"]  # how traced arrays reach the host
Gather = Literal["stack", "concat", "replicated"]  # a state gathered over an axis
BestMode = Literal["max", "min"]  # keep_best: is a higher metric better, or a lower one


@dataclasses.dataclass(frozen=True)
class Options:
    """Every option of a Checkpointer, checked (see `Checkpointer` for their meaning)."""

    directory: str  # absolute path, or a canonical gs:// / s3:// URL
    every: int | None
    max_to_keep: int | None
    queue_size: int
    on_full: OnFull
    compression: bool
    on_error: OnError
    on_existing: OnExisting
    crossing: Crossing
    peer_timeout: float
    every_seconds: float | None = None  # also save when this long has passed
    check_every: int = 100  # a bare maybe_save asks the clock every this many steps
    initial_save: bool = False  # run / scan / restore_or_init save the starting state
    on_damaged: OnDamaged = "fall_back"  # a restart's newest step is damaged
    rules: Rules | None = None  # what retention keeps (None: every step)

    @property
    def slots(self) -> int:
        """Saves in flight at most: with "newest", `queue_size` wait and one more may
        be being written."""
        return self.queue_size + (self.on_full == "newest")


class Saver(Protocol):
    """What the loops (`_run.run`, `_scan.scan`) use of a Checkpointer: its public
    surface, so they need not import the façade."""

    @property
    def directory(self) -> str: ...
    @property
    def every(self) -> int | None: ...
    @property
    def every_seconds(self) -> float | None: ...
    @property
    def check_every(self) -> int: ...
    @property
    def initial_save(self) -> bool: ...
    def save_due(self, step: ArrayLike) -> jax.Array: ...
    def latest_step(self) -> int | None: ...
    def restore(self, like: PyTree, *, step: int | None = None) -> PyTree: ...
    def save(
        self, state: PyTree, step: ArrayLike, *, shardings: PyTree = None, metrics: PyTree = None
    ) -> None: ...
    def maybe_save(
        self,
        state: PyTree,
        step: ArrayLike,
        *,
        when: ArrayLike | None = None,
        shardings: PyTree = None,
        metrics: PyTree = None,
    ) -> None: ...
    def wait(self) -> None: ...
    @property
    def stats(self) -> Stats: ...
