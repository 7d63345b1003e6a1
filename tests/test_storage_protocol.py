"""The storage protocols' contract (`_storage/_protocol`: a `StepStore` and a
`ChunkStore`, asked through `Storage`), one set of tests run against every kind: a
local directory, a prefix on the local S3 and GCS servers (conftest.py), and a
throwaway kind written by following `_storage/README.md` ("How to add a storage":
`inplace_storage.py`). Each test says what a verb promises to every stage, whichever
kind it holds; a new kind of storage passes these or is not a storage. Then the
protocols' shape: each kind implements every verb with the protocol's signature and
nothing more in public, each protocol has at most 25 verbs, and no module outside
`_storage/` asks a storage anything else, names a kind, or imports `_remote`. (The
kinds' own refusals, conditional writes and links, are `test_storage_verbs.py`'s.)"""

import ast
import inspect
import os
import pathlib
import uuid

import numpy as np
import pytest
from inplace_storage import CopyingChunks, InPlace

from jax_cb_ckpt._base._errors import DirectoryLockedError
from jax_cb_ckpt._layout import _format, _ocdbt
from jax_cb_ckpt._layout._policy import AnyOf
from jax_cb_ckpt._layout._spec import ARRAY, LeafSpec
from jax_cb_ckpt._read import _arrays
from jax_cb_ckpt._storage import _places, _remote
from jax_cb_ckpt._storage._bucket import Bucket, BucketChunks
from jax_cb_ckpt._storage._local import Local, LocalChunks
from jax_cb_ckpt._storage._protocol import ChunkStore, OpenedStep, StepStore, Storage
from jax_cb_ckpt._write import _store
from jax_cb_ckpt._write._retention import Retention

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "jax_cb_ckpt"
W = np.arange(12, dtype=np.float32).reshape(3, 4)
THROWAWAY = "throwaway:"  # `where` of the kind added by following the README


@pytest.fixture(params=["local", "gs", "s3", "throwaway"])
def where(request, tmp_path, remote_on):
    """A location of each kind: a directory, a prefix on a local GCS or S3 server, or a
    directory of the throwaway kind (`inplace_storage.py`)."""
    if request.param in ("gs", "s3"):
        return remote_on(request.param).url
    path = str(tmp_path / "ckpt")
    os.makedirs(path)
    return THROWAWAY + path if request.param == "throwaway" else path


def _at(where: str) -> Storage:
    """The storage of `where`: `_places.at`'s, or the throwaway kind's."""
    if where.startswith(THROWAWAY):
        path = where[len(THROWAWAY) :]
        return Storage(InPlace(path), CopyingChunks(path))
    return _places.at(where)


def _begun(storage: Storage, step: int, token: str) -> tuple[str, _format.Sums]:
    """A step begun and its arrays written, not yet described nor committed: where,
    and its checksums."""
    temp = storage.temp_path(step, _format.temp_name(step))
    storage.begin(temp, token)
    store = _store.StoreWriter(compression=False, kvstore_spec=storage.kvstore_spec)
    finish = store.write(
        os.path.join(temp, _format.STATE_ITEM), {("w",): W + step}, index=0, zarrays=True
    )
    return temp, finish(None)[0]


def _committed(storage: Storage, step: int, token: str = "") -> str:
    """One step written in the writer's order of verbs (`_writer._write_as_primary`)."""
    token = token or uuid.uuid4().hex
    with storage.step_sync() as sync:
        temp, sums = _begun(storage, step, token)
        text = _store.state_metadata((("w",),))
        storage.write_file(
            os.path.join(temp, _format.STATE_ITEM, _format.STATE_METADATA), text.encode()
        )
        leaves = [LeafSpec("['w']", ("w",), ARRAY, "float32", W.shape).to_json()]
        meta = _format.meta_record(step, leaves, {}, shardings={}, batch_shape=(), members=[])
        storage.write_meta(temp, dict(meta, checksums=sums))
        storage.fence(str(step), token, lambda: None)
        storage.commit(temp, storage.step_path(step), W.nbytes, sync)
    return temp


def _put(storage: Storage, name: str, data: bytes) -> None:
    """A file `name` (a path under the directory) written behind the storage's back."""
    if isinstance(storage.steps, Bucket):
        _remote.write(f"{storage.path}/{name}", data)
    else:
        path = os.path.join(storage.path, name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        pathlib.Path(path).write_bytes(data)


def _delete(storage: Storage, name: str) -> None:
    if isinstance(storage.steps, Bucket):
        _remote.delete(f"{storage.path}/{name}")
    else:
        os.unlink(os.path.join(storage.path, name))


def _relative(storage: Storage, path: str) -> str:
    assert path.startswith(storage.path + "/"), (path, storage.path)
    return path[len(storage.path) + 1 :]


# -- listing and examining


def test_a_step_is_listed_only_once_committed(where):
    storage = _at(where)
    assert storage.list_steps() == [] and storage.examine_all() == {}
    token = uuid.uuid4().hex
    with storage.step_sync():
        temp, _ = _begun(storage, 3, token)
    assert storage.list_steps() == [] and not storage.is_checkpoint(3)
    assert [step for step, _ in storage.unfinished_steps()] == [3]
    storage.remove_temp(os.path.basename(temp), token)
    assert storage.unfinished_steps() == []
    _committed(storage, 3)
    assert storage.list_steps() == [3] and storage.is_checkpoint(3)
    assert storage.examine_all()[3].kind == "complete"
    assert storage.unfinished_steps() == [] and storage.exists("3")
    assert storage.foreign_steps() == [] and storage.damaged_steps() == {}


def test_examine_tells_complete_damaged_and_foreign_apart(where):
    storage = _at(where)
    for step in (1, 2):
        _committed(storage, step)
    _delete(storage, f"2/{_format.META_ITEM}/{_format.META_FILE}")  # damaged
    _put(storage, "7/notes.txt", b"someone else's")  # a step-named entry, not ours
    found = storage.examine_all()
    assert {s: f.kind for s, f in found.items()} == {1: "complete", 2: "damaged", 7: "foreign"}
    assert storage.list_steps() == [1]
    assert list(storage.damaged_steps()) == [2] and storage.foreign_steps() == [2, 7]
    assert not storage.is_checkpoint(2) and not storage.is_checkpoint(7)


def test_the_directory_s_own_facts(where):
    storage = _at(where)
    storage.make()  # (idempotent)
    assert storage.is_directory()
    identity = storage.identity()
    assert identity is None or identity == storage.identity()
    _committed(storage, 4)
    assert storage.step_path(4) == storage.step_path("4")
    assert _relative(storage, storage.step_path(4)) == "4"
    temp = storage.temp_path(5, _format.temp_name(5))
    # Written in place, or under a temporary name of the directory that is no step's.
    assert temp == storage.step_path(5) or not _format.is_step_name(_relative(storage, temp))
    size, when = storage.entry_bytes("4"), storage.entry_time("4")
    assert size is None or size > W.nbytes // 2
    assert when is None or when.endswith("+00:00")
    assert not storage.exists("5") and not storage.exists("nothing")


# -- reading one step


def test_open_step_returns_identity_and_meta_and_a_removed_step_is_no_longer_there(where):
    storage = _at(where)
    _committed(storage, 6)
    opened = storage.open_step(6)
    assert isinstance(opened, OpenedStep) and opened.step == 6
    meta = _format.StepMeta.parse(opened.meta)
    assert meta.step == 6 and [leaf.name for leaf in meta.leaves] == [("w",)]
    assert storage.still_there(6, opened.identity)
    assert storage.open_step(6).identity == opened.identity  # the same step
    assert storage.symlinks_inside(6) == []
    assert storage.remove_step(6) and not storage.remove_step(6)
    assert not storage.still_there(6, opened.identity)
    with pytest.raises(FileNotFoundError):
        storage.open_step(6)


def test_open_step_refuses_what_is_not_a_complete_step(where):
    storage = _at(where)
    with pytest.raises(FileNotFoundError):
        storage.open_step(1)  # nothing there
    _put(storage, "2/notes.txt", b"someone else's")
    with pytest.raises(FileNotFoundError):
        storage.open_step(2)
    _committed(storage, 3)
    _delete(storage, f"3/{_format.STATE_ITEM}/{_format.STATE_METADATA}")
    with pytest.raises(_format.DamagedStep):
        storage.open_step(3)
    token = uuid.uuid4().hex
    with storage.step_sync():
        _begun(storage, 4, token)  # begun, never committed
    with pytest.raises(FileNotFoundError):
        storage.open_step(4)


def test_open_steps_opens_each_and_returns_what_failed(where):
    storage = _at(where)
    for step in (1, 2, 3):
        _committed(storage, step)
    opened = storage.open_steps([3, 1, 9, 2])
    assert list(opened) == [3, 1, 9, 2]
    assert isinstance(opened[9], FileNotFoundError)
    for step in (1, 2, 3):
        got = opened[step]
        assert isinstance(got, OpenedStep) and got.step == step
        assert _format.StepMeta.parse(got.meta).step == step
    assert storage.open_steps([]) == {}


@pytest.mark.parametrize("light", [True, False], ids=["index", "database"])
def test_the_arrays_are_read_from_what_open_step_returned(where, light):
    """`index` and `database` take the opened step: nothing of an earlier call is
    remembered, so two steps opened in turn are read in any order."""
    storage = _at(where)
    for step in (1, 2):
        _committed(storage, step)
    first, second = storage.open_step(1), storage.open_step(2)
    for opened in (second, first):
        meta = _format.StepMeta.parse(opened.meta)
        arrays = _arrays.StepArrays(storage, opened, meta.leaves, light=light)
        arrays.check_layouts()
        (value,) = arrays.read([(meta.leaves[0], None)], meta.checksums)
        assert np.array_equal(value, W + opened.step)
    try:
        index = storage.index(first)
    except _ocdbt.Unsupported:  # (a kind may leave a step to TensorStore)
        return
    assert isinstance(index, _ocdbt.Database)


def test_step_file_reads_a_small_file_of_a_step_within_its_limit(where):
    storage = _at(where)
    _committed(storage, 2)
    name = f"{_format.META_ITEM}/{_format.META_FILE}"
    text = storage.step_file(2, name, _format.META_MAX_BYTES)
    assert text is not None and b'"step"' in text
    assert storage.step_file(2, "no-such-file", 100) is None
    assert storage.step_file(9, name, 100) is None
    with pytest.raises(_format.DamagedStep):
        storage.step_file(2, name, 4)


# -- writing, committing, the lock and the fences


def test_a_fence_checks_the_lock_and_passes_for_the_step_s_writer(where):
    storage = _at(where)
    token = uuid.uuid4().hex
    with storage.step_sync():
        _begun(storage, 8, token)
    checked = []
    storage.fence("8", token, lambda: checked.append(True))
    assert checked in ([], [True])  # (a local directory's lock is held throughout)

    def lost():
        raise FileNotFoundError("the lock is gone")

    if checked:
        with pytest.raises(FileNotFoundError, match="the lock is gone"):
            storage.fence("8", token, lost)


def test_the_lock_is_exclusive_until_released(where):
    storage = _at(where)
    name = _format.LOCK_NAME
    lock = storage.lock(name)
    try:
        assert lock.still_ours()
        storage.check_directory(storage.identity(), lock)
        with pytest.raises(DirectoryLockedError):
            _at(where).lock(name)
    finally:
        lock.release()
    again = _at(where).lock(name)
    again.release()


def test_a_failed_step_leaves_nothing_listed_and_its_files_go(where):
    storage = _at(where)
    token = uuid.uuid4().hex
    with storage.step_sync():
        temp, _ = _begun(storage, 5, token)
    later = storage.clean_failed(os.path.basename(temp), token, OSError("disk full"))
    if later is not None:  # removed after the failure is reported
        storage.remove_temp(later, token)
    assert storage.unfinished_steps() == [] and storage.examine_all() == {}


# -- small files of the directory


def test_the_directory_s_small_files(where):
    storage = _at(where)
    storage.create_file(".jax_cb_ckpt.nonce-a", b"0123456789")
    storage.create_file(".jax_cb_ckpt.nonce-b", b"x")
    assert sorted(storage.names(".jax_cb_ckpt.nonce-")) == [
        ".jax_cb_ckpt.nonce-a",
        ".jax_cb_ckpt.nonce-b",
    ]
    assert storage.read_file(".jax_cb_ckpt.nonce-a", 4) == b"0123"  # at most `limit`
    assert storage.read_file(".jax_cb_ckpt.nonce-none", 4) is None
    storage.put_file(".jax_cb_ckpt.nonce-b", b"anew")
    storage.put_file(".jax_cb_ckpt.nonce-b", b"again")  # (put: whether there or not)
    assert storage.read_file(".jax_cb_ckpt.nonce-b", 100) == b"again"
    storage.remove_file(".jax_cb_ckpt.nonce-a")
    assert storage.names(".jax_cb_ckpt.nonce-") == [".jax_cb_ckpt.nonce-b"]
    assert storage.read_file(".jax_cb_ckpt.nonce-a", 4) is None


def test_link_gives_a_name_the_bytes_of_another_that_outlive_it(where):
    """What a later save links instead of writing again (issue 57): the target holds the
    source's bytes, and keeps them when the source's step goes."""
    storage = _at(where)
    _committed(storage, 1)
    source = f"1/{_format.META_ITEM}/{_format.META_FILE}"
    before = storage.step_file(1, f"{_format.META_ITEM}/{_format.META_FILE}", 1 << 20)
    target = ".jax_cb_ckpt.linked/meta"
    storage.link(source, target)
    assert before is not None and storage.read_file(target, 1 << 20) == before
    assert storage.remove_step(1)
    assert storage.read_file(target, 1 << 20) == before
    with pytest.raises(FileNotFoundError):
        storage.link("1/no-such-file", ".jax_cb_ckpt.linked/none")


def test_link_never_goes_through_a_linked_folder(tmp_path):
    """A hostile directory's symlinked folder on the way to `link`'s source or target
    would link a file from outside in, or one of ours out: refused, nothing linked."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_text("outside data")
    directory = tmp_path / "ckpt"
    directory.mkdir()
    storage = _places.at(str(directory))
    _committed(storage, 1)
    os.symlink(outside, directory / ".jax_cb_ckpt.linked")
    os.symlink(outside, directory / "7")
    with pytest.raises(OSError, match="not a folder of the directory"):
        storage.link(f"1/{_format.META_ITEM}/{_format.META_FILE}", ".jax_cb_ckpt.linked/meta")
    with pytest.raises(OSError, match="not a folder of the directory"):
        storage.link("7/secret", ".jax_cb_ckpt.in/stolen")
    assert sorted(os.listdir(outside)) == ["secret"]
    assert not (directory / ".jax_cb_ckpt.in").exists()


# -- removing and setting aside


def test_set_aside_unlists_a_step_and_remove_aside_deletes_it(where):
    storage = _at(where)
    for step in (1, 2):
        _committed(storage, step)
    assert storage.set_aside(9) is None  # not a checkpoint: nothing touched
    aside = storage.set_aside(1)
    assert aside is not None
    assert storage.list_steps() == [2] and not storage.is_checkpoint(1)
    storage.remove_aside(aside)
    assert not storage.exists(_relative(storage, aside)) and not storage.exists("1")
    assert storage.list_steps() == [2] and storage.examine_all().keys() == {2}


def test_a_damaged_step_set_aside_is_kept_whole_under_another_name(where):
    storage = _at(where)
    _committed(storage, 3)
    _delete(storage, f"3/{_format.META_ITEM}/{_format.META_FILE}")
    assert storage.set_aside_damaged(9, "nothing there") is None
    name = storage.set_aside_damaged(3, "its meta is missing")
    assert name is not None and not _format.is_step_name(name)
    assert storage.examine_all() == {} and not storage.exists("3")
    assert storage.exists(name) and storage.exists(f"{name}/{_format.STATE_ITEM}")
    [(step, listed, why)] = storage.set_aside_steps()
    assert (step, listed) == (3, name) and "its meta is missing" in why


# -- leftovers


def test_clean_leftovers_removes_a_write_cut_short_and_keeps_committed_steps(where):
    storage = _at(where)
    _committed(storage, 1)
    token = uuid.uuid4().hex
    with storage.step_sync():
        _begun(storage, 2, token)  # a writer killed before its step's files
    assert [step for step, _ in storage.unfinished_steps()] == [2]
    assert storage.clean_leftovers() == []
    assert storage.unfinished_steps() == [] and storage.list_steps() == [1]
    storage.remove_run_temps(uuid.uuid4().hex)  # another run's temporaries only
    assert storage.list_steps() == [1] and storage.open_step(1).step == 1


# -- the protocol's shape


def _verbs(protocol: type) -> dict[str, inspect.Signature]:
    return {
        name: inspect.signature(value)
        for name, value in vars(protocol).items()
        if inspect.isfunction(value) and not name.startswith("_")
    }


# A kind may return a subtype of what the protocol says (its own lock, its own sync).
_NARROWER = {"lock", "step_sync"}
_KINDS = [
    (StepStore, Local),
    (StepStore, Bucket),
    (StepStore, InPlace),
    (ChunkStore, LocalChunks),
    (ChunkStore, BucketChunks),
    (ChunkStore, CopyingChunks),
]
_IDS = [kind.__name__ for _, kind in _KINDS]


@pytest.mark.parametrize(("protocol", "kind"), _KINDS, ids=_IDS)
def test_each_kind_implements_every_verb_with_the_protocol_s_signature(protocol, kind):
    for name, wanted in _verbs(protocol).items():
        got = inspect.signature(getattr(kind, name))
        assert list(got.parameters.values()) == list(wanted.parameters.values()), name
        if name not in _NARROWER:
            assert got.return_annotation == wanted.return_annotation, name
    assert "path" in protocol.__annotations__


@pytest.mark.parametrize(("protocol", "kind"), _KINDS, ids=_IDS)
def test_a_kind_has_no_public_verb_beyond_the_protocol(protocol, kind):
    public = {name for name in dir(kind) if not name.startswith("_")}
    assert public - set(_verbs(protocol)) - set(protocol.__annotations__) == set()


@pytest.mark.parametrize("protocol", [StepStore, ChunkStore])
def test_each_protocol_has_at_most_25_verbs(protocol):
    """What a new kind of storage implements (issue 55: one class of 45 verbs before)."""
    assert 5 <= len(_verbs(protocol)) <= 25


def _modules_outside_storage():
    for path in sorted(PACKAGE.rglob("*.py")):
        if "_storage" not in path.relative_to(PACKAGE).parts:
            yield path, ast.parse(path.read_text())


def _storage_receiver(node: ast.expr) -> bool:
    """`storage.x`, `self._storage.x`, `self.storage.x`: a caller's storage object."""
    if isinstance(node, ast.Name):
        return node.id == "storage"
    return isinstance(node, ast.Attribute) and node.attr in ("storage", "_storage")


_KIND_NAMES = {"Local", "LocalChunks", "Bucket", "BucketChunks"}


def test_callers_ask_a_storage_only_the_protocol_s_verbs_and_never_name_a_kind():
    """Pyright checks the callers against `Storage` (they are typed with it, and
    `_places.at` returns it); this also catches an untyped caller, and one that goes
    round `Storage` to its step store or chunk store."""
    verbs = set(_verbs(Storage)) | {"path"}
    asked, problems = set(), []
    for path, tree in _modules_outside_storage():
        where = path.relative_to(PACKAGE)
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and _storage_receiver(node.value):
                asked.add(node.attr)
                if node.attr not in verbs:
                    problems.append(f"{where}:{node.lineno}: storage.{node.attr}")
            if isinstance(node, ast.ImportFrom) and node.module is not None:
                names = {alias.name for alias in node.names}
                if node.module.endswith(("_storage._local", "_storage._bucket")):
                    problems.append(f"{where}:{node.lineno}: imports {node.module}")
                if node.module.endswith("_storage") and names & {"_local", "_bucket"}:
                    problems.append(f"{where}:{node.lineno}: imports a kind's module")
                if names & _KIND_NAMES:
                    problems.append(f"{where}:{node.lineno}: imports {names}")
    assert not problems, problems
    assert len(asked) > 30  # (the test sees the callers)


def test_no_module_outside_storage_imports_remote():
    """What an error of a storage means is asked of `_faults` (and whether a directory
    is a URL of `_places`): `_remote` (URLs, TensorStore specs, object operations) is
    the buckets' own, so a new kind of storage changes no stage outside `_storage/`."""
    problems = []
    for path, tree in _modules_outside_storage():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module is not None:
                names = {alias.name for alias in node.names}
                if node.module.endswith("_storage._remote") or (
                    node.module.endswith("_storage") and "_remote" in names
                ):
                    problems.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
            elif isinstance(node, ast.Import):
                if any(alias.name.endswith("_storage._remote") for alias in node.names):
                    problems.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    assert problems == []


def test_retention_s_report_of_a_step_it_cannot_delete_goes_with_the_step(where):
    """What retention asks of the storage for its report (`_format.STUCK_NAME`): a step
    that refuses to be set aside is recorded, and the record removed once the step
    could be deleted. In a bucket the record stayed forever: retention asked `exists`,
    which there tells a prefix (a folder, a step), never a file."""
    storage = _at(where)
    for step in (1, 2, 3, 4):
        _committed(storage, step)
    set_aside = storage.set_aside

    def refused(step):
        if step == 1:
            raise PermissionError(f"step {step} may not be deleted")
        return set_aside(step)

    storage.set_aside = refused  # type: ignore[method-assign]
    retention = Retention(AnyOf.short({"max_to_keep": 2}), storage, note=lambda *args: None)
    for aside in retention.committed(4, {}):
        storage.remove_aside(aside)
    assert storage.list_steps() == [1, 3, 4]
    assert storage.read_file(_format.STUCK_NAME, 1000) is not None
    del storage.set_aside  # deletable again
    _committed(storage, 5)
    for aside in retention.committed(5, {}):
        storage.remove_aside(aside)
    assert storage.list_steps() == [4, 5]
    assert storage.read_file(_format.STUCK_NAME, 1000) is None
