"""`_write/_retention.py`: after each commit, the steps no rule keeps go (set aside, for
deletion later), on a small real directory written by a Checkpointer. Only complete
steps of ours are touched: a damaged step is neither ranked nor deleted (said in a
`DamagedStepWarning` note), a foreign folder is never touched; rules that changed since
the last run delete, from the first commit, what the old ones kept, named in a warning
log first; later commits act incrementally."""

import logging
import os
import shutil

import jax.numpy as jnp
import pytest
from helpers import fresh_copy

import jax_cb_ckpt
from jax_cb_ckpt import DamagedStepWarning
from jax_cb_ckpt._layout._policy import Rules
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
        Rules(**rules), _places.at(str(directory)), lambda kind, text: notes.append((kind, text))
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
