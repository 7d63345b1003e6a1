"""A training process for the crash and preemption tests (run as a script).

    python tests/crash_worker.py DIR [--sigint] [--persistent=DIR2]

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


PERSISTENT_EVERY = 4 * EVERY  # with --persistent: every 4th saved step is copied there


def train(directory, *, sigint=False, num_steps=NUM_STEPS, persistent=None):
    tier = {}
    if persistent is not None:
        tier = dict(
            persistent=persistent,
            persistent_every=PERSISTENT_EVERY,
            persistent_keep=[jax_cb_ckpt.LatestN(2)],
        )
    ckpt = jax_cb_ckpt.Checkpointer(directory, every=EVERY, max_to_keep=3, **tier)
    with ckpt:
        return ckpt.run(body, init(), num_steps, sigint=sigint)


if __name__ == "__main__":
    print("started", flush=True)
    tiers = [a.split("=", 1)[1] for a in sys.argv if a.startswith("--persistent=")]
    train(sys.argv[1], sigint="--sigint" in sys.argv, persistent=(tiers or [None])[0])
    print("done", flush=True)
