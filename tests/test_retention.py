"""`_write/_retention.py`: after each commit, the steps no rule keeps go (set aside, for
deletion later), on a small real directory written by a Checkpointer. Only complete
steps of ours are touched: a damaged step is neither ranked nor deleted (said in a
`DamagedStepWarning` note), a foreign folder is never touched; rules that changed since
the last run delete, from the first commit, what the old ones kept, named in a warning
log first; later commits act incrementally."""

import dataclasses
import logging
import os
import shutil
from collections.abc import Mapping
from typing import Any, ClassVar

import jax.numpy as jnp
import pytest
from helpers import fresh_copy

import jax_cb_ckpt
from jax_cb_ckpt import DamagedStepWarning
from jax_cb_ckpt._layout import _policy
from jax_cb_ckpt._layout._policy import AnyOf, Entry, Keeper
from jax_cb_ckpt._layout._rule import Stateless
from jax_cb_ckpt._read import _steps
from jax_cb_ckpt._storage import _places
from jax_cb_ckpt._write._retention import Retention


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """Steps 1-6 saved without rules, with a `loss` metric (lowest at step 2)."""
    directory = tmp_path_factory.mktemp("retention") / "ckpt"
    losses = {1: 5.0, 2: 1.0, 3: 4.0, 4: 6.0, 5: 3.0, 6: 7.0}
    with jax_cb_ckpt.Checkpointer(directory) as ckpt:
        for step, loss in losses.items():
            ckpt.save({"w": jnp.full((2,), float(step))}, step, metrics={"loss": loss})
    return directory


@pytest.fixture
def directory(written, tmp_path):
    return fresh_copy(written, tmp_path)


def _retention(directory, **rules):
    notes = []
    retention = Retention(
        AnyOf.short(rules),
        _places.at(str(directory)),
        lambda kind, text: notes.append((kind, text)),
    )
    return retention, notes


def _commit(retention, directory, step):
    """What the writer does after committing `step` (already on disk here)."""
    return retention.committed(step, _steps.metadata(directory, step=step))


def test_the_steps_no_rule_keeps_are_set_aside(directory):
    retention, notes = _retention(directory, max_to_keep=2)
    asides = _commit(retention, directory, 6)
    assert jax_cb_ckpt.all_steps(directory) == [5, 6]
    assert len(asides) == 4 and all(os.path.exists(a) for a in asides)
    assert all(".jax_cb_ckpt-deleting-" in os.path.basename(a) for a in asides)
    assert notes == []


def test_keep_best_ranks_by_the_recorded_metric(directory):
    retention, _ = _retention(directory, max_to_keep=1, keep_best=1, best="loss", mode="min")
    _commit(retention, directory, 6)
    assert jax_cb_ckpt.all_steps(directory) == [2, 6]


def test_a_damaged_step_is_neither_ranked_nor_deleted(directory):
    with open(directory / "3" / "meta" / "metadata", "ab") as f:
        f.write(b"x")
    retention, notes = _retention(directory, max_to_keep=1)
    _commit(retention, directory, 6)
    assert (directory / "3").is_dir()
    assert [kind for kind, _ in notes] == [DamagedStepWarning]
    assert "left step(s) 3 alone" in notes[0][1]
    with pytest.warns(DamagedStepWarning):
        assert jax_cb_ckpt.all_steps(directory) == [6]


def test_a_foreign_folder_is_never_touched(directory):
    foreign = directory / "0"
    foreign.mkdir()
    (foreign / "mine.txt").write_text("keep me")
    retention, _ = _retention(directory, max_to_keep=1)
    _commit(retention, directory, 6)
    assert (foreign / "mine.txt").read_text() == "keep me"
    assert jax_cb_ckpt.all_steps(directory) == [6]


def test_changed_rules_name_what_they_delete_in_a_warning_log(directory, caplog):
    retention, _ = _retention(directory, max_to_keep=3)
    with caplog.at_level(logging.WARNING, logger="jax_cb_ckpt"):
        _commit(retention, directory, 6)
    said = [r.getMessage() for r in caplog.records if "rules changed" in r.getMessage()]
    assert len(said) == 1
    assert "were: keep all (no rules recorded)" in said[0]
    assert "deleting 3 step(s) the previous rules kept: 1, 2, 3" in said[0]


def test_later_commits_act_incrementally(directory):
    retention, _ = _retention(directory, max_to_keep=2)
    for step in (1, 2, 3):  # as if the run committed them one after another
        shutil.move(str(directory / str(step + 3)), str(directory.parent / f"later{step}"))
    _commit(retention, directory, 3)
    assert jax_cb_ckpt.all_steps(directory) == [2, 3]
    for step in (4, 5):
        shutil.move(str(directory.parent / f"later{step - 3}"), str(directory / str(step)))
        _commit(retention, directory, step)
        assert jax_cb_ckpt.all_steps(directory) == [step - 1, step]


def test_retention_after_someone_removed_a_step(directory):
    retention, _ = _retention(directory, max_to_keep=2)
    _commit(retention, directory, 6)
    shutil.rmtree(directory / "5")
    retention.removed(5)
    assert _commit(retention, directory, 6) == []
    assert jax_cb_ckpt.all_steps(directory) == [6]


# A rule added in a test file alone (the "how to add a rule" of _layout/README.md) ------


@dataclasses.dataclass(frozen=True)
class DivisibleBy:
    """A throwaway rule: keep the steps divisible by `n` (all a `_keep_*.py` holds)."""

    n: int
    reason: ClassVar[str] = "divisible"
    keywords: ClassVar[Mapping[str, Any]] = {"keep_divisible_by": None}
    reads_metas: ClassVar[bool] = False
    ranks = None

    def to_json(self):
        return {"keep_divisible_by": self.n}

    @classmethod
    def from_keywords(cls, given, call):
        n = given.get("keep_divisible_by")
        return None if n is None else cls(n)

    def describe(self):
        return f"keep_divisible_by={self.n}"

    def track(self, held, previous):
        return Stateless(lambda step: step % self.n == 0)


def test_a_rule_added_in_a_test_file_runs_through_a_checkpointer(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(_policy, "RULES", (*_policy.RULES, DivisibleBy))  # the one line
    directory = tmp_path / "ckpt"
    keep = [DivisibleBy(7), jax_cb_ckpt.LatestN(2)]
    with jax_cb_ckpt.Checkpointer(directory, keep=keep) as ckpt:
        for step in range(1, 22):
            ckpt.save({"w": jnp.full((2,), float(step))}, step)
    assert jax_cb_ckpt.all_steps(directory) == [7, 14, 20, 21]
    kept = {row["step"]: row["kept_by"] for row in jax_cb_ckpt.metrics_table(directory)}
    assert kept == {
        7: ["divisible"],
        14: ["divisible"],
        20: ["latest"],
        21: ["newest", "latest", "divisible"],
    }
    record = jax_cb_ckpt.metadata(directory, step=21)["retention"]
    assert record == {"max_to_keep": 2, "keep_divisible_by": 7}  # in RULES order
    with caplog.at_level(logging.WARNING, logger="jax_cb_ckpt"):  # a restart: same rules
        with jax_cb_ckpt.Checkpointer(directory, keep=keep[::-1]) as ckpt:
            ckpt.save({"w": jnp.zeros(2)}, 28)
    assert jax_cb_ckpt.all_steps(directory) == [7, 14, 21, 28]
    assert "rules changed" not in caplog.text


def test_a_commit_asks_the_rules_about_a_few_steps_however_many_are_held():
    """The cost promise (docs/usage.md, "What retention touches"): a settle examines
    only the steps an add can have changed, never every held step."""
    asked = []

    class Counted(DivisibleBy):
        def track(self, held, previous):
            return Stateless(lambda step: asked.append(step) or step % self.n == 0)

    keeper = Keeper(AnyOf((Counted(1), jax_cb_ckpt.LatestN(3))))  # keeps every step
    per_commit = []
    for step in range(3000):
        asked.clear()
        keeper.add(Entry(step, float(step), None))
        assert keeper.settle() == []
        per_commit.append(len(asked))
    assert len(keeper.steps) == 3000
    assert max(per_commit[10:]) == max(per_commit[2990:]) <= 2
