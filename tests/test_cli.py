"""The command line, run as a user runs it (a subprocess): `jax-cb-ckpt` and
`python -m jax_cb_ckpt`, `ls`, `show`, `verify`, with and without `--json`, on real
checkpoints; a flipped byte makes `verify` exit 1 naming the leaf and step."""

import json
import os
import shutil
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import data_files, flip, run_child
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_cb_ckpt

SCRIPT = Path(sys.executable).with_name("jax-cb-ckpt")  # installed by pip with the package


def cli(*args, module=False):
    command = [sys.executable, "-m", "jax_cb_ckpt"] if module else [str(SCRIPT)]
    return run_child([*command, *args], timeout=120)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Steps 1 and 2 (a 1 MiB float leaf sharded over a 2x2 mesh, a typed key, ints)
    and step 3 saved under jit(vmap) over 3 members, of which 2 saved."""
    directory = tmp_path_factory.mktemp("cli") / "ckpt"
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("a", "b"))
    shardings = {
        "w": NamedSharding(mesh, P("a", "b")),
        "key": NamedSharding(mesh, P()),
        "n": NamedSharding(mesh, P()),
    }
    state = {
        "w": jnp.arange(1 << 18, dtype=jnp.float32).reshape(512, 512),
        "key": jax.random.key(0),
        "n": jnp.int32(7),
    }
    state = jax.device_put(state, shardings)
    with jax_cb_ckpt.Checkpointer(directory) as ckpt:
        save = jax.jit(lambda s, i: ckpt.save(s, i, shardings=shardings))
        save(state, 1)
        save(state, 2)
        ckpt.wait()

        def member(x, keep):
            ckpt.maybe_save({"x": x}, 3, when=keep)
            return x

        jax.jit(jax.vmap(member))(jnp.ones((3, 4)), jnp.array([True, False, True]))
    return directory


@pytest.mark.parametrize("module", [False, True], ids=["script", "python -m"])
def test_ls_lists_every_step_complete_with_size_and_time(saved, module):
    result = cli("ls", saved, module=module)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].split()[:2] == ["step", "saved"], result.stdout
    assert [line.split()[0] for line in lines[1:]] == ["1", "2", "3"], result.stdout
    assert all(line.endswith("complete") for line in lines[1:]), result.stdout
    assert "MiB" in lines[1] and jax_cb_ckpt.metadata(saved, step=1)["saved_at"][:10] in lines[1]


@pytest.mark.slow
def test_ls_json_and_a_step_being_written(saved, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(saved, copy)
    shutil.copytree(copy / "2", copy / ("9.jax_cb_ckpt-tmp-" + "ab" * 16))  # mid-write
    (copy / "notes.txt").write_text("a user's file, not a step")
    result = cli("ls", copy, "--json")
    assert result.returncode == 0, result.stderr
    found = json.loads(result.stdout)
    assert found["directory"] == str(copy.resolve())
    steps = found["steps"]
    assert [(s["step"], s["complete"]) for s in steps] == [
        (1, True),
        (2, True),
        (3, True),
        (9, False),
    ]
    assert steps[0]["bytes"] >= 1 << 20  # the 1 MiB leaf, as stored
    assert steps[0]["saved_at"] == jax_cb_ckpt.metadata(copy, step=1)["saved_at"]
    assert steps[3]["saved_at"] is None
    assert "incomplete" in cli("ls", copy).stdout.splitlines()[-1]


@pytest.mark.slow
def test_show_names_leaves_shardings_batch_and_versions(saved):
    result = cli("show", saved, "--step", 2)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert out.startswith(f"step 2 of {saved.resolve()}"), out
    assert f"jax {jax.__version__}" in out and "orbax-checkpoint" in out, out
    assert f"jax_cb_ckpt {jax_cb_ckpt.__version__}" in out, out
    (w,) = [line for line in out.splitlines() if "state['w']" in line]
    assert "float32" in w and "(512, 512)" in w, w
    assert "saved per device: mesh(a=2, b=2) P('a', 'b')" in w, w
    (key,) = [line for line in out.splitlines() if "state['key']" in line]
    assert "key<threefry2x32>" in key and "P()" in key, key
    batch = cli("show", saved).stdout  # the latest step: the vmapped save
    assert "step 3 of" in batch, batch
    assert "shape (3,)" in batch and "2 of 3 members saved: [(0,), (2,)]" in batch, batch


def test_show_names_a_pmap_save_by_its_devices(tmp_path):
    """A pmap save with axis_name= holds one state per device on a leading axis: `show`
    says so, naming the axis, not "vmap batch" (issue 53)."""
    with jax_cb_ckpt.Checkpointer(tmp_path / "ckpt") as ckpt:

        def epoch(x, keep):
            ckpt.maybe_save({"x": x}, 4, axis_name="i", when=keep)
            return x

        jax.pmap(epoch, axis_name="i")(jnp.ones((2, 3)), jnp.array([True, False]))
    out = cli("show", tmp_path / "ckpt").stdout
    assert "vmap batch" not in out, out
    assert "device axis   shape (2,) over pmap/shard_map axis 'i'" in out, out
    assert "1 of 2 devices saved: [0]" in out, out


def test_show_json_is_the_metadata(saved):
    result = cli("show", saved, "--step", 1, "--json")
    assert result.returncode == 0, result.stderr
    found = json.loads(result.stdout)
    meta = jax_cb_ckpt.metadata(saved, step=1)
    assert found == {"directory": str(saved.resolve()), **meta}
    assert meta["jax_version"] == jax.__version__
    assert meta["shardings"]["state['w']"] == {"mesh": {"a": 2, "b": 2}, "spec": [["a"], ["b"]]}


@pytest.mark.slow
def test_verify_passes_then_finds_a_flipped_byte(saved, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(saved, copy)
    result = cli("verify", copy)
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("ok (every byte matches its checksum)") == 3, result.stdout
    biggest = data_files(copy / "2")[0]
    flip(biggest, os.path.getsize(biggest) // 2)
    result = cli("verify", copy)
    assert result.returncode == 1, (result.stdout, result.stderr)
    lines = result.stdout.splitlines()
    assert lines[0].startswith("step 1: ok") and lines[2].startswith("step 3: ok"), lines
    assert lines[1].startswith("step 2: FAILED") and "state['w']" in lines[1], lines
    found = json.loads(cli("verify", copy, "--step", 2, "--json").stdout)
    assert found["ok"] is False and found["steps"][0]["ok"] is False, found
    assert "is corrupted" in found["steps"][0]["error"], found
    assert cli("verify", copy, "--step", 1).returncode == 0


@pytest.mark.slow
def test_what_cannot_run_exits_2_saying_why(saved, tmp_path):
    missing = cli("ls", tmp_path / "nowhere")
    assert missing.returncode == 2 and "is not a directory" in missing.stderr, missing
    no_step = cli("show", saved, "--step", 99)
    assert no_step.returncode == 2 and "99" in no_step.stderr, no_step
    assert "jax-cb-ckpt show:" in no_step.stderr, no_step
    usage = cli("frobnicate", saved)
    assert usage.returncode == 2 and "invalid choice" in usage.stderr, usage
    empty = tmp_path / "empty"
    empty.mkdir()
    listed = cli("ls", empty)  # no checkpoints: 2, as the table says (was 0)
    assert listed.returncode == 2 and "no checkpoints in" in listed.stderr, listed


def test_exit_codes_follow_one_rule_and_help_says_it(saved, tmp_path):
    """Issue 42 item 11: `ls` of an empty directory or of one step's folder printed "no
    checkpoints" and exited 0 where the table says 2; `verify --step 7` of a missing
    step exited 1 where `show --step 7` exits 2. One rule, in `--help` too, and the
    same table in docs/cli.md."""
    empty = tmp_path / "empty"
    empty.mkdir()
    step_folder = saved / "1"
    for args in (
        ("ls", empty),
        ("ls", "--json", empty),
        ("ls", step_folder),
        ("show", saved, "--step", 7),
        ("verify", saved, "--step", 7),
        ("verify", empty),
    ):
        run = cli(*args)
        assert run.returncode == 2, (args, run.returncode, run.stdout, run.stderr)
    assert "one step's folder: pass the directory that holds it" in cli("ls", step_folder).stderr
    helped = cli("--help").stdout
    with open(os.path.join(os.path.dirname(__file__), "..", "docs", "cli.md")) as f:
        table = f.read()
    for code in ("0", "1", "2", "3"):
        assert f"\n  {code}  " in helped, helped
        assert f"| {code} |" in table
    assert "exit codes (every command)" in cli("verify", "--help").stdout


def test_the_cli_starts_at_once_and_imports_neither_jax_nor_orbax(saved):
    """`ls`, `show` and `--help` read JSON files: they import neither JAX (~1.8 s) nor
    Orbax nor TensorStore; `verify` reads the step's index itself (`_ocdbt`) and its
    chunks' bytes, without TensorStore (~0.55 s, its import of ml_dtypes): the fixture's
    steps hold a sharded leaf's device blocks, a typed key and vmap members. Their start
    time is printed (pytest -s); a timed assertion would fail on a loaded machine, the
    imports are what is checked."""
    import time

    probe = (
        "import sys, runpy; sys.argv = ['jax-cb-ckpt', *sys.argv[1:]]\n"
        "from jax_cb_ckpt._cli._main import main\n"
        "code = main()\n"
        "heavy = [m for m in ('jax', 'orbax.checkpoint', 'tensorstore') if m in sys.modules]\n"
        "print('HEAVY', heavy)\n"
    )
    needs = {"ls": "[]", "show": "[]", "verify": "[]"}
    for args in (["ls", str(saved)], ["show", str(saved)], ["verify", str(saved)], ["--help"]):
        run = run_child([sys.executable, "-c", probe, *args], timeout=120)
        if args != ["--help"]:
            assert run.returncode == 0, run.stderr
            assert f"HEAVY {needs[args[0]]}" in run.stdout, run.stdout
        start = time.perf_counter()
        cli(*args)
        print(f"jax-cb-ckpt {args[0]}: {time.perf_counter() - start:.2f} s")


VERIFY_PROBE = (
    "import sys; sys.argv = ['jax-cb-ckpt', 'verify', sys.argv[1]]\n"
    "from jax_cb_ckpt._cli._main import main\n"
    "code = main()\n"
    "print('TENSORSTORE', 'tensorstore' in sys.modules, 'CODE', code)\n"
)


def test_verify_reads_with_tensorstore_what_its_own_reader_does_not(tmp_path, monkeypatch):
    """A compressed leaf (compression=True) needs TensorStore's zarr driver, and a step
    whose index is compressed (this package's before 2026-12-04, and Orbax's) TensorStore's
    OCDBT reader: verify imports it for those and checks them as well; a flipped bit in
    either is still found."""
    from jax_cb_ckpt._write import _store

    big = {"w": np.random.default_rng(0).standard_normal((512, 300)).astype(np.float32)}
    compressed, old = tmp_path / "compressed", tmp_path / "old"
    with jax_cb_ckpt.Checkpointer(compressed, compression=True) as ckpt:
        ckpt.save(big, 1)
    monkeypatch.setitem(_store._OCDBT_CONFIG, "compression", {"id": "zstd"})
    with jax_cb_ckpt.Checkpointer(old) as ckpt:
        ckpt.save(big, 1)
    monkeypatch.undo()
    for directory in (compressed, old):
        run = run_child([sys.executable, "-c", VERIFY_PROBE, str(directory)], timeout=120)
        assert "TENSORSTORE True CODE 0" in run.stdout, run.stdout + run.stderr
        assert "step 1: ok" in run.stdout
    flip(data_files(old / "1")[0], offset=1000)
    run = run_child([sys.executable, "-c", VERIFY_PROBE, str(old)], timeout=120)
    assert "step 1: FAILED" in run.stdout and "CODE 1" in run.stdout, run.stdout + run.stderr


def test_logging_basicconfig_after_import_shows_the_library_s_lines(tmp_path):
    """docs/cli.md's recipe: `logging.basicConfig(level=logging.INFO)` after `import
    jax_cb_ckpt` shows the saved-step line (importing Orbax at package import installed
    absl's handler on the root logger first, so basicConfig did nothing)."""
    code = (
        "import jax_cb_ckpt, logging, numpy as np\n"
        "logging.basicConfig(level=logging.INFO)\n"
        f"with jax_cb_ckpt.Checkpointer({str(tmp_path / 'c')!r}) as c:\n"
        "    c.save({'w': np.ones(3)}, 1)\n"
    )
    run = run_child([sys.executable, "-c", code], timeout=120)
    assert run.returncode == 0, run.stderr
    assert "INFO:jax_cb_ckpt:saved step 1" in run.stderr, run.stderr


LOGGED_RUN = """
import jax.numpy as jnp, jax_cb_ckpt, logging, sys
logging.basicConfig(level=logging.INFO)
body = lambda s, i: {"x": s["x"] + 1.0}
with jax_cb_ckpt.Checkpointer(sys.argv[1], every=5) as c:
    c.request_stop()
    try:
        c.run(body, {"x": jnp.zeros(3)}, 20)
    except SystemExit:
        pass
    c.run(body, {"x": jnp.zeros(3)}, 20)  # resumed
    c.run(body, {"x": jnp.zeros(3)}, 20)  # finished: nothing to do
    c.restore({"x": jnp.zeros(3)})
"""


def test_the_library_s_log_lines_are_readable_and_alone(tmp_path):
    """Issue 30 item 1: with INFO on, a stopped, resumed and finished run and a restore
    log the library's lines once each, without a doubled prefix ("WARNING:jax_cb_ckpt:
    jax_cb_ckpt: stopped ..."), a finished run at INFO (it is normal), which step a
    resumed run started from; and no third-party lines from the library's work (Orbax's
    absl INFO lines came with every restore)."""
    directory = tmp_path / "c"
    script = tmp_path / "logged.py"
    script.write_text(LOGGED_RUN)
    run = run_child([sys.executable, script, directory], timeout=180)
    assert run.returncode == 0, run.stderr
    lines = [line for line in run.stderr.splitlines() if line.startswith(("INFO:", "WARNING:"))]
    ours = [
        line for line in lines if line.startswith(("INFO:jax_cb_ckpt:", "WARNING:jax_cb_ckpt:"))
    ]
    others = [line for line in lines if line not in ours and "libtpu" not in line]
    assert not others, others  # (JAX's own note that it found no TPU, at its start, aside)
    assert not [
        line for line in ours if ":jax_cb_ckpt: " in line or "jax_cb_ckpt:jax_cb_ckpt" in line
    ], ours
    assert ours[1] == (
        f"WARNING:jax_cb_ckpt:run stopped at step 5 after request_stop(); checkpoint saved "
        f"in {directory}; exit code 1"
    ), ours
    resumed = "the newest step that passes its checks"
    assert f"INFO:jax_cb_ckpt:run: resumed from step 5 of {directory} ({resumed})" in ours
    assert f"INFO:jax_cb_ckpt:restore: restored step 20 of {directory} ({resumed})" in ours
    assert [line for line in ours if line.startswith("INFO:jax_cb_ckpt:run: nothing to do")]
    # Saves at INFO: the first one, then a line per 10 s at most (here: at the end),
    # saying how many and the newest (issue 41 item 7).
    saves = [line for line in ours if line.startswith("INFO:jax_cb_ckpt:saved")]
    assert saves[0].startswith("INFO:jax_cb_ckpt:saved step 5 (12 B"), saves
    assert saves[-1].startswith("INFO:jax_cb_ckpt:saved 3 steps to"), saves
    assert "the newest step 20 (12 B" in saves[-1] and len(saves) == 2, saves


def test_a_closed_pipe_ends_the_command_quietly(saved):
    """Issue 30 item 6: `show ... | head -1` failed with "[Errno 32] Broken pipe" and exit
    code 2 about one time in four: the reader going away ends the command, quietly."""
    for command in ("show", "ls", "verify"):
        for _ in range(4):
            run = run_child(
                ["bash", "-c", f'set -o pipefail; "{SCRIPT}" {command} "{saved}" | head -c 1'],
                timeout=120,
            )
            assert run.returncode == 0, (command, run.returncode, run.stderr)
            assert run.stderr == "", (command, run.stderr)


def test_verify_beside_a_running_writer_skips_the_steps_its_retention_removes(tmp_path, capsys):
    """`jax-cb-ckpt verify DIR` beside a writer saving in a loop with max_to_keep=2: 8 of
    59 runs exited 1 ("step 28: FAILED: ... was removed while it was being read", "not
    a complete step"). A step removed by retention while it is read is no damage: the
    command says "removed ..., skipped" and exits 0, and `jax_cb_ckpt.verify(DIR)`
    skips it the same way (it raised NoCheckpointError)."""
    import threading

    from jax_cb_ckpt._cli._main import main

    d = tmp_path / "run"
    stop, failed = threading.Event(), []

    def write():
        try:
            with jax_cb_ckpt.Checkpointer(d, max_to_keep=2) as ckpt:
                step = 0
                while not stop.is_set():
                    step += 1
                    ckpt.save({"w": np.full((64, 256), step, np.float32)}, step)
                    ckpt.wait()
        except BaseException as e:
            failed.append(e)

    writer = threading.Thread(target=write)
    writer.start()
    codes, removed, api_errors = [], 0, []
    try:
        while jax_cb_ckpt.latest_step(d) is None and not failed:
            stop.wait(0.01)
        for _ in range(400):  # bounded; most rounds meet no removal
            capsys.readouterr()
            codes.append(main(["verify", str(d), "--json"]))
            report = json.loads(capsys.readouterr().out)
            assert codes[-1] == 0, report
            removed += sum(1 for r in report["steps"] if r.get("removed"))
            try:
                checked = jax_cb_ckpt.verify(d)
            except jax_cb_ckpt.CheckpointError as e:
                api_errors.append(f"{type(e).__name__}: {e}")
            else:
                assert checked == sorted(checked)
            if removed >= 3:
                break
    finally:
        stop.set()
        writer.join()
    assert not failed, failed
    assert api_errors == [], api_errors[:3]
    assert removed, "no step was removed while verify read it: the test shows nothing"
    main(["verify", str(d)])
    assert "FAILED" not in capsys.readouterr().out


def test_verify_of_a_step_removed_while_it_is_read(tmp_path, capsys, monkeypatch):
    """The race of the test above, at a set instant: each step is removed (renamed
    aside, as retention does) just as verify starts reading it. Without --step every
    step is "removed ..., skipped" (exit 0); with --step N the one step asked for is
    not there: exit 2 (nothing verified), not 1 (damage)."""
    import uuid

    from jax_cb_ckpt._cli._main import main
    from jax_cb_ckpt._read import _steps

    d = tmp_path / "run"
    with jax_cb_ckpt.Checkpointer(d) as ckpt:
        for step in (1, 2):
            ckpt.save({"w": np.full(8, step, np.float32)}, step)
    verify_one = _steps._verify_one

    def removed_first(storage, step, what):
        os.rename(d / str(step), d / f"{step}.jax_cb_ckpt-deleting-{uuid.uuid4().hex}")
        return verify_one(storage, step, what)

    monkeypatch.setattr(_steps, "_verify_one", removed_first)
    capsys.readouterr()
    assert main(["verify", str(d), "--step", "1"]) == 2
    assert "step 1 of" in capsys.readouterr().err
    assert main(["verify", str(d)]) == 0
    out = capsys.readouterr().out
    assert out.count("removed while it was being read") == 1 and "step 2: removed" in out


def test_a_listing_beside_a_max_to_keep_1_writer_is_never_empty(tmp_path, capsys, monkeypatch):
    """Beside a writer with max_to_keep=1 the directory always holds a step, yet a
    listing could find none: it named step 1 only, and by the time step 1 was examined
    the writer had committed step 2 and removed step 1. verify() then raised "no
    checkpoint in ... (is it the run's own directory?)", the command exited 2, and
    latest_step() was None (a script checking it re-initialises): 1 verify in ~2,600
    in a loop beside such a writer. The writer moves on at exactly that instant here,
    once per call: every reader lists again and finds the new step."""
    import threading

    from jax_cb_ckpt._cli._main import main
    from jax_cb_ckpt._storage import _local

    d = tmp_path / "run"
    reader = threading.current_thread()
    examine = _local.Local._examine
    with jax_cb_ckpt.Checkpointer(d, max_to_keep=1) as ckpt:
        ckpt.save({"w": np.full(8, 1.0, np.float32)}, 1)
        ckpt.wait()
        step, moves = [1], [0]

        def examined_as_the_writer_moves_on(self, examined):
            if threading.current_thread() is reader and moves[0] and examined == step[0]:
                moves[0] -= 1  # the listing named the old step only; the next comes, it goes
                step[0] += 1
                ckpt.save({"w": np.full(8, float(step[0]), np.float32)}, step[0])
                ckpt.wait()
            return examine(self, examined)

        def once(read):
            moves[0] = 1
            result = read()
            assert moves[0] == 0  # (the writer did move on while it was listed)
            return result

        monkeypatch.setattr(_local.Local, "_examine", examined_as_the_writer_moves_on)
        assert once(lambda: jax_cb_ckpt.latest_step(d)) == 2
        assert once(lambda: jax_cb_ckpt.all_steps(d)) == [3]
        assert once(lambda: jax_cb_ckpt.verify(d)) == [4]
        capsys.readouterr()
        assert once(lambda: main(["verify", str(d)])) == 0, capsys.readouterr()
        assert "step 5: ok" in capsys.readouterr().out
