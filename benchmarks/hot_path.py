"""What a `maybe_save` in the loop body costs when it does not fire (issue 45).

    python -m benchmarks.hot_path [--reps 7] [--out DIR] [--quick]

One jitted `lax.scan` of a tanh-matmul step (`x = tanh(x @ w)`) at three sizes, about
1 us, 10 us and 1 ms a step on a 2-core CPU, each timed as:

- `bare`: the step alone;
- `cond`: the step with a pure `lax.cond(never, 2 * x, x)` on the step counter (the
  floor of any decision made on the device at every step);
- `cond_debug_callback`: the step with `lax.cond(never, jax.debug.callback(...))`;
- `maybe_save_never`: `ckpt.maybe_save(x, i + 1)` with `every=10**9` (never fires);
- `maybe_save`: the same with `every` = steps / 20 (20 saves);
- `ckpt_scan`: `ckpt.scan(..., every=steps / 20)` (20 saves, no conditional per step);
- `bare_writes` and `bare_step_writes`, two ceilings of the saves' background work:
  bare, while a thread makes 20 writes evenly over the loop, each in a new directory
  renamed into place with every file and directory fsynced and the write of two before
  deleted (`max_to_keep=2`): of one file of the state's bytes, and of the files of a
  step the library wrote (same names and sizes). On a machine whose cores the step
  uses, writing takes CPU from it: the loop pays for the writes whoever makes them.

Next to each row: the number of thunks in the compiled loop body. XLA:CPU runs a loop
body in program order when it has at most 8 thunks (or every buffer it touches is at most
512 bytes) and through its dataflow executor otherwise, which costs about 0.5 us a step
on this machine: on a tiny step, crossing that line costs more than everything the save
adds. Methods interleaved, their order rotated each repetition; medians; ratios to bare.
The figures are for docs/benchmarks.md, never for tests.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import jax_cb_ckpt

from .harness import medians, rotated, timed, write_results
from .writer import fsync_dir

NEVER = 10**9
SAVES = 20
METHODS = (
    "bare",
    "cond",
    "cond_debug_callback",
    "maybe_save_never",
    "maybe_save",
    "ckpt_scan",
    "bare_writes",
    "bare_step_writes",
)
# (name, rows of x, width of w, steps): about 1 us, 10 us and 1 ms a step on 2 cores.
SIZES = (("~1 us", 8, 64, 200_000), ("~10 us", 16, 128, 30_000), ("~1 ms", 256, 512, 300))
QUICK_STEPS = (20_000, 3_000, 30)
OFFSET = 10**6  # repetition r counts its steps from (r + 1) * OFFSET: every save is new
# What an XLA:CPU loop body may hold and still run in program order (ThunkExecutor).
SEQUENTIAL_THUNKS = 8
_NO_THUNK = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant"}


def _noop(*_: Any) -> None:
    pass


def programs(rows: int, width: int, n: int, directory: str) -> dict[str, Any]:
    """{method: (jitted program of (x, first step), its Checkpointer or None)}."""
    w = jnp.asarray(np.random.default_rng(0).standard_normal((width, width)) / np.sqrt(width))
    w = w.astype(jnp.float32)

    def step(x):
        return jnp.tanh(x @ w)

    def scanned(body: Callable[[jax.Array, jax.Array], None] | None) -> Callable:
        def loop_body(x, i):
            x = step(x)
            if body is not None:
                body(x, i)
            return x, None

        return jax.jit(lambda x, first: jax.lax.scan(loop_body, x, first + steps)[0])

    def cond_body(x, i):
        x = jax.lax.cond((i + 1) % NEVER == 0, lambda x: x * 2, lambda x: x, step(x))
        return x, None

    def cond_debug(x, i):
        never = (i + 1) % NEVER == 0
        jax.lax.cond(never, lambda x: jax.debug.callback(_noop, x), lambda x: None, x)

    steps = jnp.arange(n, dtype=jnp.int32)
    every = max(n // SAVES, 1)
    never = jax_cb_ckpt.Checkpointer(os.path.join(directory, "never"), every=NEVER)
    saving = jax_cb_ckpt.Checkpointer(os.path.join(directory, "saving"), every=every, max_to_keep=2)
    scanning = jax_cb_ckpt.Checkpointer(os.path.join(directory, "scan"), every=every, max_to_keep=2)

    def scan_with_saves(x, first):
        def body(x, _):
            return step(x), None

        return scanning.scan(body, x, length=n, every=every, start=first)[0]

    return {
        "bare": (scanned(None), None),
        "cond": (
            jax.jit(lambda x, first: jax.lax.scan(cond_body, x, first + steps)[0]),
            None,
        ),
        "cond_debug_callback": (scanned(cond_debug), None),
        "maybe_save_never": (scanned(lambda x, i: never.maybe_save(x, i + 1)), never),
        "maybe_save": (scanned(lambda x, i: saving.maybe_save(x, i + 1)), saving),
        "ckpt_scan": (jax.jit(scan_with_saves), scanning),
    }


class Writes:
    """`SAVES` writes in a thread, one every `period` seconds, each of `pattern` (paths
    and sizes relative to a step; one file: a plain write): the files written and
    fsynced in a new directory, every directory fsynced, the directory renamed into
    place and its parent fsynced; the write of two before deleted (`max_to_keep=2`)."""

    def __init__(self, directory: str, pattern: list[tuple[str, int]], period: float) -> None:
        self.directory, self.pattern, self.period = directory, pattern, period
        self.thread: threading.Thread | None = None
        self.round = 0

    def start(self) -> None:
        self.round += 1
        self.thread = threading.Thread(target=self._write, args=(self.round,))
        self.thread.start()

    def join(self) -> None:
        assert self.thread is not None
        self.thread.join()

    def _write(self, round_: int) -> None:
        os.makedirs(self.directory, exist_ok=True)
        begin = time.perf_counter()
        for k in range(SAVES):
            time.sleep(max(0.0, begin + k * self.period - time.perf_counter()))
            self._one(os.path.join(self.directory, f"{round_}-{k}"))
            if k >= 2:
                shutil.rmtree(os.path.join(self.directory, f"{round_}-{k - 2}"))
        for k in range(max(0, SAVES - 2), SAVES):
            shutil.rmtree(os.path.join(self.directory, f"{round_}-{k}"))

    def _one(self, final: str) -> None:
        partial = final + ".partial"
        directories = {partial}
        for relative, size in self.pattern:
            path = os.path.join(partial, relative)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            directories.add(os.path.dirname(path))
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                os.write(fd, os.urandom(size))
                os.fsync(fd)
            finally:
                os.close(fd)
        for path in sorted(directories, reverse=True):
            fsync_dir(path)
        os.rename(partial, final)
        fsync_dir(self.directory)


def step_pattern(step_directory: str) -> list[tuple[str, int]]:
    """(path relative to the step, size) of every file of a step the library wrote."""
    pattern = []
    for root, _, files in os.walk(step_directory):
        for name in files:
            path = os.path.join(root, name)
            pattern.append((os.path.relpath(path, step_directory), os.path.getsize(path)))
    return sorted(pattern)


def body_thunks(program: Callable, x: jax.Array) -> int | None:
    """Thunks in the compiled program's first while-loop body (None: no loop found)."""
    text = program.lower(x, 0).compile().as_text()
    found = re.search(r"while\(.*?body=(%[\w.\-]+)", text)
    if found is None:
        return None
    body = text.split(found.group(1) + " ", 1)[1].split("\n}", 1)[0]
    count = 0
    for line in body.split("\n")[1:]:
        op = re.match(r"\s*(?:ROOT )?%[\w.\-]+ = .*? ([\w\-]+)\(", line)
        if op is not None and op.group(1) not in _NO_THUNK:
            count += 1
    return count


def measure(name: str, rows: int, width: int, n: int, reps: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="jax_cb_ckpt_hot_path_") as directory:
        built = programs(rows, width, n, directory)
        x = jnp.asarray(np.random.default_rng(1).standard_normal((rows, width)), jnp.float32)
        thunks = {m: body_thunks(fn, x) for m, (fn, _) in built.items()}
        thunks["bare_writes"] = thunks["bare_step_writes"] = thunks["bare"]
        for fn, ckpt in built.values():  # compile (and the first saves) outside the clock
            jax.block_until_ready(fn(x, 0))
            if ckpt is not None:
                ckpt.wait()
        period = timed(built["bare"][0], x, 0) / SAVES
        saving = built["maybe_save"][1]
        assert saving is not None
        newest = max(jax_cb_ckpt.all_steps(saving.directory))
        ceilings = {
            "bare_writes": [("state", int(np.asarray(x).nbytes))],
            "bare_step_writes": step_pattern(os.path.join(saving.directory, str(newest))),
        }
        writes = {
            m: Writes(os.path.join(directory, m), pattern, period)
            for m, pattern in ceilings.items()
        }
        times: dict[str, list[float]] = {m: [] for m in METHODS}
        for rep in range(reps):
            for m in rotated(METHODS, rep):
                fn, ckpt = built["bare" if m in writes else m]
                if m in writes:
                    writes[m].start()
                times[m].append(timed(fn, x, (rep + 1) * OFFSET))
                if ckpt is not None:
                    ckpt.wait()  # the saves' writes stay out of the next method's time
                if m in writes:
                    writes[m].join()
        for _, ckpt in built.values():
            if ckpt is not None:
                ckpt.close()
    med = medians(times)
    return {
        "size": name,
        "x": [rows, width],
        "steps": n,
        "saves": SAVES,
        "seconds": med,
        "x_bare": {m: med[m] / med["bare"] for m in METHODS},
        "ns_per_step_over_bare": {m: 1e9 * (med[m] - med["bare"]) / n for m in METHODS},
        "us_per_step_bare": 1e6 * med["bare"] / n,
        "body_thunks": thunks,
    }


def markdown(report: dict[str, Any]) -> str:
    head = " | ".join(METHODS[1:])
    lines = [
        f"{report['machine']}; jax {report['jax']}; {report['reps']} interleaved "
        "repetitions, medians; x bare (loop-body thunks in parentheses).",
        "",
        f"| step | bare us/step (thunks) | {head} |",
        "|---|---|" + "---|" * (len(METHODS) - 1),
    ]
    for r in report["rows"]:
        cells = [f"{r['x_bare'][m]:.3f} ({r['body_thunks'][m]})" for m in METHODS[1:]]
        lines.append(
            f"| {r['size']} ({r['x'][0]}x{r['x'][1]}, {r['steps']} steps) | "
            f"{r['us_per_step_bare']:.2f} ({r['body_thunks']['bare']}) | {' | '.join(cells)} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="short loops (a smoke test)")
    parser.add_argument("--out", default=os.path.join("benchmarks", "results", "hot_path"))
    args = parser.parse_args(argv)
    report: dict[str, Any] = {
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {jax.default_backend()}",
        "jax": jax.__version__,
        "python": sys.version.split()[0],
        "reps": args.reps,
        "rows": [],
    }
    for i, (name, rows, width, n) in enumerate(SIZES):
        n = QUICK_STEPS[i] if args.quick else n
        print(f"== {name}: {rows}x{width}, {n} steps", flush=True)
        report["rows"].append(measure(name, rows, width, n, args.reps))
        write_results(args.out, report, markdown(report))
    print(markdown(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
