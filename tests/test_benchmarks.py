"""The benchmark suite's quick mode runs end to end and writes its report (a smoke test:
no timing is asserted here; targets are judged by the suite itself)."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_quick_benchmark_writes_json_markdown_and_plots(tmp_path):
    out = tmp_path / "bench"
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.run", "--quick", "--reps", "2", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env=dict(os.environ, JAX_PLATFORMS="cpu"),
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads((out / "results.json").read_text())
    names = {r["workload"] for r in report["results"]}
    assert {"tiny", "medium", "state_1KB", "state_1MB", "state_16MB"} <= names
    for r in report["results"]:
        for method, m in r["methods"].items():
            assert m["median_s"] > 0 and m["steps_per_s"] > 0, (r["workload"], method)
        assert r["library"]["saves"] > 0 and r["library"]["skipped"] == 0
    tiny = next(r for r in report["results"] if r["workload"] == "tiny")
    assert set(tiny["methods"]) >= {
        "bare",
        "maybe_save",
        "outer_loop_orbax",
        "chunked_orbax",
        "naive_debug_callback",
    }
    assert report["targets"] and all("met" in t for t in report["targets"])
    markdown = (out / "results.md").read_text()
    assert "### Targets" in markdown and "maybe_save" in markdown
    for png in ("throughput.png", "state_size.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
