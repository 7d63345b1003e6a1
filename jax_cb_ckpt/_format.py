"""The on-disk layout, in one place: names, what counts as a step, how steps come and go.

A checkpoint directory holds, for each saved step, a directory named by the step in
plain decimal (`0`, `5`, `1200`), in Orbax's layout and holding two items: `state` (the
arrays, as a nested dict: `_METADATA` and an OCDBT database, `_store.py`) and `meta`
(JSON describing every leaf and its checksums, tagged with `FORMAT`), plus Orbax's
`_CHECKPOINT_METADATA` naming the items' handlers, so plain Orbax reads every step.

Only such directories are steps. Anything else in the directory (a user's `2023/`, an
empty `5/`, `007`, a symlink, a plain Orbax checkpoint) is ignored: never listed, never
restored, never deleted. The library only ever deletes what it made itself:

- `<step>.jax_cb_ckpt-tmp-<hex>`: a step being written (older versions let Orbax
  write through `<that>.orbax-checkpoint-tmp`); once complete and fsynced it is renamed
  to `<step>` (atomic), so a step directory is complete or absent, and a unique name per
  attempt means two writers can never collide on a temporary name.
- `<step>.jax_cb_ckpt-deleting-<hex>`: a step being deleted (retention, or an explicit
  replace). The rename out of `<step>` is atomic, so a kill during the deletion never
  leaves a half-deleted directory that looks like a step.

Leftovers of either kind (a killed run) are removed when a Checkpointer opens the
directory. Every deletion checks with `lstat` that it removes a real directory, never
a symlink, and `shutil.rmtree` does not follow links inside it: nothing outside the
checkpoint directory is ever touched.

In object storage (`gs://`, `s3://`: `_remote.py`) there is no rename: a step's objects
are written under `<step>/` directly, `<step>/.jax_cb_ckpt` first and Orbax's commit
marker `<step>/commit_success.txt` last, and only a step holding both (and the item
files) is listed. Deleting a step removes its commit marker first (unlisted at once),
our marker last. At an opening, an uncommitted step prefix is deleted only when our
marker names a writer token (`step_writer`) and the prefix either lacks a file of a
whole step (a write cut short) or was begun by the holder whose lock the opening
took over (it died at its commit). A prefix without our marker is never deleted, nor
is a whole step begun by another writer (a step copied here without its commit
marker): those are reported (`clean_leftovers`), never taken for our own.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import re
import shutil
import stat
import time
import uuid
import zlib
from typing import Any, Literal

import numpy as np

from . import _remote, _spec
from ._durable import StepSync, fsync_dir
from ._errors import ConfigError

FORMAT = "jax_cb_ckpt/1"  # tag in every `meta` item; restore checks it
STATE_ITEM = "state"  # Orbax item holding the arrays, as a nested dict
META_ITEM = "meta"  # Orbax item holding the JSON description of the leaves
ITEMS = (STATE_ITEM, META_ITEM)
META_FILE = "metadata"  # the file Orbax's JsonCheckpointHandler writes in META_ITEM
ORBAX_STEP_FILE = "_CHECKPOINT_METADATA"  # written by Orbax when a save is finalized
STATE_METADATA = "_METADATA"  # Orbax's description of the state item's tree
PROCESS_PREFIX = "ocdbt.process_"  # the state item's database of process i > 0
LOCK_NAME = ".jax_cb_ckpt.lock"  # held (flock) by the one live writer of a directory
# Object storage (no rename): a step's objects are written under its final name, this
# one first (the step is ours from then on) and Orbax's commit marker last (the step is
# listed from then on).
OURS_NAME = ".jax_cb_ckpt"
COMMIT_NAME = "commit_success.txt"
_COMPLETE = frozenset(
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
_STEP_FILES = _COMPLETE - {OURS_NAME, COMMIT_NAME}
_TOKEN = re.compile(r"[0-9a-f]{32}", re.ASCII)  # a lock token (`_lock.ObjectLock`)

MAX_STEP = 2**63 - 1  # steps are stored as int64 in the metadata and as decimal names

_STEP_NAME = re.compile(r"0|[1-9][0-9]*", re.ASCII)
_URL = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)://")  # gs://, s3://, file://, ...
# A storage URL with a slash missing (s3:/x, gs:bucket), not a local name like "exp:1".
_URL_SLIP = re.compile(r"(gs|gcs|s3|s3a|hdfs|file|az|abfs|https?):/?(?!/)", re.IGNORECASE)
_OURS = re.compile(
    r"(0|[1-9][0-9]*)\.jax_cb_ckpt-(tmp|deleting)-[0-9a-f]{32}(\.orbax-checkpoint-tmp)?",
    re.ASCII,
)
# Written by versions <= 0.1.0: retention renamed steps into this folder.
_LEGACY_DELETED = "_jax_cb_ckpt_deleted"


def resolve(directory: object, where: str) -> str:
    """The absolute path of a checkpoint directory argument, or a `ConfigError`.

    Every public function takes the same forms: a non-empty str or os.PathLike,
    absolute or relative to the working directory (Orbax itself wants absolute paths).
    """
    if not isinstance(directory, (str, os.PathLike)):
        raise ConfigError(
            f"{where}: directory must be a str or os.PathLike, got "
            f"{type(directory).__name__} ({directory!r})."
        )
    path = os.fspath(directory)
    if not isinstance(path, str) or not path:
        raise ConfigError(
            f"{where}: directory is empty ({directory!r}). Fix: name the checkpoint "
            "directory, e.g. 'runs/exp1' (use '.' to mean the working directory)."
        )
    if "\0" in path:
        raise ConfigError(f"{where}: directory {path!r} contains a NUL character.")
    if _URL.match(path):
        return _remote.canonical(path, where)
    slip = _URL_SLIP.match(path)
    if slip:
        # Taken as a local path, "s3:/bucket/run" is a folder "s3:" in the working
        # directory: a run that looks checkpointed until its machine is gone.
        raise ConfigError(
            f"{where}: directory {path!r} looks like a {slip.group(1)}:// URL with a "
            f"slash missing, and would be taken for a local folder named "
            f"{slip.group(1) + ':'!r}. Fix: write {slip.group(1)}://bucket/path, or "
            "./" + f"{path} if a local folder of that name is really meant."
        )
    # realpath, not abspath: `link/../x` must name the directory the OS means (abspath
    # would drop `link/..` without following the link).
    return os.path.realpath(path)


def is_step_name(name: str) -> bool:
    """`name` is a step number written the way we write it (ASCII decimal, canonical)."""
    return _STEP_NAME.fullmatch(name) is not None and int(name) <= MAX_STEP


def _is_real_dir(path: str) -> bool:
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def _is_real_file(path: str) -> bool:
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


Kind = Literal["complete", "damaged", "foreign"]


@dataclasses.dataclass(frozen=True)
class Examined:
    """What a step-named entry of a checkpoint directory is.

    - "complete": a checkpoint of ours, whole as far as its description files tell
      (the arrays' checksums are `restore`'s and `verify`'s to check);
    - "damaged": it claims to be ours (our `meta` item, or our record in Orbax's step
      file) but is not whole: a partial copy, a truncated or edited file, a folder
      renamed to another step. Reported, never listed, restored or deleted;
    - "foreign": not ours (someone's folder, a plain Orbax checkpoint, another
      version's format): ignored, never deleted.
    `why` says what was found, for messages."""

    kind: Kind
    why: str = ""


COMPLETE = Examined("complete")
# A step-named entry that went away (renamed aside or deleted) while it was examined:
# `examine_all` leaves it out, as a listing made a moment later would.
GONE = Examined("foreign", "removed while it was being examined")
# Bounds on what a step's description files may hold: nothing is read (or parsed)
# beyond them. A meta item is ~150 B per leaf and ~30 B per checksummed chunk: 64 MiB
# is ~400,000 leaves. The writer refuses to write more (`write_meta`).
META_MAX_BYTES = 64 << 20
SMALL_FILE_MAX_BYTES = 1 << 20  # Orbax's step file, `state/_METADATA` is per leaf: see below


def is_checkpoint(path: str) -> bool:
    """`path` is a complete checkpoint of ours (`examine`)."""
    return examine(path).kind == "complete"


def examine(path: str, keys: set[str] | None = None) -> Examined:
    """What the step-named entry `path` is (see `Examined`). Locally: a real directory
    (no symlinks on the way) holding our `state` and `meta` items and the file Orbax
    writes when it finalizes a save, whose meta carries our format tag and the step of
    its folder's name, and matches the size and CRC-32 our record in the step file
    gives (steps written before the record: parsed whole, within `META_MAX_BYTES`).
    Remembered per file identity, so a step listed at every save's retention is read
    once. In object storage (from the keys under it, `keys`, or listed): every object
    `_COMPLETE` names is there; one with our marker or commit marker and not all of
    them is damaged; `restore` checks the description files as here (`load_meta`)."""
    if _remote.is_url(path):
        keys = set(_remote.list_keys(path)) if keys is None else keys
        if _COMPLETE <= keys:
            return COMPLETE
        if OURS_NAME in keys and COMMIT_NAME in keys:
            missing = sorted(_COMPLETE - keys)
            return Examined("damaged", f"committed, but {', '.join(missing)} missing")
        return Examined("foreign", "not a complete jax_cb_ckpt checkpoint")
    try:  # every file is looked at through this descriptor: one directory throughout,
        # even if the step is renamed meanwhile (retention sets steps aside)
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return GONE
    except OSError:
        return Examined("foreign", "not a directory")
    try:
        return _examine_dir(path, fd)
    finally:
        os.close(fd)


def _examine_dir(path: str, fd: int) -> Examined:
    meta = f"{META_ITEM}/{META_FILE}"
    st_meta, st_step = _lstat_in(fd, meta), _lstat_in(fd, ORBAX_STEP_FILE)
    seen = tuple(_stat_key(st) for st in (st_meta, st_step))
    key = os.path.join(path, META_ITEM, META_FILE)
    known = _TAGS.get(key)
    if known is not None and known[0] == seen:
        return known[1]
    found = _examine_files(fd, int(os.path.basename(path)), st_meta, st_step)
    if found.kind != "complete" and not _still_at(path, fd):
        # Removed or set aside while it was examined: say nothing of it.
        return GONE
    if len(_TAGS) >= 4096:
        _TAGS.clear()
    _TAGS[key] = (seen, found)
    return found


# {meta file: (its and the step file's lstat identities when read, what was found)}; a
# step set aside leaves it, so a writer's retention keeps it at the kept steps (a long
# run's memory does not grow with its saves); steps removed by hand leave it at the
# next clearing.
_TAGS: dict[str, tuple[tuple[Any, ...], Examined]] = {}


def _lstat_in(fd: int, name: str) -> os.stat_result | None:
    try:
        return os.lstat(name, dir_fd=fd)
    except OSError:
        return None


def _still_at(path: str, fd: int) -> bool:
    """The directory open as `fd` is still the one named `path`."""
    try:
        now, then = os.lstat(path), os.fstat(fd)
    except OSError:
        return False
    return (now.st_dev, now.st_ino) == (then.st_dev, then.st_ino)


def _stat_key(st: os.stat_result | None) -> tuple[int, ...] | None:
    if st is None:
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_mode)


def _read_in(fd: int, name: str, limit: int) -> bytes:
    """`read_bytes` of the file `name` in the directory open as `fd` (not a link)."""
    file = os.open(name, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=fd)
    with os.fdopen(file, "rb") as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise DamagedStep(f"'{name}' is larger than {limit} bytes, more than the library writes")
    return data


def _is_in(fd: int, name: str, kind: Any) -> bool:
    st = _lstat_in(fd, name)
    return st is not None and kind(st.st_mode)


def _examine_files(
    fd: int, step: int, st_meta: os.stat_result | None, st_step: os.stat_result | None
) -> Examined:
    """What the step directory open as `fd` is, from its files (`examine`)."""
    record = None
    if st_step is not None and stat.S_ISREG(st_step.st_mode):
        try:
            record = _record_of(_read_in(fd, ORBAX_STEP_FILE, SMALL_FILE_MAX_BYTES))
        except (OSError, ValueError):
            record = None
    if st_meta is None and record is None:
        return Examined("foreign", f"no '{META_ITEM}' item of jax_cb_ckpt")
    for item in (STATE_ITEM, META_ITEM):
        if not _is_in(fd, item, stat.S_ISDIR):
            return Examined("damaged", f"its '{item}' item is missing")
    if st_step is None or not stat.S_ISREG(st_step.st_mode):
        return Examined("damaged", f"Orbax's step file {ORBAX_STEP_FILE} is missing")
    if not _is_in(fd, f"{STATE_ITEM}/{STATE_METADATA}", stat.S_ISREG):
        return Examined("damaged", f"'{STATE_ITEM}/{STATE_METADATA}' is missing")
    if st_meta is None or not stat.S_ISREG(st_meta.st_mode):
        return Examined("damaged", f"'{META_ITEM}/{META_FILE}' is missing")
    try:
        text = _read_in(fd, f"{META_ITEM}/{META_FILE}", META_MAX_BYTES)
        check_meta_bytes(text, step, record)
    except DamagedStep as e:
        return Examined(e.kind, str(e))
    except OSError as e:
        return Examined("damaged", f"'{META_ITEM}/{META_FILE}' cannot be read ({e.strerror})")
    return COMPLETE


class DamagedStep(ValueError):
    """A step's description files are not what was written (`kind` "damaged"), or are
    another program's (`kind` "foreign"); the text says what was found."""

    def __init__(self, text: str, kind: Kind = "damaged") -> None:
        super().__init__(text)
        self.kind: Kind = kind


def read_bytes(path: str, limit: int) -> bytes:
    """A small file of a step (or an object), refused (`DamagedStep`) when larger than
    `limit`: a file is read no further than that; an object is read whole first
    (TensorStore refuses a byte range past an object's end, and lists no sizes).
    `FileNotFoundError` when absent."""
    if _remote.is_url(path):
        data, _ = _remote.read(path)
        if data is None:
            raise FileNotFoundError(f"{path} does not exist")
    else:
        with open(path, "rb") as f:
            data = f.read(limit + 1)
    return _within(path, data, limit)


def _within(path: str, data: bytes, limit: int) -> bytes:
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


def _record_of(step_file: bytes) -> dict[str, Any] | None:
    """Our record in Orbax's step file (`write_meta`), or None (another writer's file,
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


def load_meta(step_dir: str, step: int) -> dict[str, Any]:
    """The `meta` item of checkpoint `step` (its folder `step_dir`), read within
    `META_MAX_BYTES` and checked as `examine` checks it (`DamagedStep`)."""
    return open_step(step_dir, step)[1]


def open_step(step_dir: str, step: int) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """(`identity` of checkpoint `step`, its `meta` item as `load_meta` reads it),
    taken before its arrays are read. In object storage the commit marker, Orbax's step
    file and the meta item are read at once (one round trip); `FileNotFoundError`
    when the step is not (or no longer) committed."""
    step_file = os.path.join(step_dir, ORBAX_STEP_FILE)
    meta = os.path.join(step_dir, META_ITEM, META_FILE)
    if _remote.is_url(step_dir):
        marker, (step_bytes, _), (text, _) = _remote.read_many(
            [f"{step_dir}/{COMMIT_NAME}", step_file, meta]
        )
        if marker[0] is None:
            raise FileNotFoundError(f"{step_dir} is not a complete step")
        for path, data in ((step_file, step_bytes), (meta, text)):
            if data is None:
                raise FileNotFoundError(f"{path} does not exist")
        seen = ("object", marker[1])
        record = _record_of(_within(step_file, step_bytes or b"", SMALL_FILE_MAX_BYTES))
        return seen, check_meta_bytes(_within(meta, text or b"", META_MAX_BYTES), step, record)
    seen = identity(step_dir)
    record = _record_of(read_bytes(step_file, SMALL_FILE_MAX_BYTES))
    return seen, check_meta_bytes(read_bytes(meta, META_MAX_BYTES), step, record)


def symlinks_inside(path: str) -> list[str]:
    """Symlinks anywhere under `path` (a checkpoint of ours has none: reading one could
    read outside the directory). Object storage has none."""
    if _remote.is_url(path):
        return []
    found = []
    for root, dirs, files in os.walk(path):
        found += [
            os.path.join(root, n) for n in dirs + files if os.path.islink(os.path.join(root, n))
        ]
    return found


def list_steps(path: str) -> list[int]:
    """Steps with a complete checkpoint in `path`, ascending (see the module doc)."""
    return sorted(step for step, found in examine_all(path).items() if found.kind == "complete")


def examine_all(path: str) -> dict[int, Examined]:
    """{step: what its entry is} for every step-named entry of `path` (`examine`);
    empty when `path` does not exist. Nothing in one entry stops the others from
    being examined."""
    if _remote.is_url(path):
        by_step = _objects_by_step(path)
        return {int(n): examine(f"{path}/{n}", keys) for n, keys in by_step.items()}
    try:
        names = os.listdir(path)
    except (FileNotFoundError, NotADirectoryError):
        return {}
    except OSError as e:
        raise ConfigError(f"cannot list the checkpoint directory {path!r}: {e}") from e
    found = {int(n): examine(os.path.join(path, n)) for n in names if is_step_name(n)}
    return {step: f for step, f in found.items() if f is not GONE}


def foreign_steps(path: str) -> list[int]:
    """Step-like names in `path` that are not complete checkpoints of ours (for error
    messages: a plain Orbax checkpoint, an empty or half-copied directory)."""
    try:
        found = examine_all(path)
    except ConfigError:
        return []
    return sorted(step for step, f in found.items() if f.kind != "complete")


def damaged_steps(path: str) -> dict[int, str]:
    """{step: what is wrong} for the steps of ours in `path` that are damaged."""
    return {step: f.why for step, f in sorted(examine_all(path).items()) if f.kind == "damaged"}


def _objects_by_step(url: str) -> dict[str, set[str]]:
    """Object storage: {step name: the keys under it} for every step-named prefix."""
    try:
        keys = _remote.list_keys(url)
    except _remote.StorageError as e:
        raise ConfigError(f"cannot list the checkpoint directory {url!r}: {e}") from e
    by_step: dict[str, set[str]] = {}
    for key in keys:
        name, _, rest = key.partition("/")
        if rest and is_step_name(name):
            by_step.setdefault(name, set()).add(rest)
    return by_step


def exists(path: str) -> bool:
    """Something is at `path` (a file, directory or link; in object storage, any
    object under the prefix)."""
    if _remote.is_url(path):
        return bool(_remote.list_keys(path))
    return os.path.lexists(path)


def begin_step(temp: str, writer: str = "") -> None:
    """Make the place a step is written to: its temporary directory and item folders;
    in object storage our marker object, written before any other object of the step
    (only if absent), naming the `writer` (its lock token: `step_writer`)."""
    if _remote.is_url(temp):
        marker = json.dumps({"format": FORMAT, "writer": writer}).encode()
        if _remote.write(f"{temp}/{OURS_NAME}", marker, if_equal=_remote.ABSENT) is None:
            raise FileExistsError(f"{temp} was begun by another writer meanwhile")
        return
    os.makedirs(os.path.join(temp, STATE_ITEM))
    os.makedirs(os.path.join(temp, META_ITEM))


def step_writer(url: str) -> str | None:
    """Object storage: the writer (lock token) that began step `url`; None when there
    is no marker, or the object under its name is not our marker (our format tag and a
    token as a lock makes them)."""
    data, _ = _remote.read(f"{url}/{OURS_NAME}")
    try:
        marker = json.loads(data or b"{}")
    except ValueError:
        return None
    if not isinstance(marker, dict) or marker.get("format") != FORMAT:
        return None
    writer = marker.get("writer")
    return writer if isinstance(writer, str) and _TOKEN.fullmatch(writer) else None


def commit_step(directory: str, temp: str, final: str, nbytes: int, sync: StepSync) -> None:
    """A complete step (of about `nbytes` bytes) becomes listed: its files made durable
    (`sync`, made before they were written), renamed into place (atomic), the directory
    fsynced; in object storage, its commit marker written (last)."""
    if _remote.is_url(final):
        # Orbax on GCS reads a directory only with its marker: plain Orbax restores
        # `<step>/state` as it does on a local disk (docs/storage.md).
        marker = b"Checkpoint commit was successful."
        _remote.write_many({f"{final}/{item}/{COMMIT_NAME}": marker for item in ITEMS})
        if _remote.write(f"{final}/{COMMIT_NAME}", marker, if_equal=_remote.ABSENT) is None:
            raise FileExistsError(f"{final} was committed by another writer meanwhile")
        return
    sync.tree(temp, nbytes)
    os.rename(temp, final)
    fsync_dir(directory)


def temp_name(step: int) -> str:
    return f"{step}.jax_cb_ckpt-tmp-{uuid.uuid4().hex}"


def run_temp_name(step: int, run: str, attempt: int) -> str:
    """An attempt's temporary directory in a multi-process run, the same in every
    process: 24 hex digits of the run, 8 of the attempt (32, as `_OURS` expects)."""
    return f"{step}.jax_cb_ckpt-tmp-{run[:24]}{attempt:08x}"


def remove_run_temps(directory: str, run: str) -> None:
    """Delete every temporary directory of the multi-process run `run`: called when a
    step was committed, after which none of its earlier attempts is written to (a
    late process may have re-created the one of an attempt that had failed). Object
    storage has no temporary names."""
    if _remote.is_url(directory):
        return
    _remove_our_temporaries(directory, f".jax_cb_ckpt-tmp-{run[:24]}")


def unfinished_steps(directory: str) -> list[tuple[int, str]]:
    """(step, path) of every step of ours being written in `directory`, or left by a
    killed writer: our temporary directories; in object storage, steps with our
    marker and no commit marker."""
    if _remote.is_url(directory):
        return [
            (int(name), f"{directory}/{name}")
            for name, keys in sorted(_objects_by_step(directory).items())
            if OURS_NAME in keys and COMMIT_NAME not in keys
        ]
    found = []
    for name in sorted(os.listdir(directory)):
        match = _OURS.fullmatch(name)
        if match is not None and match.group(2) == "tmp" and not match.group(3):
            found.append((int(match.group(1)), os.path.join(directory, name)))
    return found


def _remove_our_temporaries(directory: str, marker: str = "") -> None:
    """Delete our temporary names in `directory` (those holding `marker`)."""
    try:
        names = os.listdir(directory)
    except OSError:
        return
    for name in names:
        if marker in name and _OURS.fullmatch(name):
            _remove_ours(os.path.join(directory, name))


def _remove_ours(path: str) -> None:
    """Delete a directory we made (never a symlink: lstat, and rmtree refuses links)."""
    if _is_real_dir(path):
        shutil.rmtree(path, ignore_errors=True)


def remove_temp(directory: str, name: str, writer: str = "") -> None:
    """Delete one attempt's temporary directory and Orbax's inside-out temporary of it.
    In object storage (written under its final name): the step's objects, if the
    `writer` (its lock token) began it and it was not committed; a prefix that was
    there before (a step copied there) or another writer's is never deleted."""
    if _remote.is_url(directory):
        url = f"{directory}/{name}"
        try:
            keys = set(_remote.list_keys(url))
            if OURS_NAME in keys and COMMIT_NAME not in keys and step_writer(url) == writer:
                _remove_remote_step(url)
        except _remote.StorageError:
            pass  # storage gone: the next opening removes what is left (unlisted)
        return
    _remove_ours(os.path.join(directory, name))
    _remove_ours(os.path.join(directory, name + ".orbax-checkpoint-tmp"))


def remove_step(directory: str, step: int) -> bool:
    """Delete checkpoint `step`: renamed aside first (atomic), then removed.

    Returns False (and touches nothing) when `<step>` is not a checkpoint of ours.
    """
    aside = set_aside(directory, step)
    if aside is None:
        return False
    if not _remote.is_url(directory):
        fsync_dir(directory)
    remove_aside(aside)
    return True


def set_aside(directory: str, step: int) -> str | None:
    """Unlist checkpoint `step`: renamed aside (atomic), for `remove_aside` to delete
    later. None (and nothing touched) when `<step>` is not a checkpoint of ours. Not
    fsynced: a crash that loses the rename gives the step back, complete, and the next
    retention sets it aside again; a crash after it leaves a leftover that the next
    opening removes."""
    source = os.path.join(directory, str(step))
    if not is_checkpoint(source):
        return None
    if _remote.is_url(source):  # unlisted as its commit marker goes
        _remote.delete(f"{source}/{COMMIT_NAME}")
        return source
    aside = os.path.join(directory, f"{step}.jax_cb_ckpt-deleting-{uuid.uuid4().hex}")
    os.rename(source, aside)
    _TAGS.pop(os.path.join(source, META_ITEM, META_FILE), None)  # it holds kept steps only
    return aside


def remove_aside(path: str) -> None:
    if _remote.is_url(path):
        try:
            _remove_remote_step(path)
        except _remote.StorageError:
            pass  # unlisted already; the next opening removes the rest
        return
    _remove_ours(path)


def _remove_remote_step(url: str) -> None:
    """Delete an unlisted step of ours from object storage: our marker last, so that a
    deletion cut short is still recognised as ours (and finished by the next opening)."""
    _remote.delete_prefix(url, keep=OURS_NAME)
    _remote.delete(f"{url}/{OURS_NAME}")


def clean_leftovers(directory: str, dead_writer: str = "") -> list[str]:
    """Remove what a killed writer of ours left: temporaries and half-done deletions.
    In object storage: every uncommitted step prefix our marker says a writer of ours
    began (`step_writer`), if it lacks a file of a whole step (a write cut short) or
    was begun by `dead_writer` (the token of the lock's holder this opening took over:
    it died at its commit). Returns the uncommitted prefixes left in place that hold a
    whole step (copied there without a commit marker, or begun by a writer not known
    to be dead), for the caller to report: nothing without our marker is deleted."""
    if _remote.is_url(directory):
        untouched = []
        for name, keys in sorted(_objects_by_step(directory).items(), key=lambda x: int(x[0])):
            if COMMIT_NAME in keys:
                continue
            url = f"{directory}/{name}"
            writer = step_writer(url) if OURS_NAME in keys else None
            whole = _STEP_FILES <= keys
            if writer is not None and (not whole or writer == dead_writer):
                _remove_remote_step(url)
            elif whole:
                untouched.append(url)
        return untouched
    _remove_our_temporaries(directory)
    legacy = os.path.join(directory, _LEGACY_DELETED)
    if _is_real_dir(legacy):  # a symlink here is never followed, only ignored
        shutil.rmtree(legacy, ignore_errors=True)
    return []


def step_meta(
    step: int,
    leaves: list[dict[str, Any]],
    versions: dict[str, str],
    *,
    shardings: dict[str, Any],
    batch_shape: tuple[int, ...],
    members: list[Any],
    saved_at: float | None = None,
) -> dict[str, Any]:
    """The `meta` item of a step (written by the host side, completed with `checksums`
    by the writer; read back as a `StepMeta` by restore, `verify` and the CLI, and
    returned as it is by `metadata()`), the schema in one place:

    - `format` (FORMAT), `library_version`, `jax_version`, `jaxlib_version`,
      `orbax_version`, `tensorstore_version`: what wrote it (`versions`);
    - `step`, `saved_at` (UTC, ISO 8601, ms; `saved_at`: when it was handed over, in
      seconds since the epoch, else now);
    - `leaves`: one `LeafSpec.to_json()` per leaf, in the state's order;
    - `shardings` (only leaves saved per device): {leaf path: {"mesh": {axis: size},
      "spec": [[mesh axes] per dimension]}};
    - `batch_shape`, `members` (only saves under vmap): the batch axes, and which
      members asked for the save;
    - `checksums`: {leaf name: {region: CRC-32}} (`_store.py`, `_read.py`).
    """
    meta: dict[str, Any] = dict(
        versions,
        format=FORMAT,
        step=step,
        saved_at=datetime.datetime.fromtimestamp(
            time.time() if saved_at is None else saved_at, datetime.UTC
        ).isoformat(timespec="milliseconds"),
        leaves=leaves,
    )
    if shardings:
        meta["shardings"] = shardings
    if batch_shape:
        meta["batch_shape"] = list(batch_shape)
        meta["members"] = members
    return meta


@dataclasses.dataclass(frozen=True)
class StepMeta:
    """A step's `meta` item as read back (the schema of `step_meta`), checked: restore,
    verify and the CLI read these fields, never the JSON's keys. What a version before
    a field existed did not record has its default."""

    step: int
    leaves: tuple[_spec.LeafSpec, ...]
    batch_shape: tuple[int, ...] = ()  # () unless saved under vmap
    # Which members asked for the save (bool, batch_shape); all of them when not recorded.
    members: np.ndarray = dataclasses.field(default_factory=lambda: np.ones((), bool))
    checksums: dict[str, Any] | None = None  # None: written before checksums were kept
    shardings: dict[str, Any] = dataclasses.field(default_factory=dict)
    saved_at: str | None = None
    versions: dict[str, str] = dataclasses.field(default_factory=dict)

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
        batch = meta.get("batch_shape", [])
        if not isinstance(batch, list) or not all(
            isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in batch
        ):
            raise ValueError(f"'batch_shape' {batch!r} is not a list of non-negative ints")
        members = np.asarray(meta.get("members", np.ones(batch, bool)), dtype=bool)
        if members.shape != tuple(batch):
            raise ValueError(f"'members' has shape {members.shape}, not the batch's {tuple(batch)}")
        for field in ("checksums", "shardings"):
            if meta.get(field) is not None and not isinstance(meta[field], dict):
                raise TypeError(f"{field!r} is a {type(meta[field]).__name__}, not an object")
        specs = tuple(_spec.LeafSpec.from_json(leaf) for leaf in leaves)
        stored = {".".join(spec.name): spec.stored_shape for spec in specs}
        for name, sums in (meta.get("checksums") or {}).items():
            _check_sums(name, sums, stored.get(name))
        versions = {k: str(v) for k, v in meta.items() if k.endswith("_version")}
        return cls(
            step=step,
            leaves=specs,
            batch_shape=tuple(batch),
            members=members,
            checksums=meta.get("checksums"),
            shardings=meta.get("shardings") or {},
            saved_at=meta.get("saved_at"),
            versions=versions,
        )


def _check_sums(name: str, sums: Any, shape: tuple[int, ...] | None) -> None:
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


def write_meta(path: str, meta: dict[str, Any]) -> None:
    """The `meta` item (the JSON file Orbax's JsonCheckpointHandler reads), then Orbax's
    step file holding our record of it (`write_step_file`): listing and restore
    check the item against the record, so a cut or edited item, or a folder renamed
    to another step, is found damaged instead of restored."""
    text = json.dumps(meta).encode()
    if len(text) > META_MAX_BYTES:
        raise ValueError(
            f"the step's description is {len(text)} bytes, more than the "
            f"{META_MAX_BYTES} a reader accepts (a state of about {len(meta['leaves'])} "
            "leaves): save fewer, larger leaves (e.g. stack them)"
        )
    write_text(os.path.join(path, META_ITEM, META_FILE), text)
    write_step_file(
        path, {"step": meta["step"], "meta_bytes": len(text), "meta_crc32": zlib.crc32(text)}
    )


def write_text(path: str, text: str | bytes) -> None:
    """A small file of a step (not fsynced here: `commit_step` syncs the step), or an
    object in object storage, created only if absent: a writer that lost the location
    while paused never overwrites the new holder's step."""
    data = text.encode() if isinstance(text, str) else text
    if _remote.is_url(path):
        if _remote.write(path, data, if_equal=_remote.ABSENT) is None:
            raise FileExistsError(f"{path} was written by another writer meanwhile")
        return
    with open(path, "wb") as f:
        f.write(data)


def read_text(path: str) -> str:
    """A small file of a step (or an object); `FileNotFoundError` when absent."""
    if _remote.is_url(path):
        data, _ = _remote.read(path)
        if data is None:
            raise FileNotFoundError(f"{path} does not exist")
        return data.decode()
    with open(path, "rb") as f:
        return f.read().decode()


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


def write_step_file(path: str, record: dict[str, Any]) -> None:
    """The file Orbax's Checkpointer writes when it finalizes a save: which handler
    wrote each item (so a CheckpointManager reads them without being told), and when;
    in its `custom_metadata`, our `record` of the step ({step, meta_bytes,
    meta_crc32}: `write_meta`)."""
    now = time.time_ns()
    content = {
        "item_handlers": dict(HANDLERS),
        "metrics": {},
        "performance_metrics": {},
        "init_timestamp_nsecs": now,
        "commit_timestamp_nsecs": now,
        "custom_metadata": {_RECORD: dict(record, format=FORMAT)},
    }
    write_text(os.path.join(path, ORBAX_STEP_FILE), json.dumps(content))


def identity(path: str) -> tuple[Any, ...]:
    """(device, inode) of `path`: tells a directory from one re-created under its name.
    A step in object storage: the generation of its commit marker."""
    if _remote.is_url(path):
        data, generation = _remote.read(f"{path}/{COMMIT_NAME}")
        if data is None:
            raise FileNotFoundError(f"{path} is not a complete step")
        return ("object", generation)
    st = os.stat(path)
    return st.st_dev, st.st_ino
