"""A fast local tier and a persistent one (`persistent=`): every save goes to the local
directory, every N-th is copied by the writer to the persistent one (a directory or a
bucket) with its own lock and retention; a restart takes the newest intact step of
either tier."""

import os
import random
import shutil
import signal
import sys
import time

import crash_worker
import jax
import numpy as np
import pytest
from helpers import (
    assert_same_state,
    data_files,
    kill_group,
    needs,
    run_child,
    start_process,
    wait_for_step,
)

import jax_cb_ckpt as ckpt
from jax_cb_ckpt import ConfigError

HERE = os.path.dirname(os.path.abspath(__file__))


def state(step):
    return {"w": np.full((64, 8), step, np.float32), "n": np.int32(step)}


def like():
    return state(0)


def save_steps(local, persistent, steps, **options):
    options = {"persistent_every": 3, **options}
    with ckpt.Checkpointer(local, persistent=persistent, **options) as c:
        for step in steps:
            c.save(state(step), step)


def assert_values(a, b):
    """The same leaves, bit for bit and of the same dtypes (jax or numpy arrays)."""
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert np.asarray(x).dtype == np.asarray(y).dtype
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def files(step_dir, skip=("_CHECKPOINT_METADATA", "meta/metadata")):
    """{relative path: bytes} of a step's files (its description files left out)."""
    out = {}
    for folder, _dirs, names in os.walk(step_dir):
        for name in names:
            path = os.path.join(folder, name)
            relative = os.path.relpath(path, step_dir)
            if relative not in skip:
                with open(path, "rb") as f:
                    out[relative] = f.read()
    return out


# -- the arguments ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("given", "named"),
    [
        ({"persistent_every": 3}, "persistent_every"),
        ({"persistent_every_seconds": 60.0}, "persistent_every_seconds"),
        ({"persistent_keep": [ckpt.LatestN(2)]}, "persistent_keep"),
        ({"persistent": "SAME", "persistent_every": 3}, "the local directory itself"),
        ({"persistent": "INSIDE", "persistent_every": 3}, "inside the other"),
        ({"persistent": "OTHER"}, "persistent_every=N"),
        ({"persistent": "OTHER", "persistent_every": 0}, "persistent_every must be"),
        ({"persistent": "OTHER", "persistent_every": 2.5}, "persistent_every must be"),
        ({"persistent": "OTHER", "persistent_every_seconds": -1}, "persistent_every_seconds"),
        ({"persistent": "OTHER", "persistent_every": 3, "persistent_keep": 3}, "persistent_keep"),
        (
            {"persistent": "OTHER", "persistent_every": 3, "persistent_keep": [3]},
            "persistent_keep[0]",
        ),
    ],
)
def test_bad_arguments_are_refused_by_name(tmp_path, given, named):
    local = str(tmp_path / "local")
    places = {"SAME": local, "INSIDE": os.path.join(local, "p"), "OTHER": str(tmp_path / "p")}
    if given.get("persistent") in places:
        given = dict(given, persistent=places[given["persistent"]])
    with pytest.raises(ConfigError, match=named.replace("[", r"\[")):
        ckpt.Checkpointer(local, **given)
    assert not os.path.exists(tmp_path / "p")  # refused before anything was made


def test_a_url_as_the_local_tier_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="local tier.*is a URL"):
        ckpt.Checkpointer("gs://bucket/run", persistent=str(tmp_path / "p"), persistent_every=3)


# -- what is written --------------------------------------------------------------------


def test_every_nth_step_is_copied_with_the_same_bytes_and_own_retention(tmp_path):
    local, persistent = str(tmp_path / "local"), str(tmp_path / "p")
    rules = [ckpt.LatestN(1), ckpt.EveryNSteps(6)]
    save_steps(local, persistent, range(1, 10), max_to_keep=2, persistent_keep=rules)
    assert ckpt.all_steps(local) == [8, 9]
    assert ckpt.all_steps(persistent) == [6, 9]  # its own retention: 3 went, 6 kept
    # Each step records the rules of the tier that keeps it (a later run reads them).
    assert ckpt.metadata(local, step=9)["retention"] == {"max_to_keep": 2}
    assert ckpt.metadata(persistent, step=9)["retention"] == {"max_to_keep": 1, "keep_every": 6}
    assert files(os.path.join(local, "9")) == files(os.path.join(persistent, "9"))
    assert (
        ckpt.metadata(persistent, step=9)["checksums"] == ckpt.metadata(local, step=9)["checksums"]
    )
    assert ckpt.verify(persistent) == [6, 9]  # every byte against its checksum
    restored = ckpt.restore(persistent, like(), step=6)
    assert_values(restored, state(6))
    assert os.path.exists(os.path.join(persistent, ".jax_cb_ckpt.lock"))  # its own lock


def test_the_persistent_directory_has_its_own_lock_and_is_a_normal_directory(tmp_path, capsys):
    import json

    from jax_cb_ckpt._cli._main import main

    persistent = str(tmp_path / "p")
    with ckpt.Checkpointer(tmp_path / "a", persistent=persistent, persistent_every=3) as c:
        with pytest.raises(ckpt.DirectoryLockedError):  # a second writer of the tier
            ckpt.Checkpointer(tmp_path / "b", persistent=persistent, persistent_every=3)
        ckpt.Checkpointer(tmp_path / "b").close()  # its local lock was given back
        c.save(state(3), 3)
    assert ckpt.all_steps(tmp_path / "b") == []  # (refused before anything was saved)
    capsys.readouterr()
    assert main(["ls", persistent, "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)["steps"]
    assert [(s["step"], s["complete"]) for s in listed] == [(3, True)]


def test_without_persistent_nothing_changes(tmp_path):
    save_steps(str(tmp_path / "local"), None, [3], persistent_every=None)
    assert sorted(os.listdir(tmp_path)) == ["local"]


def test_persistent_every_seconds_copies_once_the_time_passed(tmp_path):
    local, persistent = str(tmp_path / "local"), str(tmp_path / "p")
    with ckpt.Checkpointer(local, persistent=persistent, persistent_every_seconds=0.2) as c:
        c.save(state(1), 1)
        c.wait()
        assert ckpt.all_steps(persistent) == []  # (the clock starts at the opening)
        time.sleep(0.3)
        c.save(state(2), 2)
    assert ckpt.all_steps(persistent) == [2]


def test_plain_orbax_restores_a_persistent_step(tmp_path):
    import orbax.checkpoint as ocp

    persistent = str(tmp_path / "p")
    save_steps(str(tmp_path / "local"), persistent, [3])
    with ocp.CheckpointManager(persistent) as manager:
        got = manager.restore(3, args=ocp.args.Composite(state=ocp.args.StandardRestore()))
    np.testing.assert_array_equal(got["state"]["w"], state(3)["w"])


@pytest.mark.slow  # (gcsfs, which Orbax needs for gs://, comes with the slow extra)
@needs("gcsfs", "slow")
@pytest.mark.parametrize("remote", ["gs"], indirect=True)
def test_plain_orbax_restores_a_step_copied_to_a_bucket(tmp_path, remote):
    save_steps(str(tmp_path / "local"), remote.url, [3])
    code = f"""
import orbax.checkpoint as ocp
tree = ocp.StandardCheckpointer().restore("{remote.url}/3/state")
print(tree["w"].sum(), tree["n"])
"""
    env = dict(
        remote.env,
        TENSORSTORE_GCS_HTTP_URL=remote.env["STORAGE_EMULATOR_HOST"],
        GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT="false",  # (see test_storage.py)
    )
    result = run_child([sys.executable, "-c", code], env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["1536.0", "3"]


def test_a_failed_copy_follows_on_error_and_keeps_the_local_step(tmp_path):
    local, persistent = str(tmp_path / "local"), str(tmp_path / "p")
    os.makedirs(os.path.join(persistent, "3"))  # a user's folder where the copy goes
    c = ckpt.Checkpointer(local, persistent=persistent, persistent_every=3)
    c.save(state(3), 3)
    with pytest.raises(ckpt.SaveError, match="persistent directory.*local step 3 .* is saved"):
        c.wait()
    c.close()
    assert ckpt.all_steps(local) == [3]
    assert os.listdir(os.path.join(persistent, "3")) == []  # untouched
    with pytest.warns(ckpt.SaveFailedWarning, match="persistent directory"):
        c = ckpt.Checkpointer(local, persistent=persistent, persistent_every=3, on_error="continue")
        c.save(state(6), 6)
        shutil.rmtree(os.path.join(persistent, "3"))
        os.makedirs(os.path.join(persistent, "6"))
        c.close()
    assert ckpt.all_steps(local) == [3, 6]


# -- restarts ---------------------------------------------------------------------------


def test_a_lost_local_directory_resumes_from_the_persistent_tier(tmp_path):
    local, persistent = str(tmp_path / "local"), str(tmp_path / "p")
    save_steps(local, persistent, range(1, 9))  # copies: 3, 6
    shutil.rmtree(local)
    with ckpt.Checkpointer(local, persistent=persistent, persistent_every=3) as c:
        restored, step = c.restore_or_init(like)
        assert step == 6  # at most persistent_every steps lost
        assert_values(restored, state(6))
        for later in (7, 8, 9):  # not refused: the run goes on from step 6
            c.save(state(later), later)
    assert ckpt.all_steps(local) == [7, 8, 9]
    assert ckpt.all_steps(persistent) == [3, 6, 9]


def test_stale_older_local_steps_do_not_refuse_the_resumed_run(tmp_path):
    local, persistent = str(tmp_path / "local"), str(tmp_path / "p")
    save_steps(local, persistent, range(1, 7))
    for step in (4, 5, 6):  # the local disk of an older machine: steps up to 3
        shutil.rmtree(os.path.join(local, str(step)))
    with ckpt.Checkpointer(local, persistent=persistent, persistent_every=3) as c:
        assert c.restore(like())["n"] == 6
        c.save(state(7), 7)
    assert ckpt.all_steps(local) == [1, 2, 3, 7]


def test_a_damaged_local_step_falls_back_to_its_persistent_copy(tmp_path):
    local, persistent = str(tmp_path / "local"), str(tmp_path / "p")
    save_steps(local, persistent, range(1, 7))
    data = data_files(os.path.join(local, "6"))[0]
    with open(data, "r+b") as f:  # one byte flipped in the newest local step
        f.seek(os.path.getsize(data) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    with ckpt.Checkpointer(local, persistent=persistent, persistent_every=3) as c:
        with pytest.warns(ckpt.DamagedStepWarning, match="read step 6 of .*persistent tier"):
            restored = c.restore(like())
        c.save(state(7), 7)  # step 6 was set aside locally: no conflict
    assert_values(restored, state(6))
    assert ckpt.all_steps(local) == [1, 2, 3, 4, 5, 7]


def test_a_damaged_local_step_without_a_copy_falls_back_locally(tmp_path):
    local, persistent = str(tmp_path / "local"), str(tmp_path / "p")
    save_steps(local, persistent, range(1, 6))  # copies: 3
    data = data_files(os.path.join(local, "5"))[0]
    with open(data, "r+b") as f:
        f.write(b"\xff\xff\xff\xff")
    with ckpt.Checkpointer(local, persistent=persistent, persistent_every=3) as c:
        with pytest.warns(ckpt.DamagedStepWarning, match="read step 4 of"):
            assert c.restore(like())["n"] == 4


def test_buckets_as_the_persistent_tier(tmp_path, remote):
    local = str(tmp_path / "local")
    save_steps(local, remote.url, range(1, 6), persistent_keep=[ckpt.LatestN(1)])
    with ckpt.Checkpointer(local, persistent=remote.url, persistent_every=3) as c:
        c.restore(like())
        c.save(state(6), 6, extra={"config": "a", "step": 6})  # the extra item copied too
    assert ckpt.all_steps(remote.url) == [3, 6]  # (this Checkpointer keeps every copy)
    assert ckpt.restore_extra(remote.url, step=6) == {"config": "a", "step": 6}
    assert ckpt.verify(remote.url) == [3, 6]
    assert (
        ckpt.metadata(remote.url, step=6)["checksums"] == ckpt.metadata(local, step=6)["checksums"]
    )
    shutil.rmtree(local)
    with ckpt.Checkpointer(local, persistent=remote.url, persistent_every=3) as c:
        restored, step = c.restore_or_init(like)
    assert step == 6
    assert_values(restored, state(6))


def test_another_runs_persistent_steps_count_for_on_existing(tmp_path):
    local, persistent = str(tmp_path / "local"), str(tmp_path / "p")
    save_steps(str(tmp_path / "other"), persistent, range(1, 7))  # another run's: 3, 6
    with ckpt.Checkpointer(local, persistent=persistent, persistent_every=3) as c:
        with pytest.raises(ckpt.StepExistsError):
            c.save(state(3), 3)
    assert ckpt.all_steps(persistent) == [3, 6]  # untouched
    shutil.rmtree(local)
    with ckpt.Checkpointer(
        local, persistent=persistent, persistent_every=3, on_existing="replace"
    ) as c:
        c.save(state(3), 3)
    assert ckpt.all_steps(persistent) == [3]  # the other run's 3 and 6 replaced
    assert_values(ckpt.restore(persistent, like(), step=3), state(3))


# -- crashes ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    with jax.default_device(jax.devices("cpu")[0]):
        return crash_worker.train(tmp_path_factory.mktemp("reference") / "ckpt")


def kill_and_resume(local, persistent, uninterrupted, rng, lose_local, env=None):
    """A run with both tiers SIGKILLed at a random point; the restart (the local
    directory kept, or lost) ends bit for bit as the uninterrupted run."""
    worker = os.path.join(HERE, "crash_worker.py")
    child = start_process(
        [sys.executable, worker, str(local), f"--persistent={persistent}"], env=env
    )
    wait_for_step(local, crash_worker.PERSISTENT_EVERY, child)
    time.sleep(rng.uniform(0.0, 1.5))
    kill_group(child)
    assert child.returncode == -signal.SIGKILL
    newest = ckpt.latest_step(local)
    if lose_local:
        shutil.rmtree(local)
        kept = ckpt.latest_step(persistent)
        # At most persistent_every steps lost (the writer copies a step before it
        # writes the next one).
        assert kept is not None and newest - kept <= crash_worker.PERSISTENT_EVERY
    with jax.default_device(jax.devices("cpu")[0]):
        resumed = crash_worker.train(local, persistent=persistent)
    assert_same_state(resumed, uninterrupted)


@pytest.mark.slow
@pytest.mark.parametrize("lose_local", [False, True])
def test_sigkill_then_resume_is_exact(tmp_path, uninterrupted, lose_local):
    rng = random.Random(56 + lose_local)
    for point in range(2):
        local, persistent = tmp_path / f"local{point}", str(tmp_path / f"p{point}")
        kill_and_resume(local, persistent, uninterrupted, rng, lose_local)


@pytest.mark.slow
def test_sigkill_with_a_bucket_as_the_persistent_tier(tmp_path, uninterrupted, remote):
    kill_and_resume(
        tmp_path / "local", remote.url, uninterrupted, random.Random(7), True, remote.env
    )


def test_saves_that_skip_the_multiples_of_persistent_every_are_copied_past_them(tmp_path):
    """Saves every 3 steps, persistent_every=5: the first save past each multiple of 5
    is copied (6, 12, 15, 21, 27), so a lost local directory costs at most 5 steps
    (before: only the multiples of 15 were, and saves that never hit a multiple of
    persistent_every were never copied)."""
    local, persistent = str(tmp_path / "local"), str(tmp_path / "persistent")
    save_steps(local, persistent, range(3, 28, 3), persistent_every=5)
    assert ckpt.all_steps(persistent) == [6, 12, 15, 21, 27]
    shutil.rmtree(local)
    with ckpt.Checkpointer(local, persistent=persistent, persistent_every=5) as c:
        restored, step = c.restore_or_init(like)
    assert step == 27
    assert_values(restored, state(27))


def test_persistent_every_seconds_counts_from_the_last_copy_across_restarts(tmp_path):
    """A preemptible machine restarted more often than persistent_every_seconds: the
    clock runs from the persistent tier's newest copy, not from each opening, so the
    first save of a reopened run is copied once the time has passed since that copy
    (before: never, as long as each run was shorter than persistent_every_seconds)."""
    local, persistent = str(tmp_path / "local"), str(tmp_path / "p")
    options = {"persistent": persistent, "persistent_every_seconds": 0.5}
    with ckpt.Checkpointer(local, **options) as c:
        time.sleep(0.6)
        c.save(state(1), 1)
    time.sleep(0.6)
    with ckpt.Checkpointer(local, **options) as c:
        c.save(state(2), 2)  # 0.6 s after the copy of step 1, a moment after the opening
    assert ckpt.all_steps(persistent) == [1, 2]


def test_a_step_not_copied_before_a_restart_is_made_up_by_the_next_save(tmp_path):
    """Killed between the local commit of step 6 and its copy (here: the copy removed),
    the restarted run resumes from the local step 6; its next save (7) is copied, so a
    local directory lost at step 8 costs at most persistent_every steps (before: the
    persistent tier stayed at step 3 until step 9, and the run went back to 3)."""
    local, persistent = str(tmp_path / "local"), str(tmp_path / "p")
    save_steps(local, persistent, range(1, 7))  # copies: 3, 6
    shutil.rmtree(os.path.join(persistent, "6"))
    with ckpt.Checkpointer(local, persistent=persistent, persistent_every=3) as c:
        _, step = c.restore_or_init(like)
        assert step == 6
        for later in (7, 8):
            c.save(state(later), later)
    assert ckpt.all_steps(persistent) == [3, 7]
    shutil.rmtree(local)
    with ckpt.Checkpointer(local, persistent=persistent, persistent_every=3) as c:
        restored, step = c.restore_or_init(like)
    assert step == 7
    assert_values(restored, state(7))


def test_run_says_which_tier_it_resumed_from(tmp_path, capfd):
    """run's line on stderr names the directory the step was read from: the persistent
    one after the local directory was lost (before: the empty local directory), and
    both when it starts fresh (a mistyped persistent= shows)."""
    local, persistent = str(tmp_path / "local"), str(tmp_path / "p")

    def go():
        with ckpt.Checkpointer(local, persistent=persistent, persistent_every=4, every=2) as c:
            c.run(lambda s, i: s + 1.0, np.float32(0), 10)
        return capfd.readouterr().err

    assert f"starting fresh at step 0 in {local} (no checkpoint there nor in {persistent})" in go()
    shutil.rmtree(local)
    assert f"run resumed from step 8 of {persistent}\n" in go()


def test_a_damaged_newer_persistent_copy_gives_back_the_older_local_step(tmp_path):
    """The restart lets the local state it read go before it reads a newer persistent
    step (one state in memory at a time), and reads the local one again where no newer
    persistent step passes its checks: the older local step, exactly."""
    local, persistent = str(tmp_path / "local"), str(tmp_path / "p")
    save_steps(local, persistent, range(1, 7))  # copies: 3, 6
    shutil.rmtree(os.path.join(local, "6"))  # local: 1..5; persistent: 3, 6
    data = data_files(os.path.join(persistent, "6"))[0]
    with open(data, "r+b") as f:  # the persistent copy of 6 is damaged
        f.write(b"\xff\xff\xff\xff")
    with ckpt.Checkpointer(local, persistent=persistent, persistent_every=3) as c:
        with pytest.warns(ckpt.DamagedStepWarning, match="step 6"):
            restored = c.restore(like())
    assert_values(restored, state(5))
