"""Incremental saves against a hostile or damaged directory, a kill, odd states: what an
adversarial pass over `Checkpointer(..., incremental=True)` found (docs/usage.md,
"Incremental saves"). Real parts: real Orbax, real files, real subprocesses.
"""

from __future__ import annotations

import os
import random
import sys
import textwrap
import time

import jax
import numpy as np
import pytest
from helpers import kill_group, start_process, wait_for_step

import jax_cb_ckpt

B, T, F = 4, 2048, 256  # 8 MiB of float32


def _states(saves, shape=(B, T, F)):
    """A ring buffer written a slice further each save, and a small leaf."""
    rng = np.random.default_rng(0)
    buf = rng.standard_normal(shape, dtype=np.float32)
    width = shape[1] // 32
    out = []
    for i in range(saves):
        buf = buf.copy()
        buf[:, i * width : (i + 1) * width] = np.float32(i)
        out.append({"buf": buf, "small": np.full((8,), i, np.float32)})
    return out


def _like(state):
    return jax.tree.map(np.zeros_like, state)


def _data_dir(directory, step):
    return os.path.join(directory, str(step), "state", "d")


def _last(ckpt):
    record = ckpt.stats.recent[-1]
    return record.written_bytes, record.nbytes


def _whole_and_readable(directory, states, steps):
    for step in steps:
        jax_cb_ckpt.verify(directory, step=step)
        got = jax_cb_ckpt.restore(directory, _like(states[0]), step=step)
        assert jax_cb_ckpt.same_bits(got, states[step - 1]), step


@pytest.mark.parametrize("how", ["deleted", "a folder in its place"])
def test_a_data_file_gone_from_the_previous_step_is_not_linked(tmp_path, how):
    """A data file of the step a save links from, gone meanwhile (deleted by hand, lost):
    the save is written whole. Before, it linked the files still there and was committed
    pointing at one that is not: unreadable, though the writer held every byte of it,
    and so was every step linked from it until the next whole save."""
    directory = str(tmp_path / "ckpt")
    states = _states(3)
    with jax_cb_ckpt.Checkpointer(directory, incremental=True) as ckpt:
        ckpt.save(states[0], 1)
        ckpt.wait()
        folder = _data_dir(directory, 1)
        name = max(os.listdir(folder), key=lambda n: os.path.getsize(os.path.join(folder, n)))
        os.unlink(os.path.join(folder, name))
        if how == "a folder in its place":
            os.mkdir(os.path.join(folder, name))
        ckpt.save(states[1], 2)
        ckpt.wait()
        wrote, nbytes = _last(ckpt)
        assert wrote == nbytes
        ckpt.save(states[2], 3)  # linked from step 2 again
        ckpt.wait()
        wrote, nbytes = _last(ckpt)
        assert wrote < nbytes / 4
    _whole_and_readable(directory, states, (2, 3))


def test_a_previous_step_whose_index_is_damaged_is_not_linked(tmp_path):
    """The data files of the step a save links from, truncated meanwhile (a full disk, a
    crash of another tool): its index no longer reads. The save is written whole. Before,
    TensorStore failed reading the linked index and the save was lost (a `SaveError`),
    though the writer held every byte of it."""
    directory = str(tmp_path / "ckpt")
    states = _states(3)
    with jax_cb_ckpt.Checkpointer(directory, incremental=True) as ckpt:
        ckpt.save(states[0], 1)
        ckpt.wait()
        folder = _data_dir(directory, 1)
        for name in os.listdir(folder):
            path = os.path.join(folder, name)
            os.truncate(path, os.path.getsize(path) // 2)
        ckpt.save(states[1], 2)
        ckpt.wait()
        wrote, nbytes = _last(ckpt)
        assert wrote == nbytes
        ckpt.save(states[2], 3)  # linked from step 2
        ckpt.wait()
        wrote, nbytes = _last(ckpt)
        assert wrote < nbytes / 4
    _whole_and_readable(directory, states, (2, 3))


def test_a_previous_step_whose_values_file_was_cut_is_not_linked(tmp_path):
    """The largest data file of the step a save links from (the buffer's values, no part
    of the index) cut meanwhile: the save is written whole. Before, the new step linked
    the cut file and was committed with chunks it could not read, as was every step
    linked from it until the next whole save (each one found by `verify` only)."""
    directory = str(tmp_path / "ckpt")
    states = _states(3)
    with jax_cb_ckpt.Checkpointer(directory, incremental=True) as ckpt:
        ckpt.save(states[0], 1)
        ckpt.wait()
        folder = _data_dir(directory, 1)
        name = max(os.listdir(folder), key=lambda n: os.path.getsize(os.path.join(folder, n)))
        path = os.path.join(folder, name)
        os.truncate(path, os.path.getsize(path) // 2)
        ckpt.save(states[1], 2)
        ckpt.wait()
        wrote, nbytes = _last(ckpt)
        assert wrote == nbytes
        ckpt.save(states[2], 3)
        ckpt.wait()
        wrote, nbytes = _last(ckpt)
        assert wrote < nbytes / 4
    _whole_and_readable(directory, states, (2, 3))


def test_in_a_bucket_an_object_gone_from_the_previous_step_is_not_linked(remote):
    """As `test_a_data_file_gone_from_the_previous_step_is_not_linked`, in a bucket: the
    objects linked are those the previous step held at its commit (before, on GCS, the
    save linked the others and was committed without the one gone)."""
    from jax_cb_ckpt._storage import _remote

    states = _states(3)
    with jax_cb_ckpt.Checkpointer(remote.url, incremental=True) as ckpt:
        ckpt.save(states[0], 1)
        ckpt.wait()
        data = f"{remote.url}/1/state/d"
        names = _remote.list_keys(data)
        smallest = min(names, key=lambda n: len(_remote.read(f"{data}/{n}")[0]))
        _remote.delete(f"{data}/{smallest}")
        ckpt.save(states[1], 2)
        ckpt.wait()
        wrote, nbytes = _last(ckpt)
        assert wrote == nbytes
    jax_cb_ckpt.verify(remote.url, step=2)
    got = jax_cb_ckpt.restore(remote.url, _like(states[0]), step=2)
    assert jax_cb_ckpt.same_bits(got, states[1])


# The state of step k of a run (the child's and the test's): a ring buffer a slice further
# each step, so each linked save writes a slice and links the rest.
_RING = """
import numpy as np

def ring(k):
    buf = np.random.default_rng(0).standard_normal((4, 2048, 256), dtype=np.float32)
    for j in range(1, k + 1):
        buf[:, (j * 64) % 2048 : (j * 64) % 2048 + 64] = np.float32(j)
    return {"buf": buf, "k": np.int64(k)}
"""

_SAVER = """
import sys
import jax_cb_ckpt
with jax_cb_ckpt.Checkpointer(sys.argv[1], incremental=True, full_every=4, max_to_keep=3) as ckpt:
    start = ckpt.latest_step() or 0
    if start:
        assert jax_cb_ckpt.same_bits(ckpt.restore(ring(0)), ring(start)), "not exact"
    for k in range(start + 1, 10**6):
        ckpt.save(ring(k), k)
        ckpt.wait()
        record = ckpt.stats.recent[-1]
        print(k, record.written_bytes, record.nbytes, flush=True)
"""


@pytest.mark.slow
def test_killed_at_any_point_of_incremental_saves_a_restart_resumes_exactly_and_links(tmp_path):
    """SIGKILL at random points of incremental saves (linking, writing, pruning,
    committing): every step left is whole and exact, the next opening removes the
    leftovers, resumes bit for bit, and links again from its second save on."""
    directory = str(tmp_path / "ckpt")
    script = tmp_path / "saver.py"
    script.write_text(textwrap.dedent(_RING) + textwrap.dedent(_SAVER))
    scope: dict = {}
    exec(textwrap.dedent(_RING), scope)
    ring = scope["ring"]
    chance = random.Random(0)
    for _ in range(8):
        before = jax_cb_ckpt.latest_step(directory) or 0
        child = start_process([sys.executable, str(script), directory])
        wait_for_step(directory, before + 3, child)
        time.sleep(chance.uniform(0, 0.3))
        out, err = kill_group(child)
        lines = [line.split() for line in out.splitlines()]
        assert "not exact" not in err
        # A restarted writer's first save is whole, its later ones linked.
        assert int(lines[0][1]) == int(lines[0][2]), lines
        assert int(lines[1][1]) < int(lines[1][2]) / 4, lines
        for step in jax_cb_ckpt.all_steps(directory):
            jax_cb_ckpt.verify(directory, step=step)
            got = jax_cb_ckpt.restore(directory, ring(0), step=step)
            assert jax_cb_ckpt.same_bits(got, ring(step)), step
    with jax_cb_ckpt.Checkpointer(directory, incremental=True) as ckpt:
        assert jax_cb_ckpt.same_bits(ckpt.restore(ring(0)), ring(ckpt.latest_step()))
    left = [n for n in os.listdir(directory) if not n.isdigit() and "lock" not in n]
    assert not left, left
