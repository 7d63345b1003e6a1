"""Incremental saves (`Checkpointer(incremental=True)`) in jit and under vmap, as every
other save (issue 57, item 4), with a ring buffer that changes by a slice per save:

- `maybe_save` in a jitted `lax.scan`: every saved step restores bit for bit, and the
  saves after the first wrote a small fraction of the state (`stats.recent`); the
  later steps' data files are hard links of the earlier ones';
- `jit(vmap(train))` over seeds: the same, each member restored alone (`member=k`);
- sharded over a (4, 2) mesh of 8 CPU devices, in a subprocess
  (tests/incremental_worker.py): each device's unchanged blocks linked;
- two processes (jax.distributed, gloo), each linking its own part of the step
  (`state/ocdbt.process_1/d/` for process 1), both writing little; the newest step
  restores exactly on both processes and in one process alone, also once the steps
  before it are deleted (the links keep the bytes); in both buckets too.

The basics of one eager process (whole steps, full_every, retention in any order,
damage) are tests/test_incremental.py's."""

import shutil
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from helpers import ProcessGroup, free_port
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_cb_ckpt

# The ring buffer: 32 MiB of float32, 4 KiB a row. An incremental Checkpointer cuts a
# leaf written whole into chunks of 256 KiB here (64 rows: `_store.chunks_to_link`);
# each step writes SLICE rows, inside one chunk.
ROWS, COLS, SLICE = 8192, 1024, 64
STEPS = 5


def ring_state():
    return {
        "buffer": jnp.zeros((ROWS, COLS), jnp.float32),
        "params": {"w": jnp.arange(4096, dtype=jnp.float32) / 7, "b": jnp.ones(16)},
        "count": jnp.int32(0),
    }


def ring_update(state, step):
    """One step: a slice of the ring written (at row SLICE * step), the params moved;
    exact in float32 whatever XLA fuses (a multiplication by 0.5 and an exact sum)."""
    new = jnp.arange(SLICE * COLS, dtype=jnp.float32).reshape(SLICE, COLS)
    new = new + step.astype(jnp.float32) * 1e3
    at = (step * SLICE) % state["buffer"].shape[0]
    return {
        "buffer": jax.lax.dynamic_update_slice(state["buffer"], new, (at, 0)),
        "params": {"w": state["params"]["w"] * 0.5 + 1.0, "b": state["params"]["b"] + 1.0},
        "count": state["count"] + 1,
    }


def ring_references(state, steps):
    """The state after each step, one jitted update at a time (step k: k updates)."""
    out, update = {}, jax.jit(ring_update)
    for k in range(1, steps + 1):
        state = update(state, jnp.int32(k))
        out[k] = jax.device_get(state)
    return out


def linked_files(directory, step):
    """The state item's data files of `step` that have other links (an earlier or
    later step's), and all of them."""
    files = [p for p in (Path(directory) / str(step) / "state").rglob("d/*") if p.is_file()]
    return [p for p in files if p.stat().st_nlink > 1], files


def assert_incremental(ckpt, nbytes, steps, members=1):
    """The first save written whole, every later one about what changed: the ring's
    slice (of every member) and the params, not the `nbytes` of the state."""
    records = {r.step: r for r in ckpt.stats.recent}
    assert sorted(records) == steps, records
    first, *later = steps
    assert records[first].written_bytes >= nbytes * 0.99, records[first]
    changed = members * SLICE * COLS * 4
    for step in later:
        assert changed <= records[step].written_bytes <= 2 * changed, records[step]
        assert records[step].written_bytes <= nbytes // 16, records[step]


def test_maybe_save_in_a_jitted_scan_links_what_did_not_change(make_ckpt, ckpt_dir):
    state = ring_state()
    refs = ring_references(state, STEPS)
    ckpt = make_ckpt(incremental=True, every=1)

    def body(s, i):
        s = ring_update(s, i)
        ckpt.maybe_save(s, i)
        return s, None

    jax.block_until_ready(
        jax.jit(lambda s: jax.lax.scan(body, s, jnp.arange(1, STEPS + 1))[0])(state)
    )
    ckpt.wait()
    steps = list(range(1, STEPS + 1))
    assert ckpt.all_steps() == steps
    for step in steps:
        assert jax_cb_ckpt.same_bits(ckpt.restore(state, step=step), refs[step]), step
    nbytes = sum(x.nbytes for x in jax.tree.leaves(state))
    assert_incremental(ckpt, nbytes, steps)
    for step in steps:
        if step > 1:  # most of the bytes are in files shared with another step
            linked, files = linked_files(ckpt_dir, step)
            shared = sum(p.stat().st_size for p in linked)
            assert shared >= 0.9 * sum(p.stat().st_size for p in files), step
    assert jax_cb_ckpt.verify(ckpt_dir) == steps
    # The newest step alone: the others deleted, it still restores (links keep bytes).
    for step in steps[:-1]:
        shutil.rmtree(ckpt_dir / str(step))
    assert jax_cb_ckpt.same_bits(jax_cb_ckpt.restore(ckpt_dir, state), refs[STEPS])


SEEDS = 4  # members of the batch; the ring is ROWS // SEEDS rows per member


def member_state(seed):
    state = ring_state()
    return {
        "buffer": jnp.zeros((ROWS // SEEDS, COLS), jnp.float32) + seed,
        "params": jax.tree.map(lambda x: x + seed, state["params"]),
        "count": jnp.int32(seed),
    }


def test_jit_vmap_over_seeds_links_and_each_member_restores(make_ckpt, ckpt_dir):
    ckpt = make_ckpt(incremental=True, every=1)

    def train(state):
        def body(s, i):
            s = ring_update(s, i)
            ckpt.maybe_save(s, i)
            return s, None

        return jax.lax.scan(body, state, jnp.arange(1, STEPS + 1))[0]

    batch = jax.vmap(member_state)(jnp.arange(SEEDS))
    jax.block_until_ready(jax.jit(jax.vmap(train))(batch))
    ckpt.wait()
    steps = list(range(1, STEPS + 1))
    assert ckpt.all_steps() == steps
    like = jax.eval_shape(lambda: member_state(0))
    for seed in range(SEEDS):
        refs = ring_references(member_state(seed), STEPS)
        for step in steps:
            got = jax_cb_ckpt.restore(ckpt_dir, like, step=step, member=seed)
            assert jax_cb_ckpt.same_bits(got, refs[step]), (seed, step)
    nbytes = sum(x.nbytes for x in jax.tree.leaves(batch))
    assert_incremental(ckpt, nbytes, steps, members=SEEDS)
    linked, files = linked_files(ckpt_dir, STEPS)
    assert sum(p.stat().st_size for p in linked) >= 0.9 * sum(p.stat().st_size for p in files)


def test_a_ring_split_along_its_batch_axis_links_within_each_block(make_ckpt, ckpt_dir):
    """4 devices in process (conftest), a (2, 2) mesh: every save changes a slice of
    every device's block, so each block is cut into chunks (before, one chunk per
    block: every save wrote the whole state)."""
    mesh = jax.make_mesh((2, 2), ("a", "b"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    shardings = {
        "buffer": NamedSharding(mesh, P("a", None, "b")),
        "params": NamedSharding(mesh, P("b")),
    }

    def update(s, i):
        new = jnp.full((4, SLICE // 4, COLS), i, jnp.float32)
        at = (i * SLICE) % s["buffer"].shape[1]  # each step in another chunk
        buffer = jax.lax.dynamic_update_slice(s["buffer"], new, (0, at, 0))
        return {"buffer": buffer, "params": s["params"] * 0.5 + 1.0}

    state = jax.device_put(
        {"buffer": jnp.zeros((4, ROWS // 4, COLS)), "params": jnp.arange(4096.0)}, shardings
    )
    ckpt = make_ckpt(incremental=True, every=1)

    def body(s, i):
        s = update(s, i)
        ckpt.maybe_save(s, i, shardings=shardings)
        return s, None

    jax.jit(lambda s: jax.lax.scan(body, s, jnp.arange(1, STEPS + 1))[0])(state)
    ckpt.wait()
    steps = list(range(1, STEPS + 1))
    assert ckpt.all_steps() == steps
    nbytes = sum(x.nbytes for x in jax.tree.leaves(state))
    step_fn = jax.jit(update, out_shardings=shardings)
    for step in steps:
        state = step_fn(state, jnp.int32(step))
        got = ckpt.restore(state, step=step)
        assert got["buffer"].sharding == shardings["buffer"]
        assert jax_cb_ckpt.same_bits(jax.device_get(got), jax.device_get(state)), step
    written = {r.step: r.written_bytes for r in ckpt.stats.recent}
    assert written[1] >= 0.99 * nbytes and max(written[s] for s in steps[1:]) <= nbytes // 8


# -- 8 devices, one process or two (tests/incremental_worker.py) ---------------------------

WORKER = Path(__file__).with_name("incremental_worker.py")
TIMEOUT = 240  # a run takes ~10-20 s here; a hang never ends


def run_worker(tmp_path, mode, directory, nproc, env=None):
    port = free_port()
    commands = [
        [sys.executable, str(WORKER), mode, str(pid), str(nproc), str(port), str(directory)]
        for pid in range(nproc)
    ]
    results = ProcessGroup(tmp_path, f"{mode}-{nproc}", commands, env=env).wait(TIMEOUT)
    for pid, (rc, found) in enumerate(results):
        assert rc == 0 and found is not None, (pid, rc, found)
    return [found for _, found in results]


def inodes(folder):
    """{inode: name} of the files right in `folder`."""
    return {p.stat().st_ino: p.name for p in Path(folder).iterdir() if p.is_file()}


def assert_trained_incrementally(findings, steps):
    for found in findings:
        assert found["steps"] == steps, found
        assert all(found["exact"][str(s)] for s in steps), found
        nbytes, written = found["nbytes"], found["written_bytes"]
        first, *later = map(str, steps)
        # This process's share of the state is written once, then little: the chunks
        # of its blocks that changed (8 of 1024 rows of each: one 256 KiB chunk of each
        # 4 MiB block, 1/16 of the state) and the params.
        assert written[first] >= nbytes[first] // len(findings) * 0.99, found
        for step in later:
            assert 0 < written[step] <= nbytes[step] // 12, found


def assert_newest_restores_alone(tmp_path, directory, steps):
    """The steps before the newest deleted: it restores exactly in one process."""
    for step in steps[:-1]:
        shutil.rmtree(directory / str(step))
    [found] = run_worker(tmp_path, "restore", directory, 1)
    assert found["step"] == steps[-1] and found["exact"] is True, found
    assert found["plain_orbax_exact"] is True, found


@pytest.mark.slow
def test_a_sharded_state_links_each_device_s_unchanged_chunks(tmp_path):
    directory = tmp_path / "ckpt"
    steps = [1, 2, 3, 4]
    findings = run_worker(tmp_path, "train", directory, 1)
    assert findings[0]["devices"] == 8, findings
    assert_trained_incrementally(findings, steps)
    for step in steps[1:]:
        linked, files = linked_files(directory, step)
        shared = sum(p.stat().st_size for p in linked)
        assert shared >= 0.9 * sum(p.stat().st_size for p in files), step
        previous = inodes(directory / str(step - 1) / "state" / "d")
        assert set(inodes(directory / str(step) / "state" / "d")) & set(previous), step
    assert jax_cb_ckpt.verify(directory) == steps
    assert_newest_restores_alone(tmp_path, directory, steps)


# In the default suite, as tests/test_multiprocess.py's 2-process run (~9 s here, quiet).
def test_each_process_links_its_own_part(tmp_path):
    directory = tmp_path / "ckpt"
    steps = [1, 2, 3, 4]
    findings = run_worker(tmp_path, "train", directory, 2)
    assert [f["process"] for f in findings] == [0, 1], findings
    assert_trained_incrementally(findings, steps)
    for step in steps[1:]:
        # Each process's database of a later step holds the files of its own database
        # in the step before (the same inodes), and most of its bytes are in them.
        for part in ("state/d", "state/ocdbt.process_1/d"):
            now, before = (directory / str(s) / part for s in (step, step - 1))
            shared = set(inodes(now)) & set(inodes(before))
            assert shared, (step, part)
            size = sum(p.stat().st_size for p in now.iterdir())
            kept = sum(p.stat().st_size for p in now.iterdir() if p.stat().st_ino in shared)
            assert kept >= 0.9 * size, (step, part, kept, size)
    assert jax_cb_ckpt.verify(directory) == steps
    assert_newest_restores_alone(tmp_path, directory, steps)


@pytest.mark.slow
@pytest.mark.parametrize("remote", ["s3", "gs"], indirect=True)
def test_each_process_copies_its_own_part_in_a_bucket(tmp_path, remote):
    """The same two processes, the steps in a bucket (server-side copies, not links)."""
    steps = [1, 2, 3, 4]
    findings = run_worker(tmp_path, "train", remote.url, 2, env=remote.env)
    assert_trained_incrementally(findings, steps)
    assert jax_cb_ckpt.verify(remote.url) == steps
