"""Retention rule "latest" (`max_to_keep=N`; Orbax's `LatestN`): the newest N steps.

"Newest" is by step number, among the held steps. Its tracker is a deque of the newest
N: an add pushes one out (examined at the next settle): O(1) per commit.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any, ClassVar

from ._rule import Entry, Held, positive_int


@dataclasses.dataclass(frozen=True)
class LatestN:
    """Keep the newest `n` steps (the `max_to_keep=n` keyword)."""

    n: int
    reason: ClassVar[str] = "latest"
    keywords: ClassVar[Mapping[str, Any]] = {"max_to_keep": None}
    reads_metas: ClassVar[bool] = False

    def __post_init__(self) -> None:
        positive_int(self.n, "LatestN", "n", "how many of the newest steps to keep", optional=False)

    @property
    def ranks(self) -> str | None:
        return None

    def to_json(self) -> dict[str, Any]:
        return {"max_to_keep": self.n}

    @classmethod
    def from_keywords(cls, given: Mapping[str, Any], call: str) -> LatestN | None:
        n = given.get("max_to_keep")
        positive_int(n, call, "max_to_keep", "how many checkpoints to keep", optional=True)
        return None if n is None else cls(n)

    def describe(self) -> str:
        return f"max_to_keep={self.n}"

    def track(self, held: Held, previous: Any) -> _Latest:
        return _Latest(self.n, list(held.entries))


class _Latest:
    shapes = True

    def __init__(self, n: int, steps: list[int]) -> None:
        self._n = n
        self._latest = collections.deque(steps[-n:])

    def add(self, step: int, entry: Entry) -> Iterable[int]:
        self._latest.append(step)
        return (self._latest.popleft(),) if len(self._latest) > self._n else ()

    def keeps(self, step: int) -> bool:
        return bool(self._latest) and step >= self._latest[0]

    def decide(self, seconds: float | None) -> dict[str, Any]:
        return {}
