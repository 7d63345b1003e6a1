"""What a Checkpointer may touch: only its own directory (never through a link, never
outside it), only its own complete steps, with one writer per directory; a step of
another run is never mixed with this run's, and every function takes the same path
forms. Each test failed before its fix (adversarial testing)."""

import json
import os
import random
import shutil
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from helpers import kill_group, run_child, start_script, state_at

import jax_cb_ckpt
from jax_cb_ckpt import (
    ConfigError,
    DirectoryLockedError,
    InvalidStateError,
    NoCheckpointError,
    RestoreError,
    SaveError,
    StepExistsError,
)


def victim(tmp_path):
    """A folder outside the checkpoint directory that must survive everything."""
    outside = tmp_path / "outside"
    (outside / "precious").mkdir(parents=True)
    (outside / "precious" / "data.txt").write_text("keep me")
    (outside / "3").mkdir()  # looks like a step
    (outside / "notes.txt").write_text("keep me too")
    return outside


def assert_victim_intact(outside):
    assert (outside / "precious" / "data.txt").read_text() == "keep me"
    assert (outside / "notes.txt").read_text() == "keep me too"
    assert (outside / "3").is_dir()


# -- nothing outside the directory is ever deleted, renamed or written ----------------


@pytest.mark.parametrize("target", ["absolute", "relative"])
def test_planted_symlinks_never_lead_outside(tmp_path, ckpt_dir, target):
    outside = victim(tmp_path)
    ckpt_dir.mkdir()
    link = str(outside) if target == "absolute" else os.path.relpath(outside, ckpt_dir)
    # The old deleted-steps folder, our temporary and deleting names, Orbax's temporary
    # name and a step number: every one a symlink to the victim.
    planted = [
        "_jax_cb_ckpt_deleted",
        "3.jax_cb_ckpt-tmp-" + "a" * 32,
        "4.jax_cb_ckpt-deleting-" + "b" * 32,
        "5.orbax-checkpoint-tmp-123",
        "9",
    ]
    for name in planted:
        os.symlink(link, ckpt_dir / name)
    (ckpt_dir / "..link").symlink_to("..")
    ckpt = jax_cb_ckpt.Checkpointer(ckpt_dir, max_to_keep=1)
    for step in (1, 2, 6, 7):
        ckpt.save(state_at(step), step)
    ckpt.close()
    assert_victim_intact(outside)
    assert sorted(os.listdir(outside)) == ["3", "notes.txt", "precious"]
    for name in planted:
        assert os.path.islink(ckpt_dir / name), name
    assert jax_cb_ckpt.all_steps(ckpt_dir) == [7]  # the link named 9 is not a step
    assert int(jax_cb_ckpt.restore(ckpt_dir, state_at(0))["step"]) == 7


def test_symlinked_lock_file_is_refused_not_followed(tmp_path, ckpt_dir):
    outside = victim(tmp_path)
    ckpt_dir.mkdir()
    os.symlink(outside / "notes.txt", ckpt_dir / ".jax_cb_ckpt.lock")
    with pytest.raises(DirectoryLockedError, match=r"cannot open the lock file"):
        jax_cb_ckpt.Checkpointer(ckpt_dir)
    assert_victim_intact(outside)


@pytest.mark.parametrize("kind", ["hard link", "fifo"])
def test_lock_file_that_is_not_our_own_file_is_refused(tmp_path, ckpt_dir, kind):
    outside = victim(tmp_path)
    ckpt_dir.mkdir()
    lock = ckpt_dir / ".jax_cb_ckpt.lock"
    if kind == "hard link":
        os.link(outside / "notes.txt", lock)  # writing the lock would write the victim
    else:
        os.mkfifo(lock)  # opening it must not block
    with pytest.raises(DirectoryLockedError, match=r"not a plain file of its own"):
        jax_cb_ckpt.Checkpointer(ckpt_dir)
    assert_victim_intact(outside)


@pytest.mark.parametrize("planted", ["undeletable report", "set-aside note"])
def test_a_fifo_planted_where_a_small_file_is_read_blocks_no_reader(ckpt_dir, planted):
    # A FIFO opened for reading blocks until someone writes to it: the retention
    # report (read by the writer and `ls`) and a set-aside step's note (read by `ls`)
    # are read as regular files or not at all.
    with jax_cb_ckpt.Checkpointer(ckpt_dir, max_to_keep=2) as ckpt:
        ckpt.save({"w": np.full(3, 1)}, 1)
    if planted == "undeletable report":
        os.mkfifo(ckpt_dir / ".jax_cb_ckpt-undeletable.json")
    else:
        aside = ckpt_dir / ("7.jax_cb_ckpt-damaged-" + "a" * 32)
        aside.mkdir()
        os.mkfifo(aside / ".jax_cb_ckpt-set-aside.json")
    listed = run_child(["python", "-m", "jax_cb_ckpt", "ls", ckpt_dir], timeout=120)
    assert listed.returncode == 0 and "complete" in listed.stdout, listed.stderr
    saves = (
        "import sys, numpy as np, jax_cb_ckpt\n"
        "with jax_cb_ckpt.Checkpointer(sys.argv[1], max_to_keep=2) as ckpt:\n"
        "    for step in (2, 3, 4):\n"
        "        ckpt.save({'w': np.full(3, step)}, step)\n"
    )
    saved = run_child(["python", "-c", saves, ckpt_dir], timeout=120)
    assert saved.returncode == 0, saved.stderr
    assert jax_cb_ckpt.all_steps(ckpt_dir) == [3, 4]


@pytest.mark.parametrize("key", ["\u00b2", "9" * 5000])
def test_a_crafted_retention_report_fails_no_save(ckpt_dir, key):
    # The report of undeletable steps is read back at the first retention of a run;
    # a key `str.isdigit` takes but `int` refuses (a superscript two, 5,000 digits)
    # failed every save of the run.
    with jax_cb_ckpt.Checkpointer(ckpt_dir, max_to_keep=2) as ckpt:
        ckpt.save({"w": np.full(3, 1)}, 1)
    report = {key: "planted", "1": "planted"}
    (ckpt_dir / ".jax_cb_ckpt-undeletable.json").write_text(json.dumps(report))
    with jax_cb_ckpt.Checkpointer(ckpt_dir, max_to_keep=2) as ckpt:
        for step in (2, 3, 4):
            ckpt.save({"w": np.full(3, step)}, step)
    assert jax_cb_ckpt.all_steps(ckpt_dir) == [3, 4]


def test_plain_orbax_checkpoint_with_our_item_names_is_not_ours(make_ckpt, ckpt_dir):
    with ocp.CheckpointManager(ckpt_dir) as manager:  # a user's own Orbax checkpoint
        manager.save(
            1,
            args=ocp.args.Composite(
                state=ocp.args.PyTreeSave({"w": np.ones(3)}), meta=ocp.args.JsonSave({"a": 1})
            ),
        )
    before = _files(ckpt_dir / "1")
    ckpt = make_ckpt(max_to_keep=1)
    assert ckpt.all_steps() == [1]  # listed as the plain Orbax step it is (not ours)
    assert ckpt.metadata(step=1)["format"] == "orbax"
    ckpt.save(state_at(2), 2)
    ckpt.save(state_at(3), 3)
    ckpt.wait()
    assert ckpt.all_steps() == [1, 3]
    assert _files(ckpt_dir / "1") == before  # never deleted by retention


def test_symlinks_inside_a_step_are_never_read_through(tmp_path, make_ckpt, ckpt_dir):
    outside = victim(tmp_path)
    ckpt = make_ckpt()
    for step in (1, 2, 3):
        ckpt.save(state_at(step), step)
    ckpt.close()
    shutil.rmtree(ckpt_dir / "1" / "meta")
    os.symlink(outside, ckpt_dir / "1" / "meta")  # the item itself
    meta = ckpt_dir / "2" / "meta" / "metadata"
    meta.unlink()
    os.symlink(outside / "notes.txt", meta)  # the JSON file
    with pytest.warns(jax_cb_ckpt.DamagedStepWarning, match=r"step 1: .*step 2: "):
        assert jax_cb_ckpt.all_steps(ckpt_dir) == [3]
    data = next((ckpt_dir / "3" / "state").glob("**/manifest.ocdbt"))
    data.rename(outside / "manifest.ocdbt")
    os.symlink(outside / "manifest.ocdbt", data)  # deep inside the arrays
    # Every step is damaged: the newest one's error, naming the others.
    with pytest.raises(RestoreError, match=r"contains symlinks.*step 2: .*step 1: "):
        jax_cb_ckpt.restore(ckpt_dir, state_at(0))
    assert_victim_intact(outside)


def test_retention_deletes_only_our_checkpoints(make_ckpt, ckpt_dir):
    ckpt_dir.mkdir()
    for name in ("2023", "2024"):
        (ckpt_dir / name).mkdir()
        (ckpt_dir / name / "results.csv").write_text("1,2,3")
    ckpt = make_ckpt(max_to_keep=2)
    for step in range(1, 6):
        ckpt.save(state_at(step), step)
    ckpt.wait()
    assert ckpt.all_steps() == [4, 5]
    for name in ("2023", "2024"):
        assert (ckpt_dir / name / "results.csv").read_text() == "1,2,3"


# -- a complete checkpoint is never removed to write another; one writer a directory --


def test_second_writer_in_process_is_refused(make_ckpt, ckpt_dir):
    first = make_ckpt()
    with pytest.raises(DirectoryLockedError, match=r"another Checkpointer in this process"):
        jax_cb_ckpt.Checkpointer(ckpt_dir)
    first.close()
    second = make_ckpt()  # released by close()
    second.save(state_at(1), 1)
    second.wait()


HOLDER = """
import sys, time
import jax_cb_ckpt
ckpt = jax_cb_ckpt.Checkpointer(sys.argv[1])
print("holding", flush=True)
time.sleep(120)
"""


def test_second_writer_process_is_refused_until_the_first_dies(tmp_path, ckpt_dir):
    child = start_script(tmp_path, HOLDER, ckpt_dir, ready="holding")
    try:
        with pytest.raises(DirectoryLockedError, match=rf"another live writer .*pid {child.pid}"):
            jax_cb_ckpt.Checkpointer(ckpt_dir)
    finally:
        kill_group(child)
    with jax_cb_ckpt.Checkpointer(ckpt_dir) as ckpt:  # the kernel dropped the dead lock
        ckpt.save(state_at(1), 1)
    assert jax_cb_ckpt.all_steps(ckpt_dir) == [1]


def _files(directory):
    out = {}
    for root, _, files in os.walk(directory):
        for name in files:
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, directory)] = f.read()
    return out


def test_existing_step_of_another_run_is_refused_untouched(make_ckpt, ckpt_dir):
    first = make_ckpt()
    for step in (1, 2, 3):
        first.save(state_at(step), step)
    first.close()
    before = _files(ckpt_dir / "2")
    second = make_ckpt()
    with pytest.raises(StepExistsError, match=r"saving step 2 to .*step\(s\) 2, 3 >= 2"):
        second.save(state_at(99), 2)  # a rerun from an earlier step
    with pytest.raises(Exception, match=r"StepExistsError: saving step 3"):  # JAX's wrapper
        jax.jit(lambda s: second.save(s, 3))(state_at(98))
        jax.effects_barrier()
    with pytest.raises(StepExistsError, match=r"on_existing='replace'"):  # ours, kept
        second.wait()
    second.save(state_at(4), 4)  # after the latest: fine
    second.close()
    assert jax_cb_ckpt.all_steps(ckpt_dir) == [1, 2, 3, 4]
    assert _files(ckpt_dir / "2") == before


def test_replace_removes_the_other_runs_later_steps(make_ckpt, ckpt_dir):
    first = make_ckpt()
    for step in (1, 2, 3, 4):
        first.save(state_at(step), step)
    first.close()
    second = make_ckpt(on_existing="replace")
    second.save(state_at(20), 2)
    second.wait()
    assert second.all_steps() == [1, 2]  # 3 and 4 belonged to the other run
    assert int(second.restore(state_at(0))["step"]) == 20
    second.save(state_at(30), 3)  # after restoring step 2: the new run goes on
    second.wait()
    assert second.all_steps() == [1, 2, 3]


def test_restore_of_an_earlier_step_then_saving_is_a_conflict(make_ckpt):
    ckpt = make_ckpt(every=1)
    for step in range(5):
        ckpt.save(state_at(step), step)
    ckpt.restore(state_at(0), step=2)
    with pytest.raises(StepExistsError, match=r"step\(s\) 3, 4 >= 3"):
        ckpt.save(state_at(3), 3)


REPLACER = """
import sys
import numpy as np
import jax_cb_ckpt
directory = sys.argv[1]
ckpt = jax_cb_ckpt.Checkpointer(directory, on_existing="replace", queue_size=1)
print("ready", flush=True)
for round in range(1000):
    for step in range(10, 40, 5):
        ckpt.save({"x": np.full(1 << 20, 1000.0 * round + step)}, step)
    ckpt.restore({"x": np.zeros(1 << 20)}, step=5)  # rewind: the next round replaces
"""


def _old_run(directory):
    with jax_cb_ckpt.Checkpointer(directory) as ckpt:
        for step in range(0, 40, 5):
            ckpt.save({"x": np.full(1 << 20, float(step))}, step)


def _kill_replacer_at(tmp_path, directory, delay):
    child = start_script(tmp_path, REPLACER, directory, ready="ready")
    try:
        time.sleep(delay)
    finally:
        kill_group(child)
    steps = jax_cb_ckpt.all_steps(directory)
    assert steps[:2] == [0, 5]  # before the replaced range: never touched
    for step in steps:
        x = jax_cb_ckpt.restore(directory, {"x": np.zeros(1 << 20)}, step=step)["x"]
        assert x[0] % 1000 == step and (x == x[0]).all(), (step, x[0])
    with jax_cb_ckpt.Checkpointer(directory) as ckpt:  # reopens: leftovers cleaned
        assert ckpt.all_steps() == steps
    assert sorted(os.listdir(directory)) == sorted([str(s) for s in steps] + [".jax_cb_ckpt.lock"])


def _kills_while_replacing(tmp_path, points, seed, longest):
    print(f"kill seed {seed}")  # rerun a failure with KILL_SEED=<seed> pytest -m slow
    rng = random.Random(seed)
    for point in range(points):
        directory = tmp_path / f"kill{point}"
        _old_run(directory)
        _kill_replacer_at(tmp_path, directory, rng.uniform(0.0, longest))


@pytest.mark.slow
def test_kills_while_replacing_leave_every_listed_step_restorable(tmp_path):
    _kills_while_replacing(tmp_path, points=3, seed=8, longest=2.0)


@pytest.mark.slow
def test_many_kills_while_replacing(tmp_path):
    seed = int(os.environ.get("KILL_SEED", time.time()))
    _kills_while_replacing(tmp_path, points=15, seed=seed, longest=3.0)


# -- only our complete checkpoints are steps --------------------------------------------


def test_foreign_entries_are_not_steps(make_ckpt, ckpt_dir, tmp_path):
    ckpt_dir.mkdir()
    for name in ("5", "007", "٩", "²", "12x"):
        (ckpt_dir / name).mkdir()
    (ckpt_dir / "11").write_text("a file named like a step")
    elsewhere = tmp_path / "elsewhere"
    with jax_cb_ckpt.Checkpointer(elsewhere) as other:
        other.save(state_at(8), 8)
    os.symlink(elsewhere / "8", ckpt_dir / "8")  # a real checkpoint, behind a symlink
    assert jax_cb_ckpt.all_steps(ckpt_dir) == []
    assert jax_cb_ckpt.latest_step(ckpt_dir) is None
    with pytest.raises(NoCheckpointError, match=r"step-numbered folder\(s\) that are not"):
        jax_cb_ckpt.restore(ckpt_dir, state_at(0))
    ckpt = make_ckpt(max_to_keep=1)
    ckpt.save(state_at(2), 2)
    ckpt.save(state_at(3), 3)
    ckpt.wait()
    assert ckpt.all_steps() == [3]
    assert int(ckpt.restore(state_at(0))["step"]) == 3
    with pytest.raises(NoCheckpointError, match=r"no checkpoint for step 5 .* steps there are"):
        ckpt.restore(state_at(0), step=5)
    for name in ("5", "007", "٩", "²", "12x"):
        assert (ckpt_dir / name).is_dir(), name
    assert (ckpt_dir / "11").read_text() == "a file named like a step"
    assert jax_cb_ckpt.all_steps(elsewhere) == [8]


def test_a_step_folder_copied_in_is_kept_whole_or_half(make_ckpt, ckpt_dir, tmp_path):
    """A local step is a folder: one copied in whole (`cp -r other/500 ckpt/`) is a
    step here, listed and restored; one copied in part (its Orbax step file missing) is
    not a step but a damaged one, reported (DamagedStepWarning). Opening the directory,
    retention and a save of the same number delete neither (the object-storage case:
    test_storage.py); a restart (restore without step=) sets the damaged one aside,
    whole, and the run writes that step again (issue 41 item 1)."""
    elsewhere = tmp_path / "elsewhere"
    with jax_cb_ckpt.Checkpointer(elsewhere) as other:
        other.save(state_at(500), 500)
        other.save(state_at(600), 600)
    ckpt_dir.mkdir()
    shutil.copytree(elsewhere / "500", ckpt_dir / "500")
    shutil.copytree(elsewhere / "600", ckpt_dir / "600")
    os.remove(ckpt_dir / "600" / "_CHECKPOINT_METADATA")
    files = sorted(str(p.relative_to(ckpt_dir)) for p in ckpt_dir.rglob("*"))
    ckpt = make_ckpt(max_to_keep=1)
    with pytest.warns(jax_cb_ckpt.DamagedStepWarning, match=r"step 600: .*_CHECKPOINT_METADATA"):
        assert ckpt.all_steps() == [500]
    ckpt.save(state_at(600), 600)  # not listed, but in the way
    with pytest.raises(SaveError, match=r"'.*/600' already exists and is not a checkpoint"):
        ckpt.wait()
    left = sorted(str(p.relative_to(ckpt_dir)) for p in ckpt_dir.rglob("*"))
    assert left == sorted([*files, ".jax_cb_ckpt.lock"])
    ckpt.close()
    ckpt = make_ckpt(max_to_keep=1)
    with pytest.warns(jax_cb_ckpt.DamagedStepWarning, match=r"passing over .*step 600: "):
        assert int(ckpt.restore(state_at(0))["step"]) == 500
    [aside] = [p for p in ckpt_dir.iterdir() if p.name.startswith("600.jax_cb_ckpt-damaged-")]
    note = json.loads((aside / ".jax_cb_ckpt-set-aside.json").read_text())
    assert note["step"] == 600 and "_CHECKPOINT_METADATA" in note["why"]
    moved = sorted(str(p.relative_to(aside)) for p in aside.rglob("*"))
    assert moved == sorted(
        [f[len("600/") :] for f in files if f.startswith("600/")] + [".jax_cb_ckpt-set-aside.json"]
    )
    ckpt.save(state_at(601), 600)  # the run writes step 600 again
    ckpt.close()
    assert jax_cb_ckpt.all_steps(ckpt_dir) == [600]  # (max_to_keep=1)
    assert int(jax_cb_ckpt.restore(ckpt_dir, state_at(0))["step"]) == 601


def test_a_step_blocked_by_a_user_folder_fails_clearly(make_ckpt, ckpt_dir):
    ckpt_dir.mkdir()
    (ckpt_dir / "4").mkdir()
    (ckpt_dir / "4" / "mine.txt").write_text("mine")
    ckpt = make_ckpt()
    ckpt.save(state_at(4), 4)
    with pytest.raises(SaveError, match=r"'.*/4' already exists and is not a checkpoint"):
        ckpt.wait()
    assert (ckpt_dir / "4" / "mine.txt").read_text() == "mine"


# -- every function takes the same path forms ----------------------------------------


def test_relative_paths_everywhere(make_ckpt, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ckpt = make_ckpt("runs/exp1")
    ckpt.save(state_at(3), 3)
    ckpt.close()
    assert ckpt.directory == str(tmp_path / "runs" / "exp1")
    assert jax_cb_ckpt.all_steps("runs/exp1") == [3]
    assert jax_cb_ckpt.latest_step("runs/exp1") == 3
    assert jax_cb_ckpt.metadata("runs/exp1")["step"] == 3
    assert int(jax_cb_ckpt.restore("runs/exp1", state_at(0))["step"]) == 3


@pytest.mark.parametrize(
    "call",
    [
        lambda d: jax_cb_ckpt.Checkpointer(d),
        lambda d: jax_cb_ckpt.all_steps(d),
        lambda d: jax_cb_ckpt.latest_step(d),
        lambda d: jax_cb_ckpt.metadata(d),
        lambda d: jax_cb_ckpt.restore(d, state_at(0)),
    ],
)
def test_empty_directory_name_is_refused(call):
    with pytest.raises(ConfigError, match=r"directory is empty \(''\)"):
        call("")


def test_dotdot_after_a_symlink_means_what_the_os_means(make_ckpt, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "real" / "deep").mkdir(parents=True)
    os.symlink(tmp_path / "real" / "deep", tmp_path / "link")
    ckpt = make_ckpt("link/../ckpts")  # the OS resolves this to real/ckpts
    ckpt.save(state_at(1), 1)
    ckpt.close()
    assert jax_cb_ckpt.all_steps(tmp_path / "real" / "ckpts") == [1]
    assert not (tmp_path / "ckpts").exists()


@pytest.mark.parametrize(
    "directory, match",
    [("a\0b", r"contains a NUL character"), ("x" * 5000, r"cannot list the checkpoint")],
)
def test_impossible_paths_are_config_errors(directory, match):
    for call in (jax_cb_ckpt.all_steps, jax_cb_ckpt.latest_step):
        with pytest.raises(ConfigError, match=match):
            call(directory)


def test_unflattenable_state_is_an_invalid_state_error(make_ckpt):
    with pytest.raises(InvalidStateError, match=r"JAX cannot flatten the state.*str keys"):
        make_ckpt().save({1: jnp.ones(2), "1": jnp.ones(2)}, 5)


def test_a_collected_checkpointers_directory_can_be_reopened_at_once(ckpt_dir):
    import gc

    ckpt = jax_cb_ckpt.Checkpointer(ckpt_dir)
    ckpt.save({"x": np.zeros(1 << 22)}, 1)  # still being written when it is collected
    del ckpt
    gc.collect()
    with jax_cb_ckpt.Checkpointer(ckpt_dir) as again:  # waits for the first to finish
        again.save({"x": np.ones(1 << 22)}, 2)
    assert jax_cb_ckpt.all_steps(ckpt_dir) == [1, 2]


# -- the directory replaced under a running writer -----------------------------------


def test_directory_replaced_mid_run_is_an_error(make_ckpt, ckpt_dir):
    ckpt = make_ckpt()
    ckpt.save(state_at(1), 1)
    ckpt.wait()
    shutil.rmtree(ckpt_dir)
    ckpt_dir.mkdir()  # an empty directory under the same name
    ckpt.save(state_at(2), 2)
    with pytest.raises(SaveError, match=r"saving step 2 .* was replaced while the run"):
        ckpt.wait()
    assert os.listdir(ckpt_dir) == []  # nothing written into the replacement


def test_conflict_inside_with_raises_our_error(ckpt_dir):
    with jax_cb_ckpt.Checkpointer(ckpt_dir) as first:
        first.save(state_at(5), 5)
    with pytest.raises(StepExistsError, match=r"saving step 5") as info:
        with jax_cb_ckpt.Checkpointer(ckpt_dir) as ckpt:
            jax.jit(lambda s: ckpt.save(s, 5))(state_at(50))
            jax.effects_barrier()
    assert isinstance(info.value.__cause__, jax.errors.JaxRuntimeError)  # JAX's, chained
    assert jax_cb_ckpt.all_steps(ckpt_dir) == [5]


def test_a_skipped_replacing_save_leaves_the_other_runs_steps_in_conflict(tmp_path, monkeypatch):
    """on_existing='replace' with on_full='skip': a replacing save that was skipped
    replaced nothing, so the other run's steps still count as the other run's."""
    import threading

    from jax_cb_ckpt._storage import _places

    directory = tmp_path / "run"
    with jax_cb_ckpt.Checkpointer(directory) as first:
        for step in (10, 15):
            first.save({"x": np.full(4, float(step), np.float32)}, step)
    # The writer held in step 20's description until step 10 was offered: the only
    # slot is taken (a pause of the writer, as a stopped VM's, not timing).
    offered, write_meta = threading.Event(), _places.Storage.write_meta

    def held(self, temp, meta, *extra):
        if meta["step"] == 20:
            assert offered.wait(60), "step 10 was never offered"
        return write_meta(self, temp, meta, *extra)

    monkeypatch.setattr(_places.Storage, "write_meta", held)
    ckpt = jax_cb_ckpt.Checkpointer(directory, queue_size=1, on_full="skip", on_existing="replace")
    ckpt.save({"x": np.zeros(4, np.float32)}, 20)
    with warnings.catch_warnings(record=True) as caught:  # (StepOrderWarning too)
        warnings.simplefilter("always")
        ckpt.save({"x": np.ones(4, np.float32)}, 10)
        offered.set()
        ckpt.wait()
    assert any(issubclass(w.category, jax_cb_ckpt.SkippedSaveWarning) for w in caught)
    assert ckpt.all_steps() == [10, 15, 20]  # nothing replaced: the save was skipped
    ckpt.save({"x": np.zeros(4, np.float32)}, 12)  # replaces the other run's 15
    ckpt.close()
    assert jax_cb_ckpt.all_steps(directory) == [10, 12, 20]  # runs never mix
