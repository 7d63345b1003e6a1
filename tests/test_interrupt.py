"""Ctrl-C during `Checkpointer.run` with the default `sigint=False`: the loop stops at its
next check and saves, `run` waits for that save, and the process ends with a plain
KeyboardInterrupt. It never hangs with the loop still running in the helper thread and
never aborts ("Fatal Python error") with a callback in flight."""

import os
import signal
import subprocess
import sys
import time

import crash_worker
import pytest
from helpers import kill_group, start_process, wait_for_step

import jax_cb_ckpt

HERE = os.path.dirname(os.path.abspath(__file__))
LONG = 200_000  # steps: minutes of work, so the run is always cut short by Ctrl-C
EXIT_WITHIN = 30  # seconds from Ctrl-C to the end of the process

# The crash worker's training run, made long; `sigint` keeps its default (False).
CHILD = f"""
import signal
import sys
sys.path.insert(0, {HERE!r})
import crash_worker

def own_handler(signum, frame):
    raise KeyboardInterrupt("the script's own SIGINT handler")

if "--own-handler" in sys.argv:
    signal.signal(signal.SIGINT, own_handler)
print("started", flush=True)
crash_worker.train(sys.argv[1], num_steps={LONG})
print("done", flush=True)
"""


def start_child(directory, *extra):
    return start_process([sys.executable, "-c", CHILD, str(directory), *extra])


def interrupt(directory, presses, *extra):
    """Start the child, press Ctrl-C `presses` times once it has saved, and wait for it
    to end. Returns (returncode, stdout, stderr, latest step on disk at the first press)."""
    child = start_child(directory, *extra)
    try:
        wait_for_step(directory, 4 * crash_worker.EVERY, child)  # the loop is running
        at_signal = jax_cb_ckpt.latest_step(directory)
        for _ in range(presses):
            child.send_signal(signal.SIGINT)
            time.sleep(0.02)  # quick succession, as a user pressing twice
        try:
            out, err = child.communicate(timeout=EXIT_WITHIN)
        except subprocess.TimeoutExpired:
            out = None
        if out is None:  # (outside the except: the failure is not chained to a timeout)
            latest = jax_cb_ckpt.latest_step(directory)
            _, err = kill_group(child)
            pytest.fail(
                f"the child still ran {EXIT_WITHIN} s after Ctrl-C: latest step {at_signal} "
                f"at the signal, {latest} now.\nstderr:\n{err[-3000:]}"
            )
        return child.returncode, out, err, at_signal
    finally:
        if child.poll() is None:
            kill_group(child)


@pytest.mark.parametrize(
    "presses, own_handler",
    [(1, False), (2, False), (1, True)],
    ids=["ctrl-c", "ctrl-c-twice", "own-sigint-handler"],
)
def test_ctrl_c_saves_stops_and_raises_keyboard_interrupt(tmp_path, presses, own_handler):
    directory = tmp_path / "ckpt"
    extra = ("--own-handler",) if own_handler else ()
    returncode, out, err, at_signal = interrupt(directory, presses, *extra)

    assert "Fatal Python error" not in err, err
    # An uncaught KeyboardInterrupt: Python prints its traceback, then ends itself by
    # SIGINT so that the shell sees a death by Ctrl-C. Nothing else failed on the way
    # (a loop left running would log failed saves into the closed Checkpointer).
    assert returncode == -signal.SIGINT, (returncode, err)
    assert err.count("Traceback") == 1, err
    assert "done" not in out
    # One note, however many presses.
    assert err.count("jax_cb_ckpt: Ctrl-C: stopping at the next check, saving first") == 1, err

    # Stopped: nothing more is written, and the last save completed.
    steps = jax_cb_ckpt.all_steps(directory)
    time.sleep(0.5)
    assert jax_cb_ckpt.all_steps(directory) == steps
    latest = steps[-1]
    assert at_signal <= latest < LONG and latest % crash_worker.EVERY == 0, (at_signal, steps)
    # The KeyboardInterrupt names the step it saved; one raised by the script's own
    # handler is raised as it is, once the loop has stopped and saved.
    last_line = err.rstrip().splitlines()[-1]
    if own_handler:
        assert last_line == "KeyboardInterrupt: the script's own SIGINT handler", err
    else:
        assert last_line == (
            f"KeyboardInterrupt: jax_cb_ckpt: stopped at step {latest} after Ctrl-C; "
            "checkpoint saved"
        ), err
    assert not [n for n in os.listdir(directory) if "tmp" in n]
    for step in steps:  # every listed step restores: the state after `step` steps
        restored = jax_cb_ckpt.restore(directory, crash_worker.init(), step=step)
        assert int(restored["count"]) == sum(range(step))
