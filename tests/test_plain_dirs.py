"""Plain Orbax directories are first-class (issue 52 item 4), numbers Orbax stored are
adopted (issue 53 item 2), and a step of ours is whole only when plain Orbax can read
it (issue 53 item 8, first bullet).

On a directory of `CheckpointManager` steps, `latest_step()` was None and
`all_steps()` [] while `restore_or_init` resumed from the newest, and
`restore(step=200)` was refused: every entry point now agrees (one recognition,
`_read/_plain.py`): listed, marked as Orbax's, read unverified, never deleted. Each
test was seen failing on the code before these changes."""

import json
import os
import re
import shutil
import sys
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from helpers import run_child
from test_cli import cli

import jax_cb_ckpt
from jax_cb_ckpt import (
    DamagedStepError,
    DamagedStepWarning,
    StepExistsError,
    StructureMismatchError,
)
from jax_cb_ckpt._layout import _format

LIKE = {"w": np.zeros(3, np.float32)}


def _orbax_steps(directory, steps=(100, 200, 300)):
    """A directory of plain Orbax steps, each `w` full of its step."""
    with ocp.CheckpointManager(directory) as manager:
        for step in steps:
            manager.save(step, args=ocp.args.StandardSave({"w": np.full(3, step, np.float32)}))
    return directory


def _files(directory):
    """{relative path: bytes} of every file under `directory`."""
    return {
        os.path.relpath(os.path.join(root, name), directory): Path(root, name).read_bytes()
        for root, _, names in os.walk(directory)
        for name in names
    }


@pytest.fixture(scope="module")
def plain_dir(tmp_path_factory):
    return _orbax_steps(tmp_path_factory.mktemp("plain") / "orbax")


@pytest.fixture
def plain(plain_dir, tmp_path):
    copy = tmp_path / "orbax"
    shutil.copytree(plain_dir, copy)
    return copy


# -- issue 52 item 4: one test per entry point ---------------------------------------------


def test_all_steps_and_latest_step_list_plain_orbax_steps(plain):
    """They said [] and None (a script checking `latest_step() is None` re-initialised
    beside step 300). A plain step a restart cannot read (two pytree items) stays out."""
    with ocp.CheckpointManager(plain, item_names=("a", "b")) as manager:
        tree = ocp.args.StandardSave({"w": np.ones(3)})
        manager.save(400, args=ocp.args.Composite(a=tree, b=tree))
    assert jax_cb_ckpt.all_steps(plain) == [100, 200, 300]
    assert jax_cb_ckpt.latest_step(plain) == 300


def test_restore_of_a_named_plain_step(plain):
    """It was refused ("not complete jax_cb_ckpt checkpoints")."""
    restored = jax_cb_ckpt.restore(plain, LIKE, step=200)
    np.testing.assert_array_equal(restored["w"], 200.0)
    with pytest.raises(jax_cb_ckpt.NoCheckpointError, match=r"steps there are \[100, 200, 300\]"):
        jax_cb_ckpt.restore(plain, LIKE, step=250)


def test_restore_without_step_reads_the_latest_step(plain):
    restored = jax_cb_ckpt.restore(plain, LIKE)
    np.testing.assert_array_equal(restored["w"], jax_cb_ckpt.latest_step(plain))


def test_metadata_and_metrics_mark_a_plain_step_as_orbaxs(tmp_path):
    d = tmp_path / "plain"
    options = ocp.CheckpointManagerOptions(best_fn=lambda m: m["loss"], best_mode="min")
    with ocp.CheckpointManager(d, options=options) as manager:
        manager.save(5, args=ocp.args.StandardSave({"w": np.ones(2)}), metrics={"loss": 0.5})
    meta = jax_cb_ckpt.metadata(d)
    assert meta["format"] == "orbax" and meta["step"] == 5 and meta["item"] == "default"
    assert meta["checksums"] is None and meta["leaf_names"] == [["w"]]
    assert meta["saved_at"].endswith("+00:00") and "item_handlers" in meta["orbax"]
    assert jax_cb_ckpt.metadata(d, step=5) == meta
    assert jax_cb_ckpt.metrics(d, step=5) == {"loss": 0.5}


def test_ls_and_show_mark_plain_steps_as_listed(plain):
    listed = json.loads(cli("ls", plain, "--json").stdout)["steps"]
    assert [(r["step"], r["complete"], r["plain_orbax"]) for r in listed] == [
        (100, True, "resumable"),
        (200, True, "resumable"),
        (300, True, "resumable"),
    ]
    assert all(r["saved_at"] for r in listed)
    shown = cli("show", plain)
    assert shown.returncode == 0, shown.stderr
    assert "step 300 of" in shown.stdout and "a plain Orbax step" in shown.stdout
    assert "checksums     none (Orbax keeps none): read with Orbax, unverified" in shown.stdout
    described = json.loads(cli("show", plain, "--step", "100", "--json").stdout)
    assert described["format"] == "orbax" and described["step"] == 100


def test_verify_reads_plain_steps_and_says_they_are_not_verified(plain):
    """`verify` said "no checkpoint" (exit 2): now each plain step is read whole with
    Orbax and said unverified (exit 3, as a step without checksums); a cut step fails."""
    assert jax_cb_ckpt.verify(plain) == [100, 200, 300]
    assert jax_cb_ckpt.verify(plain, step=200) == [200]
    run = cli("verify", plain)
    assert run.returncode == 3, run.stdout + run.stderr
    assert "step 300: a plain Orbax step, read whole with Orbax: readable, NOT verified" in (
        run.stdout
    )
    for data in (plain / "200" / "default" / "d").iterdir():
        data.unlink()  # its arrays' files: cut
    with pytest.raises((DamagedStepError, jax_cb_ckpt.RestoreError), match="plain Orbax step 200"):
        jax_cb_ckpt.verify(plain)
    assert cli("verify", plain).returncode == 1


def test_retention_never_deletes_plain_steps(plain):
    """max_to_keep=1 over plain steps 100-300: they stay, bit for bit, and listed."""
    before = _files(plain)
    with jax_cb_ckpt.Checkpointer(plain, max_to_keep=1) as ckpt:
        state, start = ckpt.restore_or_init(lambda: LIKE)
        assert start == 300
        for step in (400, 500, 600):
            ckpt.save({"w": state["w"] + step}, step)
    assert jax_cb_ckpt.all_steps(plain) == [100, 200, 300, 600]
    assert {p: b for p, b in _files(plain).items() if p in before} == before


def test_a_checkpointer_on_plain_steps_lists_them_and_saves_above_them(plain):
    with jax_cb_ckpt.Checkpointer(plain) as ckpt:
        assert ckpt.latest_step() == 300 and ckpt.all_steps() == [100, 200, 300]
        ckpt.save({"w": np.ones(3, np.float32)}, 400)
        ckpt.wait()
        assert ckpt.latest_step() == 400
        with pytest.raises(StepExistsError):
            ckpt.save({"w": np.ones(3, np.float32)}, 300)  # Orbax's step: another run's
    with jax_cb_ckpt.Checkpointer(plain) as ckpt:
        restored = ckpt.restore(LIKE, step=200)  # the run goes on from 200: 300 is in the way
        np.testing.assert_array_equal(restored["w"], 200.0)
        with pytest.raises(StepExistsError):
            ckpt.save({"w": np.ones(3, np.float32)}, 250)
            ckpt.wait()


def test_a_save_below_a_plain_step_says_it_is_orbax_s_and_to_save_above_it(plain):
    """The refusal suggested on_existing='replace', which cannot delete Orbax's step
    (the library never deletes one): it says the step is Orbax's and to save above it."""
    before = _files(plain)
    with jax_cb_ckpt.Checkpointer(plain) as ckpt:
        with pytest.raises(StepExistsError) as raised:
            ckpt.save({"w": np.ones(3, np.float32)}, 250)
        text = str(raised.value)
        assert "of which 300 is a plain Orbax step" in text, text
        assert "Fix: save above step 300" in text, text
        assert "create the Checkpointer with on_existing='replace'" not in text, text
        ckpt.restore(LIKE, step=200)  # a resumed run's counter that started again
        with pytest.raises(StepExistsError) as raised:
            ckpt.save({"w": np.ones(3, np.float32)}, 150)
        text = str(raised.value)
        assert "Step(s) 200, 300 there are plain Orbax steps" in text, text
        assert "create the Checkpointer with on_existing='replace'" not in text, text
    assert {p: b for p, b in _files(plain).items() if p in before} == before


def test_replace_below_a_plain_step_is_refused_as_it_cannot_make_room(plain):
    """on_existing='replace' saved step 250 below Orbax's step 300 without a word: the
    directory then held 250 and 300, and the next restart resumed from the other run's
    300. Orbax's steps are never deleted, so replace cannot make room: refused."""
    before = _files(plain)
    with jax_cb_ckpt.Checkpointer(plain, on_existing="replace") as ckpt:
        with pytest.raises(StepExistsError, match="of which 300 is a plain Orbax step"):
            ckpt.save({"w": np.ones(3, np.float32)}, 250)
        ckpt.save({"w": np.ones(3, np.float32)}, 301)  # above it: saved
    assert {p: b for p, b in _files(plain).items() if p in before} == before
    assert 250 not in jax_cb_ckpt.all_steps(plain)


# -- issue 53 item 2: numbers Orbax stored --------------------------------------------------


def _scalars(directory, **leaves):
    """A plain Orbax step 20 of `PyTreeSave`: numbers Orbax stores as numbers."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (Orbax's own about PyTreeSave's options)
        with ocp.CheckpointManager(directory) as manager:
            manager.save(20, args=ocp.args.PyTreeSave({"w": np.ones(3, np.float32), **leaves}))
    return directory


SCALARS = {"n": np.int32(20), "f": np.float32(0.1), "b": True}
SCALAR_LIKE = {"w": np.zeros(3, np.float32), "n": np.int32(0), "f": np.float32(0), "b": False}


@pytest.mark.parametrize("entry", ["restore", "restore_step", "restore_or_init"])
def test_numpy_scalars_a_plain_step_holds_restore_in_likes_dtypes(tmp_path, entry):
    """Orbax reads np.int32(20) back as a Python 20 (int64 once an array): restore
    said "leaf like['n'] is described as int32[] and holds int64[]", and the restart
    started at 0, its first save then failing with StepExistsError."""
    d = _scalars(tmp_path / "plain", **SCALARS)
    if entry == "restore_or_init":
        with jax_cb_ckpt.Checkpointer(d) as ckpt:
            restored, start = ckpt.restore_or_init(lambda: SCALAR_LIKE, like=SCALAR_LIKE)
            assert start == 20
            ckpt.save(restored, 21)
        assert jax_cb_ckpt.all_steps(d) == [20, 21]
    else:
        step = 20 if entry == "restore_step" else None
        restored = jax_cb_ckpt.restore(d, SCALAR_LIKE, step=step)
    assert type(restored["n"]) is np.int32 and restored["n"] == 20
    assert type(restored["f"]) is np.float32 and restored["f"] == np.float32(0.1)
    assert restored["b"] is True


@pytest.mark.parametrize(
    "saved, like, shown",
    [
        (2**40, np.int32(0), "1099511627776, which like's int32[]"),
        (0.1, np.float32(0), "0.1, which like's float32[]"),  # a float64 that float32 lacks
        (1e300, jax.ShapeDtypeStruct((), jnp.float32), "1e+300, which like's float32[]"),
        (np.int32(2**20), np.int16(0), "1048576, which like's int16[]"),
        (np.float32(0.1), np.float16(0), "0.10000000149011612, which like's float16[]"),
    ],
)
def test_a_number_that_like_cannot_hold_exactly_is_refused_naming_it(tmp_path, saved, like, shown):
    """Exactly: the number cast to like's dtype and back is the same number. Before,
    numbers stored as numpy scalars were "damaged" (DamagedStepError) and 1e300
    leaked numpy's "overflow encountered in cast" RuntimeWarning."""
    d = _scalars(tmp_path / "plain", n=saved)
    with pytest.raises(StructureMismatchError, match=r"leaf like\['n'\]: .* " + re.escape(shown)):
        jax_cb_ckpt.restore(d, {"w": np.zeros(3, np.float32), "n": like})


# -- issue 53 item 8: what plain Orbax needs of a step of ours --------------------------------


def _tree_metadata(text):
    content = json.loads(text)
    return content, content["tree_metadata"]


def _drop_a_leaf(text):
    content, tree = _tree_metadata(text)
    del tree["('b',)"]
    return json.dumps(content)


def _zarr3(text):
    return json.dumps(dict(json.loads(text), use_zarr3=True))


def _unknown_type(text):
    content, tree = _tree_metadata(text)
    tree["('w',)"]["value_metadata"]["value_type"] = "made.up"
    return json.dumps(content)


DAMAGES = [
    (lambda text: "garbage", "is not valid JSON"),
    (lambda text: "{}", "has no 'tree_metadata' object"),
    (_drop_a_leaf, "does not describe leaf 'b'"),
    (_zarr3, "use_zarr3=True"),
    (_unknown_type, "entry of leaf 'w' is not one plain Orbax reads"),
]


def _damaged(d, damage):
    """Steps 1 and 2 of ours in `d`, step 2's `state/_METADATA` changed by `damage`."""
    with jax_cb_ckpt.Checkpointer(d) as ckpt:
        for step in (1, 2):
            ckpt.save({"w": np.full(3, step, np.float32), "b": np.int32(step)}, step)
    path = d / "2" / _format.STATE_ITEM / _format.STATE_METADATA
    path.write_text(damage(path.read_text()))
    return d


_ORBAX_READS = """
import sys, orbax.checkpoint as ocp
for item in sys.argv[1:]:
    try:
        read = sorted(ocp.PyTreeCheckpointer().restore(item))
    except Exception as e:
        read = type(e).__name__
    print("READ", read)
"""


def test_plain_orbax_cannot_read_a_step_with_such_a_state_description(tmp_path):
    """What the check below refuses, plain Orbax fails to read, or reads without a leaf
    (in a child process: Orbax's failed reads leave coroutines behind)."""
    items = [
        _damaged(tmp_path / str(i), damage) / "2" / "state" for i, (damage, _) in enumerate(DAMAGES)
    ]
    script = tmp_path / "read.py"
    script.write_text(_ORBAX_READS)
    run = run_child([sys.executable, script, *items], timeout=120)
    read = [line for line in run.stdout.splitlines() if line.startswith("READ")]
    assert len(read) == len(DAMAGES) and "READ ['b', 'w']" not in read, run.stdout + run.stderr


@pytest.mark.parametrize("damage, why", DAMAGES)
def test_a_state_description_plain_orbax_cannot_read_fails_verify_and_the_restart(
    tmp_path, damage, why
):
    """Garbage in `state/_METADATA` passed verify and restored, while plain Orbax could
    no longer read the step. Now verify fails (function and CLI: exit 1) and a restart
    passes over it; a named restore still reads the arrays (checked by checksum)."""
    d = _damaged(tmp_path / "ckpt", damage)
    with pytest.raises(DamagedStepError, match=r"verify\(step=2\).*_METADATA.*" + why):
        jax_cb_ckpt.verify(d)
    run = cli("verify", d)
    assert run.returncode == 1 and "step 2: FAILED" in run.stdout, run.stdout + run.stderr
    like = {"w": np.zeros(3, np.float32), "b": np.int32(0)}
    with pytest.warns(DamagedStepWarning, match=r"read step 1 .*step 2: .*" + why):
        assert jax_cb_ckpt.restore(d, like)["b"] == 1
    assert jax_cb_ckpt.restore(d, like, step=2)["b"] == 2


def test_the_check_accepts_what_orbax_itself_writes(tmp_path):
    """Older versions wrote their steps through Orbax: its `_METADATA` passes."""
    tree = {"a": np.ones(2, np.float32), "b": {"c": np.zeros(3)}, "n": 3, "e": {}, "z": None}
    ocp.PyTreeCheckpointer().save(tmp_path / "item", tree)
    text = (tmp_path / "item" / "_METADATA").read_bytes()
    names = [("a",), ("b", "c"), ("n",)]
    _format.check_state_metadata(text, names, names)
    with pytest.raises(_format.DamagedStep, match="does not describe leaf 'x'"):
        _format.check_state_metadata(text, [*names, ("x",)], [*names, ("x",)])


def test_show_and_ls_of_a_directory_of_one_plain_step_run_as_a_user_runs_them(plain):
    """(The CLI without JAX: `ls` and `show` of plain steps read JSON only.)"""
    probe = (
        "import sys; sys.argv = ['jax-cb-ckpt', *sys.argv[1:]]\n"
        "from jax_cb_ckpt._cli._main import main\n"
        "main()\n"
        "print('HEAVY', [m for m in ('jax', 'orbax.checkpoint') if m in sys.modules])\n"
    )
    for args in (["ls", str(plain)], ["show", str(plain)]):
        run = run_child([sys.executable, "-c", probe, *args], timeout=120)
        assert "HEAVY []" in run.stdout, run.stdout + run.stderr
