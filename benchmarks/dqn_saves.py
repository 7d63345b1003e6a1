"""What saves cost a real trainer: PureJaxRL's DQN with a 262 MiB flashbax buffer
(tests/dqn_worker.py), saving every --every updates, incremental or whole, against the
same training without saves.

    python -m benchmarks.dqn_saves                  # 3 repetitions of 300 updates, in /tmp
    python -m benchmarks.dqn_saves --reps 1 --segment 200 --dir /dev/shm

Each method trains its own run in one process: `none` (no `maybe_save` in the loop),
`whole` (`Checkpointer(every=..., max_to_keep=3)`) and `incremental` (the same with
`incremental=True`). Each first trains one untimed segment (the compile, and the first
save, which an incremental Checkpointer writes whole); then each repetition trains every
run --segment updates further, interleaved (the order rotating, harness.rotated), timed
from the jitted call to `ckpt.wait()` (every save on disk). Per save, from
`ckpt.stats.recent` (the timed segments' saves): the writer's seconds (`write_s`), the
bytes it wrote (`written_bytes`; a whole save writes the state) and the device's wait
(`blocking_s`). Figures are medians. Needs gymnax and flashbax (the examples extra).
Results: results.json and results.md under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any

import jax

import jax_cb_ckpt

from .harness import medians, rotated, write_results
from .run import machine

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "tests"))
import dqn_worker  # noqa: E402  (tests/: the trainer the end-to-end tests kill and resume)

METHODS = ("none", "whole", "incremental")


class Run:
    """One method's training run: its state, Checkpointer (None: no saves) and the
    jitted loop, compiled once and reused by every segment."""

    def __init__(self, name: str, root: str, every: int) -> None:
        self.name = name
        self.ckpt = None
        if name != "none":
            self.ckpt = jax_cb_ckpt.Checkpointer(
                os.path.join(root, name),
                every=every,
                max_to_keep=3,
                incremental=name == "incremental",
            )
        self.train = dqn_worker.make_train(self.ckpt, saves=self.ckpt is not None, killable=False)
        self.state = jax.block_until_ready(jax.jit(dqn_worker.init)(jax.random.key(0)))
        self.done = 0  # updates trained

    def segment(self, updates: int) -> float:
        """Train `updates` more; seconds until every save is on disk."""
        began = time.perf_counter()
        self.state = jax.block_until_ready(self.train(self.state, self.done, self.done + updates))
        if self.ckpt is not None:
            self.ckpt.wait()
        self.done += updates
        return time.perf_counter() - began

    def saves(self, after: int) -> dict[str, Any]:
        """Medians over the saves of steps past `after` (the timed segments')."""
        if self.ckpt is None:
            return {}
        records = [r for r in self.ckpt.stats.recent if r.step > after]
        first = self.ckpt.stats.recent[0]
        return {
            "saves": len(records),
            "nbytes": records[0].nbytes,
            "write_s": statistics.median(r.write_s for r in records),
            "written_bytes": statistics.median(
                r.nbytes if r.written_bytes is None else r.written_bytes for r in records
            ),
            "blocking_s": statistics.median(r.blocking_s for r in records),
            "first_save_write_s": first.write_s,
        }


def measure(root: str, segment: int, every: int, reps: int) -> dict[str, Any]:
    runs = {name: Run(name, root, every) for name in METHODS}
    warm = {name: run.segment(segment) for name, run in runs.items()}  # compile, first save
    samples: dict[str, list[float]] = {name: [] for name in METHODS}
    for rep in range(reps):
        for name in rotated(METHODS, rep):
            samples[name].append(runs[name].segment(segment))
    wall = medians(samples)
    result = {
        "segment": segment,
        "every": every,
        "reps": reps,
        "state_bytes": sum(x.nbytes for x in jax.tree.leaves(runs["none"].state)),
        "first_segment_s": warm,
        "samples_s": samples,
        "wall_s": wall,
        "x_none": {name: wall[name] / wall["none"] for name in METHODS},
        "saves": {name: run.saves(segment) for name, run in runs.items()},
    }
    for run in runs.values():
        if run.ckpt is not None:
            run.ckpt.close()
    same = {jax_cb_ckpt.same_bits(runs["none"].state, run.state) for run in runs.values()}
    result["same_final_state"] = same == {True}
    return result


def _markdown(r: dict[str, Any]) -> str:
    lines = [
        f"DQN, a {r['state_bytes'] / 2**20:.0f} MiB state; {r['segment']} updates per "
        f"segment, a save every {r['every']}; medians of {r['reps']}",
        "",
        "| method | segment (s) | x none | writer per save (s) | written per save (MB) "
        "| device wait per save (ms) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name in METHODS:
        s = r["saves"][name]
        per_save = (
            f"{s['write_s']:.2f} | {s['written_bytes'] / 1e6:.1f} | {s['blocking_s'] * 1e3:.0f}"
            if s
            else "- | - | -"
        )
        lines.append(f"| {name} | {r['wall_s'][name]:.2f} | {r['x_none'][name]:.2f} | {per_save} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--segment", type=int, default=300, help="updates per timed segment")
    parser.add_argument("--every", type=int, default=100, help="a save every this many updates")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where the steps are saved (default: /tmp)")
    parser.add_argument("--out", default=os.path.join("benchmarks", "results", "dqn_saves"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        result = measure(d, args.segment, args.every, args.reps)
    report = {"machine": machine(), "dqn_saves": result}
    print(json.dumps(report, indent=2))
    markdown = _markdown(result)
    print("\n" + markdown)
    write_results(args.out, report, markdown)


if __name__ == "__main__":
    main()
