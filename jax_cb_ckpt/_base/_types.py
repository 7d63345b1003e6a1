"""The types several stages share, below all of them: the values a Checkpointer's
options take (the options themselves are `_user/_options.Options`; the stages below
get the values they read as arguments), and what the loops `run` and `ckpt.scan` use
of a Checkpointer (`Saver`, `SavedSteps`).

Nothing here runs or blocks; it imports nothing of the package at run time (the
names under `TYPE_CHECKING` are for the type checker only).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal, Protocol, TypeAlias

if TYPE_CHECKING:
    from collections.abc import Callable

    import jax
    from jax.typing import ArrayLike

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
# A save's `extra=` (`_layout/_extra`): a JSON object, or a function of the step (an int)
# returning one, called on the host when the save fires; None: no extra item.
JsonExtra: TypeAlias = "dict[str, Any] | Callable[[int], dict[str, Any]] | None"
BestMode = Literal["max", "min"]  # keep_best: is a higher metric better, or a lower one


class SavedSteps(Protocol):
    """What the loops read of a Checkpointer's counters (`ckpt.stats`, a
    `_handoff/_stats.Stats`: a stage above this one, described here, never imported)."""

    @property
    def last_saved_step(self) -> int | None: ...


class Saver(Protocol):
    """What the loops (`_run.run`, `_scan.scan`) use of a Checkpointer: its public
    surface, so they need not import the façade (its options come as an argument)."""

    @property
    def directory(self) -> str: ...
    def save_due(self, step: ArrayLike) -> jax.Array: ...
    def should_stop(self, step: ArrayLike) -> jax.Array: ...
    def latest_step(self) -> int | None: ...
    def restore(self, like: PyTree, *, step: int | None = None) -> PyTree: ...
    def save(
        self,
        state: PyTree,
        step: ArrayLike,
        *,
        shardings: PyTree = None,
        metrics: PyTree = None,
        extra: JsonExtra = None,
    ) -> None: ...
    def maybe_save(
        self,
        state: PyTree,
        step: ArrayLike,
        *,
        when: ArrayLike | None = None,
        shardings: PyTree = None,
        metrics: PyTree = None,
        extra: JsonExtra = None,
    ) -> None: ...
    def wait(self) -> None: ...
    @property
    def stats(self) -> SavedSteps: ...
