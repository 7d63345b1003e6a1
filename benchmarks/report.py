"""Markdown tables and PNG plots from a benchmark report (see benchmarks/run.py)."""

from __future__ import annotations

import os
from typing import Any

MAIN = ("bare", "maybe_save", "outer_loop_orbax", "chunked_orbax", "naive_debug_callback")


def _mb(nbytes: float) -> str:
    return f"{nbytes / (1 << 20):.1f}"


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.2f}"


def markdown(report: dict[str, Any]) -> str:
    mach = report["machine"]
    lines = [
        f"Run {mach['date']} on {mach['device']} ({mach['backend']}, {mach['cpu_count']} "
        f"CPU cores), JAX {mach['jax']}, orbax-checkpoint {mach['orbax']}, "
        f"jax_cb_ckpt {mach['jax_cb_ckpt']}{' (quick mode)' if report['quick'] else ''}.",
        "",
        "### Throughput (medians; x bare = time / time of the bare scan)",
        "",
        "Time = until the checkpoints are on disk (final flush included); steps/s from it.",
        "",
        "| workload | save every | method | time (s) | steps/s | x bare | peak RSS added (MB) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in report["results"]:
        if r["workload"].startswith("state_"):
            continue
        for name in (*MAIN, "maybe_save_never"):
            m = r["methods"].get(name)
            if m is None:
                continue
            lines.append(
                f"| {r['workload']} | {r['every']} | {name} | {m['median_s']:.3f} | "
                f"{m['steps_per_s']:,.0f} | {m['x_bare_time']:.2f} | "
                f"{_mb(m['peak_rss_added_bytes'])} |"
            )
    lines += [
        "",
        "### State-size sweep: what the device waits for, per save (ms)",
        "",
        "Blocking = (training time with saves - bare training time) / saves, where the "
        "training time ends when the loop has finished on the device with every save "
        "handed over (queue as deep as the saves, so no back-pressure); x bare columns "
        "use the total time, final flush to disk included. Floors: the same `cond` with a "
        "no-op `io_callback` / `debug.callback` taking the state; one copy of the state's "
        "bytes into a touched host buffer; on an accelerator, one device-to-host copy.",
        "",
        "| state | bare run (s) | maybe_save blocking | library hand-off | no-op io_callback "
        "| no-op debug.callback | copy (touched) | device-to-host | maybe_save / no-op io "
        "| maybe_save total x bare | outer loop x bare | chunked x bare | peak RSS added / state |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["results"]:
        if not r["workload"].startswith("state_"):
            continue
        b = r["blocking_per_save_s"]
        lib = r.get("library", {})
        m = r["methods"]
        ratio = (
            b["maybe_save"] / b["noop_io_callback"] if b["noop_io_callback"] > 0 else float("nan")
        )
        lines.append(
            f"| {r['workload'][6:]} | {m['bare']['median_train_s']:.3f} | {_ms(b['maybe_save'])} | "
            f"{_ms(lib.get('handoff_median_s'))} | {_ms(b['noop_io_callback'])} | "
            f"{_ms(b['noop_debug_callback'])} | {_ms(r['copy_floor_s'])} | "
            f"{_ms(r['device_to_host_floor_s'])} | {ratio:.2f} | "
            f"{m['maybe_save']['x_bare_time']:.2f} | {m['outer_loop_orbax']['x_bare_time']:.2f} | "
            f"{m['chunked_orbax']['x_bare_time']:.2f} | "
            f"{m['maybe_save']['peak_rss_added_bytes'] / r['state_bytes']:.2f} |"
        )
    lines += ["", "### Targets", "", "| target | measured | limit | met |", "|---|---|---|---|"]
    for t in report["targets"]:
        lines.append(
            f"| {t['target']} | {t['measured']:.2f} | {t['op']} {t['limit']} | "
            f"{'yes' if t['met'] else '**no**'} |"
        )
    return "\n".join(lines) + "\n"


def plots(report: dict[str, Any], out: str) -> list[str]:
    """throughput.png (steps/s per method) and state_size.png (blocking per save)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    loops = [r for r in report["results"] if not r["workload"].startswith("state_")]
    if loops:
        fig, ax = plt.subplots(figsize=(9, 4.5))
        width = 0.8 / len(MAIN)
        for i, name in enumerate(MAIN):
            values = [r["methods"][name]["steps_per_s"] for r in loops]
            xs = [j + i * width for j in range(len(loops))]
            ax.bar(xs, values, width, label=name)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(loops))])
        ax.set_xticklabels([f"{r['workload']}\nevery {r['every']}" for r in loops])
        ax.set_yscale("log")
        ax.set_ylabel("steps / s (log)")
        ax.set_title(f"Training throughput with checkpoints ({report['machine']['device']})")
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = os.path.join(out, "throughput.png")
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path)
    sweep = [r for r in report["results"] if r["workload"].startswith("state_")]
    if sweep:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        sizes = [r["state_bytes"] for r in sweep]
        series = {
            "maybe_save (saved - bare)": [r["blocking_per_save_s"]["maybe_save"] for r in sweep],
            "no-op io_callback floor": [
                r["blocking_per_save_s"]["noop_io_callback"] for r in sweep
            ],
            "no-op debug.callback floor": [
                r["blocking_per_save_s"]["noop_debug_callback"] for r in sweep
            ],
            "copy into touched buffer": [r["copy_floor_s"] for r in sweep],
        }
        for label, values in series.items():
            ax.plot(sizes, [max(v, 1e-6) * 1e3 for v in values], marker="o", label=label)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("state size (bytes)")
        ax.set_ylabel("device blocking per save (ms)")
        ax.set_title("What the device waits for, per save")
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = os.path.join(out, "state_size.png")
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path)
    return written
