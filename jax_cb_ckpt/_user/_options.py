"""A Checkpointer's options: checked once, in one place, then read by every part.

`checked(...)` validates every argument of `Checkpointer(...)` (each error names the
argument, what it got, what is allowed and how to fix it) and returns a frozen
`_types.Options`, which the Checkpointer hands to the host side and the writer; nothing
changes it afterwards.
"""

from __future__ import annotations

import functools
import inspect
import math
import os
import typing
from collections.abc import Callable

import jax

from .._base._errors import ConfigError, shown
from .._base._types import BestMode, Crossing, OnDamaged, OnError, OnExisting, OnFull, Options
from .._layout import _format
from .._layout._policy import Rules
from .._read._resume import check_on_damaged
from .._storage import _places, _remote

_ON_FULL = typing.get_args(OnFull)
_ON_ERROR = typing.get_args(OnError)
_ON_EXISTING = typing.get_args(OnExisting)
_CROSSING = typing.get_args(Crossing)
_MODES = typing.get_args(BestMode)


def checked(
    directory: str | os.PathLike[str],
    *,
    every: int | None,
    max_to_keep: int | None,
    queue_size: int,
    on_full: OnFull,
    compression: bool,
    on_error: OnError,
    on_existing: OnExisting,
    crossing: Crossing,
    peer_timeout: float,
    every_seconds: float | None = None,
    check_every: int | None = None,
    initial_save: bool = False,
    keep_every: int | None = None,
    keep_every_seconds: float | None = None,
    keep_best: int | None = None,
    best: str | None = None,
    mode: BestMode = "max",
    on_damaged: OnDamaged = "fall_back",
) -> Options:
    """The options, or a `ConfigError` for the first invalid one. (Typed as the
    Checkpointer declares them; checked all the same, for callers that are not
    type-checked.)"""
    path = _places.resolve(directory, "Checkpointer(directory=...)")
    if not _remote.is_url(path) and os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError(
            f"Checkpointer(directory={path!r}): that path is an existing file, not "
            "a directory. Fix: pass a directory path (it is created if missing)."
        )
    every = _positive_int(every, "every", "save when step % every == 0", optional=True)
    max_to_keep = _positive_int(
        max_to_keep, "max_to_keep", "how many checkpoints to keep", optional=True
    )
    size = _positive_int(queue_size, "queue_size", "saves in flight at most", optional=False)
    assert size is not None
    if on_full not in _ON_FULL:
        raise ConfigError(
            f"Checkpointer(on_full={on_full!r}): on_full must be one of {_ON_FULL}: "
            "'block' makes the device wait when the queue is full (nothing lost), "
            "'skip' drops that save and counts it, 'newest' drops the oldest save "
            "still waiting instead (the device never waits for the disk)."
        )
    if on_error not in _ON_ERROR:
        raise ConfigError(
            f"Checkpointer(on_error={on_error!r}): on_error must be one of {_ON_ERROR}: "
            "'raise' stops the run at a failed write, 'continue' trains on and counts it."
        )
    if on_existing not in _ON_EXISTING:
        raise ConfigError(
            f"Checkpointer(on_existing={on_existing!r}): on_existing must be one of "
            f"{_ON_EXISTING}: 'raise' refuses a save that would mix with another "
            "run's steps in the directory, 'replace' deletes that run's steps from "
            "the saved step on and writes the new one."
        )
    check_on_damaged(on_damaged, "Checkpointer")
    if crossing not in _CROSSING:
        raise ConfigError(
            f"Checkpointer(crossing={crossing!r}): crossing must be one of {_CROSSING}: "
            "'auto' (the copy-once 'buffer' crossing on CPU and CUDA GPUs, 'callback' "
            "elsewhere), "
            "'buffer' or 'callback' (jax.debug.callback, JAX's by-value copy)."
        )
    if (
        isinstance(peer_timeout, bool)
        or not isinstance(peer_timeout, int | float)
        or not peer_timeout > 0
    ):
        raise ConfigError(
            f"Checkpointer(peer_timeout={peer_timeout!r}): peer_timeout must be a "
            "positive number of seconds (how long a process of a multi-process run "
            "waits for the others at each save)."
        )
    if on_full != "block" and jax.process_count() > 1:
        raise ConfigError(
            f"Checkpointer(on_full={on_full!r}): in a multi-process run each process's "
            "queue fills at its own pace, so the processes would drop different "
            "steps and no checkpoint would be complete. Fix: use on_full='block' "
            "(the default) and a larger queue_size."
        )
    every_seconds = _positive_seconds(every_seconds, "every_seconds", "save when this long passed")
    check = _positive_int(
        check_every, "check_every", "ask the clock every this many steps", optional=True
    )
    if check is not None and every_seconds is None:
        raise ConfigError(
            f"Checkpointer(check_every={check}): check_every says how often a maybe_save "
            "asks whether every_seconds have passed, and there is no every_seconds. Fix: "
            "pass every_seconds=T too, or leave check_every out (run()'s own check_every "
            "says how often it reads the stop request)."
        )
    if not isinstance(initial_save, bool):
        raise ConfigError(
            f"Checkpointer(initial_save={shown(initial_save)}): initial_save must be True "
            "or False (save the starting state of a fresh run: run(), ckpt.scan, "
            "restore_or_init)."
        )
    return Options(
        path,
        every,
        max_to_keep,
        size,
        on_full,
        bool(compression),
        on_error,
        on_existing,
        crossing,
        float(peer_timeout),
        every_seconds=every_seconds,
        check_every=_DEFAULT_CHECK_EVERY if check is None else check,
        initial_save=initial_save,
        on_damaged=on_damaged,
        rules=_rules(max_to_keep, keep_every, keep_every_seconds, keep_best, best, mode),
    )


# How often a bare maybe_save asks the host whether `every_seconds` have passed: one
# scalar crossing per 100 steps (benchmarks.policies measures its cost).
_DEFAULT_CHECK_EVERY = 100


def _rules(
    max_to_keep: int | None,
    keep_every: object,
    keep_every_seconds: object,
    keep_best: object,
    best: object,
    mode: object,
) -> Rules | None:
    """The retention rules (None: keep every step), each checked."""
    keep_every = _positive_int(
        keep_every, "keep_every", "keep every step that is a multiple of it", optional=True
    )
    keep_every_seconds = _positive_seconds(
        keep_every_seconds, "keep_every_seconds", "keep one step per this many seconds"
    )
    keep_best = _positive_int(
        keep_best, "keep_best", "keep the best this many steps by a metric", optional=True
    )
    if mode not in _MODES:
        raise ConfigError(
            f"Checkpointer(mode={shown(mode)}): mode must be one of {_MODES}: 'max' keeps "
            "the steps with the highest `best` metric (a return), 'min' the lowest (a loss)."
        )
    if (keep_best is None) != (best is None):
        raise ConfigError(
            f"Checkpointer(keep_best={shown(keep_best)}, best={shown(best)}): keep_best and "
            "best go together: keep_best=N keeps the N best steps by the metric named "
            "best. Fix: pass both, e.g. keep_best=3, best='return', mode='max'."
        )
    if best is not None and (
        not isinstance(best, str) or not best or len(best) > _format.MAX_METRIC_NAME
    ):
        raise ConfigError(
            f"Checkpointer(best={shown(best)}): best must name a metric passed as "
            "metrics= (its key; nested keys joined with '/', e.g. 'eval/return')."
        )
    if max_to_keep is None and keep_every is None and keep_every_seconds is None:
        if keep_best is None:
            return None
    return Rules(
        max_to_keep=max_to_keep,
        keep_every=keep_every,
        keep_every_seconds=keep_every_seconds,
        keep_best=keep_best,
        best=best if isinstance(best, str) else None,
        mode="min" if mode == "min" else "max",
    )


def _positive_seconds(value: object, name: str, meaning: str) -> float | None:
    if value is None:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value <= 0
    ):
        raise ConfigError(
            f"Checkpointer({name}=...): {name} must be a positive number of seconds or "
            f"None ({meaning}), got {shown(value)}."
        )
    return float(value)


def _positive_int(value: object, name: str, meaning: str, *, optional: bool) -> int | None:
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        allowed = "a positive int" + (" or None" if optional else "")
        raise ConfigError(
            f"Checkpointer({name}=...): {name} must be {allowed} ({meaning}), got "
            f"{shown(value)} of type {type(value).__name__}."
        )
    return value


# Orbax's `CheckpointManagerOptions` names, answered with ours (docs/usage.md's table):
# a user coming from Orbax guesses them, and Python's own answer is a bare TypeError.
ORBAX_NAMES = {
    "save_interval_steps": "every=N (maybe_save's default predicate: step % N == 0)",
    "save_on_steps": "when= on maybe_save (a bool), or last_step= for the loop's last step",
    "should_save_fn": "when= on maybe_save (any bool, traced or not)",
    "save_decision_policy": "every=N and/or every_seconds=T",
    "keep_period": "keep_every=K (every step that is a multiple of K, kept forever)",
    "keep_time_interval": "keep_every_seconds=T",
    "preservation_policy": "max_to_keep=, keep_every=, keep_every_seconds=, keep_best= (a union)",
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
