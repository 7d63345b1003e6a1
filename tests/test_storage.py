"""Checkpoints in object storage (gs://, s3://) against real local servers (conftest's
`remote` fixture: fake-gcs-server and moto's S3 server, tests/storage_servers.py): the
guarantees of a local disk, with a commit marker for the rename and a lock object for
the flock (docs/storage.md)."""

import contextlib
import json
import logging
import os
import re
import signal
import threading
import time
import traceback
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
import tensorstore as ts
from helpers import (
    assert_same_state,
    free_port,
    kill_group,
    needs,
    run_child,
    start_process,
    start_script,
    state_at,
    toy_reference,
    toy_state,
    toy_update,
)

import jax_cb_ckpt
from jax_cb_ckpt._storage import _remote

MiB = 1 << 20


def keys(url):
    """Every object under `url/` (relative keys), read with TensorStore directly."""
    return _remote.list_keys(url)


def put(url, data=b"x"):
    _remote.write(url, data)


def big_state(seed=0, mib=32):
    rng = np.random.default_rng(seed)
    n = mib * MiB // 4
    return {
        "w": jnp.asarray(rng.standard_normal(n, dtype=np.float32)),
        "key": jax.random.key(seed),
        "step": jnp.int32(seed),
        "nested": {"b": jnp.asarray(rng.integers(0, 255, (64, 3), dtype=np.uint8))},
    }


# The storage basics run on a third server as well: gcp-storage-emulator (conftest's
# `remote`), which ignores the key range of a listing and sends no generation with an
# object's bytes (no x-goog-generation header): the read path reads a step's manifest
# once, so no conditional re-read asks that server what it cannot answer.
THREE_SERVERS = pytest.mark.parametrize(
    "remote", ["gs", "s3", "gcp-storage-emulator"], indirect=True
)


@THREE_SERVERS
def test_save_list_restore_retention_and_verify(remote, tmp_path, monkeypatch):
    """A run's steps land in the bucket, are listed once committed, keep max_to_keep,
    restore bit for bit, verify, and carry their metadata; no local folder is made
    (before, `Checkpointer("s3://ckpts/run1")` wrote to ./s3:/ckpts/run1)."""
    monkeypatch.chdir(tmp_path)
    url = remote.url
    states = {}
    with jax_cb_ckpt.Checkpointer(url, max_to_keep=2) as ckpt:
        for step in range(4):
            states[step] = big_state(step, mib=1)
            ckpt.save(states[step], step)
        ckpt.wait()
        assert ckpt.all_steps() == [2, 3]
    assert jax_cb_ckpt.all_steps(url) == [2, 3]
    assert jax_cb_ckpt.latest_step(url) == 3
    meta = jax_cb_ckpt.metadata(url)
    assert meta["step"] == 3
    # Retention deleted every object of steps 0 and 1 (and only those); the steps kept
    # hold the marker written last.
    names = keys(url)
    assert not [k for k in names if k.split("/")[0] in ("0", "1")]
    assert "3/commit_success.txt" in names and "3/.jax_cb_ckpt" in names
    assert "2/commit_success.txt" in names and ".jax_cb_ckpt.lock" in names
    assert os.listdir(tmp_path) == []
    for step in (2, 3):
        restored = jax_cb_ckpt.restore(url, states[0], step=step)
        assert_same_state(restored, states[step])
    assert jax_cb_ckpt.verify(url) == [2, 3]


@THREE_SERVERS
def test_a_resumed_run_continues_bit_for_bit(remote):
    """Kill nothing, just stop: a run resumed from the bucket equals the plain loop."""
    url = remote.url
    reference = toy_reference(12)
    step_fn = jax.jit(toy_update)

    def loop(state, start, stop, ckpt):
        for step in range(start, stop):
            state = step_fn(state, jnp.int32(step))
            ckpt.maybe_save(state, step)
        return state

    with jax_cb_ckpt.Checkpointer(url, every=5) as ckpt:
        loop(toy_state(), 0, 7, ckpt)
    assert jax_cb_ckpt.all_steps(url) == [0, 5]
    with jax_cb_ckpt.Checkpointer(url, every=5) as ckpt:
        state = ckpt.restore(toy_state())
        final = loop(state, ckpt.latest_step() + 1, 12, ckpt)
    assert_same_state(final, reference[11])
    assert jax_cb_ckpt.all_steps(url) == [0, 5, 10]


def test_run_saves_to_the_bucket(remote):
    def step_fn(state, step):
        return toy_update(state, step)

    with jax_cb_ckpt.Checkpointer(remote.url, every=4) as ckpt:
        final = ckpt.run(step_fn, toy_state(), 10)
    assert_same_state(final, toy_reference(10)[9])
    assert jax_cb_ckpt.all_steps(remote.url) == [4, 8, 10]  # as on a local disk


def test_per_device_saves_and_sharded_restore(remote):
    """A sharded state is written block by block and restored onto its sharding, each
    device reading its own slices."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("d",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("d"))
    state = {"w": jax.device_put(jnp.arange(8 * MiB // 4, dtype=jnp.float32), sharding)}
    with jax_cb_ckpt.Checkpointer(remote.url) as ckpt:

        @jax.jit
        def save(state):
            return ckpt.save(state, 1, shardings={"w": sharding})

        save(state)
    meta = jax_cb_ckpt.metadata(remote.url)
    assert len(meta["checksums"]["w"]) == 4  # one block per device
    restored = jax_cb_ckpt.restore(remote.url, state)
    assert restored["w"].sharding == sharding
    assert_same_state(restored, state)


@pytest.mark.parametrize(
    "remote", ["s3", pytest.param("gs", marks=pytest.mark.slow)], indirect=True
)
def test_a_killed_writers_partial_step_is_never_listed_and_is_cleaned_up(remote, tmp_path):
    """A writer SIGKILLed while steps are being written leaves objects of an
    unfinished step: never listed, restore gives the latest complete step, and the
    next Checkpointer on the location deletes them (and nothing else)."""
    url = remote.url
    put(f"{url}/notes.txt")  # foreign objects under the prefix
    put(f"{url}/50/model.bin")
    child = start_script(
        tmp_path,
        """
        import sys
        import jax, jax.numpy as jnp, numpy as np
        import jax_cb_ckpt
        url = sys.argv[1]
        w = jnp.asarray(np.random.default_rng(0).standard_normal(8 << 20, dtype=np.float32))
        with jax_cb_ckpt.Checkpointer(url, queue_size=1) as ckpt:
            for step in range(1000):
                ckpt.save({"w": w + step}, step)
                if step == 0:
                    ckpt.wait()
                    print("saved", flush=True)
        """,
        url,
        ready="saved",
        env=remote.env,
    )
    deadline = time.monotonic() + 60
    while not any(step for step, _ in _unfinished(url)) and time.monotonic() < deadline:
        time.sleep(0.005)
    kill_group(child)
    steps = jax_cb_ckpt.all_steps(url)
    assert steps and steps[0] == 0
    unfinished = [step for step, _ in _unfinished(url)]
    assert unfinished, "the kill came between two steps; no partial step to look at"
    assert not set(unfinished) & set(steps)
    restored = jax_cb_ckpt.restore(url, {"w": jnp.zeros(8 << 20, jnp.float32)})
    assert float(restored["w"][0]) == float(np.float32(_first(0)) + steps[-1])
    with jax_cb_ckpt.Checkpointer(url):
        pass
    assert _unfinished(url) == []
    assert jax_cb_ckpt.all_steps(url) == steps
    assert {"notes.txt", "50/model.bin"} <= set(keys(url))


def upload(folder, url):
    """Every file under `folder` as an object under `url/`, as `aws s3 cp --recursive`
    or `gsutil cp -r` copies a folder."""
    for root, _, files in os.walk(folder):
        for name in files:
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                put(f"{url}/{os.path.relpath(path, folder)}", f.read())


def copy_prefix(source, target, skip=()):
    """Every object under `source/` copied under `target/`, but those named in `skip`."""
    for key in keys(source):
        if key not in skip:
            put(f"{target}/{key}", _remote.read(f"{source}/{key}")[0])


@THREE_SERVERS
@pytest.mark.parametrize("copied", ["local step", "bucket step", "foreign marker"])
def test_a_step_copied_into_the_prefix_is_never_deleted(remote, tmp_path, copied):
    """Objects someone put under `<prefix>/500/` without a commit marker: a step saved
    locally and uploaded (no marker of ours), a step copied from another prefix without
    its commit marker (our marker, naming a writer that never held this prefix), or a
    `.jax_cb_ckpt` object that is not our marker. Opening the prefix, and a save of that
    step number, leave every object as it was; the copy is not a step, and a copy that
    holds a whole step is reported by a warning naming it. (Before, the opening deleted
    the first two: an uncommitted prefix with our meta item or our marker was taken for
    a killed write of ours; a save of step 500 deleted the second.)"""
    url = remote.url
    state = {"w": jnp.arange(6.0)}
    if copied == "local step":
        with jax_cb_ckpt.Checkpointer(tmp_path / "local") as ckpt:
            ckpt.save(state, 500)
        upload(tmp_path / "local" / "500", f"{url}/500")
    elif copied == "bucket step":
        with jax_cb_ckpt.Checkpointer(f"{url}-elsewhere") as ckpt:
            ckpt.save(state, 500)
        copy_prefix(f"{url}-elsewhere/500", f"{url}/500", skip={"commit_success.txt"})
    else:
        put(f"{url}/500/.jax_cb_ckpt", b"a file of the user's")
        put(f"{url}/500/data.bin")
    before = {key: _remote.read(f"{url}/{key}")[0] for key in keys(url)}
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        ckpt = jax_cb_ckpt.Checkpointer(url)
        ckpt.save(state, 500)
        with pytest.raises(jax_cb_ckpt.SaveError, match="500' already exists and is not"):
            ckpt.close()
    after = {key: _remote.read(f"{url}/{key}")[0] for key in keys(url)}
    assert {k: v for k, v in after.items() if k != ".jax_cb_ckpt.lock"} == before
    assert jax_cb_ckpt.all_steps(url) == []
    reported = [w for w in seen if issubclass(w.category, jax_cb_ckpt.CheckpointWarning)]
    if copied == "foreign marker":
        assert reported == []
    else:
        [warning] = reported
        assert warning.category is jax_cb_ckpt.ForeignStepWarning
        assert f"'{url}/500'" in str(warning.message) and "left untouched" in str(warning.message)
        assert warning.filename == __file__  # the user's line: Checkpointer(url)


KILLED_AT_COMMIT = """
import os, signal, sys
import jax.numpy as jnp
import jax_cb_ckpt
from jax_cb_ckpt._storage import _places


def killed(self, temp, final, nbytes, sync):  # every file written, no commit marker
    if final.endswith("/2"):
        print("killed", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


with jax_cb_ckpt.Checkpointer(sys.argv[1]) as ckpt:
    ckpt.save({"w": jnp.full(10, 1.0)}, 1)
    ckpt.wait()
    _places.Bucket.commit = killed
    ckpt.save({"w": jnp.full(10, 2.0)}, 2)
"""


def test_a_whole_step_of_a_writer_killed_before_its_commit_is_removed(remote, tmp_path):
    """A writer SIGKILLed after every file of step 2 and before its commit marker: the
    next Checkpointer takes the lock over from it (its process is gone) and removes
    that step, which carries the dead holder's token, without a warning (a resumed run
    must be able to save step 2 again)."""
    url = remote.url
    child = start_script(tmp_path, KILLED_AT_COMMIT, url, ready="killed", env=remote.env)
    child.wait(timeout=60)
    kill_group(child)  # reaped, its pipes closed
    assert {".jax_cb_ckpt", "meta/metadata", "_CHECKPOINT_METADATA"} <= set(keys(f"{url}/2"))
    with jax_cb_ckpt.Checkpointer(url) as ckpt:
        assert keys(f"{url}/2") == []
        ckpt.save({"w": jnp.full(10, 3.0)}, 2)
    assert jax_cb_ckpt.all_steps(url) == [1, 2]
    assert jax_cb_ckpt.metadata(url)["step"] == 2


def _unfinished(url):
    from jax_cb_ckpt._storage import _places

    return _places.at(url).unfinished_steps()


def _first(seed):
    return np.random.default_rng(seed).standard_normal(8 << 20, dtype=np.float32)[0]


def test_a_named_step_committed_while_it_is_opened_is_read(remote, monkeypatch):
    """A named step whose writer commits it just after the read listed the step's objects
    (seen incomplete) is opened again and read, not reported as removed or unreadable;
    one still uncommitted is reported as the directory's listing reports it."""
    url = remote.url
    states = {step: {"x": jnp.arange(3.0) * step} for step in (1, 2)}
    with jax_cb_ckpt.Checkpointer(url) as ckpt:
        for step, state in states.items():
            ckpt.save(state, step)
    marker = f"{url}/2/commit_success.txt"
    committed = _remote.read(marker)[0]
    _remote.delete(marker)  # step 2: every object written, not yet committed
    original = _remote.list_and_read
    commits = [True]

    def list_and_read(where, names):
        found = original(where, names)
        if where == f"{url}/2" and commits:  # the writer commits step 2 right now
            commits.clear()
            _remote.write(marker, committed)
        return found

    monkeypatch.setattr(_remote, "list_and_read", list_and_read)
    assert_same_state(jax_cb_ckpt.restore(url, states[2], step=2), states[2])
    _remote.delete(marker)
    with pytest.raises(jax_cb_ckpt.NoCheckpointError, match=r"no checkpoint for step 2 .*\[2\]"):
        jax_cb_ckpt.restore(url, states[2], step=2)


def test_a_bucket_step_cut_short_is_neither_a_step_nor_a_plain_orbax_one(remote, capsys):
    """A writer stopped in the middle of step 2 leaves our marker and the state item
    (Orbax's `_METADATA` in it) but neither the step file nor the commit marker: that
    looked like a plain Orbax step without its step file, so a restart tried to resume
    from it and a new writer's save of step 2 was refused as another run's (found by
    the slow test of a writer paused past the stale time). It is an unfinished step of
    ours: the restart resumes from step 1, step 2 is written anew, `ls` shows it once."""
    from jax_cb_ckpt._cli import _main

    url = remote.url
    states = {step: {"x": jnp.arange(3.0) * step} for step in (1, 2)}
    with jax_cb_ckpt.Checkpointer(url) as ckpt:
        for step, state in states.items():
            ckpt.save(state, step)
    for name in ("commit_success.txt", "_CHECKPOINT_METADATA", "meta/metadata"):
        _remote.delete(f"{url}/2/{name}")
    assert "2/state/_METADATA" in keys(url) and _unfinished(url) == [(2, f"{url}/2")]
    assert _main.main(["ls", url, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["steps"]
    assert [(r["step"], r["complete"]) for r in rows] == [(1, True), (2, False)]
    assert set(rows[1]) == {"step", "saved_at", "bytes", "complete"}  # incomplete, once
    with jax_cb_ckpt.Checkpointer(url) as ckpt:
        state, start = ckpt.restore_or_init(lambda: states[1])
        assert start == 1
        ckpt.save(states[2], 2)  # the new writer writes step 2 over the cut-short one
    assert_same_state(jax_cb_ckpt.restore(url, states[2], step=2), states[2])


def test_a_step_missing_its_manifest_or_data_is_reported_with_a_fix(remote):
    """The database's manifest or data object deleted from a committed step: restore
    says the step was damaged and what to do (it was "... does not exist" alone)."""
    url = remote.url
    states = {step: {"x": jnp.arange(4.0) + step} for step in (1, 2, 3)}
    with jax_cb_ckpt.Checkpointer(url) as ckpt:
        for step, state in states.items():
            ckpt.save(state, step)
    _remote.delete(f"{url}/2/state/manifest.ocdbt")
    for key in keys(f"{url}/3/state/d"):
        _remote.delete(f"{url}/3/state/d/{key}")
    for step in (2, 3):
        with pytest.raises(jax_cb_ckpt.RestoreError, match=r"after it was written.*Fix:"):
            jax_cb_ckpt.restore(url, states[1], step=step)
    assert_same_state(jax_cb_ckpt.restore(url, states[1], step=1), states[1])


def test_named_steps_restore_concurrently_from_threads(remote):
    """Reads of different named steps at once in threads each get their own step: a
    read's in-memory manifest was kept in a store shared by every read of the process,
    so concurrent reads of other steps replaced it (most failed with TensorStore's
    "Configuration mismatch on uuid"; its check kept the numbers right)."""
    url = remote.url
    states = {step: {"x": jnp.arange(64.0) + step, "s": jnp.int32(step)} for step in range(1, 5)}
    with jax_cb_ckpt.Checkpointer(url) as ckpt:
        for step, state in states.items():
            ckpt.save(state, step)
    failures = []

    def reader(offset):
        for i in range(8):
            step = 1 + (offset + i) % 4
            try:
                assert_same_state(jax_cb_ckpt.restore(url, states[step], step=step), states[step])
            except Exception as e:  # noqa: BLE001 (collected, asserted below)
                failures.append(f"step {step}: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=reader, args=(k,)) for k in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(thread.is_alive() for thread in threads)
    assert failures == []


@THREE_SERVERS
def test_listing_and_retention_touch_only_our_steps(remote):
    """Foreign objects under the prefix (a plain Orbax step, a step-named prefix, files)
    are never listed, never restored and never deleted, even by retention."""
    url = remote.url
    foreign = ["7/_CHECKPOINT_METADATA", "7/state/x", "8/commit_success.txt", "README", "2023"]
    for key in foreign:
        put(f"{url}/{key}")
    with jax_cb_ckpt.Checkpointer(url, max_to_keep=1) as ckpt:
        for step in (1, 2, 3):
            ckpt.save({"x": jnp.float32(step)}, step)
    assert jax_cb_ckpt.all_steps(url) == [3]
    assert set(foreign) <= set(keys(url))


@THREE_SERVERS
def test_a_named_step_is_read_without_listing_the_directory(remote, monkeypatch):
    """A read of a named step lists only that step's objects, in the round trip that
    reads its description (a directory may hold thousands of steps, and a bucket's
    listing is a round trip of its own); a named step that is missing, damaged or
    foreign is still reported as a listing of the directory reports it."""
    url = remote.url
    states = {step: {"x": jnp.arange(4.0) + step, "s": jnp.int32(step)} for step in (1, 2)}
    with jax_cb_ckpt.Checkpointer(url) as ckpt:
        for step, state in states.items():
            ckpt.save(state, step)
    put(f"{url}/7/_CHECKPOINT_METADATA")  # a foreign step-named prefix
    _remote.delete(f"{url}/2/meta/metadata")  # step 2 committed, then damaged
    listed = []
    original = _remote.list_keys

    def list_keys(where):
        listed.append(where)
        return original(where)

    monkeypatch.setattr(_remote, "list_keys", list_keys)
    assert_same_state(jax_cb_ckpt.restore(url, states[1], step=1), states[1])
    assert jax_cb_ckpt.metadata(url, step=1)["step"] == 1
    assert jax_cb_ckpt.verify(url, step=1) == [1]
    assert listed == [f"{url}/1"] * 3
    for read in (
        lambda step: jax_cb_ckpt.restore(url, states[1], step=step),
        lambda step: jax_cb_ckpt.metadata(url, step=step),
        lambda step: jax_cb_ckpt.verify(url, step=step),
    ):
        with pytest.raises(jax_cb_ckpt.NoCheckpointError, match=r"no checkpoint for step 9"):
            read(9)
        with pytest.raises(jax_cb_ckpt.NoCheckpointError, match=r"the steps there are \[1\]"):
            read(7)
        with pytest.raises(jax_cb_ckpt.RestoreError, match=r"step 2 .* is damaged"):
            read(2)


@pytest.mark.slow
def test_a_two_process_run_writes_each_processes_shards_and_restores(remote, tmp_path):
    """2 processes x 4 CPU devices (jax.distributed, gloo): each process writes its own
    blocks into the bucket, process 0 merges and commits; both restore exactly."""
    from test_multiprocess import run_group  # the multi-process worker, in remote mode

    results = run_group(tmp_path, "remote", remote.url, env=remote.env)
    for i, (rc, found) in enumerate(results):
        assert rc == 0 and found is not None, (i, rc, found)
        assert found["steps"] == [2, 4] and found["exact"], found
    assert results[0][1]["shard_dirs"] == ["ocdbt.process_1"]


@pytest.mark.slow
def test_a_process_killed_mid_run_leaves_only_whole_steps_in_the_bucket(remote, tmp_path):
    """2 processes x 4 CPU devices write into the bucket; process 1 dies hard (exit 17)
    once step 6 is committed. Process 0's next save fails naming process 1 in bounded
    time; the bucket lists only whole steps; the next Checkpointer on the prefix removes
    what the dead run left unfinished; one process restores the last step exactly."""
    from test_multiprocess import PEER_TIMEOUT, Group, run_group

    group = Group(tmp_path, "remote_kill", remote.url, env=remote.env)
    (rc, found), (rc_dead, dead) = group.wait()
    assert rc_dead == 17 and dead is None, (rc_dead, group.errors(1))
    assert rc == 0 and found is not None, (rc, group.errors(0))
    error = found["second_run"]
    assert "SaveError" in error and "process 1" in error, found
    assert found["failed_after_s"] < PEER_TIMEOUT + 30, found
    steps = jax_cb_ckpt.all_steps(remote.url)
    assert steps[:3] == [2, 4, 6] and found["steps_after"] == steps, (steps, found)
    with jax_cb_ckpt.Checkpointer(remote.url):
        pass  # opening the prefix finishes off the dead run's unfinished steps
    assert _unfinished(remote.url) == []
    [(rc, restored)] = run_group(
        tmp_path, "restore", remote.url, nproc=1, devices=8, env=remote.env
    )
    assert rc == 0 and restored is not None and restored["exact"] is True, (rc, restored)
    assert restored["step"] == steps[-1], restored


# -- one writer per location -----------------------------------------------------------


HOLDER = """
import sys, time
import jax_cb_ckpt
ckpt = jax_cb_ckpt.Checkpointer(sys.argv[1])
print("holding", flush=True)
time.sleep(600)
"""


@pytest.mark.parametrize(
    "remote",
    # gcp-storage-emulator reports no generation when an object is read: the holder's
    # heartbeat is seen as a change of the lock's content.
    ["s3", "gcp-storage-emulator", pytest.param("gs", marks=pytest.mark.slow)],
    indirect=True,
)
def test_a_second_live_writer_is_refused(remote, tmp_path):
    child = start_script(tmp_path, HOLDER, remote.url, ready="holding", env=remote.env)
    try:
        start = time.monotonic()
        with pytest.raises(jax_cb_ckpt.DirectoryLockedError, match="another live writer"):
            jax_cb_ckpt.Checkpointer(remote.url)
        assert time.monotonic() - start < 3 * 5.0  # a heartbeat comes within BEAT_S
    finally:
        kill_group(child)


def test_a_dead_writers_lock_is_taken_over_with_a_warning(remote, tmp_path, caplog):
    """The holder was SIGKILLed on this host: its process is gone, so the lock is taken
    over at once, and the log says so."""
    child = start_script(tmp_path, HOLDER, remote.url, ready="holding", env=remote.env)
    kill_group(child)
    caplog.set_level(logging.WARNING, logger="jax_cb_ckpt")
    with jax_cb_ckpt.Checkpointer(remote.url) as ckpt:
        ckpt.save({"x": jnp.float32(1)}, 1)
    assert "took over the lock" in caplog.text
    assert f"pid {child.pid}" in caplog.text
    assert jax_cb_ckpt.all_steps(remote.url) == [1]


RELEASING_HOLDER = """
import os, sys, time
import jax_cb_ckpt
from jax_cb_ckpt._storage import _lock
_lock.ObjectLock.BEAT_S = 3600.0  # no beat while the next writer watches: only the release
ckpt = jax_cb_ckpt.Checkpointer(sys.argv[1])
print("holding", flush=True)
while not os.path.exists(sys.argv[2]):
    time.sleep(0.05)
ckpt.close()
print("closed", flush=True)
"""


@pytest.mark.parametrize("remote", ["s3", "gcp-storage-emulator"], indirect=True)
def test_a_lock_released_while_the_next_writer_waits_is_handed_over_not_taken_from_the_dead(
    remote, tmp_path, caplog
):
    """A holder that closes normally while the next writer watches its heartbeat: before,
    the next one logged "took over the lock ... no heartbeat for 30 s ... taken to be
    dead" and recorded the holder as dead (its uncommitted steps removed at the
    opening, whole or not). A released lock is a hand-over: taken at once, quietly."""
    from jax_cb_ckpt._storage import _lock

    go = tmp_path / "close"
    child = start_script(
        tmp_path, RELEASING_HOLDER, remote.url, go, ready="holding", env=remote.env
    )
    caplog.set_level(logging.INFO, logger="jax_cb_ckpt")
    waiting = threading.Event()

    class Waiting(logging.Handler):
        def emit(self, record):
            if "waiting up to" in record.getMessage():
                waiting.set()

    seen, opened = Waiting(), []
    logging.getLogger("jax_cb_ckpt").addHandler(seen)
    try:
        thread = threading.Thread(
            target=lambda: opened.append(_lock.ObjectLock(remote.url, ".jax_cb_ckpt.lock"))
        )
        thread.start()
        waiting.wait(10)  # (the next writer watches the holder now; bounded, STALE_S is 30)
        go.write_text("")
        thread.join(60)
        out, _ = child.communicate(timeout=60)
    finally:
        logging.getLogger("jax_cb_ckpt").removeHandler(seen)
        kill_group(child)
    assert "closed" in out
    [lock] = opened
    try:
        assert lock.taken_over_from == ""
        assert "took over" not in caplog.text and "dead" not in caplog.text
        assert waiting.is_set()  # it did wait for the holder, and says so (INFO)
    finally:
        lock.release()


def _reopened_without_a_takeover(remote, monkeypatch, caplog):
    """A second writer of `remote` opens and saves step 2 at once, with no warning."""
    from jax_cb_ckpt._storage import _lock

    monkeypatch.setattr(_lock.ObjectLock, "STALE_S", 2.0)  # a failure costs 2 s, not 30
    caplog.set_level(logging.WARNING, logger="jax_cb_ckpt")
    with jax_cb_ckpt.Checkpointer(remote.url) as ckpt:
        ckpt.save({"x": jnp.float32(2)}, 2)
    assert "took over" not in caplog.text


@THREE_SERVERS
def test_a_released_lock_is_taken_at_once_without_a_warning(remote, monkeypatch, caplog):
    """close() marks the lock object released, and the next writer takes it at once.
    Before, close() emptied it: gcp-storage-emulator never answers an upload of no
    bytes, so close() waited 5 s and the next opener watched the stale record for 30 s
    and took it over with a warning."""
    with jax_cb_ckpt.Checkpointer(remote.url) as ckpt:
        ckpt.save({"x": jnp.float32(1)}, 1)
    lock = _remote.read(f"{remote.url}/.jax_cb_ckpt.lock")[0]
    assert set(json.loads(lock)) == {"released"}
    _reopened_without_a_takeover(remote, monkeypatch, caplog)
    assert jax_cb_ckpt.all_steps(remote.url) == [1, 2]


def test_a_lock_emptied_by_an_earlier_version_reads_as_released(remote, monkeypatch, caplog):
    """Earlier versions emptied the lock object at close() (on the servers that take an
    upload of no bytes): that still means released."""
    put(f"{remote.url}/.jax_cb_ckpt.lock", b"")
    _reopened_without_a_takeover(remote, monkeypatch, caplog)
    assert jax_cb_ckpt.all_steps(remote.url) == [2]


@pytest.mark.slow
@pytest.mark.parametrize("remote", ["s3"], indirect=True)
@pytest.mark.parametrize(
    "content",
    [
        # a VM that is gone
        {"token": "t", "pid": 1, "host": "gone-vm", "since": "2026-01-01 00:00:00"},
        # this host's name and a dead pid, but another pid namespace (a container)
        {"token": "t", "pid": 2**22 + 7, "host": "here", "since": "x", "pid_space": "other"},
        5,  # JSON that is not a record
        [1, 2],
    ],
)
def test_a_lock_that_cannot_be_judged_at_once_is_watched_not_taken(
    remote, monkeypatch, caplog, content
):
    """Only a holder in this machine's own pid namespace can be seen dead at once; any
    other lock (another host, a container sharing the hostname, unreadable content) is
    taken over only after STALE_S without a heartbeat, with a warning naming it."""
    import socket

    from jax_cb_ckpt._storage import _lock

    if isinstance(content, dict) and content["host"] == "here":
        content["host"] = socket.gethostname()
    put(f"{remote.url}/.jax_cb_ckpt.lock", json.dumps(content).encode())
    monkeypatch.setattr(_lock.ObjectLock, "STALE_S", 2.0)
    caplog.set_level(logging.WARNING, logger="jax_cb_ckpt")
    start = time.monotonic()
    with jax_cb_ckpt.Checkpointer(remote.url):
        pass
    assert time.monotonic() - start >= 2.0
    assert "took over the lock" in caplog.text
    if isinstance(content, dict):
        assert f"on host {content['host']}" in caplog.text


PAUSED_WRITER = """
import os, signal, sys
import jax.numpy as jnp
import jax_cb_ckpt
from jax_cb_ckpt._storage import _places

write_meta = _places.Storage.write_meta


def pause_in_step_2(self, path, meta, *extra):  # a VM stopped just before the step's files
    if path.endswith("/2"):
        print("pausing", flush=True)
        os.kill(os.getpid(), signal.SIGSTOP)
    return write_meta(self, path, meta, *extra)


_places.Storage.write_meta = pause_in_step_2
try:
    with jax_cb_ckpt.Checkpointer(sys.argv[1]) as ckpt:
        ckpt.save({"w": jnp.full(1000, 1.0)}, 1)
        ckpt.wait()
        ckpt.save({"w": jnp.full(1000, 111.0)}, 2)
    print("committed", flush=True)
except jax_cb_ckpt.SaveError as e:
    print("failed:", e, flush=True)
"""


@pytest.mark.slow
@pytest.mark.parametrize("remote", ["s3"], indirect=True)
def test_a_writer_paused_past_the_stale_time_never_writes_into_the_new_holders_step(
    remote, tmp_path, monkeypatch
):
    """Writer A stops (SIGSTOP, a paused VM) in the middle of step 2; B finds no
    heartbeat, takes the location over, removes A's partial step and saves its own
    step 2. A resumes: its save fails, and B's step 2 restores exactly."""
    from jax_cb_ckpt._storage import _lock

    child = start_script(tmp_path, PAUSED_WRITER, remote.url, ready="pausing", env=remote.env)
    try:
        monkeypatch.setattr(_lock.ObjectLock, "STALE_S", 2.0)
        with jax_cb_ckpt.Checkpointer(remote.url) as ckpt:
            assert ckpt.all_steps() == [1]
            ckpt.save({"w": jnp.full(1000, 222.0)}, 2)
        os.kill(child.pid, signal.SIGCONT)
        out, _ = child.communicate(timeout=120)
    finally:
        kill_group(child)
    assert "failed:" in out and "step 2" in out, out
    assert jax_cb_ckpt.all_steps(remote.url) == [1, 2]
    restored = jax_cb_ckpt.restore(remote.url, {"w": jnp.zeros(1000)}, step=2)
    assert float(restored["w"][0]) == 222.0
    assert jax_cb_ckpt.verify(remote.url) == [1, 2]


def test_only_one_of_two_writers_racing_to_create_the_lock_wins(s3_server, monkeypatch):
    """S3's create-if-absent (If-None-Match): of two creates of the lock object, the
    second is refused; the lock is then held by the first."""
    from storage_servers import unique

    for name, value in s3_server.env().items():
        monkeypatch.setenv(name, value)
    bucket = unique("race")
    s3_server.make_bucket(bucket)
    url = f"s3://{bucket}/run/.jax_cb_ckpt.lock"
    assert _remote.write(url, b"first", if_equal=_remote.ABSENT) is not None
    assert _remote.write(url, b"second", if_equal=_remote.ABSENT) is None
    assert _remote.read(url)[0] == b"first"


def test_a_lock_taken_away_stops_the_writer(remote):
    """Someone else's writer took the lock (it judged ours stale): the next step is not
    written, with an error that says why, and nothing is committed."""
    url = remote.url
    with pytest.raises(jax_cb_ckpt.SaveError, match="no longer ours"):
        with jax_cb_ckpt.Checkpointer(url) as ckpt:
            ckpt.save({"x": jnp.float32(1)}, 1)
            ckpt.wait()
            put(f"{url}/.jax_cb_ckpt.lock", b'{"token": "other", "host": "h", "pid": 2}')
            ckpt.save({"x": jnp.float32(2)}, 2)
    assert jax_cb_ckpt.all_steps(url) == [1]


# -- faults ----------------------------------------------------------------------------


@pytest.mark.slow
def test_a_server_that_goes_away_fails_the_save_in_bounded_time_then_resumes(remote):
    """The server goes down mid-run (fake-gcs-server is killed with SIGKILL and started
    again on its files; moto, which keeps its objects in memory, goes away behind its
    proxy): the save fails with a SaveError naming the step and the URL (and no key)
    within the documented bound (60 s), the device does not wait for it, no partial
    step is listed; the server comes back and the run resumes from the last committed
    step."""
    url = remote.url
    state = big_state(1, mib=4)
    with pytest.raises(jax_cb_ckpt.SaveError) as raised:
        with jax_cb_ckpt.Checkpointer(url) as ckpt:
            ckpt.save(state, 1)
            ckpt.wait()
            remote.server.stop()
            start = time.monotonic()
            ckpt.save(state, 2)
            handed_off = time.monotonic() - start
            try:
                ckpt.wait()
            finally:
                waited = time.monotonic() - start
                remote.server.start()
    assert handed_off < 1.0
    assert waited < 60
    message = str(raised.value)
    assert "step 2" in message and url in message
    if remote.scheme == "s3":  # neither half of the key pair in the error
        for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
            assert remote.env[name] not in message
    assert jax_cb_ckpt.all_steps(url) == [1]
    with jax_cb_ckpt.Checkpointer(url) as ckpt:
        restored = ckpt.restore(state)
        assert_same_state(restored, state)
        ckpt.save(state, 2)
    assert jax_cb_ckpt.all_steps(url) == [1, 2]
    assert _unfinished(url) == []


@pytest.mark.slow
def test_transient_faults_are_retried_and_the_saves_commit(remote, tmp_path, monkeypatch):
    """Between the library and the server, a flaky proxy answers one request in ten
    with a transient fault, in turn an HTTP 503, an HTTP 429 and a reset connection.
    Saves, retention, listing and restore all go through (TensorStore's bounded
    retries, _remote._RETRIES), and each kind of fault was met."""
    from storage_servers import Proxy

    log = tmp_path / "faults"
    proxy = Proxy(remote.server.origin_port, flaky=(log, 10))
    try:
        for name, value in remote.server.env(proxy.port).items():
            monkeypatch.setenv(name, value)
        state = big_state(3, mib=2)
        with jax_cb_ckpt.Checkpointer(remote.url, max_to_keep=1) as ckpt:
            for step in (1, 2):
                ckpt.save(dict(state, step=jnp.int32(step)), step)
                ckpt.wait()
            assert ckpt.all_steps() == [2]
            assert_same_state(ckpt.restore(state), dict(state, step=jnp.int32(2)))
    finally:
        proxy.kill()
    faults = log.read_text().split()
    assert {"503", "429", "reset"} <= set(faults), faults


@pytest.mark.slow
@pytest.mark.parametrize("remote", ["s3"], indirect=True)
def test_a_server_that_hangs_fails_the_save_in_bounded_time(remote):
    """The server accepts connections and never answers (TensorStore sets no request
    timeout): the stalled requests are given up and the save fails within 60 s."""
    url = remote.url
    with pytest.raises(jax_cb_ckpt.SaveError, match="step 2") as raised:
        with jax_cb_ckpt.Checkpointer(url) as ckpt:
            ckpt.save({"x": jnp.float32(1)}, 1)
            ckpt.wait()
            remote.server.hang()
            start = time.monotonic()
            ckpt.save({"x": jnp.float32(2)}, 2)
            try:
                ckpt.wait()
            finally:
                waited = time.monotonic() - start
                remote.server.stop()
                remote.server.start()
    assert waited < 60, waited
    assert url in str(raised.value)
    assert jax_cb_ckpt.all_steps(url) == [1]


# -- configuration errors --------------------------------------------------------------


@pytest.mark.parametrize(
    "url, match",
    [
        ("hdfs://cluster/ckpt", "hdfs:// scheme"),
        ("gcs://bucket/run", "Google Cloud Storage is gs://"),
        ("s3:/bucket/run", "slash missing"),
        ("gs:bucket/run", "slash missing"),
        ("s3://B/run", "not a valid bucket name"),
        ("gs://bucket/../run", "'..'"),
    ],
)
def test_unknown_and_malformed_urls_are_config_errors(url, match, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for call in (
        lambda: jax_cb_ckpt.Checkpointer(url),
        lambda: jax_cb_ckpt.all_steps(url),
        lambda: jax_cb_ckpt.latest_step(url),
        lambda: jax_cb_ckpt.metadata(url),
        lambda: jax_cb_ckpt.verify(url),
        lambda: jax_cb_ckpt.restore(url, {}),
    ):
        with pytest.raises(jax_cb_ckpt.ConfigError, match=match):
            call()
    assert os.listdir(tmp_path) == []  # never a local folder


def test_credentials_in_a_url_are_refused_without_repeating_them():
    with pytest.raises(jax_cb_ckpt.ConfigError) as raised:
        jax_cb_ckpt.Checkpointer("s3://AKIAEXAMPLE:s3cr3t@bucket/run")
    assert "s3cr3t" not in str(raised.value) and "AKIAEXAMPLE" not in str(raised.value)


def test_a_bucket_that_does_not_exist_is_a_config_error(remote):
    url = f"{remote.scheme}://no-such-bucket-{os.getpid()}/run"
    with pytest.raises(jax_cb_ckpt.ConfigError, match="does not exist"):
        jax_cb_ckpt.Checkpointer(url)
    if remote.scheme == "s3":  # GCS lists a missing bucket as empty (docs/storage.md)
        with pytest.raises(jax_cb_ckpt.ConfigError, match="does not exist"):
            jax_cb_ckpt.all_steps(url)
        # A named step is opened without listing the directory first: the error is the
        # same kind (it was a bare StorageError, an OSError, after a second listing).
        for read in (
            lambda: jax_cb_ckpt.restore(url, {"x": np.zeros(2)}, step=1),
            lambda: jax_cb_ckpt.metadata(url, step=1),
            lambda: jax_cb_ckpt.verify(url, step=1),
        ):
            with pytest.raises(jax_cb_ckpt.ConfigError, match="does not exist"):
                read()
    else:
        assert jax_cb_ckpt.all_steps(url) == []


def test_no_credential_reaches_metadata_errors_or_logs(s3_server, monkeypatch, caplog):
    from storage_servers import unique

    for name, value in s3_server.env().items():
        monkeypatch.setenv(name, value)
    secret = os.environ["AWS_SECRET_ACCESS_KEY"]
    bucket = unique("cred")
    s3_server.make_bucket(bucket)
    url = f"s3://{bucket}/run"
    caplog.set_level(logging.DEBUG)
    with jax_cb_ckpt.Checkpointer(url) as ckpt:
        ckpt.save({"x": jnp.float32(1)}, 1)
    meta = json.dumps(jax_cb_ckpt.metadata(url))
    with pytest.raises(jax_cb_ckpt.ConfigError) as raised:
        jax_cb_ckpt.all_steps(f"s3://no-such-{bucket}/run")
    for text in (meta, str(raised.value), caplog.text):
        assert secret not in text and os.environ["AWS_ACCESS_KEY_ID"] not in text


def _denying(remote, tmp_path, monkeypatch, text):
    """A proxy in front of `remote`'s server denying the requests whose request line
    holds `text` as a server denies a wrong secret, echoing the request's credentials
    (tcp_proxy.py's deny mode), and an environment pointing at it with credentials of
    the test's own (GCS: TensorStore keeps the token it read first in the process):
    (proxy, its log, that environment)."""
    from storage_servers import Proxy

    log = tmp_path / f"denied-{len(list(tmp_path.iterdir()))}"
    proxy = Proxy(remote.server.origin_port, deny=(log, text))
    env = dict(remote.server.env(proxy.port))
    if remote.scheme == "s3":
        env.update(AWS_ACCESS_KEY_ID="AKIAECHOED7F3A2KEYID", AWS_SECRET_ACCESS_KEY="echo-9c2e41")
    else:
        env.update(GOOGLE_AUTH_TOKEN_FOR_TESTING="ya29.echoed-token-5d1b77")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return proxy, log, env


def _secrets(log, env):
    """The credentials the denied requests carried and the server echoed: the key id
    and the signature (S3), the bearer token (GCS), and the key pair itself."""
    sent = [line.split("\t", 1)[1] for line in log.read_text().splitlines()]
    assert sent, "no request was denied"
    found = {env.get("AWS_ACCESS_KEY_ID"), env.get("AWS_SECRET_ACCESS_KEY")}
    for auth in sent:
        found.update(re.findall(r"Credential=([^/]+)/|Signature=([0-9a-f]+)|Bearer (\S+)", auth))
    # (GCS: the token TensorStore sends is the one it read first in this process,
    # "emulator" when an earlier test used the emulator; it is what the proxy echoed.)
    return {x for item in found for x in (item if isinstance(item, tuple) else [item]) if x}


def _full_text(error):
    """An exception as a traceback prints it, with its causes and contexts."""
    return "".join(traceback.format_exception(error))


@pytest.mark.parametrize("remote", ["s3", "gs"], indirect=True)
def test_no_credential_a_server_echoes_reaches_an_error_a_log_or_the_cli(
    remote, tmp_path, monkeypatch, caplog
):
    """A server that denies every request as S3 denies a wrong secret: a 403 whose body
    echoes `<AWSAccessKeyId>`, the string to sign, the signature, the canonical request
    (with the Authorization header) and a signed URL (GCS: the bearer token, as
    `access_token` and in an Authorization header). The errors of opening and listing
    (tracebacks with their causes), the CLI's output and every log line still say 403
    and what the server answered, and none of the credentials. (Before, the key id and
    the signed URL were in the ConfigError and in the CLI's output.)"""
    proxy, log, env = _denying(remote, tmp_path, monkeypatch, "")
    caplog.set_level(logging.DEBUG)
    try:
        with pytest.raises(jax_cb_ckpt.ConfigError) as opening:
            jax_cb_ckpt.Checkpointer(remote.url)
        # TensorStore's gcs driver answers a listing refused with 403 as an empty one
        # (no error to scrub there: all_steps is [] and `ls` finds no steps).
        with (
            pytest.raises(jax_cb_ckpt.ConfigError)
            if remote.scheme == "s3"
            else (contextlib.nullcontext()) as listing
        ):
            jax_cb_ckpt.all_steps(remote.url)
        cli = run_child(["python", "-m", "jax_cb_ckpt", "ls", remote.url], env=env, timeout=120)
    finally:
        proxy.kill()
    errors = [_full_text(opening.value)]
    if remote.scheme == "s3":
        assert cli.returncode != 0
        errors += [_full_text(listing.value), cli.stderr]
    what = "SignatureDoesNotMatch" if remote.scheme == "s3" else "PERMISSION_DENIED"
    for text in errors:
        assert "403" in text and what in text, text
    for secret in _secrets(log, env):
        for text in [*errors, cli.stdout, cli.stderr, caplog.text]:
            assert secret not in text, (secret, text)


@pytest.mark.parametrize("remote", ["s3", "gs"], indirect=True)
def test_no_credential_a_server_echoes_reaches_a_save_error(remote, tmp_path, monkeypatch, caplog):
    """The same server denies only the writes of a step's arrays (TensorStore's own
    requests, not the library's object operations): the SaveError (with its causes)
    and the log lines name the step and the 403, and no credential."""
    proxy, log, env = _denying(remote, tmp_path, monkeypatch, "state")
    caplog.set_level(logging.DEBUG)
    try:
        with pytest.raises(jax_cb_ckpt.SaveError, match="step 1") as raised:
            with jax_cb_ckpt.Checkpointer(remote.url) as ckpt:
                ckpt.save({"w": jnp.arange(8.0)}, 1)
    finally:
        proxy.kill()
    text = _full_text(raised.value)
    assert "403" in text, text
    for secret in _secrets(log, env):
        assert secret not in text and secret not in caplog.text, secret


def test_s3_credentials_from_a_profile_and_the_generic_endpoint(s3_server, tmp_path):
    """The other standard ways to configure S3, in a child process with no credential
    in its environment: the key pair in a shared credentials file under a named profile
    (AWS_SHARED_CREDENTIALS_FILE, AWS_PROFILE), the endpoint in AWS_ENDPOINT_URL (for
    every service) and the region in AWS_DEFAULT_REGION. moto refuses unsigned
    requests (403), so a save, a listing and a restore that go through were signed with
    the profile's key pair; neither half of it appears in what the child printed, in
    the step's metadata or in the error for a bucket that does not exist. (TensorStore's
    default chain, given no profile name, loads none: the case this test found.)"""
    from storage_servers import unique

    bucket = unique("profile")
    s3_server.make_bucket(bucket)
    key_id, secret = "profile-key-id-7f3a", "profile-secret-9c2e41"
    credentials = tmp_path / "credentials"
    credentials.write_text(
        f"[ckpt]\naws_access_key_id = {key_id}\naws_secret_access_key = {secret}\n"
    )
    endpoint = s3_server.env()["AWS_ENDPOINT_URL_S3"]
    env = {name: "" for name in s3_server.env()}  # none of the usual variables
    env.update(
        AWS_SHARED_CREDENTIALS_FILE=str(credentials),
        AWS_CONFIG_FILE=str(tmp_path / "no-config"),
        AWS_PROFILE="ckpt",
        AWS_ENDPOINT_URL=endpoint,
        AWS_DEFAULT_REGION="us-east-1",
        AWS_EC2_METADATA_DISABLED="true",
    )
    code = f"""
import json
import jax.numpy as jnp
import jax_cb_ckpt
from jax_cb_ckpt._storage import _remote
url = "s3://{bucket}/run"
assert _remote.kvstore_spec(url)["aws_credentials"] == {{"type": "default", "profile": "ckpt"}}
with jax_cb_ckpt.Checkpointer(url) as ckpt:
    ckpt.save({{"x": jnp.arange(4.0)}}, 1)
    ckpt.wait()
    print("steps", ckpt.all_steps())
    print("restored", ckpt.restore({{"x": jnp.zeros(4)}})["x"].tolist())
print("meta", json.dumps(jax_cb_ckpt.metadata(url)))
try:
    jax_cb_ckpt.all_steps("s3://no-such-{bucket}/run")
except jax_cb_ckpt.ConfigError as e:
    print("error", e)
"""
    result = run_child(["python", "-c", code], env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    printed = result.stdout
    assert "steps [1]" in printed and "restored [0.0, 1.0, 2.0, 3.0]" in printed
    assert "meta {" in printed and "error " in printed
    for text in (printed, result.stderr):
        assert key_id not in text and secret not in text


# -- plain tools -----------------------------------------------------------------------


@pytest.mark.slow  # (gcsfs, which Orbax needs for gs://, comes with the slow extra)
@needs("gcsfs", "slow")
@pytest.mark.parametrize("remote", ["gs"], indirect=True)
def test_plain_orbax_restores_a_gs_step(remote):
    """Orbax alone (gcsfs for the files, TensorStore for the arrays, both pointed at the
    emulator by STORAGE_EMULATOR_HOST) reads a step in the bucket."""
    state = {"w": jnp.arange(1000, dtype=jnp.float32), "n": {"b": jnp.ones((3, 2), jnp.int8)}}
    with jax_cb_ckpt.Checkpointer(remote.url) as ckpt:
        ckpt.save(state, 5)
    code = f"""
import numpy as np, orbax.checkpoint as ocp
tree = ocp.StandardCheckpointer().restore("{remote.url}/5/state")
print(tree["w"].sum(), tree["n"]["b"].sum(), type(tree["w"]).__name__)
"""
    env = dict(
        remote.env,
        TENSORSTORE_GCS_HTTP_URL=remote.env["STORAGE_EMULATOR_HOST"],
        # gcsfs >= 2025 probes a bucket's type over gRPC first: 60 s per call here.
        GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT="false",
    )
    result = run_child(["python", "-c", code], env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split()[:2] == ["499500.0", "6"]


@pytest.mark.parametrize("remote", ["s3"], indirect=True)
def test_an_s3_step_copied_to_a_folder_is_a_plain_orbax_checkpoint(remote, tmp_path):
    state = {"w": jnp.arange(1000, dtype=jnp.float32), "n": {"b": jnp.ones((3, 2), jnp.int8)}}
    with jax_cb_ckpt.Checkpointer(remote.url) as ckpt:
        ckpt.save(state, 5)
    source = ts.KvStore.open(_remote.kvstore_spec(f"{remote.url}/5")).result()
    target = ts.KvStore.open({"driver": "file", "path": str(tmp_path / "5") + "/"}).result()
    for key in source.list().result():
        target.write(key, source.read(key).result().value).result()
    tree = ocp.StandardCheckpointer().restore(str(tmp_path / "5" / "state"))
    np.testing.assert_array_equal(tree["w"], np.asarray(state["w"]))
    np.testing.assert_array_equal(tree["n"]["b"], np.asarray(state["n"]["b"]))
    # ... and it is one of our steps there too.
    assert jax_cb_ckpt.all_steps(tmp_path) == [5]
    assert_same_state(jax_cb_ckpt.restore(tmp_path, state), state)


@pytest.mark.slow
def test_the_cli_reads_a_bucket(remote):
    with jax_cb_ckpt.Checkpointer(remote.url) as ckpt:
        ckpt.save({"x": jnp.arange(4.0)}, 3)
    for command in (["ls"], ["show"], ["verify"]):
        args = ["python", "-m", "jax_cb_ckpt", *command, remote.url, "--json"]
        result = run_child(args, env=remote.env, timeout=120)
        assert result.returncode == 0, result.stderr
        json.loads(result.stdout)


RECIPE_CHECK = """
python - <<'PY'
import numpy as np, jax_cb_ckpt
url = "{scheme}://my-bucket/runs/recipe"
state = {{"w": np.arange(5.0, dtype=np.float32)}}
with jax_cb_ckpt.Checkpointer(url) as ckpt:
    ckpt.save(state, 7)
assert jax_cb_ckpt.all_steps(url) == [7]
assert jax_cb_ckpt.same_bits(jax_cb_ckpt.restore(url, state), state)
print("recipe ok")
PY
"""


def _recipe_blocks():
    with open(os.path.join(os.path.dirname(__file__), "..", "docs", "storage.md")) as f:
        page = f.read()
    section = page.split("## Trying it on your machine")[1].split("\n## ")[0]
    return re.findall(r"^```bash\n(.*?)^```$", section, re.M | re.S)


@pytest.mark.parametrize("scheme, port", [("s3", "S3_PORT"), ("gs", "GCS_PORT")])
def test_the_page_s_local_server_steps_run_as_written(tmp_path, scheme, port):
    """docs/storage.md's steps to start a local server (issue 30 item 2: the page named
    moto and fake-gcs-server but not how to start them, create a bucket, or that the
    fake-gcs-server binary needs -scheme http): each block runs as written (but its
    `pip install`, done by the test extra, and on a free port), then a save, a listing
    and a restore go through the server it started."""
    (block,) = [b for b in _recipe_blocks() if port in b]
    lines = [line for line in block.splitlines() if not line.startswith("pip install")]
    script = tmp_path / "recipe.sh"
    script.write_text(
        f'set -e\ncd "{tmp_path}"\n' + "\n".join(lines) + RECIPE_CHECK.format(scheme=scheme)
    )
    out, err = tmp_path / "out.txt", tmp_path / "err.txt"
    child = start_process(["bash", str(script)], env={port: str(free_port())}, logs=(out, err))
    try:
        child.wait(timeout=180)
    finally:
        with contextlib.suppress(ProcessLookupError):  # the server bash left running
            os.killpg(child.pid, signal.SIGKILL)
        kill_group(child)
    assert child.returncode == 0, err.read_text()[-3000:]
    assert "recipe ok" in out.read_text(), out.read_text()


@pytest.mark.parametrize("remote", ["s3"], indirect=True)
def test_a_step_out_of_reach_at_a_restart_is_raised_scrubbed_and_nothing_moves(
    remote, tmp_path, monkeypatch
):
    """A restart whose newest step cannot be read (the server refuses its objects, a
    403 that echoes the credentials) raises, saying so, and does not go back to an
    older step nor set anything aside: only damage is passed over (docs/resume.md). The
    read side's errors are scrubbed as the write side's are (docs/storage.md)."""
    with jax_cb_ckpt.Checkpointer(remote.url) as ckpt:
        for step in (1, 2, 3):
            ckpt.save(state_at(step), step)
    keys = sorted(_remote.list_keys(remote.url))
    proxy, log, env = _denying(remote, tmp_path, monkeypatch, "/3/state/")
    try:
        with jax_cb_ckpt.Checkpointer(remote.url) as ckpt:
            with pytest.raises(jax_cb_ckpt.CheckpointError) as raised:
                ckpt.restore_or_init(lambda: state_at(0))
        with pytest.raises(jax_cb_ckpt.CheckpointError) as read:
            jax_cb_ckpt.verify(remote.url, step=3)
        left = sorted(_remote.list_keys(remote.url))  # (listings are not refused)
    finally:
        proxy.kill()
    for error in (raised.value, read.value):
        text = _full_text(error)
        assert "403" in text and not isinstance(error, jax_cb_ckpt.DamagedStepError), text
        assert not [s for s in _secrets(log, env) if s in text], text
    assert [k for k in left if "lock" not in k] == [k for k in keys if "lock" not in k]
