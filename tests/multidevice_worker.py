"""Run in a subprocess with 8 CPU devices (tests/test_multidevice.py): a 32 MiB state,
sharded or mapped over the devices, saved from a jitted scan whose body has a
collective on every step. Prints one JSON line of findings; exits non-zero when the
checkpoint of the last step is not the final state bit for bit."""

import json
import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
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
    if case in ("gspmd", "gspmd_shardings", "explicit"):
        # jit partitions the body; the max is a cross-device reduction
        shardings = NamedSharding(mesh, P("d")) if case == "gspmd_shardings" else None

        def body(s, i):
            s = update(s, i, jnp.max(s["w"]))
            ckpt.maybe_save(s, i + 1, shardings=shardings)
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
    # "explicit": the mesh's axes are explicit, so the trace knows the shardings and the
    # save is per device without shardings=; the other cases use automatic (GSPMD) axes.
    kind = jax.sharding.AxisType.Explicit if case == "explicit" else jax.sharding.AxisType.Auto
    mesh = jax.make_mesh((N_DEV,), ("d",), axis_types=(kind,))
    state = initial()
    if case == "pmap":  # pmap maps a leading device axis: blocks along axis 0
        state = jax.tree_util.tree_map(lambda x: x.reshape(N_DEV, -1, *x.shape[1:]), state)
    else:
        state = jax.device_put(state, NamedSharding(mesh, P("d")))
    with jax_cb_ckpt.Checkpointer(directory, every=EVERY, crossing=crossing) as ckpt:
        final = jax.device_get(train_fn(case, ckpt, mesh)(state))
    if case == "pmap":
        final = jax.tree_util.tree_map(lambda x: x.reshape(-1, *x.shape[2:]), final)
    found = {"case": case, "crossing": crossing, "devices": len(jax.devices())}
    found["steps"] = jax_cb_ckpt.all_steps(directory)
    restored = jax_cb_ckpt.restore(directory, jax.device_get(initial()), step=STEPS)
    check(case, "restore into numpy", restored, final)
    state_dir = os.path.join(directory, str(STEPS), "state")
    # Per-device saves store one chunk per device's block (a checksum per block).
    regions = jax_cb_ckpt.metadata(directory, step=STEPS)["checksums"]["w"]
    found["sharded_format"] = len(regions) == len(jax.devices())
    # restore(like) with shardings (another one than the save's, too): placed as like.
    for spec in (P("d"), P(None, "d")):  # "w" as saved, then split along the other axis
        shapes = jax.eval_shape(initial)
        like = {
            "w": jax.ShapeDtypeStruct(
                shapes["w"].shape, np.float32, sharding=NamedSharding(mesh, spec)
            ),
            "b": jax.ShapeDtypeStruct(
                shapes["b"].shape, np.int32, sharding=NamedSharding(mesh, P("d"))
            ),
        }
        placed = jax_cb_ckpt.restore(directory, like, step=STEPS)
        check(case, f"restore(like {spec})", placed, final)
        for name in ("w", "b"):
            if placed[name].sharding != like[name].sharding:
                raise SystemExit(f"{case}: restored {name} is not placed as like")
    # Plain Orbax reads the step's state item with shardings of its own.
    target = {
        name: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, P("d")))
        for name, x in jax.eval_shape(initial).items()
    }
    plain = ocp.StandardCheckpointer().restore(state_dir, target)
    check(case, "plain Orbax StandardCheckpointer", plain, final)
    if case != "pmap":
        found["temp_mib"] = temp_mib(case, mesh, state)
    print(json.dumps(found), flush=True)


def check(case, what, got, final):
    for name in ("w", "b"):
        if np.asarray(got[name]).tobytes() != np.asarray(final[name]).tobytes():
            raise SystemExit(f"{case}: {what}: leaf {name!r} is not the final state")


def temp_mib(case, mesh, state):
    """Compiled temporary memory per device (MiB), with the save and without it."""
    out = {}
    for label, saving in (("with", True), ("without", False)):
        directory = f"/tmp/jax_cb_ckpt_temp_{os.getpid()}_{label}"
        with jax_cb_ckpt.Checkpointer(directory, every=EVERY) as ckpt:
            ckpt = ckpt if saving else _NoSave()
            compiled = train_fn(case, ckpt, mesh).lower(state).compile()
            out[label] = compiled.memory_analysis().temp_size_in_bytes / 2**20
    return out


class _NoSave:
    def maybe_save(self, *args, **kwargs):
        pass


if __name__ == "__main__":
    main(*sys.argv[1:4])
