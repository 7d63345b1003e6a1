"""Incremental saves against full ones: a replay buffer that changes by a slice per save.

    python -m benchmarks.incremental                  # 5-9 minutes on 2 cores, in /tmp
    python -m benchmarks.incremental --cases 8:32 --reps 2 --tmpfs "" --growth 8:32:4
    python -m benchmarks.incremental --dir /mnt/nvme  # measure that filesystem

The state (issue 57, item 5): a ring buffer in flashbax's layout, `experience` leaves of
shape (add_batch_size=8, T, ...) (`obs` float32 (8, T, 84), `action` int32 (8, T),
`reward` and `done` float32 (8, T)) with T chosen so the buffer holds --cases' MiB, its
`current_index` and `is_full` scalars, and ~4 MiB of float32 parameters. Between two
saves the buffer changes by a slice of T/N along the time axis (wrapping around; N of
--cases `MIB:N`), the parameters change whole and the scalars move.

Per case, in one process and one fresh directory (max_to_keep=3: retention deletes as
in real use), every repetition changes the state once, then runs, interleaved (the order
rotating per repetition, harness.rotated):

- `incremental`: `Checkpointer(incremental=True)` (full_every=16), `save` + `wait`; its
  linked saves (its first, whole, save is the warm-up);
- `incremental, whole`: `Checkpointer(incremental=True, full_every=1)`: every save whole,
  digests of every chunk included (what every 16th save of `incremental` costs);
- `full`: `Checkpointer()` (incremental=False), the same state;
- ceilings of this machine: `write+fsync changed`, the bytes that really changed (the
  slice, the parameters, the scalars) written into one new file in a new folder per
  save, fsynced, the folder of three saves before removed (as retention does);
  `write+fsync full`, the state's bytes the same way; `memcpy`, a copy of the state into
  touched buffers.

Bytes per step: the library's count (`ckpt.stats.recent[-1].written_bytes`; a full
save's: its `nbytes`) and, cross-checked, the kernel's (`/proc/self/io` write_bytes
around the call; 0 on tmpfs). Then the latest step of `incremental` (linked) and of
`full` restored (numpy, checksums checked, from the page cache), interleaved, and `du`
of each directory (hard links counted once). Last (--growth), disk use along a chain
longer than full_every: `du` after each of 40 saves of a 64 MiB buffer, incremental and
full, and the data files a linked step's database holds. Amortized = (whole + 15 x linked) / 16.
Targets (issue 57) at 1/32 changed: <= 0.15x the bytes and <= 0.35x the time of a full
save; stretch: the changed bytes' own write+fsync time. Figures are medians. Results:
results.json and results.md under --out.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from typing import Any

import numpy as np

import jax_cb_ckpt

from .harness import medians, rotated, write_results
from .writer import describe, fsync_dir

BATCH, OBS = 8, 84  # flashbax's add_batch_size; the observation's width
PARAM_SHAPES = {"w0": (1024, 512), "w1": (512, 512), "w2": (512, 512), "b": (512,)}  # ~4 MiB
KEEP = 3  # max_to_keep, of the checkpoints and the ceilings' folders
FULL_EVERY = 16
TARGETS = {"fraction": 32, "bytes": 0.15, "time": 0.35, "stretch": 1.0}
DEFAULT_CASES = "256:64,256:32,256:8,1024:32"
DEFAULT_TMPFS_CASES = "256:32"
METHODS = (
    "incremental",
    "incremental, whole",
    "full",
    "write+fsync changed",
    "write+fsync full",
    "memcpy",
)


# -- the state and its change ----------------------------------------------------------


def time_steps(mib: int) -> int:
    """T such that the experience leaves hold `mib` MiB."""
    per_step = BATCH * (OBS * 4 + 3 * 4)  # obs, action, reward, done
    return max(1, (mib << 20) // per_step)


def make_state(mib: int) -> dict[str, Any]:
    """flashbax's buffer state (experience, current_index, is_full) and parameters."""
    rng = np.random.default_rng(0)
    t = time_steps(mib)
    experience = {
        "obs": rng.standard_normal((BATCH, t, OBS), dtype=np.float32),
        "action": rng.integers(0, 18, (BATCH, t), dtype=np.int32),
        "reward": rng.standard_normal((BATCH, t), dtype=np.float32),
        "done": (rng.random((BATCH, t)) < 0.01).astype(np.float32),
    }
    buffer = {
        "experience": experience,
        "current_index": np.array(0, np.int32),
        "is_full": np.array(False),
    }
    params = {k: rng.standard_normal(s, dtype=np.float32) for k, s in PARAM_SHAPES.items()}
    return {"buffer": buffer, "params": params}


def advance(state: dict[str, Any], fraction: int) -> int:
    """Add T/fraction time steps to the ring (in place, wrapping around) and change the
    parameters; the bytes that changed."""
    buffer = state["buffer"]
    experience = buffer["experience"]
    t = experience["obs"].shape[1]
    start, length = int(buffer["current_index"]), max(1, t // fraction)
    changed = 0
    for first, stop in _spans(start, length, t):
        for leaf in experience.values():
            leaf[:, first:stop] += 1  # (float and int alike: every element differs)
            changed += leaf[:, first:stop].nbytes
    end = start + length
    buffer["current_index"][...] = end % t
    buffer["is_full"][...] = bool(buffer["is_full"]) or end >= t
    for leaf in state["params"].values():
        leaf += np.float32(1e-3)
    changed += sum(leaf.nbytes for leaf in state["params"].values())
    return changed + buffer["current_index"].nbytes + buffer["is_full"].nbytes


def _spans(start: int, length: int, t: int) -> list[tuple[int, int]]:
    if start + length <= t:
        return [(start, start + length)]
    return [(start, t), (0, start + length - t)]


def leaves(tree: Any) -> list[np.ndarray]:
    if isinstance(tree, dict):
        return [leaf for value in tree.values() for leaf in leaves(value)]
    return [tree]


# -- what is timed ---------------------------------------------------------------------


def io_written() -> int:
    """This process's bytes sent to the block layer so far (/proc/self/io write_bytes;
    -1 where the kernel does not say)."""
    try:
        with open("/proc/self/io") as f:
            for line in f:
                if line.startswith("write_bytes:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return -1


def write_fsync(chunks: list[Any], directory: str, i: int) -> None:
    """A ceiling: `chunks` (buffers) written into one new file in a new folder, the file
    and the folder fsynced; the folder of KEEP saves before removed (retention)."""
    folder = os.path.join(directory, str(i))
    os.mkdir(folder)
    with open(os.path.join(folder, "data"), "wb", buffering=0) as f:
        for chunk in chunks:
            view = memoryview(chunk).cast("B")
            while view:  # an unbuffered write may write less than asked
                view = view[f.write(view) or 0 :]
        os.fsync(f.fileno())
    fsync_dir(folder)
    fsync_dir(directory)
    shutil.rmtree(os.path.join(directory, str(i - KEEP)), ignore_errors=True)


class Case:
    """One (size, fraction) in one fresh directory: the three Checkpointers and the
    ceilings' buffers."""

    def __init__(self, root: str, mib: int, fraction: int) -> None:
        self.mib, self.fraction = mib, fraction
        self.state = make_state(mib)
        self.nbytes = sum(leaf.nbytes for leaf in leaves(self.state))
        self.directory = tempfile.mkdtemp(dir=root, prefix=f"incremental_{mib}_{fraction}_")
        self.dirs = {m: os.path.join(self.directory, m.replace(" ", "_")) for m in METHODS}
        for m in METHODS[3:5]:
            os.mkdir(self.dirs[m])
        self.ckpts = {
            "incremental": self._ckpt("incremental", incremental=True, full_every=FULL_EVERY),
            "incremental, whole": self._ckpt("incremental, whole", incremental=True, full_every=1),
            "full": self._ckpt("full"),
        }
        self.changed = 0  # bytes changed by the last `advance`
        changed_max = _changed_bytes(self.state, fraction)
        self.changed_buffer = np.random.default_rng(1).bytes(changed_max)
        self.copies = [np.empty_like(leaf) for leaf in leaves(self.state)]
        for copy in self.copies:
            copy.fill(0)  # touched
        self.du_after: list[int] = []  # `incremental`'s directory after each of its saves

    def _ckpt(self, method: str, **kwargs: Any) -> jax_cb_ckpt.Checkpointer:
        return jax_cb_ckpt.Checkpointer(self.dirs[method], max_to_keep=KEEP, **kwargs)

    def run(self, method: str, step: int) -> tuple[float, int, int | None]:
        """One call of `method` for `step`: (seconds, kernel's written bytes, the
        library's written bytes or None)."""
        before = io_written()
        start = time.perf_counter()
        if method in self.ckpts:
            ckpt = self.ckpts[method]
            ckpt.save(self.state, step)
            ckpt.wait()
        elif method == "write+fsync changed":
            view = memoryview(self.changed_buffer)[: self.changed]
            write_fsync([view], self.dirs[method], step)
        elif method == "write+fsync full":
            write_fsync(leaves(self.state), self.dirs[method], step)
        else:
            for copy, leaf in zip(self.copies, leaves(self.state), strict=True):
                np.copyto(copy, leaf)
        seconds = time.perf_counter() - start
        io = io_written() - before if before >= 0 else -1
        library = None
        if method in self.ckpts:
            record = self.ckpts[method].stats.recent[-1]
            library = record.nbytes if record.written_bytes is None else record.written_bytes
        if method == "incremental":
            self.du_after.append(du(self.dirs[method]))
        return seconds, io, library

    def close(self) -> None:
        for ckpt in self.ckpts.values():
            ckpt.close()
        shutil.rmtree(self.directory, ignore_errors=True)


def _changed_bytes(state: dict[str, Any], fraction: int) -> int:
    """The most bytes one `advance` changes (a slice split by the wrap is no larger)."""
    experience = state["buffer"]["experience"]
    t = experience["obs"].shape[1]
    per_step = sum(leaf.nbytes for leaf in experience.values()) // t
    rest = sum(leaf.nbytes for leaf in leaves(state["params"])) + 4 + 1
    return per_step * max(1, t // fraction) + rest


def du(path: str) -> int:
    """Bytes the files under `path` take on disk, each inode counted once (as `du`)."""
    seen, total = set(), 0
    for folder, _, names in os.walk(path):
        for name in names:
            try:
                st = os.lstat(os.path.join(folder, name))
            except FileNotFoundError:
                continue
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_blocks * 512
    return total


# -- one case --------------------------------------------------------------------------


def measure(root: str, mib: int, fraction: int, reps: int, restore_reps: int) -> dict[str, Any]:
    """Every method of one (size, fraction), interleaved; restores; disk usage."""
    case = Case(root, mib, fraction)
    try:
        for method in METHODS:
            case.run(method, 0)  # warm up: the first (whole) saves, the ceilings' folders
        case.du_after.clear()
        samples: dict[str, list[tuple[float, int, int | None]]] = {m: [] for m in METHODS}
        changed = []
        for rep in range(reps):
            case.changed = advance(case.state, fraction)
            changed.append(case.changed)
            for method in rotated(list(METHODS), rep):
                samples[method].append(case.run(method, rep + 1))
        result = _summary(case, samples, changed)
        result["restore_ms"] = _restores(case, restore_reps)
        result["du_bytes"] = {m: du(case.dirs[m]) for m in case.ckpts}
        result["du_incremental_after_each"] = case.du_after
        result["data_files_linked_step"] = _data_files(case.dirs["incremental"], reps)
        result["records"] = _records(case)
    finally:
        case.close()
    return result


def _summary(
    case: Case, samples: dict[str, list[tuple[float, int, int | None]]], changed: list[int]
) -> dict[str, Any]:
    """Medians and ratios of the repetitions: `incremental`'s linked saves only."""
    linked = [s for s in samples["incremental"] if s[2] is not None and s[2] < case.nbytes]
    whole_in_chain = len(samples["incremental"]) - len(linked)
    times = {m: [s[0] for s in v] for m, v in samples.items() if m != "incremental"}
    times["incremental"] = [s[0] for s in linked]
    ms = {m: v * 1e3 for m, v in medians(times).items()}
    io = {m: statistics.median(s[1] for s in v) for m, v in samples.items()}
    io["incremental"] = statistics.median(s[1] for s in linked)
    written = statistics.median(s[2] or 0 for s in linked)
    full_bytes = statistics.median(s[2] or 0 for s in samples["full"])
    amortized_ms = (ms["incremental, whole"] + (FULL_EVERY - 1) * ms["incremental"]) / FULL_EVERY
    amortized_bytes = (full_bytes + (FULL_EVERY - 1) * written) / FULL_EVERY
    return {
        "mib": case.mib,
        "fraction": case.fraction,
        "time_steps": case.state["buffer"]["experience"]["obs"].shape[1],
        "state_bytes": case.nbytes,
        "changed_bytes": statistics.median(changed),
        "reps": len(changed),
        "linked_saves": len(linked),
        "whole_saves_in_chain": whole_in_chain,
        "median_ms": ms,
        "io_write_bytes": io,
        "written_bytes": {"incremental": written, "full": full_bytes},
        "amortized": {"full_every": FULL_EVERY, "ms": amortized_ms, "bytes": amortized_bytes},
        "x_full_bytes": written / full_bytes,
        "x_full_time": ms["incremental"] / ms["full"],
        "x_changed_ceiling": ms["incremental"] / ms["write+fsync changed"],
        "amortized_x_full_time": amortized_ms / ms["full"],
        "amortized_x_full_bytes": amortized_bytes / full_bytes,
        "all_ms": {m: [s * 1e3 for s in v] for m, v in times.items()},
    }


def _restores(case: Case, reps: int) -> dict[str, float]:
    """Median ms to restore the latest step of `incremental` (linked) and of `full`,
    interleaved; the linked one checked bit for bit against the state first."""
    like = case.state
    paths = {"linked": case.dirs["incremental"], "full": case.dirs["full"]}
    restored = jax_cb_ckpt.restore(paths["linked"], like)
    if not jax_cb_ckpt.same_bits(restored, like):
        raise AssertionError(f"{paths['linked']}: the linked step restores other bits")
    del restored
    times: dict[str, list[float]] = {k: [] for k in paths}
    for rep in range(reps):
        for name in rotated(list(paths), rep):
            start = time.perf_counter()
            jax_cb_ckpt.restore(paths[name], like)
            times[name].append(time.perf_counter() - start)
    return {k: v * 1e3 for k, v in medians(times).items()}


def _data_files(directory: str, step: int) -> int:
    """The data files in step `step`'s database (linked ones included)."""
    data = os.path.join(directory, str(step), "state", "d")
    return len(os.listdir(data)) if os.path.isdir(data) else 0


def _records(case: Case) -> dict[str, dict[str, float]]:
    """The writer's own medians per save (stats.recent, warm-up excluded): write_s and
    its checksum_s (an incremental save's: the CRC-32 and SHA-256 of every chunk)."""
    out = {}
    for method, ckpt in case.ckpts.items():
        records = [r for r in ckpt.stats.recent if r.step > 0]
        if method == "incremental":
            records = [r for r in records if (r.written_bytes or 0) < r.nbytes]
        out[method] = {
            "write_ms": statistics.median(r.write_s for r in records) * 1e3,
            "checksum_ms": statistics.median(r.checksum_s for r in records) * 1e3,
        }
    return out


# -- disk use along a chain -----------------------------------------------------------


def growth(root: str, mib: int, fraction: int, saves: int) -> dict[str, Any]:
    """`saves` saves of one state changing by 1/`fraction` per save, incremental
    (full_every=16) and full, max_to_keep=3: after each, `du` of both directories and
    the data files of the incremental step (untimed)."""
    state = make_state(mib)
    directory = tempfile.mkdtemp(dir=root, prefix=f"growth_{mib}_{fraction}_")
    ckpts = {
        "incremental": jax_cb_ckpt.Checkpointer(
            os.path.join(directory, "incremental"), max_to_keep=KEEP, incremental=True
        ),
        "full": jax_cb_ckpt.Checkpointer(os.path.join(directory, "full"), max_to_keep=KEEP),
    }
    out: dict[str, Any] = {"mib": mib, "fraction": fraction, "saves": saves, "linked": []}
    out |= {"du_incremental": [], "du_full": [], "data_files": []}
    try:
        for step in range(saves):
            if step:
                advance(state, fraction)
            for ckpt in ckpts.values():
                ckpt.save(state, step)
                ckpt.wait()
            record = ckpts["incremental"].stats.recent[-1]
            out["linked"].append((record.written_bytes or 0) < record.nbytes)
            out["du_incremental"].append(du(ckpts["incremental"].directory))
            out["du_full"].append(du(ckpts["full"].directory))
            out["data_files"].append(_data_files(ckpts["incremental"].directory, step))
    finally:
        for ckpt in ckpts.values():
            ckpt.close()
        shutil.rmtree(directory, ignore_errors=True)
    return out


def _growth_lines(g: dict[str, Any]) -> list[str]:
    shown = sorted({i for i in (1, 2, 3, 4, 8, 15, 16, 17, 32, g["saves"]) if i <= g["saves"]})
    rows = [
        f"Disk use along a chain: {g['saves']} saves of a {g['mib']} MiB buffer changing by "
        f"1/{g['fraction']} per save (`max_to_keep={KEEP}`, `full_every={FULL_EVERY}`), "
        "`du` of each directory after save n, MiB, and the data files in step n's database:",
        "",
        "| after save | " + " | ".join(str(i) for i in shown) + " |",
        "|---|" + "---|" * len(shown),
    ]
    for name, key in (("incremental", "du_incremental"), ("full", "du_full")):
        rows.append(f"| {name} | " + " | ".join(_mib(g[key][i - 1]) for i in shown) + " |")
    rows.append(
        "| linked? | " + " | ".join("yes" if g["linked"][i - 1] else "whole" for i in shown) + " |"
    )
    rows.append("| data files | " + " | ".join(str(g["data_files"][i - 1]) for i in shown) + " |")
    return rows


# -- the report ------------------------------------------------------------------------


def _mib(nbytes: float) -> str:
    return "n/a" if nbytes < 0 else f"{nbytes / 2**20:.1f}"


def _where(result: dict[str, Any], report: dict[str, Any]) -> str:
    return "tmpfs" if result["dir"] == report.get("tmpfs") else "disk"


def _label(r: dict[str, Any]) -> str:
    return f"{r['mib']} MiB, 1/{r['fraction']}"


def markdown(report: dict[str, Any]) -> str:
    mach, fs = report["machine"], report["machine"]["filesystem"]
    lines = [
        f"Run {mach['date']}: {mach['cpu_count']} CPU cores ({mach['cpu_model']}), "
        f"JAX {mach['jax']}, orbax-checkpoint {mach['orbax']}, jax_cb_ckpt "
        f"{mach['jax_cb_ckpt']}; directory {mach['dir']} on {fs['type']} ({fs['source']}); "
        f"load average {_load(mach['loadavg_before'])} before, "
        f"{_load(mach.get('loadavg_after'))} after.",
        "",
        "`save` + `wait`, medians in ms; incremental = its linked saves; amortized = "
        f"(whole + {FULL_EVERY - 1} x linked) / {FULL_EVERY}; ceilings in the same "
        "repetitions (write+fsync of the changed / the whole state's bytes, one file per "
        "save in a new folder, retention's deletes included; memcpy of the state).",
        "",
        "| dir | buffer, changed per save | full | incremental | x full | amortized | x full "
        "| incremental, whole | write+fsync changed | x changed | write+fsync full | memcpy "
        "| digests per linked save |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["cases"]:
        ms = r["median_ms"]
        lines.append(
            f"| {_where(r, report)} | {_label(r)} | {ms['full']:.0f} | {ms['incremental']:.0f} "
            f"| {r['x_full_time']:.2f}x | {r['amortized']['ms']:.0f} "
            f"| {r['amortized_x_full_time']:.2f}x | {ms['incremental, whole']:.0f} "
            f"| {ms['write+fsync changed']:.0f} | {r['x_changed_ceiling']:.2f}x "
            f"| {ms['write+fsync full']:.0f} | {ms['memcpy']:.0f} "
            f"| {r['records']['incremental']['checksum_ms']:.0f} |"
        )
    lines += [
        "",
        "Bytes per save in MiB, the library's (`written_bytes`) / the kernel's "
        "(/proc/self/io write_bytes; n/a or 0 on tmpfs); restore of the latest step, ms; "
        "`du` of each directory after the run (3 steps kept), MiB:",
        "",
        "| dir | buffer, changed per save | changed | full | incremental | x full | amortized "
        "x full | restore linked / full | du incremental / full | data files, linked step |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["cases"]:
        w, io, du_ = r["written_bytes"], r["io_write_bytes"], r["du_bytes"]
        restore = r["restore_ms"]
        lines.append(
            f"| {_where(r, report)} | {_label(r)} | {_mib(r['changed_bytes'])} "
            f"| {_mib(w['full'])} / {_mib(io['full'])} "
            f"| {_mib(w['incremental'])} / {_mib(io['incremental'])} | {r['x_full_bytes']:.3f}x "
            f"| {r['amortized_x_full_bytes']:.3f}x | {restore['linked']:.0f} / "
            f"{restore['full']:.0f} | {_mib(du_['incremental'])} / {_mib(du_['full'])} "
            f"| {r['data_files_linked_step']} |"
        )
    if report.get("growth"):
        lines += ["", *_growth_lines(report["growth"])]
    return "\n".join([*lines, "", *targets(report)]) + "\n"


def targets(report: dict[str, Any]) -> list[str]:
    """The targets, judged on every case at the headline fraction."""
    t = TARGETS
    out = [
        f"Targets at 1/{t['fraction']} changed: <= {t['bytes']}x the bytes and <= "
        f"{t['time']}x the time of a full save; stretch: <= {t['stretch']}x the changed "
        "bytes' own write+fsync.",
        "",
    ]
    for r in report["cases"]:
        if r["fraction"] != t["fraction"]:
            continue
        checks = (
            ("bytes", r["x_full_bytes"], t["bytes"]),
            ("time", r["x_full_time"], t["time"]),
            ("stretch", r["x_changed_ceiling"], t["stretch"]),
        )
        said = ", ".join(
            f"{name} {value:.3f}x ({'met' if value <= limit else 'NOT met'})"
            for name, value, limit in checks
        )
        out.append(f"- {_where(r, report)}, {_label(r)}: {said}")
    return out


def _load(avg: Any) -> str:
    return "?" if not avg else " ".join(f"{x:.2f}" for x in avg)


# -- main ------------------------------------------------------------------------------


def parse_cases(text: str) -> list[tuple[int, int]]:
    """'256:32,1024:32' -> [(256, 32), (1024, 32)] (MiB of buffer, 1/N changed)."""
    cases = []
    for item in filter(None, text.split(",")):
        mib, _, fraction = item.partition(":")
        cases.append((int(mib), int(fraction)))
    return cases


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--cases", default=DEFAULT_CASES, help="MIB:N,...: buffer MiB, 1/N")
    parser.add_argument("--reps", type=int, default=7, help="saves timed per case")
    parser.add_argument("--restore-reps", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where the steps go (default: /tmp)")
    parser.add_argument(
        "--tmpfs",
        default="/dev/shm" if os.path.isdir("/dev/shm") else "",
        help="a tmpfs directory where --tmpfs-cases run again; empty: none",
    )
    parser.add_argument("--tmpfs-cases", default=DEFAULT_TMPFS_CASES)
    parser.add_argument(
        "--growth", default="64:32:40", help="MIB:N:SAVES: disk use along a chain; empty: none"
    )
    parser.add_argument("--out", default=os.path.join("benchmarks", "results", "incremental"))
    args = parser.parse_args(argv)
    if args.dir:
        os.makedirs(args.dir, exist_ok=True)
    plan = [(args.dir, c) for c in parse_cases(args.cases)]
    if args.tmpfs:
        plan += [(args.tmpfs, c) for c in parse_cases(args.tmpfs_cases)]
    with tempfile.TemporaryDirectory(prefix="jax_cb_ckpt_incremental_", dir=args.dir) as root:
        report: dict[str, Any] = {"machine": describe(root), "cases": []}
        for where, (mib, fraction) in plan:
            with tempfile.TemporaryDirectory(prefix="jax_cb_ckpt_incremental_", dir=where) as d:
                here = root if where == args.dir else d
                if where != args.dir:
                    report["tmpfs"] = d
                print(f"== {mib} MiB buffer, 1/{fraction} per save, in {here}", flush=True)
                result = measure(here, mib, fraction, args.reps, args.restore_reps)
                report["cases"].append({**result, "dir": here})
        if args.growth:
            mib, fraction, saves = (int(x) for x in args.growth.split(":"))
            print(f"== disk use along {saves} saves, {mib} MiB, 1/{fraction}", flush=True)
            report["growth"] = growth(root, mib, fraction, saves)
        report["machine"]["loadavg_after"] = os.getloadavg()
    table = markdown(report)
    write_results(args.out, report, table)
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
