"""Object storage: a save to local GCS and S3 servers against their own ceilings.

    python -m benchmarks.storage                 # 64 MiB, 5 repetitions (~1 minute)
    python -m benchmarks.storage --mib 8 --reps 2

The servers are the tests' (tests/storage_servers.py: fake-gcs-server with its objects
in a folder under --dir, moto's S3 server in memory behind a TCP proxy), each on
127.0.0.1. Each repetition, in a rotating order, for a local directory (--dir), gs://
and s3://:

- save: `ckpt.save(state, step)` then `ckpt.wait()`, a state of one random float32
  leaf: the time until the step is committed (listed), and what the device waited
  (`stats.recent[-1].blocking_s`, the hand-off: it must not depend on the storage);
- ceiling: the same bytes written as one object with TensorStore (one PUT, the
  server's own speed for them; for the local directory, a write+fsync of one file).

Figures are medians; "x ceiling" is the save's time over the ceiling's. Results:
results.json and results.md under --out.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from typing import Any

import jax.numpy as jnp
import numpy as np

import jax_cb_ckpt
from jax_cb_ckpt._storage import _remote

from .harness import rotated, write_results
from .run import machine

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def servers(root: str) -> tuple[Any, Any]:
    """fake-gcs-server (objects under `root`) and moto's S3 server, each with a bucket
    "bench", their environment set in this process."""
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from storage_servers import GCSServer, S3Server  # the tests' servers

    gcs, s3 = GCSServer(root), S3Server()
    os.environ.update(gcs.env())
    os.environ.update(s3.env())
    gcs.make_bucket("bench")
    s3.make_bucket("bench")
    return gcs, s3


def _ceiling(where: str, data: bytes, rep: int) -> float:
    """One write of `data`: an object (one PUT) or a local file with fsync."""
    start = time.perf_counter()
    if _remote.is_url(where):
        _remote.write(f"{where}/ceiling-{rep}", data)
    else:
        path = os.path.join(where, f"ceiling-{rep}")
        with open(path, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.unlink(path)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=64)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--dir", default=None, help="local directory (default: a temp dir)")
    parser.add_argument("--out", default="benchmarks/results/storage")
    args = parser.parse_args(argv)
    scratch = tempfile.mkdtemp(dir=args.dir)
    gcs, s3 = servers(os.path.join(scratch, "gcs-objects"))
    try:
        report = _measure(args, scratch)
    finally:
        gcs.close()
        s3.close()
    markdown = _markdown(report)
    write_results(args.out, report, markdown)
    print(markdown)
    return 0


def _measure(args: argparse.Namespace, scratch: str) -> dict[str, Any]:
    n = args.mib * (1 << 20) // 4
    host = np.random.default_rng(0).standard_normal(n, dtype=np.float32)
    state = {"w": jnp.asarray(host)}
    data = host.tobytes()
    places = {
        "local": os.path.join(scratch, "local"),
        "gs": "gs://bench/run",
        "s3": "s3://bench/run",
    }
    os.makedirs(places["local"])
    samples: dict[str, dict[str, list[float]]] = {
        name: {"save_s": [], "device_wait_s": [], "ceiling_s": []} for name in places
    }
    ckpts = {name: jax_cb_ckpt.Checkpointer(where, max_to_keep=1) for name, where in places.items()}
    try:
        for name, ckpt in ckpts.items():  # warm-up: compile, connect, first objects
            ckpt.save(state, 0)
            ckpt.wait()
            _ceiling(places[name], data, 0)
        for rep in range(1, args.reps + 1):
            for name in rotated(list(places), rep):
                ckpt = ckpts[name]
                start = time.perf_counter()
                ckpt.save(state, rep)
                ckpt.wait()
                samples[name]["save_s"].append(time.perf_counter() - start)
                samples[name]["device_wait_s"].append(ckpt.stats.recent[-1].blocking_s)
                samples[name]["ceiling_s"].append(_ceiling(places[name], data, rep))
    finally:
        for ckpt in ckpts.values():
            ckpt.close()
    rows = []
    for name, s in samples.items():
        save, ceiling = statistics.median(s["save_s"]), statistics.median(s["ceiling_s"])
        rows.append(
            {
                "storage": name,
                "save_s": save,
                "device_wait_s": statistics.median(s["device_wait_s"]),
                "ceiling_s": ceiling,
                "x_ceiling": save / ceiling,
                "save_GBps": len(data) / save / 1e9,
                "samples": s,
            }
        )
    return {"machine": machine(), "mib": args.mib, "reps": args.reps, "rows": rows}


def _markdown(report: dict[str, Any]) -> str:
    m = report["machine"]
    lines = [
        f"### A {report['mib']} MiB save, committed (medians of {report['reps']})",
        "",
        f"{m['date']}, {m['cpu_count']} cores, JAX {m['jax']}, servers on 127.0.0.1.",
        "",
        "| storage | save until committed | GB/s | ceiling (one write) | x ceiling "
        "| device waited |",
        "|---|---|---|---|---|---|",
    ]
    for r in report["rows"]:
        lines.append(
            f"| {r['storage']} | {r['save_s'] * 1e3:.0f} ms | {r['save_GBps']:.2f} | "
            f"{r['ceiling_s'] * 1e3:.0f} ms | {r['x_ceiling']:.2f}x | "
            f"{r['device_wait_s'] * 1e3:.1f} ms |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
