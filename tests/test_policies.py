"""Metrics with a step, what is kept (keep_every, keep_every_seconds, keep_best, with
max_to_keep, as a union), saves by wall-clock (every_seconds) and the initial save:
each rule alone and combined, under vmap, across a restart, on a bucket, in the CLI,
and a kill during retention. The oracle of what is kept is written plainly here, from
the rules' definitions (docs/usage.md#what-is-kept), over the steps as they were saved."""

import json
import logging
import math
import os
import sys
import threading
import time
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from helpers import flip_stored, kill_group, run_child, start_script

import jax_cb_ckpt
from jax_cb_ckpt import ConfigError, InvalidStateError

SCRIPT_LS = Path(sys.executable).with_name("jax-cb-ckpt")


def _kept(saved, *, max_to_keep=None, keep_every=None, seconds=None, best=None, mode="max"):
    """What the rules keep of `saved`, [(step, saved_at seconds, values or None)] in
    the order they were saved (ascending steps), applied after each save as the writer
    does: a step dropped once is gone for good. `best`: keep_best N or None."""
    held: dict[int, tuple[float, np.ndarray | None]] = {}
    chain: list[float] = []  # the seconds-kept steps' times
    timed: set[int] = set()
    bests: dict[int, list[int]] = {}  # member -> its best steps
    for step, at, values in saved:
        held[step] = (at, values)
        if seconds is not None and (not chain or at >= chain[-1] + seconds):
            chain.append(at)
            timed.add(step)
        if best is not None and values is not None:
            flat = np.ravel(values)
            for member, value in enumerate(flat):
                if math.isnan(value):
                    continue
                ranked = bests.setdefault(member, [])
                ranked.append(step)
                # best first; ties: the older step first (it keeps its place)
                sign = -1 if mode == "max" else 1
                ranked.sort(key=lambda s: (sign * float(np.ravel(held[s][1])[member]), s))
                del ranked[best:]
        newest = sorted(held)[-(max_to_keep or 1) :]
        in_best = {s for ranked in bests.values() for s in ranked}
        for old in list(held):
            keep = old == max(held) or (max_to_keep is not None and old in newest)
            keep = keep or (keep_every is not None and old % keep_every == 0)
            keep = keep or old in timed or old in in_best
            if not keep:
                del held[old]
        for ranked in bests.values():
            ranked[:] = [s for s in ranked if s in held]
    return sorted(held)


def _kept_under(saved, rules):
    """`_kept` of a Checkpointer's keyword rules."""
    return _kept(
        saved,
        max_to_keep=rules.get("max_to_keep"),
        keep_every=rules.get("keep_every"),
        seconds=rules.get("keep_every_seconds"),
        best=rules.get("keep_best"),
        mode=rules.get("mode", "max"),
    )


def _best_of(saved, rules, member=0):
    """The step with the best value of `member` (ties: the older), by the rules' mode."""
    finite = [
        (np.ravel(v)[member], s)
        for s, _, v in saved
        if v is not None and not np.isnan(np.ravel(v)[member])
    ]
    want = max if rules.get("mode", "max") == "max" else min
    best_value = want(v for v, _ in finite)
    return min(s for v, s in finite if v == best_value)


def _saved_at(directory, step):
    from datetime import datetime

    return datetime.fromisoformat(
        jax_cb_ckpt.metadata(directory, step=step)["saved_at"]
    ).timestamp()


# -- metrics ------------------------------------------------------------------------------


def test_metrics_are_recorded_with_each_save_traced_or_not(make_ckpt, ckpt_dir):
    ckpt = make_ckpt(every=2)
    ckpt.save({"w": jnp.ones(3)}, 0, metrics={"return": 1.5, "loss": np.float32(np.nan)})

    @jax.jit
    def train(state):
        def body(state, i):
            state = jax.tree.map(lambda x: x + 1, state)
            metrics = {
                "eval": {"return": jnp.sum(state["w"])},
                "inf": -jnp.inf,
                "n": i,
                "ok": i > 1,
            }
            ckpt.maybe_save(state, i + 1, metrics=metrics)
            return state, None

        return jax.lax.scan(body, state, jnp.arange(4))[0]

    train({"w": jnp.ones(3)})
    ckpt.wait()
    assert ckpt.all_steps() == [0, 2, 4]
    zero = ckpt.metrics(0)
    assert zero["return"] == 1.5 and math.isnan(zero["loss"])
    assert ckpt.metrics(2) == {"eval/return": 9.0, "inf": -math.inf, "n": 1, "ok": False}
    assert jax_cb_ckpt.metrics(ckpt_dir, step=4) == {
        "eval/return": 15.0,
        "inf": -math.inf,
        "n": 3,
        "ok": True,
    }
    assert ckpt.metrics() == ckpt.metrics(4)  # the latest by default
    # stored as JSON in the step's meta item: plain Orbax reads them
    manager = ocp.CheckpointManager(ckpt_dir)
    meta = manager.restore(4, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
    assert meta["metrics"] == {"eval/return": 15.0, "inf": -math.inf, "n": 3, "ok": True}
    manager.close()
    # a step saved without metrics has none
    ckpt.save({"w": jnp.ones(3)}, 6)
    ckpt.wait()
    assert ckpt.metrics(6) == {}


def test_metrics_cross_with_the_state_in_the_same_crossing(make_ckpt, tmp_path):
    """No extra host transfer or callback: the same number of crossings with metrics as
    without, and the metrics' values are the device's."""
    counts = []
    for name, metrics in (("plain", None), ("with", lambda s: {"m": jnp.sum(s)})):
        ckpt = make_ckpt(tmp_path / name, every=5)

        def body(s, i, ckpt=ckpt, metrics=metrics):
            s = s * 1.01 + 1.0
            ckpt.maybe_save(s, i + 1, metrics=None if metrics is None else metrics(s))
            return s, None

        out = jax.jit(lambda s, body=body: jax.lax.scan(body, s, jnp.arange(20))[0])(jnp.ones(4))
        ckpt.wait()
        counts.append(ckpt.stats.crossings)
        if metrics is not None:
            for step in ckpt.all_steps():
                state = ckpt.restore(jnp.ones(4), step=step)
                assert ckpt.metrics(step)["m"] == float(jnp.sum(state))
            assert ckpt.metrics(20)["m"] == float(jnp.sum(out))
    assert counts[0] == counts[1] == 4


def test_metrics_under_vmap_have_one_value_per_member(make_ckpt):
    ckpt = make_ckpt()

    def one(state, seed):
        ret = jnp.sum(state) * seed
        ckpt.maybe_save(state, 3, when=seed > 1.0, metrics={"return": ret})
        return state

    jax.jit(jax.vmap(one))(jnp.ones((4, 2)), jnp.arange(4.0))
    ckpt.wait()
    got = ckpt.metrics(3)["return"]
    assert isinstance(got, np.ndarray) and got.shape == (4,)
    np.testing.assert_array_equal(got, [0.0, 2.0, 4.0, 6.0])
    assert ckpt.metadata(3)["members"] == [False, False, True, True]


@pytest.mark.parametrize(
    ("metrics", "text"),
    [
        ({"m": jnp.ones((2, 2))}, "metrics['m'] is float32[2,2]; a metric is one real number"),
        ({"m": "high"}, "metrics['m'] is a str"),
        ({"k": jax.random.key(0)}, "metrics['k'] is key<"),
        ({"c": 1j}, "metrics['c'] is Python complex"),
        ({f"m{i}": 1.0 for i in range(65)}, "65 metrics, more than the 64"),
        ({"m": None}, "holds no values"),
    ],
)
def test_a_metric_that_is_not_a_number_is_refused_by_name(make_ckpt, metrics, text):
    ckpt = make_ckpt()
    with pytest.raises(InvalidStateError, match=text.replace("[", r"\[").replace("]", r"\]")):
        ckpt.save(jnp.ones(2), 1, metrics=metrics)
    with pytest.raises(InvalidStateError):  # also where the save itself is not wanted
        ckpt.maybe_save(jnp.ones(2), 1, when=False, metrics=metrics)
    ckpt.wait()
    assert ckpt.all_steps() == []


def test_metrics_with_a_concatenating_gather_are_refused(make_ckpt):
    ckpt = make_ckpt()
    mapped = jax.pmap(
        lambda x: ckpt.save(x, 1, axis_name="d", gather="concat", metrics={"m": x[0]}) or x,
        axis_name="d",
    )
    with pytest.raises(ConfigError, match="gather='concat'.*scalar metric"):
        mapped(jnp.ones((2, 3)))


@pytest.mark.parametrize(
    ("kwargs", "text"),
    [
        ({"keep_best": 3}, "keep_best and best go together"),
        ({"best": "return"}, "keep_best and best go together"),
        ({"keep_best": 0, "best": "r"}, "keep_best must be a positive int"),
        ({"keep_best": 2, "best": ""}, "best must name a metric"),
        ({"keep_best": 2, "best": "r", "mode": "highest"}, "mode must be one of"),
        ({"keep_every": True}, "keep_every must be a positive int"),
        ({"keep_every_seconds": float("nan")}, "keep_every_seconds must be a positive"),
        ({"every_seconds": -1}, "every_seconds must be a positive"),
        ({"check_every": 0}, "check_every must be a positive int"),
        ({"initial_save": "yes"}, "initial_save must be True or False"),
        ({"check_every": 10}, "there is no every_seconds"),
    ],
)
def test_bad_policy_options_are_refused_by_name(ckpt_dir, kwargs, text):
    with pytest.raises(ConfigError, match=text):
        jax_cb_ckpt.Checkpointer(ckpt_dir, **kwargs)
    assert not ckpt_dir.exists()  # checked before anything is made


def test_run_and_scan_record_metrics_computed_at_their_saves(make_ckpt, tmp_path):
    def body(s, i):
        return s * 0.9 + i

    def metrics(s):
        return {"mean": jnp.mean(s), "first": s[0]}

    ckpt = make_ckpt(tmp_path / "run", every=4)
    final = ckpt.run(body, jnp.ones(3), 10, metrics=metrics)
    assert ckpt.all_steps() == [4, 8, 10]
    for step in ckpt.all_steps():
        state = ckpt.restore(jnp.ones(3), step=step)
        assert ckpt.metrics(step) == {k: float(v) for k, v in metrics(state).items()}
    assert ckpt.metrics(10)["first"] == float(final[0])
    # batched: written for one member, one value per member
    batched = make_ckpt(tmp_path / "batched", every=5)
    out = batched.run(body, jnp.ones((3, 2)), 5, batched=True, metrics=metrics)
    np.testing.assert_array_equal(batched.metrics(5)["mean"], jnp.mean(out, axis=1))
    # ckpt.scan
    scanned = make_ckpt(tmp_path / "scan", every=3)
    carry, _ = jax.jit(
        lambda c: scanned.scan(lambda c, x: (c + x, None), c, jnp.arange(7.0), metrics=metrics)
    )(jnp.zeros(2))
    scanned.wait()
    assert scanned.all_steps() == [3, 6]
    assert scanned.metrics(3)["mean"] == 3.0 and scanned.metrics(6)["mean"] == 15.0


# -- what is kept ---------------------------------------------------------------------


RETURNS = [3.0, 9.0, 1.0, 7.0, np.nan, 8.0, 5.0, 0.0, 4.0, 6.0, 9.0, 2.0, 1.0, 7.5, 3.0, 8.5]


def _save_all(ckpt, values, *, pause=0.0, metric=True):
    """Save steps 1.. with `values` as the metric "return" (None: no metrics); the
    oracle's input: (step, saved_at, values). Each save is waited for (retention ran)."""
    saved = []
    for step, value in enumerate(values, 1):
        given = None if value is None or not metric else {"return": value}
        ckpt.save({"w": jnp.full(3, float(step))}, step, metrics=given)
        ckpt.wait()
        at = _saved_at(ckpt.directory, step)  # (the newest is always kept)
        saved.append((step, at, None if given is None else np.asarray(value, np.float64)))
        time.sleep(pause)
    return saved


RULES = [
    {"keep_every": 4},
    {"max_to_keep": 3},
    {"keep_best": 3, "best": "return"},
    {"keep_best": 2, "best": "return", "mode": "min"},
    {"max_to_keep": 2, "keep_every": 5, "keep_best": 2, "best": "return"},
    {"max_to_keep": 1, "keep_every": 3},
]


@pytest.mark.parametrize("rules", RULES)
def test_each_rule_alone_and_combined_keeps_what_its_definition_keeps(make_ckpt, rules):
    ckpt = make_ckpt(**rules)
    values = [None if i == 6 else v for i, v in enumerate(RETURNS)]  # step 7: no metric
    saved = _save_all(ckpt, values)
    expected = _kept_under(saved, rules)
    assert ckpt.all_steps() == expected
    assert 16 in expected  # the newest always
    if set(rules) <= {"keep_best", "best", "mode"}:
        assert 7 not in expected  # no metric: never best
        assert 5 not in expected  # NaN: never best
    if "keep_best" in rules:
        assert ckpt.best_step() == _best_of(saved, rules)
        mode = rules.get("mode", "max")
        assert jax_cb_ckpt.best_step(ckpt.directory, best="return", mode=mode) == ckpt.best_step()
        assert ckpt.restore({"w": jnp.zeros(3)}, step=ckpt.best_step())["w"][0] == ckpt.best_step()


@pytest.mark.parametrize("rules", RULES)
def test_each_rule_under_vmap_keeps_what_its_definition_keeps(make_ckpt, rules):
    """The same rules on saves made under jit(vmap): two members, each with its own
    "return"; a step is kept while it is among any member's best."""
    ckpt = make_ckpt(**rules)

    def one(state, value, step):
        ckpt.save(state, step, metrics={"return": value})
        return state

    def bare(state, step):
        ckpt.save(state, step)
        return state

    with_metrics = jax.jit(jax.vmap(one, in_axes=(0, 0, None)))
    without = jax.jit(jax.vmap(bare, in_axes=(0, None)))
    saved = []
    for step, value in enumerate(RETURNS, 1):
        pair = np.asarray([value, RETURNS[-step]])  # member 1 ranks them the other way
        state = jnp.full((2, 3), float(step))
        if step == 7:  # no metric
            without(state, jnp.int32(step))
        else:
            with_metrics(state, jnp.asarray(pair, jnp.float32), jnp.int32(step))
        ckpt.wait()
        saved.append((step, 0.0, None if step == 7 else pair))
    expected = _kept_under(saved, rules)
    assert ckpt.all_steps() == expected
    if "keep_best" in rules:
        for member in (0, 1):
            assert ckpt.best_step(member=member) == _best_of(saved, rules, member)


def test_keep_every_seconds_keeps_one_step_per_interval(make_ckpt):
    ckpt = make_ckpt(keep_every_seconds=0.25)
    saved = _save_all(ckpt, [None] * 14, pause=0.06)
    expected = _kept(saved, seconds=0.25)
    assert ckpt.all_steps() == expected
    assert 3 <= len(expected) <= 10  # one per interval (+ the newest), from ~1 s of saves


@pytest.mark.parametrize("where", ["local", "gs"])
def test_keep_every_seconds_goes_on_across_a_restart(where, tmp_path, remote_on):
    """The chain of one step per interval continues from the steps on disk: their own
    saved_at, read back at the first commit of the next run."""
    directory = str(tmp_path / "ckpt") if where == "local" else remote_on(where).url
    rules = {"keep_every_seconds": 0.3, "max_to_keep": 1}
    saved = []
    for run in range(2):
        with jax_cb_ckpt.Checkpointer(directory, **rules) as ckpt:
            for step in range(1 + 8 * run, 9 + 8 * run):
                ckpt.save({"w": jnp.zeros(3)}, step)
                ckpt.wait()
                saved.append((step, _saved_at(directory, step), None))
                time.sleep(0.07)
    expected = _kept(saved, max_to_keep=1, seconds=0.3)
    assert jax_cb_ckpt.all_steps(directory) == expected
    assert len(expected) >= 3


def test_keep_best_under_vmap_keeps_any_members_best(make_ckpt):
    ckpt = make_ckpt(keep_best=1, best="return", mode="max")
    # member 0 is best at step 2, member 1 at step 4; member 2 is NaN throughout
    table = {
        1: [1.0, 1.0, np.nan],
        2: [5.0, 0.0, np.nan],
        3: [2.0, 1.0, np.nan],
        4: [0.0, 6.0, np.nan],
        5: [1.0, 2.0, np.nan],
    }

    def one(state, value, step):
        ckpt.save(state, step, metrics={"return": value})
        return state

    saved = []
    for step, row in table.items():
        jax.jit(jax.vmap(one, in_axes=(0, 0, None)), static_argnums=2)(
            jnp.ones((3, 2)), jnp.asarray(row), step
        )
        ckpt.wait()
        saved.append((step, 0.0, np.asarray(row)))
    assert ckpt.all_steps() == _kept(saved, best=1) == [2, 4, 5]
    assert ckpt.best_step(member=0) == 2
    assert ckpt.best_step(member=1) == 4
    assert ckpt.best_step(member=2) is None  # NaN never counts
    assert ckpt.best_step() == 4  # the best value of any member: 6.0
    with pytest.raises(ConfigError, match="member"):
        ckpt.best_step(member=3)


def test_rules_hold_across_a_restart_and_changed_rules_warn(ckpt_dir, caplog):
    rules = {"max_to_keep": 2, "keep_every": 4}
    with jax_cb_ckpt.Checkpointer(ckpt_dir, **rules) as ckpt:
        first = _save_all(ckpt, [None] * 6)
    assert jax_cb_ckpt.all_steps(ckpt_dir) == [4, 5, 6]
    with (
        jax_cb_ckpt.Checkpointer(ckpt_dir, **rules) as ckpt,
        caplog.at_level(logging.WARNING, "jax_cb_ckpt"),
    ):
        for step in (7, 8, 9):
            ckpt.save({"w": jnp.zeros(3)}, step)
            ckpt.wait()
    assert not [r for r in caplog.records if "rules changed" in r.getMessage()]
    saved = first + [(s, 0.0, None) for s in (7, 8, 9)]
    assert jax_cb_ckpt.all_steps(ckpt_dir) == _kept(saved, **rules) == [4, 8, 9]
    # other rules: they apply from the next commit, and the log names what they delete
    caplog.clear()
    with (
        jax_cb_ckpt.Checkpointer(ckpt_dir, max_to_keep=1) as ckpt,
        caplog.at_level(logging.WARNING, "jax_cb_ckpt"),
    ):
        assert jax_cb_ckpt.all_steps(ckpt_dir) == [4, 8, 9]  # opening deletes nothing
        ckpt.save({"w": jnp.zeros(3)}, 10)
        ckpt.wait()
    assert jax_cb_ckpt.all_steps(ckpt_dir) == [10]
    said = [r.getMessage() for r in caplog.records if "rules changed" in r.getMessage()]
    assert len(said) == 1
    assert "were: max_to_keep=2, keep_every=4; now: max_to_keep=1" in said[0]
    assert "deleting 3 step(s) the previous rules kept: 4, 8, 9" in said[0]
    # no rules: every step kept again, nothing deleted
    with jax_cb_ckpt.Checkpointer(ckpt_dir) as ckpt:
        ckpt.save({"w": jnp.zeros(3)}, 11)
    assert jax_cb_ckpt.all_steps(ckpt_dir) == [10, 11]


def test_rules_on_a_bucket(remote):
    rules = {"max_to_keep": 1, "keep_every": 3, "keep_best": 1, "best": "return"}
    ckpt = jax_cb_ckpt.Checkpointer(remote.url, **rules)
    with ckpt:
        saved = _save_all(ckpt, [2.0, 5.0, 1.0, 4.0, 0.0, 3.0, 1.0])
    expected = _kept(saved, max_to_keep=1, keep_every=3, best=1)
    assert jax_cb_ckpt.all_steps(remote.url) == expected == [2, 3, 6, 7]
    assert jax_cb_ckpt.best_step(remote.url) == 2  # by the rule the steps record
    assert jax_cb_ckpt.metrics(remote.url, step=2) == {"return": 5.0}
    table = jax_cb_ckpt.metrics_table(remote.url)
    assert [(r["step"], r["metrics"]["return"]) for r in table] == [
        (2, 5.0),
        (3, 1.0),
        (6, 3.0),
        (7, 1.0),
    ]
    assert [r["kept_by"] for r in table] == [["best"], ["every"], ["every"], ["newest", "latest"]]
    # across a restart on the bucket: the rules go on from what is there
    with jax_cb_ckpt.Checkpointer(remote.url, **rules) as ckpt:
        ckpt.save({"w": jnp.zeros(3)}, 8, metrics={"return": 9.0})
    assert jax_cb_ckpt.all_steps(remote.url) == [3, 6, 8]


def test_ls_shows_metrics_and_which_rule_keeps_each_step(make_ckpt, ckpt_dir):
    ckpt = make_ckpt(max_to_keep=1, keep_every=2, keep_best=1, best="return")
    _save_all(ckpt, [1.0, 3.0, np.nan, 0.5, -np.inf])
    ckpt.close()
    table = run_child(["python", "-m", "jax_cb_ckpt", "ls", ckpt_dir])
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    assert "retention: max_to_keep=1, keep_every=2, keep_best=1 by 'return' (max)" in lines[0]
    assert lines[1].split()[-5:] == ["size", "return", "kept", "by", "state"]
    rows = {int(line.split()[0]): line for line in lines[2:]}
    assert sorted(rows) == [2, 4, 5]
    assert rows[2].split()[-4:] == ["3", "every,", "best", "complete"]
    assert rows[4].split()[-3:] == ["0.5", "every", "complete"]
    assert rows[5].split()[-4:] == ["-inf", "newest,", "latest", "complete"]
    printed = run_child(["python", "-m", "jax_cb_ckpt", "ls", "--json", ckpt_dir])
    data = json.loads(printed.stdout)  # strict JSON: no NaN tokens
    assert data["retention"] == {
        "max_to_keep": 1,
        "keep_every": 2,
        "keep_best": 1,
        "best": "return",
        "mode": "max",
    }
    by_step = {row["step"]: row for row in data["steps"]}
    assert by_step[5]["metrics"] == {"return": "-inf"} and by_step[5]["kept_by"] == [
        "newest",
        "latest",
    ]
    assert by_step[2]["kept_by"] == ["every", "best"] and by_step[2]["metrics"] == {"return": 3.0}
    shown = run_child(["python", "-m", "jax_cb_ckpt", "show", "--step", "4", ckpt_dir])
    assert "metrics       return=0.5" in shown.stdout
    assert "retention     max_to_keep=1, keep_every=2" in shown.stdout


def _ls(*args, capsys):
    """`jax-cb-ckpt ls ARGS` in this process: (exit code, stdout, stderr)."""
    from jax_cb_ckpt._cli import _main

    code = _main.main(["ls", *map(str, args)])
    out, err = capsys.readouterr()
    return code, out, err


def test_metrics_table_gives_every_step_s_metrics_and_what_keeps_it(make_ckpt, ckpt_dir):
    """Issue 44 item 6: per-step metrics came only from `ls --json` or a loop over
    metrics(step=). One call returns the table; `kept_by` is what `ls` shows."""
    ckpt = make_ckpt(max_to_keep=2, keep_best=2, best="return")
    _save_all(ckpt, [5.0, 1.0, 5.0, np.nan, 2.0, None])
    rows = jax_cb_ckpt.metrics_table(ckpt_dir)
    assert [(r["step"], r["member"], r["kept_by"]) for r in rows] == [
        (1, None, ["best"]),
        (3, None, ["best"]),
        (5, None, ["latest"]),
        (6, None, ["newest", "latest"]),
    ]
    assert [r["metrics"] for r in rows] == [{"return": 5.0}, {"return": 5.0}, {"return": 2.0}, {}]
    assert all(isinstance(r["metrics"].get("return", 0.0), float) for r in rows)
    assert [r["saved_at"] for r in rows] == [
        jax_cb_ckpt.metadata(ckpt_dir, step=r["step"])["saved_at"] for r in rows
    ]
    assert ckpt.metrics_table() == rows
    ckpt.close()
    listed = json.loads(run_child(["python", "-m", "jax_cb_ckpt", "ls", "--json", ckpt_dir]).stdout)
    assert [row["kept_by"] for row in listed["steps"]] == [r["kept_by"] for r in rows]
    # no rule recorded: kept_by is [] for every step; an empty directory: no rows
    plain = ckpt_dir.parent / "plain"
    with jax_cb_ckpt.Checkpointer(plain) as other:
        other.save({"w": jnp.zeros(2)}, 7, metrics={"loss": 3})
    assert jax_cb_ckpt.metrics_table(plain) == [
        {
            "step": 7,
            "member": None,
            "saved_at": jax_cb_ckpt.metadata(plain, step=7)["saved_at"],
            "kept_by": [],
            "metrics": {"loss": 3},
        }
    ]
    (ckpt_dir.parent / "empty").mkdir()
    assert jax_cb_ckpt.metrics_table(ckpt_dir.parent / "empty") == []


def test_metrics_table_under_vmap_has_a_row_per_member(make_ckpt):
    """One row per member: its flat index (as best_step(member=) takes it), its index
    in the batch, whether it asked for the save, its value."""
    ckpt = make_ckpt(keep_best=1, best="r", mode="max")

    def save(x, asked, step):
        ckpt.maybe_save({"x": x}, step, when=asked, metrics={"r": x.sum()})
        return x

    batched = jax.jit(jax.vmap(jax.vmap(save, in_axes=(0, 0, None)), in_axes=(0, 0, None)))
    xs = jnp.arange(12.0).reshape(2, 3, 2)
    asked = jnp.array([[True, False, True], [True, True, True]])
    batched(xs, asked, 10)
    batched(xs[:, ::-1] * 3, jnp.ones((2, 3), bool), 20)
    ckpt.wait()
    rows = jax_cb_ckpt.metrics_table(ckpt.directory)
    assert [(r["step"], r["member"], r["member_index"]) for r in rows] == [
        (step, flat, (flat // 3, flat % 3)) for step in (10, 20) for flat in range(6)
    ]
    first = [r for r in rows if r["step"] == 10]
    assert [r["asked"] for r in first] == asked.ravel().tolist()
    assert [r["metrics"]["r"] for r in first] == xs.sum(-1).ravel().tolist()
    assert all(r["member_step"] == r["step"] for r in rows)
    # each member's best, read off the table, is best_step's answer for it
    for flat in range(6):
        mine = [r for r in rows if r["member"] == flat]
        top = max(mine, key=lambda r: r["metrics"]["r"])["step"]
        assert jax_cb_ckpt.best_step(ckpt.directory, member=flat) == top


def test_metrics_table_leaves_out_a_damaged_step_and_says_so(make_ckpt, ckpt_dir):
    with jax_cb_ckpt.Checkpointer(ckpt_dir) as ckpt:
        _save_all(ckpt, [1.0, 2.0, 3.0])
    with open(ckpt_dir / "2" / "meta" / "metadata", "a") as f:
        f.write(" ")  # the step's record no longer matches its description
    with pytest.warns(jax_cb_ckpt.DamagedStepWarning, match=r"step 2"):
        rows = jax_cb_ckpt.metrics_table(ckpt_dir)
    assert [(r["step"], r["metrics"]) for r in rows] == [(1, {"return": 1.0}), (3, {"return": 3.0})]


def test_ls_best_ranks_steps_by_a_metric(make_ckpt, ckpt_dir, capsys):
    """Issue 44 item 6: `jax-cb-ckpt ls --best NAME`: the steps that recorded NAME
    (not NaN), best first, by the mode the steps were kept by (or --mode); a tie goes
    to the step saved first, as retention keeps it."""
    ckpt = make_ckpt(keep_best=4, best="return", mode="min")
    with pytest.warns(jax_cb_ckpt.StepOrderWarning, match="step 3 was saved after step 20"):
        for step, value in [(10, 5.0), (20, 1.0), (3, 5.0), (40, np.nan), (50, 2.0)]:
            ckpt.save({"w": jnp.zeros(2)}, step, metrics={"return": value, "other": -step})
            ckpt.wait()
    ckpt.save({"w": jnp.zeros(2)}, 60)  # no metrics
    ckpt.close()
    code, out, _ = _ls(ckpt_dir, "--best", "return", capsys=capsys)
    assert code == 0
    assert [int(line.split()[0]) for line in out.splitlines()[2:]] == [20, 50, 10, 3]
    code, _, err = _ls(ckpt_dir, "--best", "return", "--mode", "max", capsys=capsys)
    assert code == 2 and "kept by 'return' with mode min" in err and "--ignore-recorded" in err
    code, out, _ = _ls(
        ckpt_dir,
        "--best",
        "return",
        "--mode",
        "max",
        "--ignore-recorded",
        "--top",
        "2",
        capsys=capsys,
    )
    assert [int(line.split()[0]) for line in out.splitlines()[2:]] == [10, 3]
    code, out, _ = _ls(ckpt_dir, "--best", "other", "--mode", "max", "--json", capsys=capsys)
    assert [r["step"] for r in json.loads(out)["steps"]] == [3, 10, 20, 50]  # (40: NaN, gone)
    # what cannot be ranked says how to fix it (exit 2)
    code, _, err = _ls(ckpt_dir, "--best", "other", capsys=capsys)
    assert code == 2 and "--mode max (higher is better) or --mode min" in err
    code, _, err = _ls(ckpt_dir, "--top", "2", capsys=capsys)
    assert code == 2 and "pass --best NAME too" in err
    code, _, err = _ls(ckpt_dir, "--best", "return", "--top", "0", capsys=capsys)
    assert code == 2 and "--top 0: pass a positive number" in err
    code, _, err = _ls(ckpt_dir, "--best", "nowhere", "--mode", "min", capsys=capsys)
    assert code == 2 and "no complete step" in err and "'nowhere'" in err
    code, _, err = _ls(ckpt_dir, "--best", "return", "--member", "1", capsys=capsys)
    assert code == 2 and "are plain saves (no members)" in err


def test_ls_best_orders_tied_steps_saved_in_one_millisecond_by_their_save_order(
    make_ckpt, ckpt_dir, capsys, monkeypatch
):
    """Steps 20 then 10 (a counter that restarted) with the same value, handed over in
    one millisecond: `saved_at` (to the ms) ties, and `ls --best` put step 10 first
    (by step) where the step saved first ranks first. Each step now records the order
    it was saved in (`saved_ns`, which older readers and plain Orbax ignore)."""
    import types

    from jax_cb_ckpt._save import _host

    clock = types.SimpleNamespace(time=lambda: 1.8e9, perf_counter=time.perf_counter)
    monkeypatch.setattr(_host, "time", clock)  # every hand-off in the same millisecond
    ckpt = make_ckpt(keep_best=2, best="return", mode="max")
    with pytest.warns(jax_cb_ckpt.StepOrderWarning, match="step 10 was saved after step 20"):
        for step in (20, 10):
            ckpt.save({"w": jnp.zeros(2)}, step, metrics={"return": 1.0})
            ckpt.wait()
        ckpt.close()
    metas = [jax_cb_ckpt.metadata(ckpt_dir, step=step) for step in (20, 10)]
    assert metas[0]["saved_at"] == metas[1]["saved_at"]
    code, out, _ = _ls(ckpt_dir, "--best", "return", "--json", capsys=capsys)
    assert code == 0 and [r["step"] for r in json.loads(out)["steps"]] == [20, 10]
    assert metas[0]["saved_ns"] < metas[1]["saved_ns"]


def test_metrics_table_of_a_batch_the_state_holds_itself(make_ckpt, ckpt_dir):
    """run(batched=True) records 1-D metrics for a batch the state holds without vmap:
    the table crashed on them (`.item()` of a (3,) array); a row per index now."""
    ckpt = make_ckpt(every=2)
    body = lambda s, i: {"x": s["x"] + 1.0}  # noqa: E731
    ckpt.run(body, {"x": jnp.arange(3.0)}, 4, batched=True, metrics=lambda s: {"x": s["x"]})
    ckpt.save({"x": jnp.zeros(3)}, 5, metrics={"x": jnp.asarray([7.0, 8.0, 9.0]), "n": 2})
    ckpt.close()
    rows = jax_cb_ckpt.metrics_table(ckpt_dir)
    assert [(r["step"], r["member"], r["asked"]) for r in rows] == [
        (step, k, True) for step in (2, 4, 5) for k in range(3)
    ]
    assert [r["metrics"]["x"] for r in rows if r["step"] == 4] == [4.0, 5.0, 6.0]
    assert [r["metrics"] for r in rows if r["step"] == 5][2] == {"x": 9.0, "n": 2}


def test_metrics_table_and_best_step_name_a_step_whose_description_does_not_read(ckpt_dir):
    """A step without the description record (an older version's) whose meta holds a
    metric that is not a number: listed by its files, but metrics_table and best_step
    left it out without the DamagedStepWarning the docs promise."""
    with jax_cb_ckpt.Checkpointer(ckpt_dir) as ckpt:
        _save_all(ckpt, [1.0, 2.0, 3.0])
    step = ckpt_dir / "2"
    record = json.loads((step / "_CHECKPOINT_METADATA").read_text())
    record["custom_metadata"] = {}
    (step / "_CHECKPOINT_METADATA").write_text(json.dumps(record))
    meta = json.loads((step / "meta" / "metadata").read_text())
    meta["metrics"] = {"return": "high"}
    (step / "meta" / "metadata").write_text(json.dumps(meta))
    assert jax_cb_ckpt.all_steps(ckpt_dir) == [1, 2, 3]  # (its files are whole)
    with pytest.warns(jax_cb_ckpt.DamagedStepWarning, match=r"cannot be read.*\(step 2: "):
        assert [r["step"] for r in jax_cb_ckpt.metrics_table(ckpt_dir)] == [1, 3]
    with pytest.warns(jax_cb_ckpt.DamagedStepWarning, match=r"step 2: "):
        assert jax_cb_ckpt.best_step(ckpt_dir, best="return", mode="max") == 3


def test_a_member_s_value_where_it_did_not_ask_ranks_nowhere(make_ckpt, capsys):
    """A vmapped while_loop whose member 0 stops at 5 and member 1 at 8, saving every
    4: at step 8 member 0 holds its last state (5 updates) without asking. best_step,
    ls --best --member 0 and keep_best ranked that value, so the best step named for
    member 0 was one restore(member=0) refuses."""
    ckpt = make_ckpt(every=4, keep_best=1, best="score", max_to_keep=1)

    def run(x, n):
        def body(c):
            i, x = c
            ckpt.maybe_save({"x": x + 1.0}, i + 1, metrics={"score": (x + 1.0).sum()})
            return i + 1, x + 1.0

        return jax.lax.while_loop(lambda c: c[0] < n, body, (0, x))

    jax.jit(jax.vmap(run))(jnp.zeros((2, 1)), jnp.asarray([5, 8]))
    ckpt.wait()
    assert jax_cb_ckpt.metadata(ckpt.directory, step=8)["members"] == [False, True]
    assert ckpt.all_steps() == [4, 8]  # 4: member 0's newest and best (score 4)
    assert jax_cb_ckpt.best_step(ckpt.directory, member=0) == 4
    assert jax_cb_ckpt.best_step(ckpt.directory) == 8  # member 1's 8 is the best of all
    code, out, _ = _ls(ckpt.directory, "--best", "score", "--member", "0", capsys=capsys)
    assert code == 0 and [int(line.split()[0]) for line in out.splitlines()[2:]] == [4]
    restored = jax_cb_ckpt.restore(ckpt.directory, {"x": jnp.zeros(1)}, step=4, member=0)
    assert float(restored["x"][0]) == 4.0


def test_an_all_nan_metric_under_vmap_never_stops_the_writer(make_ckpt):
    """The log line of a save summed a batch's metric with nanmin, which warns on all
    NaN: where warnings are errors (as here: pytest's filterwarnings) the writer's
    thread died of it and the next saves waited for ever."""
    ckpt = make_ckpt()
    save = jax.jit(
        jax.vmap(lambda x, s: ckpt.save({"x": x}, s, metrics={"loss": x * jnp.nan}), (0, None))
    )
    done = threading.Event()

    def saves():
        for step in range(1, 6):
            save(jnp.ones(3), jnp.asarray(step))
        ckpt.wait()
        done.set()

    thread = threading.Thread(target=saves, daemon=True)
    thread.start()
    thread.join(120)
    assert done.is_set(), "the saves never finished: the writer's thread died"
    assert ckpt.all_steps() == [1, 2, 3, 4, 5]


def test_ls_shows_no_metrics_for_a_step_set_aside(ckpt_dir, capsys):
    """A step set aside by a restart showed the metrics of the step written again under
    its number (looked up by step number)."""
    with jax_cb_ckpt.Checkpointer(ckpt_dir) as ckpt:
        for step, r in ((1, 1.0), (2, 2.0)):
            ckpt.save({"w": jnp.arange(1000.0) * step}, step, metrics={"r": r})
    flip_stored(ckpt_dir / "2", np.arange(1000, dtype=np.float32)[100:120] * 2)
    with pytest.warns(jax_cb_ckpt.DamagedStepWarning):
        with jax_cb_ckpt.Checkpointer(ckpt_dir) as ckpt:
            ckpt.restore_or_init(lambda: {"w": jnp.zeros(1000)})
            ckpt.save({"w": jnp.ones(1000)}, 2, metrics={"r": 99.0})
    code, out, _ = _ls(ckpt_dir, capsys=capsys)
    assert code == 0
    aside = [line for line in out.splitlines() if "set aside" in line]
    assert len(aside) == 1, aside
    # (the columns before the note: the note's random hex name may hold "99")
    columns = aside[0][: aside[0].index("set aside")]
    assert "99" not in columns and " 2 " not in columns[10:], aside


def test_ls_best_under_vmap_ranks_by_the_best_member_or_one(make_ckpt, capsys):
    ckpt = make_ckpt()
    save = jax.jit(jax.vmap(lambda x, s: ckpt.save({"x": x}, s, metrics={"r": x}), (0, None)))
    save(jnp.array([1.0, 9.0, 2.0]), 1)
    save(jnp.array([5.0, 3.0, 4.0]), 2)
    ckpt.wait()

    def rank(*args):
        out = _ls(ckpt.directory, *args, capsys=capsys)[1]
        return [int(line.split()[0]) for line in out.splitlines()[1:]]

    assert rank("--best", "r", "--mode", "max") == [1, 2]  # 9 (member 1) beats 5
    assert rank("--best", "r", "--mode", "max", "--member", "0") == [2, 1]
    assert rank("--best", "r", "--mode", "min", "--member", "2") == [1, 2]
    code, _, err = _ls(
        ckpt.directory, "--best", "r", "--mode", "max", "--member", "3", capsys=capsys
    )
    assert code == 2 and "flat indices 0..2" in err


# -- when to save ---------------------------------------------------------------------


def test_every_seconds_saves_by_the_clock_asking_every_check_every_steps(make_ckpt):
    ckpt = make_ckpt(every_seconds=0.05, check_every=10)

    @jax.jit
    def train(s):
        def body(i, s):
            s = s + 1
            jax.debug.callback(lambda: time.sleep(0.001))  # ~1 ms a step
            ckpt.maybe_save(s, i + 1)
            return s

        return jax.lax.fori_loop(0, 300, body, s)

    train(jnp.zeros(2))
    ckpt.wait()
    steps = ckpt.all_steps()
    assert all(step % 10 == 0 for step in steps)  # asked only every check_every steps
    assert 2 <= len(steps) <= 30
    times = [_saved_at(ckpt.directory, s) for s in steps]
    assert all(b - a >= 0.045 for a, b in zip(times, times[1:], strict=False))
    # the clock's reads are no saves: one crossing of the state per save
    assert ckpt.stats.crossings == len(steps)
    if steps[-1] != 300:  # the final state was not saved: close says so (issue 41 item 5)
        with pytest.warns(jax_cb_ckpt.CheckpointWarning, match=r"loop reached step 300 .*"):
            ckpt.close()


def test_every_seconds_with_every_saves_on_both(make_ckpt):
    ckpt = make_ckpt(every=7, every_seconds=3600)
    jax.jit(
        lambda s: jax.lax.fori_loop(0, 30, lambda i, s: (ckpt.maybe_save(s, i + 1), s + 1)[1], s)
    )(jnp.zeros(2))
    ckpt.wait()
    assert ckpt.all_steps() == [7, 14, 21, 28]  # the clock never came due


def test_run_and_scan_save_by_the_clock_at_their_chunk_boundaries(make_ckpt, tmp_path):
    def slow(s, i):
        jax.debug.callback(lambda: time.sleep(0.002))
        return s + 1

    ckpt = make_ckpt(tmp_path / "run", every_seconds=0.05, check_every=8)
    final = ckpt.run(slow, jnp.zeros(2), 100)
    steps = ckpt.all_steps()
    assert steps[-1] == 100 and all(s % 8 == 0 for s in steps[:-1]) and len(steps) >= 3
    assert float(final[0]) == 100.0
    scanned = make_ckpt(tmp_path / "scan", every_seconds=0.05, check_every=8)

    def step(c, x):
        jax.debug.callback(lambda: time.sleep(0.002))
        return c + x, None

    jax.jit(lambda c: scanned.scan(step, c, jnp.ones(100))[0])(jnp.zeros(2))
    scanned.wait()
    steps = scanned.all_steps()
    assert len(steps) >= 2 and all(s % 8 == 0 for s in steps)


def test_initial_save_saves_the_starting_state_of_a_fresh_run(make_ckpt, tmp_path):
    def body(s, i):
        return s + 1

    ckpt = make_ckpt(tmp_path / "run", every=5, initial_save=True)
    ckpt.run(body, jnp.zeros(2), 10, metrics=lambda s: {"m": s[0]})
    assert ckpt.all_steps() == [0, 5, 10] and ckpt.metrics(0) == {"m": 0.0}
    ckpt.run(body, jnp.zeros(2), 15)  # resumed: no second step 0
    assert ckpt.all_steps() == [0, 5, 10, 15]
    own = make_ckpt(tmp_path / "own", initial_save=True)
    state, start = own.restore_or_init(lambda: {"w": jnp.arange(3.0)})
    assert start == 0 and own.all_steps() == [0]  # on disk when it returns
    np.testing.assert_array_equal(own.restore({"w": jnp.zeros(3)}, step=0)["w"], [0, 1, 2])

    # a scan of the same run after it: step 0 is there, no second one is handed over
    def add(c, x):
        return jax.tree.map(lambda a: a + x, c), None

    jax.jit(lambda c: own.scan(add, c, jnp.ones(4), every=2)[0])(state)
    own.wait()
    assert own.all_steps() == [0, 2, 4] and own.stats.duplicates == 0
    empty = make_ckpt(tmp_path / "empty", every=5, initial_save=True)
    empty.run(body, jnp.zeros(2), 0)  # nothing to run: step 0 is on disk all the same
    assert empty.all_steps() == [0]
    scanned = make_ckpt(tmp_path / "scan", every=4, initial_save=True)
    jax.jit(lambda c: scanned.scan(lambda c, x: (c + x, None), c, jnp.ones(8))[0])(jnp.zeros(2))
    scanned.wait()
    assert scanned.all_steps() == [0, 4, 8]


# -- what an adversarial pass found ----------------------------------------------------


def test_a_step_below_the_newest_never_unkeeps_the_seconds_chain(make_ckpt):
    """A restarted counter (step 5 saved after step 50) is judged by its save time: the
    steps one per interval kept stay kept."""
    ckpt = make_ckpt(keep_every_seconds=0.1, max_to_keep=1)
    for step in (10, 20, 30, 40, 50):
        ckpt.save({"w": jnp.zeros(3)}, step)
        ckpt.wait()
        time.sleep(0.15)
    assert ckpt.all_steps() == [10, 20, 30, 40, 50]
    with pytest.warns(jax_cb_ckpt.StepOrderWarning):
        ckpt.save({"w": jnp.zeros(3)}, 5)
        ckpt.wait()
    assert ckpt.all_steps() == [5, 10, 20, 30, 40, 50]


def test_best_step_of_a_directory_ranks_by_the_rule_its_steps_record(make_ckpt, ckpt_dir):
    """Issue 42 item 1: `jax_cb_ckpt.best_step(d, best="eval_loss")` ranked by the
    default mode "max" and returned the worst step, where every step records that it
    was kept by 'eval_loss' (min). The recorded rule is the default; a mode that
    contradicts it is refused unless asked for; another metric needs a mode."""
    ckpt = make_ckpt(keep_best=2, best="eval_loss", mode="min")
    for step, loss in ((100, 0.021), (200, 0.5), (6000, 0.0077)):
        ckpt.save({"w": jnp.zeros(2)}, step, metrics={"eval_loss": loss, "ret": step})
    ckpt.wait()
    assert jax_cb_ckpt.best_step(ckpt_dir) == 6000
    assert jax_cb_ckpt.best_step(ckpt_dir, best="eval_loss") == 6000
    assert jax_cb_ckpt.best_step(ckpt_dir, best="eval_loss", mode="min") == 6000
    with pytest.raises(ConfigError, match=r"kept by 'eval_loss' with mode='min'.*ignore_recorded"):
        jax_cb_ckpt.best_step(ckpt_dir, best="eval_loss", mode="max")
    # (200 went: keep_best=2 kept 100 and 6000; by "max" the worst of them is 100)
    worst = jax_cb_ckpt.best_step(ckpt_dir, best="eval_loss", mode="max", ignore_recorded=True)
    assert worst == 100
    with pytest.raises(ConfigError, match=r"not whether a higher or a lower 'ret' is better"):
        jax_cb_ckpt.best_step(ckpt_dir, best="ret")
    assert jax_cb_ckpt.best_step(ckpt_dir, best="ret", mode="max") == 6000
    assert ckpt.best_step() == 6000


def test_best_step_without_a_recorded_rule_needs_the_metric_and_mode(make_ckpt, ckpt_dir):
    ckpt = make_ckpt()
    ckpt.save({"w": jnp.zeros(2)}, 1, metrics={"r": 1.0})
    ckpt.wait()
    with pytest.raises(ConfigError, match=r"record no rule ranking a metric.*pass best="):
        jax_cb_ckpt.best_step(ckpt_dir)
    with pytest.raises(ConfigError, match=r"pass mode='max'"):
        jax_cb_ckpt.best_step(ckpt_dir, best="r")


def test_a_clock_set_back_never_unkeeps_what_the_seconds_chain_kept(ckpt_dir, monkeypatch):
    """Issue 42 item 4: keep_every_seconds=3600, steps 1..8 ten minutes apart (the
    chain keeps 1 and 7), the wall clock set 2 h back for step 9, then a restart that
    saves step 10: step 1 was deleted (the restart rebuilt the chain by save times,
    where step 9 now came first). Each step records the chain's decision when it is
    saved, and a restart keeps it. The clock is the host's `time.time` (what a save is
    stamped with), set for each save."""
    t0 = 1_800_000_000.0
    at = {step: t0 + 600 * (step - 1) for step in range(1, 9)}
    at |= {9: at[8] + 600 - 7200, 10: at[8] + 900 - 7200}
    now = [t0]
    monkeypatch.setattr(time, "time", lambda: now[0])
    rules = {"keep_every_seconds": 3600, "max_to_keep": 1}
    with jax_cb_ckpt.Checkpointer(ckpt_dir, **rules) as ckpt:
        for step in range(1, 10):
            now[0] = at[step]
            ckpt.save({"w": jnp.zeros(3)}, step)
            ckpt.wait()
        assert ckpt.all_steps() == [1, 7, 9]
    with jax_cb_ckpt.Checkpointer(ckpt_dir, **rules) as ckpt:  # the restart
        now[0] = at[10]
        ckpt.save({"w": jnp.zeros(3)}, 10)
    assert jax_cb_ckpt.all_steps(ckpt_dir) == [1, 7, 10]
    recorded = [jax_cb_ckpt.metadata(ckpt_dir, step=s)["retention"] for s in (1, 7, 10)]
    assert [r["seconds_chain"] for r in recorded] == [True, True, False]
    # `ls` and metrics_table say what the writer does: step 1 is kept by the chain
    # (they rebuilt it by save times, and showed step 1 as about to be deleted)
    kept = [(r["step"], r["kept_by"]) for r in jax_cb_ckpt.metrics_table(ckpt_dir)]
    assert kept == [(1, ["seconds"]), (7, ["seconds"]), (10, ["newest", "latest"])]
    listed = json.loads(run_child(["python", "-m", "jax_cb_ckpt", "ls", "--json", ckpt_dir]).stdout)
    assert [(r["step"], r["kept_by"]) for r in listed["steps"]] == kept


def _rewrite_meta(step_dir, change):
    """Edit a step's meta item and rewrite its record in Orbax's step file to match (a
    consistent edit that the listing's size and CRC check cannot see)."""
    from jax_cb_ckpt._layout import _format

    path = os.path.join(step_dir, "meta", "metadata")
    with open(path) as f:
        meta = json.load(f)
    change(meta)
    for name, data in _format.meta_files(meta).items():
        with open(os.path.join(step_dir, name), "wb") as f:
            f.write(data)


def test_retention_leaves_a_step_whose_meta_cannot_be_read_alone(make_ckpt, ckpt_dir):
    with jax_cb_ckpt.Checkpointer(ckpt_dir) as ckpt:
        _save_all(ckpt, [9.0, 1.0, 2.0])
    _rewrite_meta(ckpt_dir / "1", lambda meta: meta.update(metrics={"note": "hello"}))
    assert jax_cb_ckpt.all_steps(ckpt_dir) == [1, 2, 3]  # listed (the record matches)
    ckpt = make_ckpt(max_to_keep=1, keep_best=1, best="return")
    with pytest.warns(jax_cb_ckpt.DamagedStepWarning, match=r"left step\(s\) 1 alone"):
        ckpt.save({"w": jnp.zeros(3)}, 4, metrics={"return": 0.0})
        ckpt.wait()
    assert ckpt.all_steps() == [1, 3, 4]  # 1 neither ranked nor deleted; 3 is best now
    # with max_to_keep alone, a step read only before it is deleted is left alone too
    other = make_ckpt(ckpt_dir.parent / "other")
    _save_all(other, [None] * 2)
    other.close()
    _rewrite_meta(ckpt_dir.parent / "other" / "1", lambda meta: meta.update(metrics=[1]))
    with jax_cb_ckpt.Checkpointer(ckpt_dir.parent / "other", max_to_keep=1) as again:
        with pytest.warns(jax_cb_ckpt.DamagedStepWarning):
            again.save({"w": jnp.zeros(3)}, 3)
            again.wait()
    assert os.path.isdir(ckpt_dir.parent / "other" / "1")


def test_a_damaged_bucket_step_is_not_deleted_by_retention(remote, capsys):
    with jax_cb_ckpt.Checkpointer(remote.url) as ckpt:
        _save_all(ckpt, [9.0, 1.0])
    from jax_cb_ckpt._storage import _remote

    url = f"{remote.url}/1/meta/metadata"
    data, _ = _remote.read(url)
    _remote.write(url, data.replace(b'"return": 9.0', b'"return": 8.0'))  # CRC no longer matches
    with jax_cb_ckpt.Checkpointer(remote.url, max_to_keep=1, keep_best=1, best="return") as ckpt:
        with pytest.warns(jax_cb_ckpt.DamagedStepWarning):
            ckpt.save({"w": jnp.zeros(3)}, 3, metrics={"return": 0.0})
            ckpt.wait()
    assert "1" in {k.split("/")[0] for k in _remote.list_keys(remote.url)}
    # and ls says what it is (a bucket lists a step by its objects alone)
    from jax_cb_ckpt._cli._main import main

    assert main(["ls", "--json", remote.url]) == 0
    rows = {row["step"]: row for row in json.loads(capsys.readouterr().out)["steps"]}
    assert rows[1]["complete"] is False and "meta" in rows[1]["damaged"]
    assert rows[3]["complete"] and rows[3]["kept_by"] == ["newest", "latest"]


def test_a_best_metric_the_saves_never_pass_is_warned_about(make_ckpt):
    ckpt = make_ckpt(keep_best=2, best="ret")
    with pytest.warns(jax_cb_ckpt.CheckpointWarning, match=r"without 'ret'.*never count as best"):
        ckpt.save({"w": jnp.zeros(3)}, 1, metrics={"return": 1.0})
    ckpt.save({"w": jnp.zeros(3)}, 2, metrics={"return": 2.0})  # said once per set of names
    ckpt.save({"w": jnp.zeros(3)}, 3)  # a save without metrics is fine
    ckpt.wait()


def test_odd_but_valid_values_and_records(make_ckpt, ckpt_dir):
    ckpt = make_ckpt()
    ckpt.save({"w": jnp.zeros(3)}, 1, metrics={"u": np.uint64(2**64 - 1), "i": np.int64(-(2**63))})
    ckpt.save({"w": jnp.zeros(3)}, 2, metrics={"nan": np.float32(np.nan)})
    ckpt.close()
    assert jax_cb_ckpt.metrics(ckpt_dir, step=1) == {"u": 2**64 - 1, "i": -(2**63)}
    # a record of no rule, and a saved_at that is not a string: read, listed, saved after
    _rewrite_meta(ckpt_dir / "2", lambda meta: meta.update(retention={}, saved_at=12))
    table = run_child(["python", "-m", "jax_cb_ckpt", "ls", ckpt_dir])
    assert table.returncode == 0 and "kept by" not in table.stdout, table.stderr
    shown = run_child(["python", "-m", "jax_cb_ckpt", "show", "--json", ckpt_dir])
    data = json.loads(shown.stdout, parse_constant=lambda c: pytest.fail(f"not JSON: {c}"))
    assert data["metrics"] == {"nan": "nan"}
    with jax_cb_ckpt.Checkpointer(ckpt_dir, max_to_keep=1) as again:
        again.save({"w": jnp.zeros(3)}, 3)
    assert jax_cb_ckpt.all_steps(ckpt_dir) == [3]


def test_the_clock_is_asked_every_check_every_steps_under_vmap_too(make_ckpt):
    """A vmapped loop counter would turn the cond that guards the clock into a select
    that asks at every step; the batching rule asks once per check for the batch."""
    ckpt = make_ckpt(every_seconds=3600, check_every=50)
    reads = []
    read = ckpt._parts.clock.read
    ckpt._parts.clock.read = lambda step: (reads.append(1), read(step))[1]  # counted, not replaced

    def body(carry, _):
        state, i = carry
        ckpt.maybe_save(state, i + 1)
        return (state + 1, i + 1), None

    run = jax.vmap(lambda s, i: jax.lax.scan(body, (s, i), None, length=1000)[0])
    jax.jit(run)(jnp.zeros((3, 2)), jnp.zeros(3, jnp.int32))
    jax.jit(jax.vmap(run))(jnp.zeros((2, 3, 2)), jnp.zeros((2, 3), jnp.int32))
    ckpt.wait()
    assert len(reads) == 2 * 1000 // 50
    # The clock never came due: the loops' final states are not on disk, said at close.
    with pytest.warns(jax_cb_ckpt.CheckpointWarning, match=r"loop reached step 1000 .* no step"):
        ckpt.close()


# -- a kill during retention ------------------------------------------------------------

_WORKER = """
import os, sys
os.environ.setdefault("JAX_PLATFORMS", "cpu")
import jax.numpy as jnp, numpy as np
import jax_cb_ckpt
ckpt = jax_cb_ckpt.Checkpointer(sys.argv[1], max_to_keep=2, keep_every=10, keep_best=3, best="r")
print("started", flush=True)
for step in range(1, 100000):
    ckpt.save({"x": jnp.full(1 << 16, float(step))}, step, metrics={"r": float((step * 37) % 101)})
"""


def test_a_kill_during_retention_leaves_every_kept_step_whole(tmp_path):
    """SIGKILL at random moments of a run whose writer deletes a step at almost every
    commit: every step the rules keep, of the steps up to the newest on disk, is there
    and verifies; nothing incomplete is listed."""
    rng = np.random.default_rng(7)
    directory = tmp_path / "ckpt"
    for round_ in range(3):
        child = start_script(tmp_path, _WORKER, directory, ready="started")
        time.sleep(float(rng.uniform(0.3, 1.5)))
        kill_group(child)
        steps = jax_cb_ckpt.all_steps(directory)
        assert steps, f"round {round_}: nothing saved"
        newest = steps[-1]
        # (Steps no rule keeps may still be there: the kill can fall between a commit
        # and its retention.)
        saved = [(s, 0.0, np.asarray(float((s * 37) % 101))) for s in range(1, newest + 1)]
        expected = _kept(saved, max_to_keep=2, keep_every=10, best=3)
        missing = sorted(set(expected) - set(steps))
        assert not missing, f"round {round_}: kept steps {missing} are gone (on disk: {steps})"
        assert jax_cb_ckpt.verify(directory) == steps
        directory = tmp_path / f"ckpt{round_ + 1}"  # a fresh run each round


def test_one_step_that_cannot_be_deleted_stops_no_other_deletion(tmp_path, capsys):
    """Issue 42 item 3: saves 1..6, step 4 made undeletable (chattr +i), max_to_keep=2,
    saves 7..12: every later deletion stopped (4..12 all stayed, a log warning per
    save). Now retention passes over step 4, deletes the rest as the rules say (the set
    stays bounded), says it once (the path and the OS error), and `ls` shows it."""
    d = tmp_path / "ckpt"
    with jax_cb_ckpt.Checkpointer(d) as ckpt:
        for step in range(1, 7):
            ckpt.save({"w": jnp.zeros(2)}, step)
    if run_child(["chattr", "+i", d / "4"]).returncode != 0:
        pytest.skip("chattr +i is not available here")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with jax_cb_ckpt.Checkpointer(d, max_to_keep=2) as ckpt:
                for step in range(7, 13):
                    ckpt.save({"w": jnp.zeros(2)}, step)
                    ckpt.wait()
        said = [str(w.message) for w in caught if "cannot delete" in str(w.message)]
        assert len(said) == 1 and f"step 4 ({d}/4)" in said[0], said
        assert "PermissionError" in said[0] or "Operation not permitted" in said[0], said
        assert jax_cb_ckpt.all_steps(d) == [4, 11, 12]
        ls = run_child([SCRIPT_LS, "ls", d])
        assert "retention cannot delete it: " in ls.stdout, ls.stdout
    finally:
        run_child(["chattr", "-i", d / "4"])
    with jax_cb_ckpt.Checkpointer(d, max_to_keep=2) as ckpt:  # deletable again: it goes
        ckpt.save({"w": jnp.zeros(2)}, 13)
    assert jax_cb_ckpt.all_steps(d) == [12, 13]
    assert not (d / ".jax_cb_ckpt-undeletable.json").exists()


def test_a_step_whose_meta_was_edited_is_named_at_wait_when_retention_passes_it(make_ckpt):
    """Issue 42 item 6: a step whose meta was edited (a damaged step: its record does
    not match) was left alone in silence: retention listed the steps with a listing
    that leaves damaged ones out. It is said at the next wait()/close()."""
    ckpt = make_ckpt()
    for step in (1, 2, 3):
        ckpt.save({"w": jnp.zeros(2)}, step)
    ckpt.close()
    meta = os.path.join(ckpt.directory, "2", "meta", "metadata")
    with open(meta, "ab") as f:
        f.write(b" ")  # edited: its size no longer matches the record
    again = make_ckpt(max_to_keep=1)
    with pytest.warns(jax_cb_ckpt.DamagedStepWarning, match=r"left step\(s\) 2 alone"):
        again.save({"w": jnp.zeros(2)}, 4)
        again.wait()
    assert os.path.isdir(os.path.join(ckpt.directory, "2"))  # neither ranked nor deleted
    with pytest.warns(jax_cb_ckpt.DamagedStepWarning):
        assert jax_cb_ckpt.all_steps(ckpt.directory) == [4]


def test_metric_names_as_tensorboard_writes_them(make_ckpt, ckpt_dir):
    """Issue 42 item 9: `metrics={"eval/loss": ...}` was refused ("keys must contain
    neither '.' nor '/'") where the docs name nested metrics "eval/return". A flat key
    with '/' or '.' is its name; a nested one joins its keys with '/'; two of one name
    are refused; keep_best ranks by such a name."""
    ckpt = make_ckpt(keep_best=1, best="eval/loss", mode="min")
    ckpt.save({"w": jnp.zeros(2)}, 1, metrics={"eval/loss": 0.5, "train.loss": 1.0})
    ckpt.save({"w": jnp.zeros(2)}, 2, metrics={"eval": {"loss": 0.25}, "train.loss": 2.0})
    ckpt.wait()
    assert jax_cb_ckpt.metrics(ckpt_dir, step=2) == {"eval/loss": 0.25, "train.loss": 2.0}
    assert jax_cb_ckpt.all_steps(ckpt_dir) == [2]  # (step 1 was the worse 'eval/loss')
    assert jax_cb_ckpt.best_step(ckpt_dir) == 2
    with pytest.raises(InvalidStateError, match=r"are both named 'eval/loss'"):
        ckpt.save({"w": jnp.zeros(2)}, 3, metrics={"eval/loss": 1.0, "eval": {"loss": 2.0}})
    ls = run_child([SCRIPT_LS, "ls", ckpt_dir])
    assert "eval/loss" in ls.stdout and "train.loss" in ls.stdout, ls.stdout


def test_maybe_save_takes_a_metrics_function_computed_only_at_saves(make_ckpt, ckpt_dir):
    """Issue 42 item 10: `run` and `scan` take `metrics=lambda state: ...`, maybe_save
    refused it (with a fix about equinox Modules), so a loop of one's own computed its
    eval metric at every step. It is computed inside the save's cond only."""
    ckpt = make_ckpt(every=5)
    computed = []

    def metrics(state):
        jax.debug.callback(lambda: computed.append(1))  # once per evaluation
        return {"eval/loss": jnp.sum(state)}

    def body(i, s):
        s = s + 1.0
        ckpt.maybe_save(s, i + 1, metrics=metrics)
        return s

    jax.jit(lambda s: jax.lax.fori_loop(0, 20, body, s))(jnp.zeros(2))
    ckpt.save(jnp.zeros(2), 21, metrics=metrics)  # eagerly, too
    ckpt.wait()
    jax.effects_barrier()
    assert ckpt.all_steps() == [5, 10, 15, 20, 21]
    assert [jax_cb_ckpt.metrics(ckpt_dir, step=s)["eval/loss"] for s in (5, 20)] == [10.0, 40.0]
    assert len(computed) == 5  # at the saves only, not at each of the 20 steps


def test_an_array_metric_per_member_under_vmap_is_refused_at_the_call(make_ckpt):
    """Issue 42 item 5: a (3,) metric per member was stored as (4, 3) under vmap of 4
    seeds (the docs say arrays are refused), and `best_step(member=11)` was accepted."""
    ckpt = make_ckpt(every=1)

    def one(x, i):
        ckpt.maybe_save(x, i, metrics={"r": jnp.full(3, 1.0) * x[0]})
        return x

    with pytest.raises(InvalidStateError, match=r"metrics\['r'\] is float32\[3\] per member"):
        jax.jit(jax.vmap(one, in_axes=(0, None)))(jnp.ones((4, 2)), jnp.int32(1))
    ckpt.maybe_save(jnp.ones((4, 2)), 2, metrics={"r": jnp.arange(4.0)})  # a batch held
    ckpt.wait()  # without vmap: 1-D, one value per member
    with pytest.raises(ConfigError, match=r"member=11"):
        jax_cb_ckpt.best_step(ckpt.directory, best="r", mode="max", member=11)


def test_a_tie_keeps_the_step_saved_first(make_ckpt):
    """Issue 42 item 2: keep_best=1 by 'r', saves of steps 10 (r=5), 11 (r=1) and 3
    (r=5): step 10 was deleted and step 3 kept (ranked by step number, not by the order
    of saves). The docs: a new step enters a best set only when strictly better."""
    ckpt = make_ckpt(keep_best=1, best="r")
    ckpt.save({"w": jnp.zeros(2)}, 10, metrics={"r": 5.0})
    ckpt.save({"w": jnp.zeros(2)}, 11, metrics={"r": 1.0})
    with pytest.warns(jax_cb_ckpt.StepOrderWarning):
        ckpt.save({"w": jnp.zeros(2)}, 3, metrics={"r": 5.0})
        ckpt.wait()
    assert ckpt.all_steps() == [10, 11]  # 10: the best (first); 11: the newest
    assert ckpt.best_step() == 10
