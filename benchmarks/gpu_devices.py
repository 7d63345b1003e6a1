"""Per-device saves on this machine's devices, checked bit for bit (issue 22, 5).

    python -m benchmarks.gpu_devices [--out DIR]

Written for a GPU host (one GPU is a mesh of one), it runs on any backend. Each case is a
jitted scan of STEPS steps saving every step, over a state of float32, bfloat16 and
PRNG keys (and packed dtypes in the `+packed` cases); the last checkpoint is restored
and must equal the program's final state bit for bit:

- `shardings`: `maybe_save(..., shardings=)` on a mesh of every local device, each
  device handing over its own block;
- `pmap`: `maybe_save(..., axis_name=)` inside `jax.pmap` (the batch of devices);
- `shard_map`: `maybe_save(..., axis_name=, gather="concat")` inside `jax.shard_map`;
- `gathered`: a plain `maybe_save` of the same state (the default crossing);
- `shardings+packed`, `gathered+packed`: the same with int4, uint4 and int2 leaves.

Results (one line per case: ok, or the error) go to results.json/results.md after each
case. Exits 1 if a case fails.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import traceback
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_cb_ckpt

from .harness import write_results

STEPS = 4


def state(n_dev: int, packed: bool) -> dict[str, Any]:
    """Leading axis a multiple of the device count: every leaf splits over it. `packed`:
    int4/uint4/int2 leaves too (their own cases, so that a backend without sub-byte
    arithmetic fails those alone)."""
    rows = 2 * n_dev
    s = {
        "w": jnp.arange(rows * 1024, dtype=jnp.float32).reshape(rows, 1024) / 7,
        "h": jnp.arange(rows * 8, dtype=jnp.bfloat16).reshape(rows, 8),
        "key": jax.random.split(jax.random.key(3), rows),
    }
    if packed:
        s["q4"] = (jnp.arange(rows * 6) % 16 - 8).astype(jnp.int4).reshape(rows, 6)
        s["u4"] = (jnp.arange(rows * 6) % 16).astype(jnp.uint4).reshape(rows, 6)
        s["q2"] = (jnp.arange(rows * 5) % 4 - 2).astype(jnp.int2).reshape(rows, 5)
    return s


def update(s: dict[str, Any], i: Any) -> dict[str, Any]:
    """Elementwise (each device's block updates alone), every leaf changed."""
    new = {
        "w": s["w"] * 0.5 + i.astype(jnp.float32),
        "h": s["h"] + jnp.bfloat16(1),
        "key": jax.vmap(lambda k: jax.random.split(k)[0])(s["key"]),
    }
    if "q4" in s:
        new.update(q4=s["q4"] + jnp.int4(1), u4=s["u4"] + jnp.uint4(3), q2=s["q2"] + jnp.int2(1))
    return new


def scan(save: Callable[[Any, Any], None] | None) -> Callable[[Any], Any]:
    def body(s, i):
        s = update(s, i)
        if save is not None:
            save(s, i + 1)
        return s, None

    return lambda s: jax.lax.scan(body, s, jnp.arange(STEPS))[0]


def run_case(name: str, directory: str) -> None:
    case, packed = name.removesuffix("+packed"), name.endswith("+packed")
    devices = jax.local_devices()
    n_dev = len(devices)
    mesh = Mesh(np.array(devices), ("d",))
    sharded = NamedSharding(mesh, P("d"))
    with jax_cb_ckpt.Checkpointer(directory, every=1, max_to_keep=2) as ckpt:
        if case == "shardings":
            init = jax.device_put(state(n_dev, packed), sharded)
            shardings = jax.tree_util.tree_map(lambda _: sharded, init)
            save = lambda s, step: ckpt.maybe_save(s, step, shardings=shardings)  # noqa: E731
            out, want = jax.jit(scan(save))(init), jax.jit(scan(None))(init)
        elif case == "pmap":
            init = jax.tree_util.tree_map(
                lambda x: x.reshape(n_dev, -1, *x.shape[1:]), state(n_dev, packed)
            )
            save = lambda s, step: ckpt.maybe_save(s, step, axis_name="d")  # noqa: E731
            out = jax.pmap(scan(save), axis_name="d")(init)
            want = jax.pmap(scan(None), axis_name="d")(init)
        elif case == "shard_map":
            init = jax.device_put(state(n_dev, packed), sharded)

            def mapped(save):
                return jax.jit(
                    jax.shard_map(scan(save), mesh=mesh, in_specs=P("d"), out_specs=P("d"))
                )

            save = lambda s, step: ckpt.maybe_save(s, step, axis_name="d", gather="concat")  # noqa: E731
            out, want = mapped(save)(init), mapped(None)(init)
        elif case == "gathered":
            init = jax.device_put(state(n_dev, packed), devices[0])
            out = jax.jit(scan(ckpt.maybe_save))(init)
            want = jax.jit(scan(None))(init)
        else:
            raise ValueError(case)
        ckpt.wait()
        steps = ckpt.all_steps()
        if steps[-1] != STEPS:
            raise AssertionError(f"steps on disk {steps}, expected the last to be {STEPS}")
        if not jax_cb_ckpt.same_bits(jax.device_get(out), jax.device_get(want)):
            raise AssertionError("the run with saves computed other values than without")
        restored = ckpt.restore(jax.device_get(out), step=STEPS)
        if not jax_cb_ckpt.same_bits(restored, jax.device_get(out)):
            raise AssertionError(f"step {STEPS} restored differs from the final state")


CASES = ("shardings", "pmap", "shard_map", "gathered", "shardings+packed", "gathered+packed")


def markdown(report: dict[str, Any]) -> str:
    lines = [f"{report['devices']} x {report['device_kind']} (jax {report['jax']})", ""]
    lines += ["| case | result |", "|---|---|"]
    for case, result in report["cases"].items():
        lines.append(f"| {case} | {' '.join(result.split())} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--out", default=os.path.join("benchmarks", "results", "gpu_devices"))
    args = parser.parse_args(argv)
    report: dict[str, Any] = {
        "backend": jax.default_backend(),
        "devices": jax.local_device_count(),
        "device_kind": jax.local_devices()[0].device_kind,
        "jax": jax.__version__,
        "cases": {},
    }
    failed = 0
    with tempfile.TemporaryDirectory(prefix="jax_cb_ckpt_gpu_devices_") as root:
        for case in CASES:
            try:
                run_case(case, os.path.join(root, case))
                report["cases"][case] = "ok, bit for bit"
            except Exception as e:
                failed += 1
                report["cases"][case] = f"FAILED: {type(e).__name__}: {str(e)[:300]}"
                report.setdefault("tracebacks", {})[case] = traceback.format_exc()[-3000:]
            print(f"{case}: {report['cases'][case]}", flush=True)
            write_results(args.out, report, markdown(report))
    print(markdown(report))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
