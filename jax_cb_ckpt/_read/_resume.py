"""Where a restart resumes from: the newest step that passes its checks.

A restart (`Checkpointer.restore_or_init`, `Checkpointer.run`, `restore` without
`step=`) walks the directory's steps from the newest down and reads the first one that
passes its checks: every byte against its checksums (with `verify`), its description
against its files. A step of ours that does not (a damaged description, a flipped bit, a
cut file) is passed over, and a `DamagedStepWarning` names each one passed over and
why. Nothing is deleted: a Checkpointer (which holds the directory's lock) sets each
step it passed over aside under a name that is not a step (`_format.SET_ASIDE_PATTERN`,
`Storage.set_aside_damaged`), so the run can write that step number again; a plain
read (`jax_cb_ckpt.restore`) touches nothing. `on_damaged="raise"` stops instead, at
the first step that would be passed over.

Only damage is passed over (`DamagedStepError`): a `like` that does not fit
(`StructureMismatchError`), storage out of reach or a refused permission is raised as
it is, so a network failure never sends a run back to an older step. A step named by
`step=` never falls back.

A plain Orbax checkpoint (`_plain`) counts as a step to resume from too: it is read
with Orbax and said to be unverified (Orbax keeps no checksums); it is never set aside
or otherwise touched.

Runs in the caller's thread and blocks it while it reads; each step tried is read whole.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Callable
from typing import Generic, Literal, TypeVar

from .._base import _warn
from .._base._errors import (
    ConfigError,
    DamagedStepError,
    DamagedStepWarning,
    RestoreError,
    shown,
    where,
)
from .._base._types import OnDamaged
from .._storage._protocol import Storage
from . import _plain

T = TypeVar("T")
Source = Literal["jax_cb_ckpt", "orbax"]


@dataclasses.dataclass(frozen=True)
class Passed:
    """A step a restart passed over, why, and where it went (`set_aside`: its new name,
    None when it stayed: a plain read, an Orbax step, or a set-aside that failed)."""

    step: int
    why: str
    set_aside: str | None = None
    plain: bool = False  # a plain Orbax step: never set aside


@dataclasses.dataclass(frozen=True)
class Resumed(Generic[T]):
    """What a restart found: the value read (None when no step passes its checks), its
    step and where it came from, the steps passed over on the way (newer ones), and the
    error of the newest of them (what a read that cannot fall back raises)."""

    value: T | None
    step: int | None
    source: Source | None
    passed: tuple[Passed, ...]
    error: DamagedStepError | None = None
    older: tuple[Passed, ...] = ()  # damaged steps below the one read: left as they are

    def refusal(self) -> DamagedStepError:
        """The error of a read that found no step passing its checks (every step is
        damaged): the newest one's, naming the others."""
        assert self.error is not None
        others = "; ".join(f"step {p.step}: {p.why}" for p in self.passed[1:])
        if not others:
            return self.error
        return DamagedStepError(
            f"{self.error} No older step passes its checks either ({others}).", self.error.why
        )


def newest(
    storage: Storage,
    read: Callable[[int], T],
    read_plain: Callable[[_plain.PlainStep], T],
    *,
    on_damaged: OnDamaged,
) -> Resumed[T]:
    """The newest step of `storage` that passes its checks, read by `read(step)` (ours)
    or `read_plain(found)` (a plain Orbax step), and the newer steps passed over. Touches
    nothing and says nothing (`report` does); with `on_damaged="raise"`, raises
    `DamagedStepError` at the first step it would pass over."""
    found = storage.examine_all()
    plain = _plain.steps(storage, found)
    candidates = sorted(
        {s for s, f in found.items() if f.kind != "foreign"} | set(plain), reverse=True
    )
    passed: list[Passed] = []
    first: DamagedStepError | None = None
    for step in candidates:
        examined = found.get(step)
        if examined is not None and examined.kind == "unreadable":
            raise RestoreError(
                f"{where()}: step {step} of {storage.path!r}, newer than every step read so "
                f"far, cannot be read: {examined.why}. A restart does not go back past a "
                "step it may not read (it may be the newest state). Fix: give this process "
                "read access to the folder, or move it out of the directory."
            )
        if examined is not None and examined.kind == "damaged":
            error = DamagedStepError(
                f"{where()}: step {step} in {storage.path!r} is damaged ({examined.why}); "
                "nothing was read from it. Fix: restore another step (all_steps()), or "
                "the folder from a good copy.",
                examined.why,
            )
        else:
            try:
                if step in plain:
                    value, source = read_plain(plain[step]), "orbax"
                else:
                    value, source = read(step), "jax_cb_ckpt"
            except DamagedStepError as e:
                error = e
            else:
                older = tuple(
                    Passed(s, f.why)
                    for s, f in sorted(found.items())
                    if s < step and f.kind == "damaged"
                )
                return Resumed(value, step, source, tuple(passed), first, older)
        if on_damaged == "raise":
            raise DamagedStepError(
                f"{error} (on_damaged='raise': a restart stops at the newest step when it is "
                "damaged; with on_damaged='fall_back', the default, it resumes from the "
                "newest step that passes its checks)",
                error.why,
            ) from error
        passed.append(Passed(step, error.why, plain=step in plain))
        first = first or error
    return Resumed(None, None, None, tuple(passed), first)


def report(
    storage: Storage,
    resumed: Resumed[T],
    *,
    set_aside: bool,
    instead: tuple[int, str] | None = None,
) -> Resumed[T]:
    """Say what a restart passed over (one `DamagedStepWarning`), each step of ours set
    aside first when asked (a plain Orbax step never is): `resumed`, with where each
    step went. `instead`: the step read from another directory, (step, its path) (a
    Checkpointer's persistent tier), which the warning names as the one read."""
    if not resumed.passed and not resumed.older:
        return resumed
    passed = _aside(storage, list(resumed.passed)) if set_aside else resumed.passed
    resumed = dataclasses.replace(resumed, passed=passed)
    _say(storage, resumed, set_aside, instead)
    return resumed


def _aside(storage: Storage, passed: list[Passed]) -> tuple[Passed, ...]:
    """`passed`, each step of ours set aside (a plain Orbax step never is)."""
    done = []
    for one in passed:
        if one.plain:
            done.append(one)
            continue
        try:
            name = storage.set_aside_damaged(one.step, one.why)
            done.append(dataclasses.replace(one, set_aside=name))
        except OSError as e:  # (a bucket's StorageError is an OSError)
            why = f"{one.why}; it could not be set aside ({e}), so it stays where it is"
            done.append(dataclasses.replace(one, why=why))
    return tuple(done)


def _say(
    storage: Storage, result: Resumed[T], set_aside: bool, instead: tuple[int, str] | None
) -> None:
    """One `DamagedStepWarning` naming every step passed over, why, and what became of it."""
    parts = []
    for one in result.passed:
        if one.set_aside is not None:
            fate = f"set aside as {one.set_aside!r}"
        elif one.plain:
            fate = "left in place (a plain Orbax step)"
        else:
            fate = "left in place"
        parts.append(f"step {one.step}: {one.why} ({fate})")
    if instead is not None:
        said = (
            f"read step {instead[0]} of {instead[1]!r} (the persistent tier), newer than "
            f"every step of {storage.path!r} that passes its checks"
        )
    elif result.step is None:
        said = (
            f"no step of {storage.path!r} passes its checks, so the run starts from its "
            "initial state"
        )
    else:
        said = (
            f"read step {result.step} of {storage.path!r}, the newest step that passes its checks"
        )
    if parts:
        said += f", passing over {len(parts)} newer step(s): " + "; ".join(parts)
        said += ". Nothing was deleted."
        if any(one.set_aside is not None for one in result.passed):
            said += (
                " A step set aside is no longer a step: the run can write that step number "
                "again, and `jax-cb-ckpt ls` shows it."
            )
        said += " To stop at a damaged step instead, pass on_damaged='raise'."
    else:
        said += "."
    if result.older:
        older = "; ".join(f"step {p.step}: {p.why}" for p in result.older)
        said += (
            f" {len(result.older)} older step folder(s) claim to be jax_cb_ckpt checkpoints "
            f"but are damaged and are not listed ({older}); they are left as they are. Fix: "
            "restore them from a good copy, or move them out of the directory; "
            "`jax-cb-ckpt verify` checks every step."
        )
    _warn.warn(f"{where()}: {said}", DamagedStepWarning)


_ON_DAMAGED = typing.get_args(OnDamaged)


def check_on_damaged(on_damaged: object, where: str) -> None:
    """`on_damaged` (a Checkpointer's, or `restore`'s) is one of its values."""
    if on_damaged not in _ON_DAMAGED:
        raise ConfigError(
            f"{where}(on_damaged={shown(on_damaged)}): on_damaged must be one of "
            f"{_ON_DAMAGED}: 'fall_back' resumes from the newest step that passes its "
            "checks, naming each newer step passed over (DamagedStepWarning); 'raise' "
            "stops at a damaged newest step (DamagedStepError)."
        )
