"""The one timing harness of the benchmarks: every method runs in one process,
interleaved (the order rotates each repetition so no method always runs first or
after the same neighbour), and the result of each is the median of its repetitions."""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import jax

T = TypeVar("T")


def timed(fn: Callable[..., Any], *args: Any) -> float:
    """Seconds for `fn(*args)` to finish on the device, callbacks included: every
    hand-off made by a callback has returned when the clock stops."""
    jax.effects_barrier()
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    jax.effects_barrier()
    return time.perf_counter() - start


def rotated(items: Sequence[T], rep: int) -> list[T]:
    """`items` rotated by `rep` (the order of repetition `rep`)."""
    k = rep % len(items) if items else 0
    return list(items[k:]) + list(items[:k])


def medians(samples: dict[str, list[float]]) -> dict[str, float]:
    return {name: statistics.median(values) for name, values in samples.items()}


def write_results(out: str, report: Any, markdown: str) -> None:
    """`out`/results.json (the report) and `out`/results.md (its table)."""
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(report, f, indent=2)
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write(markdown)
