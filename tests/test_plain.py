"""`_read/_plain.py`: plain Orbax steps beside ours. A `CheckpointManager`'s step is
found (`steps`) with its pytree item, one with no pytree item or several is found with
the problem said; `restore` checks it against `like` leaf by leaf before reading (a
missing, extra, reshaped or recast leaf is a `StructureMismatchError` naming it: Orbax
would cast silently), reads it into `like`'s types, refuses `member=`, and never
changes the step."""

import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from jax_cb_ckpt import ConfigError, DamagedStepError, StructureMismatchError
from jax_cb_ckpt._base._errors import calling
from jax_cb_ckpt._read import _plain
from jax_cb_ckpt._read._request import Request
from jax_cb_ckpt._storage import _places


@pytest.fixture(autouse=True)
def _restore():
    """Messages name the public call under way (`calling`), as `restore` sets it."""
    with calling("restore"):
        yield


STATE = {"w": np.arange(3, dtype=np.float32), "n": np.int32(7), "k": {"b": np.ones((2, 2))}}


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    directory = tmp_path_factory.mktemp("plain") / "orbax"
    with ocp.CheckpointManager(directory) as manager:
        manager.save(3, args=ocp.args.StandardSave(STATE))
        manager.save(5, args=ocp.args.StandardSave({**STATE, "w": STATE["w"] + 10}))
    return directory


@pytest.fixture
def storage(written, tmp_path):
    copy = tmp_path / "orbax"
    shutil.copytree(written, copy)
    return _places.at(str(copy))


def _found(storage):
    return _plain.steps(storage, storage.examine_all())


def test_a_managers_steps_are_found_with_their_item(storage):
    found = _found(storage)
    assert sorted(found) == [3, 5]
    assert found[5].item == "default" and found[5].problem is None
    assert found[5].path == os.path.join(storage.path, "5")


def test_the_step_is_read_into_likes_types_and_left_unchanged(storage):
    before = sorted(os.walk(storage.path))
    like = {"w": jnp.zeros(3), "n": np.int32(0), "k": {"b": np.zeros((2, 2))}}
    out = _plain.restore(_found(storage)[5], Request.of(like))
    assert isinstance(out["w"], jax.Array) and out["w"].dtype == jnp.float32
    np.testing.assert_array_equal(out["w"], [10, 11, 12])
    assert type(out["n"]) is np.int32 and out["n"] == 7
    assert type(out["k"]["b"]) is np.ndarray
    assert sorted(os.walk(storage.path)) == before


@pytest.mark.parametrize(
    "like, match",
    [
        (
            {"w": np.zeros(3, np.int32), "n": np.int32(0), "k": {"b": np.zeros((2, 2))}},
            r"leaf like\['w'\] differs: the step holds float32\[3\], like has int32\[3\] "
            r"\(Orbax would cast it silently",
        ),
        (
            {"w": np.zeros(4, np.float32), "n": np.int32(0), "k": {"b": np.zeros((2, 2))}},
            r"leaf like\['w'\] differs: the step holds float32\[3\], like has float32\[4\]",
        ),
        (
            {"w": np.zeros(3, np.float32), "n": np.int32(0), "k": {"c": np.zeros((2, 2))}},
            r"leaf like\['k'\]\['c'\] \(float64\[2,2\]\) is not in it",
        ),
        (
            {"w": np.zeros(3, np.float32), "n": np.int32(0)},
            r"it holds leaf 'k/b', which like does not have",
        ),
    ],
)
def test_a_like_that_differs_is_refused_naming_the_leaf(storage, like, match):
    with pytest.raises(StructureMismatchError, match=r"^restore: plain Orbax step 3 .*" + match):
        _plain.restore(_found(storage)[3], Request.of(like))


def test_member_is_refused():
    found = _plain.PlainStep(3, "default", "/nowhere/3")
    with pytest.raises(ConfigError, match="a plain Orbax step records no batch"):
        _plain.restore(found, Request.of({}), member=0)


def test_a_step_with_several_pytree_items_is_found_with_its_problem(tmp_path):
    directory = tmp_path / "two"
    with ocp.CheckpointManager(directory, item_names=("a", "b")) as manager:
        manager.save(
            1,
            args=ocp.args.Composite(
                a=ocp.args.StandardSave({"x": np.ones(2)}),
                b=ocp.args.StandardSave({"y": np.ones(2)}),
            ),
        )
    storage = _places.at(str(directory))
    found = _found(storage)[1]
    assert "several pytree items ['a', 'b']" in found.problem
    with pytest.raises(
        DamagedStepError,
        match=r"cannot be resumed from: a plain Orbax step "
        r"with several pytree items",
    ):
        _plain.restore(found, Request.of({"x": np.ones(2)}))


def test_a_folder_that_is_not_orbaxs_is_not_found(storage):
    other = os.path.join(storage.path, "9")
    os.mkdir(other)
    with open(os.path.join(other, "_CHECKPOINT_METADATA"), "w") as f:
        f.write('{"not": "orbax"}')
    assert sorted(_found(storage)) == [3, 5]
