"""Unit tests of `_policy`: retention rules and the Keeper (no JAX, no disk).

Each rule alone, their union, the edge cases of "best" (NaN, a missing metric, inf, ties,
members), the rare paths (a remove, an add below the newest, a Keeper built from a
listing) and the rules' JSON record; then a randomized differential test against two plain
oracles (see `ScratchOracle` and `LiteralOracle`). How fast it runs is a benchmark's
business, not a test's.
"""

import json
import math
import random
import re
import types

import numpy as np
import pytest

from jax_cb_ckpt._layout._keep_best import BestN
from jax_cb_ckpt._layout._keep_latest import LatestN
from jax_cb_ckpt._layout._policy import AnyOf, Entry, Keeper

NAN, INF = float("nan"), float("inf")


def Rules(**keywords):
    """The rules as `Checkpointer(...)`'s keywords spell them (their short form)."""
    return AnyOf.short(keywords)


def entry(step, value=None, seconds=None):
    return Entry(step, seconds, None if value is None else np.asarray(value, dtype=float))


def commit(keeper, *entries):
    """Add each entry and settle after it, as the writer does; every step let go."""
    gone = []
    for one in entries:
        keeper.add(one)
        gone += keeper.settle()
    return gone


# Each rule alone -------------------------------------------------------------------------


def test_latest_keeps_the_newest_n_and_lets_one_go_per_commit():
    keeper = Keeper(Rules(max_to_keep=3))
    per_commit = [(keeper.add(entry(step)), keeper.settle())[1] for step in range(0, 70, 10)]
    assert per_commit == [[], [], [], [0], [10], [20], [30]]
    assert keeper.steps == [40, 50, 60]


def test_every_keeps_multiples_forever_and_the_newest():
    keeper = Keeper(Rules(keep_every=5))
    assert commit(keeper, *map(entry, range(13))) == [1, 2, 3, 4, 6, 7, 8, 9, 11]
    assert keeper.steps == [0, 5, 10, 12]
    assert keeper.kept_by(12) == ("newest",)
    assert keeper.kept_by(10) == ("every",)


def test_seconds_keeps_one_step_per_interval_and_never_one_without_a_time():
    times = [None, 100.0, 100.5, 101.0, 101.7, 102.0, None, 103.1, 103.2]
    keeper = Keeper(Rules(keep_every_seconds=1.0))
    gone = commit(keeper, *(entry(step, seconds=t) for step, t in enumerate(times)))
    # 1 is the first with a time; 3 is 1.0 s after it; 5 is 1.0 s after 3; 7 is 1.1 s
    # after 5. 4 (101.7) is measured from 3 (101.0), not from 2, which was not kept.
    assert keeper.steps == [1, 3, 5, 7, 8]
    assert gone == [0, 2, 4, 6]
    assert keeper.kept_by(8) == ("newest",)


def test_best_keeps_the_n_highest_under_max_and_the_n_lowest_under_min():
    values = [3.0, 9.0, 1.0, 7.0, 5.0, 8.0, 0.0]
    high = Keeper(Rules(keep_best=2, best="return"))
    commit(high, *(entry(step, v) for step, v in enumerate(values)))
    assert high.steps == [1, 5, 6]  # 9 and 8, and the newest
    assert high.best_step() == 1
    low = Keeper(Rules(keep_best=2, best="loss", mode="min"))
    commit(low, *(entry(step, v) for step, v in enumerate(values)))
    assert low.steps == [2, 6]  # 1 and 0 (the newest, also best)
    assert low.kept_by(6) == ("newest", "best")
    assert low.best_step() == 6


def test_nan_and_a_missing_metric_never_count_as_best():
    keeper = Keeper(Rules(keep_best=1, best="r"))
    commit(keeper, entry(0, NAN), entry(1), entry(2, NAN), entry(3, -5.0), entry(4, NAN))
    assert keeper.steps == [3, 4]
    assert keeper.kept_by(3) == ("best",)
    assert keeper.best_step() == 3
    only_nan = Keeper(Rules(keep_best=1, best="r"), [entry(0, NAN), entry(1)])
    assert only_nan.settle() == [0]
    assert only_nan.best_step() is None


def test_inf_is_a_value_and_the_best_under_max():
    keeper = Keeper(Rules(keep_best=1, best="r"))
    commit(keeper, entry(0, 1e300), entry(1, INF), entry(2, 5.0), entry(3, INF))
    assert keeper.steps == [1, 3]  # the later inf is only a tie: 1 keeps its place
    assert keeper.kept_by(1) == ("best",)
    low = Keeper(Rules(keep_best=1, best="r", mode="min"))
    commit(low, entry(0, 1.0), entry(1, -INF), entry(2, INF), entry(3, 2.0))
    assert low.steps == [1, 3]
    assert low.best_step() == 1


def test_a_tie_keeps_the_older_step():
    keeper = Keeper(Rules(keep_best=2, best="r"))
    assert commit(keeper, *(entry(step, 4.0) for step in range(5))) == [2, 3]
    assert keeper.steps == [0, 1, 4]
    assert keeper.kept_by(4) == ("newest",)
    commit(keeper, entry(5, 4.5))  # strictly better: enters, the newer of the tie leaves
    assert keeper.steps == [0, 5]
    # Built from a listing (any order), the older step wins the tie just the same.
    rebuilt = Keeper(Rules(keep_best=1, best="r"), [entry(9, 2.0), entry(3, 2.0), entry(6, 2.0)])
    assert rebuilt.settle() == [6]
    assert rebuilt.best_step() == 3


def test_a_member_s_value_at_a_step_it_did_not_ask_for_never_counts():
    """A finished member of a vmapped while_loop holds its last state at later steps
    without asking for them: its value there (here 9, its best) is no state of its own
    at that step (restore(member=0, step=3) refuses it), so it neither enters member 0's
    best set nor makes step 3 member 0's best step."""
    asked = np.asarray([False, True])
    keeper = Keeper(Rules(keep_best=1, best="r"))
    keeper.add(Entry(1, 1.0, np.asarray([5.0, 1.0])))
    keeper.add(Entry(2, 2.0, np.asarray([2.0, 2.0])))
    keeper.add(Entry(3, 3.0, np.asarray([9.0, 0.0]), asked))
    assert keeper.best_step(0) == 1 and keeper.best_step(1) == 2
    assert keeper.best_step() == 1  # 9 at step 3 is member 0's value where it did not ask
    assert keeper.kept_by(1) == ("best",) and keeper.kept_by(3) == ("newest",)
    rebuilt = Keeper(
        Rules(keep_best=1, best="r"),
        [
            Entry(1, 1.0, np.asarray([5.0, 1.0])),
            Entry(2, 2.0, np.asarray([2.0, 2.0])),
            Entry(3, 3.0, np.asarray([9.0, 0.0]), asked),
        ],
    )
    assert rebuilt.best_step(0) == 1 and rebuilt.kept_by(1) == ("best",)


# Union, newest, kept_by ---------------------------------------------------------------------


def test_rules_combine_as_a_union_and_kept_by_names_each():
    rules = Rules(max_to_keep=2, keep_every=4, keep_every_seconds=10.0, keep_best=1, best="r")
    keeper = Keeper(rules)
    values = [0.0, 6.0, 1.0, 2.0, 3.0, 1.0, 0.0, 0.0, 2.0, 1.0]
    commit(keeper, *(entry(step, v, 5.0 * step) for step, v in enumerate(values)))
    assert keeper.steps == [0, 1, 2, 4, 6, 8, 9]
    assert keeper.kept_by(0) == ("every", "seconds")
    assert keeper.kept_by(1) == ("best",)
    assert keeper.kept_by(2) == ("seconds",)
    assert keeper.kept_by(4) == ("every", "seconds")
    assert keeper.kept_by(8) == ("latest", "every", "seconds")
    assert keeper.kept_by(9) == ("newest", "latest")
    assert keeper.kept_by(3) == ()  # not held
    assert keeper.kept_by(12345) == ()


def test_the_newest_is_always_kept_even_when_no_rule_keeps_it():
    keeper = Keeper(Rules(keep_every=100))
    commit(keeper, entry(0), entry(7))
    assert keeper.steps == [0, 7]
    assert keeper.kept_by(7) == ("newest",)
    assert commit(keeper, entry(8)) == [7]
    bad = Keeper(Rules(keep_best=1, best="r"))
    assert commit(bad, entry(0, 5.0), entry(1, NAN)) == []
    assert bad.kept_by(1) == ("newest",)


def test_a_keeper_needs_a_rule():
    with pytest.raises(ValueError, match=r"no rule is set.*only when rules.any"):
        Keeper(Rules())


# Members of a vmapped run --------------------------------------------------------------------


def test_each_member_keeps_its_own_best_and_best_step_picks_a_member():
    rows = [[1, 5, 0, 2], [4, 1, 0, 2], [2, 2, 0, 9], [0, 3, NAN, 1], [3, 0, 0, 0]]
    keeper = Keeper(Rules(keep_best=1, best="r"))
    commit(keeper, *(entry(step, row) for step, row in enumerate(rows)))
    # member 0: step 1 (4); member 1: step 0 (5); member 2: all 0, the oldest (0);
    # member 3: step 2 (9). Step 3 is best for no member and not the newest.
    assert keeper.steps == [0, 1, 2, 4]
    assert [keeper.best_step(member) for member in range(4)] == [1, 0, 0, 2]
    assert keeper.best_step(np.int64(3)) == 2
    assert keeper.best_step() == 2  # 9 is the best value of any member


def test_a_tuple_member_indexes_the_batch_shape():
    grid = np.arange(6.0).reshape(2, 3)
    keeper = Keeper(Rules(keep_best=1, best="r"))
    commit(keeper, entry(0, grid), entry(1, -grid), entry(2, grid[::-1] + 10))
    for (i, j), flat in [((0, 0), 0), ((1, 2), 5), ((0, 1), 1)]:
        assert keeper.best_step((i, j)) == keeper.best_step(flat) == 2
    commit(keeper, entry(3, np.where(np.arange(6).reshape(2, 3) == 4, 99.0, -1.0)))
    assert keeper.best_step((1, 1)) == keeper.best_step(4) == keeper.best_step() == 3
    assert keeper.best_step((1, 2)) == 2


@pytest.mark.parametrize(
    "member, shown",
    [(4, "range(4)"), (-1, "range(4)"), ((0, 1), "a tuple of 1"), (True, "range(4)")],
)
def test_a_bad_member_names_the_batch_shape_and_the_valid_range(member, shown):
    keeper = Keeper(Rules(keep_best=1, best="r"), [entry(0, [1.0, 2.0, 3.0, 4.0])])
    with pytest.raises(ValueError, match=r"batch shape \(4,\).*" + re.escape(shown)):
        keeper.best_step(member)


def test_a_bad_tuple_member_and_a_member_of_a_plain_save_are_refused():
    keeper = Keeper(Rules(keep_best=1, best="r"), [entry(0, np.zeros((2, 3)))])
    for member in [(2, 0), (0, 3), (0,), 6, (0, 1.0)]:
        with pytest.raises(ValueError, match=r"batch shape \(2, 3\).*range\(6\).*of 2"):
            keeper.best_step(member)
    plain = Keeper(Rules(keep_best=1, best="r"), [entry(0, 1.0)])
    with pytest.raises(ValueError, match=r"plain save's metric \(shape \(\)\).*without member"):
        plain.best_step(0)
    assert plain.best_step() == 0


def test_values_of_different_shapes_count_only_where_the_member_exists():
    keeper = Keeper(Rules(keep_best=1, best="r"))
    commit(keeper, entry(0, [1.0, 1.0, 7.0]), entry(1, 5.0), entry(2, [0.0, 2.0]))
    # member 0: step 1 (5; its plain value is member 0); member 1: step 2; member 2:
    # step 0, which only it has.
    assert keeper.steps == [0, 1, 2]
    assert keeper.best_step(0) == 1 and keeper.best_step(1) == 2  # shape (2,): newest's
    with pytest.raises(ValueError, match=r"batch shape \(2,\)"):
        keeper.best_step(2)
    assert keeper.best_step() == 0


# Rare paths: a Keeper from a listing, remove, an add below the newest ------------------------


def test_every_step_of_a_listing_is_examined_at_the_first_settle():
    listed = [entry(step) for step in random.Random(0).sample(range(10), 10)]
    keeper = Keeper(Rules(max_to_keep=2), listed)
    assert keeper.steps == list(range(10))
    assert keeper.settle() == list(range(8))
    assert keeper.steps == [8, 9] and keeper.settle() == []


def test_changed_rules_apply_to_a_listing_at_once():
    listed = [entry(step, float(step % 5), 10.0 * step) for step in range(20)]
    keeper = Keeper(Rules(keep_every=10, keep_best=1, best="r", mode="min"), listed)
    assert keeper.settle() == [s for s in range(20) if s not in (0, 10, 19)]


def test_removing_a_best_step_refills_the_best_set_from_the_rest():
    keeper = Keeper(Rules(keep_best=2, best="r", keep_every=2))
    commit(keeper, entry(0, 5.0), entry(1, 3.0), entry(2, 7.0), entry(3, 9.0), entry(4, 0.0))
    assert keeper.steps == [0, 2, 3, 4]  # 1 left when 3 pushed it out; 0 stays by "every"
    assert keeper.kept_by(0) == ("every",)
    keeper.remove(3)  # someone else deleted it
    assert keeper.kept_by(0) == ("every", "best")  # the next best still held comes back
    assert keeper.kept_by(2) == ("every", "best")
    assert keeper.best_step() == 2
    keeper.remove(0)
    assert keeper.kept_by(4) == ("newest", "every", "best")  # 1 is gone for good
    assert keeper.settle() == []


def test_removing_an_unknown_step_does_nothing_and_removing_the_newest_promotes_the_next():
    keeper = Keeper(Rules(max_to_keep=2))
    commit(keeper, *map(entry, range(5)))
    keeper.remove(99)
    keeper.remove(2)  # already let go
    assert keeper.steps == [3, 4] and keeper.settle() == []
    keeper.remove(4)
    assert keeper.kept_by(3) == ("newest", "latest")
    commit(keeper, entry(5), entry(6))
    assert keeper.steps == [5, 6]


def test_removing_a_seconds_step_recomputes_the_chain():
    keeper = Keeper(Rules(keep_every_seconds=1.0))
    for step, seconds in enumerate([0.0, 1.0, 1.5, 2.0, 10.0]):  # no settle in between
        keeper.add(entry(step, seconds=seconds))
    kept = [keeper.kept_by(step) for step in range(4)]
    assert kept == [("seconds",), ("seconds",), (), ("seconds",)]
    keeper.remove(1)
    # Now 2 (1.5) is 1.5 s after 0 and joins the chain, and 3 (2.0) is only 0.5 s after 2.
    assert keeper.kept_by(2) == ("seconds",)
    assert keeper.settle() == [3]
    assert keeper.steps == [0, 2, 4]


def test_an_add_below_the_newest_is_placed_and_the_seconds_chain_recomputed():
    keeper = Keeper(Rules(keep_every_seconds=10.0))
    commit(keeper, entry(10, seconds=0.0), entry(30, seconds=10.0), entry(40, seconds=12.0))
    assert keeper.steps == [10, 30, 40]
    # Step 5 saved last (a restarted counter) is judged by its time, after 40's: 1 s
    # after 30 it is not kept; and what the chain kept stays kept.
    assert commit(keeper, entry(5, seconds=13.0)) == [5]
    assert keeper.kept_by(10) == ("seconds",) and keeper.kept_by(30) == ("seconds",)
    # One saved out of time order (a clock set back) never revokes the chain either.
    commit(keeper, entry(7, seconds=-1.0))
    assert keeper.kept_by(10) == ("seconds",) and keeper.kept_by(7) == ("seconds",)
    assert keeper.steps == [7, 10, 30, 40]
    latest = Keeper(Rules(max_to_keep=2))
    commit(latest, entry(10), entry(20), entry(30))
    assert commit(latest, entry(15)) == [15]
    assert latest.kept_by(30) == ("newest", "latest") and latest.steps == [20, 30]


def test_adding_a_held_step_again_replaces_its_entry():
    keeper = Keeper(Rules(keep_best=1, best="r"))
    commit(keeper, entry(0, 9.0), entry(1, 1.0), entry(2, 2.0))
    assert keeper.best_step() == 0
    keeper.add(entry(0, 0.0))
    assert keeper.settle() == [0] and keeper.best_step() == 2


# Rules and their JSON record ------------------------------------------------------------------


@pytest.mark.parametrize(
    "rules",
    [
        Rules(),
        Rules(max_to_keep=3),
        Rules(keep_every=1000, keep_every_seconds=3600.0),
        Rules(keep_every_seconds=60),
        Rules(max_to_keep=1, keep_best=2, best="return", mode="min"),
        Rules(keep_best=1, best="é" * 200),
    ],
)
def test_a_record_round_trips_through_json(rules):
    assert AnyOf.from_json(json.loads(json.dumps(rules.to_json()))) == rules


def test_to_json_writes_only_the_set_fields_and_describe_says_them():
    rules = Rules(max_to_keep=3, keep_every=100, keep_best=2, best="return")
    expected = {"max_to_keep": 3, "keep_every": 100, "keep_best": 2, "best": "return"}
    assert rules.to_json() == {**expected, "mode": "max"}
    assert rules.describe() == "max_to_keep=3, keep_every=100, keep_best=2 by 'return' (max)"
    assert Rules(keep_every_seconds=60.0).describe() == "keep_every_seconds=60.0"
    assert Rules().to_json() == {} and Rules().describe() == "keep all"
    assert Rules(mode="min").to_json() == {}
    assert not Rules().any and Rules(keep_every_seconds=1.0).any


def test_a_record_with_unknown_keys_is_read_and_missing_keys_are_defaults():
    record = {"max_to_keep": 3, "keep_newest_of_each_day": 1, "best_of": [1, 2]}
    assert AnyOf.from_json(record) == Rules(max_to_keep=3)
    assert AnyOf.from_json({"keep_best": 1, "best": "r"}).find(BestN).mode == "max"


@pytest.mark.parametrize(
    "record, message",
    [
        (
            {"max_to_keep": True},
            r"\(max_to_keep=\.\.\.\): max_to_keep must be a positive int.*True of type bool",
        ),
        ({"keep_every": -5}, r"\(keep_every=\.\.\.\): keep_every must be .*got -5 of type int"),
        ({"max_to_keep": 0}, r"\(max_to_keep=\.\.\.\): .*got 0 of type int"),
        ({"max_to_keep": 2.0}, r"\(max_to_keep=\.\.\.\): .*got 2.0 of type float"),
        ({"keep_best": 1, "best": "r", "max_to_keep": "3"}, r"\(max_to_keep=.*got '3' of type str"),
        ({"keep_every_seconds": NAN}, r"\(keep_every_seconds=\.\.\.\): .*positive number.*got nan"),
        ({"keep_every_seconds": INF}, r"\(keep_every_seconds=\.\.\.\): .*got inf"),
        ({"keep_every_seconds": -1.0}, r"\(keep_every_seconds=\.\.\.\): .*got -1.0"),
        ({"keep_every_seconds": False}, r"\(keep_every_seconds=\.\.\.\): .*got False"),
        ({"keep_every_seconds": "60"}, r"\(keep_every_seconds=\.\.\.\): .*got '60'"),
        ({"keep_best": 2, "best": "r", "mode": "median"}, r"\(mode='median'\): mode must be one"),
        ({"keep_best": 2, "best": "r", "mode": ["max"]}, r"\(mode=\['max'\]\): mode must be"),
        ({"keep_best": 2}, r"\(keep_best=2, best=None\): keep_best and best go together"),
        ({"best": "r"}, r"\(keep_best=None, best='r'\): keep_best and best go together"),
        ({"keep_best": 2, "best": "x" * 201}, r"\(best='xxx.*\): best must name a metric"),
        ({"keep_best": 2, "best": ""}, r"\(best=''\): best must name a metric"),
        ({"keep_best": 2, "best": 7}, r"\(best=7\): best must name a metric"),
        ({"max_to_keep": None}, r": max_to_keep is null"),
        ([3], r": \[3\] is a list, not a JSON object"),
        ("max_to_keep=3", r": 'max_to_keep=3' is a str, not a JSON object"),
    ],
)
def test_a_bad_record_is_refused_naming_the_field_and_value(record, message):
    with pytest.raises(ValueError, match=r"^retention record" + message):
        AnyOf.from_json(record)


def test_bad_rules_are_refused_when_made():
    with pytest.raises(ValueError, match=r"^Checkpointer\(keep_best=3, best=None\): keep_best and"):
        Rules(keep_best=3)
    with pytest.raises(ValueError, match=r"^Checkpointer\(keep_every=\.\.\.\): .*got 0 of type"):
        Rules(keep_every=0)
    with pytest.raises(ValueError, match=r"^LatestN\(n=\.\.\.\): n must be a positive int \("):
        LatestN(0)
    with pytest.raises(ValueError, match=r"^BestN\(metric=''\): metric must name a metric"):
        BestN("", 2)
    with pytest.raises(ValueError, match=r"^AnyOf\(rules\): LatestN is given 2 times"):
        AnyOf((LatestN(2), LatestN(3)))


# A randomized differential test against two oracles -------------------------------------------


def _key(rules, value, order):
    """Better compares higher; a tie goes to the step saved first (`order`: the save's
    place in the order of saves; after a restart, the listing's by save time)."""
    return (value if rules.mode == "max" else -value, -order)


def _counted(entry_, member):
    """The value `entry_` has for `member`, or None when it does not count."""
    flat = [] if entry_.values is None else np.asarray(entry_.values).ravel().tolist()
    if member < len(flat) and not math.isnan(flat[member]):
        return flat[member]
    return None


def _members(held):
    return max((np.size(e.values) for e in held.values() if e.values is not None), default=0)


def _chain(rules, held):
    """The seconds chain walked from the first held step saved (by save time)."""
    chain, last = set(), None
    if rules.keep_every_seconds is None:
        return chain
    timed = sorted((e.seconds, step) for step, e in held.items() if e.seconds is not None)
    for seconds, step in timed:
        if last is None or seconds >= last + rules.keep_every_seconds:
            chain.add(step)
            last = seconds
    return chain


def _ranked(rules, held, order, member, leave_out=()):
    """The held steps whose value counts for `member`, best first."""
    steps = [s for s in held if s not in leave_out and _counted(held[s], member) is not None]
    return sorted(
        steps, key=lambda s: _key(rules, _counted(held[s], member), order[s]), reverse=True
    )


def _best_sets(rules, held, order):
    if rules.keep_best is None:
        return []
    return [set(_ranked(rules, held, order, j)[: rules.keep_best]) for j in range(_members(held))]


class ScratchOracle:
    """Every rule recomputed from scratch over the steps held now, in the plainest way.

    Why this is the module's incremental definition and not a different one: the
    incremental rules could differ from a recomputation only through steps that are
    gone, and a step goes (settle) only when no rule keeps it: it was then in no
    member's best set and not in the seconds chain. A step outside the chain never
    decides another step's place in it (each chain step is measured from the previous
    chain step), and a step outside a best set is worse than every step in it, so
    neither would change the answer had it stayed. A step pushed out of a best set but
    still held (kept by another rule) is part of `held` here, as it is one of the rest
    the keeper refills a best set from. `LiteralOracle` follows the incremental wording
    word for word; the test checks that both agree with each other and with the Keeper.
    """

    def __init__(self, rules):
        self.rules, self.held = rules, {}
        self.order, self.next = {}, 0  # each held step's place in the order of saves

    def add(self, entry_):
        self.held[entry_.step] = entry_
        self.order[entry_.step] = self.next
        self.next += 1

    def remove(self, step):
        self.held.pop(step, None)
        self.order.pop(step, None)

    def restart(self):
        """A Keeper built anew from a listing knows the order of saves by their times
        (unknown times first), then steps."""
        listed = sorted(
            self.held.values(),
            key=lambda e: (-math.inf if e.seconds is None else e.seconds, e.step),
        )
        self.order = {e.step: i for i, e in enumerate(listed)}
        self.next = len(listed)

    def chain(self):
        return _chain(self.rules, self.held)

    def best_sets(self):
        return _best_sets(self.rules, self.held, self.order)

    def kept_by(self):
        """{held step: the names of the rules that keep it}."""
        rules, ordered = self.rules, sorted(self.held)
        chain, best_sets = self.chain(), self.best_sets()
        latest = set(ordered[-rules.max_to_keep :] if rules.max_to_keep else ())
        kept = {}
        for step in ordered:
            reasons = []
            if step == ordered[-1]:
                reasons.append("newest")
            if step in latest:
                reasons.append("latest")
            if rules.keep_every is not None and step % rules.keep_every == 0:
                reasons.append("every")
            if step in chain:
                reasons.append("seconds")
            if any(step in best for best in best_sets):
                reasons.append("best")
            kept[step] = tuple(reasons)
        return kept

    def settle(self):
        gone = [step for step, reasons in self.kept_by().items() if not reasons]
        for step in gone:
            self.remove(step)
        return gone

    def best_step(self, member):
        members = range(_members(self.held)) if member is None else [member]
        ranked = [
            (_key(self.rules, _counted(self.held[s], j), self.order[s]), s)
            for j in members
            for s in _ranked(self.rules, self.held, self.order, j)
        ]
        return max(ranked)[1] if ranked else None


class LiteralOracle(ScratchOracle):
    """The incremental definition word for word, with O(N) scans instead of heaps: the
    chain decided at add time from its last step; a step enters a full best set only
    when strictly better than its worst, which leaves; a removed chain step recomputes
    the chain, a removed best step is replaced by the best of the rest held; an add below
    the newest or of a held step, and a Keeper built anew, recompute everything."""

    def __init__(self, rules):
        super().__init__(rules)
        self.restart()

    def restart(self):
        super().restart()
        self._chain = _chain(self.rules, self.held)
        self._best = _best_sets(self.rules, self.held, self.order)

    def recompute(self):
        """Everything anew from the held steps, in the order of saves kept so far."""
        self._chain = _chain(self.rules, self.held)
        self._best = _best_sets(self.rules, self.held, self.order)

    def chain(self):
        return self._chain

    def best_sets(self):
        return self._best

    def add(self, entry_):
        step, rules = entry_.step, self.rules
        if step in self.held or (self.held and step < max(self.held)):
            super().add(entry_)
            self.recompute()
            return
        last = max((self.held[s].seconds for s in self._chain), default=None)
        super().add(entry_)
        every = rules.keep_every_seconds
        if every is not None and entry_.seconds is not None:
            if last is None or entry_.seconds >= last + every:
                self._chain.add(step)
        if rules.keep_best is None:
            return
        self._best.extend(set() for _ in range(_members(self.held) - len(self._best)))
        for member, best in enumerate(self._best):
            value = _counted(entry_, member)
            if value is None:
                continue
            if len(best) < rules.keep_best:
                best.add(step)
                continue
            order = self.order

            def key(s, member=member, order=order):
                return _key(rules, _counted(self.held[s], member), order[s])

            worst = min(best, key=key)
            if key(step) > key(worst):
                best.remove(worst)
                best.add(step)

    def remove(self, step):
        if step not in self.held:
            return
        super().remove(step)
        if step in self._chain:
            self._chain = _chain(self.rules, self.held)
        for member, best in enumerate(self._best):
            if step in best:
                best.remove(step)
                best.update(_ranked(self.rules, self.held, self.order, member, leave_out=best)[:1])


def _random_rules(rng):
    while True:
        best = rng.choice([None, 1, 2, 3])
        rules = types.SimpleNamespace(
            max_to_keep=rng.choice([None, None, 1, 2, 4]),
            keep_every=rng.choice([None, None, 2, 3, 7]),
            keep_every_seconds=rng.choice([None, None, 0.5, 1, 2.5]),
            keep_best=best,
            best=None if best is None else "metric",
            mode=rng.choice(["max", "min"]),
        )
        if Rules(**vars(rules)).any:
            return rules  # (as the oracles read them: every keyword, None when unset)


def _random_entry(rng, step, shapes, clock):
    """Values drawn from a few numbers (ties), with NaN, inf and a missing metric; a
    time that now and then is unknown, else the clock (later than every earlier save:
    saves are timed as they are handed over, in the order they are committed)."""
    shape = rng.choice(shapes)
    values = None
    if rng.random() < 0.9:
        pool = [0.0, 1.0, 2.0, 3.0, NAN, NAN, INF, -INF] if rng.random() < 0.3 else [0, 1, 2, 3]
        values = np.asarray([rng.choice(pool) for _ in range(math.prod(shape))], float)
        values = values.reshape(shape)
    seconds = None if rng.random() < 0.1 else clock
    return Entry(step, seconds, values)


@pytest.mark.parametrize("seed", range(300))
def test_the_keeper_agrees_with_plain_oracles_on_random_sequences(seed):
    rng = random.Random(seed)
    rules = _random_rules(rng)
    shapes = rng.choice([[()], [(4,)], [(2, 3)], [(), (3,)], [(4,), (2, 3)]])
    keeper = Keeper(Rules(**vars(rules)))
    scratch, literal = ScratchOracle(rules), LiteralOracle(rules)
    clock, top = 0.0, -1
    for _ in range(rng.randint(10, 60)):
        what = rng.random()
        if what < 0.7 or not scratch.held:  # mostly above the newest, now and then below
            step = top + rng.randint(1, 3) if rng.random() < 0.85 else rng.randint(0, top + 1)
            top, clock = max(top, step), clock + rng.choice([0.25, 0.5, 1.0])
            new = _random_entry(rng, step, shapes, clock)
            for one in (keeper, scratch, literal):
                one.add(new)
        elif what < 0.85:  # someone else deletes a step (or one never held)
            step = rng.choice([*scratch.held, top + 5])
            for one in (keeper, scratch, literal):
                one.remove(step)
        elif what < 0.9:  # a new Keeper from the listing, in any order
            listed = list(scratch.held.values())
            rng.shuffle(listed)
            keeper = Keeper(Rules(**vars(rules)), listed)
            scratch.restart()
            literal.restart()
        if rng.random() < 0.7:
            assert keeper.settle() == scratch.settle() == literal.settle(), rules
        expected = scratch.kept_by()
        assert literal.kept_by() == expected, rules
        assert {step: keeper.kept_by(step) for step in keeper.steps} == expected, rules
        if rules.keep_best is None:  # (best_step ranks by the BestN rule)
            continue
        assert keeper.best_step() == scratch.best_step(None)
        newest_first = [scratch.held[step] for step in sorted(scratch.held, reverse=True)]
        shaped = [e.values for e in newest_first if e.values is not None]
        if shaped and np.ndim(shaped[0]):  # the batch shape: the newest step's
            shape = np.shape(shaped[0])
            member = rng.randrange(math.prod(shape))
            assert keeper.best_step(member) == scratch.best_step(member)
            assert keeper.best_step(np.unravel_index(member, shape)) == scratch.best_step(member)
