"""The benchmark suite's quick mode and the writer benchmark run end to end and write
their reports (smoke tests: no timing is asserted here; targets are judged by the
benchmarks themselves)."""

import json
import os

import pytest
from helpers import run_child


def _run(*args, timeout):
    result = run_child(["python", "-m", *args], timeout=timeout)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


@pytest.mark.slow  # ~3 minutes
def test_quick_benchmark_writes_json_markdown_and_plots(tmp_path):
    out = tmp_path / "bench"
    _run("benchmarks.run", "--quick", "--reps", "2", "--out", str(out), timeout=900)
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
    writer = json.loads((out / "writer" / "results.json").read_text())  # ends the profile
    assert writer["quick"] and writer["cases"] and writer["devices"]
    assert [r["every"] for r in writer["loops"]] == [100, 1000]
    assert writer["newest"]["newest_x_bare"] > 0  # a save every 10 steps, on_full="newest"
    assert writer["newest"]["floor_x_bare"] > 0  # the same crossings doing nothing
    assert writer["newest"]["unwritten_x_bare"] > 0  # our host side, the writer asleep


@pytest.mark.slow
def test_writer_benchmark_smallest_run_reports_save_and_ceilings(tmp_path):
    out, disk = tmp_path / "writer", tmp_path / "disk"
    shm = tmp_path / "tmpfs"  # any directory will do for the test
    shm.mkdir()
    args = ("--only", "tiny,64MiB,devices", "--reps", "1", "--dir", str(disk), "--out", str(out))
    printed = _run("benchmarks.writer", *args, "--tmpfs", str(shm), timeout=300).stdout
    report = json.loads((out / "results.json").read_text())
    machine = report["machine"]
    assert machine["cpu_count"] >= 1 and machine["cpu_model"] and machine["jax"]
    assert machine["orbax"] != "?" and machine["filesystem"]["type"] != "unknown"
    assert machine["dir"].startswith(str(disk)) and not os.listdir(disk)  # cleaned up
    cases = report["cases"]
    # The large leaves with their files kept and with the previous one deleted (as
    # max_to_keep=1 does; the ceilings the same), and again on the tmpfs directory.
    assert [
        (c["case"], c["compression"], c["pattern"], c["dir"] == report["tmpfs"]) for c in cases
    ] == [
        ("tiny", False, "keep", False),
        ("tiny", True, "keep", False),
        ("64MiB", False, "keep", False),
        ("64MiB", False, "retain", False),
        ("64MiB", True, "keep", False),
        ("64MiB", True, "retain", False),
        ("64MiB", False, "keep", True),
        ("64MiB", False, "retain", True),
    ]
    assert not os.listdir(shm)  # cleaned up
    for c in cases:
        assert c["reps"] == 1 and (c["leaves"], c["bytes"]) in ((4, 2048), (1, 64 << 20))
        for key in ("save_s", "write_fsync_s", "commit_s", "writer_write_s", "x_write_fsync"):
            assert c[key] > 0, key
        assert c["checksum_s"] is None or c["checksum_s"] >= 0
    devices = report["devices"]
    assert devices["devices"] == 8 and devices["leaves"] == 80
    assert devices["save_s"]["gathered"] > 0 and devices["save_s"]["per_device"] > 0
    assert "loops" not in report
    markdown = (out / "results.md").read_text()
    assert markdown in printed and "x write+fsync" in markdown and "per device" in markdown


@pytest.mark.slow
def test_storage_benchmark_saves_to_both_servers_and_reports_ceilings(tmp_path):
    out = tmp_path / "storage"
    args = ("--mib", "1", "--reps", "1", "--dir", str(tmp_path), "--out", str(out))
    printed = _run("benchmarks.storage", *args, timeout=300).stdout
    report = json.loads((out / "results.json").read_text())
    assert [r["storage"] for r in report["rows"]] == ["local", "gs", "s3"]
    for r in report["rows"]:
        assert r["save_s"] > 0 and r["ceiling_s"] > 0 and r["device_wait_s"] > 0
    assert (out / "results.md").read_text() in printed


@pytest.mark.slow
def test_gpu_devices_check_is_exact_on_the_cpu_devices(tmp_path):
    """benchmarks/gpu_devices.py (issue 22, item 5, run by benchmarks/gpu.sh on a GPU)
    passes on this machine's 4 CPU devices: shardings=, pmap, shard_map and a gathered
    save of packed dtypes, each restored bit for bit."""
    out = tmp_path / "devices"
    _run("benchmarks.gpu_devices", "--out", str(out), timeout=300)
    report = json.loads((out / "results.json").read_text())
    assert report["devices"] == 4
    cases = ("shardings", "pmap", "shard_map", "gathered", "shardings+packed", "gathered+packed")
    assert report["cases"] == dict.fromkeys(cases, "ok, bit for bit")


@pytest.mark.slow  # ~45 s: two child processes, four methods compiled per workload
def test_gpu_cost_runs_each_xla_configuration_in_a_process_of_its_own(tmp_path):
    out = tmp_path / "cost"
    printed = _run(
        "benchmarks.gpu_cost", "--quick", "--reps", "1", "--out", str(out), timeout=600
    ).stdout
    report = json.loads((out / "results.json").read_text())
    assert [c["config"] for c in report["configs"]] == [
        "xla-default",
        "command-buffer+conditional",
    ]
    assert "--xla_gpu_enable_command_buffer=" in report["configs"][1]["xla_flags"]
    for config in report["configs"]:
        assert "error" not in config, config["error"]
        assert [w["workload"] for w in config["workloads"]] == ["tiny", "medium"]
        for w in config["workloads"]:
            assert set(w["x_bare"]) == {"bare", "maybe_save_never", "maybe_save", "ckpt_scan"}
            assert all(v > 0 for v in w["train_s"].values())
    assert (out / "results.md").read_text() in printed


@pytest.mark.slow  # ~30 s
def test_restore_benchmark_reports_restore_next_to_its_ceilings(tmp_path):
    out, disk = tmp_path / "restore", tmp_path / "disk"
    disk.mkdir()
    args = ("--only", "tiny", "--reps", "1", "--dir", str(disk), "--out", str(out))
    printed = _run("benchmarks.restore", *args, timeout=300).stdout
    report = json.loads((out / "results.json").read_text())
    assert report["machine"]["jax"] and isinstance(report["cold"], bool)
    [case] = report["results"]
    assert case["case"] == "tiny" and case["dir"] == str(disk)
    modes = ["warm", "cold"] if report["cold"] else ["warm"]
    methods = ("restore", "restore, verify=False", "restore, jax.Arrays", "plain Orbax")
    methods = (*methods, "restore, like jax.Arrays", "restore, TensorStore")
    for method in (*methods, "plain read", "verify", "verify, TensorStore"):
        for mode in modes:
            assert case["ms"][f"{method} {mode}"] > 0, (method, mode)
    assert not os.listdir(disk)  # cleaned up
    # The object-storage rows (the test extra installs the servers): restore from gs://
    # and s3:// next to one GET and ranged GETs of as many bytes, and a plain read of
    # the step's objects.
    assert [(b["dir"], b["case"]) for b in report["buckets"]] == [
        ("gs://", "tiny"),
        ("s3://", "tiny"),
    ]
    for bucket in report["buckets"]:
        assert bucket["bytes"] > 0
        for method in ("restore", "restore, verify=False", "one GET", "ranged GETs", "plain read"):
            assert bucket["ms"][method] > 0, (bucket["dir"], method)
    markdown = (out / "results.md").read_text()
    assert markdown in printed and "x Orbax" in markdown and "x GET" in markdown
    assert "| verify | verify, TensorStore | x TensorStore |" in markdown
    assert "x read |" in markdown.split("x GET")[1]  # the bucket table's plain-read ratio


def test_policies_benchmark_reports_device_ratios_and_retention_per_save(tmp_path):
    printed = _run(
        "benchmarks.policies",
        *("--steps", "2000", "--every", "1000", "--reps", "1", "--kept", "5,40", "--saves", "4"),
        timeout=300,
    ).stdout
    report = json.loads(printed[: printed.index("\n}\n") + 2])
    device = report["device"]
    assert set(device["ratio_to_plain"]) == {"plain", "policies", "every_seconds", "plain_again"}
    assert device["ratio_to_plain"]["plain"] == 1.0 and device["saves_per_run"] == 2
    assert device["best_step_of_the_policies_run"] is not None  # metrics were recorded
    for n, row in report["writer"].items():
        assert row["retention_ms_per_save"] > 0 and row["write_ms_per_save"] > 0, n
        # max_to_keep=n, keep_every=7 and the best 3: about n of the n + saves steps
        assert int(n) <= row["steps_on_disk"] <= int(n) + int(n) // 7 + 4 + 3
    assert "x plain" in printed and "kept: retention" in printed


@pytest.mark.slow  # ~40 s
def test_hot_path_benchmark_reports_each_step_size_next_to_the_cond_floor(tmp_path):
    out = tmp_path / "hot"
    printed = _run("benchmarks.hot_path", "--quick", "--reps", "1", "--out", str(out), timeout=600)
    report = json.loads((out / "results.json").read_text())
    assert [r["size"] for r in report["rows"]] == ["~1 us", "~10 us", "~1 ms"]
    methods = {"bare", "cond", "cond_debug_callback", "maybe_save_never", "maybe_save"}
    for row in report["rows"]:
        assert set(row["x_bare"]) == methods | {"ckpt_scan", "bare_writes", "bare_step_writes"}
        assert all(v > 0 for v in row["seconds"].values())
        assert all(isinstance(row["body_thunks"][m], int) for m in methods)
    assert (out / "results.md").read_text() in printed.stdout


def test_partial_benchmark_reports_the_partial_restore_against_the_whole(tmp_path):
    out = tmp_path / "partial"
    args = ("--mib", "8", "--reps", "2", "--dir", str(tmp_path), "--out", str(out))
    printed = _run("benchmarks.partial", *args, timeout=300).stdout
    report = json.loads((out / "results.json").read_text())["partial"]
    assert set(report["median_ms"]) == {"whole", "params, partial_restore"}
    assert all(ms > 0 for ms in report["median_ms"].values())
    assert 0.009 < report["params_share"] < 0.011 and report["target"] == 0.05
    assert (
        report["ratio"]
        == report["median_ms"]["params, partial_restore"] / report["median_ms"]["whole"]
    )
    assert "partial_restore" in (out / "results.md").read_text() and "ratio" in printed


def test_incremental_benchmark_reports_linked_saves_against_full_ones_and_ceilings(tmp_path):
    out, disk, shm = tmp_path / "incremental", tmp_path / "disk", tmp_path / "tmpfs"
    shm.mkdir()  # any directory will do for the test
    args = ("--cases", "8:32", "--reps", "2", "--restore-reps", "1", "--dir", str(disk))
    args += ("--tmpfs", str(shm), "--tmpfs-cases", "8:32", "--growth", "8:32:4", "--out", str(out))
    printed = _run("benchmarks.incremental", *args, timeout=300).stdout
    report = json.loads((out / "results.json").read_text())
    cases = report["cases"]
    assert [(c["mib"], c["fraction"], c["dir"] == report["tmpfs"]) for c in cases] == [
        (8, 32, False),
        (8, 32, True),
    ]
    assert not os.listdir(disk) and not os.listdir(shm)  # cleaned up
    for c in cases:
        assert c["reps"] == c["linked_saves"] == 2 and c["whole_saves_in_chain"] == 0
        assert set(c["median_ms"]) == {
            "incremental",
            "incremental, whole",
            "full",
            "write+fsync changed",
            "write+fsync full",
            "memcpy",
        }
        assert all(ms > 0 for ms in c["median_ms"].values())
        assert all(ms > 0 for ms in c["restore_ms"].values())
        written = c["written_bytes"]
        assert written["full"] == c["state_bytes"] > written["incremental"] >= c["changed_bytes"]
        assert c["x_full_bytes"] == written["incremental"] / written["full"]
        assert c["du_bytes"]["incremental"] < c["du_bytes"]["full"]  # steps share files
        assert len(c["du_incremental_after_each"]) == 2
    growth = report["growth"]  # disk use along a chain: the first save whole, then linked
    assert growth["linked"] == [False, True, True, True]
    assert all(n > 0 for n in growth["data_files"])
    assert len(growth["du_incremental"]) == len(growth["du_full"]) == 4
    markdown = (out / "results.md").read_text()
    assert markdown in printed and "Targets at 1/32 changed" in markdown
    assert "Disk use along a chain" in markdown
