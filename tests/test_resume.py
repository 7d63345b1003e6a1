"""`_read/_resume.py`: a restart's rules, on a small real directory. `newest` reads the
newest step that passes its checks, passing over (and naming, with why) the newer ones
that are damaged, whether their description is damaged or their read raises
`DamagedStepError`; any other error is raised as it is; `on_damaged="raise"` stops at
the first; no passing step gives a refusal naming every one. `report` says it in one
`DamagedStepWarning` and, when asked, sets the passed-over steps aside (nothing is
deleted). `check_on_damaged` refuses other values."""

import os
import shutil

import jax.numpy as jnp
import pytest

import jax_cb_ckpt
from jax_cb_ckpt import ConfigError, DamagedStepError, DamagedStepWarning, RestoreError
from jax_cb_ckpt._base._errors import calling
from jax_cb_ckpt._read import _resume
from jax_cb_ckpt._storage import _places


@pytest.fixture(autouse=True)
def _restart():
    """Messages name the public call under way (`calling`): here a made-up "restart"."""
    with calling("restart"):
        yield


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    directory = tmp_path_factory.mktemp("resume") / "ckpt"
    with jax_cb_ckpt.Checkpointer(directory) as ckpt:
        for step in (1, 2, 3, 4):
            ckpt.save({"w": jnp.full((2,), float(step))}, step)
    return directory


@pytest.fixture
def storage(written, tmp_path):
    copy = tmp_path / "ckpt"
    shutil.copytree(written, copy)
    return _places.at(str(copy))


def _damage_description(storage, step):
    with open(os.path.join(storage.path, str(step), "meta", "metadata"), "ab") as f:
        f.write(b"x")


def _reader(bad=(), other=()):
    """`read(step)`: the step itself, DamagedStepError for `bad`, RestoreError for `other`."""
    tried = []

    def read(step):
        tried.append(step)
        if step in bad:
            raise DamagedStepError(f"step {step} flipped", f"bit flipped in {step}")
        if step in other:
            raise RestoreError(f"step {step}: storage out of reach")
        return f"value of {step}"

    return read, tried


def _no_plain(found):
    raise AssertionError("no plain Orbax step here")


def test_the_newest_step_that_passes_is_read_and_nothing_is_said(storage):
    read, tried = _reader()
    resumed = _resume.newest(storage, read, _no_plain, on_damaged="fall_back")
    assert (resumed.value, resumed.step, resumed.source) == ("value of 4", 4, "jax_cb_ckpt")
    assert resumed.passed == () and tried == [4]
    assert _resume.report(storage, resumed, set_aside=True) is resumed  # no warning


def test_damaged_newer_steps_are_passed_over_and_named_with_why(storage):
    _damage_description(storage, 4)
    read, tried = _reader(bad={3})
    resumed = _resume.newest(storage, read, _no_plain, on_damaged="fall_back")
    assert resumed.step == 2 and resumed.value == "value of 2"
    assert tried == [3, 2]  # a damaged description is never read
    assert [p.step for p in resumed.passed] == [4, 3]
    assert "meta/metadata" in resumed.passed[0].why
    assert resumed.passed[1].why == "bit flipped in 3"
    assert isinstance(resumed.error, DamagedStepError) and "step 4" in str(resumed.error)
    with pytest.warns(
        DamagedStepWarning,
        match=r"^restart: read step 2 of .*passing over 2 newer step\(s\): step 4: .*\(left in "
        r"place\); step 3: bit flipped in 3 \(left in place\)\. Nothing was deleted",
    ):
        _resume.report(storage, resumed, set_aside=False)
    assert {"1", "2", "3", "4"} <= set(os.listdir(storage.path))  # nothing moved


def test_report_sets_the_passed_over_steps_aside_when_asked(storage):
    read, _ = _reader(bad={4, 3})
    resumed = _resume.newest(storage, read, _no_plain, on_damaged="fall_back")
    with pytest.warns(DamagedStepWarning, match=r"set aside as .*the run can write that step"):
        resumed = _resume.report(storage, resumed, set_aside=True)
    names = [p.set_aside for p in resumed.passed]
    assert all(names) and all(os.path.exists(os.path.join(storage.path, n)) for n in names)
    assert jax_cb_ckpt.all_steps(storage.path) == [1, 2]


def test_another_error_is_raised_as_it_is(storage):
    read, tried = _reader(other={4})
    with pytest.raises(RestoreError, match="storage out of reach"):
        _resume.newest(storage, read, _no_plain, on_damaged="fall_back")
    assert tried == [4]


def test_on_damaged_raise_stops_at_the_first_damaged_step(storage):
    read, tried = _reader(bad={4})
    with pytest.raises(DamagedStepError, match=r"step 4 flipped \(on_damaged='raise'") as info:
        _resume.newest(storage, read, _no_plain, on_damaged="raise")
    assert info.value.why == "bit flipped in 4"
    assert tried == [4]


def test_no_passing_step_gives_a_refusal_naming_every_one(storage):
    read, _ = _reader(bad={1, 2, 3, 4})
    resumed = _resume.newest(storage, read, _no_plain, on_damaged="fall_back")
    assert resumed.value is None and resumed.step is None
    refusal = resumed.refusal()
    assert str(refusal).startswith("step 4 flipped No older step passes its checks either")
    assert "step 3: bit flipped in 3; step 2: bit flipped in 2; step 1: bit flipped in 1" in str(
        refusal
    )
    with pytest.warns(DamagedStepWarning, match="starts from its initial state"):
        _resume.report(storage, resumed, set_aside=False)


def test_older_damaged_steps_are_said_and_left_alone(storage):
    _damage_description(storage, 1)
    read, _ = _reader()
    resumed = _resume.newest(storage, read, _no_plain, on_damaged="fall_back")
    assert resumed.step == 4 and [p.step for p in resumed.older] == [1]
    with pytest.warns(DamagedStepWarning, match=r"read step 4 .*1 older step folder\(s\)"):
        _resume.report(storage, resumed, set_aside=True)
    assert os.path.isdir(os.path.join(storage.path, "1"))


@pytest.mark.parametrize("value", ["fallback", None, True])
def test_on_damaged_must_be_one_of_its_values(value):
    with pytest.raises(ConfigError, match=r"restore\(on_damaged=.*must be one of \('fall_back', "):
        _resume.check_on_damaged(value, "restore")
    _resume.check_on_damaged("raise", "restore")
