"""Which steps a checkpoint directory holds, what a step says of itself, and reading
its arrays without a `like`: `all_steps`, `latest_step`, `metadata`, `metrics`,
`metrics_table`, `best_step`, `verify`, `step_metas`, and the steps every read takes
(pick a step, identify it, read and check its description, open its arrays, read
them, make sure it was not removed meanwhile), which `restore` (`_restore.py`) builds
on.

Needs numpy and TensorStore, not JAX: `jax-cb-ckpt verify` starts without importing it.
Runs in the caller's thread and blocks it until the read is done.

A step may be removed while it is read (`max_to_keep` retention of a writer running in
another thread or process, or a replacing save): the read then fails the way a corrupt
file would, or could even return a mix. So a step is identified (device, inode; in a
bucket, its commit marker's generation) before reading and checked after: a step that
is gone, or is another directory now, is a `NoCheckpointError` that says so, whatever
the read gave.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import os
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np

from .._base import _warn
from .._base._errors import (
    CheckpointError,
    ConfigError,
    DamagedStepError,
    DamagedStepWarning,
    NoCheckpointError,
    RestoreError,
    calling,
    entry,
    shown,
    where,
)
from .._base._types import BestMode
from .._layout import _extra, _format, _ocdbt, _policy
from .._layout._format import META_ITEM, STATE_ITEM
from .._layout._keep_best import BestN
from .._layout._spec import LeafSpec
from .._storage import _faults, _places
from .._storage._protocol import OpenedStep, StepIdentity, Storage
from . import _arrays, _plain

F = TypeVar("F", bound=Callable[..., Any])


def step_by_keyword(fn: F) -> F:
    """`fn` (whose step and options are keyword-only), with a call that passes the step
    positionally (Orbax's habit: `manager.restore(20)`) told to pass `step=` instead of
    Python's bare "takes 2 positional arguments but 3 were given"."""
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    positional = [p.name for p in inspect.signature(fn).parameters.values() if p.kind in kinds]
    names = ", ".join(n for n in positional if n != "self")

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        if len(args) > len(positional):
            step = shown(args[len(positional)])
            raise ConfigError(
                f"{fn.__name__}({names}, {step}): the step is passed by keyword, as are the "
                f"options. Fix: {fn.__name__}({names}, step={step})."
            )
        return fn(*args, **kwargs)

    return call  # type: ignore[return-value]


@entry("all_steps")
def all_steps(directory: str | os.PathLike[str]) -> list[int]:
    """Steps with a complete checkpoint in `directory`, ascending.

    The checkpoints written by jax_cb_ckpt count, and the plain Orbax steps a restart
    resumes from (a `CheckpointManager`'s: `metadata(directory, step=k)["format"]` is
    "orbax" for them; they are read with Orbax, unverified, and never deleted: see
    [The checkpoint directory](usage.md#the-checkpoint-directory)): other folders, even
    with integer names, are ignored; a damaged step of ours is not listed and is named
    in a `DamagedStepWarning`. A step listed here is complete and restores. Does not
    wait for pending saves.
    """
    return _listed(_places.at(_places.resolve(directory)), "all_steps").steps


@entry("latest_step")
def latest_step(directory: str | os.PathLike[str]) -> int | None:
    """The newest complete step in `directory` (ours, or a plain Orbax step: the one a
    restart resumes from when it passes its checks), or None when there is none. A
    damaged step is never the latest: it is reported (`DamagedStepWarning`)."""
    steps = _listed(_places.at(_places.resolve(directory)), "latest_step").steps
    return steps[-1] if steps else None


@dataclasses.dataclass(frozen=True)
class Listing:
    """The steps of a directory that reads take: the complete steps of ours (`ours`)
    and the plain Orbax steps a restart resumes from (`plain`: `_plain.listed`, the one
    recognition every listing and read uses)."""

    ours: list[int]
    plain: dict[int, _plain.PlainStep]

    @property
    def steps(self) -> list[int]:
        return sorted({*self.ours, *self.plain})


def listing(storage: Storage, found: dict[int, _format.Examined]) -> Listing:
    """The `Listing` of what `storage.examine_all()` found."""
    ours = sorted(step for step, f in found.items() if f.kind == "complete")
    return Listing(ours, _plain.listed(storage, found))


def plain_instead(storage: Storage, step: int, error: NoCheckpointError) -> _plain.PlainStep:
    """Step `step`, which a read of ours could not open (`error`), as the plain Orbax
    step it is; `error` raised when it is none. Asked only then, so that a read of a
    step of ours costs nothing more."""
    found = _plain.find(storage, step)
    if found is None:
        raise error
    return found


def _listed(storage: Storage, what: str) -> Listing:
    """The steps of `storage` (`Listing`); a `DamagedStepWarning` naming the damaged
    ones, so that a run never silently goes back to an older step."""
    path, found = storage.path, storage.examine_all()
    damaged = {
        step: f.why for step, f in sorted(found.items()) if f.kind in ("damaged", "unreadable")
    }
    if damaged:
        _warn_left_out(
            damaged,
            f"{what}: {len(damaged)} step folder(s) of {path!r} claim to be jax_cb_ckpt "
            "checkpoints but are damaged and are not listed",
            "restore the folder from a good copy, or move it out of the directory; "
            "`jax-cb-ckpt verify` checks every step.",
        )
    return listing(storage, found)


def _warn_left_out(damaged: dict[int, str], said: str, fix: str) -> None:
    """A `DamagedStepWarning`: `said` (which steps were left out of what), each step with
    why, that nothing was deleted, and `fix`."""
    listed = "; ".join(f"step {step}: {why}" for step, why in damaged.items())
    _warn.warn(f"{said} ({listed}). Nothing was deleted. Fix: {fix}", DamagedStepWarning)


def check_step_arg(step: object, what: str) -> int | None:
    if step is None:
        return None
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
        raise ConfigError(
            f"{what}(step={step!r}): step must be a non-negative int (a step listed by "
            "all_steps()) or None for the latest."
        )
    return int(step)


def pick_step(storage: Storage, step: int | None, what: str) -> int:
    """The step to read: `step`, or the latest when None; `NoCheckpointError` /
    `RestoreError` saying what the directory holds when there is no such complete
    step. A named step is taken as named here: `Storage.open_step` checks that it is
    complete in the reads it makes anyway (in a bucket, one round trip), and
    `open_step` below lists the directory to say what is wrong with it only when it
    cannot be opened."""
    if step is not None:
        return step
    return _listed_step(storage, step, what)


def _listed_step(storage: Storage, step: int | None, what: str) -> int:
    path = storage.path
    listed = _listed(storage, what) if step is None else listing(storage, storage.examine_all())
    steps = listed.steps
    if step is not None and step in steps:
        return step
    if step is not None:
        damaged = storage.damaged_steps()
        if step in damaged:
            raise DamagedStepError(
                f"{what}: step {step} in {path!r} is damaged ({damaged[step]}); nothing "
                "was read from it. Fix: restore another step (all_steps()), or the "
                "folder from a good copy.",
                damaged[step],
            )
    foreign = [s for s in storage.foreign_steps() if s not in listed.plain]
    other = (
        f" The directory holds {len(foreign)} step-numbered folder(s) that are not "
        "complete jax_cb_ckpt checkpoints or plain Orbax steps a restore reads "
        f"({short(foreign)}): someone's folder, a copy in progress, an interrupted "
        "write, or an Orbax step whose state item is not known (`jax-cb-ckpt ls` says "
        "which)."
        if foreign
        else ""
    )
    if not steps:
        raise NoCheckpointError(
            f"{what}: no checkpoint in {path!r}.{other} Fix: check the directory, or "
            "start from the initial state when latest_step() is None."
        )
    if step is None:
        return steps[-1]
    raise NoCheckpointError(
        f"{what}: no checkpoint for step {step} in {path!r}; the steps there are "
        f"{short(steps)}.{_set_aside(storage, step)}{other}"
    )


def _set_aside(storage: Storage, step: int) -> str:
    """Where a restart set the damaged step `step` aside (for a message naming a step
    that is not there), or ''."""
    try:
        found = [(name, why) for s, name, why in storage.set_aside_steps() if s == step]
    except (OSError, ConfigError):
        return ""
    if not found:
        return ""
    names = ", ".join(repr(name) for name, _ in found)
    return (
        f" Step {step} was damaged, and a restart set it aside as {names} "
        f"({found[-1][1]}): kept there whole, no longer a step (`jax-cb-ckpt ls` shows it)."
    )


def read_failure(
    e: Exception, storage: Storage, step: int, seen: StepIdentity, what: str
) -> CheckpointError:
    """The error for a read of `what` (a leaf, the arrays) of checkpoint `step` that
    raised `e`: a stored layout unlike the step's description; the step removed while it
    was read; or the read's own failure."""
    if not storage.still_there(step, seen):  # files vanish under a read as it goes
        return removed(storage, step)
    if isinstance(e, _arrays.LayoutError):
        return DamagedStepError(f"{where()}: {e}. Fix: restore another step.", str(e))
    # A server's answer may echo credentials: scrubbed before it goes into an error.
    text = _faults.scrub(str(e)).split(" [source locations=")[0].strip()
    damaged = (_arrays.ChunkError, _ocdbt.Damaged, FileNotFoundError)
    if isinstance(e, damaged) or _faults.is_damage(e):
        return DamagedStepError(
            f"{where()}: cannot read {what}: {text}. A file of the step was changed, cut or "
            "removed after it was written (bad disk or memory, a partial copy, a hand "
            f"edit). {_outcome()} Fix: restore another step (all_steps()); "
            "`jax-cb-ckpt verify` checks every step.",
            f"cannot read {what}: {text}",
        )
    return RestoreError(f"{where()}: cannot read {what}: {text}")


def _outcome() -> str:
    """What became of the read, said in a message: verify returns nothing anyway."""
    return (
        "The step fails verification." if where().startswith("verify(") else "Nothing was returned."
    )


def removed(storage: Storage, step: int) -> NoCheckpointError:
    try:
        steps = storage.list_steps()
    except ConfigError:
        steps = []
    now = f"the steps there now are {short(steps)}" if steps else "no step is there now"
    return NoCheckpointError(
        f"{where()}: step {step} was removed while it was being read ({now}); nothing "
        "read from it is returned. A writer running on the directory deletes old steps "
        "(max_to_keep, or a save with on_existing='replace'). Fix: read another step, "
        "e.g. the latest (restore() without step=, after latest_step()), and retry on "
        "this error; to read an old step at leisure, raise max_to_keep or copy the "
        "step's folder first."
    )


def open_step(storage: Storage, step: int, what: str | None = None) -> OpenedStep:
    """Checkpoint `step` opened (its identity, its `meta` item: `Storage.open_step`),
    read and checked before its arrays are read, and free of symlinks; errors say
    whether it was removed meanwhile or is damaged. `what` (the caller's name), for a
    step the caller named: `pick_step` left it to this to check, so a step that is not
    there is reported as `pick_step` reports it, not as removed."""
    opened = _opened(storage, step, what)
    links = storage.symlinks_inside(step)
    if links:
        raise DamagedStepError(
            f"{where()}: the checkpoint contains symlinks ({links[0]!r}, ...), which could "
            "make reading it read files outside the directory; the library never writes "
            "them, so it was altered. Fix: restore another step, or replace the links by "
            "the files they point to if you trust them.",
            f"it contains symlinks ({links[0]!r}, ...)",
        )
    return opened


def _opened(storage: Storage, step: int, what: str | None) -> OpenedStep:
    try:
        return storage.open_step(step)
    except Exception as e:
        if what is None or isinstance(e, _faults.StorageError):
            raise _open_failure(e, storage, step) from e
    # A named step that nothing listed before it was opened, and that could not be
    # opened: the directory's listing says what is wrong with it (`_listed_step`
    # raises: missing, damaged, someone else's), unless the step is complete by now (its
    # writer committed it meanwhile): then it is opened again, once.
    _listed_step(storage, step, what)
    try:
        return storage.open_step(step)
    except Exception as e:
        raise _open_failure(e, storage, step) from e


def _out_of_reach(e: Exception) -> ConfigError:
    return ConfigError(f"{where()}: cannot read the checkpoint directory: {e}")


def _open_failure(e: Exception, storage: Storage, step: int) -> CheckpointError:
    """The error for `storage.open_step(step)` raising `e` (`open_step`): the storage out
    of reach, the step removed meanwhile, or damaged."""
    if isinstance(e, _faults.StorageError):
        return _out_of_reach(e)
    try:
        complete = storage.is_checkpoint(step)
    except _faults.StorageError as later:
        return _out_of_reach(later)
    if not complete:
        return removed(storage, step)
    if isinstance(e, _format.DamagedStep):
        return DamagedStepError(
            f"{where()}: the step is damaged: {e}. Fix: restore another step "
            "(all_steps()), or the folder from a good copy.",
            str(e),
        )
    return RestoreError(f"{where()}: cannot read the checkpoint's '{META_ITEM}' item: {e}")


@entry("metadata")
@step_by_keyword
def metadata(directory: str | os.PathLike[str], *, step: int | None = None) -> dict[str, Any]:
    """The JSON `meta` item of checkpoint `step` (default: the latest) in `directory`,
    with the step's `extra=` JSON under "extra" where it was saved with one
    (`restore_extra`). For a plain Orbax step (listed by `all_steps`), what it says of
    itself, marked as Orbax's: `{"format": "orbax", "checksums": None, ...}` (it is read
    unverified; see [usage.md](usage.md#coming-from-orbaxs-checkpointmanager))."""
    return _metadata(directory, step)[0]


@entry("restore_extra")
@step_by_keyword
def restore_extra(
    directory: str | os.PathLike[str], *, step: int | None = None
) -> dict[str, Any] | None:
    """The JSON saved with checkpoint `step` (default: the latest) by `extra=`, or None
    when it was saved without; checked against the size and CRC-32 recorded when it was
    written (a `DamagedStepError` when it does not match). Plain Orbax reads it too:
    `CheckpointManager(directory).restore(step, args=Composite(extra=JsonRestore()))`."""
    storage = _places.at(_places.resolve(directory))
    named = check_step_arg(step, "restore_extra")
    step = pick_step(storage, named, "restore_extra")
    with calling(f"restore_extra(step={step}) from {storage.path!r}"):
        try:
            opened = open_step(storage, step, None if named is None else "restore_extra")
        except NoCheckpointError as e:
            plain_instead(storage, step, e)  # (raises unless it is a plain Orbax step)
            return None
        return read_extra(storage, opened)


def read_extra(storage: Storage, opened: OpenedStep) -> dict[str, Any] | None:
    """The opened step's `extra` item (`_layout/_extra`), or None: read within its bound,
    checked against our record in Orbax's step file before it is parsed (hostile
    input); a `DamagedStepError` saying what is wrong, a `NoCheckpointError` when the
    step was removed meanwhile."""
    step = opened.step
    try:
        return _extra.read(functools.partial(storage.step_file, step))
    except _format.DamagedStep as e:
        if not storage.still_there(step, opened.identity):
            raise removed(storage, step) from None
        raise DamagedStepError(
            f"{where()}: the step's '{_format.EXTRA_ITEM}' item is damaged: {e}. Its arrays "
            "may be intact (restore reads them, checked). Fix: read another step's extra "
            "(all_steps()), or restore the folder from a good copy.",
            f"its '{_format.EXTRA_ITEM}' item is damaged: {e}",
        ) from None


@entry("metrics")
@step_by_keyword
def metrics(directory: str | os.PathLike[str], *, step: int | None = None) -> dict[str, Any]:
    """The metrics saved with checkpoint `step` (default: the latest) in `directory`:
    {name: value}, a Python number for a plain save and a numpy array of the batch's
    shape for a save under vmap; {} for a step saved without `metrics=`. For a plain
    Orbax step, the numbers its manager recorded with it (its `metrics` item), or {}."""
    meta, call = _metadata(directory, step, "metrics")
    if _plain.is_described(meta):  # what Orbax's manager recorded with it
        return dict(meta["metrics"])
    with calling(call):
        described = parsed(meta)
    return {
        name: value.item() if value.ndim == 0 else value
        for name, value in described.metrics.items()
    }


@entry("metrics_table")
def metrics_table(directory: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The metrics of every complete step of `directory` (local or a bucket) as one
    table: a list of rows, oldest step first, each a dict

        {"step": 500, "member": None, "saved_at": "2026-...+00:00",
         "metrics": {"return": 1.5, ...}, "kept_by": ["latest", "best"]}

    `metrics` holds Python numbers ({} for a step saved without `metrics=`); `kept_by`
    names the retention rules that keep the step, by the rules the newest step was
    saved with (what `jax-cb-ckpt ls` shows; [] when no rule is recorded). A step saved
    under vmap has one row per member: `member` is its flat index (as in
    `best_step(member=)` and `restore(member=)`), `member_index` its index in the batch
    shape, `asked` whether it asked for the save and `member_step` its own step (a
    vmapped while_loop's members may differ); so has a step whose metrics are 1-D for
    a batch the state holds itself (`run(batched=True)`). A plain Orbax step has no
    row (`metrics(directory, step=k)` gives what its manager recorded).
    `pandas.json_normalize(rows)`
    makes it a DataFrame. Reads each step's meta (a bucket's 16 at a time, one round
    trip each);
    a damaged step is left out with a `DamagedStepWarning`. Does not wait for pending
    saves; blocks the caller while it reads."""
    call = "metrics_table"
    storage = _places.at(_places.resolve(directory))
    metas = step_metas(storage, _listed(storage, call).ours, warn=call)
    kept = _policy.kept_by_each(metas)[1]
    rows: list[dict[str, Any]] = []
    for step, meta in metas.items():
        shared = {"saved_at": meta.saved_at, "kept_by": list(kept.get(step, ()))}
        batch = meta.batch_shape or _held_batch(meta.metrics)
        if batch == ():
            values = {
                name: value.item() if value.ndim == 0 else value.tolist()
                for name, value in meta.metrics.items()
            }
            rows.append({"step": step, "member": None, **shared, "metrics": values})
            continue
        own = meta.member_steps
        for flat, index in enumerate(np.ndindex(batch)):
            rows.append(
                {
                    "step": step,
                    "member": flat,
                    "member_index": index,
                    "asked": bool(meta.members[index]) if meta.batch_shape else True,
                    "member_step": step if own is None else int(own[index]),
                    **shared,
                    "metrics": {
                        name: (v if v.ndim == 0 else v[index]).item()
                        for name, v in meta.metrics.items()
                    },
                }
            )
    return rows


def _held_batch(metrics: dict[str, np.ndarray]) -> tuple[int, ...]:
    """The batch of a step saved with 1-D metrics outside vmap (a batch the state holds
    itself: `run(batched=True)`): their shape, when they agree; () otherwise."""
    shapes = {value.shape for value in metrics.values() if value.ndim}
    return shapes.pop() if len(shapes) == 1 else ()


@entry("best_step")
def best_step(
    directory: str | os.PathLike[str],
    *,
    best: str | None = None,
    mode: BestMode | None = None,
    member: int | tuple[int, ...] | None = None,
    ignore_recorded: bool = False,
) -> int | None:
    """The complete step of `directory` with the best value of a metric, or None when no
    step has a valid one (a step without it, or with NaN, never counts; a plain Orbax
    step is not ranked).

    By default the rule the steps were kept by, as the newest step records it (a
    Checkpointer with `keep_best=2, best="eval_loss", mode="min"`): nothing to repeat,
    and an evaluation process beside the training (which holds the writer's lock) reads
    it without a Checkpointer. `best=` names another metric (then `mode=` is needed:
    `"max"`, the highest, or `"min"`, the lowest); a `mode=` that contradicts the
    recorded one for the same metric is refused, unless `ignore_recorded=True`. For
    saves under vmap: `member=k` (an int, or an index into the batch shape) ranks
    member k's values; without it, the step holding the best value of any member.
    Reads each step's meta; does not wait for pending saves."""
    call = "best_step"
    storage = _places.at(_places.resolve(directory))
    if best is not None and (not isinstance(best, str) or not best):
        raise ConfigError(f"{call}(best={best!r}): best must name a metric (a str).")
    if mode not in (None, "max", "min"):
        raise ConfigError(f"{call}(mode={mode!r}): mode must be 'max' or 'min'.")
    metas = step_metas(storage, _listed(storage, call).ours, warn=call)
    recorded = _recorded_best(metas)
    best, mode = _best_rule(best, mode, recorded, ignore_recorded, storage.path)
    try:
        rules = _policy.AnyOf((BestN(best, 1, mode),))
    except ValueError as e:
        raise ConfigError(f"{call}(best={best!r}): {e}") from None
    keeper = _policy.Keeper(rules, [_policy.entry_of(s, m, rules) for s, m in metas.items()])
    try:
        return keeper.best_step(member)
    except ValueError as e:
        raise ConfigError(f"{call}(member={member!r}) in {storage.path!r}: {e}") from None


def _recorded_best(metas: dict[int, _format.StepMeta]) -> BestN | None:
    """The rule ranking a metric the newest step was saved with, if any."""
    rules = _policy.recorded_rules(metas[max(metas)]) if metas else None
    return None if rules is None else rules.find(BestN)


def _best_rule(
    best: str | None,
    mode: BestMode | None,
    recorded: BestN | None,
    ignore_recorded: bool,
    path: str,
) -> tuple[str, BestMode]:
    """The metric and mode `best_step` ranks by: the ones given, checked against the
    rule the steps record, or that rule."""
    call = f"best_step in {path!r}"
    said = (
        "no rule ranking a metric"
        if recorded is None
        else f"keep_best by {recorded.metric!r} ({recorded.mode})"
    )
    if best is None:
        if recorded is None:
            raise ConfigError(
                f"{call}: the steps record {said}, so which metric is best is not known. "
                "Fix: pass best='<metric name>' and mode='max' (higher is better) or "
                "mode='min'."
            )
        best = recorded.metric
    same = recorded is not None and recorded.metric == best
    if mode is None:
        if recorded is None or not same:
            raise ConfigError(
                f"{call}(best={best!r}): the steps record {said}, not whether a higher or "
                f"a lower {best!r} is better. Fix: pass mode='max' (higher is better) or "
                "mode='min'."
            )
        return best, recorded.mode
    if same and recorded is not None and mode != recorded.mode and not ignore_recorded:
        raise ConfigError(
            f"{call}(best={best!r}, mode={mode!r}): the steps were kept by {best!r} with "
            f"mode={recorded.mode!r}; mode={mode!r} ranks them the other way (the worst "
            "would come back as the best). Fix: leave mode out, or pass "
            "ignore_recorded=True to rank by it anyway."
        )
    return best, mode


def step_metas(
    storage: Storage, steps: list[int], *, warn: str | None = None
) -> dict[int, _format.StepMeta]:
    """The checked meta of each of `steps`; a step removed meanwhile or whose meta is
    damaged is left out (a listing reports damaged steps; with `warn`, the caller's
    name, a `DamagedStepWarning` names each step still there whose meta did not read,
    which a listing by files alone cannot see). The storage opens them as suits it
    (`Storage.open_steps`: a bucket's 16 at a time, a local directory's one by one)."""

    unreadable: dict[int, str] = {}

    def one(step: int, opened: OpenedStep | Exception) -> _format.StepMeta | None:
        try:
            if isinstance(opened, Exception):
                raise opened
            return _format.StepMeta.parse(opened.meta)
        except Exception as e:  # removed by retention meanwhile, or damaged since listed
            unreadable[step] = f"{type(e).__name__}: {e}"[:300]
            return None

    opened = storage.open_steps(steps)
    found = [one(step, opened[step]) for step in steps]
    if warn is not None:
        damaged = {s: why for s, why in sorted(unreadable.items()) if storage.exists(str(s))}
        if damaged:
            _warn_left_out(
                damaged,
                f"{warn}: {len(damaged)} step(s) of {storage.path!r} are listed but their "
                "description cannot be read, and are left out",
                "`jax-cb-ckpt verify` checks every step; restore the folder from a good "
                "copy, or move it out of the directory.",
            )
    return {step: meta for step, meta in zip(steps, found, strict=True) if meta is not None}


def _metadata(
    directory: str | os.PathLike[str], step: int | None, what: str = "metadata"
) -> tuple[dict[str, Any], str]:
    """A step's `meta` item (for `metadata`, with its `extra` item's value under
    "extra", where it has one), or what a plain Orbax step says of itself
    (`_plain.describe`), and the call's name for messages."""
    storage = _places.at(_places.resolve(directory))
    named = check_step_arg(step, what)
    step = pick_step(storage, named, what)
    call = f"{what}(step={step}) from {storage.path!r}"
    with calling(call):
        try:
            opened = open_step(storage, step, None if named is None else what)
        except NoCheckpointError as e:
            return _plain.describe(storage, plain_instead(storage, step, e)), call
        if what != "metadata":
            return opened.meta, call
        extra = read_extra(storage, opened)  # (returned with the meta, never stored in it)
        return opened.meta if extra is None else dict(opened.meta, extra=extra), call


def parsed(meta: dict[str, Any]) -> _format.StepMeta:
    """The fields of a step's `meta` item, or a RestoreError saying which is wrong."""
    try:
        return _format.StepMeta.parse(meta)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise DamagedStepError(
            f"{where()}: the checkpoint's '{META_ITEM}' item is invalid ({type(e).__name__}: "
            f"{e}); it was edited or corrupted. Fix: restore another step.",
            f"its '{META_ITEM}' item is invalid ({e})",
        ) from e


def open_arrays(
    storage: Storage,
    opened: OpenedStep,
    meta: _format.StepMeta,
    specs: list[LeafSpec],
    *,
    light: bool = False,
) -> _arrays.StepArrays:
    """The step's arrays, opened, with the stored layouts of `specs` checked against
    their descriptions before anything of them is read (`light`: `StepArrays`')."""
    step, seen = opened.step, opened.identity
    try:
        arrays = _arrays.StepArrays(storage, opened, meta.leaves, light=light)
        arrays.check_layouts(specs)
    except _arrays.LeafReadError as e:
        what = f"leaf {e.leaf.path}"
        raise read_failure(e.cause, storage, step, seen, what) from e.cause
    except Exception as e:
        raise read_failure(e, storage, step, seen, "the checkpoint's arrays") from e
    return arrays


def check_orbax_description(storage: Storage, opened: OpenedStep, meta: _format.StepMeta) -> None:
    """The step's `state/_METADATA` is what plain Orbax needs to read its arrays
    (`_format.check_state_metadata`): a `DamagedStepError` when it is not (our reads
    never use it, so nothing else would see it), a `NoCheckpointError` when the step
    was removed meanwhile. `verify` and a restart check it; a named restore does not
    need it (its arrays are checked against their checksums)."""
    step, seen = opened.step, opened.identity
    name = f"{STATE_ITEM}/{_format.STATE_METADATA}"
    stored = [leaf.name for leaf in meta.leaves if 0 not in leaf.stored_shape]
    try:
        data = storage.step_file(step, name, _format.META_MAX_BYTES)
        if data is None and storage.exists(f"{step}/{name}"):  # (a refused permission)
            raise OSError(f"'{name}' is there but cannot be read")
        if data is None:
            raise _format.DamagedStep(f"'{name}' is missing")
        _format.check_state_metadata(data, stored, [leaf.name for leaf in meta.leaves])
    except (_format.DamagedStep, OSError) as e:
        if not storage.still_there(step, seen):
            raise removed(storage, step) from None
        if not isinstance(e, _format.DamagedStep):
            raise RestoreError(
                f"{where()}: step {step}: {e}. A refused permission (or storage out of "
                "reach) is not damage, and a restart does not go back past it. Fix: give "
                "this process read access to the step's files."
            ) from e
        raise DamagedStepError(
            f"{where()}: {e}: plain Orbax cannot read the step as it is (its arrays may be "
            "intact: restore(step=) still reads them, checked against their checksums). "
            f"The file was changed after the step was written. {_outcome()} Fix: restore "
            "another step (all_steps()); `jax-cb-ckpt verify` checks every step.",
            f"{e} (plain Orbax cannot read the step)",
        ) from None


def sums_to_check(
    meta: _format.StepMeta, specs: list[LeafSpec], verify: bool
) -> _format.Sums | None:
    """The checksums to check the stored leaves `specs` against, or None to read them
    unchecked (`verify=False`, or a step written before checksums were kept). A step
    with checksums that lacks a leaf's was edited: an error, before anything is read."""
    if not verify or meta.checksums is None:
        return None
    for saved in specs:
        _leaf_sums(meta.checksums, saved)
    return meta.checksums


def read_leaves(
    arrays: _arrays.StepArrays,
    requests: list[tuple[LeafSpec, _arrays.Box | None]],
    sums: _format.Sums | None,
    storage: Storage,
    step: int,
    seen: StepIdentity,
    *,
    keep: bool = True,
) -> list[np.ndarray]:
    """`arrays.read(requests, keep=)`, its failures as our errors; and the step
    checked to be the one the read began on (TensorStore reads a file removed meanwhile
    as an absent key, and zarr an absent chunk as its fill value)."""
    try:
        results = arrays.read(requests, sums, keep=keep)
    except _arrays.ChecksumMismatch as e:
        if not storage.still_there(step, seen):
            raise removed(storage, step) from e
        name = _format.param_name(e.leaf.name)
        raise _mismatch(name, e.leaf.path, e.region, storage.step_path(step)) from None
    except _arrays.LeafReadError as e:
        what = f"leaf {e.leaf.path}"
        raise read_failure(e.cause, storage, step, seen, what) from e.cause
    if not storage.still_there(step, seen):
        raise removed(storage, step)
    return results


def _mismatch(name: str, leaf: str, key: str, step_dir: str) -> RestoreError:
    region = f"elements [{key.replace(',', ', ')}]" if key else "its value"
    return DamagedStepError(
        f"{where()}: leaf {leaf} is corrupted: the checksum of {region} does not match "
        f"the one recorded when it was written (stored as zarr array '{name}' in "
        f"{step_dir + '/' + STATE_ITEM!r}). A file of the step was changed on "
        "disk after it was written (bad disk or memory, a partial copy, a hand edit). "
        f"{_outcome()} Fix: restore another step (all_steps()); "
        "jax_cb_ckpt.verify(directory) checks every step.",
        f"leaf {leaf} is corrupted: the checksum of {region} does not match",
    )


def _leaf_sums(sums: _format.Sums, saved: LeafSpec) -> dict[str, int]:
    """A leaf's checksums, {region: CRC-32}; an error when the step has none for it."""
    leaf_sums = sums.get(_format.param_name(saved.name))
    if leaf_sums is None:
        raise DamagedStepError(
            f"{where()}: leaf {saved.path} has no checksum in the checkpoint's "
            f"'{META_ITEM}' item; it was edited or corrupted. Fix: restore another step, "
            "or pass verify=False to read it unchecked.",
            f"leaf {saved.path} has no checksum",
        )
    return leaf_sums


def short(steps: list[int]) -> str:
    if len(steps) <= 10:
        return str(steps)
    return f"[{', '.join(map(str, steps[:5]))}, ..., {', '.join(map(str, steps[-3:]))}]"


@entry("verify")
@step_by_keyword
def verify(directory: str | os.PathLike[str], *, step: int | None = None) -> list[int]:
    """Check every stored byte of `step` (default: every step) against the checksums
    recorded when it was written, without a `like`: each leaf is read whole into host
    memory, one at a time, once its stored layout is the described one. A step written
    without checksums (an older version) is read whole too, so a cut or missing file
    fails, but cannot be verified (its `checksums` are None; the CLI exits 3); so is a
    plain Orbax step (listed by `all_steps`), with Orbax, all at once (it imports
    Orbax and JAX then): Orbax keeps no checksums, so it is readable, never verified.
    Each step's `state/_METADATA` must be what plain Orbax needs to read the step (a
    JSON object describing each stored leaf), since plain Orbax reading every step is
    promised. Returns the steps checked: a step removed while it was read (by the
    retention of a run writing the directory) is skipped, never taken for damage.
    Raises what the CLI fails on, so a script's `verify(d)` passes exactly what
    `jax-cb-ckpt verify d` passes: `DamagedStepError` naming the first corrupted leaf
    (its step, region and directory) or the first damaged step folder (a description
    cut or edited: not listed, and so never read), `RestoreError` for a step this
    process may not read, `NoCheckpointError` for a directory without a step (a wrong
    path). Blocks while reading."""
    storage = _places.at(_places.resolve(directory))
    named = check_step_arg(step, "verify")
    plain: dict[int, _plain.PlainStep] = {}
    if named is None:
        found = storage.examine_all()
        listed = listing(storage, found)
        steps, plain = listed.steps, listed.plain
        for bad, f in sorted(found.items()):
            if f.kind == "unreadable":
                raise RestoreError(f"verify: step {bad} of {storage.path!r} {f.why}.")
            if f.kind == "damaged":
                raise DamagedStepError(
                    f"verify: step {bad} of {storage.path!r} is damaged ({f.why}): it is "
                    "not listed or restored. Fix: restore the folder from a good copy, or "
                    "move it out of the directory.",
                    f.why,
                )
        if not steps:
            raise NoCheckpointError(
                f"verify: no checkpoint in {storage.path!r}, so nothing was verified (is it "
                "the run's own directory?)."
            )
    else:
        steps = [pick_step(storage, named, "verify")]
    checked = []
    for one in steps:
        with calling(f"verify(step={one}) of {storage.path!r}"):
            if one in plain:
                _plain.read_whole(plain[one])
                checked.append(one)
                continue
            try:
                _verify_one(storage, one, None if named is None else "verify")
            except NoCheckpointError as e:
                if named is not None:  # not a step of ours: a plain Orbax one? (else raised)
                    _plain.read_whole(plain_instead(storage, one, e))
                elif gone(storage, one):
                    continue  # removed by a writer's retention while it was read: no damage
                else:
                    raise
        checked.append(one)
    return checked


def gone(storage: Storage, step: int) -> bool:
    """The step, listed complete a moment ago, is no longer a step of ours: removed (or
    being removed) by a writer's retention, not damaged (a damaged or unreadable folder
    is still there, and says so)."""
    try:
        now = storage.examine_all().get(step)
    except ConfigError:
        return False
    return now is None or now.kind == "foreign"


def _verify_one(storage: Storage, step: int, what: str | None) -> None:
    """Every stored byte of `step` read and checked (`verify`), under its `calling`."""
    opened = open_step(storage, step, what)
    seen, meta = opened.identity, parsed(opened.meta)
    check_orbax_description(storage, opened, meta)
    read_extra(storage, opened)  # (checked against its CRC-32, where the step has one)
    stored = [saved for saved in meta.leaves if 0 not in saved.stored_shape]
    # Without checksums (an older version's step) every byte is still read: a cut
    # or missing file fails here, where it would fail a restore.
    sums = sums_to_check(meta, stored, True)
    arrays = open_arrays(storage, opened, meta, stored, light=True)
    for group in _by_size(stored, _VERIFY_GROUP_BYTES):
        requests: list[tuple[LeafSpec, _arrays.Box | None]] = [(s, None) for s in group]
        read_leaves(arrays, requests, sums, storage, step, seen, keep=False)


# verify reads leaves in groups of about this many bytes at once (concurrently), so
# that its memory stays bounded whatever the step's size.
_VERIFY_GROUP_BYTES = 256 << 20


def _by_size(specs: list[LeafSpec], limit: int) -> list[list[LeafSpec]]:
    """`specs` in consecutive groups of at most `limit` stored bytes (a larger leaf
    alone)."""
    groups: list[list[LeafSpec]] = [[]]
    size = 0
    for spec in specs:
        nbytes = np.dtype(spec.dtype).itemsize * math.prod(spec.stored_shape)
        if groups[-1] and size + nbytes > limit:
            groups.append([])
            size = 0
        groups[-1].append(spec)
        size += nbytes
    return [g for g in groups if g]
