"""Overhead of maybe_save under jit(vmap) over seeds, at a tiny (dispatch-bound) step.

    python -m benchmarks.vmap_overhead [--seeds 8] [--steps 20000] [--reps 5]

One process, methods interleaved, medians of --reps: the same jit(vmap(scan)) training
of a small MLP (8 -> 64 -> 1, SGD, batch 32 per step) without checkpointing ("bare"),
with a maybe_save whose predicate never holds ("never"), and saving every 1000 steps
("every_1000"; the whole batch of seeds, one crossing per save).
"""

from __future__ import annotations

import argparse
import json
import tempfile

import jax
import jax.numpy as jnp

import jax_cb_ckpt

from .harness import medians, rotated, timed


def init(seed):
    k1, k2, key = jax.random.split(jax.random.key(seed), 3)
    params = {
        "w1": jax.random.normal(k1, (8, 64)) * 0.3,
        "b1": jnp.zeros(64),
        "w2": jax.random.normal(k2, (64, 1)) * 0.1,
        "b2": jnp.zeros(1),
    }
    return {"params": params, "key": key}


def make_train(steps, save):
    """jit(vmap(train)) over seeds; `offset` shifts the step numbers so that repeated
    runs save new steps (a step already handed over would be dropped as a duplicate)."""

    def loss(params, x, y):
        h = jnp.tanh(x @ params["w1"] + params["b1"])
        return jnp.mean((h @ params["w2"] + params["b2"] - y) ** 2)

    def body(state, step):
        key, sub = jax.random.split(state["key"])
        x = jax.random.normal(sub, (32, 8))
        y = jnp.sin(x.sum(axis=1, keepdims=True))
        grads = jax.grad(loss)(state["params"], x, y)
        params = jax.tree_util.tree_map(lambda p, g: p - 0.01 * g, state["params"], grads)
        state = {"params": params, "key": key}
        if save is not None:
            save(state, step)
        return state, None

    def train(seed, offset):
        return jax.lax.scan(body, init(seed), offset + jnp.arange(steps))[0]

    return jax.jit(jax.vmap(train, in_axes=(0, None)))


def measure(seeds: int, steps: int, reps: int) -> dict:
    seeds_arr = jnp.arange(seeds)
    times: dict[str, list[float]] = {"bare": [], "never": [], "every_1000": []}
    with tempfile.TemporaryDirectory() as d:
        ckpt = jax_cb_ckpt.Checkpointer(d, queue_size=4, max_to_keep=2)
        fns = {
            "bare": make_train(steps, None),
            "never": make_train(steps, lambda s, i: ckpt.maybe_save(s, i, when=i < 0)),
            "every_1000": make_train(steps, lambda s, i: ckpt.maybe_save(s, i, when=i % 1000 == 0)),
        }
        names = list(fns)
        for rep in range(reps + 1):  # the first repetition compiles and is dropped
            for name in rotated(names, rep):
                elapsed = timed(fns[name], seeds_arr, jnp.int32(rep * steps))
                if rep:
                    times[name].append(elapsed)
        ckpt.close()
        stats = ckpt.stats
    med = medians(times)
    return {
        "seeds": seeds,
        "steps": steps,
        "reps": reps,
        "median_s": med,
        "us_per_step": {k: v / steps * 1e6 for k, v in med.items()},
        "overhead_never": med["never"] / med["bare"] - 1,
        "overhead_every_1000": med["every_1000"] / med["bare"] - 1,
        "stats": stats.summary(),
        "jax": jax.__version__,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20000)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    result = measure(args.seeds, args.steps, args.reps)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
