"""What metrics and policies cost: the device's time, and the writer's per save.

    python -m benchmarks.policies [--steps 200000] [--every 10000] [--reps 9]
                                  [--kept 10,1000,10000] [--saves 30]

1. The device: one process, runs interleaved (the order rotates each repetition),
   medians of --reps, as ratios to the same run without metrics or policies. A tiny
   step (a 16-float state; dispatch-bound, where any per-step cost shows), `steps`
   steps in one jitted `fori_loop`, a `maybe_save` with `every` (10,000: the writer
   keeps up, ~2 ms a save against ~5 ms of steps, so the device never waits for it and
   what is measured is the device's own cost):
   - "plain": `max_to_keep=3`;
   - "policies": the same with `metrics={"return", "loss"}` computed from the state,
     `keep_best=3` by "return", `keep_every=5000`;
   - "every_seconds": `every_seconds=3600` (never due) with `check_every=100`: the
     host query of the clock every 100 steps, what a bare `maybe_save` pays for it;
   - "plain_again": a second "plain" Checkpointer: the noise of the ratios.
2. The writer: retention's work per save (`SaveRecord.retention_s`: deciding and
   unlisting) and the whole write per save, with `max_to_keep=N`, `keep_best=3` and
   `keep_every=7` after N steps are on disk, for each N of --kept: independent of N.
   The first commit of a Checkpointer examines every step once (listed apart).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp

import jax_cb_ckpt

from .harness import medians, rotated, timed


def _train(ckpt: jax_cb_ckpt.Checkpointer, steps: int, metrics: bool):
    def body(i, state):
        state = state * 0.999 + jnp.sin(i.astype(jnp.float32))
        recorded = None
        if metrics:
            recorded = {"return": jnp.sum(state), "loss": jnp.mean(state**2)}
        ckpt.maybe_save(state, i + 1, metrics=recorded)
        return state

    return jax.jit(lambda state, start: jax.lax.fori_loop(start, start + steps, body, state))


def device(steps: int, every: int, reps: int) -> dict:
    with tempfile.TemporaryDirectory() as d:
        made = {
            "plain": (dict(every=every, max_to_keep=3), False),
            "policies": (
                dict(every=every, max_to_keep=3, keep_best=3, best="return", keep_every=5000),
                True,
            ),
            "every_seconds": (
                dict(every=every, max_to_keep=3, every_seconds=3600, check_every=100),
                False,
            ),
            "plain_again": (dict(every=every, max_to_keep=3), False),
        }
        ckpts, fns = {}, {}
        for name, (options, metrics) in made.items():
            ckpts[name] = jax_cb_ckpt.Checkpointer(f"{d}/{name}", queue_size=4, **options)
            fns[name] = _train(ckpts[name], steps, metrics)
        times: dict[str, list[float]] = {name: [] for name in made}
        state = jnp.ones(16)
        for rep in range(reps + 1):  # the first repetition compiles and is dropped
            for name in rotated(list(made), rep):
                elapsed = timed(fns[name], state, jnp.int32(rep * steps))
                ckpts[name].wait()  # (outside the clock: the writer's work is not the device's)
                if rep:
                    times[name].append(elapsed)
        best = ckpts["policies"].best_step()
        for ckpt in ckpts.values():
            ckpt.close()
    med = medians(times)
    return {
        "steps": steps,
        "reps": reps,
        "every": every,
        "saves_per_run": steps // every,
        "median_s": med,
        "us_per_step": {k: v / steps * 1e6 for k, v in med.items()},
        "ratio_to_plain": {k: v / med["plain"] for k, v in med.items()},
        "best_step_of_the_policies_run": best,
    }


def writer(kept: list[int], saves: int) -> dict:
    rows = {}
    for n in kept:
        with tempfile.TemporaryDirectory() as d:
            rules = dict(max_to_keep=n, keep_best=3, best="return", keep_every=7)
            state = jnp.ones(16)
            with jax_cb_ckpt.Checkpointer(d, **rules, queue_size=8) as ckpt:
                start = time.perf_counter()
                for step in range(1, n + 1):  # fill: n steps on disk (n or so kept)
                    ckpt.save(state, step, metrics={"return": float(step % 97)})
                ckpt.wait()
                fill_s = time.perf_counter() - start
            # A new Checkpointer: its first commit examines every step (once).
            with jax_cb_ckpt.Checkpointer(d, **rules) as ckpt:
                for step in range(n + 1, n + 1 + saves):
                    ckpt.save(state, step, metrics={"return": float(step % 97)})
                    ckpt.wait()  # one save at a time: each record is one save's work
                records = [r for r in ckpt.stats.recent if r.step > n]
            on_disk = len(jax_cb_ckpt.all_steps(d))
        first, later = records[0], records[1:]
        rows[n] = {
            "steps_on_disk": on_disk,
            "fill_s": fill_s,
            "first_commit_retention_ms": first.retention_s * 1e3,
            "retention_ms_per_save": statistics.median(r.retention_s for r in later) * 1e3,
            "write_ms_per_save": statistics.median(r.write_s for r in later) * 1e3,
        }
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200_000)
    parser.add_argument("--every", type=int, default=10_000)
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--kept", default="10,1000,10000")
    parser.add_argument("--saves", type=int, default=30)
    args = parser.parse_args()
    result = {
        "device": device(args.steps, args.every, args.reps),
        "writer": writer([int(n) for n in args.kept.split(",")], args.saves),
        "jax": jax.__version__,
    }
    print(json.dumps(result, indent=2))
    dev = result["device"]
    print(
        f"\ndevice, tiny step, {dev['steps']} steps, a save every {dev['every']}, "
        f"median of {dev['reps']}:"
    )
    for name, ratio in dev["ratio_to_plain"].items():
        print(f"  {name:<14} {dev['us_per_step'][name]:8.2f} us/step  {ratio:6.3f}x plain")
    print("\nwriter, per save (median), by steps on disk:")
    for n, row in result["writer"].items():
        print(
            f"  {n:>6} kept: retention {row['retention_ms_per_save']:.3f} ms, write "
            f"{row['write_ms_per_save']:.2f} ms; first commit examines all: "
            f"{row['first_commit_retention_ms']:.1f} ms ({row['steps_on_disk']} on disk)"
        )


if __name__ == "__main__":
    main()
