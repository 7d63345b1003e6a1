"""The on-disk layout, in one place: names, what counts as a step, how steps come and go.

A checkpoint directory holds, for each saved step, a directory named by the step in
plain decimal (`0`, `5`, `1200`), in Orbax's layout and holding two items: `state` (the
arrays, as a nested dict: `_METADATA` and an OCDBT database, `_store.py`) and `meta`
(JSON describing every leaf and its checksums, tagged with `FORMAT`), plus Orbax's
`_CHECKPOINT_METADATA` naming the items' handlers, so plain Orbax reads every step.

Only such directories are steps of ours. Anything else in the directory (a user's
`2023/`, an empty `5/`, `007`, a symlink) is ignored: never listed, never restored,
never deleted; a plain Orbax checkpoint (a `CheckpointManager`'s step) is listed and
read as Orbax's by the readers (`_read/_plain.py`), never written or deleted. The
library only ever deletes what it made itself:

- `<step>.jax_cb_ckpt-tmp-<hex>`: a step being written (older versions let Orbax
  write through `<that>.orbax-checkpoint-tmp`); once complete and fsynced it is renamed
  to `<step>` (atomic), so a step directory is complete or absent, and a unique name per
  attempt means two writers can never collide on a temporary name.
- `<step>.jax_cb_ckpt-deleting-<hex>`: a step being deleted (retention, or an explicit
  replace). The rename out of `<step>` is atomic, so a kill during the deletion never
  leaves a half-deleted directory that looks like a step.

Leftovers of either kind (a killed run) are removed when a Checkpointer opens the
directory (`_storage/`, which reads and removes steps where they live). Every deletion
checks with `lstat` that it removes a real directory, never a symlink, and
`shutil.rmtree` does not follow links inside it: nothing outside the checkpoint
directory is ever touched.

In object storage (`gs://`, `s3://`: `_remote.py`) there is no rename: a step's objects
are written under `<step>/` directly, `<step>/.jax_cb_ckpt` first and Orbax's commit
marker `<step>/commit_success.txt` last, and only a step holding both (and the item
files) is listed. Deleting a step removes its commit marker first (unlisted at once),
our marker last. At an opening, an uncommitted step prefix is deleted only when our
marker names a writer token (`Bucket._step_writer`) and the prefix either lacks a file of a
whole step (a write cut short) or was begun by the holder whose lock the opening
took over (it died at its commit). A prefix without our marker is never deleted, nor
is a whole step begun by another writer (a step copied here without its commit
marker): those are reported (`clean_leftovers`), never taken for our own.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
import re
import threading
import time
import uuid
import zlib
from typing import Any, Literal

import numpy as np

try:  # ISA-L's CRC-32 (SIMD): zlib's checksum, ~19 GB/s here where zlib's runs at ~2.5
    from isal.isal_zlib import crc32 as _crc32
except ImportError:  # a platform without its wheels: the same checksum, slower
    from zlib import crc32 as _crc32

from . import _spec

FORMAT = "jax_cb_ckpt/1"  # tag in every `meta` item; restore checks it
STATE_ITEM = "state"  # Orbax item holding the arrays, as a nested dict
META_ITEM = "meta"  # Orbax item holding the JSON description of the leaves
ITEMS = (STATE_ITEM, META_ITEM)
META_FILE = "metadata"  # the file Orbax's JsonCheckpointHandler writes in META_ITEM
# The user's JSON beside the state (`extra=`, `_extra.py`): an Orbax JSON item, written
# only by a save given one (a step without it has neither the item nor its record).
EXTRA_ITEM = "extra"
EXTRA_MAX_BYTES = 1 << 20  # its bound, at the save and at every read
ORBAX_STEP_FILE = "_CHECKPOINT_METADATA"  # written by Orbax when a save is finalized
STATE_METADATA = "_METADATA"  # Orbax's description of the state item's tree
PROCESS_PREFIX = "ocdbt.process_"  # the state item's database of process i > 0
LOCK_NAME = ".jax_cb_ckpt.lock"  # held (flock) by the one live writer of a directory
# Object storage (no rename): a step's objects are written under its final name, this
# one first (the step is ours from then on) and Orbax's commit marker last (the step is
# listed from then on).
OURS_NAME = ".jax_cb_ckpt"
COMMIT_NAME = "commit_success.txt"
COMMITTED = b"Checkpoint commit was successful."  # its text (Orbax's)
COMPLETE_KEYS = frozenset(
    {
        OURS_NAME,
        COMMIT_NAME,
        ORBAX_STEP_FILE,
        f"{META_ITEM}/{META_FILE}",
        f"{STATE_ITEM}/{STATE_METADATA}",
    }
)
# The files every whole step has, wherever it was written (a local step has neither of
# our markers): a prefix holding them is a step, copied or cut short at its commit.
STEP_FILES = COMPLETE_KEYS - {OURS_NAME, COMMIT_NAME}
_TOKEN = re.compile(r"[0-9a-f]{32}", re.ASCII)  # a lock token (`_lock.ObjectLock`)

MAX_STEP = 2**63 - 1  # steps are stored as int64 in the metadata and as decimal names
# A leaf written whole is split along its leading axes into chunks of at most this many
# bytes (`_store`); a reader asks for them one request each (`_bucket.Bucket`).
CHUNK_BYTES = 16 << 20
# An incremental save's chunks (`_store.chunks_to_link`): about this many per leaf, none
# smaller than CHUNK_BYTES_FEWEST (what changed is rewritten chunk by chunk).
CHUNKS_PER_LEAF = 256
CHUNK_BYTES_FEWEST = 256 << 10
SMALL_BYTES = 64 << 10  # smaller leaves: their raw chunk bytes, never compressed
Region = tuple[tuple[int, int], ...]  # (start, stop) per dimension of a stored block

_STEP_NAME = re.compile(r"0|[1-9][0-9]*", re.ASCII)
OURS_PATTERN = re.compile(
    r"(0|[1-9][0-9]*)\.jax_cb_ckpt-(tmp|deleting)-[0-9a-f]{32}(\.orbax-checkpoint-tmp)?",
    re.ASCII,
)
# Written by versions <= 0.1.0: retention renamed steps into this folder.
LEGACY_DELETED = "_jax_cb_ckpt_deleted"
# A damaged step a restart passed over, set aside (renamed; in a bucket, copied and then
# unlisted) under a name that is not a step: the run may write that step number again,
# and nothing of it is lost. Never deleted, never listed, never restored; `jax-cb-ckpt
# ls` shows it with the reason recorded in its `SET_ASIDE_NOTE`.
SET_ASIDE_PATTERN = re.compile(r"(0|[1-9][0-9]*)\.jax_cb_ckpt-damaged-[0-9a-f]{32}", re.ASCII)
SET_ASIDE_NOTE = ".jax_cb_ckpt-set-aside.json"
# The steps retention could not delete ({step: the error}), written by the writer while
# there are any, read by `jax-cb-ckpt ls`.
STUCK_NAME = ".jax_cb_ckpt-undeletable.json"


def is_step_name(name: str) -> bool:
    """`name` is a step number written the way we write it (ASCII decimal, canonical)."""
    return _STEP_NAME.fullmatch(name) is not None and int(name) <= MAX_STEP


Kind = Literal["complete", "damaged", "foreign", "unreadable"]


@dataclasses.dataclass(frozen=True)
class Examined:
    """What a step-named entry of a checkpoint directory is.

    - "complete": a checkpoint of ours, whole as far as its description files tell
      (the arrays' checksums are `restore`'s and `verify`'s to check);
    - "damaged": it claims to be ours (our `meta` item, or our record in Orbax's step
      file) but is not whole: a partial copy, a truncated or edited file, a folder
      renamed to another step. Reported, never listed, restored or deleted;
    - "foreign": not ours (someone's folder, a plain Orbax checkpoint, another
      version's format): ignored, never deleted;
    - "unreadable": this process may not read it (a refused permission), so what it is
      cannot be told: reported, never listed, restored, deleted or set aside, and a
      restart stops at it rather than go back past it.
    `why` says what was found, for messages."""

    kind: Kind
    why: str = ""


COMPLETE = Examined("complete")
# A step-named entry that went away (renamed aside or deleted) while it was examined:
# `examine_all` leaves it out, as a listing made a moment later would.
GONE = Examined("foreign", "removed while it was being examined")
# A bucket step of ours without its commit marker (written in place: being written, or
# left by a killed writer): not a step, and never taken for a plain Orbax one.
UNFINISHED = Examined("foreign", "a step of ours being written, or left by a killed writer")
# Bounds on what a step's description files may hold: nothing is read (or parsed)
# beyond them. A meta item is ~150 B per leaf and ~30 B per checksummed chunk: 64 MiB
# is ~400,000 leaves. The writer refuses to write more (`meta_files`).
META_MAX_BYTES = 64 << 20
# A batch's members are one JSON boolean each (4 bytes or more) in the description.
_MAX_MEMBERS = META_MAX_BYTES // 4
SMALL_FILE_MAX_BYTES = 1 << 20  # Orbax's step file, `state/_METADATA` is per leaf: see below


class DamagedStep(ValueError):
    """A step's description files are not what was written (`kind` "damaged"), or are
    another program's (`kind` "foreign"); the text says what was found."""

    def __init__(self, text: str, kind: Kind = "damaged") -> None:
        super().__init__(text)
        self.kind: Kind = kind


def within(path: str, data: bytes, limit: int) -> bytes:
    """`data` read from `path`, refused (`DamagedStep`) when larger than `limit`."""
    if len(data) > limit:
        name = "/".join(path.rsplit("/", 2)[-2:])
        raise DamagedStep(f"'{name}' is larger than {limit} bytes, more than the library writes")
    return data


def load_json(data: bytes, what: str) -> Any:
    """JSON from a step's file: `DamagedStep` for text that is not JSON, nested too
    deeply for the parser, or not UTF-8 (never a RecursionError or UnicodeError)."""
    try:
        return json.loads(data.decode("utf-8"))
    except RecursionError:
        raise DamagedStep(f"{what} is nested too deeply to be JSON the library wrote") from None
    except (UnicodeDecodeError, ValueError) as e:
        raise DamagedStep(f"{what} is not valid JSON ({type(e).__name__}: {str(e)[:80]})") from None


def record_of(step_file: bytes) -> dict[str, Any] | None:
    """Our record in Orbax's step file (`meta_files`), or None (another writer's file,
    or one from before the record); `ValueError` when the file is not JSON."""
    content = load_json(step_file, ORBAX_STEP_FILE)
    custom = content.get("custom_metadata") if isinstance(content, dict) else None
    record = custom.get(_RECORD) if isinstance(custom, dict) else None
    return record if isinstance(record, dict) else None


def check_meta_bytes(text: bytes, step: int, record: dict[str, Any] | None) -> dict[str, Any]:
    """The `meta` item of the step folder named `step`, parsed, after its bytes were
    checked against our `record` of them (when the step file has one), its format tag
    and its step; `DamagedStep` saying what is wrong (kind "foreign" for another
    format)."""
    name = f"'{META_ITEM}/{META_FILE}'"
    if record is not None:
        size, crc = record.get("meta_bytes"), record.get("meta_crc32")
        if size != len(text):
            raise DamagedStep(
                f"{name} holds {len(text)} bytes where {size} were written (cut short, "
                "or changed, after the step was written)"
            )
        if crc != zlib.crc32(text):
            raise DamagedStep(f"{name} does not match the CRC-32 recorded when it was written")
        if record.get("step") != step:
            raise DamagedStep(
                f"the folder is named {step} but holds step {record.get('step')!r} (renamed "
                "or copied under another name)"
            )
    meta = load_json(text, name)
    if not isinstance(meta, dict):
        raise DamagedStep(f"{name} holds a JSON {type(meta).__name__}, not an object")
    tag = meta.get("format")
    if tag != FORMAT:
        if record is None:  # another program's JSON item, or another version's
            raise DamagedStep(f"its format tag is {tag!r}, not {FORMAT!r}", "foreign")
        raise DamagedStep(f"{name} has format tag {tag!r}, not {FORMAT!r}")
    if meta.get("step") != step:
        raise DamagedStep(
            f"the folder is named {step} but holds step {meta.get('step')!r} (renamed or "
            "copied under another name)"
        )
    return meta


# The value types of a leaf whose handler reads an array from the state item's database
# (ours write "np.ndarray"; older versions, through Orbax, may have written the others).
_ORBAX_VALUE_TYPES = frozenset({"np.ndarray", "jax.Array", "scalar"})
# An empty node (an empty dict, list, tuple, None) Orbax describes and reads without data.
_ORBAX_EMPTY_NODES = frozenset({"None", "Dict", "List", "Tuple", "NamedTuple"})


def check_state_metadata(
    data: bytes, stored: list[tuple[str, ...]], described: list[tuple[str, ...]]
) -> None:
    """`state/_METADATA` (Orbax's description of the state item's tree, written by
    `_store.state_metadata`) holds what plain Orbax needs to read the step's arrays
    (its `InternalTreeMetadata.from_json`, orbax-checkpoint 0.12): a JSON object whose
    `tree_metadata` names every stored leaf (`stored`: the leaves of the step's meta
    that are not of size zero) and no leaf the step does not describe (`described`;
    an empty node, which Orbax reads without data, may be there), each under its key
    path (`str(tuple(name))`) with its keys and a value type that Orbax reads from the
    database, not skipped; the arrays in OCDBT (`use_ocdbt`), as zarr v2 (`use_zarr3`
    false). `DamagedStep` saying what is not so. Our own reads
    never use the file; `verify` and a restart check it, since plain Orbax reading
    every step is promised."""
    name = f"'{STATE_ITEM}/{STATE_METADATA}'"
    content = load_json(data, name)
    if not isinstance(content, dict):
        raise DamagedStep(f"{name} holds a JSON {type(content).__name__}, not an object")
    tree = content.get("tree_metadata")
    if not isinstance(tree, dict):
        raise DamagedStep(f"{name} has no 'tree_metadata' object")
    if content.get("use_ocdbt") is not True or content.get("use_zarr3", False) is not False:
        raise DamagedStep(
            f"{name} says use_ocdbt={content.get('use_ocdbt')!r}, "
            f"use_zarr3={content.get('use_zarr3', False)!r}, where the arrays are zarr v2 "
            "in an OCDBT database (true, false)"
        )
    paths = {str(tuple(leaf)): leaf for leaf in described}
    for key, entry in tree.items():
        value = entry.get("value_metadata") if isinstance(entry, dict) else None
        empty = isinstance(value, dict) and value.get("value_type") in _ORBAX_EMPTY_NODES
        if key not in paths and not empty:
            raise DamagedStep(
                f"{name} describes {str(key)[:80]!r}, which is not a leaf of the step"
            )
    for leaf in stored:
        entry = tree.get(str(tuple(leaf)))
        if entry is None:
            raise DamagedStep(f"{name} does not describe leaf {'/'.join(leaf)!r}")
        if not _orbax_entry(entry, leaf):
            raise DamagedStep(
                f"{name}'s entry of leaf {'/'.join(leaf)!r} is not one plain Orbax reads "
                "(its keys, or a value type read from the database, not skipped)"
            )


def _orbax_entry(entry: object, leaf: tuple[str, ...]) -> bool:
    """One leaf's entry in `state/_METADATA` is one Orbax reads as that leaf's array."""
    if not isinstance(entry, dict):
        return False
    keys, value = entry.get("key_metadata"), entry.get("value_metadata")
    if not isinstance(keys, list) or len(keys) != len(leaf) or not isinstance(value, dict):
        return False
    for key, part in zip(keys, leaf, strict=True):
        if not isinstance(key, dict) or key.get("key") != part or key.get("key_type") not in (1, 2):
            return False
    return value.get("value_type") in _ORBAX_VALUE_TYPES and value.get("skip_deserialize") is False


def _our_marker(data: bytes | None) -> dict | None:
    """Our marker object `data` as a dict, or None when it is not ours (not JSON, not an
    object, not our format tag): hostile input, read before it is trusted."""
    try:
        record = json.loads(data or b"{}")
    except ValueError:
        return None
    return record if isinstance(record, dict) and record.get("format") == FORMAT else None


def marker_writer(data: bytes | None) -> str | None:
    """The writer (lock token) our marker object `data` names; None when there is none,
    or it is not our marker (our format tag and a token as a lock makes them)."""
    marker = _our_marker(data)
    if marker is None:
        return None
    writer = marker.get("writer")
    return writer if isinstance(writer, str) and _TOKEN.fullmatch(writer) else None


def step_of_aside(aside: str) -> int:
    """The step a deletion's aside (`<step>.jax_cb_ckpt-deleting-<hex>`, or in a bucket
    the step's own URL) was."""
    return int(os.path.basename(aside.rstrip("/")).partition(".")[0])


def set_aside_name(step: int) -> str:
    """The name a damaged step is set aside under (`SET_ASIDE_PATTERN`)."""
    return f"{step}.jax_cb_ckpt-damaged-{uuid.uuid4().hex}"


def aside_marker(marker: bytes | None, name: str) -> bytes:
    """Our marker object of a bucket step being set aside as `name` (`Bucket.
    set_aside_damaged`): the marker as it was (its writer kept), naming where the step
    went. Written once the copy and its note are whole and before the step is unlisted,
    so a set-aside cut short at any later instant is finished by the next opening
    (`moved_to`), never taken for someone's copy of a step."""
    record = _our_marker(marker) or {"format": FORMAT}
    return json.dumps(dict(record, set_aside_as=name)).encode()


def moved_to(marker: bytes | None, step: int) -> str | None:
    """The set-aside name our marker object of bucket step `step` names (`aside_marker`):
    None when there is none, or it is not a set-aside name of that step (an edited or
    foreign object: never trusted to say where a step went)."""
    record = _our_marker(marker)
    if record is None:
        return None
    name = record.get("set_aside_as")
    match = SET_ASIDE_PATTERN.fullmatch(name) if isinstance(name, str) else None
    return name if match is not None and int(match.group(1)) == step else None


def note_step(data: bytes | None) -> int | None:
    """The step a set-aside note (`set_aside_note`) says it was; None when there is no
    note or it is not one of ours."""
    try:
        note = json.loads(data or b"")
    except ValueError:
        return None
    if not isinstance(note, dict) or note.get("format") != FORMAT:
        return None
    step = note.get("step")
    return step if isinstance(step, int) and not isinstance(step, bool) else None


def set_aside_note(step: int, why: str) -> bytes:
    """The note written beside a step set aside: which step it was, why, and when."""
    when = datetime.datetime.now(datetime.UTC).isoformat(timespec="milliseconds")
    return json.dumps({"format": FORMAT, "step": step, "why": why, "set_aside_at": when}).encode()


def read_set_aside_note(data: bytes | None) -> str:
    """The reason a set-aside step's note gives, for `jax-cb-ckpt ls` (bounded: the note
    is read within `SMALL_FILE_MAX_BYTES`); a placeholder when there is none."""
    try:
        note = json.loads(data or b"")
    except ValueError:
        note = None
    why = note.get("why") if isinstance(note, dict) else None
    return why[:500] if isinstance(why, str) else "no reason recorded"


def temp_name(step: int) -> str:
    return f"{step}.jax_cb_ckpt-tmp-{uuid.uuid4().hex}"


def run_temp_name(step: int, run: str, attempt: int) -> str:
    """An attempt's temporary directory in a multi-process run, the same in every
    process: 24 hex digits of the run, 8 of the attempt (32, as `OURS_PATTERN` expects)."""
    return f"{step}.jax_cb_ckpt-tmp-{run[:24]}{attempt:08x}"


# The `meta` item's schema (`meta_record`):
# - `format` (FORMAT), `library_version`, `jax_version`, `jaxlib_version`,
#   `orbax_version`, `tensorstore_version`: what wrote it (`versions`);
# - `step`, `saved_at` (UTC, ISO 8601, ms; `saved_at`: when it was handed over, in
#   seconds since the epoch, else now); `saved_ns`: the order the saves were made in,
#   as nanoseconds since the epoch when the writer described it, strictly increasing
#   within a process (`save_order_ns`): steps saved in one millisecond are told
#   apart by it (`ls --best`'s ties, retention's order of a directory's steps);
# - `leaves`: one `LeafSpec.to_json()` per leaf, in the state's order;
# - `shardings` (only leaves saved per device): {leaf path: {"mesh": {axis: size},
#   "spec": [[mesh axes] per dimension]}};
# - `batch_shape`, `members` (only saves under vmap): the batch axes, and which
#   members asked for the save; `member_steps` (only where a batched step differs
#   between members): each member's own step, in the batch's shape. A member that
#   did not ask holds what its state was at its own step, which under vmap of a
#   `while_loop` may be a state it never had (a finished member's body still runs);
#   a restart resumes each member from the newest step it asked at; `left` (only
#   where some member had left its `ckpt.while_loop`): which members had, in the
#   batch's shape: what the step holds for them is their body's leftover, never a
#   state they had (they did not ask for the step);
# - `metrics` (only saves given `metrics=`): {name: number, or nested lists of
#   numbers in the batch's shape under vmap}; NaN and inf as Python's json writes them;
# - `retention` (only with retention rules): the rules in force when it was saved
#   (`_policy.AnyOf.to_json`): a later run with other rules says what they change;
# - `checksums`: {leaf name: {region: CRC-32}} (`_store.py`, `_arrays.py`).
# (`extra=`'s JSON is an item of its own, `_extra`; `metadata()` adds it as `extra`.)
def meta_record(
    step: int,
    leaves: list[dict[str, Any]],
    versions: dict[str, str],
    *,
    shardings: dict[str, Any],
    batch_shape: tuple[int, ...],
    members: list[Any],
    member_steps: list[Any] | None = None,
    left: list[Any] | None = None,
    saved_at: float | None = None,
    metrics: dict[str, Any] | None = None,
    retention: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The `meta` item of a step (written by the host side, completed with `checksums`
    by the writer; read back as a `StepMeta` by restore, `verify` and the CLI, and
    returned as it is by `metadata()`); its schema, in one place: the comment above."""
    meta: dict[str, Any] = dict(
        versions,
        format=FORMAT,
        step=step,
        saved_at=datetime.datetime.fromtimestamp(
            time.time() if saved_at is None else saved_at, datetime.UTC
        ).isoformat(timespec="milliseconds"),
        saved_ns=save_order_ns(),
        leaves=leaves,
    )
    if shardings:
        meta["shardings"] = shardings
    if batch_shape:
        meta["batch_shape"] = list(batch_shape)
        meta["members"] = members
        if member_steps is not None:
            meta["member_steps"] = member_steps
        if left is not None:
            meta["left"] = left
    if metrics:
        meta["metrics"] = metrics
    if retention:
        meta["retention"] = retention
    return meta


_LAST_NS = [0]  # the last `save_order_ns` of this process
_NS_LOCK = threading.Lock()


def save_order_ns() -> int:
    """Now, in nanoseconds since the epoch, and after every earlier call in this process
    (each Checkpointer's writer describes its saves in the order they were made)."""
    with _NS_LOCK:
        _LAST_NS[0] = max(time.time_ns(), _LAST_NS[0] + 1)
        return _LAST_NS[0]


@dataclasses.dataclass(frozen=True)
class StepMeta:
    """A step's `meta` item as read back (the schema of `meta_record`), checked: restore,
    verify and the CLI read these fields, never the JSON's keys. What a version before
    a field existed did not record has its default."""

    step: int
    leaves: tuple[_spec.LeafSpec, ...]
    batch_shape: tuple[int, ...] = ()  # () unless saved under vmap
    # Which members asked for the save (bool, batch_shape); all of them when not recorded.
    members: np.ndarray = dataclasses.field(default_factory=lambda: np.ones((), bool))
    # Each member's own step (int64, batch_shape), where they differ; None: all at `step`.
    member_steps: np.ndarray | None = None
    # Which members had left their ckpt.while_loop (bool, batch_shape); None: none had.
    left: np.ndarray | None = None
    checksums: Sums | None = None  # None: written before checksums were kept
    shardings: dict[str, Any] = dataclasses.field(default_factory=dict)
    saved_at: str | None = None
    saved_ns: int | None = None  # the save's order (`meta_record`); None: not recorded
    versions: dict[str, str] = dataclasses.field(default_factory=dict)
    # {name: value} of `metrics=` (float64, int64 or bool arrays; 0-d for a plain save)
    metrics: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
    retention: dict[str, Any] | None = None  # the rules' record, unchecked (`_retention`)

    @classmethod
    def parse(cls, meta: dict[str, Any]) -> StepMeta:
        """The fields of a `meta` item whose format tag was checked; `ValueError` or
        `TypeError` naming the first field that is wrong (it was edited or corrupted)."""
        step = meta.get("step")
        if not isinstance(step, int) or isinstance(step, bool) or not 0 <= step <= MAX_STEP:
            raise ValueError(f"'step' is {step!r}, not a step number")
        leaves = meta.get("leaves")
        if not isinstance(leaves, list):
            raise TypeError(f"'leaves' is a {type(leaves).__name__}, not a list")
        batch, members, member_steps, left = _batch_fields(meta)
        for field in ("checksums", "shardings"):
            if meta.get(field) is not None and not isinstance(meta[field], dict):
                raise TypeError(f"{field!r} is a {type(meta[field]).__name__}, not an object")
        specs = tuple(_spec.LeafSpec.from_json(leaf) for leaf in leaves)
        stored = {".".join(spec.name): spec.stored_shape for spec in specs}
        for name, sums in (meta.get("checksums") or {}).items():
            _check_sums(name, sums, stored.get(name))
        saved_ns = meta.get("saved_ns")
        if saved_ns is not None and (
            not isinstance(saved_ns, int) or isinstance(saved_ns, bool) or saved_ns < 0
        ):
            raise ValueError(f"'saved_ns' is {saved_ns!r}, not a number of nanoseconds")
        versions = {k: str(v) for k, v in meta.items() if k.endswith("_version")}
        metrics = parse_metrics(meta.get("metrics", {}))
        return cls(
            step=step,
            leaves=specs,
            batch_shape=tuple(batch),
            members=members,
            member_steps=member_steps,
            left=left,
            checksums=meta.get("checksums"),
            shardings=meta.get("shardings") or {},
            saved_at=meta["saved_at"] if isinstance(meta.get("saved_at"), str) else None,
            saved_ns=saved_ns,
            versions=versions,
            metrics=metrics,
            retention=meta["retention"] if isinstance(meta.get("retention"), dict) else None,
        )

    def best_values(self, name: str | None) -> np.ndarray | None:
        """The metric `name` as float64 (one value per member under vmap), for ranking;
        None when the step has no such metric."""
        value = None if name is None else self.metrics.get(name)
        return None if value is None else np.asarray(value, dtype=np.float64)

    @property
    def device_axes(self) -> tuple[str, ...]:
        """The pmap/shard_map axes whose devices the batch axis stands for: a save with
        `axis_name=` inside the map (`gather="stack"`) stores one state per device on a
        new leading axis, every leaf saved per device and split along it over those
        axes (their sizes make the batch). () for a batch made by vmap, or none. The
        record is read as untrusted: anything else in it is (), not an error."""
        batch = self.batch_shape
        if len(batch) != 1 or not self.leaves:
            return ()
        found: set[tuple[str, ...]] = set()
        for leaf in self.leaves:
            described = self.shardings.get(leaf.path)
            mesh = described.get("mesh") if isinstance(described, dict) else None
            spec = described.get("spec") if isinstance(described, dict) else None
            if not isinstance(mesh, dict) or not isinstance(spec, list) or not spec:
                return ()
            axes = spec[0]
            if not isinstance(axes, list) or not axes or leaf.shape[:1] != batch:
                return ()
            sizes = [mesh.get(a) if isinstance(a, str) else None for a in axes]
            whole = 1
            for n in sizes:
                if not isinstance(n, int) or isinstance(n, bool) or n <= 0:
                    return ()
                whole *= n
            if whole != batch[0]:
                return ()
            found.add(tuple(axes))
        return found.pop() if len(found) == 1 else ()

    @property
    def saved_seconds(self) -> float | None:
        """`saved_at` in seconds since the epoch (None: not recorded, or unreadable)."""
        return saved_seconds(self.saved_at)


def saved_seconds(saved_at: object) -> float | None:
    """A meta record's `saved_at` (ISO 8601, to the ms) in seconds since the epoch, or
    None. Retention reads a step's time from here both for the step it just wrote and
    for the steps a later run finds: the same milliseconds, the same decisions."""
    if not isinstance(saved_at, str):
        return None
    try:
        when = datetime.datetime.fromisoformat(saved_at)
    except ValueError:
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=datetime.UTC)
    return when.timestamp()


# "A small pytree of scalars": each metric is a column of `jax-cb-ckpt ls` and a few
# bytes of the step's meta. A reader accepts no more than this (the writer refuses it).
MAX_METRICS = 64
MAX_METRIC_NAME = 200
_MAX_METRIC_VALUES = 1 << 20  # one per member: a batch of a million members at most


def _batch_fields(
    meta: dict[str, Any],
) -> tuple[list[int], np.ndarray, np.ndarray | None, np.ndarray | None]:
    """A `meta` item's batch fields, checked (`StepMeta.parse`): the batch shape, which
    members asked, each member's step (or None) and which had left (or None)."""
    batch = meta.get("batch_shape", [])
    if not isinstance(batch, list) or not all(
        isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in batch
    ):
        raise ValueError(f"'batch_shape' {batch!r} is not a list of non-negative ints")
    if len(batch) > 32 or math.prod(batch) > _MAX_MEMBERS:  # (before any is allocated)
        raise ValueError(
            f"'batch_shape' {batch!r} has more members than a step's description can "
            f"name ({_MAX_MEMBERS})"
        )
    members = np.asarray(meta.get("members", np.ones(batch, bool)), dtype=bool)
    if members.shape != tuple(batch):
        raise ValueError(f"'members' has shape {members.shape}, not the batch's {tuple(batch)}")
    member_steps = meta.get("member_steps")
    if member_steps is not None:
        member_steps = np.asarray(member_steps)
        ok = member_steps.shape == tuple(batch) and member_steps.dtype.kind in "iu"
        if not ok or (member_steps.size and member_steps.min() < 0):
            raise ValueError(
                f"'member_steps' is not the batch's {tuple(batch)} non-negative step numbers"
            )
        member_steps = member_steps.astype(np.int64)
    left = meta.get("left")
    if left is not None:
        left = np.asarray(left)
        if left.shape != tuple(batch) or left.dtype != np.bool_ or (left & members).any():
            raise ValueError(
                f"'left' is not the batch's {tuple(batch)} booleans of members that did not ask"
            )
    return batch, members, member_steps, left


def parse_metrics(record: object) -> dict[str, np.ndarray]:
    """The `metrics` of a meta item, checked: {name: float64/int64/bool array};
    `ValueError`/`TypeError` naming what is wrong (an edited or foreign file)."""
    if not isinstance(record, dict):
        raise TypeError(f"'metrics' is a {type(record).__name__}, not an object")
    if len(record) > MAX_METRICS:
        raise ValueError(f"'metrics' has {len(record)} entries, more than {MAX_METRICS}")
    out = {}
    for name, value in record.items():
        if not isinstance(name, str) or not name or len(name) > MAX_METRIC_NAME:
            raise ValueError(f"the metric name {str(name)[:40]!r} is not a name")
        try:
            array = np.asarray(value)
        except ValueError as e:  # ragged nested lists
            raise ValueError(f"the metric {name!r} is not a number or an array: {e}") from None
        if array.dtype.kind not in "biuf" or array.ndim > 32 or array.size > _MAX_METRIC_VALUES:
            raise ValueError(
                f"the metric {name!r} is not a number or an array of numbers "
                f"(dtype {array.dtype}, shape {array.shape})"
            )
        out[name] = array.astype(np.int64) if array.dtype.kind == "i" else array
    return out


def _check_sums(name: str, sums: object, shape: tuple[int, ...] | None) -> None:
    """One leaf's checksums in a `meta` item: {region key: CRC-32}, each region a box
    inside the leaf's stored shape ('0:4,8:16'; '' for a scalar); `ValueError` else."""
    if shape is None:
        raise ValueError(f"'checksums' names {name!r}, which is not a leaf of the step")
    if not isinstance(sums, dict):
        raise TypeError(f"the checksums of {name!r} are a {type(sums).__name__}, not an object")
    for key, crc in sums.items():
        parts = key.split(",") if key else []
        ok = isinstance(crc, int) and not isinstance(crc, bool) and 0 <= crc < 2**32
        ok = ok and len(parts) == len(shape)
        for part, n in zip(parts, shape, strict=False):
            start, colon, stop = part.partition(":")
            ok = ok and colon == ":" and start.isdecimal() and stop.isdecimal()
            ok = ok and 0 <= int(start or 0) < int(stop or 0) <= n
        if not ok:
            raise ValueError(
                f"the checksum {key!r}: {crc!r} of {name!r} is not a region of its shape "
                f"{list(shape)} with a CRC-32"
            )


def meta_files(meta: dict[str, Any], extra: bytes | None = None) -> dict[str, bytes]:
    """{path in the step: bytes}: the `meta` item (the JSON file Orbax's
    JsonCheckpointHandler reads), the `extra` item where the save has one (its bytes,
    `_extra.encode`), then Orbax's step file holding our record of them (sizes, CRC-32s
    and step: `check_meta_bytes`, `_extra.check_bytes`), in that order: listing and
    restore check the items against the record, so a cut or edited item, or a folder
    renamed to another step, is found damaged instead of restored."""
    text = json.dumps(meta).encode()
    if len(text) > META_MAX_BYTES:
        raise ValueError(
            f"the step's description is {len(text)} bytes, more than the "
            f"{META_MAX_BYTES} a reader accepts (a state of about {len(meta['leaves'])} "
            "leaves): save fewer, larger leaves (e.g. stack them)"
        )
    record = {"step": meta["step"], "meta_bytes": len(text), "meta_crc32": zlib.crc32(text)}
    files = {f"{META_ITEM}/{META_FILE}": text}
    if extra is not None:  # (its size and CRC-32 in the record: `_extra.check_bytes`)
        record.update(extra_bytes=len(extra), extra_crc32=zlib.crc32(extra))
        files[f"{EXTRA_ITEM}/{META_FILE}"] = extra
    files[ORBAX_STEP_FILE] = step_file(record)
    return files


# Orbax's handlers of the two items, by the names Orbax records (tests/test_format.py
# checks them against Orbax's classes: importing Orbax costs ~1.6 s and installs absl's
# logging handler, so the writer names them without it).
HANDLERS = {
    META_ITEM: "orbax.checkpoint._src.handlers.json_checkpoint_handler.JsonCheckpointHandler",
    STATE_ITEM: (
        "orbax.checkpoint._src.handlers.pytree_checkpoint_handler.PyTreeCheckpointHandler"
    ),
}
_RECORD = "jax_cb_ckpt"  # our record in the step file's custom_metadata


def step_file(record: dict[str, Any]) -> bytes:
    """The file Orbax's Checkpointer writes when it finalizes a save: which handler
    wrote each item (so a CheckpointManager reads them without being told), and when;
    in its `custom_metadata`, our `record` of the step ({step, meta_bytes,
    meta_crc32}, and extra_bytes, extra_crc32 where it has an `extra` item:
    `meta_files`)."""
    now = time.time_ns()
    handlers = dict(HANDLERS)
    if "extra_bytes" in record:  # (Orbax lists a Composite's items in the order saved)
        handlers[EXTRA_ITEM] = HANDLERS[META_ITEM]
    content = {
        "item_handlers": handlers,
        "metrics": {},
        "performance_metrics": {},
        "init_timestamp_nsecs": now,
        "commit_timestamp_nsecs": now,
        "custom_metadata": {_RECORD: dict(record, format=FORMAT)},
    }
    return json.dumps(content).encode()


# -- names and checksums of the arrays inside the state item (written by `_store`,
# read by `_arrays`)

Sums = dict[str, dict[str, int]]  # a step's checksums: {leaf name: {region key: CRC-32}}


def param_name(path: tuple[str, ...]) -> str:
    """The name Orbax gives a leaf's array inside the database."""
    return ".".join(path)


def region_key(region: Region) -> str:
    """A region as text, for the checksums in `meta`: '0:4,8:16' ('' for a scalar)."""
    return ",".join(f"{a}:{b}" for a, b in region)


def checksum(array: np.ndarray) -> int:
    """CRC-32 of an array's bytes in C order."""
    array = np.ascontiguousarray(array)
    return _crc32(array.reshape(-1).view(np.uint8).data) if array.size else 0


def checksum_bytes(data: bytes) -> int:
    """`checksum` of an array whose bytes these are."""
    return _crc32(data) if data else 0
