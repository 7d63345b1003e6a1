"""A real client of incremental saves (issue 57): PureJaxRL's DQN with a flashbax replay
buffer of 262 MiB in the saved state (tests/dqn_worker.py), trained in one jitted loop with
`maybe_save` after every update, SIGKILLed at a random point mid-run and resumed. The final
state equals the uninterrupted run's bit for bit, with `incremental=True` and without.
In the incremental run, a save that links the step before it writes under a quarter of
the state, and every step left on disk, copied alone to a fresh directory, restores with
plain Orbax (`orbax.checkpoint`, no jax_cb_ckpt) to the bytes jax_cb_ckpt restores.

Slow (a 275 MB state, whole saves of ~1-3 s on the 2-core VM): `pytest -m slow`.
Reproduce a failure's kill point with the seed it printed: DQN_KILL_SEED=<seed>.
"""

import os
import random
import shutil
import signal
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from helpers import json_lines, needs, run_child

import jax_cb_ckpt

WORKER = os.path.join(os.path.dirname(__file__), "dqn_worker.py")
# gymnax 1.0.1 requires jax<0.12: CI's newest end (the newest JAX) runs without either.
pytestmark = [
    needs("gymnax", "examples", "; gymnax 1.0.1 requires jax<0.12"),
    needs("flashbax", "examples", "; in the extra beside gymnax, which requires jax<0.12"),
]


@pytest.fixture(scope="module")
def worker():
    import dqn_worker  # gymnax and flashbax: imported only where the marks let the tests run

    return dqn_worker


def train(directory, mode, *kill):
    """The worker run to its end (or to its kill): (CompletedProcess, its JSON report)."""
    done = run_child(["python", WORKER, directory, mode, *map(str, kill)], timeout=600)
    if kill:
        return done, None
    assert done.returncode == 0 and "done" in done.stdout, done.stderr[-3000:]
    return done, json_lines(done.stdout)[-1]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, worker):
    """The run without a kill: its report (the final state's digest, its saves). Its
    saves are incremental (the quicker); what a save writes does not change the program
    (the same jitted loop, `maybe_save` in it, whatever the mode), so its final state is
    both modes' reference."""
    directory = tmp_path_factory.mktemp("dqn") / "uninterrupted"
    report = train(directory, "incremental")[1]
    check_linked_saves(report)
    return report


def by_name(tree):
    """{path of names: numpy array}: jax_cb_ckpt's pytree (dataclass fields, tuple
    positions, a typed key as its data) and plain Orbax's nested dicts alike."""

    def name(key):
        for field in ("name", "key", "idx"):
            if hasattr(key, field):
                return str(getattr(key, field))
        raise AssertionError(f"unexpected key {key!r}")

    named = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if jax.numpy.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            leaf = jax.random.key_data(leaf)
        named[tuple(name(k) for k in path)] = np.asarray(leaf)
    return named


def restores_alone_with_plain_orbax(directory, step, like, tmp_path):
    """Step `step`'s folder copied alone to a fresh directory (every other step, and the
    steps whose files it linked, absent there) restores with plain Orbax to the bytes
    jax_cb_ckpt restores from `directory`."""
    fresh = tmp_path / f"alone-{step}"
    shutil.copytree(directory / str(step), fresh / str(step))
    handlers = {"state": ocp.PyTreeCheckpointHandler(), "meta": ocp.JsonCheckpointHandler()}
    with ocp.CheckpointManager(fresh, item_handlers=handlers) as manager:
        assert manager.all_steps() == [step]
        plain = by_name(manager.restore(step)["state"])
    ours = by_name(jax_cb_ckpt.restore(directory, like, step=step))
    assert plain.keys() == ours.keys(), (step, sorted(plain.keys() ^ ours.keys()))
    for path, array in ours.items():
        assert plain[path].dtype == array.dtype and plain[path].shape == array.shape, path
        assert plain[path].tobytes() == array.tobytes(), (step, path)
    shutil.rmtree(fresh)


def check_linked_saves(report):
    """A run's saves: its first written whole, each later one (linked from the step
    before it) wrote under a quarter of the state."""
    records = report["recent"]
    assert len(records) >= 3, records  # one whole, at least two linked
    assert all(r["nbytes"] == report["nbytes"] >= 256 << 20 for r in records), records
    assert records[0]["written"] == records[0]["nbytes"], records[0]
    for r in records[1:]:
        assert r["written"] < 0.25 * r["nbytes"], r
    print(f"\nincremental: linked saves wrote {[r['written'] for r in records[1:]]} bytes")


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["incremental", "whole"])
def test_dqn_killed_mid_run_resumes_bit_for_bit(tmp_path, worker, uninterrupted, mode):
    seed = int(os.environ.get("DQN_KILL_SEED", time.time_ns() % 2**32))
    rng = random.Random(seed)
    every, total = worker.EVERY, worker.NUM_UPDATES
    kill_at = rng.randrange(2 * every + 1, total - 3 * every)  # >= 3 saves left after it
    delay = round(rng.uniform(0.0, 2.0), 2)  # the writer, mid-save, goes on meanwhile
    print(f"kill seed {seed}: SIGKILL {delay} s after update {kill_at}")
    directory = tmp_path / "killed"
    killed, _ = train(directory, mode, kill_at, delay)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    on_disk = jax_cb_ckpt.all_steps(directory)
    print(f"on disk at the kill: {on_disk}, leftovers {os.listdir(directory)}")
    assert on_disk and on_disk[-1] <= kill_at, on_disk  # killed mid-run

    _, resumed = train(directory, mode)
    assert resumed["digest"] == uninterrupted["digest"]  # the final state, in memory
    like = worker.like()
    final = jax_cb_ckpt.restore(directory, like, step=total)  # and on disk
    assert worker.digest(final) == uninterrupted["digest"]
    if mode == "incremental":
        check_linked_saves(resumed)  # the resumed run's chain starts with a whole save
        steps = jax_cb_ckpt.all_steps(directory)
        assert steps[-1] == total and len(steps) == 3, steps  # max_to_keep=3
        for step in steps:
            restores_alone_with_plain_orbax(directory, step, like, tmp_path)
