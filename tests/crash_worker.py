"""A training process for the crash and preemption tests (run as a script).

    python tests/crash_worker.py DIR [--sigint]

Trains NUM_STEPS steps with Checkpointer.run, saving every EVERY steps: the writer is
busy all the time, so a kill lands with writes in flight. Exits 0 when done; on
SIGTERM (or SIGINT with --sigint) it saves, stops and exits with 128 + the signal.
"""

import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jax_cb_ckpt  # noqa: E402

NUM_STEPS = 3000  # ~2-4 s of saves: a random kill lands mid-run
EVERY = 5
SIZE = 1 << 14  # 64 KB of float32


def init():
    return {"x": jnp.zeros(SIZE), "key": jax.random.key(42), "count": jnp.int32(0)}


def body(state, step):
    key, sub = jax.random.split(state["key"])
    x = state["x"] * 0.999 + jax.random.normal(sub, (SIZE,)) * 1e-3
    return {"x": x, "key": key, "count": state["count"] + step}


def train(directory, *, sigint=False, num_steps=NUM_STEPS):
    ckpt = jax_cb_ckpt.Checkpointer(directory, every=EVERY, max_to_keep=3)
    with ckpt:
        return ckpt.run(body, init(), num_steps, sigint=sigint)


if __name__ == "__main__":
    print("started", flush=True)
    train(sys.argv[1], sigint="--sigint" in sys.argv)
    print("done", flush=True)
