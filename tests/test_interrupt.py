"""Ctrl-C during `Checkpointer.run` with the default `sigint=False`: the loop stops at its
next check and saves, `run` waits for that save, and the process ends with a plain
KeyboardInterrupt. It never hangs with the loop still running in the helper thread and
never aborts ("Fatal Python error") with a callback in flight. Also signals at the edges:
a SIGTERM while `run` waits for its final write, and Ctrl-C while `close()` waits."""

import os
import signal
import subprocess
import sys
import time

import crash_worker
import pytest
from helpers import kill_group, run_script, start_process, wait_for_step

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

signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal, also when
# the tests run with SIGINT ignored (nohup, a background job), which children inherit

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
            # Quick succession, as a user pressing twice: within the stop (the loop
            # stops, saves and raises in a few ms now; a press after that lands in
            # the user's own code, as any Ctrl-C does).
            time.sleep(0.001)
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
    [
        pytest.param(1, False, id="ctrl-c"),
        pytest.param(2, False, id="ctrl-c-twice", marks=pytest.mark.slow),
        pytest.param(1, True, id="own-sigint-handler", marks=pytest.mark.slow),
    ],
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
    assert err.count("Ctrl-C: run stops at the next check, saving first") == 1, err

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


# A SIGTERM after the loop's last check, while the final save is written: the loop never
# reads it, yet `run` acts on it (Preempted once that save is on disk) and consumes it
# (a later `run` in the same process runs to its end).
SIGTERM_IN_FINAL_WRITE = """
import glob, os, signal, sys, threading, time
import jax.numpy as jnp
import jax_cb_ckpt

directory = sys.argv[1]
ckpt = jax_cb_ckpt.Checkpointer(directory, every=2)
init = {"x": jnp.zeros(1 << 24), "n": jnp.int32(0)}  # 64 MiB: each write takes a while

def body(state, step):
    return {"x": state["x"] + 1.0, "n": state["n"] + 1}

def sigterm_once_the_final_write_began():
    # Step 4's temporary folder: its save was handed over after the loop's last check.
    while not glob.glob(os.path.join(directory, "4.*")):
        time.sleep(0.001)
    os.kill(os.getpid(), signal.SIGTERM)

threading.Thread(target=sigterm_once_the_final_write_began, daemon=True).start()
try:
    ckpt.run(body, init, 4)
    print("first run returned", flush=True)
except jax_cb_ckpt.Preempted as e:
    print(f"first run: Preempted({e.code}) at step {e.step}; on disk {ckpt.all_steps()}")
final = ckpt.run(body, init, 8)  # no signal now
print(f"second run returned after {int(final['n'])} steps")
ckpt.close()
"""


@pytest.mark.slow
def test_sigterm_during_the_final_write_preempts_once_saved_and_is_consumed(tmp_path):
    result = run_script(tmp_path, SIGTERM_IN_FINAL_WRITE, tmp_path / "ckpt", timeout=120)
    assert result.stdout.splitlines() == [
        "first run: Preempted(143) at step 4; on disk [2, 4]",
        "second run returned after 8 steps",
    ], (result.returncode, result.stdout, result.stderr[-3000:])
    assert result.returncode == 0, result.stderr[-3000:]


# Ctrl-C while close() waits for the writer, which then fails a save: the close still
# stops the writer, and the SaveError is neither lost nor turned into a warning: the
# KeyboardInterrupt notes it and the next close() raises it, once.
CTRL_C_IN_CLOSE = """
import os, signal, sys, threading, time
import numpy as np
import jax_cb_ckpt

signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal, also when
# the tests run with SIGINT ignored (nohup, a background job), which children inherit
directory = sys.argv[1]
os.makedirs(os.path.join(directory, "2"))  # a folder of the user's where step 2 would go
ckpt = jax_cb_ckpt.Checkpointer(directory)
ckpt.save({"x": np.ones(1 << 24, np.float32)}, 1)  # 64 MiB: the writer is busy a while
ckpt.save({"x": np.ones(4, np.float32)}, 2)  # then fails: "2" is in the way

def ctrl_c_once_close_waits(main=threading.main_thread().ident):
    while True:  # until close() waits for the writer (in Exchange.drain)
        frame, names = sys._current_frames().get(main), set()
        while frame is not None:
            names.add(frame.f_code.co_name)
            frame = frame.f_back
        if "drain" in names:
            break
        time.sleep(0.001)
    os.kill(os.getpid(), signal.SIGINT)

threading.Thread(target=ctrl_c_once_close_waits, daemon=True).start()
try:
    ckpt.close()
    print("close returned")
except KeyboardInterrupt as e:
    print("close: KeyboardInterrupt", *getattr(e, "__notes__", []), sep="\\n")
writers = [t for t in threading.enumerate() if t.name.startswith("jax_cb_ckpt-writer")]
print(f"writer threads: {len(writers)}")
for call in (ckpt.close, ckpt.wait, ckpt.close):
    try:
        call()
        print(f"{call.__name__} returned")
    except jax_cb_ckpt.SaveError as e:
        print(f"{call.__name__}: {type(e).__name__}: {e}")
print(f"on disk {jax_cb_ckpt.all_steps(directory)}", flush=True)
"""


@pytest.mark.slow
def test_ctrl_c_during_close_keeps_the_writer_error(tmp_path):
    directory = tmp_path / "ckpt"
    result = run_script(tmp_path, CTRL_C_IN_CLOSE, directory, timeout=120)
    error = (
        f"SaveError: saving step 2 to {str(directory)!r} failed: FileExistsError: "
        f"{str(directory / '2')!r} already exists and is not a checkpoint"
    )
    lines, seen = result.stdout.splitlines(), (result.stdout, result.stderr[-3000:])
    assert lines[0] == "close: KeyboardInterrupt", seen
    assert lines[1].startswith("jax_cb_ckpt: close() was interrupted"), seen
    assert error in lines[1], seen
    assert lines[2] == "writer threads: 0", seen
    assert lines[3].startswith(f"close: {error}"), seen
    assert lines[4:] == ["wait returned", "close returned", "on disk [1]"], seen
    assert result.returncode == 0 and "Warning" not in result.stderr, seen
