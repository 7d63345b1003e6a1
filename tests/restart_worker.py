"""Training processes for the restart tests (tests/test_restart.py), run as a script:

    python tests/restart_worker.py SCENARIO DIR [KILL_AT] [OPTION]

Each scenario is a loop in a shape users write, run to its end (exit 0, the final
state's digest printed as a JSON line), or SIGKILLed by itself once update KILL_AT is
done and the checkpoint before it is on disk. Run again on the same directory, it
resumes; the test compares the digest with an uninterrupted run's.

- "loop": `restore_or_init` + a `fori_loop(start, N)` saving `i + 1` (OPTION "raise":
  on_damaged="raise");
- "scan_restarting": the README's first example as users extend it, a scan whose
  index starts at 0 again after `restore_or_init` (saves `i + 1`);
- "orbax": the loop, resumed from a directory that plain Orbax's CheckpointManager
  wrote (`orbax_run`: steps 5..20 with StandardSave);
- "weak": an initial state with a Python number (gymnax's LogWrapper's
  `episode_returns = 0`), once with `restore_or_init` and a loop of one's own and
  once (OPTION "run") with `ckpt.run`;
- "clock": a loop of one's own saving by the clock (every_seconds), its last step
  given by `last_step=` (OPTION "unsaid": without it);
- "while": `jit(vmap(run))` of a `while_loop` whose members stop at different steps.

Every update is exactly representable arithmetic (or the same compiled program for a
fresh and a resumed run), so any run that resumes right ends in the same bits.
"""

import hashlib
import json
import os
import signal
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jax_cb_ckpt  # noqa: E402

N = 40  # updates
EVERY = 5
KILL_AT = [None]
DIRECTORY = [""]
NEEDED = [None]  # the step that must be on disk before the kill (default: KILL_AT's chunk)


def digest(state):
    """The state's bits, leaf by leaf (typed keys as their key data)."""
    h = hashlib.sha256()
    for leaf in jax.tree.leaves(state):
        if isinstance(leaf, jax.Array) and jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            leaf = jax.random.key_data(leaf)
        array = np.asarray(leaf)
        h.update(f"{array.dtype}{array.shape}".encode() + array.tobytes())
    return h.hexdigest()


def done(state, **extra):
    print(json.dumps({"digest": digest(state), **extra}), flush=True)


def _die_after(step):
    """After update KILL_AT: wait until the checkpoint before it is on disk (this
    callback holds the program; the writer thread writes meanwhile), then die."""
    if KILL_AT[0] is None or int(np.max(step)) != KILL_AT[0]:
        return
    needed = KILL_AT[0] - KILL_AT[0] % EVERY if NEEDED[0] is None else NEEDED[0]
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        steps = [s for s in os.listdir(DIRECTORY[0]) if s.isdigit()]
        if steps and max(map(int, steps)) >= needed:
            break
        time.sleep(0.01)
    os.kill(os.getpid(), signal.SIGKILL)


def init(key):
    return {"w": jnp.zeros(1000, jnp.float32), "key": key}


def update(state, i):
    key, sub = jax.random.split(state["key"])
    noise = jnp.round(jax.random.normal(sub, (1000,)) * 8) / 8  # exact in float32
    return {"w": state["w"] * 0.5 + noise, "key": key}


def loop(directory, option):
    on_damaged = "raise" if option == "raise" else "fall_back"
    with jax_cb_ckpt.Checkpointer(directory, every=EVERY, on_damaged=on_damaged) as ckpt:
        state, start = ckpt.restore_or_init(jax.jit(init), jax.random.key(0))
        final = _train(ckpt, update, state, start)
    done(final, start=int(start))


def _train(ckpt, step_fn, state, start):
    """The resumable form: a fori_loop from the step resumed, saving `i + 1`, that
    dies where the test asked (`_die_after`)."""

    @jax.jit
    def train(state, start):
        def body(i, state):
            state = step_fn(state, i)
            ckpt.maybe_save(state, i + 1)
            jax.debug.callback(_die_after, i + 1)
            return state

        return jax.lax.fori_loop(start, N, body, state)

    return train(state, start)


def scan_restarting(directory, option):
    with jax_cb_ckpt.Checkpointer(directory, every=EVERY) as ckpt:
        state, start = ckpt.restore_or_init(jax.jit(init), jax.random.key(0))

        @jax.jit
        def train(state):
            def body(state, i):
                state = update(state, i)
                ckpt.maybe_save(state, i + 1)  # the scan index: starts at 0 every call
                jax.debug.callback(_die_after, i + 1)
                return state, None

            return jax.lax.scan(body, state, jnp.arange(N))[0]

        final = train(state)
    done(final, start=int(start))


def orbax_run(directory):
    """The run before it switched libraries: chunks of EVERY jitted updates in a Python
    loop, a plain Orbax CheckpointManager saving after each (StandardSave, one item)."""
    import orbax.checkpoint as ocp

    state = init(jax.random.key(0))
    step = jax.jit(update)
    with ocp.CheckpointManager(directory) as manager:
        for i in range(20):
            state = step(state, jnp.int32(i))
            if (i + 1) % EVERY == 0:
                saved = {"w": state["w"], "key": jax.random.key_data(state["key"])}
                manager.save(i + 1, args=ocp.args.StandardSave(saved))
        manager.wait_until_finished()
    print(json.dumps({"orbax_steps": sorted(manager.all_steps())}), flush=True)


def orbax(directory, option):
    """The loop, over a directory plain Orbax wrote: its state's key as raw key data
    (Orbax's StandardSave takes no typed keys), wrapped again for the updates."""

    def init_raw(key):
        return {"w": jnp.zeros(1000, jnp.float32), "key": jax.random.key_data(key)}

    with jax_cb_ckpt.Checkpointer(directory, every=EVERY) as ckpt:
        state, start = ckpt.restore_or_init(jax.jit(init_raw), jax.random.key(0))

        @jax.jit
        def train(state, start):
            def body(i, state):
                typed = {"w": state["w"], "key": jax.random.wrap_key_data(state["key"])}
                typed = update(typed, i)
                state = {"w": typed["w"], "key": jax.random.key_data(typed["key"])}
                ckpt.maybe_save(state, i + 1)
                jax.debug.callback(_die_after, i + 1)
                return state

            return jax.lax.fori_loop(start, N, body, state)

        final = train(state, start)
    done(final, start=int(start))


def weak_init(key):
    return {"w": jax.random.normal(key, (2,)), "ret": 0}  # "ret": a Python 0, weakly typed


def weak_body(i, state):
    return {"w": state["w"] * 0.5, "ret": state["ret"] + jnp.sum(state["w"])}


def weak(directory, option):
    with jax_cb_ckpt.Checkpointer(directory, every=EVERY) as ckpt:
        if option == "run":

            def body(state, i):
                jax.debug.callback(_die_after, i + 1)
                return weak_body(i, state)

            final = ckpt.run(body, jax.jit(weak_init)(jax.random.key(1)), N)
            done(final)
            return
        state, start = ckpt.restore_or_init(jax.jit(weak_init), jax.random.key(1))
        final = _train(ckpt, lambda state, i: weak_body(i, state), state, start)
    done(final, start=int(start))


def clock(directory, option):
    """Saves by the clock alone (every_seconds=3600: none in this short run), the
    initial state saved first (initial_save), the last step given by `last_step=`."""
    last = None if option == "unsaid" else N
    NEEDED[0] = 0
    with jax_cb_ckpt.Checkpointer(
        directory, every_seconds=3600, check_every=EVERY, initial_save=True
    ) as ckpt:
        state, start = ckpt.restore_or_init(jax.jit(init), jax.random.key(0))

        @jax.jit
        def train(state, start):
            def body(i, state):
                state = update(state, i)
                ckpt.maybe_save(state, i + 1, last_step=last)
                jax.debug.callback(_die_after, i + 1)
                return state

            return jax.lax.fori_loop(start, N, body, state)

        final = train(state, start)
    done(final, start=int(start), latest=jax_cb_ckpt.latest_step(directory))


WHILE_N = (5, 10, 15, 20)


def while_(directory, option):
    """Four members counting to 5, 10, 15 and 20 in one vmapped `ckpt.while_loop` (the
    documented form); a member that is done stays done (the body still runs for it;
    JAX discards its results, and it saves nothing)."""
    with jax_cb_ckpt.Checkpointer(directory, every=EVERY) as ckpt:
        x, start = ckpt.restore_or_init(lambda: jnp.zeros(4))

        def run(x, start, n):
            def body(c):
                i, x = c
                x = x * 1.5 + 1.0
                ckpt.maybe_save(x, i + 1)
                jax.debug.callback(_die_after, i + 1)
                return i + 1, x

            return ckpt.while_loop(lambda c: c[0] < n, body, (start, x))[1]

        starts = jnp.broadcast_to(jnp.asarray(start, jnp.int32), (4,))
        final = jax.jit(jax.vmap(run))(x, starts, jnp.asarray(WHILE_N))
    done(final, start=np.asarray(start).tolist())


SCENARIOS = {
    "loop": loop,
    "scan_restarting": scan_restarting,
    "orbax": orbax,
    "weak": weak,
    "clock": clock,
    "while": while_,
}


if __name__ == "__main__":
    scenario, DIRECTORY[0] = sys.argv[1], sys.argv[2]
    if len(sys.argv) > 3 and sys.argv[3] != "-":
        KILL_AT[0] = int(sys.argv[3])
    option = sys.argv[4] if len(sys.argv) > 4 else ""
    if scenario == "orbax_run":
        orbax_run(DIRECTORY[0])
    else:
        SCENARIOS[scenario](DIRECTORY[0], option)
