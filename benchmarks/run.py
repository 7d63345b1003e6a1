"""The benchmark suite: in-JIT checkpointing against the outer-loop approach.

    python -m benchmarks.run --quick            # under 2 minutes on 2 CPU cores
    python -m benchmarks.run                    # the full run
    python -m benchmarks.run --out DIR          # where results.json/.md and the PNGs go
    python -m benchmarks.run --targets          # only what the targets need (~5 minutes)
    python -m benchmarks.run --dir /mnt/nvme    # write the checkpoints there (default /tmp)

Every profile but --gpu ends with the writer benchmark (benchmarks/writer.py; results
in OUT/writer; `--only writer` runs it alone).

Every configuration runs all methods in one process, interleaved (the order rotates per
repetition), after a warm-up run that compiles; medians over the repetitions, ratios
against the bare loop of the same configuration. On a CUDA machine the same command
measures the GPU (see benchmarks/gpu.sh).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from typing import Any

import jax

from . import suite
from .harness import medians, rotated, write_results

IN_JIT_FLOORS = ("noop_debug_callback", "noop_io_callback")
ALL = (
    "bare",
    "maybe_save",
    "outer_loop_orbax",
    "chunked_orbax",
    "naive_debug_callback",
    "maybe_save_never",
    *IN_JIT_FLOORS,
)
SWEEP_METHODS = ("bare", "maybe_save", "outer_loop_orbax", "chunked_orbax", *IN_JIT_FLOORS)


def plan(profile: str) -> list[dict[str, Any]]:
    """The configurations: (workload, steps, every, methods) of a profile."""
    gpu = jax.default_backend() != "cpu"
    quick = profile == "quick"
    if profile == "targets":  # the configurations the targets are evaluated on
        configs = [
            dict(workload="tiny", n=20000, every=1000, methods=ALL),
            dict(workload="medium", n=2000, every=500, methods=ALL),
        ]
        sizes = [64 << 20, 256 << 20]
    elif profile == "gpu":  # benchmarks/gpu.sh: the whole run in a few minutes
        configs = [
            dict(workload="tiny", n=10000, every=1000, methods=ALL),
            dict(workload="medium", n=1000, every=100, methods=ALL),
        ]
        sizes = [1 << 20, 64 << 20, 256 << 20]  # 1 GB did not fit the script's time
    elif quick:
        configs = [
            dict(workload="tiny", n=4000, every=1000, methods=ALL),
            dict(workload="medium", n=200, every=50, methods=ALL),
        ]
        sizes = [1 << 10, 1 << 20, 16 << 20]
    else:
        configs = [dict(workload="tiny", n=20000, every=e, methods=ALL) for e in (100, 1000)] + [
            dict(workload="medium", n=2000, every=e, methods=ALL) for e in (100, 500)
        ]
        sizes = [1 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20, 256 << 20]
        if gpu:
            sizes.append(1 << 30)
    configs += [
        dict(workload=s, n=20, every=5, methods=SWEEP_METHODS, deep_queue=True) for s in sizes
    ]
    return configs


def make_workload(spec: Any) -> suite.Workload:
    if spec == "tiny":
        return suite.tiny()
    if spec == "medium":
        return suite.medium()
    return suite.sized(int(spec))


def run_config(config: dict[str, Any], reps: int, root: str) -> dict[str, Any]:
    wl = make_workload(config["workload"])
    n, every = config["n"], config["every"]
    directory = tempfile.mkdtemp(dir=root)
    # The sweep measures the hand-off itself: a queue as deep as the saves per run, so
    # back-pressure never blocks; the loops keep the default queue_size=2.
    queue_size = n // every if config.get("deep_queue") else 2
    methods = [
        suite.METHODS[name](wl, n, every, directory, queue_size=queue_size)
        for name in config["methods"]
    ]
    for m in methods:
        m.prepare()
    times: dict[str, list[float]] = {m.name: [] for m in methods}
    train: dict[str, list[float]] = {m.name: [] for m in methods}
    rss: dict[str, list[int]] = {m.name: [] for m in methods}
    recent_before = 0
    ours = next((m for m in methods if m.name == "maybe_save"), None)
    if ours is not None:
        ours.flush()
        recent_before = len(ours.ckpt.stats.recent)
    for rep in range(reps):
        for m in rotated(methods, rep):
            with suite.PeakRSS() as peak:
                trained, total = m.run(offset=(rep + 1) * suite.OFFSET)
            train[m.name].append(trained)
            times[m.name].append(total)
            rss[m.name].append(peak.added)
    stats = ours.ckpt.stats if ours is not None else None
    for m in methods:
        m.close()
    saves = n // every
    med = medians(times)
    med_train = medians(train)
    bare = med["bare"]
    result: dict[str, Any] = {
        "workload": wl.name,
        "state_bytes": wl.state_bytes,
        "steps": n,
        "every": every,
        "saves_per_run": saves,
        "queue_size": queue_size,
        "reps": reps,
        "methods": {
            name: {
                "median_s": med[name],
                "median_train_s": med_train[name],
                "steps_per_s": n / med[name],
                "x_bare_time": med[name] / bare,
                "peak_rss_added_bytes": max(rss[name]),
                "all_s": times[name],
            }
            for name in med
        },
        "copy_floor_s": suite.copy_floor(wl.state_bytes),
        "device_to_host_floor_s": suite.device_to_host_floor(wl),
    }
    per_save = {
        name: (med_train[name] - med_train["bare"]) / saves
        for name in ("maybe_save", *IN_JIT_FLOORS)
        if name in med
    }
    result["blocking_per_save_s"] = per_save  # training time with saves minus bare, per save
    if stats is not None:
        timed = stats.recent[recent_before:]
        result["library"] = {
            "blocking_median_s": statistics.median([r.blocking_s for r in timed])
            if timed
            else None,
            "handoff_median_s": statistics.median([r.handoff_s for r in timed]) if timed else None,
            "write_median_s": statistics.median([r.write_s for r in timed]) if timed else None,
            "queue_high_water": stats.queue_high_water,
            "skipped": stats.skipped,
            "saves": stats.saves,
        }
    return result


def evaluate(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each target of the benchmark issue with its measured ratio (ratios in one run)."""
    targets = []
    for r in results:
        m = r["methods"]
        if r["workload"] == "tiny" and r["every"] == 1000:
            ratio = m["maybe_save"]["steps_per_s"] / m["outer_loop_orbax"]["steps_per_s"]
            targets.append(
                _target("tiny, save every 1000: maybe_save / outer loop steps/s", ratio, ">=", 2.5)
            )
            ratio = m["maybe_save"]["steps_per_s"] / m["chunked_orbax"]["steps_per_s"]
            targets.append(
                _target("tiny, save every 1000: maybe_save / chunked steps/s", ratio, ">=", 0.95)
            )
        if "maybe_save_never" in m:
            ratio = m["maybe_save_never"]["median_s"] / m["bare"]["median_s"]
            targets.append(
                _target(
                    f"{r['workload']} (every {r['every']}): never-firing maybe_save time / bare",
                    ratio,
                    "<=",
                    1.05,
                )
            )
        if r["state_bytes"] >= (64 << 20) and r["workload"].startswith("state_"):
            # Total time until every checkpoint is on disk, against the careful user's
            # outer loop (jitted chunks of `every` steps, async Orbax between them).
            ratio = m["maybe_save"]["median_s"] / m["chunked_orbax"]["median_s"]
            targets.append(
                _target(f"{r['workload']}: total time / chunked outer loop", ratio, "<=", 1.0)
            )
            if r["workload"] == "state_64MB":
                # What the device waits for per save, against one copy of the state into
                # already touched host memory (the least any hand-off can cost).
                floor = r["copy_floor_s"]
                ours = r["blocking_per_save_s"]["maybe_save"]
                targets.append(
                    _target(
                        f"{r['workload']}: device wait per save / one touched copy",
                        ours / floor,
                        "<=",
                        3.0,
                    )
                )
                lib = r.get("library", {}).get("blocking_median_s")
                if lib is not None:
                    targets.append(
                        _target(
                            f"{r['workload']}: library hand-off per save / one touched copy",
                            lib / floor,
                            "<=",
                            1.5,
                        )
                    )
        if r["state_bytes"] >= (16 << 20) and "maybe_save" in m:
            # Smaller states are dominated by fixed costs (threads, Orbax, allocator).
            bound = (r["queue_size"] + 1) * r["state_bytes"]
            ratio = m["maybe_save"]["peak_rss_added_bytes"] / bound
            targets.append(
                _target(
                    f"{r['workload']}: peak RSS added / ((queue_size+1) x state)", ratio, "<=", 1.10
                )
            )
    return targets


def _target(name: str, value: float, op: str, limit: float) -> dict[str, Any]:
    ok = value >= limit if op == ">=" else value <= limit
    return {"target": name, "measured": value, "op": op, "limit": limit, "met": ok}


def machine() -> dict[str, Any]:
    device = jax.devices()[0]
    return {
        "date": datetime.date.today().isoformat(),
        "backend": jax.default_backend(),
        "device": getattr(device, "device_kind", str(device)),
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "jax": jax.__version__,
        "orbax": _version("orbax-checkpoint"),
        "jax_cb_ckpt": _version("jax_cb_ckpt"),
    }


def _version(name: str) -> str:
    import importlib.metadata

    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "?"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a small run (CI smoke test)")
    parser.add_argument("--gpu", action="store_true", help="the short accelerator profile")
    parser.add_argument("--targets", action="store_true", help="only the targets' configs")
    parser.add_argument("--reps", type=int, default=None, help="default: 3 quick, 5 full")
    parser.add_argument("--out", default=None, help="default: benchmarks/results/<backend>")
    parser.add_argument("--only", default=None, help="run only workloads containing this")
    parser.add_argument("--dir", default=None, help="checkpoints go here; default: under /tmp")
    args = parser.parse_args(argv)
    reps = args.reps or (3 if args.quick else 5)
    out = args.out or os.path.join("benchmarks", "results", jax.default_backend())
    os.makedirs(out, exist_ok=True)
    results, report = [], {}
    profile = (
        "quick" if args.quick else "gpu" if args.gpu else "targets" if args.targets else "full"
    )
    if args.dir:
        os.makedirs(args.dir, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="jax_cb_ckpt_bench_", dir=args.dir) as root:
        for config in plan(profile):
            if args.only and args.only not in str(config["workload"]):
                continue
            print(f"== {config['workload']} n={config['n']} every={config['every']}", flush=True)
            results.append(run_config(config, reps, root))
            _print_config(results[-1])
            report = _write_report(args, results, out)  # after each: a timeout keeps it
    from . import report as report_lib

    if report:
        report_lib.plots(report, out)
        print(report_lib.markdown(report))
    if profile == "gpu" or args.only not in (None, "writer"):
        return 0
    return run_writer(args, os.path.join(out, "writer"))


def run_writer(args: argparse.Namespace, out: str) -> int:
    """The writer benchmark, in a process of its own: its states (up to 256 MiB) and its
    8-device child do not share this process's memory or devices, and writer.py imports
    this module (run_config, machine), so this one does not import it."""
    cmd = [sys.executable, "-m", "benchmarks.writer", "--out", os.path.abspath(out)]
    cmd += ["--quick"] if args.quick else []
    cmd += ["--reps", str(args.reps)] if args.reps else []
    cmd += ["--dir", os.path.abspath(args.dir)] if args.dir else []
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return subprocess.run(cmd, cwd=root).returncode


def _write_report(
    args: argparse.Namespace, results: list[dict[str, Any]], out: str
) -> dict[str, Any]:
    """results.json and results.md for the configurations measured so far."""
    from . import report as report_lib

    report = {"machine": machine(), "quick": args.quick, "results": results}
    report["targets"] = evaluate(results)
    write_results(out, report, report_lib.markdown(report))
    return report


def _print_config(r: dict[str, Any]) -> None:
    for name, m in r["methods"].items():
        print(f"   {name:22s} {m['median_s']:8.3f} s  {m['x_bare_time']:6.2f}x bare")


if __name__ == "__main__":
    raise SystemExit(main())
