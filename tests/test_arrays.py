"""The read path's own contract (`_read.StepArrays`), on steps the writer wrote: a box
of a leaf is read with the whole checksummed regions meeting it, and every one of them
is checked; the same request is read once; small leaves are read as raw chunk bytes,
whose number and size are checked against the stored layout; a restore returns the
arrays it read without copying them again."""

import os

import numpy as np
import pytest
import tensorstore as ts

import jax_cb_ckpt
from jax_cb_ckpt._layout import _format
from jax_cb_ckpt._read import _arrays as _read
from jax_cb_ckpt._storage import _places
from jax_cb_ckpt._write import _store


def _saved(directory, state, step=1):
    with jax_cb_ckpt.Checkpointer(directory) as ckpt:
        ckpt.save(state, step)
    step_dir = os.path.join(directory, str(step))
    meta = _format.StepMeta.parse(_places.at(str(directory)).open_step(step).meta)
    return step_dir, meta


def _arrays(step_dir, meta):
    storage = _places.at(os.path.dirname(step_dir))
    opened = storage.open_step(int(os.path.basename(step_dir)))
    arrays = _read.StepArrays(storage, opened, meta.leaves)
    arrays.check_layouts()
    return arrays


def _leaf(meta, name):
    return next(s for s in meta.leaves if s.name == (name,))


def _database(step_dir):
    """The step's state item as a writable key-value store (to damage it)."""
    state = os.path.join(step_dir, "state")
    spec = _store.ocdbt_spec(_places.at(os.path.dirname(step_dir)).kvstore_spec(state))
    return ts.KvStore.open(spec, context=ts.Context({"cache_pool#ocdbt": {}})).result()


BIG = np.arange(24 * 2**20 // 4, dtype=np.float32).reshape(24, -1)  # 2 chunks (16 MiB)


def test_a_box_is_read_with_its_whole_regions_and_checked(tmp_path):
    step_dir, meta = _saved(tmp_path / "ckpt", {"big": BIG})
    big = _leaf(meta, "big")
    regions = sorted(meta.checksums["big"])
    assert len(regions) == 2, regions  # two chunks, one checksum each
    arrays = _arrays(step_dir, meta)
    box = ((15, 17), (0, BIG.shape[1]))  # rows 15-16: across the chunks' boundary
    (part,) = arrays.read([(big, box)], meta.checksums)
    assert np.array_equal(part, BIG[15:17]) and part.flags.owndata
    # A flipped byte in the second chunk (rows 16-23), outside the box but inside a
    # region it meets, fails the read: a region is checked whole or not returned.
    db = _database(step_dir)
    chunk = bytearray(db.read("big/1.0").result().value)
    chunk[4 * BIG.shape[1] * 4] ^= 1  # row 20
    db.write("big/1.0", bytes(chunk)).result()
    with pytest.raises(_read.ChecksumMismatch) as info:
        _arrays(step_dir, meta).read([(big, box)], meta.checksums)
    assert info.value.leaf == big and info.value.region in regions
    # Without checksums the box alone is what is returned.
    (part,) = _arrays(step_dir, meta).read([(big, ((0, 2), (0, BIG.shape[1])))], None)
    assert np.array_equal(part, BIG[:2])


def test_the_same_request_is_read_once(tmp_path):
    step_dir, meta = _saved(tmp_path / "ckpt", {"big": BIG})
    big = _leaf(meta, "big")
    first, second, whole = _arrays(step_dir, meta).read(
        [(big, ((0, 8), (0, BIG.shape[1]))), (big, ((0, 8), (0, BIG.shape[1]))), (big, None)],
        meta.checksums,
    )
    assert first is second and np.array_equal(whole, BIG)


def test_small_leaves_are_raw_chunks_checked_for_count_and_size(tmp_path):
    state = {"a": np.arange(10, dtype=np.int32), "s": np.float32(2.5)}
    step_dir, meta = _saved(tmp_path / "ckpt", state)
    arrays = _arrays(step_dir, meta)
    assert arrays.layouts[("a",)].raw and arrays.layouts[("s",)].raw
    a, s = arrays.read([(_leaf(meta, "a"), None), (_leaf(meta, "s"), None)], meta.checksums)
    assert np.array_equal(a, state["a"]) and s == state["s"] and s.shape == ()
    db = _database(step_dir)
    db.write("a/0", np.arange(9, dtype=np.int32).tobytes()).result()  # one element short
    with pytest.raises(_read.LeafReadError, match=r"holds 36 bytes where its layout gives 40"):
        _arrays(step_dir, meta).read([(_leaf(meta, "a"), None)], None)
    db.write("a/0", None).result()  # gone
    with pytest.raises(_read.LeafReadError, match=r"chunk 'a/0' is missing"):
        _arrays(step_dir, meta).read([(_leaf(meta, "a"), None)], None)
    # restore says which leaf, in which step, and never returns numbers for it
    missing = r"cannot read leaf state\['a'\]: its chunk 'a/0' is missing"
    with pytest.raises(jax_cb_ckpt.RestoreError, match=missing):
        jax_cb_ckpt.restore(tmp_path / "ckpt", state, verify=False)


def test_restored_numpy_leaves_are_the_callers_to_write(tmp_path):
    """A numpy `like` gets the arrays the read allocated (no second copy of a leaf),
    never a read-only view of a chunk's bytes."""
    state = {"big": BIG, "small": np.arange(5.0)}
    _saved(tmp_path / "ckpt", state)
    restored = jax_cb_ckpt.restore(
        tmp_path / "ckpt", {k: np.zeros_like(v) for k, v in state.items()}
    )
    assert jax_cb_ckpt.same_bits(restored, state)
    for value in restored.values():
        assert value.flags.writeable and value.flags.c_contiguous
        value += 1  # the caller's to change
