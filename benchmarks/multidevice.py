"""8 CPU devices: saving a sharded state gathered (no `shardings=`) vs per device.

    python -m benchmarks.multidevice                  # 8, 32 and 128 MiB; ~2 minutes
    python -m benchmarks.multidevice --sizes 32 --reps 3 --out DIR

A GSPMD-sharded float32 state (split over 8 CPU devices on its first axis, a mesh with
automatic axes) trained by a jitted scan whose step has a cross-device reduction; a save
every 2 steps, 5 saves per run, a queue as deep as the saves (the hand-off is measured,
not back-pressure). Methods in one process, interleaved, the order rotating per
repetition, after a warm-up run that compiles; medians. Reported per size: time per save
the device waits (training time with saves minus bare, per save), the time until
everything is on disk, and the compiled program's temporary memory per device.
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
)

import argparse  # noqa: E402
import json  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_cb_ckpt  # noqa: E402

from .harness import medians, rotated, write_results  # noqa: E402

N_DEV, STEPS, EVERY = 8, 10, 2
METHODS = ("bare", "gathered", "per_device")


def make_state(mib: int, mesh):
    rows = N_DEV * 64
    w = jnp.arange(mib * 2**20 // 4, dtype=jnp.float32).reshape(rows, -1) * 1e-6
    return jax.device_put(w, NamedSharding(mesh, P("d")))


class Run:
    def __init__(self, method: str, mesh, directory: str) -> None:
        self.method = method
        self.ckpt = None
        shardings = NamedSharding(mesh, P("d"))
        if method != "bare":
            self.ckpt = jax_cb_ckpt.Checkpointer(
                directory, every=EVERY, max_to_keep=2, queue_size=STEPS // EVERY
            )

        def body(w, i):
            w = w * 0.999 + jnp.max(w) * 1e-9
            if self.ckpt is not None:
                kwargs = {"shardings": shardings} if method == "per_device" else {}
                self.ckpt.maybe_save(w, i + 1, **kwargs)
            return w, None

        self.fn = jax.jit(lambda w, start: jax.lax.scan(body, w, start + jnp.arange(STEPS))[0])

    def temp_mib(self, state) -> float:
        compiled = self.fn.lower(state, 0).compile()
        return compiled.memory_analysis().temp_size_in_bytes / 2**20

    def run(self, state, start: int) -> tuple[float, float]:
        jax.effects_barrier()
        t0 = time.perf_counter()
        jax.block_until_ready(self.fn(state, start))
        jax.effects_barrier()
        trained = time.perf_counter() - t0
        if self.ckpt is not None:
            self.ckpt.wait()
        return trained, time.perf_counter() - t0

    def close(self) -> None:
        if self.ckpt is not None:
            self.ckpt.close()


def measure(mib: int, reps: int, root: str) -> dict:
    mesh = jax.make_mesh((N_DEV,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
    state = make_state(mib, mesh)
    runs = [Run(m, mesh, os.path.join(root, f"{mib}_{m}")) for m in METHODS]
    temp = {r.method: r.temp_mib(state) for r in runs}
    for r in runs:
        r.run(state, 0)  # compile and warm up
    train: dict[str, list[float]] = {m: [] for m in METHODS}
    total: dict[str, list[float]] = {m: [] for m in METHODS}
    for rep in range(reps):
        for r in rotated(runs, rep):
            t, tot = r.run(state, (rep + 1) * 1000)
            train[r.method].append(t)
            total[r.method].append(tot)
    for r in runs:
        r.close()
    med_train, med_total = medians(train), medians(total)
    saves = STEPS // EVERY
    return {
        "state_mib": mib,
        "saves_per_run": saves,
        "reps": reps,
        "train_s": med_train,
        "total_s": med_total,
        "wait_per_save_ms": {
            m: 1000 * (med_train[m] - med_train["bare"]) / saves for m in METHODS if m != "bare"
        },
        "temp_mib": temp,
    }


def markdown(results: list[dict]) -> str:
    lines = [
        "| state | device wait per save, gathered (ms) | per device (ms) | total time "
        "gathered / per device (s) | temp memory bare / gathered / per device (MiB) |",
        "|---|---|---|---|---|",
    ]
    for r in results:
        w, t, m = r["wait_per_save_ms"], r["total_s"], r["temp_mib"]
        lines.append(
            f"| {r['state_mib']} MiB | {w['gathered']:.1f} | {w['per_device']:.1f} | "
            f"{t['gathered']:.3f} / {t['per_device']:.3f} | "
            f"{m['bare']:.1f} / {m['gathered']:.1f} / {m['per_device']:.1f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--sizes", default="8,32,128", help="state sizes in MiB")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out", default=os.path.join("benchmarks", "results", "multidevice"))
    args = parser.parse_args(argv)
    assert len(jax.devices()) == N_DEV, jax.devices()
    os.makedirs(args.out, exist_ok=True)
    results = []
    with tempfile.TemporaryDirectory(prefix="jax_cb_ckpt_md_") as root:
        for mib in (int(s) for s in args.sizes.split(",")):
            results.append(measure(mib, args.reps, root))
            print(json.dumps(results[-1]), flush=True)
    targets = []
    for r in results:
        if r["state_mib"] == 32:
            grew = r["temp_mib"]["per_device"] - r["temp_mib"]["bare"]
            targets.append(
                {
                    "target": "8 devices, 32 MiB GSPMD state: temp memory added with shardings=",
                    "measured_mib": grew,
                    "limit_mib": 4,
                    "met": grew <= 4,
                }
            )
    table = markdown(results)
    for t in targets:
        table += f"\n\n{t['target']}: {t['measured_mib']:.2f} MiB (<= {t['limit_mib']}: "
        table += "met)" if t["met"] else "NOT met)"
    report = {"jax": jax.__version__, "results": results, "targets": targets}
    write_results(args.out, report, table + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
