"""Demo: train inside one jitted loop, get killed, resume, match the uninterrupted run.

    python -m jax_cb_ckpt.demo            # needs optax: pip install "jax_cb_ckpt[demo]"

1. A child process trains a small MLP with optax (Adam on a cosine schedule) for
   `--steps` steps, entirely inside one jitted `lax.fori_loop`, calling
   `ckpt.maybe_save` in the loop body. This process SIGKILLs it once a checkpoint at
   `--kill-at` or later is on disk: a real, unannounced death with writes in flight.
2. This process takes the latest complete checkpoint and its step
   (`ckpt.restore_or_init`) and trains only the remaining steps, checkpointing on, with
   the same compiled program: the state and the first step are its arguments.
3. It trains all steps again without interruption and compares: the resumed final state
   (parameters, optimizer state, schedule counter, PRNG key) must equal it bit for bit.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import jax_cb_ckpt

try:
    import optax
except ImportError:  # pragma: no cover - exercised by users without the extra
    optax = None

# ~140 us a step on a 2-core CPU: a save every 100 steps comes every ~14 ms, longer than
# the writer takes to write one (~5 ms), so the device waits only for the copy.
IN, HIDDEN, OUT, BATCH = 8, 128, 1, 256


def init_state(seed: int, total_steps: int) -> dict[str, Any]:
    """Parameters, optimizer state, PRNG key and step: everything a run needs to resume."""
    key = jax.random.key(seed)
    k1, k2, key = jax.random.split(key, 3)
    params = {
        "w1": jax.random.normal(k1, (IN, HIDDEN)) / np.sqrt(IN),
        "b1": jnp.zeros(HIDDEN),
        "w2": jax.random.normal(k2, (HIDDEN, OUT)) / np.sqrt(HIDDEN),
        "b2": jnp.zeros(OUT),
    }
    opt_state = make_optimizer(total_steps).init(params)
    return {"params": params, "opt_state": opt_state, "key": key, "step": jnp.int32(0)}


def make_optimizer(total_steps: int):
    assert optax is not None
    return optax.adam(optax.cosine_decay_schedule(3e-3, decay_steps=total_steps, alpha=0.05))


def target(x):
    return jnp.sin(x @ jnp.linspace(-1.0, 1.0, IN)[:, None] * 2.0)


def loss_fn(params, x, y):
    h = jnp.tanh(x @ params["w1"] + params["b1"])
    return jnp.mean((h @ params["w2"] + params["b2"] - y) ** 2)


def make_train(total_steps: int, ckpt: jax_cb_ckpt.Checkpointer):
    """`train(state, start)`: one jitted loop over steps `start` to `total_steps`,
    checkpointing from inside. The state and the first step are arguments, so a fresh
    run and a resumed one execute one compiled program."""
    optimizer = make_optimizer(total_steps)

    def body(step, state):
        key, sub = jax.random.split(state["key"])
        x = jax.random.normal(sub, (BATCH, IN))
        grads = jax.grad(loss_fn)(state["params"], x, target(x))
        updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)  # type: ignore[union-attr]
        state = {"params": params, "opt_state": opt_state, "key": key, "step": step + 1}
        # Traced code: step is a tracer. The predicate (step % every == 0) runs on the
        # device; only saving steps cross to the host.
        ckpt.maybe_save(state, state["step"])
        return state

    @jax.jit
    def train(state, start):
        return jax.lax.fori_loop(start, total_steps, body, state)

    return train


def eval_loss(state) -> float:
    x = jax.random.normal(jax.random.key(1234), (1024, IN))
    return float(loss_fn(state["params"], x, target(x)))


def worker(args) -> None:
    """The child: train all steps in one jitted loop (it is killed part-way)."""
    state = init_state(args.seed, args.steps)
    with jax_cb_ckpt.Checkpointer(args.dir, every=args.every, max_to_keep=3) as ckpt:
        train = make_train(args.steps, ckpt)
        print("worker: training", flush=True)
        jax.block_until_ready(train(state, 0))
    print("worker: finished without being killed", flush=True)


def run_and_kill(args) -> int | None:
    """Start the worker, SIGKILL it once a checkpoint >= kill_at is on disk."""
    command = [sys.executable, "-m", "jax_cb_ckpt.demo", "--worker", "--dir", args.dir]
    command += ["--steps", str(args.steps), "--every", str(args.every), "--seed", str(args.seed)]
    child = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 600
    while child.poll() is None and time.monotonic() < deadline:
        latest = jax_cb_ckpt.latest_step(args.dir)
        if latest is not None and latest >= args.kill_at:
            os.kill(child.pid, signal.SIGKILL)
            child.wait()
            return latest
        time.sleep(0.002)
    child.wait()
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=6000)
    parser.add_argument("--every", type=int, default=200)
    parser.add_argument("--kill-at", type=int, default=None, help="default: steps // 3")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dir", default=None, help="checkpoint directory (default: a temp dir)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if optax is None:
        print('the demo needs optax: pip install "jax_cb_ckpt[demo]"', file=sys.stderr)
        return 2
    if args.worker:
        worker(args)
        return 0
    if args.kill_at is None:
        args.kill_at = args.steps // 3
    if args.dir is not None:
        return demo(args)
    scratch = tempfile.mkdtemp(prefix="jax_cb_ckpt_demo_")
    args.dir = os.path.join(scratch, "ckpt")
    try:
        return demo(args)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)  # our own temp dir: leave nothing behind


def explain(stats: jax_cb_ckpt.Stats) -> None:
    """What the run's saves cost, a line per number (`stats.summary()` in words)."""
    wait, copy = stats.blocking_per_save_s * 1e3, stats.handoff_per_save_s * 1e3
    print(f"    per save, medians of {stats.saves} saves:")
    print(
        f"      the device waited {wait:.2f} ms: {copy:.2f} ms to copy the state into host "
        f"memory,\n        the rest to hand it over (and for a place in the queue, if full)"
    )
    print(
        f"      the writer thread wrote it to disk in {stats.write_per_save_s * 1e3:.1f} ms, "
        "in the background,\n        while the device trained on"
    )
    if stats.queue_waits == 0:
        print(
            f"      no save waited for a place in the queue (at most "
            f"{stats.queue_high_water} in flight): the writer kept up"
        )
    else:
        print(
            f"      {stats.queue_waits} of {stats.saves} saves waited for a place in the queue "
            f"(at most {stats.queue_high_water} in flight):\n        the writer did not always "
            "keep up (it shares the CPU with the training);\n        when that matters, "
            "save less often or raise queue_size"
        )
    print(f"    ckpt.stats: {stats.summary()}")


def demo(args: argparse.Namespace) -> int:

    print(
        f"jax_cb_ckpt demo: {args.steps} steps of an MLP trained with optax inside one "
        f"jitted loop,\na checkpoint every {args.every} steps (max_to_keep=3) in "
        f"{args.dir}\n"
    )
    print(f"[1] a child process trains; it is SIGKILLed once step >= {args.kill_at} is on disk")
    start = time.perf_counter()
    seen = run_and_kill(args)
    on_disk = jax_cb_ckpt.all_steps(args.dir)
    if seen is None:
        print("    the child finished before it could be killed (use more --steps)")
    else:
        print(f"    killed after seeing step {seen} on disk ({time.perf_counter() - start:.1f} s)")
    print(f"    complete checkpoints left on disk: {on_disk}")
    if len(on_disk) > 3:
        print(
            "    (max_to_keep=3 keeps three; a fourth is left when the kill fell between a "
            "save\n    and the deletion it triggers: the next save's retention removes it)"
        )

    with jax_cb_ckpt.Checkpointer(args.dir, every=args.every, max_to_keep=3) as ckpt:
        # The latest checkpoint and its step (or, with none on disk, a fresh state and 0)
        resumed, start_step = ckpt.restore_or_init(init_state, args.seed, args.steps)
        print(f"\n[2] restored step {start_step}; training the remaining steps")
        resumed = make_train(args.steps, ckpt)(resumed, start_step)
        ckpt.wait()
        print(f"    saved steps now: {ckpt.all_steps()} (max_to_keep=3)")
        explain(ckpt.stats)

    print("\n[3] the same run without interruption, for comparison")
    # The same program (saves included), into a temporary directory of its own.
    scratch = tempfile.mkdtemp(prefix="jax_cb_ckpt_demo_reference_")
    try:
        with jax_cb_ckpt.Checkpointer(scratch, every=args.every, max_to_keep=1) as ref:
            reference = make_train(args.steps, ref)(init_state(args.seed, args.steps), 0)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    same = jax_cb_ckpt.same_bits(resumed, reference)
    print(
        f"    final eval loss: resumed {eval_loss(resumed):.6f}, "
        f"uninterrupted {eval_loss(reference):.6f}"
    )
    print(f"    resumed final state == uninterrupted final state, bit for bit: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
