"""Training across processes (jax.distributed), checkpointed from inside one jit.

    python examples/multiprocess.py                  # 2 local processes x 4 CPU devices
    python examples/multiprocess.py --steps 400      # again: resumes from the latest step

Run again, each command resumes (a finished run is shown, not retrained; so is a run
already past --steps). The default directory is named by the options that change the
state's shape (`/tmp/jax_cb_ckpt_multiprocess-1024x4096` for --rows and --cols).

Without --process-id the script is a local launcher: it starts --processes copies of
itself on this machine (CPU devices, gloo collectives on 127.0.0.1) and forwards SIGTERM
and Ctrl-C to them. On a cluster, start one copy per host yourself:

    python examples/multiprocess.py --process-id I --num-processes N \
        --coordinator HOST0:PORT --dir /shared/ckpt

Every process creates the same `Checkpointer` on the same (shared) directory and runs
the same `ckpt.run`; the state's arrays are sharded over the devices of all processes
(a mesh over `jax.devices()`). Each process writes its own devices' blocks; process 0
commits each step once every process wrote its part. A SIGTERM to any process stops
every process at the same step, saved (exit 143); run again to resume. Each process
prints a digest of its own blocks, so two runs can be compared bit for bit.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import signal
import socket
import subprocess
import sys


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--dir", help="checkpoints (default: /tmp/jax_cb_ckpt_multiprocess-<rows>x<cols>)"
    )
    p.add_argument("--steps", type=int, default=200, help="total training steps")
    p.add_argument("--every", type=int, default=50, help="save every N steps")
    p.add_argument("--rows", type=int, default=1024, help="parameter rows (sharded)")
    p.add_argument("--cols", type=int, default=4096, help="parameter columns")
    launcher = p.add_argument_group("local launcher")
    launcher.add_argument("--processes", type=int, default=2)
    launcher.add_argument("--devices", type=int, default=4, help="CPU devices per process")
    worker = p.add_argument_group("one process of the run (set by the launcher)")
    worker.add_argument("--process-id", type=int)
    worker.add_argument("--num-processes", type=int)
    worker.add_argument("--coordinator", help="HOST:PORT of process 0")
    args = p.parse_args(argv)
    if args.dir is None:  # one directory per state shape: never resume another shape
        args.dir = f"/tmp/jax_cb_ckpt_multiprocess-{args.rows}x{args.cols}"
    return args


def launch(args: argparse.Namespace) -> int:
    """Start the processes of one run on this machine; forward stop signals to them."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(
        os.environ,
        JAX_PLATFORMS="cpu",
        XLA_FLAGS=f"--xla_force_host_platform_device_count={args.devices}",
    )
    common = [a for a in sys.argv[1:] if not a.startswith(("--processes", "--devices"))]
    children = [
        subprocess.Popen(
            [sys.executable, __file__, *common]
            + ["--process-id", str(i), "--num-processes", str(args.processes)]
            + ["--coordinator", f"127.0.0.1:{port}"],
            env=env,
        )
        for i in range(args.processes)
    ]

    def forward(signum: int, frame: object) -> None:
        for child in children:
            child.send_signal(signal.SIGTERM)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    codes = [child.wait() for child in children]
    return max(codes, key=abs)


def train(args: argparse.Namespace) -> int:
    """One process of the run."""
    import jax

    if os.environ.get("JAX_PLATFORMS") == "cpu":
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(args.coordinator, args.num_processes, args.process_id)

    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import jax_cb_ckpt

    mesh = Mesh(np.array(jax.devices()), ("d",))
    rows = NamedSharding(mesh, P("d"))  # parameters split by rows over every device
    whole = NamedSharding(mesh, P())  # replicated: the loss
    shardings = {"w": rows, "m": rows, "loss": whole}

    def init() -> dict[str, jax.Array]:
        zeros = jnp.zeros((args.rows, args.cols), jnp.float32)
        return {"w": zeros, "m": zeros, "loss": jnp.zeros((), jnp.float32)}

    state = jax.jit(init, out_shardings=shardings)()

    def step(s: dict[str, jax.Array], i: jax.Array) -> dict[str, jax.Array]:
        # A moving target; momentum SGD on 0.5 * |w - target|^2. The loss is a mean
        # over every device: a collective across the processes, as in real training.
        row = jnp.arange(args.rows, dtype=jnp.float32)[:, None]
        col = jnp.arange(args.cols, dtype=jnp.float32)
        target = jnp.sin(row * 0.003 + col * 0.01 + i * 0.1)
        grad = s["w"] - target
        m = 0.9 * s["m"] + grad
        return {"w": s["w"] - 0.05 * m, "m": m, "loss": jnp.mean(grad**2)}

    me = jax.process_index()
    ckpt = jax_cb_ckpt.Checkpointer(args.dir, every=args.every)
    resumed = ckpt.latest_step()
    steps = args.steps
    if resumed is not None and resumed > steps:
        # A longer run is there already (--steps 400, then the default 200): show it
        # rather than fail; run() restores its latest step and has nothing left to do.
        say(f"process {me}: {args.dir} holds a run at step {resumed}, past --steps {steps}")
        steps = resumed
    try:
        state = ckpt.run(step, state, num_steps=steps)
    except jax_cb_ckpt.Preempted as e:
        say(f"process {me}: stopped at step {e.step}, saved; run again to resume")
        ckpt.close()
        return 143
    ckpt.close()
    digest = hashlib.sha256()
    for leaf in (state["w"], state["m"], state["loss"]):
        for shard in sorted(leaf.addressable_shards, key=lambda s: s.device.id):
            digest.update(np.asarray(shard.data).tobytes())
    say(
        f"process {me}: steps {resumed or 0}..{steps}, loss {float(state['loss']):.6g}, "
        f"saved steps {ckpt.all_steps()}, digest of my blocks {digest.hexdigest()[:16]}"
    )
    return 0


def say(line: str) -> None:
    """One write per line: the processes share the launcher's output."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.process_id is None:
        return launch(args)
    return train(args)


if __name__ == "__main__":
    sys.exit(main())
