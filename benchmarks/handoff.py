"""Device-blocking time of one save of a large state, next to its two floors.

    python -m benchmarks.handoff [--mb 64] [--saves 6] [--reps 5]

All in one process, interleaved, medians of --reps repetitions:
- bare:      a jitted lax.scan of --saves steps over the state, no checkpointing;
- noop:      the same scan with a no-op `io_callback(ordered=True)` taking the state on
             every step (inside the same `lax.cond`): JAX's own cost of a crossing;
- noop_debug: the same with a no-op `jax.debug.callback` (the library's crossing);
- maybe_save: the same scan with `ckpt.maybe_save(state, step)` on every step
             (queue_size = 2 x --saves, so the queue never blocks and we see the hand-off);
- copyto:    one `np.copyto` of the state's bytes into an already-touched buffer.
Per-save blocking = (scan time - bare time) / saves. The library's own stats give the
part spent inside its callback (`handoff_s`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

import jax_cb_ckpt

from .harness import medians, rotated, timed


def build(save_fn):
    """A jitted scan over `steps` that updates the state and (maybe) saves each step."""

    @jax.jit
    def run(x, steps):
        def body(x, i):
            x = x + 1.0
            if save_fn is not None:
                save_fn({"x": x}, i)
            return x, None

        return jax.lax.scan(body, x, steps)[0]

    return run


def noop_save(state, step):
    jax.lax.cond(
        step >= 0,
        lambda s, i: io_callback(lambda *_: None, None, i, s, ordered=True),
        lambda s, i: None,
        state,
        step,
    )


def noop_debug_save(state, step):
    jax.lax.cond(
        step >= 0,
        lambda s, i: jax.debug.callback(lambda *_: None, i, s),
        lambda s, i: None,
        state,
        step,
    )


def measure(mb: int, saves: int, reps: int) -> dict:
    n = mb * (1 << 20) // 4
    x0 = jnp.zeros(n, jnp.float32)
    bare = build(None)
    noop = build(noop_save)
    noop_debug = build(noop_debug_save)
    warm, steps = jnp.arange(saves), jnp.arange(saves, 2 * saves)
    times: dict[str, list[float]] = {
        "bare": [],
        "noop": [],
        "noop_debug": [],
        "maybe_save": [],
        "copyto": [],
    }
    handoff: list[float] = []
    src = np.ones(n, np.float32)
    dst = np.zeros(n, np.float32)  # touched: zeros were written
    dst += 0
    for rep in range(reps + 1):  # the first repetition warms up and is dropped
        with tempfile.TemporaryDirectory() as d:
            ckpt = jax_cb_ckpt.Checkpointer(d, every=1, queue_size=2 * saves)
            ours = build(ckpt.maybe_save)
            for fn in (bare, noop, noop_debug, ours):  # compile outside the timed region
                jax.block_until_ready(fn(x0, warm))
            ckpt.wait()
            fns = {"bare": bare, "noop": noop, "noop_debug": noop_debug, "maybe_save": ours}
            t = {name: timed(fns[name], x0, steps) for name in rotated(list(fns), rep)}
            start = time.perf_counter()
            np.copyto(dst, src)
            t["copyto"] = time.perf_counter() - start
            ckpt.close()
            if rep:
                for k, v in t.items():
                    times[k].append(v)
                handoff.extend(r.handoff_s for r in ckpt.stats.recent[saves:])
    med = medians(times)
    per_save = {
        "noop": (med["noop"] - med["bare"]) / saves,
        "noop_debug": (med["noop_debug"] - med["bare"]) / saves,
        "maybe_save": (med["maybe_save"] - med["bare"]) / saves,
    }
    return {
        "state_mb": mb,
        "saves_per_scan": saves,
        "reps": reps,
        "median_scan_s": med,
        "blocking_per_save_s": per_save,
        "copyto_s": med["copyto"],
        "library_handoff_median_s": statistics.median(handoff),
        "ratio_maybe_save_to_noop": per_save["maybe_save"] / per_save["noop"],
        "jax": jax.__version__,
        "backend": jax.default_backend(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--mb", type=int, default=64)
    parser.add_argument("--saves", type=int, default=6)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    result = measure(args.mb, args.saves, args.reps)
    print(json.dumps(result, indent=2))
    ms = {k: v * 1e3 for k, v in result["blocking_per_save_s"].items()}
    print(
        f"\n{args.mb} MB state, per save: maybe_save {ms['maybe_save']:.1f} ms, "
        f"no-op io_callback {ms['noop']:.1f} ms, no-op debug.callback "
        f"{ms['noop_debug']:.1f} ms, np.copyto (touched) "
        f"{result['copyto_s'] * 1e3:.1f} ms; library hand-off "
        f"{result['library_handoff_median_s'] * 1e3:.3f} ms; ratio to no-op "
        f"{result['ratio_maybe_save_to_noop']:.2f}"
    )


if __name__ == "__main__":
    main()
