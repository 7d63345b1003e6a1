"""Restore against its ceilings: what a resumed run waits for before its first step.

    python -m benchmarks.restore                  # 5 repetitions, /tmp and /dev/shm
    python -m benchmarks.restore --reps 3 --only tiny
    python -m benchmarks.restore --dir /mnt/nvme  # measure that filesystem

Each case saves one step with the library, then, in one process and the same
repetitions (the order rotating per repetition, harness.rotated), reads it back by:

- `restore`: `jax_cb_ckpt.restore(directory, like)` (checksums verified; the state as
  numpy, like a resumed run's `init`);
- `restore, verify=False`: the same without the checksums;
- `plain Orbax`: `CheckpointManager(directory).restore(step, args=Composite(state=
  StandardRestore()))` of the same step (what Orbax alone costs on our layout);
- `plain read`: every file of the step read into memory (`f.read`), the storage's own
  speed: warm (page cache), and cold (after `drop_caches`) where the kernel lets this
  process drop the caches, else reported as not measured.

The cold rows drop the page cache before each method's read. The tmpfs directory
(`/dev/shm`) has no disk: its rows are the CPU's share. Figures are medians, in ms;
"x Orbax" and "x read" are restore's time over the ceiling's (1.0 = as fast).
Results: results.json and results.md under --out.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np

import jax_cb_ckpt

from .harness import medians, rotated, write_results
from .run import machine

_DROP = "/proc/sys/vm/drop_caches"


def _states() -> dict[str, Callable[[], dict[str, Any]]]:
    rng = np.random.default_rng(0)
    return {
        "tiny": lambda: {
            "a": np.float32(1.0),
            "b": np.arange(8, dtype=np.int32),
            "w": rng.standard_normal((8, 64), dtype=np.float32),
        },
        "80 leaves, 1 MiB": lambda: {
            f"l{i:02d}": rng.standard_normal(3277, dtype=np.float32) for i in range(80)
        },
        "256 MiB": lambda: {"w": rng.standard_normal((64, 1024, 1024), dtype=np.float32)},
    }


def can_drop_caches() -> bool:
    try:
        with open(_DROP, "w") as f:
            f.write("1")
        return True
    except OSError:
        return False


def _drop() -> None:
    os.sync()
    with open(_DROP, "w") as f:
        f.write("3")


def plain_read(step_dir: str) -> int:
    total = 0
    for root, _dirs, files in os.walk(step_dir):
        for name in files:
            with open(os.path.join(root, name), "rb") as f:
                total += len(f.read())
    return total


def _methods(directory: str, like: Any) -> dict[str, Callable[[], Any]]:
    import orbax.checkpoint as ocp

    def orbax() -> Any:
        with ocp.CheckpointManager(directory) as manager:
            return manager.restore(1, args=ocp.args.Composite(state=ocp.args.StandardRestore()))

    return {
        "restore": lambda: jax_cb_ckpt.restore(directory, like, step=1),
        "restore, verify=False": lambda: jax_cb_ckpt.restore(directory, like, step=1, verify=False),
        "plain Orbax": orbax,
        "plain read": lambda: plain_read(os.path.join(directory, "1")),
    }


def run_case(base: str, name: str, make: Callable[[], Any], reps: int, cold: bool) -> dict:
    directory = tempfile.mkdtemp(prefix="restore-", dir=base)
    try:
        state = make()
        with jax_cb_ckpt.Checkpointer(directory) as ckpt:
            ckpt.save(state, 1)
        like = {k: np.zeros_like(v) for k, v in state.items()}
        restored = jax_cb_ckpt.restore(directory, like, step=1)
        assert jax_cb_ckpt.same_bits(restored, state), "restore gave other bits"
        methods = _methods(directory, like)
        modes = ["warm", "cold"] if cold else ["warm"]
        samples: dict[str, list[float]] = {f"{m} {mode}": [] for m in methods for mode in modes}
        for method in methods.values():
            method()  # warm up: imports, first-open costs, the page cache
        for rep in range(reps):
            for key in rotated(list(samples), rep):
                method_name, mode = key.rsplit(" ", 1)
                if mode == "cold":
                    _drop()
                start = time.perf_counter()
                methods[method_name]()
                samples[key].append((time.perf_counter() - start) * 1e3)
        return {"case": name, "dir": base, "ms": medians(samples), "samples_ms": samples}
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def _table(results: list[dict], cold: bool) -> str:
    lines = [
        "| dir | state | mode | restore | verify=False | plain Orbax | plain read | "
        "x Orbax | x read |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        ms = r["ms"]
        for mode in ["warm", "cold"] if cold and r["dir"] != "/dev/shm" else ["warm"]:
            ours, orbax, read = (
                ms[f"{m} {mode}"] for m in ("restore", "plain Orbax", "plain read")
            )
            lines.append(
                f"| {r['dir']} | {r['case']} | {mode} | {ours:.2f} | "
                f"{ms[f'restore, verify=False {mode}']:.2f} | {orbax:.2f} | {read:.2f} | "
                f"{ours / orbax:.2f} | {ours / read:.1f} |"
            )
    if not cold:
        lines.append("")
        lines.append(f"cold rows not measured: this process cannot write {_DROP}")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--dir", action="append", default=None, help="default: /tmp, /dev/shm")
    parser.add_argument("--only", default=None, help="one case: tiny, 80, 256")
    parser.add_argument("--out", default=os.path.join("benchmarks", "results", "restore"))
    args = parser.parse_args()
    dirs = args.dir or [d for d in ("/tmp", "/dev/shm") if os.path.isdir(d)]
    cold = can_drop_caches()
    results = []
    for base in dirs:
        for name, make in _states().items():
            if args.only and not name.startswith(args.only):
                continue
            # Cold reads only mean something on a disk: tmpfs has no cache to drop.
            results.append(run_case(base, name, make, args.reps, cold and base != "/dev/shm"))
            print(
                f"{base} {name}: " + ", ".join(f"{k} {v:.2f}" for k, v in results[-1]["ms"].items())
            )
    table = _table(results, cold)
    print(table)
    write_results(args.out, {"machine": machine(), "cold": cold, "results": results}, table)


if __name__ == "__main__":
    main()
