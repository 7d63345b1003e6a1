"""Nothing handed over is lost silently: every save reaches disk, also at interpreter
exit from any thread, or is dropped for a reason the user is told (a repeated step, a
skipped or failed one, which may then be saved again). Each test failed before its
fix (adversarial testing)."""

import os
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import run_script, state_at

import jax_cb_ckpt

# -- every save handed over reaches disk, whatever happens to the object --------------

EXIT_SCRIPT = """
import sys, threading
import jax, jax.numpy as jnp
import jax_cb_ckpt

MODE, DIRECTORY = sys.argv[1], sys.argv[2]
if MODE == "global":  # a module-level Checkpointer, never closed
    ckpt = jax_cb_ckpt.Checkpointer(DIRECTORY, queue_size=8)
N = 6

def train(ckpt):
    @jax.jit
    def run(x):
        def body(x, i):
            x = x + 1.0
            ckpt.save({"x": x}, i)
            return x, None
        return jax.lax.scan(body, x, jnp.arange(N))[0]
    return jax.block_until_ready(run(jnp.zeros(1 << 22)))  # 16 MB a save

def main():
    ckpt = jax_cb_ckpt.Checkpointer(DIRECTORY, queue_size=8)
    train(ckpt)
    if MODE == "del":
        del ckpt
        import gc; gc.collect()
    # "local": returns without close(); the Checkpointer is garbage collected

if MODE == "global":
    train(ckpt)
    print("pending at exit:", ckpt._parts.exchange.pending, flush=True)
elif MODE == "late":
    # A non-daemon thread that opens its Checkpointer after the main thread ended.
    def late():
        import time; time.sleep(1.0)
        with jax_cb_ckpt.Checkpointer(DIRECTORY, queue_size=8) as ckpt:
            train(ckpt)
    threading.Thread(target=late).start()
elif MODE == "pool":
    # A thread-pool worker nobody waits for: its saves cannot be written, and say so.
    from concurrent.futures import ThreadPoolExecutor
    ckpt = jax_cb_ckpt.Checkpointer(DIRECTORY, queue_size=8)
    def late():
        import time; time.sleep(1.0)
        train(ckpt)
    ThreadPoolExecutor(1).submit(late)
elif MODE == "skip":
    # Garbage collected with skipped saves: the skips are still reported.
    def skipping():
        ckpt = jax_cb_ckpt.Checkpointer(DIRECTORY, queue_size=1, on_full="skip")
        train(ckpt)
    skipping()
elif MODE == "thread":
    # A non-daemon thread still training when the main thread ends.
    ckpt = jax_cb_ckpt.Checkpointer(DIRECTORY, queue_size=8)
    def late():
        import time; time.sleep(1.0)
        train(ckpt)
    threading.Thread(target=late).start()
else:
    main()
print("main done", flush=True)
"""


@pytest.mark.slow
def test_what_cannot_be_written_at_exit_is_reported(tmp_path):
    result = run_script(tmp_path, EXIT_SCRIPT, "pool", tmp_path / "pool")
    assert "after interpreter exit closed it and was not written" in result.stderr
    result = run_script(tmp_path, EXIT_SCRIPT, "skip", tmp_path / "skip")
    skipped = set(range(6)) - set(jax_cb_ckpt.all_steps(tmp_path / "skip"))
    assert skipped, "nothing was skipped: the test shows nothing"
    for step in skipped:
        assert f"SkippedSaveWarning: jax_cb_ckpt: skipped the save of step {step}:" in result.stderr


@pytest.mark.parametrize(
    "mode",
    [
        "global",
        *(pytest.param(m, marks=pytest.mark.slow) for m in ("local", "del", "thread", "late")),
    ],
)
def test_unclosed_checkpointer_writes_everything_at_exit(tmp_path, mode):
    directory = tmp_path / "ckpt"
    result = run_script(tmp_path, EXIT_SCRIPT, mode, directory)
    assert result.returncode == 0, result.stderr
    assert "main done" in result.stdout
    if mode == "global":
        pending = int(result.stdout.split("pending at exit:")[1].split()[0])
        assert pending > 0  # only meaningful when saves were still in flight
        flushed = re.search(
            r"(\d+) save\(s\) to .* were still pending at interpreter exit", result.stderr
        )
        assert "UnflushedSaveWarning" in result.stderr and flushed, result.stderr
        assert 0 < int(flushed.group(1)) <= pending
    for bad in ("terminate called", "Fatal Python error", "CheckpointerClosedError"):
        assert bad not in result.stderr, result.stderr
    assert jax_cb_ckpt.all_steps(directory) == list(range(6)), result.stderr
    assert [n for n in os.listdir(directory) if "tmp" in n] == []
    restored = jax_cb_ckpt.restore(directory, {"x": jnp.zeros(1 << 22)})
    np.testing.assert_array_equal(restored["x"], np.full(1 << 22, 6.0, np.float32))


# -- a save is dropped only for a reason the user sees --------------------------------


def test_repeated_step_is_dropped_with_a_warning(make_ckpt):
    ckpt = make_ckpt()
    ckpt.save(state_at(3), 3)
    with pytest.warns(jax_cb_ckpt.DuplicateStepWarning, match=r"step 3 was handed over again"):
        ckpt.save(state_at(30), 3)
    ckpt.wait()
    assert (ckpt.stats.saves, ckpt.stats.duplicates) == (1, 1)
    assert int(ckpt.restore(state_at(0))["step"]) == 3


def test_skipped_step_can_be_saved_again(make_ckpt):
    ckpt = make_ckpt(queue_size=1, on_full="skip")
    big = {"x": jnp.zeros(1 << 23)}

    @jax.jit
    def burst(x):
        for step in range(4):  # faster than the writer: some are skipped
            ckpt.save({"x": x + step}, step)
        return x

    jax.block_until_ready(burst(big["x"]))
    with pytest.warns(jax_cb_ckpt.SkippedSaveWarning):
        ckpt.wait()
    skipped = [s for s in range(4) if s not in ckpt.all_steps()]
    assert skipped, "the writer kept up: nothing was skipped, the test shows nothing"
    below = [s for s in skipped if s < max(ckpt.all_steps(), default=-1)]
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always", jax_cb_ckpt.StepOrderWarning)
        for step in skipped:
            ckpt.save({"x": big["x"] + step}, step)
            ckpt.wait()
    # A skipped step below one written (which steps the writer skipped varies from run
    # to run) is saved after a higher one: said once, and written all the same.
    assert len(said) == (1 if below else 0), [str(w.message) for w in said]
    assert all(issubclass(w.category, jax_cb_ckpt.StepOrderWarning) for w in said)
    assert ckpt.all_steps() == [0, 1, 2, 3]


def test_failed_step_can_be_saved_again(make_ckpt, ckpt_dir):
    ckpt = make_ckpt(on_error="continue")
    (ckpt_dir / "7").write_text("a user's file in the way")
    ckpt.save(state_at(7), 7)
    with pytest.warns(jax_cb_ckpt.SaveFailedWarning, match=r"step 7 .* is not a checkpoint"):
        ckpt.wait()
    assert (ckpt_dir / "7").read_text() == "a user's file in the way"
    (ckpt_dir / "7").unlink()
    ckpt.save(state_at(7), 7)
    ckpt.wait()
    assert ckpt.all_steps() == [7]
