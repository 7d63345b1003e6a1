"""What a checkpoint directory holds is input (issue 28, part 2): a damaged, renamed or
foreign step folder is reported, never restored as another step and never silently
skipped; nothing in one folder stops the others; nothing is read or allocated beyond
what the step's own files justify. Each test was seen failing on the code before it."""

import json
import os
import subprocess
import sys
import threading
import warnings
from pathlib import Path

import numpy as np
import pytest
from helpers import assert_same_state, run_child, state_at

import jax_cb_ckpt
from jax_cb_ckpt import DamagedStepWarning, RestoreError

SCRIPT = Path(sys.executable).with_name("jax-cb-ckpt")


def _saved(directory, steps=(4, 8)):
    with jax_cb_ckpt.Checkpointer(directory) as ckpt:
        for step in steps:
            ckpt.save(state_at(step), step)


def test_a_damaged_newest_step_is_reported_not_silently_skipped(tmp_path):
    """(a) A partial copy of the newest step's meta: listing and restore name it (a
    DamagedStepWarning) instead of going back to step 4 in silence; the CLI lists it
    as damaged and `verify` exits 1. Nothing is deleted."""
    d = tmp_path / "ckpt"
    _saved(d)
    meta = d / "8" / "meta" / "metadata"
    text = meta.read_bytes()
    meta.write_bytes(text[: len(text) // 2])
    for call in (
        lambda: jax_cb_ckpt.all_steps(d),
        lambda: jax_cb_ckpt.latest_step(d),
        lambda: jax_cb_ckpt.restore(d, state_at(0)),
    ):
        with pytest.warns(DamagedStepWarning, match=r"step 8: 'meta/metadata' holds \d+ bytes"):
            call()
    with pytest.warns(DamagedStepWarning):
        assert jax_cb_ckpt.all_steps(d) == [4]
    with pytest.raises(RestoreError, match=r"step 8 .* is damaged"):
        jax_cb_ckpt.restore(d, state_at(0), step=8)
    ls = run_child([str(SCRIPT), "ls", str(d)], timeout=120)
    assert ls.returncode == 0, ls.stderr
    assert "damaged" in ls.stdout and " 8 " in ls.stdout, ls.stdout
    verify = run_child([str(SCRIPT), "verify", str(d)], timeout=120)
    assert verify.returncode == 1, verify.stdout + verify.stderr
    assert "step 8: DAMAGED" in verify.stdout
    assert meta.read_bytes() == text[: len(text) // 2]  # untouched


def test_a_step_damaged_after_a_listing_is_reported_by_the_next_one(tmp_path):
    """A listing remembers what it found of a step while its files are unchanged: Orbax's
    state/_METADATA deleted after a listing makes the step damaged at the next listing
    of the same process, as in a new one (it stayed listed, and plain Orbax cannot
    read the step without it)."""
    d = tmp_path / "ckpt"
    _saved(d)
    assert jax_cb_ckpt.all_steps(d) == [4, 8]
    (d / "8" / "state" / "_METADATA").unlink()
    with pytest.warns(DamagedStepWarning, match=r"step 8: 'state/_METADATA' is missing"):
        assert jax_cb_ckpt.all_steps(d) == [4]


def test_a_step_missing_its_data_file_is_reported_with_a_fix(tmp_path):
    """A data file of the step's database deleted: restore and verify say the step was
    damaged and what to do (it was TensorStore's NOT_FOUND alone)."""
    d = tmp_path / "ckpt"
    _saved(d)
    for data in (d / "8" / "state" / "d").iterdir():
        data.unlink()
    for call in (
        lambda: jax_cb_ckpt.restore(d, state_at(0), step=8),
        lambda: jax_cb_ckpt.verify(d, step=8),
    ):
        with pytest.raises(RestoreError, match=r"step=8.*removed after it was written.*Fix:"):
            call()
    assert_same_state(jax_cb_ckpt.restore(d, state_at(0), step=4), state_at(4))


def test_a_renamed_step_is_not_restored_as_another_step(tmp_path):
    """(b) Folder 4 renamed to 12: not listed, and restore(step=12) refuses naming the
    step it holds, where it returned step 4's state."""
    d = tmp_path / "ckpt"
    _saved(d)
    os.rename(d / "4", d / "12")
    with pytest.warns(
        DamagedStepWarning, match=r"step 12: the folder is named 12 but holds step 4"
    ):
        assert jax_cb_ckpt.all_steps(d) == [8]
    with pytest.raises(RestoreError, match=r"named 12 but holds step 4"):
        jax_cb_ckpt.restore(d, state_at(0), step=12)


def test_a_foreign_folder_of_nested_brackets_stops_nothing(tmp_path):
    """(f) A folder 7/ whose meta is 400 KB of '[': listing, restore, opening a
    Checkpointer and `ls` go on (they raised RecursionError / "could not open")."""
    d = tmp_path / "ckpt"
    _saved(d)
    (d / "7" / "meta").mkdir(parents=True)
    (d / "7" / "meta" / "metadata").write_text("[" * 400_000)
    with pytest.warns(DamagedStepWarning, match=r"step 7: "):
        assert jax_cb_ckpt.all_steps(d) == [4, 8]
    with pytest.warns(DamagedStepWarning):
        restored = jax_cb_ckpt.restore(d, state_at(0))
    assert jax_cb_ckpt.same_bits(restored, state_at(8))
    with jax_cb_ckpt.Checkpointer(d) as ckpt:
        ckpt.save(state_at(9), 9)
    assert (d / "7" / "meta" / "metadata").stat().st_size == 400_000
    ls = run_child([str(SCRIPT), "ls", str(d)], timeout=120)
    assert ls.returncode == 0 and "Traceback" not in ls.stderr, ls.stderr


def test_a_sparse_huge_meta_is_not_read_at_listing(tmp_path):
    """(e) A foreign folder with a sparse 512 MiB meta file cost +640 MiB at every
    listing and opening: now it is refused by its size, unread."""
    d = tmp_path / "ckpt"
    _saved(d, steps=(4,))
    (d / "5" / "meta").mkdir(parents=True)
    with open(d / "5" / "meta" / "metadata", "wb") as f:
        f.write(b'{"format": "jax_cb_ckpt/1", "leaves": [')
        f.truncate(512 << 20)
    code = (
        "import resource, warnings, jax_cb_ckpt\n"
        "warnings.simplefilter('ignore')\n"
        "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        f"assert jax_cb_ckpt.all_steps({str(d)!r}) == [4]\n"
        f"jax_cb_ckpt.Checkpointer({str(d)!r}).close()\n"
        "print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)\n"
    )
    child = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert child.returncode == 0, child.stderr
    assert int(child.stdout.split()[-1]) < 64, child.stdout  # MiB of peak growth


@pytest.mark.parametrize("flip", [('"0:', '"0;'), ('"leaves"', '"leavez"')])
def test_a_flipped_region_key_is_a_restore_error(tmp_path, flip):
    """(g) A bit flip in a checksum's region key ("0:3" to "0;3") escaped restore() and
    verify() as a bare ValueError. Rewritten consistently (the record in the step file
    matching it), so that the description's own checks are what catch it."""
    from jax_cb_ckpt._storage import _places

    d = tmp_path / "ckpt"
    _saved(d, steps=(4,))
    meta = json.loads((d / "4" / "meta" / "metadata").read_text())
    text = json.dumps(meta).replace(*flip, 1)
    _places.at(str(d)).write_meta(str(d / "4"), json.loads(text))
    for call in (
        lambda: jax_cb_ckpt.restore(d, state_at(0), step=4),
        lambda: jax_cb_ckpt.verify(d, step=4),
    ):
        with pytest.raises(RestoreError, match=r"item is invalid|is damaged"):
            call()


def test_verify_of_a_directory_without_checkpoints_fails(tmp_path):
    """(i) `verify DIR && deploy` on a wrong path (the run's parent) exited 0."""
    (tmp_path / "ckpt").mkdir()
    run = run_child([str(SCRIPT), "verify", str(tmp_path / "ckpt")], timeout=120)
    assert run.returncode == 2, run.stdout
    assert "no checkpoints" in run.stderr
    # ls on someone else's step-numbered folders says what is there
    (tmp_path / "ckpt" / "3").mkdir()
    ls = run_child([str(SCRIPT), "ls", str(tmp_path / "ckpt")], timeout=120)
    assert "3" in ls.stdout and "not a jax_cb_ckpt checkpoint" in ls.stdout, ls.stdout


def test_the_cli_escapes_what_it_prints(tmp_path):
    """(h) A leaf name with a lone surrogate crashed `show` (UnicodeEncodeError) and
    terminal escape codes reached the terminal."""
    d = tmp_path / "ckpt"
    with jax_cb_ckpt.Checkpointer(d) as ckpt:
        ckpt.save({"a\x1b[31mred": np.ones(3, np.float32)}, 1)
    from jax_cb_ckpt._storage import _places

    meta = json.loads((d / "1" / "meta" / "metadata").read_text())
    meta["leaves"][0]["path"] = "['\udcff\x1b]0;owned\x07']"
    _places.at(str(d)).write_meta(str(d / "1"), meta)
    for command in ("show", "verify", "ls"):
        run = run_child([str(SCRIPT), command, str(d)], timeout=120)
        assert "Traceback" not in run.stderr, run.stderr
        assert "\x1b" not in run.stdout + run.stderr, (command, run.stdout)
    show = run_child([str(SCRIPT), "show", str(d)], timeout=120)
    assert show.returncode == 0 and "\\x1b" in show.stdout, show.stdout


def _rewrite_zarray(step_dir, name, change):
    """Edit a leaf's `.zarray` inside the state item's OCDBT database, as a tool that
    knows the format would."""
    import tensorstore as ts

    kv = ts.KvStore.open(
        {"driver": "ocdbt", "base": {"driver": "file", "path": f"{step_dir}/state/"}}
    ).result()
    zarray = json.loads(kv.read(f"{name}/.zarray").result().value)
    change(zarray)
    kv.write(f"{name}/.zarray", json.dumps(zarray)).result()


def _big_state():
    return {
        "big": np.arange(1 << 18, dtype=np.float32),  # above SMALL_BYTES: the zarr driver
        "small": np.arange(4, dtype=np.float32),
    }


@pytest.mark.parametrize("leaf", ["big", "small"])
@pytest.mark.parametrize(
    "change, words",
    [
        (lambda z: z.update(dtype="<i4"), r"has dtype int32, where the description gives"),
        (lambda z: z.update(shape=[1 << 28], chunks=[1 << 28]), r"has shape \[268435456\]"),
        (lambda z: z.update(shape=[1 << 40], chunks=[1 << 40]), r"has shape \[1099511627776\]"),
    ],
)
def test_a_stored_layout_unlike_the_description_is_refused_unread(tmp_path, leaf, change, words):
    """(d, e) A `.zarray` whose dtype became another of the same size passed verify; one
    claiming 1 GiB cost +1 GiB peak, one claiming 4 TiB aborted the CLI (bad_alloc)."""
    d = tmp_path / "ckpt"
    with jax_cb_ckpt.Checkpointer(d) as ckpt:
        ckpt.save(_big_state(), 1)
    _rewrite_zarray(d / "1", leaf, change)
    with pytest.raises(RestoreError, match=words):
        jax_cb_ckpt.verify(d)
    run = run_child([str(SCRIPT), "verify", str(d)], timeout=120)
    assert run.returncode == 1, run.stdout + run.stderr
    assert "FAILED" in run.stdout and leaf in run.stdout, run.stdout
    with pytest.raises(RestoreError):
        jax_cb_ckpt.restore(d, _big_state())


def test_verify_reads_every_byte_of_a_step_without_checksums(tmp_path):
    """(c) A step without checksums (an older version's) whose data file is cut in half
    passed verify unread ("readable", exit 0)."""
    from jax_cb_ckpt._storage import _places

    d = tmp_path / "ckpt"
    with jax_cb_ckpt.Checkpointer(d) as ckpt:
        ckpt.save(_big_state(), 1)
        ckpt.save(_big_state(), 2)
    for step in (1, 2):
        meta = json.loads((d / str(step) / "meta" / "metadata").read_text())
        del meta["checksums"]
        _places.at(str(d)).write_meta(str(d / str(step)), meta)
    run = run_child([str(SCRIPT), "verify", str(d)], timeout=120)
    assert run.returncode == 3, run.stdout + run.stderr  # readable, not verifiable
    assert "step 1: readable, NOT verified" in run.stdout
    data = max((d / "1" / "state" / "d").iterdir(), key=lambda p: p.stat().st_size)
    os.truncate(data, data.stat().st_size // 2)
    # The cut takes the step's index with it when TensorStore wrote the index after the
    # values in that file (it is then read first, `_ocdbt`, before any leaf); else the
    # leaf's own bytes are found short. Either way: a cut file, no numbers.
    cut = r"cannot read (the checkpoint's arrays|leaf state\['big'\]).*cut"
    with pytest.raises(RestoreError, match=cut):
        jax_cb_ckpt.verify(d, step=1)
    with pytest.raises(RestoreError, match=cut):
        jax_cb_ckpt.restore(d, _big_state(), step=1)
    run = run_child([str(SCRIPT), "verify", str(d)], timeout=120)
    assert run.returncode == 1, run.stdout + run.stderr
    assert "step 1: FAILED" in run.stdout and "step 2: readable, NOT verified" in run.stdout


def test_a_step_set_aside_while_listed_is_never_reported_damaged(tmp_path):
    """Retention renames a step aside while another process lists the directory: the
    step is there (complete) or not, never "damaged" because its files vanished under
    the examination (a resumed run's `latest_step` warned of a damaged step in CI)."""
    directory = tmp_path / "ckpt"
    with jax_cb_ckpt.Checkpointer(directory) as ckpt:
        for step in (1, 2):
            ckpt.save(state_at(step), step)
    step_dir, aside = directory / "2", directory / "2.jax_cb_ckpt-deleting-0"
    stop = threading.Event()

    def rename_back_and_forth():
        while not stop.is_set():
            os.rename(step_dir, aside)
            os.rename(aside, step_dir)

    mover = threading.Thread(target=rename_back_and_forth)
    mover.start()
    try:
        seen = set()
        with warnings.catch_warnings():
            warnings.simplefilter("error", DamagedStepWarning)
            for _ in range(3000):
                seen.add(tuple(jax_cb_ckpt.all_steps(directory)))
    finally:
        stop.set()
        mover.join()
    assert seen <= {(1,), (1, 2)}, seen
