"""Watching a long run inside one jit: one INFO line per committed step, the progress
bar of `run(progress=True)` (a subprocess, as a user sees it), the line a re-run of a
finished directory prints, and `ckpt.stats` polled from another thread while training."""

import logging
import threading

import jax
import jax.numpy as jnp
import numpy as np
from helpers import run_script


def test_saves_at_info_the_first_then_summed_up_every_one_at_debug(make_ckpt, caplog):
    """Issue 41 item 7: a line per save flooded a long run's log (600 in 60 s). At INFO
    the first save, then one line per 10 s at most (here: at close) summing up the
    saves since; each save at DEBUG."""
    caplog.set_level(logging.DEBUG, logger="jax_cb_ckpt")
    ckpt = make_ckpt()
    state = {"w": np.zeros(1000, np.float32)}
    ckpt.save(state, 3)
    ckpt.save(state, 4)
    ckpt.close()
    records = [r for r in caplog.records if r.name == "jax_cb_ckpt"]
    info = [r.getMessage() for r in records if r.levelno == logging.INFO]
    debug = [r.getMessage() for r in records if r.levelno == logging.DEBUG]
    assert [line.split(" (")[0] for line in info] == ["saved step 3", "saved step 4"], info
    assert [line.split(" (")[0] for line in debug] == ["saved step 3", "saved step 4"], debug
    for line in info:
        assert line.endswith(f") to {ckpt.directory}") and "(3.9 KiB, written in" in line
        assert "device waited" in line, line


RUN_WITH_PROGRESS = """
import logging, sys
import jax.numpy as jnp
import jax_cb_ckpt

logging.basicConfig(level=logging.INFO)  # a finished run's "nothing to do" is INFO

ckpt = jax_cb_ckpt.Checkpointer(sys.argv[1], every=50)
body = lambda s, i: {"x": s["x"] * 1.0001 + i}
out = ckpt.run(body, {"x": jnp.zeros(4)}, 200, check_every=10, progress=True)
print("done", ckpt.stats.last_saved_step, flush=True)
ckpt.run(body, {"x": jnp.zeros(4)}, 200, progress=True)  # finished already
ckpt.close()
"""


def test_run_shows_a_progress_bar_and_says_when_nothing_is_left(tmp_path):
    result = run_script(tmp_path, RUN_WITH_PROGRESS, tmp_path / "ckpt", timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["done", "200"], result.stdout
    frames = result.stderr.replace("\r", "\n").splitlines()
    bars = [f for f in frames if f.startswith("jax_cb_ckpt ckpt")]
    assert bars, result.stderr[-2000:]
    # Every line of the bar names it, its first too (issue 44 item 8: the first line,
    # printed before the description was set, was a bare "0%|  | 0/200").
    drawn = [f for f in frames if "/200 [" in f]
    assert drawn == [f for f in drawn if f.startswith("jax_cb_ckpt ckpt")], drawn[:2]
    assert "compiling" in drawn[0], drawn[0]
    assert "200/200" in bars[-1] and "saved 200" in bars[-1], bars[-1]
    assert "step/s" in bars[-1] or "s/step" in bars[-1], bars[-1]
    # Until the loop's first check the bar says it compiles; its clock starts there, so
    # the rate and the time left count steps run (issue 30 item 6: they counted the
    # compilation, 176 steps/s shown for a run at ~700).
    assert [b for b in bars if " 0/200" in b and "compiling" in b], bars[:3]
    assert not [b for b in bars if "200/200" in b and "compiling" in b], bars
    assert "nothing to do, the latest checkpoint in" in result.stderr, result.stderr[-2000:]
    assert "is step 200 of num_steps=200" in result.stderr


def test_stats_polled_from_another_thread_while_training(make_ckpt):
    ckpt = make_ckpt(every=1)
    seen = []
    done = threading.Event()

    def poll():
        while not done.is_set():
            seen.append(ckpt.stats.last_saved_step)
            done.wait(0.001)

    poller = threading.Thread(target=poll)
    poller.start()

    def body(s, i):
        s = s + 1.0
        ckpt.maybe_save(s, i + 1)
        return s, None

    jax.block_until_ready(
        jax.jit(lambda s: jax.lax.scan(body, s, jnp.arange(200))[0])(jnp.zeros(8))
    )
    ckpt.wait()
    done.set()
    poller.join()
    assert ckpt.stats.last_saved_step == 200
    steps = [s for s in seen if s is not None]
    assert steps == sorted(steps) and steps, seen[:20]  # never goes back
