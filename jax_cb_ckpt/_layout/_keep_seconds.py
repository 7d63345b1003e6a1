"""Retention rule "seconds" (`keep_every_seconds=T`; Orbax's `EveryNSeconds`).

Walking the held steps in the order they were saved (by their save times; a counter
restarted below the newest step does not reorder them): the first one with a save time,
then each saved at least T seconds after the previous one kept so. A step so kept stays
kept. The decision is recorded with each step when it is saved (`decide`:
`"seconds_chain"` in its retention record), so that a restart keeps what the run kept
even when the clock jumped meanwhile. Its tracker is the chain (a set) and the time of
its last step: O(1) per commit.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any, ClassVar

from ._rule import Entry, Held, positive_seconds

_MEANING = "keep one step per this many seconds"


@dataclasses.dataclass(frozen=True)
class EveryNSeconds:
    """Keep one step per `seconds` (the `keep_every_seconds=seconds` keyword)."""

    seconds: float
    reason: ClassVar[str] = "seconds"
    keywords: ClassVar[Mapping[str, Any]] = {"keep_every_seconds": None}
    reads_metas: ClassVar[bool] = True

    def __post_init__(self) -> None:
        seconds = positive_seconds(
            self.seconds, "EveryNSeconds", "seconds", _MEANING, optional=False
        )
        object.__setattr__(self, "seconds", seconds)

    @property
    def ranks(self) -> str | None:
        return None

    def to_json(self) -> dict[str, Any]:
        return {"keep_every_seconds": self.seconds}

    @classmethod
    def from_keywords(cls, given: Mapping[str, Any], call: str) -> EveryNSeconds | None:
        seconds = given.get("keep_every_seconds")
        seconds = positive_seconds(seconds, call, "keep_every_seconds", _MEANING)
        return None if seconds is None else cls(seconds)

    def describe(self) -> str:
        return f"keep_every_seconds={self.seconds}"

    def track(self, held: Held, previous: Any) -> _Chain:
        return _Chain(self.seconds, held, previous if isinstance(previous, _Chain) else None)


class _Chain:
    shapes = True

    def __init__(self, every: float, held: Held, previous: _Chain | None) -> None:
        self._every = every
        self._chain: set[int] = set()
        self._last: float | None = None
        kept = set() if previous is None else previous._chain  # (what it kept, stays)
        # In the order the steps were saved: a step saved later with a lower number (a
        # restarted counter) must not push out the steps the chain already kept.
        timed = sorted((e.seconds, s) for s, e in held.entries.items() if e.seconds is not None)
        for _, step in timed:
            entry = held.entries[step]
            self._offer(step, entry.seconds, True if step in kept else self._recorded(entry))

    def _recorded(self, entry: Entry) -> bool | None:
        """The decision recorded with the step, when made under the same interval."""
        record = entry.record
        value = record.get("seconds_chain")
        same = record.get("keep_every_seconds") == self._every
        return value if same and isinstance(value, bool) else None

    def _would_chain(self, seconds: float | None) -> bool:
        return seconds is not None and (self._last is None or seconds >= self._last + self._every)

    def _offer(self, step: int, seconds: float | None, chained: bool | None) -> None:
        if seconds is None:
            return
        if chained if chained is not None else self._would_chain(seconds):
            self._chain.add(step)
            self._last = seconds if self._last is None else max(self._last, seconds)

    def add(self, step: int, entry: Entry) -> Iterable[int]:
        self._offer(step, entry.seconds, self._recorded(entry))
        return ()

    def keeps(self, step: int) -> bool:
        return step in self._chain

    def decide(self, seconds: float | None) -> dict[str, Any]:
        return {"seconds_chain": self._would_chain(seconds)}
