"""Runs die: SIGKILL at random moments with writes in flight, SIGTERM/SIGINT preemption,
a full disk. Whatever happens, the complete checkpoints restore and the resumed run ends
bit-identical to an uninterrupted one."""

import os
import random
import signal
import sys
import time

import crash_worker
import jax
import pytest
from helpers import assert_same_state, kill_group, start_process, wait_for_step

import jax_cb_ckpt

HERE = os.path.dirname(os.path.abspath(__file__))
KILL_POINTS = 2  # in the default suite; the slow test tries 20


@pytest.fixture(scope="module", autouse=True)
def on_the_workers_backend():
    """The workers run on the CPU (`JAX_PLATFORMS=cpu`); what this process computes to
    compare with them (the uninterrupted run, the resumes) runs there too: on another
    backend XLA gives other bits (a parent on CUDA against CPU children, 2026-12-04)."""
    with jax.default_device(jax.devices("cpu")[0]):
        yield


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    return crash_worker.train(tmp_path_factory.mktemp("reference") / "ckpt")


def start_worker(directory, *extra):
    return start_process(
        [sys.executable, os.path.join(HERE, "crash_worker.py"), str(directory), *extra]
    )


def check_disk_and_resume(directory, uninterrupted):
    steps = jax_cb_ckpt.all_steps(directory)
    # Only complete steps are listed, each restores; retention kept at most 3 (+1 if the
    # kill fell between a save and the deletion it triggers).
    assert steps and len(steps) <= 4 and all(s % crash_worker.EVERY == 0 for s in steps)
    for step in steps:
        restored = jax_cb_ckpt.restore(directory, crash_worker.init(), step=step)
        assert int(restored["count"]) == sum(range(step))  # the state after `step` steps
    resumed = crash_worker.train(directory)
    assert_same_state(resumed, uninterrupted)
    return steps


def run_kill_points(tmp_path, uninterrupted, points, seed):
    print(f"kill seed {seed}")  # reproduce a failure with this seed
    rng = random.Random(seed)
    seen = []
    for point in range(points):
        directory = tmp_path / f"kill{point}"
        child = start_worker(directory)
        wait_for_step(directory, crash_worker.EVERY, child)  # the loop is running
        time.sleep(rng.uniform(0.0, 1.5))
        kill_group(child)
        assert child.returncode == -signal.SIGKILL
        latest = jax_cb_ckpt.latest_step(directory)
        leftovers = [n for n in os.listdir(directory) if "tmp" in n]
        check_disk_and_resume(directory, uninterrupted)
        seen.append((latest, leftovers))
    return seen


@pytest.mark.slow
def test_sigkill_at_random_points_resumes_bit_for_bit(tmp_path, uninterrupted):
    seen = run_kill_points(tmp_path, uninterrupted, KILL_POINTS, seed=1234)
    assert all(latest < crash_worker.NUM_STEPS for latest, _ in seen), seen


@pytest.mark.slow
def test_sigkill_many_points(tmp_path, uninterrupted):
    seen = run_kill_points(tmp_path, uninterrupted, 20, seed=int(time.time()))
    print("kill points (latest step, partial tmp dirs):", seen)


@pytest.mark.parametrize(
    "sig, flag",
    [(signal.SIGTERM, ()), pytest.param(signal.SIGINT, ("--sigint",), marks=pytest.mark.slow)],
)
def test_preemption_saves_stops_and_resumes(tmp_path, uninterrupted, sig, flag):
    directory = tmp_path / "ckpt"
    child = start_worker(directory, *flag)
    try:
        wait_for_step(directory, 4 * crash_worker.EVERY, child)
        child.send_signal(sig)
        out, err = child.communicate(timeout=120)
    finally:  # a failure here leaves no child running into the next test
        kill_group(child)
    assert child.returncode == 128 + sig, err
    assert "done" not in out
    latest = jax_cb_ckpt.latest_step(directory)
    assert latest < crash_worker.NUM_STEPS and latest % crash_worker.EVERY == 0
    name = signal.Signals(sig).name
    said = f"run stopped at step {latest} after {name}; checkpoint saved in {directory}; "
    assert err.count(said + f"exit code {128 + sig}") == 1, err[-2000:]  # one line, on stderr
    assert not [n for n in os.listdir(directory) if "tmp" in n]  # the last save completed
    check_disk_and_resume(directory, uninterrupted)


@pytest.mark.slow
def test_request_stop_in_process(tmp_path, uninterrupted):
    ckpt = jax_cb_ckpt.Checkpointer(tmp_path / "ckpt", every=crash_worker.EVERY)
    ckpt.request_stop()
    with pytest.raises(jax_cb_ckpt.Preempted) as info:
        ckpt.run(crash_worker.body, crash_worker.init(), crash_worker.NUM_STEPS)
    assert info.value.code == 1 and info.value.step == crash_worker.EVERY
    assert "stopped at step 5 after request_stop(); checkpoint saved" in str(info.value)
    assert not ckpt.stop_requested  # consumed
    assert_same_state(
        ckpt.run(crash_worker.body, crash_worker.init(), crash_worker.NUM_STEPS), uninterrupted
    )
    ckpt.close()


def test_run_is_bit_identical_to_a_plain_scan(tmp_path, uninterrupted):
    init = crash_worker.init()
    plain = jax.jit(
        lambda s: jax.lax.scan(
            lambda s, i: (crash_worker.body(s, i), None),
            s,
            jax.numpy.arange(crash_worker.NUM_STEPS),
        )[0]
    )(init)
    assert_same_state(plain, uninterrupted)


@pytest.mark.slow
def test_run_batched_over_seeds_resumes_exactly(tmp_path):
    seeds = 3

    def init(seed):
        return {"x": jax.numpy.zeros(8) + seed, "key": jax.random.key(seed)}

    def body(state, step):
        key, sub = jax.random.split(state["key"])
        return {"x": state["x"] * 0.5 + jax.random.normal(sub, (8,)), "key": key}

    inits = jax.tree_util.tree_map(
        lambda *xs: jax.numpy.stack(xs), *[init(s) for s in range(seeds)]
    )
    with jax_cb_ckpt.Checkpointer(tmp_path / "full", every=10) as ckpt:
        full = ckpt.run(body, inits, 60, batched=True)
    with jax_cb_ckpt.Checkpointer(tmp_path / "cut", every=10) as ckpt:
        ckpt.run(body, inits, 30, batched=True)  # the run that was cut short
    with jax_cb_ckpt.Checkpointer(tmp_path / "cut", every=10) as ckpt:
        resumed = ckpt.run(body, inits, 60, batched=True)
        assert ckpt.all_steps() == [10, 20, 30, 40, 50, 60]
    assert_same_state(resumed, full)
    for seed in range(seeds):  # each member is its own independent run
        with jax_cb_ckpt.Checkpointer(tmp_path / f"seed{seed}", every=10) as ckpt:
            single = ckpt.run(body, init(seed), 60)
        member = jax.tree_util.tree_map(lambda x, seed=seed: x[seed], full)
        assert_same_state(single, member)


def test_run_arguments(tmp_path):
    no_every = jax_cb_ckpt.Checkpointer(tmp_path / "a")
    with pytest.raises(jax_cb_ckpt.ConfigError, match="run: the Checkpointer needs every=N"):
        no_every.run(crash_worker.body, crash_worker.init(), 10)
    no_every.close()
    ckpt = jax_cb_ckpt.Checkpointer(tmp_path / "b", every=5)
    ckpt.run(crash_worker.body, crash_worker.init(), 10)
    with pytest.raises(
        jax_cb_ckpt.ConfigError, match="latest checkpoint .* is step 10, past num_steps=5"
    ):
        ckpt.run(crash_worker.body, crash_worker.init(), 5)
    done = ckpt.run(crash_worker.body, crash_worker.init(), 10)  # nothing left to run
    assert int(done["count"]) == sum(range(10))
    ckpt.close()


def soak(tmp_path, saves):
    from benchmarks.suite import PeakRSS

    ckpt = jax_cb_ckpt.Checkpointer(tmp_path / "ckpt", every=1, max_to_keep=3)

    def body(state, step):
        return {"x": state["x"] + 1.0, "step": step}

    init = {"x": jax.numpy.zeros(256), "step": jax.numpy.int32(0)}
    ckpt.run(body, init, 100)  # warm up: compile, threads, allocator
    total = 100 + saves
    with PeakRSS() as peak:
        final = ckpt.run(body, init, total)
    ckpt.close()
    assert ckpt.stats.saves == total and ckpt.stats.failed == 0
    assert ckpt.all_steps() == [total - 2, total - 1, total]
    assert not [n for n in os.listdir(tmp_path / "ckpt") if "tmp" in n]
    assert float(final["x"][0]) == float(total)
    print(f"soak: peak RSS grew by {peak.added / 2**20:.1f} MB over {saves} saves")
    assert peak.added < 64 * 2**20


def test_soak_saves_bounded_memory(tmp_path):
    soak(tmp_path, 150)


@pytest.mark.slow
def test_soak_thousand_saves_bounded_memory(tmp_path):
    soak(tmp_path, 1000)
