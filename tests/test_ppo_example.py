"""examples/ppo_cartpole.py: learns CartPole, a SIGKILLed run resumes bit for bit, and
each configuration has its own default directory."""

import os
import re

import pytest
from helpers import ROOT, needs, run_child

EXAMPLE = os.path.join(ROOT, "examples", "ppo_cartpole.py")
# gymnax 1.0.1 requires jax<0.12: CI's newest end (the newest JAX) runs without it.
pytestmark = needs("gymnax", "examples", "; gymnax 1.0.1 requires jax<0.12")


def run_example(*args, cwd=None, stderr=False):
    result = run_child(["python", EXAMPLE, *args], timeout=600, cwd=cwd)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return (result.stdout, result.stderr) if stderr else result.stdout


@pytest.mark.slow
def test_default_config_reaches_cartpole_return(tmp_path):
    out = run_example("--dir", str(tmp_path / "ckpt"))
    line = re.search(r"final mean return \(last 20 updates\) per seed: .*", out).group(0)
    assert float(re.search(r"\[\s*([\d.]+)", line).group(1)) >= 450, out  # the cap is 500
    # Running it again resumes from the final checkpoint: nothing is left to train, and
    # the learning curve (part of the saved state) comes back whole.
    again = run_example("--dir", str(tmp_path / "ckpt"))
    assert "resumed at the end" in again and line in again


# One kill-and-resume per path in the default suite: run() batched over seeds is
# test_crash.py's; this one (PPO, ~1 minute) is in -m slow.
@pytest.mark.slow
def test_kill_and_resume_vmapped_over_seeds_is_bit_exact():
    out = run_example("--kill-demo", "--seeds", "2", "--total-timesteps", "25600", "--every", "5")
    assert "killed; checkpoints on disk" in out
    assert "bit for bit: True" in out


@pytest.mark.slow
def test_each_configuration_has_its_own_default_directory(tmp_path):
    # The docstring's commands one after the other: the vmapped run must not resume from
    # the single-seed run's checkpoints (another shape; a rerun resuming is tested above).
    short = ("--total-timesteps", "2048", "--every", "2")  # 4 updates
    run_example(*short, cwd=tmp_path)
    out, err = run_example(*short, "--seeds", "2", "--progress", cwd=tmp_path, stderr=True)
    assert "checkpoints in runs/ppo_cartpole-seeds2-t2048" in out, out
    assert sorted(os.listdir(tmp_path / "runs")) == [
        "ppo_cartpole-seeds1-t2048",
        "ppo_cartpole-seeds2-t2048",
    ]
    frames = err.replace("\r", "\n").splitlines()
    bars = [f for f in frames if f.startswith("jax_cb_ckpt ppo_cartpole-seeds2-t2048")]
    assert bars and "4/4" in bars[-1], err[-2000:]
