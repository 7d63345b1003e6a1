"""Restoring one step into the types of `like` (`restore`, and one member of a batch
saved under vmap).

Runs in the caller's thread and blocks it until the arrays are in memory. The arrays
are read by the one read path (`_arrays.StepArrays`: TensorStore on the layout the
writer writes, checked against the checksums while it reads, `_steps.read_leaves`),
not by Orbax; plain Orbax still reads every step (tests/test_restore.py). The JSON
`meta` item says how each leaf was stored, so nothing is unpickled and no code runs. A
checkpoint is trusted no further than its files: a `meta` item that does not match the
arrays (hand-edited, corrupt, another program's) is a `RestoreError`; a step removed
while it is read is a `NoCheckpointError` (`_steps`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable, Iterable
from typing import Any

import jax
import numpy as np

from .._base import _dtypes, _warn
from .._base._errors import (
    ConfigError,
    DamagedStepError,
    DamagedStepWarning,
    MemberStateWarning,
    NoCheckpointError,
    RestoreError,
    StructureMismatchError,
    calling,
    entry,
    where,
)
from .._base._types import OnDamaged
from .._layout import _format, _spec
from .._storage import _places
from .._storage._protocol import OpenedStep, Storage
from . import _arrays, _plain, _rebuild, _resume, _steps
from ._request import Request
from ._resume import check_on_damaged

logger = logging.getLogger("jax_cb_ckpt")

_Member = int | tuple[int, ...] | None  # `member=`: one member of a vmap batch, or all


def _placement(like_leaf: Any, spec: _spec.LeafSpec, saved: _spec.LeafSpec) -> Any:
    """The sharding to read a leaf with, when `like` places it on devices and the
    stored data can be read as is (not a PRNG key, a widened dtype or a number)."""
    sharding = getattr(like_leaf, "sharding", None)
    if not isinstance(sharding, jax.sharding.Sharding) or isinstance(like_leaf, np.ndarray):
        return None
    if saved.kind != _spec.ARRAY or spec.kind != _spec.ARRAY or saved.dtype != spec.dtype:
        return None
    dtype = np.dtype(saved.dtype)
    if _dtypes.storage_dtype(dtype) != dtype or 0 in saved.shape:
        return None
    return sharding


@entry("restore")
@_steps.step_by_keyword
def restore(
    directory: str | os.PathLike[str],
    like: Any,
    *,
    step: int | None = None,
    verify: bool = True,
    member: int | tuple[int, ...] | None = None,
    on_damaged: OnDamaged = "fall_back",
    partial_restore: bool = False,
) -> Any:
    """Restore checkpoint `step` (default: the newest that passes its checks) of
    `directory` into the shape of `like`.

    `like` is a pytree like the saved state: concrete arrays, or `jax.ShapeDtypeStruct`s
    (e.g. from `jax.eval_shape`). The result has `like`'s pytree types (TrainState,
    NamedTuple, dataclass, dict, ...), dtypes, typed PRNG keys (re-wrapped with the
    recorded implementation) and Python scalar types; jax.Array leaves are placed with
    the sharding of the `like` leaf when it has one, committed only where that leaf is
    (an array made on the host, uncommitted, comes back uncommitted on its device, so a
    `pmap` that took it takes the restored one). Blocks until the data is loaded. With
    `verify` (default), every array read is checked against the checksums recorded
    when it was written: a corrupted file is a `DamagedStepError`, never numbers.
    `directory` may be relative (to the working directory), as everywhere.

    Without `step=`, the newest step that passes its checks is read: a newer damaged
    step (a flipped bit, a cut or edited file) is passed over, named in a
    `DamagedStepWarning` and left where it is (a Checkpointer's restart sets it aside);
    `on_damaged="raise"` raises `DamagedStepError` at it instead. A plain Orbax
    checkpoint (a `CheckpointManager`'s step, listed by `all_steps`) is read too, with
    Orbax, unverified ([usage.md](usage.md#coming-from-orbaxs-checkpointmanager)). A
    step named by `step=` never falls back.

    `member`: for a checkpoint saved under `vmap` (`metadata()["batch_shape"]`),
    restore one member of the batch (an int, or a tuple of ints for several batch
    axes) into one member's `like`, reading (and checking) only its chunks. Without
    `member`, a batch whose members did not all ask for the step: without `step=` each
    member comes from the newest step it asked for; with `step=k` the step is returned
    as stored, and members that did not ask for `k` and were not at it (they had left
    their `ckpt.while_loop`, or were at a step of their own) are named in a
    `MemberStateWarning`, as are, without `step=`, members that asked for no step at
    all and were not at the one read.

    `partial_restore=True` (Orbax's name): `like` holds some of the saved leaves, whose
    chunks alone are read ([usage.md](usage.md#restoring-part-of-a-state-partial_restore)).

    Raises:
        NoCheckpointError: no complete checkpoint for that step, or it was removed
            while it was being read (by a writer's retention): read another one.
        StructureMismatchError: `like` differs from the checkpoint; names the first leaf.
        DamagedStepError: the step named by `step=` (or, with `on_damaged="raise"`, the
            newest step) is damaged; every step is damaged.
        RestoreError: the checkpoint cannot be read.
    """
    storage = _places.at(_places.resolve(directory))
    named = _steps.check_step_arg(step, "restore")
    check_on_damaged(on_damaged, "restore")
    request = make_request(like, partial_restore)
    if named is not None:
        return _read_named(storage, request, named, verify, member)
    return _read_newest(storage, request, verify, member, on_damaged)


def _read_named(
    storage: Storage, request: Request, named: int, verify: bool, member: _Member
) -> Any:
    """`restore(step=named)`: that step, ours or a plain Orbax one; never another."""
    step = _steps.pick_step(storage, named, "restore")
    try:
        return read_step(storage, request, step, verify=verify, member=member, named=True)
    except NoCheckpointError as e:  # (not a step of ours: a plain Orbax one?)
        found = _steps.plain_instead(storage, step, e)
        state = _plain.restore(found, request, member=member)
        _said_unverified(storage, step)
        return state


def _read_newest(
    storage: Storage, request: Request, verify: bool, member: _Member, on_damaged: OnDamaged
) -> Any:
    """`restore()` without `step=`: the newest step that passes its checks."""
    for _ in range(_LOOKS):
        resumed = resume(storage, request, verify=verify, member=member, on_damaged=on_damaged)
        if resumed.step is not None:
            break
        if resumed.error is not None:  # every step is damaged: the newest says why
            raise resumed.refusal()
        _steps.pick_step(storage, None, "restore")  # raises: says what the directory holds
        # A step is there now, where the listing found none: a writer's retention removed
        # the one listed while it was examined and committed a newer one. Look again.
    else:
        raise NoCheckpointError(
            f"{where()}: the steps of {storage.path!r} were removed while they were being "
            f"read, {_LOOKS} times over (a writer running on the directory deletes old "
            "steps: max_to_keep). Fix: retry on this error, or raise max_to_keep."
        )
    restart = _resume.report(storage, resumed, set_aside=False).value
    if restart is None:  # (report keeps the value read)
        raise NoCheckpointError(f"{where()}: no step of {storage.path!r} could be read")
    if restart.unowned:
        say_unowned(restart.unowned, resumed.step)
    if resumed.source == "orbax":
        _said_unverified(storage, resumed.step)
    return restart.state


def make_request(like: Any, partial_restore: object = False) -> Request:
    """A restore's `Request` for `like` (`partial_restore` checked): made once, passed
    to every reader of the restore."""
    return Request.of(like, partial=_checked_partial(partial_restore))


def _checked_partial(partial_restore: object) -> bool:
    """`partial_restore`, a bool (a stray argument is said, not taken as true)."""
    if not isinstance(partial_restore, bool):
        raise ConfigError(
            f"{where()}(partial_restore={partial_restore!r}): partial_restore must be True "
            "(like holds some of the checkpoint's leaves: only they are read) or False "
            "(like holds every leaf)."
        )
    return partial_restore


# How many times `restore` lists the directory again when a step appeared where its
# listing found none (a race with a writer's retention), before it says so.
_LOOKS = 3


def _said_unverified(storage: Storage, step: int | None) -> None:
    logger.info(
        "restore: read step %s of %s, a plain Orbax checkpoint, unverified (Orbax keeps "
        "no checksums)",
        step,
        storage.path,
    )


def say_unowned(members: Iterable[tuple[int, ...]], step: int) -> None:
    """The `MemberStateWarning` of a restore that returns, for `members`, what `step`
    holds though they asked for no step at or before it."""
    _warn.warn(
        f"{where()}: {unowned_text(members, step)}; it is returned for them as stored. "
        "Fix: restore_or_init(init_fn) starts them again from init_fn's state at step 0; "
        "or save every member's first state (initial_save, or a save at the loop's start).",
        MemberStateWarning,
    )


def _say_unasked(meta: _format.StepMeta, step: int) -> None:
    """`restore(step=k)` of a whole batch: the `MemberStateWarning` naming the members
    that did not ask for `k` and whose data there is not their state at `k`: they had
    left their `ckpt.while_loop` (`left`), or were at another step of their own
    (`member_steps`). (A member that did not ask but was at `k`, its predicate false in
    a loop every member runs, holds its true state at `k`: nothing to say.) From the
    description the read used: nothing more is listed or read."""
    if not meta.batch_shape or meta.members.all():
        return
    elsewhere = _not_at(meta) & ~meta.members
    if not elsewhere.any():
        return
    shown = members_text(tuple(int(i) for i in index) for index in np.argwhere(elsewhere))
    _warn.warn(
        f"{where()}: member(s) {shown} of the batch did not ask for step "
        f"{step} and were not at it (they had left their loop, whose body ran on for "
        "them, or were at a step of their own): what it holds for them is returned as "
        "stored, a state they never had at that step. Fix: restore(like, "
        f"step={step}, member=k) for a member that asked; restore(like) without step= "
        "(or restore_or_init) takes each member from the newest step it asked for.",
        MemberStateWarning,
    )


def _not_at(meta: _format.StepMeta) -> np.ndarray:
    """The members whose data in this step is not their state at it: they had left
    their `ckpt.while_loop` (`left`), or their own step was another (`member_steps`)."""
    elsewhere = np.zeros(meta.batch_shape, bool)
    if meta.left is not None:
        elsewhere |= meta.left
    if meta.member_steps is not None:
        elsewhere |= meta.member_steps != meta.step
    return elsewhere


def resume(
    storage: Storage,
    like: Request | Callable[[], Any],
    *,
    verify: bool = True,
    member: int | tuple[int, ...] | None = None,
    on_damaged: OnDamaged = "fall_back",
) -> _resume.Resumed[Restart]:
    """The newest step of `storage` that passes its checks, read into `like` (a
    `Request`, or a function making `like`: made only when there is a step to read,
    `restore_or_init`'s default is traced from the user's `init_fn`) by
    `_resume.newest`: ours by `read_step` (a batch whose members did not all ask for
    that step: each of them from its own newest step, `_each_newest`), a plain Orbax
    step by `_plain.restore`."""
    request = like if isinstance(like, Request) else Request(like)

    def ours(step: int) -> Restart:
        if member is not None:  # one member: from the newest step it asked for
            meta = _steps.parsed(_steps.open_step(storage, step).meta)
            index = _member_position(member, meta)
            source = step
            if not meta.members[index]:
                older = _newest_asked(storage, step, meta.batch_shape, {index})
                if index not in older:
                    raise RestoreError(
                        f"{where()}: member {index} did not save at step {step}, the "
                        f"newest of {storage.path!r}, nor at any readable step before it "
                        "(its maybe_save predicate was false at each, e.g. a member of a "
                        "vmapped loop that left it before its first save), so no step "
                        "holds a state of its own for it. Fix: start it from its initial "
                        "state (restore_or_init does), or restore another member.",
                    )
                source = older[index]
            state = read_step(storage, request, source, verify=verify, member=member, named=False)
            return Restart(state)
        state = read_step(storage, request, step, verify=verify, member=None, named=False)
        return _each_newest(storage, request, step, state, verify)

    return _resume.newest(
        storage,
        ours,
        lambda found: Restart(_plain.restore(found, request, member=member)),
        on_damaged=on_damaged,
    )


@dataclasses.dataclass(frozen=True)
class Restart:
    """A state a restart read, and each member's own step where the members of a vmap
    batch resume from different steps (None: every member from the step read).
    `unowned`: the members that asked for no readable step at or before the one read
    and were not at it: their data in `state` is what that step holds, no state of
    theirs (the caller starts them again, or says so: `unowned_text`)."""

    state: Any
    member_steps: np.ndarray | None = None
    unowned: tuple[tuple[int, ...], ...] = ()


def members_text(members: Iterable[tuple[int, ...]]) -> str:
    """Members as messages name them: `0, 3` (one batch axis) or `(0, 1), (1, 0)`."""
    return ", ".join(str(i[0] if len(i) == 1 else i) for i in sorted(members))


def unowned_text(members: Iterable[tuple[int, ...]], step: int) -> str:
    """Why the data of `members` (which did not ask for `step`, nor for an older step)
    is none of their states."""
    return (
        f"member(s) {members_text(members)} of the batch saved at step {step} asked for no "
        f"readable step at or before it and were not at step {step} (they had left their "
        "loop, whose body ran on for them, or were at a step of their own): what it holds "
        "for them is not a state they had"
    )


def _each_newest(
    storage: Storage, request: Request, step: int, state: Any, verify: bool
) -> Restart:
    """`state`, read from the batch saved at `step`, with each member that did not ask
    for that step (its predicate was false: a finished member of a vmapped while_loop,
    whose body still ran, holds a state it never had there) taken from the newest older
    step it asked for that passes its checks, and each member's step. A member that
    asked for no such step keeps what `step` holds, its state there if it was at
    `step`; one that was not (`_not_at`) is named in `unowned`."""
    meta = _steps.parsed(_steps.open_step(storage, step).meta)
    batch = meta.batch_shape
    if not batch or meta.members.all():
        return Restart(state)
    missing = {tuple(int(i) for i in index) for index in np.argwhere(~meta.members)}
    starts = np.full(batch, step, np.int64)
    passed: dict[int, str] = {}
    batched = _batched(meta)
    while missing:
        sources = _newest_asked(storage, step, batch, missing, passed)
        if not sources:
            break
        for index, source in sorted(sources.items()):
            try:
                one = read_step(
                    storage,
                    request.member(batched, index, len(batch)),
                    source,
                    verify=verify,
                    member=index,
                    named=False,
                )
            except DamagedStepError as e:  # that step is no source: an older one may be
                passed[source] = e.why
                continue
            state = request.with_member(state, batched, index, one)
            starts[index] = source
            missing.discard(index)
    if passed:
        shown = "; ".join(f"step {s}: {why}" for s, why in sorted(passed.items()))
        _warn.warn(
            f"{where()}: members of the batch saved at step {step} that did not ask for it "
            f"were read from older steps, passing over damaged ones ({shown}); nothing "
            "was moved. Fix: `jax-cb-ckpt verify` the directory.",
            DamagedStepWarning,
        )
    # One that asked for no step but was at this one (its predicate false in a loop
    # every member runs) holds its true state here; the others hold none of theirs.
    elsewhere = _not_at(meta)
    return Restart(state, starts, tuple(sorted(i for i in missing if elsewhere[i])))


def _newest_asked(
    storage: Storage,
    step: int,
    batch: tuple[int, ...],
    members: set[tuple[int, ...]],
    passed: dict[int, str] | None = None,
) -> dict[tuple[int, ...], int]:
    """{member: the newest step below `step` it asked for} for each of `members` that
    has one: steps of the same batch shape whose description passes its checks, and
    not in `passed` ({step: why}, which collects the ones passed over)."""
    passed = {} if passed is None else passed
    found: dict[tuple[int, ...], int] = {}
    for candidate in reversed([s for s in storage.list_steps() if s < step]):
        if len(found) == len(members):
            break
        if candidate in passed:
            continue
        try:
            meta = _steps.parsed(_steps.open_step(storage, candidate).meta)
        except DamagedStepError as e:
            passed[candidate] = e.why
            continue
        if meta.batch_shape != batch:
            continue
        for index in members:
            if index not in found and meta.members[index]:
                found[index] = candidate
    return found


def members_from(
    storage: Storage, step: int, state: Any, source: Any, members: Iterable[tuple[int, ...]]
) -> Any:
    """`state`, read from the batch saved at `step`, with each of `members` taken from
    `source`, a state of the same batch (`restore_or_init`'s fresh one)."""
    meta = _steps.parsed(_steps.open_step(storage, step).meta)
    batched, n = _batched(meta), len(meta.batch_shape)
    with calling("restore"):
        whole = Request.of(source)
        whole.specs  # noqa: B018  (described here: its messages say restore)
    for index in members:
        state = whole.with_member(state, batched, index, whole.member(batched, index, n).like)
    return state


def _batched(meta: _format.StepMeta) -> set[tuple[str, ...]]:
    """The names of the leaves of `meta`'s step that carry its batch axes."""
    n = len(meta.batch_shape)
    return {s.name for s in meta.leaves if s.shape[:n] == meta.batch_shape}


def read_step(
    storage: Storage,
    request: Request,
    step: int,
    *,
    verify: bool,
    member: int | tuple[int, ...] | None,
    named: bool,
) -> Any:
    """Checkpoint `step` of `storage` (listed, or `named` by the caller) read into the
    request's `like`; its messages name the public call (`where()`) and the step: as
    an argument where the call takes one (`restore(step=300)`), else as the step read
    (`restore_or_init: step 300 of ...`: restore_or_init and run take no step)."""
    call = where()
    if named or call == "restore":
        call += f"(step={step}) from {storage.path!r}"
    else:
        call += f": step {step} of {storage.path!r}"
    with calling(call):
        return _read_step(storage, request, step, verify=verify, member=member, named=named)


def _read_step(
    storage: Storage,
    request: Request,
    step: int,
    *,
    verify: bool,
    member: int | tuple[int, ...] | None,
    named: bool,
) -> Any:
    like_specs = request.specs
    opened = _steps.open_step(storage, step, "restore" if named else None)
    seen, meta = opened.identity, _steps.parsed(opened.meta)
    if not named:  # a restart trusts a step only when plain Orbax can read it too
        _steps.check_orbax_description(storage, opened, meta)
    if member is not None:
        index = _member_index(member, meta)
        return _restore_member(storage, opened, meta, request, index, verify)
    if meta.batch_shape:
        _check_batched_like(like_specs, meta.leaves, meta.batch_shape, meta.device_axes)
    request.check(meta.leaves)
    by_name = {spec.name: spec for spec in meta.leaves}
    saved_of = [by_name[spec.name] for spec in like_specs]  # (only like's leaves are read)
    stored = [saved for saved in saved_of if 0 not in saved.stored_shape]
    sums = _steps.sums_to_check(meta, stored, verify)
    arrays = _steps.open_arrays(storage, opened, meta, stored, light=True)
    requests, placements = _requests(request.leaves, like_specs, saved_of)
    results = _steps.read_leaves(arrays, requests, sums, storage, step, seen)
    values = _placed(request, saved_of, placements, results)
    leaves = [
        _rebuild.rebuild(leaf, spec, saved, array)
        for leaf, spec, saved, array in zip(
            request.leaves, like_specs, saved_of, values, strict=True
        )
    ]
    if named:  # (a restart says what it does with such members itself: `unowned`)
        _say_unasked(meta, step)
    return request.build(leaves)


# Per like leaf, where its read's results are: None (a zero-size leaf, described, not
# stored), an index into the results (the whole leaf), or (its sharding, {box: index})
# (each device's block of it).
_Placement = None | int | tuple[jax.sharding.Sharding, dict[_arrays.Box, int]]


def _requests(
    like_leaves: list[Any], like_specs: tuple[_spec.LeafSpec, ...], saved_of: list[_spec.LeafSpec]
) -> tuple[list[tuple[_spec.LeafSpec, _arrays.Box | None]], list[_Placement]]:
    """What to read of each leaf (the whole leaf, or each device's block where `like`
    places it on devices), and where each leaf's results will be."""
    requests: list[tuple[_spec.LeafSpec, _arrays.Box | None]] = []
    placements: list[_Placement] = []
    for leaf, spec, saved in zip(like_leaves, like_specs, saved_of, strict=True):
        sharding = _placement(leaf, spec, saved)
        if 0 in saved.stored_shape:
            placements.append(None)
        elif sharding is None:
            placements.append(len(requests))
            requests.append((saved, None))
        else:  # each device reads its own block (each process: its devices' blocks)
            shape = saved.stored_shape
            boxes: dict[_arrays.Box, int] = {}
            for index in sharding.addressable_devices_indices_map(shape).values():
                box = _box(index, shape)
                if box not in boxes:
                    boxes[box] = len(requests)
                    requests.append((saved, box))
            placements.append((sharding, boxes))
    return requests, placements


def _placed(
    request: Request,
    saved_of: list[_spec.LeafSpec],
    placements: list[_Placement],
    results: list[np.ndarray],
) -> list[Any]:
    """Each leaf's data as read, placed where `like` has it.

    Every leaf whose `like` sits on one device, or is an abstract leaf for the default
    device, is put there in one device_put of all of them (one call, not one per
    leaf: 80 leaves 17 -> 9 ms here); a leaf sharded over several devices is put block
    by block. On a CPU device_put adopts the aligned block the read allocated, without
    a copy. A leaf whose `like` is an uncommitted array goes there uncommitted, as it
    was (`_rebuild.loose`: a pmap refuses a committed copy of a leaf it took)."""
    values: list[Any] = []
    single: dict[int, Any] = {}  # leaf: its device's sharding, or None (the default)
    uncommitted: dict[Any, list[int]] = {}  # a device's sharding: its leaves put there loose
    together = zip(request.leaves, request.specs, saved_of, placements, strict=True)
    for i, (leaf, spec, saved, placed) in enumerate(together):
        shape = saved.stored_shape
        if placed is None:  # zero-size leaves are described, not stored
            values.append(np.zeros(shape, np.dtype(saved.dtype)))
        elif isinstance(placed, int):
            values.append(_as_described(results[placed], saved, shape))
            if _to_default_device(leaf, spec, saved):
                single[i] = None
        elif len(placed[0].device_set) == 1:
            values.append(results[_only_block(placed)])
            if _rebuild.loose(leaf) is None:
                single[i] = placed[0]
            else:  # committed only where like is (a host-made array is not)
                uncommitted.setdefault(placed[0], []).append(i)
        else:
            values.append(_from_blocks(placed, shape, results))
    placed_all = jax.device_put([values[i] for i in single], list(single.values()))
    for i, put in zip(single, placed_all, strict=True):
        values[i] = put
    for sharding, indices in uncommitted.items():
        put = _rebuild.put_loose([values[i] for i in indices], sharding)
        for i, one in zip(indices, put, strict=True):
            values[i] = one
    return values


def _from_blocks(
    placed: tuple[jax.sharding.Sharding, dict[_arrays.Box, int]],
    shape: tuple[int, ...],
    results: list[np.ndarray],
) -> jax.Array:
    """A leaf sharded over several devices, made of the blocks each device read."""
    sharding, boxes = placed
    indices = sharding.addressable_devices_indices_map(shape)
    blocks = []
    for device, index in indices.items():
        assert index is not None  # (an addressable device's index)
        blocks.append(jax.device_put(results[boxes[_box(index, shape)]], device))
    return jax.make_array_from_single_device_arrays(shape, sharding, blocks)


def _to_default_device(like_leaf: Any, spec: _spec.LeafSpec, saved: _spec.LeafSpec) -> bool:
    """An abstract `like` leaf with no sharding whose stored data is what it asks for
    (an array of its dtype, not weakly typed): it goes to the default device as read."""
    return (
        isinstance(like_leaf, jax.ShapeDtypeStruct)
        and like_leaf.sharding is None
        and not like_leaf.weak_type
        and saved.kind == spec.kind == _spec.ARRAY
        and saved.dtype == spec.dtype
    )


def _only_block(placed: object) -> int:
    """The index into the read's results of a leaf placed on one device (one block)."""
    assert isinstance(placed, tuple)
    [index] = placed[1].values()
    return index


def _box(index: tuple[slice, ...], shape: tuple[int, ...]) -> _arrays.Box:
    """A device's index into a leaf (a tuple of slices) as a box."""
    return tuple(s.indices(n)[:2] for s, n in zip(index, shape, strict=True))


def _member_index(member: object, meta: _format.StepMeta) -> tuple[int, ...]:
    """`member` as an index into the batch axes, checked (and saved: a member whose
    `maybe_save` predicate was false at this step holds no state of its own)."""
    index = _member_position(member, meta)
    if not meta.members[index]:
        raise RestoreError(
            f"{where()}: member {index} did not save at step {meta.step} (its "
            "maybe_save predicate was false), so the step holds no state of its own for "
            "it. Fix: restore without step= (each member from the newest step it saved "
            "at), another step, or another member."
        )
    return index


def _member_position(member: object, meta: _format.StepMeta) -> tuple[int, ...]:
    """`member` as an index into the batch axes of `meta`'s step, checked."""
    batch = meta.batch_shape
    if not batch:
        raise ConfigError(
            f"{where()}: member={member!r}, but step {meta.step} was not saved under "
            "vmap (it has no batch axes). Fix: restore without member=."
        )
    parts = (member,) if isinstance(member, int) else member
    index = tuple(parts) if isinstance(parts, tuple) else ()
    ok = (
        len(index) == len(batch)
        and all(isinstance(i, int) and not isinstance(i, bool) for i in index)
        and all(0 <= i < n for i, n in zip(index, batch, strict=True))
    )
    if not ok:
        kind = "an int" if len(batch) == 1 else f"a tuple of {len(batch)} ints"
        raise ConfigError(
            f"{where()}: member={member!r} is not a member of the checkpoint's batch of "
            f"shape {batch}. Fix: pass {kind}, each in range(size of its batch axis)."
        )
    return index


def _check_batched_like(
    like_specs: tuple[_spec.LeafSpec, ...],
    saved_specs: tuple[_spec.LeafSpec, ...],
    batch: tuple[int, ...],
    device_axes: tuple[str, ...] = (),
) -> None:
    """A `like` of one member for a batched checkpoint (of one device, for a pmap
    save: `device_axes`): say so, and how to pick one."""
    by_name = {spec.name: spec for spec in saved_specs}
    for spec in like_specs:
        saved = by_name.get(spec.name)
        if saved is not None and saved.shape != spec.shape and saved.shape == batch + spec.shape:
            pick = "member=k" if len(batch) == 1 else f"member=(i, ..., k) ({len(batch)} ints)"
            if device_axes:
                over = ", ".join(repr(a) for a in device_axes)
                raise StructureMismatchError(
                    f"{where()}: the checkpoint holds one state per device, saved inside "
                    f"pmap/shard_map with axis_name= (axis {over}, {batch[0]} devices: the "
                    f"leading axis of every leaf: {spec.path} is stored as "
                    f"{saved.describe()}), and like has one device's shapes "
                    f"({spec.describe()}). Fix: pass a like with the device axis (the "
                    "state as the pmapped function takes it: an init_fn that returns it "
                    "replicated or split over the devices), or restore one device's "
                    "state with restore(like, member=k)."
                )
            raise StructureMismatchError(
                f"{where()}: the checkpoint holds a batch saved under vmap, of shape {batch} "
                f"(the leading axes of every leaf: {spec.path} is stored as "
                f"{saved.describe()}), and like has one member's shapes "
                f"({spec.describe()}). Fix: restore one member with restore(like, "
                f"{pick}), or pass a like with the batch axes to restore the whole batch."
            )


def _restore_member(
    storage: Storage,
    opened: OpenedStep,
    meta: _format.StepMeta,
    request: Request,
    index: tuple[int, ...],
    verify: bool,
) -> Any:
    """One member of a batched checkpoint, read chunk by chunk (no Orbax, no batch), into
    the request's `like` (one member's state)."""
    step = opened.step
    shown = index[0] if len(index) == 1 else index
    with calling(f"restore(step={step}, member={shown}) from {storage.path!r}"):
        return _read_member(storage, opened, meta, request, index, verify)


def _read_member(
    storage: Storage,
    opened: OpenedStep,
    meta: _format.StepMeta,
    request: Request,
    index: tuple[int, ...],
    verify: bool,
) -> Any:
    step, seen = opened.step, opened.identity
    n = len(meta.batch_shape)
    batched = _batched(meta)
    one = tuple(
        dataclasses.replace(s, shape=s.shape[n:]) if s.name in batched else s for s in meta.leaves
    )
    by_name = {spec.name: spec for spec in one}
    _check_member_like(request.specs, by_name, batched, meta.batch_shape)
    request.check(one)
    full = {s.name: s for s in meta.leaves}
    stored = [full[spec.name] for spec in request.specs if 0 not in full[spec.name].stored_shape]
    sums = _steps.sums_to_check(meta, stored, verify)
    arrays = _steps.open_arrays(storage, opened, meta, stored, light=True)
    requests = []
    for saved in stored:
        if saved.name in batched:  # only the chunks holding the member are read
            box = tuple((i, i + 1) for i in index) + _arrays.whole(saved.stored_shape[n:])
            requests.append((saved, box))
        else:
            requests.append((saved, None))
    results = iter(_steps.read_leaves(arrays, requests, sums, storage, step, seen))
    leaves = []
    for leaf, spec in zip(request.leaves, request.specs, strict=True):
        saved = by_name[spec.name]
        shape = saved.stored_shape
        if 0 in full[spec.name].stored_shape:
            array = np.zeros(shape, np.dtype(saved.dtype))
        else:
            array = _as_described(next(results).reshape(shape), saved, shape)
        leaves.append(_rebuild.rebuild(leaf, spec, saved, array))
    return request.build(leaves)


def _check_member_like(
    like_specs: tuple[_spec.LeafSpec, ...],
    by_name: dict[tuple[str, ...], _spec.LeafSpec],
    batched: set[tuple[str, ...]],
    batch: tuple[int, ...],
) -> None:
    """A `like` with the batch axes, given with member=: say so, and what to pass."""
    for spec in like_specs:
        saved = by_name.get(spec.name)
        if saved is not None and spec.name in batched and spec.shape == batch + saved.shape:
            raise StructureMismatchError(
                f"{where()}: like has the batch axes {batch} (leaf {spec.path} is "
                f"{spec.describe()}); with member=, like is one member's state "
                f"({saved.describe()}). Fix: pass one member's like (e.g. "
                "jax.tree.map(lambda x: x[0], like)), or restore without member=."
            )


def _as_described(array: np.ndarray, saved: _spec.LeafSpec, shape: tuple[int, ...]) -> np.ndarray:
    """A leaf's stored data as the dtype it was saved with, once its shape (`shape`:
    the stored one, or one member's) is the described one; else an error."""
    dtype = np.dtype(saved.dtype)
    value = _dtypes.from_storage(array, dtype) if array.shape == shape else None
    if value is None:
        raise DamagedStepError(
            f"{where()}: leaf {saved.path} is described as {dtype.name}{list(shape)} but "
            f"its data is {array.dtype.name}{list(array.shape)}; the checkpoint was edited "
            "or corrupted. Fix: restore another step.",
            f"leaf {saved.path}'s data is not what its description says",
        )
    return value
