"""How a step's files are made durable before its rename (`_durable.py`): one syncfs of
the file system where that is known to write everything and cost less, an fsync of
each file and directory otherwise. Real files, the real kernel; no power cut here (the
crash tests kill writers at random points, test_crash.py)."""

import os
import sys

import pytest

from jax_cb_ckpt._storage import _durable


def _mounted_type(path: str) -> str | None:
    """The file system type of `path` by another route: the longest mount point of
    /proc/mounts that holds it."""
    real = os.path.realpath(path)
    best, kind = "", None
    with open("/proc/mounts") as f:
        for line in f:
            _, point, fstype = line.split()[:3]
            point = point.replace("\\040", " ")
            inside = real == point or real.startswith(point.rstrip("/") + "/")
            if inside and len(point) >= len(best):
                best, kind = point, fstype
    return kind


linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux /proc")


@linux
def test_the_file_system_type_is_read_off_the_device_number(tmp_path):
    assert _durable.fs_type(os.stat(tmp_path).st_dev) == _mounted_type(str(tmp_path))
    assert _durable.fs_type(os.makedev(4095, 4095)) is None  # no such mount


@linux
def test_syncfs_is_taken_only_when_little_else_is_unwritten(tmp_path):
    """32 MiB written and not synced elsewhere: a small step does not syncfs (it would
    wait for those bytes too); a step whose own bytes they are does; once synced, they
    are no longer counted."""
    if _durable._SYNCFS is None or _mounted_type(str(tmp_path)) not in _durable.SYNCFS_TYPES:
        pytest.skip("syncfs is not used on this kernel or file system")
    other = tmp_path / "other.bin"
    step = tmp_path / "step"
    step.mkdir()
    with open(other, "wb") as f:
        f.write(os.urandom(32 << 20))
    unwritten = _durable.unwritten_bytes()
    assert unwritten >= 30 << 20
    assert not _durable.syncfs_fits(str(step), 4 << 10)
    assert _durable.syncfs_fits(str(step), unwritten)  # all of it the step's own
    with _durable.StepSync(str(tmp_path)) as sync:
        sync.tree(str(step), unwritten)
    assert _durable.unwritten_bytes() < 30 << 20  # our 32 MiB are on disk


def test_each_step_takes_the_way_that_fits_and_is_synced(tmp_path, monkeypatch):
    """syncfs where it fits (here: the step's bytes are all that is unwritten), the
    per-file fsyncs where the checkpoint directory could not be opened or the file
    system is not one whose syncfs is trusted."""
    step = tmp_path / "7.tmp"
    (step / "state" / "d").mkdir(parents=True)
    taken = []
    for name in ("syncfs", "fsync_tree"):
        through = getattr(_durable, name)
        monkeypatch.setattr(
            _durable, name, lambda *a, _n=name, _f=through: (taken.append(_n), _f(*a))[1]
        )

    def one_step(directory):
        for name in ("state/d/data", "state/manifest.ocdbt", "_CHECKPOINT_METADATA"):
            (step / name).write_bytes(os.urandom(1 << 20))
        with _durable.StepSync(str(directory)) as sync:
            sync.tree(str(step), _durable.unwritten_bytes())
        sync.close()  # twice: no error
        return taken.pop()

    trusted = _mounted_type(str(tmp_path)) in _durable.SYNCFS_TYPES
    expected = "syncfs" if _durable._SYNCFS is not None and trusted else "fsync_tree"
    assert one_step(tmp_path) == expected
    assert one_step(tmp_path / "gone") == "fsync_tree"  # nothing to open
    monkeypatch.setattr(_durable, "SYNCFS_TYPES", frozenset())  # an unknown file system
    assert one_step(tmp_path) == "fsync_tree"
    assert not _durable.syncfs_fits(str(tmp_path / "gone"), 0)
