"""A Checkpointer's options: frozen groups that check themselves, in one object.

`Checkpointer(...)`'s flat keywords are the public spelling. `checked(...)` hands each
keyword to the group whose field it is (`GROUPS`: the groups' fields are the one list
of them) and returns the frozen `Options`; nothing changes it afterwards. Each group
checks its own fields in `__post_init__` (every error names the argument, what it got,
what is allowed and how to fix it), so no group holds a bad value however it is made.

The stages below the façade get what they read as arguments (`HostSide` the queue
size, `Writer` the directory, the rules and compression, `Exchange` the failure
rules): none of them imports this module.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import os
import typing
from collections.abc import Callable, Iterable, Sequence
from typing import Any, ClassVar

import jax

from .._base._errors import ConfigError, calling, shown
from .._base._types import BestMode, Crossing, OnDamaged, OnError, OnExisting, OnFull
from .._layout import _policy, _rule
from .._layout._keep_best import BestN
from .._layout._keep_latest import LatestN
from .._layout._policy import AnyOf
from .._layout._rule import Rule
from .._read._resume import check_on_damaged
from .._storage import _places
from .._write._incremental import FULL_EVERY

_ON_FULL = typing.get_args(OnFull)
_ON_ERROR = typing.get_args(OnError)
_ON_EXISTING = typing.get_args(OnExisting)
_CROSSING = typing.get_args(Crossing)

# How often a bare maybe_save asks the host whether `every_seconds` have passed: one
# scalar crossing per 100 steps (benchmarks.policies measures its cost).
DEFAULT_CHECK_EVERY = 100


@dataclasses.dataclass(frozen=True)
class Where:
    """Where the steps go, and how a save travels there."""

    directory: str  # given: a str or PathLike; kept: absolute, or a canonical URL
    crossing: Crossing = "auto"  # how traced arrays reach the host
    compression: bool = False  # zstd for the stored arrays
    incremental: bool = False  # link the chunks that did not change (`_incremental`)
    full_every: int | None = FULL_EVERY  # incremental: every this many saves whole

    def __post_init__(self) -> None:
        with calling("Checkpointer(directory=...)"):
            path = _places.resolve(self.directory)
        if not _places.is_url(path) and os.path.exists(path) and not os.path.isdir(path):
            raise ConfigError(
                f"Checkpointer(directory={path!r}): that path is an existing file, not "
                "a directory. Fix: pass a directory path (it is created if missing)."
            )
        if self.crossing not in _CROSSING:
            raise ConfigError(
                f"Checkpointer(crossing={self.crossing!r}): crossing must be one of "
                f"{_CROSSING}: 'auto' (the copy-once 'buffer' crossing on CPU and CUDA "
                "GPUs, 'callback' elsewhere), "
                "'buffer' or 'callback' (jax.debug.callback, JAX's by-value copy)."
            )
        object.__setattr__(self, "directory", path)
        object.__setattr__(self, "compression", bool(self.compression))
        if not isinstance(self.incremental, bool):
            raise ConfigError(
                f"Checkpointer(incremental={shown(self.incremental)}): incremental must be "
                "True (a step links the chunks that did not change since the step before "
                "it) or False."
            )
        _positive_int(
            self.full_every, "full_every", "write every this many saves whole", optional=True
        )
        if self.full_every != FULL_EVERY and not self.incremental:
            raise ConfigError(
                f"Checkpointer(full_every={self.full_every}): full_every says how often an "
                "incremental save is written whole, and incremental is False. Fix: pass "
                "incremental=True too, or leave full_every out."
            )
        if self.incremental:  # (a bucket's links need its provider's client library)
            with calling("Checkpointer(incremental=True)"):
                _places.check_links(path)


@dataclasses.dataclass(frozen=True)
class When:
    """When `maybe_save` (and `run`, `ckpt.scan`, `restore_or_init`) save."""

    every: int | None = None  # save when step % every == 0
    every_seconds: float | None = None  # also save when this long has passed
    check_every: int | None = None  # a bare maybe_save asks the clock (None: `check`)
    initial_save: bool = False  # run / scan / restore_or_init save the starting state

    def __post_init__(self) -> None:
        _positive_int(self.every, "every", "save when step % every == 0", optional=True)
        seconds = _positive_seconds(
            self.every_seconds, "every_seconds", "save when this long passed"
        )
        check = _positive_int(
            self.check_every, "check_every", "ask the clock every this many steps", optional=True
        )
        if check is not None and seconds is None:
            raise ConfigError(
                f"Checkpointer(check_every={check}): check_every says how often a maybe_save "
                "asks whether every_seconds have passed, and there is no every_seconds. Fix: "
                "pass every_seconds=T too, or leave check_every out (run()'s own check_every "
                "says how often it reads the stop request)."
            )
        if not isinstance(self.initial_save, bool):
            raise ConfigError(
                f"Checkpointer(initial_save={shown(self.initial_save)}): initial_save must be "
                "True or False (save the starting state of a fresh run: run(), ckpt.scan, "
                "restore_or_init)."
            )
        object.__setattr__(self, "every_seconds", seconds)

    @property
    def check(self) -> int:
        """Every how many steps a bare maybe_save asks the clock (`every_seconds`)."""
        return DEFAULT_CHECK_EVERY if self.check_every is None else self.check_every


@dataclasses.dataclass(frozen=True)
class Keep:
    """What retention keeps: a step any rule keeps, and the newest (no rule: every
    step). The rules come as objects (`keep=[LatestN(3), BestN("loss", 2, "min")]`)
    or in their short form, the keywords that build them (`max_to_keep=3, keep_best=2,
    best="loss", mode="min"`; `short`: those given, defaults left out), never both.
    `rules` is them combined, as the writer's retention reads it (None: keep all)."""

    keep: Sequence[Rule] | None = None
    short: tuple[tuple[str, Any], ...] = ()
    rules: AnyOf | None = dataclasses.field(init=False)

    # The keywords of `Checkpointer(...)` it holds, with their defaults: `keep` and
    # each rule's short form (`_policy.keywords`).
    KEYWORDS: ClassVar[dict[str, Any]] = {"keep": None, **_policy.keywords()}

    @classmethod
    def given(cls, keep: Sequence[Rule] | None = None, **short: Any) -> Keep:
        """The group from `Checkpointer(...)`'s keywords."""
        return cls(keep, tuple(short.items()))

    def __post_init__(self) -> None:
        known = self.KEYWORDS
        unknown = sorted(k for k, _ in self.short if k not in known or k == "keep")
        if unknown:
            raise TypeError(f"Keep: no option {unknown}")  # (a bug of ours)
        short = tuple(
            (k, v) for k, v in self.short if type(v) is not type(known[k]) or v != known[k]
        )
        object.__setattr__(self, "short", short)
        if self.keep is None:
            rules = AnyOf.short(dict(short))
        else:
            rules = _rule_objects(self.keep, [name for name, _ in short])
            object.__setattr__(self, "keep", rules.rules)  # (a tuple: frozen, hashable)
        object.__setattr__(self, "rules", rules if rules.any else None)

    # What the façade reads: the metric ranked (`best_step`, a misspelt `best`'s
    # warning), its mode, and `max_to_keep` (the Checkpointer's repr).

    @property
    def best(self) -> str | None:
        return None if self.rules is None else self.rules.metric

    @property
    def mode(self) -> BestMode:
        ranked = None if self.rules is None else self.rules.find(BestN)
        return "max" if ranked is None else ranked.mode

    @property
    def max_to_keep(self) -> int | None:
        latest = None if self.rules is None else self.rules.find(LatestN)
        return None if latest is None else latest.n


def _rule_objects(keep: object, short: list[str], name: str = "keep") -> AnyOf:
    """`keep=[...]` combined, or a `ConfigError` naming `keep` (`name`: the keyword it
    was given as) and the keywords that `keep` cannot be given with."""
    if short:
        names, plain = ", ".join(f"{n}=..." for n in short), ", ".join(short)
        raise ConfigError(
            f"Checkpointer(keep=[...], {names}): keep= and {plain} both say what to keep "
            f"(keep= as rule objects, {plain} as the keywords' short form); give one or the "
            "other. Fix: put every rule in keep=, e.g. keep=[jax_cb_ckpt.LatestN(3), "
            "jax_cb_ckpt.BestN('loss', 2, 'min')], or drop keep=."
        )
    if isinstance(keep, str | bytes | dict) or not isinstance(keep, Iterable):
        raise ConfigError(
            f"Checkpointer({name}={shown(keep)}): {name} must be a list of retention rules, "
            f"got a {type(keep).__name__}. Fix: e.g. keep=[jax_cb_ckpt.LatestN(3)]."
        )
    rules = tuple(keep)
    for index, rule in enumerate(rules):
        if not isinstance(rule, _policy.RULES):
            what = "the class itself" if isinstance(rule, type) else type(rule).__name__
            raise ConfigError(
                f"Checkpointer({name}=[...]): {name}[{index}] is {shown(rule)} ({what}), not a "
                f"retention rule. Fix: one of {', '.join(k.__name__ for k in _policy.RULES)}"
                ", made with its arguments, e.g. jax_cb_ckpt.LatestN(3)."
            )
    problem = AnyOf.problem(rules)
    if problem is not None:
        raise ConfigError(f"Checkpointer({name}=[...]): {problem}")
    return AnyOf(rules)


@dataclasses.dataclass(frozen=True)
class Queue:
    """Saves in flight, and what a save does when they fill the queue."""

    queue_size: int = 2  # saves handed over and not yet written, at most
    on_full: OnFull = "block"

    def __post_init__(self) -> None:
        _positive_int(self.queue_size, "queue_size", "saves in flight at most", optional=False)
        on_full = self.on_full
        if on_full not in _ON_FULL:
            raise ConfigError(
                f"Checkpointer(on_full={on_full!r}): on_full must be one of {_ON_FULL}: "
                "'block' makes the device wait when the queue is full (nothing lost), "
                "'skip' drops that save and counts it, 'newest' drops the oldest save "
                "still waiting instead (the device never waits for the disk)."
            )
        if on_full != "block" and jax.process_count() > 1:
            raise ConfigError(
                f"Checkpointer(on_full={on_full!r}): in a multi-process run each process's "
                "queue fills at its own pace, so the processes would drop different "
                "steps and no checkpoint would be complete. Fix: use on_full='block' "
                "(the default) and a larger queue_size."
            )

    @property
    def slots(self) -> int:
        """Saves in flight at most: with "newest", `queue_size` wait and one more may
        be being written."""
        return self.queue_size + (self.on_full == "newest")


@dataclasses.dataclass(frozen=True)
class Failures:
    """What a failed write, another run's steps, a damaged newest step and a silent
    peer process do."""

    on_error: OnError = "raise"
    on_existing: OnExisting = "raise"
    on_damaged: OnDamaged = "fall_back"
    peer_timeout: float = 60.0  # seconds a process waits for the others at a save

    def __post_init__(self) -> None:
        if self.on_error not in _ON_ERROR:
            raise ConfigError(
                f"Checkpointer(on_error={self.on_error!r}): on_error must be one of "
                f"{_ON_ERROR}: 'raise' stops the run at a failed write, 'continue' trains "
                "on and counts it."
            )
        if self.on_existing not in _ON_EXISTING:
            raise ConfigError(
                f"Checkpointer(on_existing={self.on_existing!r}): on_existing must be one of "
                f"{_ON_EXISTING}: 'raise' refuses a save that would mix with another "
                "run's steps in the directory, 'replace' deletes that run's steps from "
                "the saved step on and writes the new one."
            )
        check_on_damaged(self.on_damaged, "Checkpointer")
        timeout = self.peer_timeout
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not timeout > 0:
            raise ConfigError(
                f"Checkpointer(peer_timeout={timeout!r}): peer_timeout must be a "
                "positive number of seconds (how long a process of a multi-process run "
                "waits for the others at each save)."
            )
        object.__setattr__(self, "peer_timeout", float(timeout))


@dataclasses.dataclass(frozen=True)
class Tiers:
    """The persistent tier (Orbax's emergency checkpointing): a second checkpoint
    directory that every `persistent_every`-th step (or one step per
    `persistent_every_seconds`) is copied to, with its own retention."""

    persistent: str | None = None  # given: a str or PathLike; kept: as `directory`
    persistent_every: int | None = None
    persistent_every_seconds: float | None = None
    persistent_keep: Sequence[Rule] | None = None
    rules: AnyOf | None = dataclasses.field(init=False, default=None)

    def __post_init__(self) -> None:
        given = [
            name
            for name in ("persistent_every", "persistent_every_seconds", "persistent_keep")
            if getattr(self, name) is not None
        ]
        if self.persistent is None:
            if given:
                raise ConfigError(
                    f"Checkpointer({given[0]}=...): {given[0]} is an option of the "
                    "persistent tier, and there is no persistent=. Fix: pass persistent="
                    "a second directory or a gs:// / s3:// URL, or drop "
                    f"{', '.join(given)}."
                )
            return
        with calling("Checkpointer(persistent=...)"):
            object.__setattr__(self, "persistent", _places.resolve(self.persistent))
        _positive_int(
            self.persistent_every, "persistent_every", "copy every N-th step", optional=True
        )
        seconds = _positive_seconds(
            self.persistent_every_seconds, "persistent_every_seconds", "copy one step per T s"
        )
        object.__setattr__(self, "persistent_every_seconds", seconds)
        if self.persistent_every is None and seconds is None:
            raise ConfigError(
                f"Checkpointer(persistent={self.persistent!r}): say which steps go to the "
                "persistent tier. Fix: pass persistent_every=N (every N-th step saved) "
                "and/or persistent_every_seconds=T (one step per T seconds)."
            )
        if self.persistent_keep is not None:
            rules = _rule_objects(self.persistent_keep, [], "persistent_keep")
            object.__setattr__(self, "persistent_keep", rules.rules)
            object.__setattr__(self, "rules", rules if rules.any else None)


@dataclasses.dataclass(frozen=True)
class Options:
    """Every option of a Checkpointer, checked, by what it is about."""

    where: Where
    when: When
    keep: Keep
    queue: Queue
    failures: Failures
    tiers: Tiers = Tiers()

    def __post_init__(self) -> None:
        persistent = self.tiers.persistent
        if persistent is not None:
            _check_tiers(self.where.directory, persistent)


def _check_tiers(directory: str, persistent: str) -> None:
    """The two tiers: two different places, the local one a local directory, one
    process (a `ConfigError` naming `persistent=` otherwise)."""
    why = fix = ""
    if persistent == directory:
        why = "it is the local directory itself"
        fix = "pass another directory or a bucket URL"
    elif _places.is_url(directory):
        why = f"the local tier, directory={directory!r}, is a URL"
        fix = "pass a local directory as directory= (the fast tier)"
    elif not _places.is_url(persistent) and (
        persistent.startswith(directory + os.sep) or directory.startswith(persistent + os.sep)
    ):
        why = "one directory is inside the other"
        fix = "pass two separate directories"
    elif jax.process_count() > 1:
        why = "a multi-process run cannot keep a persistent tier yet"
        fix = "drop persistent= in multi-process runs (docs/usage.md, emergency checkpointing)"
    if fix:
        raise ConfigError(f"Checkpointer(persistent={persistent!r}): {why}. Fix: {fix}.")


Group = Where | When | Keep | Queue | Failures | Tiers
_G = typing.TypeVar("_G", Where, When, Keep, Queue, Failures, Tiers)

# Each group under its name in `Options`; a keyword of `Checkpointer(...)` belongs to
# the group with a field of its name.
GROUPS: dict[str, type[Group]] = typing.get_type_hints(Options)


def keywords(group: type[Group]) -> tuple[str, ...]:
    """The keywords of `Checkpointer(...)` that `group` holds (its fields given by
    the caller, not those it derives; `Keep`: its `KEYWORDS`)."""
    if group is Keep:
        return tuple(Keep.KEYWORDS)
    return tuple(f.name for f in dataclasses.fields(group) if f.init)


def checked(directory: object, **given: Any) -> Options:
    """The options of `Checkpointer(directory, **given)`, or a `ConfigError` for the
    first invalid one (checked all the same for callers that are not type-checked); an
    option not given takes its group's default."""
    unknown = set(given) - {k for group in GROUPS.values() for k in keywords(group)}
    if unknown:
        raise TypeError(f"checked: no option {sorted(unknown)}")  # (a bug of ours)
    given["directory"] = directory

    def made(group: type[_G]) -> _G:
        chosen = {k: given[k] for k in keywords(group) if k in given}
        return Keep.given(**chosen) if group is Keep else group(**chosen)  # type: ignore[return-value]

    return Options(made(Where), made(When), made(Keep), made(Queue), made(Failures), made(Tiers))


def _positive_seconds(value: object, name: str, meaning: str) -> float | None:
    return _rule.positive_seconds(value, "Checkpointer", name, meaning)


def _positive_int(value: object, name: str, meaning: str, *, optional: bool) -> int | None:
    return _rule.positive_int(value, "Checkpointer", name, meaning, optional=optional)


# Orbax's `CheckpointManagerOptions` names, answered with ours (docs/usage.md's table):
# a user coming from Orbax guesses them, and Python's own answer is a bare TypeError.
ORBAX_NAMES = {
    "save_interval_steps": "every=N (maybe_save's default predicate: step % N == 0)",
    "save_on_steps": "when= on maybe_save (a bool), or last_step= for the loop's last step",
    "should_save_fn": "when= on maybe_save (any bool, traced or not)",
    "save_decision_policy": "every=N and/or every_seconds=T",
    "keep_period": "keep_every=K (every step that is a multiple of K, kept forever)",
    "keep_time_interval": "keep_every_seconds=T",
    "preservation_policy": (
        "keep=[jax_cb_ckpt.LatestN(n), jax_cb_ckpt.EveryNSteps(n), jax_cb_ckpt.EveryNSeconds(s), "
        "jax_cb_ckpt.BestN(metric, n, mode)] (a union), or the keywords max_to_keep=, keep_every=, "
        "keep_every_seconds=, keep_best="
    ),
    "best_fn": (
        "best='<metric name>', with metrics={name: value} passed to each save (Orbax's "
        "best_fn computes the value from the metrics; here the metric is named)"
    ),
    "best_mode": "mode='max' or mode='min'",
    "keep_checkpoints_without_metrics": (
        "nothing: a step without the metric never counts as best, and max_to_keep or "
        "keep_every keep it as they keep any step"
    ),
    "enable_async_checkpointing": "nothing: saves are always written in the background",
    "async_options": "queue_size= and on_full=",
    "create": "nothing: the directory is always created",
    "cleanup_tmp_directories": (
        "nothing: what a killed writer left is removed when a Checkpointer opens the directory"
    ),
    "step_prefix": "nothing: steps are folders named by the step in plain decimal",
    "step_format_fixed_length": "nothing: steps are folders named by the step in plain decimal",
    "multiprocessing_options": (
        "peer_timeout= (every process makes a Checkpointer: docs/multiprocess.md)"
    ),
}


def orbax_names(init: Callable[..., None]) -> Callable[..., None]:
    """`Checkpointer.__init__`, with a keyword of Orbax's options answered by ours (a
    `ConfigError` naming both) instead of Python's bare "unexpected keyword argument"."""
    known = set(inspect.signature(init).parameters)

    @functools.wraps(init)
    def checked_init(self: object, *args: object, **kwargs: object) -> None:
        for name in kwargs:
            if name not in known and name in ORBAX_NAMES:
                raise ConfigError(
                    f"Checkpointer({name}=...): {name} is Orbax's CheckpointManagerOptions "
                    f"name; here it is {ORBAX_NAMES[name]}. See docs/usage.md (each "
                    "option's Orbax name)."
                )
        init(self, *args, **kwargs)

    return checked_init
