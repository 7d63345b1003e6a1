"""The writer: a durable save's latency and bandwidth against the disk's own ceilings.

    python -m benchmarks.writer                     # 5 repetitions, ~5 minutes on 2 cores
    python -m benchmarks.writer --quick             # 3 repetitions, shorter loops
    python -m benchmarks.writer --dir /mnt/nvme     # measure that filesystem (default: /tmp)
    python -m benchmarks.writer --only tiny --reps 1          # one case, seconds

Each case saves a state eagerly through the public API, `ckpt.save(state, step)` then
`ckpt.wait()`: when the clock stops the checkpoint is handed over, written, fsynced and
committed. Next to it, in the same process, the same directory and the same repetitions
(the order rotating per repetition, harness.rotated), two ceilings of this machine:

- write+fsync: a plain Python write of the state's bytes into one new file, then fsync;
- commit: a small durable commit (3 small files written and fsynced, their directory
  fsynced, renamed into place, the parent fsynced).

Figures are medians; "x write+fsync" is our GB/s over the ceiling's (1.0 = the disk's
speed), "x commit" our time over the commit's. GB/s count the state's bytes (1e9), also
when compressed. Also measured: the 80-leaf state saved inside `jit` on 8 CPU devices,
gathered vs per device (`shardings=`; in a subprocess with 8 host devices), and a jitted
scan of tiny steps with `maybe_save` against the chunked outer loop (benchmarks.suite,
through run.run_config), and, where the library has `on_full="newest"`, a save every
10 tiny steps with that policy against the bare scan. Results: results.json and
results.md under --out.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

import jax_cb_ckpt

from . import suite
from .harness import medians, rotated, write_results
from .run import machine, run_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
N_DEV = 8
GB = 1e9

# The checksum column. A checksum of what the writer writes is being added elsewhere
# (Orbax keeps none). When the records in `ckpt.stats.recent` gain a field of this name
# (seconds spent checksumming that save), the column shows its median; until then, n/a.
CHECKSUM_FIELD = "checksum_s"


# -- states ----------------------------------------------------------------------------


def _random(shape: tuple[int, ...], seed: int) -> np.ndarray:
    """Random bytes as uint32: incompressible, so zstd cannot shrink the write."""
    n = int(np.prod(shape)) * 4
    return np.frombuffer(np.random.default_rng(seed).bytes(n), np.uint32).reshape(shape)


def tiny_state() -> dict[str, np.ndarray]:
    """4 leaves of 512 bytes (2 KiB)."""
    return {f"p{i}": _random((128,), i) for i in range(4)}


def leaves80_state() -> dict[str, np.ndarray]:
    """80 leaves of (8, 410) uint32, 1 MiB in all (13 KB each; 8 rows: one per device)."""
    return {f"p{i:02d}": _random((N_DEV, 410), i) for i in range(80)}


def single_leaf(mib: int) -> Callable[[], dict[str, np.ndarray]]:
    def make() -> dict[str, np.ndarray]:
        return {"x": _random((mib << 18,), 0)}

    make.__doc__ = f"One leaf of {mib} MiB."
    return make


# What happens to the files of earlier repetitions, for the library and its ceilings
# alike: "keep" keeps them all (every save writes new blocks), "retain" deletes the one
# before once the next is durable (the library with max_to_keep=1: the disk reuses the
# blocks it frees). These VMs' disks run several times faster on reused blocks than on
# new ones, so a ratio means something only against a ceiling of the same pattern.
Pattern = str
PATTERNS: tuple[Pattern, ...] = ("keep", "retain")


@dataclasses.dataclass(frozen=True)
class Case:
    key: str  # what --only selects
    label: str
    make: Callable[[], dict[str, np.ndarray]]
    compressions: tuple[bool, ...]  # full profile; quick keeps the first unless large
    large: bool = False
    patterns: tuple[Pattern, ...] = ("keep",)


CASES = (
    Case("tiny", "tiny, 4 leaves", tiny_state, (False, True)),
    Case("leaves80", "80 leaves, 1 MiB in all", leaves80_state, (False, True)),
    Case("64MiB", "one 64 MiB leaf", single_leaf(64), (False, True), patterns=PATTERNS),
    Case("256MiB", "one 256 MiB leaf", single_leaf(256), (False, True), True, PATTERNS),
)


# -- what is timed ---------------------------------------------------------------------


def save_and_wait(ckpt: jax_cb_ckpt.Checkpointer, state: Any, step: int) -> tuple[float, float]:
    """(until save() returned, until wait() returned): handed over / durably committed."""
    start = time.perf_counter()
    ckpt.save(state, step)
    handed = time.perf_counter() - start
    ckpt.wait()
    return handed, time.perf_counter() - start


# The ceilings' files follow the case's pattern, as the checkpoints do: "keep" keeps
# them until the case's directory is removed; "retain" deletes the previous one inside
# the timed repetition, after the new one is durable (the library's retention deletes
# its previous step after the commit, and the cost of a deletion, which ext4 mounted
# with `discard` trims at the next journal commit, lands on whichever fsync comes next).


def write_fsync(
    leaves: list[np.ndarray], directory: str, name: str, previous: str | None = None
) -> float:
    """Ceiling (a): the same bytes written into one new file and fsynced; then the
    file `previous` deleted (the "retain" pattern)."""
    start = time.perf_counter()
    with open(os.path.join(directory, name), "wb", buffering=0) as f:
        for leaf in leaves:
            view = np.ascontiguousarray(leaf).data.cast("B")
            while view:  # an unbuffered write may write less than asked
                view = view[f.write(view) or 0 :]
        os.fsync(f.fileno())
    if previous is not None and os.path.exists(os.path.join(directory, previous)):
        os.unlink(os.path.join(directory, previous))
    return time.perf_counter() - start


def durable_commit(directory: str, name: str, previous: str | None = None) -> float:
    """Ceiling (b): 3 small files written and fsynced, their directory fsynced, renamed
    into place, the parent fsynced (the least a crash-safe checkpoint can cost); then
    the commit `previous` deleted (the "retain" pattern)."""
    tmp, final = os.path.join(directory, name + ".tmp"), os.path.join(directory, name)
    start = time.perf_counter()
    os.mkdir(tmp)
    for part in ("a", "b", "c"):
        with open(os.path.join(tmp, part), "wb", buffering=0) as f:
            f.write(b"x" * 100)
            os.fsync(f.fileno())
    fsync_dir(tmp)
    os.rename(tmp, final)
    fsync_dir(directory)
    if previous is not None:
        shutil.rmtree(os.path.join(directory, previous), ignore_errors=True)
    return time.perf_counter() - start


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def checksum_cost(records: list[Any]) -> float | None:
    """Median seconds spent checksumming per save, or None while stats have no such field."""
    values = [getattr(r, CHECKSUM_FIELD) for r in records if hasattr(r, CHECKSUM_FIELD)]
    return statistics.median(values) if values else None


# -- one eager case --------------------------------------------------------------------


def measure_case(
    case: Case, compression: bool, reps: int, root: str, pattern: Pattern = "keep"
) -> dict[str, Any]:
    host = case.make()
    leaves = list(host.values())
    nbytes = sum(x.nbytes for x in leaves)
    state = jax.device_put(host)
    directory = tempfile.mkdtemp(dir=root, prefix=f"{case.key}_")
    retain = pattern == "retain"
    ckpt = jax_cb_ckpt.Checkpointer(
        os.path.join(directory, "ckpt"), compression=compression, max_to_keep=1 if retain else None
    )
    handed: list[float] = []

    def ours(step: int) -> float:
        h, total = save_and_wait(ckpt, state, step)
        handed.append(h)
        return total

    def before(name: str, i: int) -> str | None:
        return f"{name}-{i - 1}" if retain else None

    timers: dict[str, Callable[[int], float]] = {
        "save": ours,
        "write_fsync": lambda i: write_fsync(
            leaves, directory, f"ceiling-{i}", before("ceiling", i)
        ),
        "commit": lambda i: durable_commit(directory, f"commit-{i}", before("commit", i)),
    }
    try:
        for timer in timers.values():
            timer(0)  # warm up: the first save creates the directory, starts the writer
        handed.clear()
        times: dict[str, list[float]] = {name: [] for name in timers}
        for rep in range(reps):
            for name in rotated(list(timers), rep):
                times[name].append(timers[name](rep + 1))
        records = [r for r in ckpt.stats.recent if r.step > 0]
    finally:
        ckpt.close()
        shutil.rmtree(directory, ignore_errors=True)
    med = medians(times)
    return {
        "case": case.key,
        "label": case.label,
        "dir": root,
        "pattern": pattern,
        "compression": compression,
        "leaves": len(leaves),
        "bytes": nbytes,
        "reps": reps,
        "save_s": med["save"],
        "save_gb_s": nbytes / med["save"] / GB,
        "handed_over_s": statistics.median(handed),
        "writer_write_s": statistics.median(r.write_s for r in records),
        "checksum_s": checksum_cost(records),
        "write_fsync_s": med["write_fsync"],
        "write_fsync_gb_s": nbytes / med["write_fsync"] / GB,
        "commit_s": med["commit"],
        "x_write_fsync": med["write_fsync"] / med["save"],
        "x_commit": med["save"] / med["commit"],
        "all_s": times,
    }


# -- 8 devices: gathered vs per device (in a child process with 8 host devices) -------


def measure_devices(reps: int, root: str) -> dict[str, Any]:
    """Runs this module with --devices-child under 8 host devices; returns its result."""
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
    flags.append(f"--xla_force_host_platform_device_count={N_DEV}")
    env = dict(os.environ, XLA_FLAGS=" ".join(flags), JAX_PLATFORMS="cpu")
    out = os.path.join(root, "devices.json")
    cmd = [sys.executable, "-m", "benchmarks.writer", "--devices-child", out]
    subprocess.run([*cmd, "--dir", root, "--reps", str(reps)], cwd=ROOT, env=env, check=True)
    with open(out) as f:
        return json.load(f)


def devices_child(reps: int, root: str) -> dict[str, Any]:
    """The 80-leaf state sharded over 8 devices (first axis), saved inside `jit` with
    and without `shardings=`, then `wait()`; interleaved, medians."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    assert len(jax.devices()) == N_DEV, jax.devices()
    mesh = jax.make_mesh((N_DEV,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
    sharding = NamedSharding(mesh, P("d"))
    host = leaves80_state()
    state = jax.device_put(host, sharding)
    ckpts = {
        m: jax_cb_ckpt.Checkpointer(os.path.join(root, f"devices_{m}"))
        for m in ("gathered", "per_device")
    }
    # The save is a statement in the jitted program, as users write it.
    fns = {
        "gathered": jax.jit(lambda s, step: ckpts["gathered"].save(s, step)),
        "per_device": jax.jit(
            lambda s, step: ckpts["per_device"].save(s, step, shardings=sharding)
        ),
    }

    def timed(method: str, step: int) -> float:
        start = time.perf_counter()
        fns[method](state, step)
        ckpts[method].wait()
        return time.perf_counter() - start

    try:
        for method in fns:
            timed(method, 0)  # compile and warm up
        times: dict[str, list[float]] = {m: [] for m in fns}
        for rep in range(reps):
            for method in rotated(list(fns), rep):
                times[method].append(timed(method, rep + 1))
        blocking = {
            m: statistics.median(r.blocking_s for r in c.stats.recent if r.step > 0)
            for m, c in ckpts.items()
        }
    finally:
        for c in ckpts.values():
            c.close()
    med = medians(times)
    return {
        "devices": N_DEV,
        "leaves": len(host),
        "bytes": sum(x.nbytes for x in host.values()),
        "reps": reps,
        "save_s": med,
        "per_device_x_gathered": med["per_device"] / med["gathered"],
        "library_blocking_s": blocking,  # stats.recent[].blocking_s (issue 17, item 6)
        "all_s": times,
    }


# -- tiny steps in one jitted scan vs the chunked outer loop --------------------------


def measure_loops(steps: int, reps: int, root: str) -> list[dict[str, Any]]:
    """20,000 tiny steps (full profile), a save every 100 and 2 saves per run:
    maybe_save in the scan against the chunked loop with async Orbax (benchmarks.suite)."""
    results = []
    for every in sorted({100, steps // 2}):
        config = dict(workload="tiny", n=steps, every=every, methods=LOOP_METHODS)
        r = run_config(config, reps, root)
        m = r["methods"]
        r["maybe_save_x_chunked"] = m["maybe_save"]["median_s"] / m["chunked_orbax"]["median_s"]
        results.append(r)
    return results


LOOP_METHODS = ("bare", "maybe_save", "chunked_orbax")
NEWEST_EVERY = 10


class KeepNewest(suite.MaybeSave):
    """maybe_save with `on_full="newest"` (issue 17 item 3): a save that finds the queue
    full takes the place of the oldest one waiting; the device never waits for the disk.
    Library defaults otherwise (no compression); flush() checks the run's last step is on
    disk, as the policy promises."""

    name = "maybe_save_newest"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        suite.InJit.__init__(self, *args, **kwargs)  # not MaybeSave's: its own Checkpointer
        self.ckpt = jax_cb_ckpt.Checkpointer(
            os.path.join(self.directory, self.name),
            every=self.every,
            max_to_keep=2,
            on_full="newest",  # absent before issue 17
        )
        self.last_step = 0

    def run(self, offset: int) -> tuple[float, float]:
        self.last_step = offset + self.n
        return super().run(offset)

    def flush(self) -> None:
        super().flush()
        if self.ckpt.latest_step() != self.last_step:
            raise RuntimeError(
                f"on_full='newest': the run's last step {self.last_step} is not on disk "
                f"after wait() (latest: {self.ckpt.latest_step()})"
            )


suite.METHODS[KeepNewest.name] = KeepNewest  # so run_config runs it like the others


class NoopCrossing(suite.InJit):
    """The floor of a save that crosses: the same `cond` around the library's kind of
    crossing (a pure `buffer_callback` with the state's leaves, its token read by a
    `debug.callback`) whose host side does nothing. What JAX and XLA cost per crossing
    on this machine, before any work of ours."""

    name = "noop_crossing"

    def save_hook(self, state: Any) -> None:
        from jax.experimental.buffer_callback import buffer_callback

        leaves = jax.tree_util.tree_leaves(suite._raw(state))  # keys as their key data
        token_type = jax.ShapeDtypeStruct((), np.int32)

        def cross(leaves):
            token = buffer_callback(lambda ctx, out, *buffers: None, token_type)(*leaves)
            jax.debug.callback(lambda token: None, token)

        jax.lax.cond(state["step"] % self.every == 0, cross, lambda _: None, leaves)


suite.METHODS[NoopCrossing.name] = NoopCrossing


class NewestUnwritten(KeepNewest):
    """`KeepNewest` whose writer does not write: each save it takes costs it
    `PRETEND_WRITE_S` asleep (no CPU, no GIL) instead. The library's whole host side
    runs as in `KeepNewest` (the crossings, the hand-off, the queue, superseding), so
    this row minus the floor is what our callbacks cost the device, and `KeepNewest`
    minus this row is what the writer's work costs it (the GIL, the CPU of its threads
    and of the kernel). A probe: it replaces a private method of this Checkpointer's
    writer thread, which looks it up for every save."""

    name = "maybe_save_newest_unwritten"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.ckpt._parts.writer._write = _pretend_write  # type: ignore[attr-defined]

    def flush(self) -> None:
        self.ckpt.wait()  # nothing is on disk: there is no last step to check


PRETEND_WRITE_S = 0.003  # about what the writer takes for the tiny state


def _pretend_write(item: Any) -> None:
    time.sleep(PRETEND_WRITE_S)


suite.METHODS[NewestUnwritten.name] = NewestUnwritten


def keep_newest_exists(root: str) -> bool:
    """Whether this version of the library has `on_full="newest"` (it refuses unknown
    policies with ConfigError before touching the directory)."""
    try:
        jax_cb_ckpt.Checkpointer(os.path.join(root, "probe"), on_full="newest").close()
    except jax_cb_ckpt.ConfigError:
        return False
    return True


def measure_newest(steps: int, reps: int, root: str) -> dict[str, Any]:
    """Tiny steps in one jitted scan, a save every 10 with `on_full="newest"`, vs bare."""
    methods = ("bare", NoopCrossing.name, NewestUnwritten.name, KeepNewest.name)
    config = dict(workload="tiny", n=steps, every=NEWEST_EVERY, methods=methods)
    r = run_config(config, reps, root)
    r["newest_x_bare"] = r["methods"][KeepNewest.name]["x_bare_time"]
    r["floor_x_bare"] = r["methods"][NoopCrossing.name]["x_bare_time"]
    r["unwritten_x_bare"] = r["methods"][NewestUnwritten.name]["x_bare_time"]
    return r


# -- the machine -----------------------------------------------------------------------


def filesystem(path: str) -> dict[str, str]:
    """The mount holding `path`: its type, source and mount point (/proc/mounts)."""
    real = os.path.realpath(path)
    best = {"type": "unknown", "source": "?", "mount": "/"}
    try:
        with open("/proc/mounts") as f:
            mounts = [line.split()[:3] for line in f]
    except OSError:
        return best
    for source, mount, kind in mounts:
        mount = mount.replace("\\040", " ")
        inside = real == mount or real.startswith(mount.rstrip("/") + "/")
        if inside and len(mount) >= len(best["mount"]):
            best = {"type": kind, "source": source, "mount": mount}
    return best


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or "?"


def describe(root: str) -> dict[str, Any]:
    return {
        **machine(),
        "cpu_model": cpu_model(),
        "dir": root,
        "filesystem": filesystem(root),
        "loadavg_before": os.getloadavg(),
    }


# -- the report ------------------------------------------------------------------------


def _ms(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds * 1e3:.2f}"


def _size(nbytes: int) -> str:
    if nbytes >= 1 << 20:
        return f"{nbytes / (1 << 20):.0f} MiB"
    return f"{nbytes / (1 << 10):.1f} KiB"


def markdown(report: dict[str, Any]) -> str:
    mach, fs = report["machine"], report["machine"]["filesystem"]
    lines = [
        f"Run {mach['date']}: {mach['cpu_count']} CPU cores ({mach['cpu_model']}), "
        f"JAX {mach['jax']}, orbax-checkpoint {mach['orbax']}, jax_cb_ckpt "
        f"{mach['jax_cb_ckpt']}; directory {mach['dir']} on {fs['type']} ({fs['source']} "
        f"at {fs['mount']}); load average {_load(mach['loadavg_before'])} before, "
        f"{_load(mach.get('loadavg_after'))} after{' (quick mode)' if report['quick'] else ''}.",
        "",
        "Eager `save(state, step)` + `wait()` (handed over, written, fsynced, committed), "
        "medians; ceilings measured in the same repetitions. x write+fsync = our GB/s / "
        "the ceiling's (1.0 = disk speed); x commit = our time / a 3-file durable commit's.",
        "",
        "Files: keep = every save's files kept (new blocks each time), retain = the "
        "previous save deleted once the next is durable (`max_to_keep=1`; the ceilings "
        "delete theirs the same way). tmpfs rows have no disk: the CPU's share.",
        "",
        "| dir | state | files | bytes | zstd | save+wait (ms) | GB/s | write+fsync (ms) | "
        "GB/s | x write+fsync | commit (ms) | x commit | writer write_s (ms) | "
        "checksum (ms) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in report["cases"]:
        where = "tmpfs" if c.get("dir") == report.get("tmpfs") else "disk"
        lines.append(
            f"| {where} | {c['label']} | {c.get('pattern', 'keep')} | {_size(c['bytes'])} | "
            f"{'on' if c['compression'] else 'off'} | "
            f"{_ms(c['save_s'])} | {c['save_gb_s']:.3f} | {_ms(c['write_fsync_s'])} | "
            f"{c['write_fsync_gb_s']:.3f} | {c['x_write_fsync']:.2f}x | {_ms(c['commit_s'])} | "
            f"{c['x_commit']:.1f}x | {_ms(c['writer_write_s'])} | {_ms(c['checksum_s'])} |"
        )
    d = report.get("devices")
    if d:
        s, b = d["save_s"], d["library_blocking_s"]
        lines += [
            "",
            f"80 leaves ({_size(d['bytes'])}) sharded over {d['devices']} CPU devices, saved "
            "inside `jit`, then `wait()` (medians):",
            "",
            "| gathered (ms) | per device, `shardings=` (ms) | per device / gathered | "
            "stats blocking_s gathered / per device (ms) |",
            "|---|---|---|---|",
            f"| {_ms(s['gathered'])} | {_ms(s['per_device'])} | "
            f"{d['per_device_x_gathered']:.2f}x | {_ms(b['gathered'])} / {_ms(b['per_device'])} |",
        ]
    if report.get("loops"):
        lines += [
            "",
            "Tiny steps (benchmarks.suite's 8-64-1 MLP) in one jitted scan with `maybe_save` "
            "(compression on, as Orbax's default) vs the chunked outer loop with async Orbax; "
            "time until on disk, medians:",
            "",
            "| steps | save every | saves | bare (s) | maybe_save (s) | chunked (s) | "
            "maybe_save / chunked |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in report["loops"]:
            m = r["methods"]
            lines.append(
                f"| {r['steps']:,} | {r['every']:,} | {r['saves_per_run']} | "
                f"{m['bare']['median_s']:.3f} | {m['maybe_save']['median_s']:.3f} | "
                f"{m['chunked_orbax']['median_s']:.3f} | {r['maybe_save_x_chunked']:.2f}x |"
            )
    if "newest" in report:
        lines += ["", _newest_line(report["newest"])]
    return "\n".join(lines) + "\n"


def _newest_line(r: dict[str, Any] | None) -> str:
    if r is None:
        return (
            f'A save every {NEWEST_EVERY} tiny steps with `on_full="newest"`: n/a '
            "(this version of the library has no such policy)."
        )
    m = r["methods"]
    return (
        f"{r['steps']:,} tiny steps in one jitted scan, a save every {r['every']} with "
        f'`on_full="newest"`: {m[KeepNewest.name]["median_s"]:.3f} s against '
        f"{m['bare']['median_s']:.3f} s bare, **{r['newest_x_bare']:.2f}x bare**; the "
        "last step on disk after `wait()` in every run. The floor, the same crossings "
        f"with a host side that does nothing: {m[NoopCrossing.name]['median_s']:.3f} s, "
        f"{r['floor_x_bare']:.2f}x bare. The library's host side with a writer that "
        f"sleeps {PRETEND_WRITE_S * 1e3:.0f} ms per save instead of writing: "
        f"{m[NewestUnwritten.name]['median_s']:.3f} s, {r['unwritten_x_bare']:.2f}x bare "
        "(the rest is what the writer's work costs the device)."
    )


def _load(avg: Any) -> str:
    return "?" if not avg else " ".join(f"{x:.2f}" for x in avg)


# -- main ------------------------------------------------------------------------------


PARTS = (*(c.key for c in CASES), "devices", "loops", "newest")


def plan(quick: bool, only: set[str]) -> list[tuple[Case, bool, Pattern]]:
    """(case, compression, file pattern) triples: quick compresses only the large leaf."""
    chosen = []
    for case in CASES:
        if case.key not in only:
            continue
        for compression in case.compressions:
            if quick and compression and not case.large:
                continue
            chosen += [(case, compression, pattern) for pattern in case.patterns]
    return chosen


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="3 repetitions, 2,000-step loops")
    parser.add_argument("--reps", type=int, default=None, help="default: 3 quick, 5 full")
    parser.add_argument(
        "--dir",
        default=None,
        help="where checkpoints and ceiling files are written (its filesystem is measured); "
        "default: a new temporary directory under $TMPDIR or /tmp",
    )
    parser.add_argument(
        "--tmpfs",
        default="/dev/shm" if os.path.isdir("/dev/shm") else "",
        help="a tmpfs directory where the large uncompressed cases run again (no disk: "
        "the writer's CPU share; not in --quick); empty: none. Default /dev/shm",
    )
    parser.add_argument("--out", default=os.path.join("benchmarks", "results", "writer"))
    parser.add_argument(
        "--only", default=",".join(PARTS), help=f"comma-separated parts of {','.join(PARTS)}"
    )
    parser.add_argument("--steps", type=int, default=None, help="loop length (20000; quick 2000)")
    parser.add_argument("--devices-child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    reps = args.reps or (3 if args.quick else 5)
    if args.devices_child:  # the 8-device part, started by measure_devices
        with open(args.devices_child, "w") as f:
            json.dump(devices_child(reps, args.dir), f)
        return 0
    only = set(args.only.split(","))
    unknown = only - set(PARTS)
    if unknown:
        parser.error(f"--only: unknown part(s) {sorted(unknown)}; choose from {PARTS}")
    steps = args.steps or (2000 if args.quick else 20000)
    os.makedirs(args.out, exist_ok=True)
    if args.dir:
        os.makedirs(args.dir, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="jax_cb_ckpt_writer_", dir=args.dir) as root:
        report: dict[str, Any] = {"machine": describe(root), "quick": args.quick, "cases": []}
        for case, compression, pattern in plan(args.quick, only):
            print(
                f"== {case.label}, compression {'on' if compression else 'off'}, {pattern}",
                flush=True,
            )
            report["cases"].append(measure_case(case, compression, reps, root, pattern))
        if args.tmpfs and not args.quick:
            with tempfile.TemporaryDirectory(prefix="jax_cb_ckpt_writer_", dir=args.tmpfs) as shm:
                report["tmpfs"] = shm
                for case, compression, pattern in plan(args.quick, only):
                    if len(case.patterns) > 1 and not compression:  # the large leaves
                        print(f"== {case.label} on tmpfs, {pattern}", flush=True)
                        report["cases"].append(measure_case(case, compression, reps, shm, pattern))
        if "devices" in only:
            print(f"== 80 leaves on {N_DEV} devices", flush=True)
            report["devices"] = measure_devices(reps, root)
        if "loops" in only:
            print(f"== {steps} tiny steps in one scan vs the chunked loop", flush=True)
            report["loops"] = measure_loops(steps, reps, root)
        if "newest" in only:
            print(
                f"== {steps} tiny steps, a save every {NEWEST_EVERY}, on_full='newest'", flush=True
            )
            exists = keep_newest_exists(root)
            report["newest"] = measure_newest(steps, reps, root) if exists else None
        report["machine"]["loadavg_after"] = os.getloadavg()
    table = markdown(report)
    write_results(args.out, report, table)
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
