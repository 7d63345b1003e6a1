"""A Checkpointer's reads that continue a run: `restore`, `restore_or_init` and the
restart `run` makes. Each waits for the pending saves, reads through `_read` (the
newest step that passes its checks, newer damaged ones set aside), and tells the
exchange that the run goes on from the step read (`Parts.continue_from`). The reads
that change nothing (`all_steps`, `metadata`, ...) go to `_read._steps` directly."""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from .._base._errors import ConfigError, InvalidStateError, NoCheckpointError, shown, where
from .._base._types import PyTree, Saver
from .._read import _rebuild, _restore, _resume, _steps

if TYPE_CHECKING:
    from .._storage._protocol import Storage
    from ._wiring import Parts

logger = logging.getLogger("jax_cb_ckpt")

# What a restart gives: the state, and its step (per member: an int array).
Resumed = tuple[PyTree, int | np.ndarray]


def restore(
    parts: Parts,
    like: PyTree,
    step: int | None,
    verify: bool,
    member: int | tuple[int, ...] | None,
    partial_restore: bool,
) -> PyTree:
    """`Checkpointer.restore` (its docstring)."""
    parts.wait()
    if step is None:
        request = _restore.make_request(like, partial_restore)
        resumed = resume(parts, request, verify=verify, member=member)
        if resumed is None:
            # Nothing to resume from: the read says what the directory holds.
            _steps.pick_step(parts.storage, None, "restore")
            raise NoCheckpointError(f"restore: no checkpoint in {parts.directory!r}")
        return resumed[0]
    restored = _restore.restore(
        parts.directory,
        like,
        step=step,
        verify=verify,
        member=member,
        partial_restore=partial_restore,
    )
    parts.continue_from(step)
    return restored


def restore_extra(parts: Parts, step: int | None) -> dict[str, Any] | None:
    """`Checkpointer.restore_extra` (its docstring): waits for pending saves first."""
    parts.wait()
    return _steps.restore_extra(parts.directory, step=step)


def restore_or_init(
    ckpt: Saver,
    parts: Parts,
    init_fn: Callable[..., PyTree],
    args: tuple[object, ...],
    like: PyTree,
) -> Resumed:
    """`Checkpointer.restore_or_init` (its docstring); `ckpt` saves a fresh start."""
    parts.check_usable()
    if not callable(init_fn):
        raise ConfigError(
            f"restore_or_init(init_fn={shown(init_fn)}): init_fn must be the "
            "function that makes the initial state, called as init_fn(*args) when "
            "there is no checkpoint. Fix: pass the function, then its arguments: "
            "restore_or_init(init, key)."
        )

    @functools.cache
    def made_like() -> PyTree:  # (args closed over: Python numbers stay numbers)
        if like is not None:
            return like
        try:
            return jax.eval_shape(lambda: init_fn(*args))
        except TypeError as e:  # (JAX's own message names neither us nor init_fn)
            raise InvalidStateError(
                f"restore_or_init: init_fn(*args), traced by jax.eval_shape for the "
                f"structure to restore into, failed: {e}. Fix: init_fn must return the "
                "state, a pytree of arrays (keep strings and other static values out of it)."
            ) from e

    def fresh() -> PyTree:
        init = init_fn(*args)
        if like is not None:  # a weakly typed leaf in like's (the loop's) dtype
            init = _rebuild.as_carried(init, like)
        return init

    resumed = resume(parts, made_like, fresh=fresh)
    if resumed is not None:
        return resumed
    init = fresh()
    if parts.options.when.initial_save:
        ckpt.save(init, 0)
        ckpt.wait()  # on disk before the run goes on (and lists its steps)
    return init, 0


def resume(
    parts: Parts,
    like: Callable[[], PyTree] | _restore.Request,
    *,
    verify: bool = True,
    member: int | tuple[int, ...] | None = None,
    fresh: Callable[[], PyTree] | None = None,
    damaged: list[int] | None = None,
) -> Resumed | None:
    """A restart: (the state, its step) of the newest step that passes its checks
    (ours, or a plain Orbax step), the newer damaged ones passed over and set aside
    (`on_damaged`), said in one INFO line; None when there is nothing to resume from.
    `like()` is what the step is read into (made only when there is one to read).
    Members of a vmap batch that asked for no step of their own start again from
    `fresh()`'s state at step 0 (`restore_or_init`, said in the INFO line); without
    `fresh` they keep what the step holds, said in a `MemberStateWarning`. Waits for
    pending saves first. `damaged`, where given, gets the steps passed over on a fresh
    start (`run`'s start line names them)."""
    parts.wait()
    on_damaged = parts.options.failures.on_damaged

    def read(storage: Storage) -> _resume.Resumed[_restore.Restart]:
        return _restore.resume(storage, like, verify=verify, member=member, on_damaged=on_damaged)

    storage, resumed = _newest_of_tiers(parts, read)
    parts.resumed_from = None if resumed.step is None else storage.path
    if resumed.step is None:
        if resumed.error is not None and where() == "restore":
            raise resumed.refusal()  # asked to restore, and nothing can be: nothing moved
        _resume.report(storage, resumed, set_aside=True)  # a fresh start
        if damaged is not None:
            damaged.extend(p.step for p in resumed.passed)
        parts.exchange.forget(parts.steps_on_disk())
        return None
    resumed = _resume.report(storage, resumed, set_aside=True)
    step = resumed.step
    assert step is not None  # (report keeps the step read)
    parts.continue_from(step)
    why = "the newest step that passes its checks"
    if storage is parts.persistent:
        why += " (of the persistent tier)"
    if resumed.passed:
        why += ", passing over " + ", ".join(str(p.step) for p in resumed.passed)
    if resumed.source == "orbax":
        why += "; a plain Orbax checkpoint, read unverified (Orbax keeps no checksums)"
    restart = resumed.value
    assert restart is not None
    state, start, more = _members(storage, restart, step, fresh)
    verb = "restored step" if where() == "restore" else "resumed from step"
    logger.info("%s: %s %d of %s (%s)", where(), verb, step, storage.path, why + more)
    return state, start


def _newest_of_tiers(
    parts: Parts, read: Callable[[Storage], _resume.Resumed[_restore.Restart]]
) -> tuple[Storage, _resume.Resumed[_restore.Restart]]:
    """The newest step that passes its checks in either tier (with persistent=), and
    its tier's storage: the local tier is read first; the persistent one only where it
    lists a newer step than the one read (a lost local directory, a damaged newest
    local step: its persistent copy). The local steps passed over are set aside and
    said in a warning (`_resume.report`) when the persistent tier gives the step."""
    local = parts.storage
    resumed = read(local)
    tier = parts.persistent
    if tier is None:
        return local, resumed
    newest = max(tier.list_steps(), default=None)
    if newest is None or (resumed.step is not None and newest <= resumed.step):
        return local, resumed
    # A newer step in the persistent tier: the local state read is let go before that
    # one is read (one state in memory at a time: a model sized to its device fits),
    # and read again only where none of the persistent tier's newer steps passes.
    below = resumed.step
    resumed = dataclasses.replace(resumed, value=None)
    other = read(tier)
    if other.step is None or (below is not None and other.step <= below):
        _resume.report(tier, other, set_aside=True)  # (its damaged steps, said)
        del other
        return local, (resumed if below is None else read(local))
    if resumed.passed:  # the damaged local steps newer than the one read: set aside
        _resume.report(local, resumed, set_aside=True, instead=(other.step, tier.path))
    return tier, other


def _members(
    storage: Storage, restart: _restore.Restart, step: int, fresh: Callable[[], PyTree] | None
) -> tuple[PyTree, int | np.ndarray, str]:
    """The state and step a batch's members resume from, and what the INFO line says
    of them: each member from its own newest step; one that asked for no step keeps
    what `step` holds (a warning), or starts again from `fresh()` at step 0."""
    start: int | np.ndarray = step
    state, why = restart.state, ""
    if restart.unowned and fresh is None:
        _restore.say_unowned(restart.unowned, step)
    elif restart.unowned and fresh is not None:
        # Asked for no step: they start again, as a fresh run does.
        assert restart.member_steps is not None  # (set wherever members are unowned)
        state = _restore.members_from(storage, step, state, fresh(), restart.unowned)
        for index in restart.unowned:
            restart.member_steps[index] = 0
    if restart.member_steps is not None:  # members of a batch resume from their own
        start = restart.member_steps
        why += f"; the batch's members from their own newest steps {start.tolist()}"
    if restart.unowned and fresh is not None:
        why += (
            f"; member(s) {_restore.members_text(restart.unowned)} asked for no step "
            "and start again from init_fn's state at step 0"
        )
    return state, start, why


def best_step(parts: Parts, member: int | tuple[int, ...] | None) -> int | None:
    """`Checkpointer.best_step` (its docstring): by the Checkpointer's `best` and `mode`."""
    keep = parts.options.keep
    if keep.best is None:
        raise ConfigError(
            "best_step: this Checkpointer ranks no metric. Fix: create it with "
            "keep_best=N, best='<metric name>' (and mode='max' or 'min'), or use "
            "jax_cb_ckpt.best_step(directory, best=..., mode=...)."
        )
    return _steps.best_step(
        parts.directory, best=keep.best, mode=keep.mode, member=member, ignore_recorded=True
    )
