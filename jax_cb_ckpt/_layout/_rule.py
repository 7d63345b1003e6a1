"""What a retention rule is: the protocol each `_keep_*.py` rule implements.

A rule (Orbax's `PreservationPolicy`, made incremental) is a small frozen object that
says which steps it keeps. It has:

- `reason`, its name in `kept_by` (`jax-cb-ckpt ls`'s "kept by" column);
- `keywords`, its short form: the `Checkpointer(...)` keywords that build it, which
  are also its keys in the JSON record a step is saved with (`to_json`,
  `from_keywords`), with their defaults;
- `ranks`, the metric it ranks steps by (`Entry.values`), or None, and `reads_metas`,
  whether it needs the steps' records (times, metrics) and not only their numbers;
- `track`, the incremental state it keeps while a `Keeper` holds steps (`Tracker`):
  an `add` of a step above every held step returns the steps it let go, so that a
  commit examines only those (the O(members log N) per commit of `_policy.Keeper`).

`_policy.py` combines the rules (`AnyOf`) and lists the known ones (`RULES`); the rule
modules import only this one. Numpy and the standard library.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping
from typing import Any, ClassVar, Protocol

import numpy as np

from .._base._errors import ConfigError, shown


@dataclasses.dataclass(frozen=True)
class Entry:
    """A step as retention sees it: when it was saved (seconds since the epoch, None:
    unknown) and the values of the metric a rule ranks by (`Rule.ranks`): shape () for
    a plain save, the batch shape under vmap (one value per member), None when the step
    has no such metric."""

    step: int
    seconds: float | None
    values: np.ndarray | None
    # Under vmap: which members asked for the save (bool, the batch shape); None for a
    # plain save, or one every member asked for.
    members: np.ndarray | None = None
    # The decisions the rules recorded with the step when it was saved (`Tracker.decide`,
    # e.g. the seconds chain's), read from its retention record; {}: none recorded.
    record: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    # The save's order (`StepMeta.saved_ns`): ties of `seconds` (one millisecond) are
    # ordered by it; None: not recorded (an older version).
    saved_ns: int | None = None


@dataclasses.dataclass
class Held:
    """What a `Keeper` holds, shared with its rules' trackers (read, never changed by
    them): the entries in ascending step order, and the order the steps were saved in
    ({step: order}, and back, {order: step})."""

    entries: dict[int, Entry]
    order: dict[int, int]
    stepped: dict[int, int]


class Tracker(Protocol):
    """A rule's state while a `Keeper` holds steps (made by `Rule.track`)."""

    # Removing a step it keeps changes what it keeps (the Keeper rebuilds then).
    shapes: bool

    def add(self, step: int, entry: Entry) -> Iterable[int]:
        """A step above every held step was added to `Held`; the steps this rule no
        longer keeps because of it (they are examined at the next settle)."""
        ...

    def keeps(self, step: int) -> bool:
        """Whether this rule keeps the held `step`; called only for the steps `add`
        returned and a few more, never for every held step per commit."""
        ...

    def decide(self, seconds: float | None) -> dict[str, Any]:
        """What to record with a step about to be saved at `seconds` (after every held
        step), so that a restart keeps what this run kept ({}: nothing)."""
        ...


class Rule(Protocol):
    """A retention rule (see the module's docstring). Frozen, compared by value."""

    reason: ClassVar[str]
    keywords: ClassVar[Mapping[str, Any]]
    # It reads the steps' records (save times, metrics, recorded decisions), not only
    # their numbers: the first commit then reads every listed step's meta.
    reads_metas: ClassVar[bool]

    @property
    def ranks(self) -> str | None: ...

    def to_json(self) -> dict[str, Any]:
        """Its keywords as set, for the step's JSON record."""
        ...

    @classmethod
    def from_keywords(cls, given: Mapping[str, Any], call: str) -> Rule | None:
        """The rule from its keywords in `given` (others ignored), None when they do not
        set it, or a `ConfigError` "{call}({name}=...): ..." naming the keyword."""
        ...

    def describe(self) -> str:
        """A short text for logs, e.g. "max_to_keep=3"."""
        ...

    def track(self, held: Held, previous: Tracker | None) -> Tracker:
        """Its state over the steps `held` holds (O(N log N)); `previous`: this rule's
        tracker before a rebuild caused by an add below the newest step (what it decided
        for good, it keeps), else None."""
        ...


class Stateless:
    """A tracker for a rule that decides each step by itself (`keeps`)."""

    shapes = False

    def __init__(self, keeps: Any) -> None:
        self.keeps = keeps

    def add(self, step: int, entry: Entry) -> Iterable[int]:
        return ()

    def decide(self, seconds: float | None) -> dict[str, Any]:
        return {}


def positive_int(value: object, call: str, name: str, meaning: str, *, optional: bool) -> Any:
    """`value`, or a `ConfigError` naming `call`'s argument `name` (None passes when
    `optional`)."""
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        allowed = "a positive int" + (" or None" if optional else "")
        raise ConfigError(
            f"{call}({name}=...): {name} must be {allowed} ({meaning}), got "
            f"{shown(value)} of type {type(value).__name__}."
        )
    return value


def positive_seconds(
    value: object, call: str, name: str, meaning: str, *, optional: bool = True
) -> Any:
    """`value` as a float (None passes when `optional`), or a `ConfigError` naming
    `call`'s argument `name`."""
    if value is None and optional:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value <= 0
    ):
        raise ConfigError(
            f"{call}({name}=...): {name} must be a positive number of seconds"
            f"{' or None' if optional else ''} ({meaning}), got {shown(value)}."
        )
    return float(value)
