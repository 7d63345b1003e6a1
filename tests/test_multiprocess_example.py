"""examples/multiprocess.py: 2 local processes x 4 CPU devices. A run resumed from its
checkpoint ends bit for bit where an uninterrupted run ends, on every process, and
SIGTERM to the launcher stops both processes at the same saved step."""

import os
import re
import signal
import subprocess
import sys
import time

import pytest
from helpers import kill_group, start_process

import jax_cb_ckpt

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "multiprocess.py")
SMALL = ["--rows", "256", "--cols", "1024", "--every", "20"]  # 1 MiB per leaf
TIMEOUT = 240


def run_example(directory, steps):
    args = [sys.executable, EXAMPLE, "--dir", str(directory), "--steps", str(steps), *SMALL]
    child = start_process(args)
    try:
        out, err = child.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        kill_group(child)
        raise AssertionError(f"no end in {TIMEOUT} s") from None
    assert child.returncode == 0, out[-3000:] + err[-3000:]
    return out


def digests(out):
    found = dict(re.findall(r"process (\d): steps .*?digest of my blocks (\w{16})", out))
    assert sorted(found) == ["0", "1"], out
    return found


@pytest.mark.slow
def test_resumed_run_ends_bit_for_bit_where_an_uninterrupted_one_does(tmp_path):
    first = run_example(tmp_path / "resumed", 60)
    assert "steps 0..60" in first and "saved steps [20, 40, 60]" in first, first
    resumed = run_example(tmp_path / "resumed", 120)
    assert "steps 60..120" in resumed, resumed
    straight = run_example(tmp_path / "straight", 120)
    assert digests(resumed) == digests(straight), (resumed, straight)
    assert digests(straight)["0"] != digests(straight)["1"]  # each process's own blocks
    # The docstring's first command run again after the longer run: shown, not an error.
    again = run_example(tmp_path / "resumed", 60)
    assert "holds a run at step 120, past --steps 60" in again, again
    assert digests(again) == digests(straight), (again, straight)


@pytest.mark.slow
def test_sigterm_to_the_launcher_stops_both_processes_at_one_saved_step(tmp_path):
    directory = tmp_path / "ckpt"
    args = [sys.executable, EXAMPLE, "--dir", str(directory), "--steps", "10000000", *SMALL]
    child = start_process(args)
    try:
        deadline = time.monotonic() + TIMEOUT
        while (jax_cb_ckpt.latest_step(directory) or 0) < 40:
            assert child.poll() is None and time.monotonic() < deadline, child.communicate()
            time.sleep(0.05)
        child.send_signal(signal.SIGTERM)
        out, err = child.communicate(timeout=TIMEOUT)
    finally:
        kill_group(child)
    assert child.returncode == 143, out + err[-3000:]
    stops = re.findall(r"process (\d): stopped at step (\d+), saved", out)
    assert sorted(p for p, _ in stops) == ["0", "1"], out
    assert stops[0][1] == stops[1][1], stops
    assert jax_cb_ckpt.latest_step(directory) == int(stops[0][1])
