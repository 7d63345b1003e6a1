"""The writer's retention: after each commit, which steps go (`_policy.Keeper`), and
setting them aside (their files are deleted later, `Writer._sweep`).

Runs in the writer thread, after a step is committed: the device never waits for it.
The first commit of a Checkpointer lists the directory once and, where the rules rank
metrics or times, reads each step's meta; every later commit costs the same however
many steps are kept (`Keeper.add` and `settle`). Only the library's own complete steps
are ever touched (`Storage.set_aside` checks each), and a step is unlisted before its
files go, so a crash at any point leaves every kept step whole.

Rules changed between runs apply from the first commit on: the steps the previous
run's rules (the `retention` record of the newest step before it) kept and the new
rules do not are deleted then, and named in a warning log first.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

import numpy as np

from .._base._errors import CheckpointWarning, ConfigError, DamagedStepWarning
from .._layout import _format, _policy
from .._layout._policy import AnyOf, Entry, Keeper
from .._read import _steps
from .._storage import _faults
from .._storage._protocol import Storage

logger = logging.getLogger("jax_cb_ckpt")


class Retention:
    """Which steps one writer keeps under `rules`, and what it set aside."""

    def __init__(
        self, rules: AnyOf, storage: Storage, note: Callable[[type[Warning], str], None]
    ) -> None:
        self.rules = rules
        self._storage = storage
        self._note = note  # a warning for the user's thread (`Exchange.note`)
        self._keeper: Keeper | None = None  # made at the first commit (or just before)
        # What changed rules delete, said once the first commit's step is added.
        self._changed: tuple[AnyOf | None, list[int], dict[int, _format.StepMeta]] | None = None
        self._put_off: list[int] = []  # steps to set aside that the storage refused
        self._stuck: dict[int, str] = {}  # steps that refused their deletion: why
        # Steps whose meta was read and checked (or that this writer committed): the
        # only ones set aside without reading their meta first.
        self._checked: set[int] = set()

    def removed(self, step: int) -> None:
        """`step` was deleted by someone else (a save with on_existing='replace')."""
        if self._keeper is not None:
            self._keeper.remove(step)

    def committed(self, step: int, meta: dict[str, Any]) -> list[str]:
        """After `step` (its `meta` record) was committed: set aside the steps no rule
        keeps any more; what was set aside, for deletion."""
        # The step just committed is complete and listed, which is what matters: when
        # the storage does not answer, retention waits for the next commit.
        seconds = _format.saved_seconds(meta.get("saved_at"))  # (as a later run reads it)
        members = np.asarray(meta.get("members", True), dtype=bool)
        entry = Entry(
            step,
            seconds,
            _best_values(meta, self.rules.metric),
            None if members.all() else members,
            meta.get("retention") or {},  # (the decisions recorded with it)
        )
        self._checked.add(step)
        try:
            if self._keeper is None:
                self._keeper = self._open(step, entry.members is not None)
            self._keeper.add(entry)
            changed, self._changed = self._changed, None
            if changed is not None:
                self._warn_changed(self._keeper, *changed)
            going = sorted(set(self._put_off) | set(self._keeper.settle()))
        except (_faults.StorageError, ConfigError, OSError) as e:
            self._put_off_warning(e)
            return []
        except Exception as e:  # a fault of ours: said, and nothing deleted
            self._keeper = None  # (listed again at the next commit)
            self._note(
                CheckpointWarning,
                f"jax_cb_ckpt: retention in {self._storage.path!r} after step {step} failed "
                f"({type(e).__name__}: {e}); nothing was deleted, and step {step} is saved.",
            )
            return []
        self._put_off = []
        asides = []
        for index, old in enumerate(going):
            if old not in self._checked and not self._still_ours(old):
                continue
            try:
                aside = self._storage.set_aside(old)
            except (_faults.StorageError, ConfigError, OSError) as e:
                if isinstance(e, ConfigError) or _faults.out_of_reach(e):
                    self._put_off = going[index:]  # the storage, not the step: all wait
                    self._put_off_warning(e)
                    break
                self._put_off.append(old)  # this step refused: the others go on
                self._refused(old, e)
                continue
            self._checked.discard(old)
            if self._stuck.pop(old, None) is not None:
                self._say_stuck()
            if aside is not None:
                asides.append(aside)
        return asides

    def _refused(self, step: int, e: OSError) -> None:
        """A step retention cannot delete (`chattr +i`, a read-only folder, a bucket
        that refuses): passed over, retried at every commit, said once (a warning with
        its path and the error) and recorded where `jax-cb-ckpt ls` finds it."""
        if step in self._stuck:
            return
        self._stuck[step] = f"{type(e).__name__}: {_faults.scrub(str(e))}"
        self._note(
            CheckpointWarning,
            f"jax_cb_ckpt: retention cannot delete step {step} "
            f"({self._storage.step_path(step)}): {self._stuck[step]}. The other steps are "
            "deleted as the rules say; this one stays (retried at each save) until it can "
            "be. Fix: make it deletable (chattr -i, permissions), or remove it yourself.",
        )
        self._say_stuck()

    def _recall_stuck(self, steps: set[int]) -> None:
        """The report an earlier run left of the steps it could not delete, kept for
        those still here (the rules decide whether they go; one removed by hand leaves
        the report)."""
        try:
            data = self._storage.read_file(_format.STUCK_NAME, _format.SMALL_FILE_MAX_BYTES)
            record = json.loads(data) if data else {}
        except (OSError, ValueError):
            data, record = b"?", {}  # (torn or unreadable: written anew, or removed)
        if not data:
            return
        if not isinstance(record, dict):
            record = {}
        old = {int(k): v for k, v in record.items() if _step_name(k) and isinstance(v, str)}
        self._stuck = {s: why for s, why in old.items() if s in steps}  # (the rules decide)
        if self._stuck != old or not old:
            self._say_stuck()

    def _say_stuck(self) -> None:
        """The steps retention cannot delete, in the directory's `STUCK_NAME` file."""
        try:
            if self._stuck:
                record = {str(step): why for step, why in sorted(self._stuck.items())}
                self._storage.put_file(_format.STUCK_NAME, json.dumps(record).encode())
            elif self._storage.read_file(_format.STUCK_NAME, 1) is not None:
                # (not `exists`: that is a folder's or step's test; in a bucket a
                # file is no prefix, and the report was never removed there)
                self._storage.remove_file(_format.STUCK_NAME)
        except OSError:
            pass  # (a report: the warning said it already)

    def _still_ours(self, step: int) -> bool:
        """A step listed at the opening whose meta was not read yet: read and checked now,
        before it is deleted. One that cannot be read (damaged since, or not whole: a
        bucket lists a step by its objects alone) is left alone, and said."""
        if _steps.step_metas(self._storage, [step]):
            return True
        if self._storage.exists(str(step)):
            self._say_left_alone([step])
        return False

    def _say_left_alone(self, steps: list[int]) -> None:
        self._note(
            DamagedStepWarning,
            f"jax_cb_ckpt: retention in {self._storage.path!r} left step(s) "
            f"{', '.join(map(str, steps))} alone: their description (meta) cannot be read "
            "or is not what was written, so they may be damaged; they are neither ranked "
            "nor deleted. Fix: `jax-cb-ckpt verify` the directory; remove or restore them.",
        )

    def _put_off_warning(self, e: Exception) -> None:
        logger.warning(
            "retention in %s put off to the next save: %s",
            self._storage.path,
            _faults.scrub(str(e)),
        )

    def decisions(self, step: int, seconds: float | None, masked: bool) -> dict[str, Any]:
        """What the rules record with the step about to be written (at `seconds`), e.g.
        whether it joins the seconds chain (`Keeper.decisions`), so that a restart keeps
        what this run kept, whatever the clock did (set back, say) in between. {}: none,
        or the directory could not be listed (decided at the commit, as before)."""
        try:
            if self._keeper is None:
                self._keeper = self._open(step, masked)
        except (_faults.StorageError, ConfigError, OSError):
            return {}
        return self._keeper.decisions(seconds)

    def _open(self, step: int, masked: bool) -> Keeper:
        """The keeper of the first commit (of `step`; `masked`: some of its members did
        not ask for it), before the step is added: every other complete step of the
        directory, each examined under the rules (changed rules apply from here); what
        the previous run's rules kept and these delete is said once the step is added
        (`_changed`)."""
        found = self._storage.examine_all()
        steps = sorted(s for s, f in found.items() if f.kind == "complete" and s != step)
        damaged = sorted(s for s, f in found.items() if f.kind in ("damaged", "unreadable"))
        if damaged:  # listed apart: never ranked or deleted, and said
            self._say_left_alone(damaged)
        self._recall_stuck(set(steps))
        # Every step's meta when a rule reads them (times, metrics), or when members of
        # this step did not ask for it: each member's newest step is kept (`Keeper`),
        # which needs the masks.
        wanted = _reads_metas(self.rules) or masked
        metas = _steps.step_metas(self._storage, steps[-1:] if not wanted else steps)
        if wanted:  # a step whose meta cannot be read is neither ranked nor deleted
            unread = [s for s in steps if s not in metas]
            if unread:
                self._say_left_alone(unread)
            steps = [s for s in steps if s in metas]
        self._checked |= set(metas)
        entries = [_policy.entry_of(s, metas.get(s), self.rules) for s in steps]
        previous = _policy.recorded_rules(metas.get(steps[-1]) if steps else None)
        if steps and previous != self.rules:
            self._changed = (previous, steps, metas)
        return Keeper(self.rules, entries)

    def _warn_changed(
        self,
        keeper: Keeper,
        previous: AnyOf | None,
        steps: list[int],
        metas: dict[int, _format.StepMeta],
    ) -> None:
        """The steps the previous rules kept that these rules drop, in a warning log
        (before anything is deleted)."""
        if previous is None:
            kept_before = set(steps)  # no record: kept every step (or an older version)
            said = "keep all (no rules recorded)"
        else:
            if _reads_metas(previous):
                missing = [s for s in steps if s not in metas]
                metas = {**metas, **_steps.step_metas(self._storage, missing)}
            old = Keeper(previous, [_policy.entry_of(s, metas.get(s), previous) for s in steps])
            kept_before = set(steps) - set(old.settle())
            said = previous.describe()
        dropped = sorted(s for s in kept_before if not keeper.kept_by(s))
        if dropped:
            shown = ", ".join(str(s) for s in dropped[:20]) + (", ..." if len(dropped) > 20 else "")
            logger.warning(
                "retention in %s: the rules changed since the last step was saved (were: "
                "%s; now: %s); deleting %d step(s) the previous rules kept: %s",
                self._storage.path,
                said,
                self.rules.describe(),
                len(dropped),
                shown,
            )


def _reads_metas(rules: AnyOf) -> bool:
    """Some rule reads the steps' records (times, metrics), not their numbers alone."""
    return any(rule.reads_metas for rule in rules.rules)


def _best_values(meta: dict[str, Any], best: str | None) -> np.ndarray | None:
    """The `best` metric of a step being written (its meta record), as float64."""
    if best is None:
        return None
    value = (meta.get("metrics") or {}).get(best)
    return None if value is None else np.asarray(value, dtype=np.float64)


def _step_name(key: str) -> bool:
    """Whether a key of the report (hostile: any JSON) is a step as `_say_stuck` writes
    one: ASCII digits, which `int` takes (not '²', which `isdigit` takes and `int`
    refuses), and short (`int` refuses over 4,300 digits)."""
    return key.isascii() and key.isdigit() and len(key) <= 20
