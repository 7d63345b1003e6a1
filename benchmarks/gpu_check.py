"""On a GPU: the two crossings checked bit for bit, and what the device waits per save.

    python -m benchmarks.gpu_check [--sizes 64,256] [--reps 3] [--out DIR]

For each state size (MB of float32): a jitted scan of 20 steps saving every 5, with
`crossing="callback"` (jax.debug.callback, the default on GPU) and `crossing="buffer"`
(copies on XLA's stream into pinned memory, jax_cb_ckpt/_save/_cuda.py), against the same
scan without saves; the checkpoint of the last step must equal the final state bit for
bit. The floor is one device-to-host copy of the state (`jax.device_get`). Target: the
buffer crossing's device wait per save <= 1.2x that copy. Exits 1 if a check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_cb_ckpt

STEPS, EVERY = 20, 5


def train_fn(ckpt):
    def body(x, i):
        x = x * 0.999 + 1e-3
        if ckpt is not None:
            ckpt.maybe_save({"x": x}, i + 1)
        return x, None

    # `start` numbers the steps: every timed run saves new steps (no duplicates).
    return jax.jit(lambda x, start: jax.lax.scan(body, x, start + jnp.arange(STEPS))[0])


def measure(mb: int, reps: int, root: str) -> dict:
    x = jax.random.normal(jax.random.key(0), (mb * 2**20 // 4,), jnp.float32)
    x = jax.block_until_ready(x)
    final = np.asarray(jax.device_get(train_fn(None)(x, 0)))
    found: dict = {"state_mb": mb}
    times: dict[str, list[float]] = {"bare": []}
    ckpts = {}
    for crossing in ("callback", "buffer"):
        directory = os.path.join(root, f"{mb}_{crossing}")
        ckpts[crossing] = jax_cb_ckpt.Checkpointer(
            directory, every=EVERY, queue_size=STEPS // EVERY, crossing=crossing
        )
        times[crossing] = []
    fns = {name: train_fn(ckpts.get(name)) for name in times}
    for fn in fns.values():
        jax.block_until_ready(fn(x, 0))  # compile; saves steps 5..20, the state `final`
    for ckpt in ckpts.values():
        ckpt.wait()
    for rep in range(reps):
        for name, fn in fns.items():
            jax.effects_barrier()
            start = time.perf_counter()
            jax.block_until_ready(fn(x, (rep + 1) * 1000))
            jax.effects_barrier()
            times[name].append(time.perf_counter() - start)
            if name in ckpts:
                ckpts[name].wait()
    med = {k: statistics.median(v) for k, v in times.items()}
    saves = STEPS // EVERY
    found["wait_per_save_ms"] = {
        k: 1000 * (med[k] - med["bare"]) / saves for k in ("callback", "buffer")
    }
    d2h = []
    for rep in range(reps):  # a fresh array each time: JAX caches an array's host copy
        fresh = jax.block_until_ready(x + rep)
        start = time.perf_counter()
        jax.device_get(fresh)
        d2h.append(time.perf_counter() - start)
    found["device_to_host_ms"] = 1000 * statistics.median(d2h)
    found["exact"] = {}
    for name, ckpt in ckpts.items():
        ckpt.close()
        restored = jax_cb_ckpt.restore(ckpt.directory, {"x": final}, step=STEPS)
        found["exact"][name] = restored["x"].tobytes() == final.tobytes()
    found["buffer_over_d2h"] = found["wait_per_save_ms"]["buffer"] / found["device_to_host_ms"]
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--sizes", default="64,256")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", default=os.path.join("benchmarks", "results", "gpu"))
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    print(jax.devices(), jax.devices()[0].client.platform_version, flush=True)
    results, ok = [], True
    with tempfile.TemporaryDirectory(prefix="jax_cb_ckpt_gpu_") as root:
        for mb in (int(s) for s in args.sizes.split(",")):
            try:
                results.append(measure(mb, args.reps, root))
            except Exception as e:  # report and go on: the other size may still work
                results.append({"state_mb": mb, "error": f"{type(e).__name__}: {e}"})
            ok = ok and "error" not in results[-1] and all(results[-1]["exact"].values())
            print(json.dumps(results[-1]), flush=True)
    with open(os.path.join(args.out, "gpu_check.json"), "w") as f:
        json.dump({"jax": jax.__version__, "device": str(jax.devices()[0]), "results": results}, f)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
