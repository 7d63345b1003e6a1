"""Run in a subprocess with 8 CPU devices (tests/test_multidevice.py): a 32 MiB state,
sharded or mapped over the devices, saved from a jitted scan whose body has a
collective on every step. Prints `ok <case> <crossing> <devices> <steps>`; exits non-zero
when the checkpoint of the last step is not the final state bit for bit."""

import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_cb_ckpt

N_DEV = 8
MIB = 32
STEPS, EVERY = 4, 2  # saves steps 2 and 4; the final state is step 4


def initial():
    """32 MiB of float32 plus a small int leaf; leading axes divisible by N_DEV."""
    n = MIB * 2**20 // 4
    return {
        "w": jnp.arange(n, dtype=jnp.float32).reshape(N_DEV * 64, -1) * 1e-6,
        "b": jnp.arange(N_DEV * 4, dtype=jnp.int32).reshape(N_DEV, 4),
    }


def update(state, step, top):
    return {"w": state["w"] * 0.999 + top * 1e-9, "b": state["b"] + step}


def train_fn(case, ckpt, mesh):
    if case == "gspmd":  # jit partitions the body; the max is a cross-device reduction

        def body(s, i):
            s = update(s, i, jnp.max(s["w"]))
            ckpt.maybe_save(s, i + 1)
            return s, None

        return jax.jit(lambda s: jax.lax.scan(body, s, jnp.arange(STEPS))[0])

    def mapped_body(s, i):  # one device's block; pmax is the collective
        s = update(s, i, jax.lax.pmax(jnp.max(s["w"]), "d"))
        ckpt.maybe_save(s, i + 1, axis_name="d", gather="concat")
        return s, None

    def scan(s):
        return jax.lax.scan(mapped_body, s, jnp.arange(STEPS))[0]

    if case == "shard_map":
        return jax.jit(jax.shard_map(scan, mesh=mesh, in_specs=P("d"), out_specs=P("d")))
    if case == "pmap":
        return jax.pmap(scan, axis_name="d")
    raise SystemExit(f"unknown case {case!r}")


def main(case, directory, crossing):
    mesh = jax.make_mesh((N_DEV,), ("d",))
    state = initial()
    if case == "pmap":  # pmap maps a leading device axis: blocks along axis 0
        state = jax.tree_util.tree_map(lambda x: x.reshape(N_DEV, -1, *x.shape[1:]), state)
    else:
        state = jax.device_put(state, NamedSharding(mesh, P("d")))
    with jax_cb_ckpt.Checkpointer(directory, every=EVERY, crossing=crossing) as ckpt:
        final = jax.device_get(train_fn(case, ckpt, mesh)(state))
    if case == "pmap":
        final = jax.tree_util.tree_map(lambda x: x.reshape(-1, *x.shape[2:]), final)
    steps = jax_cb_ckpt.all_steps(directory)
    restored = jax_cb_ckpt.restore(directory, jax.device_get(initial()), step=STEPS)
    for name in ("w", "b"):
        if np.asarray(restored[name]).tobytes() != np.asarray(final[name]).tobytes():
            raise SystemExit(f"{case}: leaf {name!r} of step {STEPS} is not the final state")
    print("ok", case, crossing, len(jax.devices()), steps, flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:4])
