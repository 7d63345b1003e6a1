"""Retention: which checkpoint steps the writer thread keeps after each commit.

Rules combine as a union: a step stays while any rule keeps it, and the newest step
always stays (a run must be able to resume from it); so does, under vmap, the newest
step each member asked for (a member that stopped saving, a finished member of a
vmapped while_loop, resumes from there). With no rule set everything is
kept, and the writer builds no `Keeper` at all.

- "latest" (`max_to_keep`): the newest N steps held;
- "every" (`keep_every`): the steps divisible by it, forever;
- "seconds" (`keep_every_seconds`): walking the held steps in the order they were
  saved (by their save times; a counter restarted below the newest step does not
  reorder them), the first one with a save time, then each saved at least that long
  after the previous one kept so;
- "best" (`keep_best`, `best`, `mode`): for each member of a vmapped run (a plain save
  is one member), the N steps with the best value of the metric `best`. NaN, a
  missing metric and a member's value at a step it did not ask for never count; on a
  tie the older step keeps its place.

What a Keeper keeps is always what a pass from scratch over the steps it holds would
keep: a step it lets go was outside every best set and the seconds chain, so its absence
changes neither. So a Keeper built from a directory's listing carries on exactly as one
that saw every commit, and rules changed between runs apply from the first settle.

Cost: `add` and `settle` of a step above the others take O(members * log N) amortized,
however many steps are held: settle examines only the steps whose answer can have
changed since the last settle. A step removed by someone else, an add below the newest
and the construction cost O(N log N) once. (Measured by a benchmark, not by the tests.)

Example::

    keeper = Keeper(Rules(max_to_keep=3, keep_best=1, best="return"), listed_entries)
    keeper.add(Entry(step, time.time(), np.asarray(episode_return)))
    for gone in keeper.settle():
        delete(gone)
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
import math
import reprlib
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

if TYPE_CHECKING:
    from ._format import StepMeta

Mode = Literal["max", "min"]  # "max": a higher metric is better; "min": a lower one
Reason = Literal["newest", "latest", "every", "seconds", "best"]  # names in `kept_by`
_COUNTS = ("max_to_keep", "keep_every", "keep_best")
_FIELDS = ("max_to_keep", "keep_every", "keep_every_seconds", "keep_best", "best")
_NAME_MAX = 200  # characters of a metric's name


def _problem(rules: Rules) -> str | None:
    """What is wrong with `rules` (naming the field, the value and the fix), or None."""

    def shown(name: str) -> str:
        value = getattr(rules, name)
        return f"{name}={reprlib.repr(value)} ({type(value).__name__})"

    for name in _COUNTS:
        value = getattr(rules, name)
        if value is not None and (type(value) is not int or value <= 0):
            return (
                f"{shown(name)} is not a positive int. Fix: a positive int, or None to turn it off"
            )
    seconds = rules.keep_every_seconds
    if seconds is not None and (
        isinstance(seconds, bool)
        or not isinstance(seconds, (int, float))
        or not 0 < seconds < math.inf  # also NaN
    ):
        return f"{shown('keep_every_seconds')} is not a positive finite number of seconds"
    best = rules.best
    if best is not None and (type(best) is not str or not 0 < len(best) <= _NAME_MAX):
        return (
            f"best={reprlib.repr(best)} is not a metric's name (a str of 1 to "
            f"{_NAME_MAX} characters). Fix: the name of the metric to rank steps by"
        )
    if rules.mode not in ("max", "min"):
        return f"mode={reprlib.repr(rules.mode)} is not 'max' (higher is better) or 'min'"
    if best is None and rules.keep_best is not None:
        return f"keep_best={rules.keep_best} is set without best. Fix: name the metric"
    if best is not None and rules.keep_best is None:
        return f"best={best!r} is set without keep_best. Fix: set keep_best=N, or drop best"
    return None


@dataclasses.dataclass(frozen=True)
class Rules:
    """Which steps to keep (see the module's docstring); each rule is off when None."""

    max_to_keep: int | None = None
    keep_every: int | None = None
    keep_every_seconds: float | None = None
    keep_best: int | None = None
    best: str | None = None
    mode: Mode = "max"

    def __post_init__(self) -> None:
        problem = _problem(self)
        if problem is not None:
            raise ValueError(f"Rules: {problem}.")

    @property
    def any(self) -> bool:
        """Some rule is set (otherwise every step is kept, with no Keeper)."""
        return any(getattr(self, name) is not None for name in _FIELDS[:4])

    def to_json(self) -> dict[str, Any]:
        """The set fields (and `mode` when `best` is set), for a JSON file."""
        data = {name: getattr(self, name) for name in _FIELDS if getattr(self, name) is not None}
        return {**data, "mode": self.mode} if self.best is not None else data

    @classmethod
    def from_json(cls, data: object) -> Rules:
        """Rules from a record `to_json` wrote, read from a file nobody vouches for: a
        `ValueError` naming the field and value for anything `to_json` does not write
        (a null, a bool for an int, NaN seconds, ...). A missing key is its default and
        an unknown key is ignored (a newer version's rule)."""
        if not isinstance(data, dict):
            kind = type(data).__name__
            raise ValueError(
                f"retention record: {reprlib.repr(data)} is a {kind}, not a JSON object."
            )
        given = {name: data[name] for name in (*_FIELDS, "mode") if name in data}
        for name, value in given.items():
            if value is None:
                raise ValueError(f"retention record: {name} is null; to_json leaves it out.")
        try:
            return cls(**given)
        except ValueError as error:
            raise ValueError(f"retention record: {str(error).removeprefix('Rules: ')}") from None

    def describe(self) -> str:
        """One line for messages and logs, e.g. "max_to_keep=3, keep_best=2 by 'return'
        (max)"; "keep all" when no rule is set."""
        parts = [f"{name}={getattr(self, name)}" for name in _FIELDS[:3] if getattr(self, name)]
        if self.keep_best is not None:
            parts.append(f"keep_best={self.keep_best} by {self.best!r} ({self.mode})")
        return ", ".join(parts) or "keep all"


@dataclasses.dataclass(frozen=True)
class Entry:
    """A step as retention sees it: when it was saved (seconds since the epoch, None:
    unknown) and its `best` metric: shape () for a plain save, the batch shape under
    vmap (one value per member), None when the step has no such metric."""

    step: int
    seconds: float | None
    values: np.ndarray | None
    # Under vmap: which members asked for the save (bool, the batch shape); None for a
    # plain save, or one every member asked for.
    members: np.ndarray | None = None
    # The seconds chain's decision recorded when the step was saved (`would_chain`), so
    # that a restart keeps what the run kept even when the clock jumped meanwhile;
    # None: not recorded (an older version, or other rules).
    chained: bool | None = None
    # The save's order (`StepMeta.saved_ns`): ties of `seconds` (one millisecond) are
    # ordered by it; None: not recorded (an older version).
    saved_ns: int | None = None


def _flat(values: np.ndarray | None) -> list[Any]:
    """The members' values as Python numbers (exact comparisons, also for int64)."""
    return [] if values is None else np.asarray(values).ravel().tolist()


class Keeper:
    """The retention state of one directory, used by the writer thread only (no lock).

    Data structures, chosen so that a commit never scans every held step:
    `_entries` is a dict in ascending step order (new steps arrive at its end; a
    deletion is O(1)); "latest" is a deque of the newest `max_to_keep` steps; "seconds"
    a set (its last member's time is all an add needs); "best" one min-heap per member
    of its best set, worst on top, as (goodness, -order), `order` counting the saves (a
    step saved later ties below one saved earlier, whatever their numbers); `_unchecked`
    holds the only steps whose answer may have changed since the last settle (a new
    newest, a step pushed out of "latest" or a best set, everything after a rebuild),
    and settle examines only those.
    """

    def __init__(self, rules: Rules, entries: Iterable[Entry] = ()) -> None:
        if not rules.any:
            raise ValueError(
                "Keeper(rules): no rule is set, so every step is kept and no Keeper is "
                "needed. Fix: build one only when rules.any."
            )
        self._rules = rules
        self._entries: dict[int, Entry] = {entry.step: entry for entry in entries}
        # The order the steps were saved in: listed steps by their save times (then the
        # order recorded within one millisecond, then step), each one added later after
        # them: {step: order}.
        listed = sorted(
            self._entries.values(),
            key=lambda e: (
                -math.inf if e.seconds is None else e.seconds,
                -1 if e.saved_ns is None else e.saved_ns,
                e.step,
            ),
        )
        self._order = {entry.step: index for index, entry in enumerate(listed)}
        self._next = len(listed)
        self._rebuild()

    def _rebuild(self, *, keep_chain: bool = False) -> None:
        """Everything anew from the held steps, all of them unchecked: O(N log N).
        `keep_chain`: the steps the seconds chain holds stay in it (an add out of order
        never revokes what the chain kept)."""
        rules = self._rules
        kept = getattr(self, "_chain", set()) if keep_chain else set()
        self._entries = dict(sorted(self._entries.items()))
        steps = list(self._entries)
        self._unchecked = set(steps)
        keep = rules.max_to_keep
        self._latest = collections.deque(steps[-keep:] if keep is not None else ())
        self._chain: set[int] = set()
        self._chain_last: float | None = None
        # The newest step every member asked for (`_all_asked`), and each member's newest
        # step after it ({flat member index: step}, from steps some members did not ask
        # for), out of `_size` members: a member's newest is its entry, else the former.
        self._all_asked: int | None = None
        self._members_newest: dict[int, int] = {}
        self._size: int | None = None
        for step, entry in self._entries.items():
            self._offer_members(step, entry.members)
        self._heaps: list[list[tuple[Any, int]]] = []
        self._in_best: collections.Counter[int] = collections.Counter()
        self._stepped = {order: step for step, order in self._order.items()}
        if rules.keep_best is not None:  # in save order, as if each were just added
            for step in sorted(self._entries, key=self._order.__getitem__):
                self._offer_best(step, self._entries[step])
        # The chain in the order the steps were saved: a step saved later with a lower
        # number (a restarted counter) must not push out the steps it already kept.
        timed = sorted(
            (e.seconds, step) for step, e in self._entries.items() if e.seconds is not None
        )
        for seconds, step in timed:
            chained = True if step in kept else self._entries[step].chained
            self._offer_seconds(step, seconds, chained=chained)

    def _items(self, step: int, entry: Entry) -> Iterator[tuple[int, Any]]:
        """(member, (goodness, -order)) for each member whose value counts (not NaN,
        and the member asked for the step: a finished member of a vmapped while_loop
        has no state of its own there): on a tie, the step saved first ranks higher."""
        sign = 1 if self._rules.mode == "max" else -1
        order = self._order[step]
        asked = None if entry.members is None else np.asarray(entry.members, bool).ravel()
        for member, value in enumerate(_flat(entry.values)):
            if value == value and (asked is None or member >= asked.size or asked[member]):
                yield member, (sign * value, -order)

    def would_chain(self, seconds: float | None) -> bool:
        """Would a step saved at `seconds` (after every held step) join the seconds
        chain? The decision the writer records with the step (`Entry.chained`)."""
        every, last = self._rules.keep_every_seconds, self._chain_last
        if every is None or seconds is None:
            return False
        return last is None or seconds >= last + every

    def _offer_seconds(
        self, step: int, seconds: float | None, *, chained: bool | None = None
    ) -> None:
        """The seconds chain, for a step saved after every step in it (`chained`: the
        decision recorded when it was saved, which stands; None: decided here)."""
        if self._rules.keep_every_seconds is None or seconds is None:
            return
        if chained is None:
            chained = self.would_chain(seconds)
        if chained:
            self._chain.add(step)
            last = self._chain_last
            self._chain_last = seconds if last is None else max(last, seconds)

    def _offer_best(self, step: int, entry: Entry) -> None:
        """Each member's best set, for a step above every held step: O(members log N)."""
        keep = self._rules.keep_best
        assert keep is not None
        for member, item in self._items(step, entry):
            self._heaps.extend([] for _ in range(member + 1 - len(self._heaps)))
            heap = self._heaps[member]
            if len(heap) < keep:
                heapq.heappush(heap, item)
            elif item > heap[0]:  # strictly better than the worst: a tie stays out
                _, negated = heapq.heapreplace(heap, item)
                out = self._stepped[-negated]
                self._in_best[out] -= 1
                if not self._in_best[out]:
                    del self._in_best[out]
                    self._unchecked.add(out)
            else:
                continue
            self._in_best[step] += 1

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

    def _a_members_newest(self, step: int) -> bool:
        """`step` is the newest step some member asked for."""
        if step in self._members_newest.values():
            return True
        size = self._size
        return step == self._all_asked and (size is None or len(self._members_newest) < size)

    def _newest(self) -> int | None:
        return next(reversed(self._entries), None)

    def add(self, entry: Entry) -> None:
        """A step just committed. One above every held step costs O(members log N); one
        below the newest, or one already held (its entry is replaced), rebuilds: O(N)."""
        newest = self._newest()
        step = entry.step
        self._order[step] = self._next  # saved after every held step
        self._stepped[self._next] = step
        self._next += 1
        if step in self._entries or (newest is not None and step < newest):
            # A step saved anew replaces the old one, as if removed first; one below the
            # newest (a restarted counter) keeps what the chain kept.
            again = step in self._entries
            self._entries[step] = entry
            self._rebuild(keep_chain=not again)
            return
        self._entries[step] = entry
        if newest is not None:
            self._unchecked.add(newest)  # no longer the newest
        if self._rules.max_to_keep is not None:
            self._latest.append(step)
            if len(self._latest) > self._rules.max_to_keep:
                self._unchecked.add(self._latest.popleft())
        self._offer_seconds(step, entry.seconds, chained=entry.chained)
        self._offer_members(step, entry.members)
        if self._rules.keep_best is not None:
            self._offer_best(step, entry)

    def remove(self, step: int) -> None:
        """A step deleted by someone else (an unknown step: nothing). One that shapes a
        rule (a latest, seconds or best step) rebuilds: O(N log N)."""
        if step not in self._entries:
            return
        shapes = self.kept_by(step)
        del self._entries[step]
        self._forget_order(step)
        self._unchecked.discard(step)
        if {"newest", "latest", "seconds", "best"} & set(shapes):
            self._rebuild()

    def settle(self) -> list[int]:
        """The steps no rule keeps any more, ascending; forgotten here, for the caller to
        delete. Only the unchecked steps are examined (see the class docstring)."""
        held = (step for step in self._unchecked if step in self._entries)
        gone = sorted(step for step in held if not self.kept_by(step))
        self._unchecked.clear()
        for step in gone:  # in no rule's structure: a plain deletion
            del self._entries[step]
            self._forget_order(step)
        return gone

    def _forget_order(self, step: int) -> None:
        """A step no longer held leaves the save order (memory: the held steps only)."""
        order = self._order.pop(step, None)
        if order is not None and self._stepped.get(order) == step:
            del self._stepped[order]

    def kept_by(self, step: int) -> tuple[Reason, ...]:
        """The rules that keep `step`, in a fixed order; () if none (it goes at the next
        settle) or if the step is not held."""
        if step not in self._entries:
            return ()
        every = self._rules.keep_every
        reasons: list[Reason] = []
        if step == self._newest() or self._a_members_newest(step):
            reasons.append("newest")
        if self._latest and step >= self._latest[0]:
            reasons.append("latest")
        if every is not None and step % every == 0:
            reasons.append("every")
        if step in self._chain:
            reasons.append("seconds")
        if step in self._in_best:
            reasons.append("best")
        return tuple(reasons)

    def best_step(self, member: int | tuple[int, ...] | None = None) -> int | None:
        """Member `member`'s best step (a flat index, or a tuple index into the batch
        shape: that of the newest step holding the metric); with None, the step holding
        the best value of any member. None when no step has a value that counts."""
        with_values = (e.values for e in reversed(self._entries.values()) if e.values is not None)
        values = next(with_values, None)
        if values is None:
            return None
        index = None if member is None else _member_index(member, np.shape(values))
        if self._rules.keep_best is not None:  # each member's best is in its best set
            heaps = self._heaps if index is None else self._heaps[index : index + 1]
            items: Iterable[tuple[Any, int]] = (item for heap in heaps for item in heap)
        else:
            items = (
                item
                for step, entry in self._entries.items()
                for at, item in self._items(step, entry)
                if index is None or at == index
            )
        top = max(items, default=None)
        return None if top is None else self._stepped[-top[1]]

    @property
    def steps(self) -> list[int]:
        """The held steps, ascending."""
        return list(self._entries)


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


def recorded_rules(meta: StepMeta | None) -> Rules | None:
    """The rules a step was saved with, as its meta records them (None: none recorded,
    no rule set, or a record that does not read)."""
    if meta is None or meta.retention is None:
        return None
    try:
        rules = Rules.from_json(meta.retention)
    except ValueError:
        return None
    return rules if rules.any else None


def entry_of(step: int, meta: StepMeta | None, rules: Rules) -> Entry:
    """What retention needs of a step on disk, under `rules`: when it was saved, its
    `best` metric, which members asked for it, and the seconds chain's decision
    recorded with it (only when it was made under the same interval)."""
    if meta is None:  # removed meanwhile, or damaged since listed
        return Entry(step, None, None)
    members = None if meta.members.all() else meta.members
    recorded = meta.retention if isinstance(meta.retention, dict) else {}
    same = recorded.get("keep_every_seconds") == rules.keep_every_seconds
    chained = recorded_chain(recorded) if same else None
    return Entry(
        step,
        meta.saved_seconds,
        meta.best_values(rules.best),
        members,
        chained,
        meta.saved_ns,
    )


def recorded_chain(record: dict[str, Any]) -> bool | None:
    """The seconds chain's decision in a step's retention record (a JSON bool), or
    None (absent, or not a bool)."""
    value = record.get("seconds_chain")
    return value if isinstance(value, bool) else None


def kept_by_each(metas: dict[int, StepMeta]) -> tuple[Rules | None, dict[int, tuple[Reason, ...]]]:
    """The rules the newest of `metas` was saved with (None: none), and which of them
    keep each step: what the writer's next settle would answer, for `jax-cb-ckpt ls`
    and `metrics_table` ({} when no rule is recorded)."""
    rules = recorded_rules(metas[max(metas)]) if metas else None
    if rules is None:
        return None, {}
    keeper = Keeper(rules, [entry_of(step, meta, rules) for step, meta in metas.items()])
    return rules, {step: keeper.kept_by(step) for step in metas}
