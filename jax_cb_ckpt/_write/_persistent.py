"""The persistent tier (`Checkpointer(persistent=...)`): every `every`-th step, or once
`every_seconds` have passed, the writer copies a step it has just committed to the
local directory into a second checkpoint directory (a bucket, usually), with that
directory's own lock and retention. Orbax's emergency checkpointing in one writer: the
local tier is fast and lost with the machine, the persistent one slow and kept.

Why a copy of the committed step's files, not a second write from the host buffers:
the arrays' bytes (and their checksums) are the local step's by construction, nothing
crosses from the device again, the local step is complete before the copy begins (a
failed copy never costs it), and the same code copies into any storage. Its cost: the
step's files read back (from the page cache: just written) and written once more, in
the writer thread, while the save holds its queue slot. The step's description is
written anew with the persistent tier's retention record (the rules in force where it
is kept); everything else is the local step's bytes.

The local tier is a local directory (`Options` refuses a URL), so its step is read as
the files of a folder; the persistent one is any storage, reached through its verbs.
Runs in the writer thread. Imports `_base/`, `_layout/`, `_storage/` and `_retention`.
"""

from __future__ import annotations

import logging
import os
import stat
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from .._base import _warn
from .._base._errors import ForeignStepWarning
from .._layout import _format
from .._layout._policy import AnyOf
from .._storage import _places
from .._storage._lock import DirectoryLock
from .._storage._protocol import Storage
from ._retention import Retention

logger = logging.getLogger("jax_cb_ckpt")

# The files of a step that are its description: written anew, not copied.
_DESCRIPTION = {
    f"{_format.META_ITEM}/{_format.META_FILE}",
    f"{_format.EXTRA_ITEM}/{_format.META_FILE}",
    _format.ORBAX_STEP_FILE,
}
_MAX_DESCRIPTION = 1 << 24  # bytes: a step's description files are far smaller


class Persistent:
    """The persistent tier of one writer: which steps it copies, the copy, its lock and
    its retention. Made in the user's thread (`_wiring.wire`), used by the writer."""

    def __init__(
        self,
        source: Storage,
        directory: str,
        lock: DirectoryLock,
        *,
        rules: AnyOf | None,
        every: int | None,
        every_seconds: float | None,
    ) -> None:
        self.directory = directory
        self.storage = _places.at(directory)
        self._source = source
        self._lock = lock
        self._identity = self.storage.identity()
        self._rules = rules
        self._every = every
        self._seconds = every_seconds
        # A warning of its retention for the user's thread: set to `Exchange.note` once
        # the exchange is made (it is made knowing this tier's steps).
        self.note: Callable[[type[Warning], str], None] = lambda category, message: None
        self._retention = None if rules is None else Retention(rules, self.storage, self._note)
        # Where the last copy left off (a restarted run goes on from there, else from the
        # opening): the step of the save before (`due`: a save past a multiple of `every`
        # since it is copied, also one a killed run committed locally but never copied)
        # and the clock of every_seconds.
        self._previous, age = _newest(self.storage)
        self._last = time.monotonic() - age
        self._aside: list[str] = []
        untouched = self.storage.clean_leftovers(lock.taken_over_from)
        if untouched:
            _warn.warn(
                f"jax_cb_ckpt: {untouched[:5]} in the persistent directory hold a whole "
                "step's files without a commit marker; they are not steps and were left "
                "untouched. Fix: remove them.",
                ForeignStepWarning,
            )

    def due(self, step: int) -> bool:
        """Whether the step just written locally is also kept persistently: a multiple
        of `every`, or the first save past one (saves every 3 steps, every=5: 6, 12, 15,
        ...), so that a lost local tier costs at most `every` steps whatever the saves'
        spacing; or the first save once `every_seconds` have passed since the last copy."""
        previous, self._previous = self._previous, step
        if self._every is not None and (
            step % self._every == 0
            or (previous is not None and step // self._every > previous // self._every)
        ):
            return True
        return self._seconds is not None and time.monotonic() - self._last >= self._seconds

    def replaced(self, steps: tuple[int, ...] | list[int]) -> None:
        """on_existing='replace': another run's steps from the saved one on go here too."""
        for old in steps:
            if self.storage.remove_step(old) and self._retention is not None:
                self._retention.removed(old)

    def copy(self, step: int) -> None:
        """Copy the local tier's committed `step` here, commit it, apply retention (the
        steps it unlists are deleted by `sweep`). Raises what went wrong; nothing of the
        local tier is touched."""
        self._check()
        if self.storage.exists(str(step)):
            raise FileExistsError(
                f"step {step} is already in the persistent directory {self.directory!r} "
                "(written by another run); it was kept"
            )
        meta = self._meta(self._source.open_step(step).meta, step)
        temp = self.storage.temp_path(step, _format.temp_name(step))
        token = self._lock.token
        with self.storage.step_sync() as sync:
            try:
                self.storage.begin(temp, token)
                nbytes, extra = self._files(step, temp)
                self.storage.fence(str(step), token, self._check)
                self.storage.write_meta(temp, meta, extra)
                self.storage.commit(temp, os.path.join(self.directory, str(step)), nbytes, sync)
            except BaseException as e:
                later = self.storage.clean_failed(os.path.basename(temp), token, e)
                if later is not None:
                    self.storage.remove_temp(later, token)
                raise
        self._last = time.monotonic()
        logger.debug("copied step %d to the persistent tier %s", step, self.directory)
        if self._retention is not None:
            self._aside += self._retention.committed(step, meta)

    def sweep(self) -> None:
        """Delete the steps retention set aside (after the save was reported); what
        fails is left for the next opening's clean-up (it is unlisted already)."""
        while self._aside:
            aside = self._aside.pop()
            try:
                self.storage.remove_aside(aside)
            except OSError:
                logger.debug("removing %s failed; the next opening does", aside, exc_info=True)

    def close(self) -> None:
        try:
            self.sweep()
        finally:
            self._lock.release()

    def _note(self, category: type[Warning], message: str) -> None:
        self.note(category, message)

    def _check(self) -> None:
        self.storage.check_directory(self._identity, self._lock)

    def _meta(self, meta: dict[str, Any], step: int) -> dict[str, Any]:
        """The local step's description with this tier's retention record."""
        meta = dict(meta)
        meta.pop("retention", None)
        if self._rules is not None and self._retention is not None:
            record = self._rules.to_json()
            seconds = _format.saved_seconds(meta.get("saved_at"))
            masked = not np.asarray(meta.get("members", True), dtype=bool).all()
            record.update(self._retention.decisions(step, seconds, masked))
            meta["retention"] = record
        return meta

    def _files(self, step: int, temp: str) -> tuple[int, bytes | None]:
        """Every file of the local step but its description, written into `temp`; their
        bytes in all, and the `extra` item's bytes (written with the description)."""
        root = self._source.step_path(step)
        nbytes, extra = 0, None
        for folder, dirs, files in os.walk(root):
            dirs.sort()
            for name in sorted(files):
                path = os.path.join(folder, name)
                relative = os.path.relpath(path, root).replace(os.sep, "/")
                if not stat.S_ISREG(os.lstat(path).st_mode):
                    raise OSError(f"{path} is not a regular file: the step was not copied")
                if relative in _DESCRIPTION:
                    if relative.startswith(f"{_format.EXTRA_ITEM}/"):
                        extra = _read(path, _MAX_DESCRIPTION)
                    continue
                with open(path, "rb") as f:
                    data = f.read()
                self.storage.write_file(f"{temp}/{relative}", data)
                nbytes += len(data)
        return nbytes, extra


def _newest(storage: Storage) -> tuple[int | None, float]:
    """The newest step of `storage` and the seconds since it was saved (its
    `saved_at`); (None, 0) when there is none, 0 s when its time is unreadable or ahead
    of this clock (hostile input: never makes a copy due sooner than recorded)."""
    try:
        steps = storage.list_steps()
        if not steps:
            return None, 0.0
        saved = _format.saved_seconds(storage.open_step(steps[-1]).meta.get("saved_at"))
    except Exception:  # (a damaged step, storage out of reach: count from now)
        return None, 0.0
    return steps[-1], 0.0 if saved is None else min(max(time.time() - saved, 0.0), 1e9)


def _read(path: str, limit: int) -> bytes:
    with open(path, "rb") as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise OSError(f"{path} is larger than {limit} bytes: the step was not copied")
    return data
