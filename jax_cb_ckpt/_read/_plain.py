"""Plain Orbax checkpoints: a `CheckpointManager`'s steps, found beside ours and read.

A run that saved with Orbax's `CheckpointManager` and then switched to this library
leaves steps this library did not write: a folder named by the step, holding Orbax's
`_CHECKPOINT_METADATA` (which names each item's handler) and the items. A step whose
one pytree item (`StandardSave` or `PyTreeSave`: the item named "state", or "default"
for a manager without item names, or the only one) can be read is a step a restart
resumes from (`_resume`): nothing else marks it, and training must not silently start
again at 0 beside it.

This is the one recognition every reader uses (`steps`, and `listed` / `step` for the
ones without a problem): `all_steps`, `latest_step`, `restore` with and without
`step=`, `metadata`, `verify`, a Checkpointer's conflicts and `jax-cb-ckpt ls | show |
verify` list and read the same plain steps, each marked as Orbax's (`describe`).

It is read with Orbax itself, which keeps no checksums: it is resumed from unverified,
and said so. What it holds is checked against `like` here, leaf by leaf, before it is
read: Orbax casts a dtype to the target's silently (float32 into int32 truncates) and
checks no shape for numpy targets, so neither reaches `like`. A typed PRNG key of `like`
takes the stored raw key data (Orbax stores typed keys so, and `PRNGKey` data is so).
The step is never written, set aside or deleted.

Runs in the caller's thread and blocks it while it reads; imports Orbax (~0.3 s more
than JAX) only when such a step is read. Recognising one needs numpy alone, so
`jax-cb-ckpt ls` says which folders a restart would resume from without importing JAX.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from .._base import _dtypes
from .._base._errors import (
    ConfigError,
    DamagedStepError,
    RestoreError,
    StructureMismatchError,
    calling,
    where,
)
from .._layout import _format, _spec
from .._layout._format import ORBAX_STEP_FILE, SMALL_FILE_MAX_BYTES, STATE_METADATA, Examined
from .._storage import _faults
from .._storage._protocol import Storage

if TYPE_CHECKING:  # (JAX's: imported where a step is read, `_restore`)
    from ._request import Request

# The handlers of a pytree item, by the name Orbax records (its module paths move).
_PYTREE_HANDLERS = ("StandardCheckpointHandler", "PyTreeCheckpointHandler")


@dataclasses.dataclass(frozen=True)
class PlainStep:
    """A step folder of plain Orbax's, its pytree item, and where it is (`path`: a
    local path or URL). `problem`: why it cannot be resumed from (several pytree
    items, no readable description), said by the restart that passes it over."""

    step: int
    item: str
    path: str
    problem: str | None = None
    saved_at: str | None = None  # Orbax's commit time (UTC, ISO 8601), when it says


# The format tag `metadata()` gives a plain Orbax step (`describe`); ours is `FORMAT`.
PLAIN_FORMAT = "orbax"


def steps(storage: Storage, found: dict[int, Examined]) -> dict[int, PlainStep]:
    """{step: what it is} for the entries `found` (`Storage.examine_all`) that are not
    ours and hold Orbax's step file naming a pytree item (or, for an Orbax version that
    names none, one item folder with Orbax's `_METADATA`)."""
    plain = {}
    for step, examined in found.items():
        if examined.kind != "foreign" or examined == _format.UNFINISHED:
            continue  # (a bucket step of ours cut short holds Orbax's item files too)
        try:
            text = storage.step_file(step, ORBAX_STEP_FILE, SMALL_FILE_MAX_BYTES)
        except (_format.DamagedStep, OSError):
            continue
        if text is not None:
            recognised = _recognised(storage, step, text)
            if recognised is not None:
                plain[step] = recognised
            continue
        # No step file (an Orbax version that wrote none, or lost): one item folder of a
        # manager's names with Orbax's description of a tree is a step of Orbax's too.
        items = [item for item in ("state", "default") if _described(storage, step, item)]
        if len(items) == 1:
            path = storage.step_path(step)
            problem = None
            if storage.symlinks_inside(step):
                problem = "it holds symlinks (a read could leave the directory)"
            plain[step] = PlainStep(step, items[0], path, problem)
    return plain


def listed(storage: Storage, found: dict[int, Examined]) -> dict[int, PlainStep]:
    """The plain Orbax steps of `steps` that a restart resumes from (no problem): the
    ones every listing shows and every read takes, beside the complete steps of ours."""
    return {s: p for s, p in steps(storage, found).items() if p.problem is None}


def find(storage: Storage, number: int) -> PlainStep | None:
    """Step `number` when it is a plain Orbax step that `listed` shows, else None (one
    of ours, a damaged or foreign folder, none): asked once a read of ours found no
    step of ours there."""
    found = storage.examine_all().get(number)
    if found is None:
        return None
    return listed(storage, {number: found}).get(number)


def describe(storage: Storage, found: PlainStep) -> dict[str, Any]:
    """What `metadata()` and `jax-cb-ckpt show` give for a plain Orbax step, read with
    the standard library (no Orbax): `format` "orbax" (ours say `FORMAT`), `step`,
    `item` (the pytree item read), `checksums` None (Orbax keeps none: it is read
    unverified), `saved_at` (Orbax's commit time, or None), `leaf_names` (the stored
    leaves' names, from Orbax's `_METADATA`: their shapes and dtypes are Orbax's to
    read, `ocp.PyTreeCheckpointer().metadata`), `metrics` (the manager's `metrics`
    item, when it holds numbers: `metrics()` returns them) and `orbax`: Orbax's
    `_CHECKPOINT_METADATA` as it is (None when it is missing or not JSON)."""
    record = _json(storage, found.step, ORBAX_STEP_FILE, SMALL_FILE_MAX_BYTES)
    tree = _json(storage, found.step, f"{found.item}/{STATE_METADATA}", _format.META_MAX_BYTES)
    entries = tree.get("tree_metadata") if isinstance(tree, dict) else None
    names = []
    for entry in entries.values() if isinstance(entries, dict) else ():
        keys = entry.get("key_metadata") if isinstance(entry, dict) else None
        if isinstance(keys, list):
            names.append([str(k.get("key")) if isinstance(k, dict) else "?" for k in keys])
    # A manager given `metrics=` writes them as its JSON item "metrics" (its best_fn's).
    recorded = _json(storage, found.step, "metrics/metrics", SMALL_FILE_MAX_BYTES)
    try:
        metrics = _format.parse_metrics(recorded if isinstance(recorded, dict) else {})
    except (TypeError, ValueError):
        metrics = {}
    return {
        "format": PLAIN_FORMAT,
        "step": found.step,
        "item": found.item,
        "checksums": None,
        "saved_at": found.saved_at,
        "leaf_names": names,
        "metrics": {name: value.tolist() for name, value in metrics.items()},
        "orbax": record if isinstance(record, dict) else None,
    }


def is_described(meta: dict[str, Any]) -> bool:
    """`meta` (what `metadata()` gave) is a plain Orbax step's (`describe`)."""
    return meta.get("format") == PLAIN_FORMAT


def _json(storage: Storage, step: int, name: str, limit: int) -> Any:
    """A small JSON file of a plain step, or None (missing, too large, not JSON)."""
    try:
        data = storage.step_file(step, name, limit)
        return None if data is None else _format.load_json(data, name)
    except (_format.DamagedStep, OSError):
        return None


def _commit_time(record: object) -> str | None:
    """Orbax's commit time of a step (`commit_timestamp_nsecs` in its step file), in
    the form `saved_at` has; None when it does not say."""
    nsecs = record.get("commit_timestamp_nsecs") if isinstance(record, dict) else None
    if not isinstance(nsecs, int) or isinstance(nsecs, bool) or not 0 < nsecs < 2**63:
        return None
    when = datetime.datetime.fromtimestamp(nsecs / 1e9, datetime.UTC)
    return when.isoformat(timespec="milliseconds")


def _described(storage: Storage, step: int, item: str) -> bool:
    try:
        return storage.step_file(step, f"{item}/{STATE_METADATA}", SMALL_FILE_MAX_BYTES) is not None
    except (_format.DamagedStep, OSError):
        return True  # (there, and larger than a description: its reading says so)


def _recognised(storage: Storage, step: int, text: bytes) -> PlainStep | None:
    """What the step folder whose Orbax step file holds `text` is: None when it is not
    a step of Orbax's (the file is not Orbax's JSON naming item handlers, or it carries
    our record: a step of ours, uncommitted or copied without its marker)."""
    path = storage.step_path(step)
    try:
        record = json.loads(text)
        ours = _format.record_of(text) is not None
    except (ValueError, RecursionError):
        return None
    handlers = record.get("item_handlers") if isinstance(record, dict) else None
    if not isinstance(handlers, dict) or ours:
        return None
    items = sorted(
        name
        for name, handler in handlers.items()
        if isinstance(name, str)
        and isinstance(handler, str)
        and handler.rsplit(".", 1)[-1] in _PYTREE_HANDLERS
    )
    if not items:
        return PlainStep(step, "", path, "a plain Orbax step without a pytree item")
    named = [i for i in ("state", "default") if i in items]
    item = items[0] if len(items) == 1 else (named[0] if named else "")
    if not item:
        return PlainStep(
            step,
            "",
            path,
            f"a plain Orbax step with several pytree items {items}: which one "
            "is the state is not known",
        )
    try:
        described = storage.step_file(step, f"{item}/{STATE_METADATA}", _format.META_MAX_BYTES)
    except (_format.DamagedStep, OSError):
        described = None
    if described is None:
        return PlainStep(step, item, path, f"its item {item!r} has no readable {STATE_METADATA}")
    if storage.symlinks_inside(step):
        return PlainStep(step, item, path, "it holds symlinks (a read could leave the directory)")
    return PlainStep(step, item, path, saved_at=_commit_time(record))


def restore(found: PlainStep, request: Request, *, member: object = None) -> Any:
    """The plain Orbax step `found` read into the types of the request's `like` (see
    the module's doc; with `request.partial`, only like's leaves are read):
    `StructureMismatchError` naming the first leaf that differs; `DamagedStepError` for
    a step that cannot be read as it describes itself; `RestoreError` otherwise."""
    with calling(f"{where()}: plain Orbax step {found.step} ({found.path}/{found.item})"):
        return _checked_restore(found, request, member)


def _checked_restore(found: PlainStep, request: Request, member: object) -> Any:
    if found.problem is not None:
        raise DamagedStepError(
            f"{where()}: cannot be resumed from: {found.problem}.", found.problem
        )
    if member is not None:
        raise ConfigError(
            f"{where()}: member= reads one member of a batch this library saved under vmap; "
            "a plain Orbax step records no batch. Fix: restore the whole state."
        )
    with _quiet_orbax():
        return _restore(found, request)


def read_whole(found: PlainStep) -> None:
    """Every array of the plain Orbax step `found` read with Orbax, as numpy, and
    dropped (`verify`): a cut or missing file fails (`DamagedStepError`), as it would
    fail a restore. Orbax keeps no checksums, so this cannot tell a changed number:
    the step is readable, never verified. Holds the whole step in memory at once."""
    with calling(f"{where()}: plain Orbax step {found.step} ({found.path}/{found.item})"):
        if found.problem is not None:
            raise DamagedStepError(f"{where()}: cannot be read: {found.problem}.", found.problem)
        with _quiet_orbax():
            _read_tree(found)


def _read_tree(found: PlainStep) -> Any:
    """The step's pytree item as Orbax reads it without a target (`_read_arrays`)."""
    return _read_arrays(found, _stored_tree(found))


def _stored_tree(found: PlainStep) -> Any:
    """Orbax's description of the step's pytree item: a nested tree of its metadata
    (an array's shape and dtype, or a number's), read before any array is."""
    import orbax.checkpoint as ocp  # (only when such a step is read: see the module doc)

    try:
        described = ocp.PyTreeCheckpointer().metadata(f"{found.path}/{found.item}").item_metadata
    except Exception as e:
        raise _failure("its description", e) from e
    if described is None:
        raise DamagedStepError(f"{where()}: Orbax finds no description of it", "no description")
    return described.tree


def _read_arrays(found: PlainStep, tree: Any, wanted: set[tuple[str, ...]] | None = None) -> Any:
    """The arrays of the item `tree` describes, read by Orbax as numpy (host memory,
    whatever device wrote them), and Python numbers for the numbers it stored; with
    `wanted` (stored names), only those: every other leaf is Orbax's `PLACEHOLDER`,
    which it neither reads nor returns."""
    import orbax.checkpoint as ocp

    def args(leaf: object) -> Any:
        is_scalar = isinstance(leaf, ocp.metadata.value.ScalarMetadata)
        return ocp.RestoreArgs() if is_scalar else ocp.RestoreArgs(restore_type=np.ndarray)

    try:
        restore_args = _map(args, tree)
        item = None
        if wanted is not None:
            item = _map_named(lambda n, v: v if n in wanted else ocp.PLACEHOLDER, tree)
            restore_args = _map_named(lambda n, v: v if n in wanted else None, restore_args)
        return ocp.PyTreeCheckpointer().restore(
            f"{found.path}/{found.item}",
            args=ocp.args.PyTreeRestore(item=item, restore_args=restore_args),
        )
    except Exception as e:
        raise _failure("its arrays", e) from e


@contextlib.contextmanager
def _quiet_orbax() -> Iterator[None]:
    """Orbax logs through absl on the root logger (a WARNING for every item it reads
    without a `_CHECKPOINT_METADATA` of its own): kept out of the user's log while we
    read; what matters reaches the user as our errors."""
    absl = logging.getLogger("absl")
    level = absl.level
    absl.setLevel(logging.ERROR)
    try:
        yield
    finally:
        absl.setLevel(level)


def _restore(found: PlainStep, request: Request) -> Any:
    # JAX's: only where a step is read; recognising one (`steps`, for `jax-cb-ckpt ls`)
    # needs numpy alone.
    from . import _rebuild

    tree = _stored_tree(found)
    stored = _leaves(tree)
    like_specs = request.specs
    saved_specs = [_saved_spec(spec, stored) for spec in like_specs]
    names = {spec.name for spec in like_specs}
    extra = sorted(set(stored) - names)
    if extra and not request.partial:
        raise StructureMismatchError(
            f"{where()}: it holds leaf {'/'.join(extra[0])!r}, which like does not have. Fix: "
            "pass a like with the structure of the state Orbax saved, or "
            "partial_restore=True to restore only like's leaves."
        )
    read = _leaves(_read_arrays(found, tree, names if extra else None))
    leaves = []
    for leaf, spec, saved in zip(request.leaves, like_specs, saved_specs, strict=True):
        array = _as_saved(read[spec.name], saved)
        if array.shape != saved.stored_shape or array.dtype.name != saved.dtype:
            raise DamagedStepError(
                f"{where()}: leaf {spec.path} is described as {saved.dtype}"
                f"{list(saved.stored_shape)} and holds {array.dtype.name}{list(array.shape)}",
                f"leaf {spec.path}'s data is not what its description says",
            )
        leaves.append(_rebuild.rebuild(leaf, spec, saved, array))
    return request.build(leaves)


def _as_saved(value: Any, saved: _spec.LeafSpec) -> np.ndarray:
    """A leaf as Orbax read it, as an array of its described dtype. A number Orbax
    stored (`ScalarMetadata`: a numpy scalar or a Python number, saved with
    `PyTreeSave`) comes back from Orbax as a Python number (int64 or float64 once an
    array: its `ScalarHandler` returns `.item()`), and is taken back to the dtype it
    was stored in when that is exact (it always is for what Orbax wrote: np.int32(20)
    is read as 20). `rebuild` then casts it to like's dtype, again only exactly (a
    Python 2**40 into an int32 like, or 0.1 into a float32 one, is refused naming the
    leaf). An array is taken as read: its dtype is checked by the caller."""
    array = np.asarray(value)
    if saved.kind != _spec.SCALAR or array.dtype.name == saved.dtype or array.shape != ():
        return array
    cast = _dtypes.exact_cast(array, np.dtype(_dtypes.named(saved.dtype)))
    return array if cast is None else cast  # (None: the caller says it differs)


def _leaves(tree: Any, name: tuple[str, ...] = ()) -> dict[tuple[str, ...], Any]:
    """{stored name: leaf} of Orbax's nested dicts and lists (None: an empty node)."""
    if isinstance(tree, dict):
        out: dict[tuple[str, ...], Any] = {}
        for key, value in tree.items():
            out |= _leaves(value, (*name, str(key)))
        return out
    if isinstance(tree, (list, tuple)):
        out = {}
        for index, value in enumerate(tree):
            out |= _leaves(value, (*name, str(index)))
        return out
    return {} if tree is None else {name: tree}


def _map(fn: Any, tree: Any) -> Any:
    if isinstance(tree, dict):
        return {key: _map(fn, value) for key, value in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_map(fn, value) for value in tree)
    return None if tree is None else fn(tree)


def _map_named(fn: Any, tree: Any, name: tuple[str, ...] = ()) -> Any:
    """`_map` whose `fn(name, leaf)` is also given the leaf's stored name (`_leaves`)."""
    if isinstance(tree, dict):
        return {k: _map_named(fn, v, (*name, str(k))) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_map_named(fn, v, (*name, str(i))) for i, v in enumerate(tree))
    return None if tree is None else fn(name, tree)


def _saved_spec(spec: _spec.LeafSpec, stored: dict[tuple[str, ...], Any]) -> Any:
    from . import _rebuild

    """The stored leaf at `spec`'s name described as a `LeafSpec` of the kind `like`
    wants, or a `StructureMismatchError` saying what differs (before any data is read)."""
    meta = stored.get(spec.name)
    fix = " Fix: pass a like with the structure, shapes and dtypes of the state Orbax saved."
    if meta is None:
        raise StructureMismatchError(
            f"{where()}: leaf {spec.path} ({spec.describe()}) is not in it.{fix}"
        )
    shape = tuple(int(d) for d in getattr(meta, "shape", ()) or ())
    try:
        dtype = np.dtype(_dtypes.named(str(np.dtype(meta.dtype))))
    except (TypeError, AttributeError):
        raise StructureMismatchError(
            f"{where()}: leaf {spec.path} is stored as {meta!r}, which is not an array.{fix}"
        ) from None
    shown = f"{dtype.name}{list(shape)}"
    if spec.kind == _spec.KEY:
        data = _spec.key_data_shape(spec.impl) if spec.impl else ()
        if dtype != np.uint32 or shape != spec.shape + data:
            raise StructureMismatchError(
                f"{where()}: leaf {spec.path} is a {spec.describe()} in like, and the step "
                f"holds {shown}, not its raw key data (uint32{list(spec.shape + data)}).{fix}"
            )
        return dataclasses.replace(spec, dtype="uint32")
    if type(meta).__name__ == "ScalarMetadata":  # a Python number Orbax saved
        pytype = {"b": "bool", "i": "int", "u": "int", "f": "float", "c": "complex"}[dtype.kind]
        saved = _spec.LeafSpec(spec.path, spec.name, _spec.SCALAR, dtype.name, (), pytype=pytype)
    else:
        saved = _spec.LeafSpec(spec.path, spec.name, _spec.ARRAY, dtype.name, shape)
    if not _rebuild.compatible(spec, saved):
        raise StructureMismatchError(
            f"{where()}: leaf {spec.path} differs: the step holds {shown}, like has "
            f"{spec.describe()} (Orbax would cast it silently; the library does not).{fix}"
        )
    return saved


def _failure(what: str, e: Exception) -> RestoreError:
    """Orbax's (or TensorStore's) failure to read `what`: damage when it says the files
    are not what they claim, else the error as it is (storage out of reach, ...)."""
    text = _faults.scrub(str(e)).split(" [source locations=")[0].strip()
    if isinstance(e, FileNotFoundError) or _faults.is_damage(e):
        return DamagedStepError(
            f"{where()}: cannot read {what}: {type(e).__name__}: {text[:500]}",
            f"cannot read {what} ({type(e).__name__})",
        )
    return RestoreError(f"{where()}: cannot read {what}: {type(e).__name__}: {text[:500]}")
