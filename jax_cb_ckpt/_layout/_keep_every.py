"""Retention rule "every" (`keep_every=K`; Orbax's `EveryNSteps`): every step whose
number is a multiple of K, forever. Decided by the step's number alone: no state, O(1).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar

from ._rule import Held, Stateless, positive_int

_MEANING = "keep every step that is a multiple of it"


@dataclasses.dataclass(frozen=True)
class EveryNSteps:
    """Keep every step that is a multiple of `n`, forever (the `keep_every=n` keyword)."""

    n: int
    reason: ClassVar[str] = "every"
    keywords: ClassVar[Mapping[str, Any]] = {"keep_every": None}
    reads_metas: ClassVar[bool] = False

    def __post_init__(self) -> None:
        positive_int(self.n, "EveryNSteps", "n", _MEANING, optional=False)

    @property
    def ranks(self) -> str | None:
        return None

    def to_json(self) -> dict[str, Any]:
        return {"keep_every": self.n}

    @classmethod
    def from_keywords(cls, given: Mapping[str, Any], call: str) -> EveryNSteps | None:
        n = given.get("keep_every")
        positive_int(n, call, "keep_every", _MEANING, optional=True)
        return None if n is None else cls(n)

    def describe(self) -> str:
        return f"keep_every={self.n}"

    def track(self, held: Held, previous: Any) -> Stateless:
        return Stateless(lambda step: step % self.n == 0)
