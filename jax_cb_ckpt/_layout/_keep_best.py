"""Retention rule "best" (`keep_best=N, best=name, mode=`; Orbax's `BestN`).

For each member of a vmapped run (a plain save is one member), the N steps with the
best value of the metric `name`. NaN, a missing metric and a member's value at a step
it did not ask for never count; on a tie the step saved first keeps its place (a new
step enters a full set only when strictly better). Its tracker is one min-heap per
member of its best set, worst on top, as (goodness, -order), `order` counting the saves:
an add costs O(members log N) and returns the steps it pushed out of every best set.
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
import math
import reprlib
import typing
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, ClassVar

import numpy as np

from .._base._errors import ConfigError, shown
from .._base._types import BestMode
from ._format import MAX_METRIC_NAME
from ._rule import Entry, Held, positive_int

_MODES = typing.get_args(BestMode)


@dataclasses.dataclass(frozen=True)
class BestN:
    """Keep the `n` steps with the best value of the metric `metric` (a name given in
    `metrics=`): the highest with `mode="max"`, the lowest with `mode="min"` (the
    `keep_best=n, best=metric, mode=mode` keywords)."""

    metric: str
    n: int
    mode: BestMode = "max"
    reason: ClassVar[str] = "best"
    keywords: ClassVar[Mapping[str, Any]] = {"keep_best": None, "best": None, "mode": "max"}
    reads_metas: ClassVar[bool] = True

    def __post_init__(self) -> None:
        _check(self.n, self.metric, self.mode, "BestN", ("n", "metric", "mode"), optional=False)

    @property
    def ranks(self) -> str:
        return self.metric

    def to_json(self) -> dict[str, Any]:
        return {"keep_best": self.n, "best": self.metric, "mode": self.mode}

    @classmethod
    def from_keywords(cls, given: Mapping[str, Any], call: str) -> BestN | None:
        n, best, mode = given.get("keep_best"), given.get("best"), given.get("mode", "max")
        _check(n, best, mode, call, ("keep_best", "best", "mode"), optional=True)
        return None if n is None else cls(str(best), n, mode)  # (checked: a str)

    def describe(self) -> str:
        return f"keep_best={self.n} by {self.metric!r} ({self.mode})"

    def track(self, held: Held, previous: Any) -> BestSets:
        return BestSets(self, held)


def _check(
    n: object, best: object, mode: object, call: str, names: tuple[str, str, str], *, optional: bool
) -> None:
    """A `ConfigError` naming `call`'s argument for a bad count, metric or mode; with
    `optional`, neither count nor metric set passes."""
    n_name, best_name, mode_name = names
    positive_int(n, call, n_name, "keep the best this many steps by a metric", optional=optional)
    if mode not in _MODES:
        raise ConfigError(
            f"{call}({mode_name}={shown(mode)}): {mode_name} must be one of {_MODES}: 'max' "
            f"keeps the steps with the highest `{best_name}` metric (a return), 'min' the "
            "lowest (a loss)."
        )
    if (n is None) != (best is None):
        raise ConfigError(
            f"{call}({n_name}={shown(n)}, {best_name}={shown(best)}): {n_name} and "
            f"{best_name} go together: {n_name}=N keeps the N best steps by the metric "
            f"named {best_name}. Fix: pass both, e.g. {n_name}=3, {best_name}='return', "
            f"{mode_name}='max'."
        )
    if best is not None and (not isinstance(best, str) or not best or len(best) > MAX_METRIC_NAME):
        raise ConfigError(
            f"{call}({best_name}={shown(best)}): {best_name} must name a metric passed as "
            "metrics= (its key; nested keys joined with '/', e.g. 'eval/return')."
        )


def _flat(values: np.ndarray | None) -> list[Any]:
    """The members' values as Python numbers (exact comparisons, also for int64)."""
    return [] if values is None else np.asarray(values).ravel().tolist()


class BestSets:
    """Each member's best set over the held steps (see the module's docstring)."""

    shapes = True

    def __init__(self, rule: BestN, held: Held) -> None:
        self._keep = rule.n
        self._sign = 1 if rule.mode == "max" else -1
        self._held = held
        self._heaps: list[list[tuple[Any, int]]] = []
        self._in_best: collections.Counter[int] = collections.Counter()
        for step in sorted(held.entries, key=held.order.__getitem__):  # as if just added
            self.add(step, held.entries[step])

    def items(self, step: int, entry: Entry) -> Iterator[tuple[int, Any]]:
        """(member, (goodness, -order)) for each member whose value counts (not NaN,
        and the member asked for the step: a finished member of a vmapped while_loop
        has no state of its own there): on a tie, the step saved first ranks higher."""
        order = self._held.order[step]
        asked = None if entry.members is None else np.asarray(entry.members, bool).ravel()
        for member, value in enumerate(_flat(entry.values)):
            if value == value and (asked is None or member >= asked.size or asked[member]):
                yield member, (self._sign * value, -order)

    def add(self, step: int, entry: Entry) -> Iterable[int]:
        out_of_every_set = []
        for member, item in self.items(step, entry):
            self._heaps.extend([] for _ in range(member + 1 - len(self._heaps)))
            heap = self._heaps[member]
            if len(heap) < self._keep:
                heapq.heappush(heap, item)
            elif item > heap[0]:  # strictly better than the worst: a tie stays out
                _, negated = heapq.heapreplace(heap, item)
                out = self._held.stepped[-negated]
                self._in_best[out] -= 1
                if not self._in_best[out]:
                    del self._in_best[out]
                    out_of_every_set.append(out)
            else:
                continue
            self._in_best[step] += 1
        return out_of_every_set

    def keeps(self, step: int) -> bool:
        return step in self._in_best

    def decide(self, seconds: float | None) -> dict[str, Any]:
        return {}

    def best_step(self, member: int | tuple[int, ...] | None = None) -> int | None:
        """Member `member`'s best step (a flat index, or a tuple index into the batch
        shape: that of the newest step holding the metric); with None, the step holding
        the best value of any member. None when no step has a value that counts."""
        entries = self._held.entries.values()
        with_values = (e.values for e in reversed(entries) if e.values is not None)
        values = next(with_values, None)
        if values is None:
            return None
        index = None if member is None else _member_index(member, np.shape(values))
        heaps = self._heaps if index is None else self._heaps[index : index + 1]
        top = max((item for heap in heaps for item in heap), default=None)
        return None if top is None else self._held.stepped[-top[1]]


def _member_index(member: object, shape: tuple[int, ...]) -> int:
    """The flat index of `member` in a batch of `shape`, or a ValueError that says
    the shape and the indices it has."""
    if shape == ():
        raise ValueError(
            f"best_step(member={reprlib.repr(member)}): the steps hold a plain save's "
            "metric (shape ()), which has no members. Fix: call best_step() without member."
        )
    size = math.prod(shape)
    indices = member if isinstance(member, tuple) else (member,)
    bounds = shape if isinstance(member, tuple) else (size,)
    ints = [int(i) for i in indices if isinstance(i, (int, np.integer)) and not isinstance(i, bool)]
    if len(ints) == len(indices) == len(bounds) and all(map(lambda i, n: 0 <= i < n, ints, bounds)):
        return int(np.ravel_multi_index(ints, bounds))
    raise ValueError(
        f"best_step(member={reprlib.repr(member)}): no such member in the batch shape "
        f"{shape}. Fix: a flat index in range({size}), or a tuple of {len(shape)} "
        f"indices, each below {shape}."
    )
