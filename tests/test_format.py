"""Unit tests of the layout's names (`_format`), of a local directory's steps
(`_local.Local`) and of object-storage URLs (`_remote`): no JAX program, no server
(milliseconds each)."""

import json
import os

import pytest

from jax_cb_ckpt import ConfigError
from jax_cb_ckpt._layout import _format as fmt
from jax_cb_ckpt._storage import _local, _places, _remote


@pytest.mark.parametrize(
    "name, ok",
    [
        ("0", True),
        ("5", True),
        ("1200", True),
        (str(2**63 - 1), True),
        (str(2**63), False),
        ("007", False),
        ("-1", False),
        ("1e3", False),
        ("٣", False),  # a non-ASCII digit
        ("", False),
    ],
)
def test_step_names_are_canonical_ascii_decimals(name, ok):
    assert fmt.is_step_name(name) is ok


def test_temporary_names_are_ours_and_unique(tmp_path):
    a, b = fmt.temp_name(12), fmt.temp_name(12)
    assert a != b and a.startswith("12.jax_cb_ckpt-tmp-")
    run = fmt.run_temp_name(12, "ab" * 16, 3)
    assert run == "12.jax_cb_ckpt-tmp-" + "ab" * 12 + "00000003"
    for name in (a, run, "7.jax_cb_ckpt-deleting-" + "0" * 32, "12", "notes"):
        (tmp_path / name).mkdir()
    found = _places.at(str(tmp_path)).unfinished_steps()
    assert sorted(found) == sorted([(12, str(tmp_path / a)), (12, str(tmp_path / run))])


def test_leftovers_of_ours_are_removed_and_nothing_else(tmp_path):
    ours = [fmt.temp_name(3), "4.jax_cb_ckpt-deleting-" + "f" * 32]
    theirs = ["3", "3.jax_cb_ckpt-tmp-short", "notes", "4.jax_cb_ckpt-deleting-" + "F" * 32]
    for name in ours + theirs:
        (tmp_path / name).mkdir()
    _places.at(str(tmp_path)).clean_leftovers()
    assert sorted(os.listdir(tmp_path)) == sorted(theirs)


@pytest.mark.parametrize(
    "text, canonical",
    [
        ("gs://bucket/run", "gs://bucket/run"),
        ("GS://bucket/run/", "gs://bucket/run"),
        ("s3://my.bucket-1//a///b/", "s3://my.bucket-1/a/b"),
        ("s3://bucket", "s3://bucket"),
    ],
)
def test_urls_are_made_canonical(text, canonical):
    assert _places.resolve(text) == canonical
    assert _remote.is_url(canonical)


@pytest.mark.parametrize(
    "text, match",
    [
        ("file:///tmp/x", "file:// scheme"),
        ("gcs://b/x", "Google Cloud Storage is gs://"),
        ("s3:/b/x", "slash missing"),
        ("S3:b", "slash missing"),
        ("gs://ab/x", "not a valid bucket name"),
        ("gs://Bucket/x", "not a valid bucket name"),
        ("s3://bkt/./x", "'.' or '..'"),
    ],
)
def test_bad_urls_are_config_errors_naming_the_problem(text, match):
    with pytest.raises(ConfigError, match=match):
        _places.resolve(text)


def test_local_names_that_look_a_little_like_urls_stay_local(tmp_path):
    assert _places.resolve("exp:1") == os.path.realpath("exp:1")
    assert _places.resolve("./s3:/x") == os.path.realpath("s3:/x")


def test_url_parts_and_key_ranges():
    assert _remote.split("s3://b/run/5/state") == ("s3", "b", "run/5/state")
    assert _remote.split("gs://b") == ("gs", "b", "")
    assert _remote._after("run/") == "run0"  # every key under run/ sorts before it
    assert _remote._after("") == ""
    spec = _remote.kvstore_spec("gs://b/run")
    assert spec["driver"] == "gcs" and spec["path"] == "run/"
    assert "gcs_request_retries" in spec


def _meta(**changes):
    leaf = {"path": "state['w']", "name": ["w"], "kind": "array", "dtype": "float32"}
    meta = fmt.meta_record(
        7,
        [dict(leaf, shape=[2, 3], impl=None, pytype=None)],
        {"library_version": "1.0", "jax_version": "0.10.2"},
        shardings={},
        batch_shape=(2,),
        members=[True, False],
    )
    return {**meta, "checksums": {"w": {"0:2,0:3": 1}}, **changes}


def test_the_step_meta_written_is_read_back_field_by_field():
    meta = fmt.StepMeta.parse(_meta())
    assert meta.step == 7 and meta.batch_shape == (2,) and meta.checksums == {"w": {"0:2,0:3": 1}}
    assert [leaf.name for leaf in meta.leaves] == [("w",)] and meta.leaves[0].shape == (2, 3)
    assert meta.members.tolist() == [True, False] and meta.left is None
    assert fmt.StepMeta.parse(_meta(left=[False, True])).left.tolist() == [False, True]
    assert meta.versions == {"library_version": "1.0", "jax_version": "0.10.2"}
    assert meta.saved_at is not None and meta.saved_at.endswith("+00:00")


def test_what_an_older_version_did_not_record_has_its_default():
    old = {k: v for k, v in _meta().items() if k not in ("batch_shape", "members", "saved_at")}
    del old["checksums"]
    meta = fmt.StepMeta.parse(old)
    assert meta.batch_shape == () and meta.members.shape == () and meta.members.all()
    assert meta.checksums is None and meta.shardings == {} and meta.saved_at is None


PER_DEVICE = {"state['w']": {"mesh": {"i": 2}, "spec": [["i"], []]}}


@pytest.mark.parametrize(
    "shardings, axes",
    [
        (PER_DEVICE, ("i",)),  # a pmap save with axis_name="i"
        ({}, ()),  # a vmap batch
        ({"state['w']": {"mesh": {"i": 4}, "spec": [["i"], []]}}, ()),  # 4 devices, batch 2
        ({"state['w']": {"mesh": {"i": 2}, "spec": [[], ["i"]]}}, ()),  # split elsewhere
        ({"state['w']": {"mesh": "i", "spec": [["i"]]}}, ()),  # garbage: not an error
        ({"state['w']": {"mesh": {"i": 2}, "spec": "P('i')"}}, ()),
        ({"state['w']": {"mesh": {"i": True}, "spec": [["i"]]}}, ()),
        ({"state['w']": {"mesh": {"i": 2}, "spec": [[7]]}}, ()),
        ({"state['w']": []}, ()),
    ],
)
def test_a_pmap_save_is_told_from_a_vmap_batch_by_its_record(shardings, axes):
    """`StepMeta.device_axes`: the batch axis of a per-device save inside pmap/shard_map
    (every leaf split along it over axes whose sizes make the batch), from the record,
    read as untrusted (issue 53: `show` called it a "vmap batch")."""
    assert fmt.StepMeta.parse(_meta(shardings=shardings)).device_axes == axes


@pytest.mark.parametrize(
    "changes, words",
    [
        ({"step": -1}, "'step' is -1, not a step number"),
        ({"step": True}, "'step' is True"),
        ({"leaves": {}}, "'leaves' is a dict, not a list"),
        ({"batch_shape": [2, "x"]}, "'batch_shape' [2, 'x'] is not a list"),
        ({"members": [True]}, "'members' has shape (1,), not the batch's (2,)"),
        ({"left": [False, 1]}, "'left' is not the batch's (2,) booleans of members that"),
        ({"left": [True, False]}, "'left' is not the batch's (2,) booleans of members that"),
        ({"left": [False]}, "'left' is not the batch's (2,) booleans"),
        ({"checksums": []}, "'checksums' is a list, not an object"),
        ({"shardings": "P()"}, "'shardings' is a str, not an object"),
        ({"leaves": [{"name": ["w"]}]}, "'kind'"),
        ({"checksums": {"w": {"0;2,0:3": 1}}}, "checksum '0;2,0:3': 1 of 'w' is not a region"),
        ({"checksums": {"w": {"0:2,0:4": 1}}}, "is not a region of its shape [2, 3]"),
        ({"checksums": {"w": {"0:2,0:3": -1}}}, "with a CRC-32"),
        ({"checksums": {"v": {"0:2,0:3": 1}}}, "names 'v', which is not a leaf"),
    ],
)
def test_an_edited_step_meta_is_refused_naming_the_field(changes, words):
    meta = _meta(**changes)
    with pytest.raises((ValueError, TypeError, KeyError)) as caught:
        fmt.StepMeta.parse(meta)
    assert words in str(caught.value)


def test_a_batch_shape_no_description_can_hold_is_refused_before_its_mask_is_made():
    """Hostile input: a `meta` item without `members` whose `batch_shape` names 10**12
    members made a mask of that many booleans (np.ones) before anything refused it."""
    meta = _meta(batch_shape=[10**6, 10**6])
    meta.pop("members", None)
    with pytest.raises(ValueError, match="more members than a step's description can name"):
        fmt.StepMeta.parse(meta)


def _bare_step(step, n):
    """A step folder as an older version wrote it (no record in the step file): its
    items, Orbax's files, and a meta item with our tag and its step."""
    for item in (fmt.STATE_ITEM, fmt.META_ITEM):
        (step / item).mkdir(parents=True)
    (step / fmt.ORBAX_STEP_FILE).write_text("{}")
    (step / fmt.STATE_ITEM / fmt.STATE_METADATA).write_text("{}")
    (step / fmt.META_ITEM / fmt.META_FILE).write_text(json.dumps({"format": fmt.FORMAT, "step": n}))


def test_orbax_handler_names_are_orbax_s_own():
    """The step file names Orbax's handlers without importing Orbax (`HANDLERS`)."""
    import orbax.checkpoint as ocp

    for item, handler in (
        (fmt.META_ITEM, ocp.JsonCheckpointHandler),
        (fmt.STATE_ITEM, ocp.PyTreeCheckpointHandler),
    ):
        assert fmt.HANDLERS[item] == f"{handler.__module__}.{handler.__qualname__}"


def test_a_step_is_listed_by_what_its_meta_says_now_not_when_first_read(tmp_path):
    """is_checkpoint remembers a meta file's format tag until the file changes: an
    edit (or a replacement) is seen at the next listing."""
    step = tmp_path / "3"
    _bare_step(step, 3)
    meta = step / fmt.META_ITEM / fmt.META_FILE
    assert _places.at(str(tmp_path)).list_steps() == [3]
    meta.write_text(json.dumps({"format": "other/9", "step": 3}))
    assert _places.at(str(tmp_path)).list_steps() == []
    replacement = tmp_path / "new"
    replacement.write_text(json.dumps({"format": fmt.FORMAT, "step": 3}))
    os.replace(replacement, meta)
    assert _places.at(str(tmp_path)).list_steps() == [3]
    meta.unlink()
    assert _places.at(str(tmp_path)).list_steps() == []


def test_what_is_remembered_of_a_step_goes_with_it(tmp_path):
    """A writer's retention sets a step aside at every save: what is_checkpoint
    remembered of it goes too, or a long run's memory would grow with its saves."""
    for n in range(3):
        _bare_step(tmp_path / str(n), n)
    assert _places.at(str(tmp_path)).list_steps() == [0, 1, 2]
    remembered = [k for k in _local._TAGS if k.startswith(str(tmp_path))]
    assert len(remembered) == 3
    local = _places.at(str(tmp_path))
    local.remove_aside(local.set_aside(0))
    local.remove_step(1)
    assert [k for k in _local._TAGS if k.startswith(str(tmp_path))] == [
        str(tmp_path / "2" / fmt.META_ITEM / fmt.META_FILE)
    ]
    assert _places.at(str(tmp_path)).list_steps() == [2]
