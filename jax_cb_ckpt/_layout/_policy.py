"""Retention: which checkpoint steps the writer thread keeps after each commit.

The rules are objects, one module each (`_keep_latest.py`, `_keep_every.py`,
`_keep_seconds.py`, `_keep_best.py`; the protocol in `_rule.py`), listed in `RULES`.
They combine as a union (`AnyOf`, Orbax's `AnyPreservationPolicy`): a step stays while
any rule keeps it, and the newest step always stays (a run must be able to resume from
it); so does, under vmap, the newest step each member asked for (a member that stopped
saving, a finished member of a vmapped while_loop, resumes from there). With no rule
set everything is kept, and the writer builds no `Keeper` at all.

Each rule has a short form, the `Checkpointer(...)` keywords that build it and its keys
in the JSON record a step is saved with (`AnyOf.short`, `to_json`, `from_json`):
`max_to_keep` (`LatestN`), `keep_every` (`EveryNSteps`), `keep_every_seconds`
(`EveryNSeconds`), `keep_best`, `best` and `mode` (`BestN`).

What a Keeper keeps is always what a pass from scratch over the steps it holds would
keep: a step it lets go was outside every best set and the seconds chain, so its absence
changes neither. So a Keeper built from a directory's listing carries on exactly as one
that saw every commit, and rules changed between runs apply from the first settle.

Cost: `add` and `settle` of a step above the others take O(members * log N) amortized,
however many steps are held: each rule's tracker (`Rule.track`) returns the steps an
add made it let go, and settle examines only those (and the step that stopped being the
newest). A step removed by someone else, an add below the newest and the construction
cost O(N log N) once (`tests/test_retention.py` counts the steps a rule is asked about).

Example::

    keeper = Keeper(AnyOf((LatestN(3), BestN("return", 1))), listed_entries)
    keeper.add(Entry(step, time.time(), np.asarray(episode_return)))
    for gone in keeper.settle():
        delete(gone)
"""

from __future__ import annotations

import dataclasses
import math
import reprlib
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from .._base._errors import ConfigError
from ._keep_best import BestN, BestSets
from ._keep_every import EveryNSteps
from ._keep_latest import LatestN
from ._keep_seconds import EveryNSeconds
from ._rule import Entry, Held, Rule, Tracker

if TYPE_CHECKING:
    from ._format import StepMeta

# The rules a record can name, in the order of the record's keys and of `kept_by`'s
# reasons: a new rule is one module and one name here.
RULES: tuple[type[Rule], ...] = (LatestN, EveryNSteps, EveryNSeconds, BestN)

R = TypeVar("R", bound=Rule)


def keywords() -> dict[str, Any]:
    """Every rule's short form: {`Checkpointer(...)` keyword: its default}."""
    return {name: default for rule in RULES for name, default in rule.keywords.items()}


def _place(rule: Rule) -> tuple[int, str]:
    kind = type(rule)
    return (RULES.index(kind) if kind in RULES else len(RULES), kind.__name__)


@dataclasses.dataclass(frozen=True)
class AnyOf:
    """Rules combined: a step is kept while any of them keeps it (see the module's
    docstring). Held in `RULES` order, whatever order they were given in, so that a
    record and `kept_by` read the same however the rules were spelt. At most one rule
    of each kind, and one metric ranked."""

    rules: tuple[Rule, ...] = ()

    def __post_init__(self) -> None:
        rules = tuple(self.rules)
        problem = self.problem(rules)
        if problem is not None:
            raise ConfigError(f"AnyOf(rules): {problem}")
        object.__setattr__(self, "rules", tuple(sorted(rules, key=_place)))

    @staticmethod
    def problem(rules: tuple[Rule, ...]) -> str | None:
        """What is wrong with combining `rules` (and how to fix it), or None."""
        kinds = [type(rule).__name__ for rule in rules]
        twice = sorted({kind for kind in kinds if kinds.count(kind) > 1})
        if twice:
            return (
                f"{twice[0]} is given {kinds.count(twice[0])} times; a step records one "
                "rule of each kind. Fix: one rule of each kind."
            )
        ranked = sorted({rule.ranks for rule in rules if rule.ranks is not None})
        if len(ranked) > 1:
            return (
                f"the rules rank the metrics {ranked}; a step records the values of one "
                "ranked metric. Fix: rank by one metric."
            )
        return None

    @classmethod
    def short(cls, given: Mapping[str, Any], call: str = "Checkpointer") -> AnyOf:
        """The rules the short form `given` sets ({keyword: value}; None values and
        other keys ignored), or a `ConfigError` "{call}({keyword}=...): ..."."""
        made = (kind.from_keywords(given, call) for kind in RULES)
        return cls(tuple(rule for rule in made if rule is not None))

    @property
    def any(self) -> bool:
        """Some rule is set (otherwise every step is kept, with no Keeper)."""
        return bool(self.rules)

    @property
    def metric(self) -> str | None:
        """The metric a rule ranks steps by (`Entry.values`), or None."""
        return next((rule.ranks for rule in self.rules if rule.ranks is not None), None)

    def find(self, kind: type[R]) -> R | None:
        """The rule of type `kind`, or None."""
        return next((rule for rule in self.rules if type(rule) is kind), None)

    def to_json(self) -> dict[str, Any]:
        """Each rule's keywords, in `RULES` order, for a JSON file."""
        return {name: value for rule in self.rules for name, value in rule.to_json().items()}

    @classmethod
    def from_json(cls, data: object) -> AnyOf:
        """Rules from a record `to_json` wrote, read from a file nobody vouches for: a
        `ValueError` naming the field and value for anything `to_json` does not write
        (a null, a bool for an int, NaN seconds, ...). A missing key is its default and
        an unknown key is ignored (a newer version's rule)."""
        if not isinstance(data, dict):
            kind = type(data).__name__
            raise ValueError(
                f"retention record: {reprlib.repr(data)} is a {kind}, not a JSON object."
            )
        for name in keywords():
            if name in data and data[name] is None:
                raise ValueError(f"retention record: {name} is null; to_json leaves it out.")
        return cls.short(data, "retention record")

    def describe(self) -> str:
        """One line for messages and logs, e.g. "max_to_keep=3, keep_best=2 by 'return'
        (max)"; "keep all" when no rule is set."""
        return ", ".join(rule.describe() for rule in self.rules) or "keep all"


class Keeper:
    """The retention state of one directory, used by the writer thread only (no lock).

    Data structures, chosen so that a commit never scans every held step: `Held`'s
    entries are a dict in ascending step order (new steps arrive at its end; a deletion
    is O(1)), with the order the steps were saved in; each rule keeps its own tracker
    (`Rule.track`); `_unchecked` holds the only steps whose answer may have changed
    since the last settle (a new newest, the steps a tracker let go, everything after a
    rebuild), and settle examines only those.
    """

    def __init__(self, rules: AnyOf, entries: Iterable[Entry] = ()) -> None:
        if not rules.any:
            raise ValueError(
                "Keeper(rules): no rule is set, so every step is kept and no Keeper is "
                "needed. Fix: build one only when rules.any."
            )
        self._rules = rules
        held = {entry.step: entry for entry in entries}
        # The order the steps were saved in: listed steps by their save times (then the
        # order recorded within one millisecond, then step), each one added later after
        # them: {step: order}.
        listed = sorted(
            held.values(),
            key=lambda e: (
                -math.inf if e.seconds is None else e.seconds,
                -1 if e.saved_ns is None else e.saved_ns,
                e.step,
            ),
        )
        self._held = Held(held, {entry.step: index for index, entry in enumerate(listed)}, {})
        self._next = len(listed)
        self._trackers: list[Tracker] = []
        self._rebuild()

    def _rebuild(self, *, carry_on: bool = False) -> None:
        """Everything anew from the held steps, all of them unchecked: O(N log N).
        `carry_on`: each rule keeps what it decided for good (an add out of order
        never revokes what the seconds chain kept)."""
        held = self._held
        held.entries = dict(sorted(held.entries.items()))
        held.stepped = {order: step for step, order in held.order.items()}
        self._unchecked = set(held.entries)
        # The newest step every member asked for (`_all_asked`), and each member's newest
        # step after it ({flat member index: step}, from steps some members did not ask
        # for), out of `_size` members: a member's newest is its entry, else the former.
        self._all_asked: int | None = None
        self._members_newest: dict[int, int] = {}
        self._size: int | None = None
        for step, entry in held.entries.items():
            self._offer_members(step, entry.members)
        before = self._trackers if carry_on else [None] * len(self._rules.rules)
        rules = self._rules.rules
        self._trackers = [rule.track(held, old) for rule, old in zip(rules, before, strict=True)]

    def decisions(self, seconds: float | None) -> dict[str, Any]:
        """What the rules record with a step about to be saved at `seconds` (after every
        held step): `Tracker.decide`, e.g. whether it joins the seconds chain."""
        return {k: v for tracker in self._trackers for k, v in tracker.decide(seconds).items()}

    def _offer_members(self, step: int, members: np.ndarray | None) -> None:
        """Each member's newest step, for a step above every held step (`members`: which
        asked for it; None: all of them)."""
        if members is None or np.asarray(members).all():
            self._unchecked.update(self._members_newest.values())
            if self._all_asked is not None:
                self._unchecked.add(self._all_asked)
            self._all_asked, self._members_newest, self._size = step, {}, None
            return
        flat = np.asarray(members, bool).ravel()
        self._size = flat.size
        for member in np.flatnonzero(flat).tolist():
            old = self._members_newest.get(member)
            if old is not None:
                self._unchecked.add(old)
            self._members_newest[member] = step
        if len(self._members_newest) >= self._size and self._all_asked is not None:
            self._unchecked.add(self._all_asked)  # every member asked for a newer step

    def _a_newest(self, step: int) -> bool:
        """`step` is the newest step, or the newest step some member asked for."""
        if step == next(reversed(self._held.entries), None):
            return True
        if step in self._members_newest.values():
            return True
        size = self._size
        return step == self._all_asked and (size is None or len(self._members_newest) < size)

    def add(self, entry: Entry) -> None:
        """A step just committed. One above every held step costs O(members log N); one
        below the newest, or one already held (its entry is replaced), rebuilds: O(N)."""
        held = self._held
        newest = next(reversed(held.entries), None)
        step = entry.step
        held.order[step] = self._next  # saved after every held step
        held.stepped[self._next] = step
        self._next += 1
        if step in held.entries or (newest is not None and step < newest):
            # A step saved anew replaces the old one, as if removed first; one below the
            # newest (a restarted counter) keeps what the rules decided for good.
            again = step in held.entries
            held.entries[step] = entry
            self._rebuild(carry_on=not again)
            return
        held.entries[step] = entry
        if newest is not None:
            self._unchecked.add(newest)  # no longer the newest
        for tracker in self._trackers:
            self._unchecked.update(tracker.add(step, entry))
        self._offer_members(step, entry.members)

    def remove(self, step: int) -> None:
        """A step deleted by someone else (an unknown step: nothing). One that shapes a
        rule (the newest, or a step a rule with state keeps) rebuilds: O(N log N)."""
        if step not in self._held.entries:
            return
        shapes = self._a_newest(step) or any(t.shapes and t.keeps(step) for t in self._trackers)
        del self._held.entries[step]
        self._forget_order(step)
        self._unchecked.discard(step)
        if shapes:
            self._rebuild()

    def settle(self) -> list[int]:
        """The steps no rule keeps any more, ascending; forgotten here, for the caller to
        delete. Only the unchecked steps are examined (see the class docstring)."""
        held = (step for step in self._unchecked if step in self._held.entries)
        gone = sorted(step for step in held if not self.kept_by(step))
        self._unchecked.clear()
        for step in gone:  # kept by no tracker: a plain deletion
            del self._held.entries[step]
            self._forget_order(step)
        return gone

    def _forget_order(self, step: int) -> None:
        """A step no longer held leaves the save order (memory: the held steps only)."""
        order = self._held.order.pop(step, None)
        if order is not None and self._held.stepped.get(order) == step:
            del self._held.stepped[order]

    def kept_by(self, step: int) -> tuple[str, ...]:
        """The rules that keep `step` ("newest", then each rule's `reason` in `RULES`
        order); () if none (it goes at the next settle) or if the step is not held."""
        if step not in self._held.entries:
            return ()
        newest = ("newest",) if self._a_newest(step) else ()
        pairs = zip(self._rules.rules, self._trackers, strict=True)
        return newest + tuple(rule.reason for rule, tracker in pairs if tracker.keeps(step))

    def best_step(self, member: int | tuple[int, ...] | None = None) -> int | None:
        """Member `member`'s best step by the `BestN` rule (`BestSets.best_step`)."""
        for tracker in self._trackers:
            if isinstance(tracker, BestSets):
                return tracker.best_step(member)
        raise ValueError("best_step: no BestN rule ranks the steps (a bug of ours).")

    @property
    def steps(self) -> list[int]:
        """The held steps, ascending."""
        return list(self._held.entries)


def recorded_rules(meta: StepMeta | None) -> AnyOf | None:
    """The rules a step was saved with, as its meta records them (None: none recorded,
    no rule set, or a record that does not read)."""
    if meta is None or meta.retention is None:
        return None
    try:
        rules = AnyOf.from_json(meta.retention)
    except ValueError:
        return None
    return rules if rules.any else None


def entry_of(step: int, meta: StepMeta | None, rules: AnyOf) -> Entry:
    """What retention needs of a step on disk, under `rules`: when it was saved, the
    metric they rank by, which members asked for it, and the decisions recorded with it
    (its retention record: each rule reads its own, `Tracker.decide`)."""
    if meta is None:  # removed meanwhile, or damaged since listed
        return Entry(step, None, None)
    members = None if meta.members.all() else meta.members
    record = meta.retention if isinstance(meta.retention, dict) else {}
    values = meta.best_values(rules.metric)
    return Entry(step, meta.saved_seconds, values, members, record, meta.saved_ns)


def kept_by_each(metas: dict[int, StepMeta]) -> tuple[AnyOf | None, dict[int, tuple[str, ...]]]:
    """The rules the newest of `metas` was saved with (None: none), and which of them
    keep each step: what the writer's next settle would answer, for `jax-cb-ckpt ls`
    and `metrics_table` ({} when no rule is recorded)."""
    rules = recorded_rules(metas[max(metas)]) if metas else None
    if rules is None:
        return None, {}
    keeper = Keeper(rules, [entry_of(step, meta, rules) for step, meta in metas.items()])
    return rules, {step: keeper.kept_by(step) for step in metas}
