"""The storage object's verbs (`_local.Local`, `_bucket.Bucket`) as the writer calls
them, without a Checkpointer or JAX: a step written with the verbs alone (and
`_store.StoreWriter` for its arrays) is one that the public readers list, verify and
restore; and each verb's refusal, the rules a new kind of storage must keep too. The
bucket runs against the local S3 and GCS servers of conftest.py."""

import os
import uuid

import numpy as np
import pytest

import jax_cb_ckpt
from jax_cb_ckpt._layout import _format
from jax_cb_ckpt._layout._policy import AnyOf
from jax_cb_ckpt._layout._spec import ARRAY, LeafSpec
from jax_cb_ckpt._read._steps import all_steps, verify
from jax_cb_ckpt._storage import _places
from jax_cb_ckpt._write import _store
from jax_cb_ckpt._write._retention import Retention

W = np.arange(3 * 2**20, dtype=np.float32).reshape(3, -1)  # 12 MiB: one chunk
B = np.full(5, 7, np.int64)


def _tree():
    return {"w": W, "b": B}


def _write_step(storage, step, token, *, tree=None):
    """One step, in the writer's order of verbs (`_writer._write_as_primary`, one
    process): its place, its arrays, its descriptions, the fence, the commit."""
    tree = _tree() if tree is None else tree
    temp = storage.temp_path(step, _format.temp_name(step))
    with storage.step_sync() as sync:
        storage.begin(temp, token)
        store = _store.StoreWriter(compression=False, kvstore_spec=storage.kvstore_spec)
        flat = {(name,): value for name, value in tree.items()}
        finish = store.write(os.path.join(temp, _format.STATE_ITEM), flat, index=0, zarrays=True)
        sums, _ = finish(None)
        text = _store.state_metadata(tuple(flat))
        storage.write_file(
            os.path.join(temp, _format.STATE_ITEM, _format.STATE_METADATA), text.encode()
        )
        leaves = [
            LeafSpec(repr(name), (name,), ARRAY, str(v.dtype), v.shape).to_json()
            for name, v in tree.items()
        ]
        meta = _format.meta_record(step, leaves, {}, shardings={}, batch_shape=(), members=[])
        storage.write_meta(temp, dict(meta, checksums=sums))
        storage.fence(str(step), token, lambda: None)
        storage.commit(temp, storage.step_path(step), sum(v.nbytes for v in tree.values()), sync)
    return temp


def test_a_step_written_with_the_verbs_alone_is_listed_verified_and_restored(where):
    storage = _places.at(where)
    token = uuid.uuid4().hex
    _write_step(storage, 3, token)
    assert storage.list_steps() == [3] and all_steps(where) == [3]
    assert verify(where, step=3) == [3]
    like = {"w": np.zeros_like(W), "b": np.zeros_like(B)}
    restored = jax_cb_ckpt.restore(where, like, step=3)
    np.testing.assert_array_equal(restored["w"], W)
    np.testing.assert_array_equal(restored["b"], B)


def test_a_step_is_listed_only_once_committed(where):
    """Everything but the commit: not a step any reader lists (locally a temporary
    name; in a bucket no commit marker)."""
    storage = _places.at(where)
    token = uuid.uuid4().hex
    temp = storage.temp_path(4, _format.temp_name(4))
    storage.begin(temp, token)
    storage.write_meta(
        temp, _format.meta_record(4, [], {}, shardings={}, batch_shape=(), members=[])
    )
    assert storage.list_steps() == [] and all_steps(where) == []
    assert storage.clean_failed(os.path.basename(temp), token, OSError("disk")) in (None, "4")


def test_retention_keeps_the_newest_and_sets_the_rest_aside(where):
    storage = _places.at(where)
    token = uuid.uuid4().hex
    small = {"b": B}
    for step in (1, 2, 3, 4):
        _write_step(storage, step, token, tree=small)
    retention = Retention(AnyOf.short({"max_to_keep": 2}), storage, note=lambda *args: None)
    aside = retention.committed(4, {})  # the first commit: every step examined
    assert storage.list_steps() == [3, 4]
    for name in aside:
        storage.remove_aside(name)
    assert storage.list_steps() == [3, 4] and all_steps(where) == [3, 4]


# -- a directory's refusals


def test_local_a_step_place_and_a_file_are_never_made_twice_or_through_a_link(tmp_path):
    storage = _places.at(str(tmp_path))
    temp = storage.temp_path(1, _format.temp_name(1))
    assert os.path.dirname(temp) == str(tmp_path) and temp != storage.step_path(1)
    storage.begin(temp)
    assert os.path.isdir(os.path.join(temp, _format.STATE_ITEM))
    assert os.path.isdir(os.path.join(temp, _format.META_ITEM))
    with pytest.raises(FileExistsError):
        storage.begin(temp)  # a temporary name is unique: one already there is refused
    storage.create_file("f", b"1")
    with pytest.raises(FileExistsError):
        storage.create_file("f", b"2")
    (tmp_path / "target").write_text("keep")
    os.symlink(tmp_path / "target", tmp_path / "link")
    with pytest.raises(OSError):
        storage.create_file("link", b"through the link")
    storage.remove_file("link")  # a link is never removed (nor what it points to)
    assert (tmp_path / "target").read_text() == "keep" and os.path.islink(tmp_path / "link")


def test_local_a_failed_step_is_removed_at_once_and_a_replaced_directory_refused(tmp_path):
    path = tmp_path / "ckpt"
    path.mkdir()
    storage = _places.at(str(path))
    temp = storage.temp_path(2, _format.temp_name(2))
    storage.begin(temp)
    assert storage.clean_failed(os.path.basename(temp), "", OSError("disk full")) is None
    assert not os.path.exists(temp)  # (a full disk is freed at once)
    lock = storage.lock(".jax_cb_ckpt.lock-test")
    identity = storage.identity()
    storage.check_directory(identity, lock)
    os.rename(path, tmp_path / "moved")
    path.mkdir()  # a new directory where the old one was
    with pytest.raises(FileNotFoundError, match="was replaced while the run was saving"):
        storage.check_directory(identity, lock)
    lock.release()


def test_local_arrays_are_written_with_the_file_store_without_locking(tmp_path):
    spec = _places.at(str(tmp_path)).kvstore_spec(str(tmp_path / "3" / "state"))
    assert spec["driver"] == "file" and spec["path"].endswith("/3/state/")
    assert spec["file_io_locking"] == {"mode": "non_atomic"}


# -- a bucket's refusals: conditional writes, the fence, no temporary names


# The GCS emulators ignore ifGenerationMatch=0 (tests/storage_servers.py: a second
# create-if-absent succeeds there; real GCS refuses it), so the refusals of a
# create-if-absent are checked on S3 (moto honours If-None-Match); on gs, the rest.
@pytest.mark.parametrize("where", ["s3"], indirect=True)
def test_bucket_a_step_is_begun_written_and_committed_once(where):
    storage = _places.at(where)
    assert storage.temp_path(5, "ignored") == storage.step_path(5)  # no rename there
    token = uuid.uuid4().hex
    temp = storage.temp_path(5, "")
    storage.begin(temp, token)
    assert storage.steps._step_writer("5") == token
    with pytest.raises(FileExistsError, match="begun by another writer"):
        storage.begin(temp, uuid.uuid4().hex)
    storage.write_file(f"{temp}/x", b"1")
    with pytest.raises(FileExistsError, match="written by another writer"):
        storage.write_file(f"{temp}/x", b"2")  # created only if absent
    with pytest.raises(FileExistsError, match="no longer the one this writer began"):
        storage.fence("5", uuid.uuid4().hex, lambda: None)


@pytest.mark.parametrize("where", ["gs", "s3"], indirect=True)
def test_bucket_the_fence_checks_the_lock_and_the_step_writer(where):
    storage = _places.at(where)
    token = uuid.uuid4().hex
    storage.begin(storage.temp_path(8, ""), token)
    checked = []
    storage.fence("8", token, lambda: checked.append(True))
    assert checked == [True]  # the lock is checked at every fence
    with pytest.raises(FileExistsError, match="no longer the one this writer began"):
        storage.fence("8", uuid.uuid4().hex, lambda: None)  # taken over meanwhile


@pytest.mark.parametrize("where", ["gs", "s3"], indirect=True)
def test_bucket_a_failed_step_is_removed_later_unless_the_storage_is_out_of_reach(where):
    storage = _places.at(where)
    token = uuid.uuid4().hex
    storage.begin(storage.temp_path(6, ""), token)
    later = storage.clean_failed("6", token, OSError("a leaf's write failed"))
    assert later == "6" and storage.exists("6")  # removed after the failure is reported
    storage.remove_temp(later, token)
    assert not storage.exists("6")
    gone = storage.clean_failed("6", token, OSError("CURL error 7: connection refused"))
    assert gone is None  # the next opening removes it, not a wait on a dead server


@pytest.mark.parametrize("where", ["s3"], indirect=True)
def test_bucket_a_committed_step_is_never_committed_again(where):
    storage = _places.at(where)
    token = uuid.uuid4().hex
    _write_step(storage, 7, token, tree={"b": B})
    with pytest.raises(FileExistsError, match="committed by another writer"):
        storage.commit(storage.step_path(7), storage.step_path(7), 0, storage.step_sync())
    storage.remove_temp("7", token)  # a committed step is not a failed one: kept
    assert storage.list_steps() == [7]
