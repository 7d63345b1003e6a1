"""What a save in the loop costs when it does not fire, per XLA configuration (issue 22, 2).

    python -m benchmarks.gpu_cost [--reps 5] [--out DIR] [--quick]

On a GPU, XLA's conditional copies its predicate to the host and the host waits for
it at every step, so a `maybe_save` that never fires stops the host from running ahead
of the device. For the tiny (dispatch-bound) and medium (compute-bound) steps of
benchmarks/suite.py, one jitted scan of `n` steps is timed as:

- `bare`: no checkpoint;
- `maybe_save_never`: `maybe_save` whose predicate never holds (target <= 1.05x bare);
- `maybe_save`: `maybe_save` firing every `every` steps;
- `ckpt_scan`: `ckpt.scan(..., every=every)`, saving between chunks with no conditional
  in the step loop (target <= 1.01x bare).

XLA reads XLA_FLAGS once per process, so each configuration runs in a child process of
its own: XLA's defaults, and command buffers that take conditionals and loops (a branch
joins a CUDA graph only if every command in it can; the predicate then stays on the
device). A configuration that fails to start is reported with its error, and the others
still run. Each child writes its results when it ends; the parent writes results.json
and results.md after each child, so a timeout keeps what was measured. Ratios to bare,
medians of the repetitions (their order rotated).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from typing import Any

import jax

from . import suite
from .harness import medians, rotated, write_results

CONFIGS: dict[str, str] = {
    "xla-default": "",
    # The command types XLA may record into CUDA graphs, with conditionals and loops
    # added; the rest are XLA's defaults for recent releases.
    "command-buffer+conditional": (
        "--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,"
        "CONDITIONAL,WHILE --xla_gpu_graph_min_graph_size=1"
    ),
}
METHODS = ("bare", "maybe_save_never", "maybe_save", "ckpt_scan")


def workloads(quick: bool) -> list[tuple[str, int, int]]:
    """(workload, steps, save every)."""
    if quick:
        return [("tiny", 400, 100), ("medium", 40, 10)]
    return [("tiny", 10000, 1000), ("medium", 1000, 100)]


def measure(name: str, n: int, every: int, reps: int, root: str) -> dict[str, Any]:
    wl = suite.tiny() if name == "tiny" else suite.medium()
    directory = tempfile.mkdtemp(dir=root)
    methods = [suite.METHODS[m](wl, n, every, directory) for m in METHODS]
    for m in methods:
        m.prepare()
    times: dict[str, list[float]] = {m.name: [] for m in methods}
    for rep in range(reps):
        for m in rotated(methods, rep):
            times[m.name].append(m.run(offset=(rep + 1) * suite.OFFSET)[0])
    for m in methods:
        m.close()
    med = medians(times)
    return {
        "workload": name,
        "steps": n,
        "every": every,
        "train_s": med,
        "x_bare": {k: v / med["bare"] for k, v in med.items()},
    }


def child(config: str, quick: bool, reps: int, out_file: str) -> None:
    report: dict[str, Any] = {
        "config": config,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "backend": jax.default_backend(),
        "device": str(jax.devices()[0].device_kind),
        "jax": jax.__version__,
        "workloads": [],
    }
    with tempfile.TemporaryDirectory(prefix="jax_cb_ckpt_gpu_cost_") as root:
        for name, n, every in workloads(quick):
            print(f"== {config}: {name}, {n} steps, every {every}", flush=True)
            report["workloads"].append(measure(name, n, every, reps, root))
            with open(out_file, "w") as f:
                json.dump(report, f)


def markdown(report: dict[str, Any]) -> str:
    lines = [
        "| configuration | workload | " + " | ".join(METHODS[1:]) + " (x bare) | bare s |",
        "|---|---|" + "---|" * len(METHODS),
    ]
    for config in report["configs"]:
        if "error" in config:
            lines.append(
                f"| {config['config']} | failed: {' '.join(config['error'].split())[-200:]} |"
            )
        for w in config["workloads"]:
            ratios = " | ".join(f"{w['x_bare'][m]:.3f}" for m in METHODS[1:])
            lines.append(
                f"| {config['config']} | {w['workload']} ({w['steps']} steps, every "
                f"{w['every']}) | {ratios} | {w['train_s']['bare']:.4f} |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="short loops (a smoke test)")
    parser.add_argument("--out", default=os.path.join("benchmarks", "results", "gpu_cost"))
    parser.add_argument("--only", default=",".join(CONFIGS), help="comma-separated configs")
    parser.add_argument(
        "--child-timeout", type=float, default=600, help="seconds per configuration"
    )
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--child-out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args.child, args.quick, args.reps, args.child_out)
        return 0
    report: dict[str, Any] = {"configs": []}
    for config in args.only.split(","):
        if config not in CONFIGS:
            parser.error(f"--only: unknown config {config!r}; choose from {list(CONFIGS)}")
        flags = " ".join(filter(None, [os.environ.get("XLA_FLAGS", ""), CONFIGS[config]]))
        env = dict(os.environ, XLA_FLAGS=flags)
        with tempfile.NamedTemporaryFile(suffix=".json") as out_file:
            command = [sys.executable, "-m", "benchmarks.gpu_cost", "--child", config]
            command += ["--child-out", out_file.name, "--reps", str(args.reps)]
            command += ["--quick"] if args.quick else []
            try:
                done = subprocess.run(
                    command, env=env, capture_output=True, text=True, timeout=args.child_timeout
                )
            except subprocess.TimeoutExpired as e:  # keep the workloads it finished
                out = e.stdout.decode() if isinstance(e.stdout, bytes) else e.stdout or ""
                done = subprocess.CompletedProcess(command, 124, out, "timed out")
            sys.stdout.write(done.stdout)
            try:
                with open(out_file.name) as f:
                    result = json.load(f)
            except (OSError, ValueError):
                result = {"config": config, "xla_flags": flags, "workloads": []}
            if done.returncode != 0:
                result["error"] = (done.stderr or f"exit {done.returncode}")[-2000:]
        report["configs"].append(result)
        write_results(args.out, report, markdown(report))
    table = markdown(report)
    print(table)
    return 0 if all("error" not in c for c in report["configs"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
