"""The arrays' writer (`_store.StoreWriter`) on its own: what it writes is what
TensorStore (and so Orbax) reads back, its checksums are the CRC-32 of each region's
bytes, `meanwhile` runs while the transaction commits, and two processes' parts merge
into one database. No Checkpointer, no JAX program."""

import os
import zlib

import numpy as np
import pytest
import tensorstore as ts

from jax_cb_ckpt._handoff._shards import Layout, ShardedArray
from jax_cb_ckpt._storage import _places
from jax_cb_ckpt._write import _store

BIG = np.arange(40 * 2**20 // 4, dtype=np.float32).reshape(40, -1)  # 40 MiB: 3 chunks
SMALL = np.arange(6, dtype=np.int16).reshape(2, 3)


def _writer(directory, compression=False):
    return _store.StoreWriter(
        compression=compression, kvstore_spec=_places.at(directory).kvstore_spec
    )


def _read(state_dir, name):
    """A leaf read back through TensorStore's zarr driver over the OCDBT database, as
    Orbax opens it."""
    spec = {
        "driver": "zarr",
        "kvstore": {
            "driver": "ocdbt",
            "base": {"driver": "file", "path": state_dir + "/"},
            "path": name + "/",
        },
    }
    return ts.open(spec, open=True).result().read().result()


def _crc(array):
    return zlib.crc32(np.ascontiguousarray(array).tobytes())


@pytest.mark.parametrize("compression", [False, True])
def test_leaves_read_back_exactly_with_a_checksum_per_region(tmp_path, compression):
    state = str(tmp_path / "state")
    os.makedirs(state)
    writer = _writer(str(tmp_path), compression)
    finish = writer.write(state, {("big",): BIG, ("a", "small"): SMALL}, index=0, zarrays=True)
    seen = []
    sums, seconds = finish(lambda s: seen.append({k: dict(v) for k, v in s.items()}))
    assert seen == [sums] and seconds >= 0  # meanwhile saw every checksum
    np.testing.assert_array_equal(_read(state, "big"), BIG)
    np.testing.assert_array_equal(_read(state, "a.small"), SMALL)
    assert sums["a.small"] == {"0:2,0:3": _crc(SMALL)}
    assert len(sums["big"]) == 3  # one per chunk of at most 16 MiB
    for key, crc in sums["big"].items():
        rows = slice(*map(int, key.split(",")[0].split(":")))
        assert crc == _crc(BIG[rows])


def test_two_processes_parts_merge_into_one_database(tmp_path):
    """Process 1 writes its blocks into its own database; process 0 merges its index
    (the data stays in process 1's files), as Orbax's finalize does."""
    state = str(tmp_path / "state")
    os.makedirs(state)
    top, bottom = BIG[:20], BIG[20:]
    rows = Layout(("x",), (2,), ((("x",), ()),))  # leaf 0's rows split over 2 devices

    def half(region, block):  # the one type of a leaf as blocks, as the writer hands it
        return {("w",): ShardedArray(BIG.shape, BIG.dtype, rows, 0, {region: block})}

    p0 = _writer(str(tmp_path)).write(
        state, half(((0, 20), (0, BIG.shape[1])), top), index=0, zarrays=True
    )
    p1 = _writer(str(tmp_path)).write(
        state, half(((20, 40), (0, BIG.shape[1])), bottom), index=1, zarrays=False
    )
    sums0, _ = p0(None)
    sums1, _ = p1(None)
    assert set(sums0["w"]) | set(sums1["w"]) == {
        f"0:20,0:{BIG.shape[1]}",
        f"20:40,0:{BIG.shape[1]}",
    }
    _writer(str(tmp_path)).merge(state, 2)
    np.testing.assert_array_equal(_read(state, "w"), BIG)


def test_a_failed_write_is_raised_by_finish_not_lost(tmp_path):
    """A database that cannot be written (its folder is a file): the failure reaches
    the caller, naming the file it could not write."""
    state = tmp_path / "state"
    state.write_text("a file where the database goes")
    with pytest.raises(ValueError, match="Not a directory"):
        finish = _writer(str(tmp_path)).write(str(state), {("s",): SMALL}, index=0, zarrays=True)
        finish(None)
