"""`_read/_steps.py`: the reads every step shares, on a small real directory written by
a Checkpointer. Only complete steps of ours are listed (a damaged one is left out and
named in one `DamagedStepWarning`, nothing deleted; a foreign folder is ignored);
`latest_step`, `metrics`, `metrics_table`, `best_step` (the recorded rule, or one
given); a step passed positionally is refused saying to pass `step=`; `verify` checks
every byte and names a flipped one; a missing step says which steps there are."""

import jax.numpy as jnp
import numpy as np
import pytest
from helpers import fresh_copy

import jax_cb_ckpt
from jax_cb_ckpt import (
    ConfigError,
    DamagedStepError,
    DamagedStepWarning,
    NoCheckpointError,
)
from jax_cb_ckpt._read import _steps

LOSS = {1: 5.0, 2: 3.0, 3: 4.0, 4: 6.0}


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """Steps 1-4, each with a `loss` metric, kept by keep_best=2 on it (min) and the
    latest 2: step 1 goes (the worst loss of the others, not the latest)."""
    directory = tmp_path_factory.mktemp("steps") / "ckpt"
    with jax_cb_ckpt.Checkpointer(
        directory, keep_best=2, best="loss", mode="min", max_to_keep=2
    ) as ckpt:
        for step, loss in LOSS.items():
            ckpt.save({"w": jnp.full((3,), float(step))}, step, metrics={"loss": loss})
    return directory


@pytest.fixture
def directory(written, tmp_path):
    return fresh_copy(written, tmp_path)


def _damage(directory, step):
    with open(directory / str(step) / "meta" / "metadata", "ab") as f:
        f.write(b"x")


def test_all_and_latest_steps(directory):
    assert _steps.all_steps(directory) == [2, 3, 4]
    assert _steps.latest_step(directory) == 4
    assert _steps.latest_step(directory.parent / "empty") is None


def test_a_foreign_folder_is_not_a_step(directory):
    (directory / "7").mkdir()
    (directory / "7" / "notes.txt").write_text("mine")
    assert _steps.all_steps(directory) == [2, 3, 4]


def test_a_damaged_step_is_left_out_and_named_once(directory):
    _damage(directory, 4)
    with pytest.warns(
        DamagedStepWarning,
        match=r"1 step folder\(s\).*step 4: 'meta/metadata'"
        r".*Nothing was deleted",
    ) as caught:
        assert _steps.latest_step(directory) == 3
    assert len(caught) == 1
    assert (directory / "4").is_dir()


def test_metrics_and_the_table(directory):
    assert _steps.metrics(directory) == {"loss": 6.0}
    assert _steps.metrics(directory, step=2) == {"loss": 3.0}
    rows = _steps.metrics_table(directory)
    assert [(r["step"], r["member"], r["metrics"]) for r in rows] == [
        (s, None, {"loss": LOSS[s]}) for s in (2, 3, 4)
    ]
    assert "best" in rows[0]["kept_by"] and "latest" in rows[2]["kept_by"]


def test_a_step_passed_positionally_is_refused_saying_to_use_step(directory):
    with pytest.raises(
        ConfigError,
        match=r"metrics\(directory, 2\).*Fix: metrics\(directory, "
        r"step=2\)",
    ):
        _steps.metrics(directory, 2)


def test_best_step_by_the_recorded_rule_or_one_given(directory):
    assert _steps.best_step(directory) == 2
    assert _steps.best_step(directory, best="loss", mode="max", ignore_recorded=True) == 4
    with pytest.raises(ConfigError, match=r"kept by 'loss' with mode='min'.*ignore_recorded"):
        _steps.best_step(directory, mode="max")
    with pytest.raises(ConfigError, match=r"mode must be 'max' or 'min'"):
        _steps.best_step(directory, mode="lowest")  # type: ignore[arg-type]


def test_a_missing_step_names_the_steps_there(directory):
    """A named step is taken as named (`pick_step`); opening it (`open_step`, given the
    caller's name) says what the directory holds when it is not there."""
    storage = jax_cb_ckpt._storage._places.at(str(directory))
    assert _steps.pick_step(storage, 1, "restore") == 1
    with pytest.raises(NoCheckpointError, match=r"no checkpoint for step 1 .*are \[2, 3, 4\]"):
        _steps.open_step(storage, 1, "restore")
    assert _steps.pick_step(storage, None, "restore") == 4


@pytest.mark.parametrize("step", [-1, True, 2.0, "3"])
def test_a_step_argument_must_be_a_non_negative_int(step):
    with pytest.raises(ConfigError, match=r"restore\(step=.*must be a non-negative int"):
        _steps.check_step_arg(step, "restore")
    assert _steps.check_step_arg(np.int64(3), "restore") == 3


def test_verify_checks_every_step_and_names_a_flipped_byte(directory):
    assert _steps.verify(directory) == [2, 3, 4]
    files = sorted((directory / "3" / "state" / "d").iterdir())
    biggest = max(files, key=lambda p: p.stat().st_size)
    data = bytearray(biggest.read_bytes())
    data[len(data) // 2] ^= 0xFF
    biggest.write_bytes(bytes(data))
    assert _steps.verify(directory, step=4) == [4]
    with pytest.raises(DamagedStepError, match=r"^verify\(step=3\) .*does not match"):
        _steps.verify(directory, step=3)


def test_short_lists_long_step_lists_shortly():
    assert _steps.short([1, 2]) == "[1, 2]"
    assert _steps.short(list(range(20))) == "[0, 1, 2, 3, 4, ..., 17, 18, 19]"
