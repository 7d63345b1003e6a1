"""`extra=` of the loops that save by themselves (`ckpt.scan`, `ckpt.fori_loop(every=)`):
the Checkpointer as those loops see it (`Saver`), its saves given the loop's `extra`.
(`ckpt.run` passes its own on: its jitted loop is cached, keyed by the extra.)"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._base._errors import ConfigError
from .._base._types import JsonExtra, PyTree, SavedSteps, Saver
from .._layout import _extra

if TYPE_CHECKING:
    import jax
    from jax.typing import ArrayLike


def with_extra(ckpt: Saver, extra: JsonExtra, call: str) -> Saver:
    """`ckpt`, or (`extra` given) `ckpt` whose saves store `extra`, checked now (`call`:
    the loop, for messages)."""
    checked = _extra.of(extra, call)
    return ckpt if checked is None else _WithExtra(ckpt, checked)


class _WithExtra:
    """A `Saver` whose `save` and `maybe_save` store `extra` (an `_extra.Extra`, which
    they take as a function of the step); the rest is the Checkpointer's."""

    def __init__(self, ckpt: Saver, extra: _extra.Extra) -> None:
        self._ckpt, self._extra = ckpt, extra

    @property
    def directory(self) -> str:
        return self._ckpt.directory

    @property
    def stats(self) -> SavedSteps:
        return self._ckpt.stats

    def save_due(self, step: ArrayLike) -> jax.Array:
        return self._ckpt.save_due(step)

    def should_stop(self, step: ArrayLike) -> jax.Array:
        return self._ckpt.should_stop(step)

    def latest_step(self) -> int | None:
        return self._ckpt.latest_step()

    def restore(self, like: PyTree, *, step: int | None = None) -> PyTree:
        return self._ckpt.restore(like, step=step)

    def wait(self) -> None:
        self._ckpt.wait()

    def save(
        self,
        state: PyTree,
        step: ArrayLike,
        *,
        shardings: PyTree = None,
        metrics: PyTree = None,
        extra: JsonExtra = None,
    ) -> None:
        self._ckpt.save(state, step, shardings=shardings, metrics=metrics, extra=self._extra)

    def maybe_save(
        self,
        state: PyTree,
        step: ArrayLike,
        *,
        when: ArrayLike | None = None,
        shardings: PyTree = None,
        metrics: PyTree = None,
        extra: JsonExtra = None,
    ) -> None:
        self._ckpt.maybe_save(
            state, step, when=when, shardings=shardings, metrics=metrics, extra=self._extra
        )


def refuse_without_saves(extra: object, every: int | None, check_every: int | None) -> None:
    """`fori_loop(extra=...)` without `every=`/`check_every=`: a loop that saves nothing
    itself has no saves to store it with."""
    if extra is not None and every is None and check_every is None:
        raise ConfigError(
            "fori_loop(extra=...): extra is an option of a loop that saves its carry "
            "itself, and this one saves nothing itself (no every= or check_every=). "
            "Fix: pass every=N, or pass extra= to the saves in its body."
        )
