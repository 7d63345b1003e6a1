"""A PureJaxRL-shaped trainer for the exact-resume tests (tests/test_exact_resume.py):
4 seeds under `jit(vmap(train))`, a Flax MLP trained with Adam, one `fori_loop` over
updates with `maybe_save(state, i + 1)` at the end of each.

    python tests/purejaxrl_worker.py DIR [KILL_AT]

As a script it trains in the recommended shape: `ckpt.restore_or_init` gives the state
(restored, or initialised in a call of its own) and its step, and the jitted training
function receives both as arguments, so a fresh run and a resumed one are one compiled
program. With KILL_AT the process SIGKILLs itself once update KILL_AT is done and the
checkpoint before it is on disk (from a host callback every update makes, so that the
program is the same with or without it).
Run it again on the same DIR to resume; it exits 0 once every update is done.

On CPU this program's bits change when the initial state is built inside the jitted
function (`make_train_inside`, PureJaxRL's own shape): the naive resume differs.
"""

import os
import signal
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

import jax_cb_ckpt  # noqa: E402

NUM_UPDATES = 24
EVERY = 4
SEEDS = 4
KILL_AT = [0]  # set by the script's argument: the update after which the process dies
DIRECTORY = [""]


class MLP(nn.Module):
    # lecun_normal, not PureJaxRL's orthogonal: flax's orthogonal initializer is a QR,
    # and jax 0.10.2's CPU backend can deadlock in a batched QR under vmap on 2 cores.
    @nn.compact
    def __call__(self, x):
        init = nn.initializers.lecun_normal()
        x = nn.tanh(nn.Dense(64, kernel_init=init)(x))
        x = nn.tanh(nn.Dense(64, kernel_init=init)(x))
        return nn.Dense(2, kernel_init=init)(x)


NET, TX = MLP(), optax.adam(3e-4)


def keys():
    return jax.random.split(jax.random.key(0), SEEDS)


def init(rng):
    k_net, k_run = jax.random.split(rng)
    params = NET.init(k_net, jnp.zeros((4,)))
    return {"params": params, "opt": TX.init(params), "rng": k_run}


def update(state):
    rng, key = jax.random.split(state["rng"])
    x = jax.random.normal(key, (32, 4))
    y = jnp.sin(x.sum(-1, keepdims=True)) * jnp.ones((32, 2))

    def loss(params):
        out = NET.apply(params, x)
        return jnp.mean((out - y) ** 2) + 0.01 * jnp.mean(jax.nn.log_softmax(out))

    grads = jax.grad(loss)(state["params"])
    updates, opt = TX.update(grads, state["opt"], state["params"])
    return {"params": optax.apply_updates(state["params"], updates), "opt": opt, "rng": rng}


def _die_after(done):
    """After update KILL_AT: wait until the checkpoint before it is on disk (this
    callback holds the program; the writer thread writes meanwhile), then die."""
    if int(done) != KILL_AT[0]:
        return
    while (jax_cb_ckpt.latest_step(DIRECTORY[0]) or 0) < KILL_AT[0] - EVERY:
        time.sleep(0.01)
    os.kill(os.getpid(), signal.SIGKILL)


def _updates(ckpt, start, state):
    def body(i, state):
        state = update(state)
        ckpt.maybe_save(state, i + 1)  # after update i: i + 1 updates done
        jax.debug.callback(_die_after, i + 1)
        return state

    return jax.lax.fori_loop(start, NUM_UPDATES, body, state)


def make_train_inside(ckpt):
    """PureJaxRL's shape: `train(rng)` builds the initial state inside the jitted
    function. A resume must pass the restored state in, which is another program."""

    def train(rng):
        return _updates(ckpt, 0, init(rng))

    return train


def make_train(ckpt):
    """The recommended shape: `train(state, start)`, the state and the first update
    passed in, for a fresh run and a resumed one alike."""

    def train(state, start):
        return _updates(ckpt, start, state)

    return jax.jit(jax.vmap(train, in_axes=(0, None)))


def run(directory):
    """The recommended shape, end to end: the final state (also checkpoint NUM_UPDATES)."""
    with jax_cb_ckpt.Checkpointer(directory, every=EVERY) as ckpt:
        state, start = ckpt.restore_or_init(jax.jit(jax.vmap(init)), keys())
        return make_train(ckpt)(state, start)


if __name__ == "__main__":
    DIRECTORY[0] = sys.argv[1]
    if len(sys.argv) > 2:
        KILL_AT[0] = int(sys.argv[2])
    jax.block_until_ready(run(sys.argv[1]))
    print("done", flush=True)
