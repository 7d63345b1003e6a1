"""Exact resume in the shape users write (issue 34), on a PureJaxRL-shaped trainer of 4
seeds under `jit(vmap)` (tests/purejaxrl_worker.py):

- a run in PureJaxRL's own shape (the initial state built inside the jitted function)
  restores exactly what it saved, but its resume is another program (the state passed
  in): its bits may change, in the last places, as XLA compiles it; which is why the
  recommended shape exists;
- the recommended shape (`ckpt.restore_or_init`, the state and start passed in),
  SIGKILLed mid-run and run again, ends bit for bit as the uninterrupted run, for every
  seed;
- `restore_or_init` itself: fresh, resumed, under vmap, a `like`, a bad argument;
- `ckpt.run` resumed in the same process reuses the compiled loop (no recompilation).
"""

import logging
import os
import signal
import sys

import jax
import jax.numpy as jnp
import numpy as np
import purejaxrl_worker as worker
import pytest
from helpers import assert_same_state, run_child

import jax_cb_ckpt

WORKER = os.path.join(os.path.dirname(__file__), "purejaxrl_worker.py")
RESUME_AT = 12


def _differing(a, b):
    """(leaves that differ in at least one bit, all leaves, the largest difference)."""

    def raw(x):
        if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            x = jax.random.key_data(x)
        return np.asarray(x)

    pairs = list(zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))
    differ = [(x, y) for x, y in pairs if raw(x).tobytes() != raw(y).tobytes()]
    largest = max(
        (float(np.max(np.abs(raw(x).astype(np.float64) - raw(y)))) for x, y in differ),
        default=0.0,
    )
    return len(differ), len(pairs), largest


def test_the_initial_state_built_inside_train_is_another_program(tmp_path):
    """PureJaxRL's shape, `jit(vmap(train))(rngs)` with the initial state built inside
    `train`, resumed from update 12 the only way a resume can (the restored state passed
    in). What is guaranteed: the library restores exactly what the fresh run saved (its
    final step restores as its final state, bit for bit), and the resumed run, another
    program, differs from the uninterrupted one at most in the last places. Whether it
    differs at all is XLA's choice: 35 of 52 leaves on a PPO trainer with jax 0.10.2, none
    of this test's with jax 0.12.1 on CPU, nor on an H200. Backend-neutral."""
    with jax_cb_ckpt.Checkpointer(tmp_path / "naive", every=worker.EVERY) as ckpt:
        fresh = jax.jit(jax.vmap(worker.make_train_inside(ckpt)))(worker.keys())
        like = jax.eval_shape(jax.vmap(worker.init), worker.keys())
        middle = ckpt.restore(like, step=RESUME_AT)
        assert jax_cb_ckpt.same_bits(ckpt.restore(like, step=worker.NUM_UPDATES), fresh)
    with jax_cb_ckpt.Checkpointer(tmp_path / "naive-resumed", every=worker.EVERY) as ckpt:
        resumed = worker.make_train(ckpt)(middle, RESUME_AT)
    differ, total, largest = _differing(fresh, resumed)
    print(f"\nnaive resume: {differ} of {total} leaves differ, by at most {largest:.2g}")
    assert largest < 1e-4, (differ, largest)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The recommended shape, run to its end in a child process."""
    directory = tmp_path_factory.mktemp("exact") / "uninterrupted"
    done = run_child(["python", WORKER, directory], timeout=300)
    assert done.returncode == 0 and "done" in done.stdout, done.stderr[-2000:]
    return directory


def test_the_recommended_shape_resumes_after_sigkill_bit_for_bit(tmp_path, uninterrupted):
    directory = tmp_path / "killed"
    killed = run_child(["python", WORKER, directory, str(RESUME_AT)], timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    on_disk = jax_cb_ckpt.all_steps(directory)
    assert on_disk and on_disk[-1] < worker.NUM_UPDATES, on_disk  # killed mid-run
    resumed = run_child(["python", WORKER, directory], timeout=300)
    assert resumed.returncode == 0 and "done" in resumed.stdout, resumed.stderr[-2000:]
    like = jax.eval_shape(jax.vmap(worker.init), worker.keys())
    final = jax_cb_ckpt.restore(directory, like, step=worker.NUM_UPDATES)
    expected = jax_cb_ckpt.restore(uninterrupted, like, step=worker.NUM_UPDATES)
    assert_same_state(final, expected)
    one = jax.eval_shape(worker.init, worker.keys()[0])
    for k in range(worker.SEEDS):  # every seed, on its own
        mine = jax_cb_ckpt.restore(directory, one, step=worker.NUM_UPDATES, member=k)
        theirs = jax_cb_ckpt.restore(uninterrupted, one, step=worker.NUM_UPDATES, member=k)
        assert jax_cb_ckpt.same_bits(mine, theirs), k


def _init(seed):
    return {"w": jnp.full((3,), seed, jnp.float32), "key": jax.random.key(seed)}


def test_restore_or_init_fresh_resumed_and_under_vmap(tmp_path):
    calls = []

    def init(seeds):
        state = jax.vmap(_init)(seeds)
        if not isinstance(state["w"], jax.core.Tracer):  # (eval_shape traces it: no work)
            calls.append(seeds)
        return state

    seeds = jnp.arange(3)
    with jax_cb_ckpt.Checkpointer(tmp_path / "ckpt") as ckpt:
        state, start = ckpt.restore_or_init(init, seeds)
        assert start == 0 and len(calls) == 1  # no checkpoint: init(*args), in its own call
        assert jax_cb_ckpt.same_bits(state, jax.vmap(_init)(seeds))
        ckpt.save(jax.tree.map(lambda x: x, state), 7)  # (under vmap: a batch of 3)
    with jax_cb_ckpt.Checkpointer(tmp_path / "ckpt") as ckpt:
        state, start = ckpt.restore_or_init(init, seeds)
        assert start == 7 and len(calls) == 1  # restored (like: eval_shape, init not run)
        assert jax_cb_ckpt.same_bits(state, jax.vmap(_init)(seeds))
        like = {"w": np.zeros((3, 3), np.float32), "key": jax.vmap(_init)(seeds)["key"]}
        restored, start = ckpt.restore_or_init(init, seeds, like=like)
        assert start == 7 and isinstance(restored["w"], np.ndarray)  # like's types
        with pytest.raises(jax_cb_ckpt.ConfigError, match="init_fn must be the function"):
            ckpt.restore_or_init(seeds, init)  # the arguments swapped


def test_a_resumed_run_reuses_the_compiled_loop(tmp_path, caplog):
    """`ckpt.run` stopped (request_stop) and run again by the same Checkpointer: the
    second call resumes from the saved step in the executable compiled for the first
    (traced start), and ends as an uninterrupted run does."""

    def body(state, i):
        return {"x": state["x"] * 0.5 + i}

    init = {"x": jnp.zeros(3)}
    with jax_cb_ckpt.Checkpointer(tmp_path / "whole", every=5) as ckpt:
        whole = ckpt.run(body, init, 20)
    caplog.set_level(logging.WARNING, logger="jax")
    # The loop runs in run()'s helper thread: log compiles process-wide, not per thread.
    jax.config.update("jax_log_compiles", True)
    try:
        with jax_cb_ckpt.Checkpointer(tmp_path / "cut", every=5) as ckpt:
            ckpt.request_stop()
            with pytest.raises(jax_cb_ckpt.Preempted):
                ckpt.run(body, init, 20)
            first = [r.getMessage() for r in caplog.records]
            caplog.clear()
            resumed = ckpt.run(body, init, 20)
            second = [r.getMessage() for r in caplog.records]
    finally:
        jax.config.update("jax_log_compiles", False)
    assert any("jit(loop)" in m and "ompil" in m for m in first), first
    assert not [m for m in second if "jit(loop)" in m and "ompil" in m], second
    assert_same_state(resumed, whole)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
