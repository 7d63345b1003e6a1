"""Multi-device programs with 32 MiB states, in a subprocess with 8 CPU devices: saves
from GSPMD `jit`, `shard_map` and `pmap` never abort, and the checkpoint of the last step
is the final state bit for bit (tests/multidevice_worker.py does the work).

Before the copy-once crossing, each of these died in XLA's rendezvous ("Termination
timeout for 'all gather'", SIGABRT) on jax 0.10.2: `debug.callback` waits for JAX's
asynchronous copy of its arguments while the other devices wait in the next
collective. The "callback" crossing still does that, so it is not run here."""

import subprocess
import sys
from pathlib import Path

import pytest
from helpers import kill_group, start_process

WORKER = Path(__file__).with_name("multidevice_worker.py")
TIMEOUT = 120  # the three cases take ~2 s each here; an abort took 61 s


def run_worker(case, directory, crossing="buffer"):
    child = start_process([sys.executable, str(WORKER), case, str(directory), crossing])
    try:
        out, err = child.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        out, err = kill_group(child)
        raise AssertionError(f"{case}: no result in {TIMEOUT} s\n{err[-3000:]}") from None
    assert child.returncode == 0, f"{case}: rc {child.returncode}\n{err[-3000:]}"
    return out.split()


@pytest.mark.parametrize("case", ["gspmd", "shard_map", "pmap"])
def test_multi_device_save_of_32_mib_is_exact(tmp_path, case):
    words = run_worker(case, tmp_path / "ckpt")
    assert words[:4] == ["ok", case, "buffer", "8"], words
    assert " ".join(words[4:]) == "[2, 4]"
