"""One process of an incremental run over 8 CPU devices (tests/test_incremental_dist.py).

    python incremental_worker.py MODE PROCESS_ID NUM_PROCESSES PORT DIRECTORY

With NUM_PROCESSES 2: jax.distributed with gloo collectives on 127.0.0.1, 4 devices
per process; with 1, 8 devices. A (4, 2) mesh ("a", "b") over the 8 devices; the state
is a 32 MiB ring buffer `(batch, time, features)` split along its batch axis over "a"
(with 2 processes each holds half the batch) and its features over "b", which every
step writes a slice of in time (for every member of the batch, so every device's
block changes a little), plus small params and a counter. Modes:

- `train`: a jitted scan of STEPS steps saving each with `maybe_save(...,
  shardings=...)` into an incremental Checkpointer; every step restored (with the
  save's shardings) and compared with a reference computed step by step; prints one
  JSON line of findings (what each save wrote: `stats.recent`'s written_bytes).
- `restore`: the newest step restored with the shardings and compared, by this
  library and by plain Orbax (a single process, after the test deleted the steps
  before it).
"""

import json
import os
import sys

MODE, PID, NPROC, PORT, DIRECTORY = sys.argv[1:6]
PID, NPROC = int(PID), int(NPROC)
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={8 // NPROC}"

import jax  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")
if NPROC > 1:
    jax.distributed.initialize(f"127.0.0.1:{PORT}", num_processes=NPROC, process_id=PID)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_cb_ckpt  # noqa: E402

BATCH, TIME, FEATURES = 8, 1024, 1024  # 32 MiB of float32
SLICE = 8  # time steps written per step (256 KiB of the 32 MiB)
# ... at time STRIDE * step: each step in another chunk (of 64 time steps: an incremental
# save cuts each 4 MiB block into 256 KiB chunks), so that a step linked from a wrong
# step (not the one before it) holds a stale slice.
STRIDE = 64
STEPS = 4
TIMEOUT = 60.0  # peer_timeout


def shardings_for(mesh):
    return {
        "buffer": NamedSharding(mesh, P("a", None, "b")),
        "params": NamedSharding(mesh, P(None, "b")),
        "count": NamedSharding(mesh, P()),
    }


def initial(shardings):
    make = jax.jit(
        lambda: {
            "buffer": jnp.zeros((BATCH, TIME, FEATURES), jnp.float32),
            "params": jnp.arange(64 * 128, dtype=jnp.float32).reshape(64, 128) / 7,
            "count": jnp.int32(0),
        },
        out_shardings=shardings,
    )
    return make()


def update(state, step):
    """A slice of the ring written for every member (at time STRIDE * step), the params
    moved; exact in float32 whatever XLA fuses."""
    new = jnp.arange(BATCH * SLICE * FEATURES, dtype=jnp.float32)
    new = new.reshape(BATCH, SLICE, FEATURES) + step.astype(jnp.float32) * 1e3
    at = (step * STRIDE) % TIME
    return {
        "buffer": jax.lax.dynamic_update_slice(state["buffer"], new, (0, at, 0)),
        "params": state["params"] * 0.5 + 1.0,
        "count": state["count"] + 1,
    }


def local_bytes(tree):
    """This process's blocks of every leaf, in device order, as bytes."""
    return {
        k: [np.asarray(s.data).tobytes() for s in sorted(v.addressable_shards, key=_device)]
        for k, v in tree.items()
    }


def _device(shard):
    return shard.device.id


def references(shardings):
    """{step: this process's blocks of the state after that many steps}."""
    state, out = initial(shardings), {}
    step_fn = jax.jit(update, out_shardings=shardings)
    for k in range(1, STEPS + 1):
        state = step_fn(state, jnp.int32(k))
        out[k] = local_bytes(state)
    return out


def train(shardings, findings):
    ckpt = jax_cb_ckpt.Checkpointer(DIRECTORY, every=1, incremental=True, peer_timeout=TIMEOUT)

    def body(s, i):
        s = update(s, i)
        ckpt.maybe_save(s, i, shardings=shardings)
        return s, None

    run = jax.jit(
        lambda s: jax.lax.scan(body, s, jnp.arange(1, STEPS + 1))[0], out_shardings=shardings
    )
    jax.block_until_ready(run(initial(shardings)))
    ckpt.wait()
    findings["steps"] = ckpt.all_steps()
    findings["nbytes"] = {r.step: r.nbytes for r in ckpt.stats.recent}
    findings["written_bytes"] = {r.step: r.written_bytes for r in ckpt.stats.recent}
    refs = references(shardings)
    like = initial(shardings)
    findings["exact"] = {
        step: local_bytes(ckpt.restore(like, step=step)) == refs[step] for step in findings["steps"]
    }
    ckpt.close()


def main():
    mesh = jax.make_mesh((4, 2), ("a", "b"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    shardings = shardings_for(mesh)
    findings = {"process": jax.process_index(), "devices": len(jax.devices())}
    if MODE == "train":
        train(shardings, findings)
    elif MODE == "restore":
        step = jax_cb_ckpt.latest_step(DIRECTORY)
        restored = jax_cb_ckpt.restore(DIRECTORY, initial(shardings), step=step)
        findings["step"] = step
        findings["exact"] = local_bytes(restored) == references(shardings)[step]
        findings["sharding"] = [list(x.sharding.spec) for x in restored.values()]
        # Plain Orbax reads the step alone too (its own shardings, from `like`'s).
        import orbax.checkpoint as ocp

        target = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), restored
        )
        plain = ocp.StandardCheckpointer().restore(
            os.path.join(DIRECTORY, str(step), "state"), target
        )
        findings["plain_orbax_exact"] = local_bytes(plain) == local_bytes(restored)
    else:
        raise SystemExit(f"unknown mode {MODE!r}")
    print(json.dumps(findings), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
