"""The hand-off protocol between the callback side, the writer thread and the user.

One object owns everything the three share: the slots that bound saves in flight, the
queue (of `_items.SaveItem`s), the pending count, the steps handed over, the first
writer error and the notes (warnings to emit in the user's thread). Each side uses its
own methods:

- callback side (inside JAX's callbacks, or an eager `save`): `hand_over` (`admit`,
  then the host's copy queued by `fill`, or its claim given back when the copy fails),
  `record`, `end_run`; below them `claim`, `take_slot`, `submit`, `supersede`, `unclaim`;
- writer thread: `next_item`, `finished`;
- user thread: `drain`, `settle`, `take_error`, `take_notes`, `forget`.

Which saves may be written is decided here, in memory (the callback never touches the
disk): a step already handed over by this Checkpointer is dropped with a warning (a
repeated call); a step below one already handed over is written, with a warning once
(a counter that restarted: retention would delete it at once; a jitted save is compared
with the steps handed over when the user last waited, `settle`, since one program's
crossings arrive in any order); a step at or below a
step another run left in
the directory is a conflict (an error by default, or a replace of those steps when the
user asked for it), so two runs never mix silently. A step that was skipped or whose
write failed was never written: it is forgotten, and a later save of it is written.

The data of one save may arrive several times from one program run: under GSPMD `jit`
every device runs the crossing with the whole (gathered) state. Such copies come from
the same crossing (its `owner`, the traced call's Signature) and are dropped silently.
Whether a program run repeated a step is decided once per run instead, by `end_run`,
which the crossing calls once per save after its data (see `_save/_traced.py`).
"""

from __future__ import annotations

import bisect
import collections
import enum
import threading
from collections.abc import Callable
from typing import Any, Literal

from .._base import _warn
from .._base._errors import (
    CheckpointError,
    DuplicateStepWarning,
    SaveError,
    SaveFailedWarning,
    SkippedSaveWarning,
    StepExistsError,
    StepOrderWarning,
)
from .._base._types import OnError, OnExisting, OnFull
from ._items import Claim, SaveItem
from ._stats import StatsRecorder


class Closed(enum.Enum):
    """Why a Checkpointer takes no more saves (the text ends "the Checkpointer ...")."""

    BY_USER = "was closed"
    AT_EXIT = "was closed at interpreter exit"
    COLLECTED = "was garbage collected without close()"


class _Stop(enum.Enum):
    """In the queue: the writer ends once it gets there."""

    STOP = "stop"


_STOP = _Stop.STOP


_ABSENT = object()


class HandedSteps:
    """step -> owner (the crossing that handed it over) for every step of this run, in
    memory that does not grow with the number of regular saves. A long run saving every
    k steps hands over millions of steps; one dict entry each (~100 B with its int)
    was a slow leak. Steps one owner hands over in a regular progression (each higher
    than every step before it) are kept as one run `[first, stride, count, owner]`; a
    step out of that order (lower than one already handed) goes to a plain dict.
    Runs cover disjoint, increasing ranges, so a lookup is one bisect."""

    def __init__(self) -> None:
        self._runs: list[list[Any]] = []  # [first, stride, count, owner]; stride 0: one
        self._odd: dict[int, object] = {}

    def get(self, step: int, default: object = None) -> object:
        if step in self._odd:
            return self._odd[step]
        i = self._find(step)
        return default if i is None else self._runs[i][3]

    def __contains__(self, step: int) -> bool:
        return self.get(step, _ABSENT) is not _ABSENT

    def __len__(self) -> int:
        return len(self._odd) + sum(run[2] for run in self._runs)

    def add(self, step: int, owner: object) -> None:
        """Record `step` (not already held) as handed over by `owner`."""
        if self._runs:
            first, stride, count, last_owner = last = self._runs[-1]
            end = first + stride * (count - 1)
            if step <= end:
                self._odd[step] = owner
                return
            if last_owner is owner and (count == 1 or step - end == stride):
                last[1], last[2] = step - first if count == 1 else stride, count + 1
                return
        self._runs.append([step, 0, 1, owner])

    def pop(self, step: int, default: object = None) -> object:
        if step in self._odd:
            return self._odd.pop(step)
        i = self._find(step)
        if i is None:
            return default
        first, stride, count, owner = self._runs[i]
        k = (step - first) // stride if stride else 0
        pieces = [(first, k), (step + stride, count - k - 1)]  # (first, count) either side
        kept = [[f, stride if n > 1 else 0, n, owner] for f, n in pieces if n > 0]
        self._runs[i : i + 1] = kept
        return owner

    def clear(self) -> None:
        self._runs.clear()
        self._odd.clear()

    def highest(self) -> int | None:
        """The highest step held (None when empty)."""
        ends = [run[0] + run[1] * (run[2] - 1) for run in self._runs[-1:]]
        return max([*ends, *self._odd], default=None)

    def highest_below(self, step: int) -> int | None:
        """The highest step held below `step` (None when there is none)."""
        below = [s for s in self._odd if s < step]
        i = bisect.bisect_left(self._runs, step, key=lambda run: run[0]) - 1
        if i >= 0:  # the last run that starts below `step`
            first, stride, count, _ = self._runs[i]
            k = 0 if not stride else min(count - 1, (step - 1 - first) // stride)
            below.append(first + k * stride)
        return max(below, default=None)

    def _find(self, step: int) -> int | None:
        i = bisect.bisect_right(self._runs, step, key=lambda run: run[0]) - 1
        if i < 0:
            return None
        first, stride, count, _ = self._runs[i]
        if step == first:
            return i
        if stride and (step - first) % stride == 0 and (step - first) // stride < count:
            return i
        return None


def is_failed_write(error: CheckpointError) -> bool:
    """Errors that `on_error="continue"` turns into warnings: failed writes, not refusals."""
    return isinstance(error, SaveError) and not isinstance(error, StepExistsError)


class Exchange:
    """`queue_size`: the slots (saves in flight at most). It admits each save (`admit`:
    the `on_existing` and `on_full` rules) and reports what went wrong (`report`,
    `refuse_if_failed`: the `on_error` rule), counting both in `stats`."""

    def __init__(
        self,
        directory: str,
        *,
        queue_size: int,
        on_existing: OnExisting,
        old_steps: list[int],
        on_full: OnFull = "block",
        on_error: OnError = "raise",
        stats: StatsRecorder | None = None,
        is_plain: Callable[[int], bool] = lambda step: False,
    ) -> None:
        self.directory = directory
        # Is an old step a plain Orbax one (never deleted, so never replaced)? Asked only
        # for a refusal's message (it may read the directory).
        self._is_plain = is_plain
        self.on_existing = on_existing
        self.on_full: OnFull = on_full
        self.on_error: OnError = on_error
        self.stats = StatsRecorder() if stats is None else stats
        self._queue_size = queue_size
        self._slots = threading.BoundedSemaphore(queue_size)
        self._cond = threading.Condition()
        # Waiting for the writer:
        self._queue: collections.deque[SaveItem | _Stop] = collections.deque()
        self._pending = 0
        self._handed = HandedSteps()  # step -> the crossing that handed it
        self._arrived: set[tuple[object, int]] = set()  # handed, the run not yet ended (`end_run`)
        self._skipped: set[tuple[object, int]] = set()  # skipped, the run not yet ended
        self._old = sorted(old_steps)  # steps other runs left here, not to be mixed with
        self._restored: int | None = None  # the step the run resumed from (`forget`)
        self._error: CheckpointError | None = None
        self._notes: list[tuple[type[Warning], str]] = []
        self._order_noted = False  # a step below one handed over: said once
        # The highest step handed over when the user's thread last settled (`settle`:
        # wait()/close(), once every save its programs dispatched had arrived).
        self._settled: int | None = None
        self.closed: Closed | None = None  # set: saves handed over from then on fail

    # -- callback side --------------------------------------------------------------

    def claim(
        self, step: int, owner: object = None, *, in_order: bool = True
    ) -> tuple[int, ...] | Literal["duplicate", "replica"]:
        """May `step` be written? `"duplicate"`: drop it (noted for the user);
        `"replica"`: drop it silently (another device's copy of the same save, or a
        later run's, which `end_run` reports); otherwise the old steps to delete first
        (empty unless replacing). Raises `StepExistsError` when the step would mix with
        steps another run left in the directory.

        A step below one already handed over is noted once (`StepOrderWarning`: a
        counter that restarted). `in_order`: the saves reach here in the order they were
        made (eager saves, in the user's thread), so any higher step handed over counts.
        Not in order (a callback): the crossings of one program may arrive in any order
        (XLA orders neither the pure buffer callbacks nor unordered effects: on a GPU
        an unrolled loop's step 0 arrived after its step 4), so only the steps handed
        over before the user's thread last settled (`settle`) count."""
        with self._cond:
            if owner is not None and (owner, step) in self._skipped:
                return "replica"  # another device's copy of a save that was skipped
            handed = self._handed.get(step, _ABSENT)
            if handed is not _ABSENT:
                if owner is not None and handed is owner:
                    return "replica"
                self._note(DuplicateStepWarning, self._duplicate_message(step))
                return "duplicate"
            cut = bisect.bisect_left(self._old, step)
            clash = tuple(self._old[cut:])
            restored = self._restored
            if restored is not None and step <= restored and self.on_existing == "raise":
                raise StepExistsError(self._restart_message(step, restored, clash))
            if clash and (self.on_existing == "raise" or any(map(self._is_plain, clash))):
                # (a plain Orbax step is never deleted: "replace" cannot make room for
                # this step below it, and the latest step would stay the other run's)
                raise StepExistsError(self._clash_message(step, clash))
            del self._old[cut:]
            highest = self._handed.highest() if in_order else self._settled
            if highest is not None and step < highest and not self._order_noted:
                self._order_noted = True
                self._note(StepOrderWarning, self._order_message(step, highest))
            self._handed.add(step, owner)
            if owner is not None:
                self._arrived.add((owner, step))
            return clash

    def end_run(self, step: int, owner: object) -> bool:
        """One program run's save of `step` by the crossing `owner` is over (its data
        arrived before this). False when that data was dropped because the same crossing
        had handed the step over in an earlier run (noted for the user)."""
        with self._cond:
            if (owner, step) in self._skipped:
                self._skipped.discard((owner, step))  # a later run may save it again
                return True
            if (owner, step) in self._arrived:
                self._arrived.discard((owner, step))
                return True
            if self._handed.get(step, None) is owner:
                self._note(DuplicateStepWarning, self._duplicate_message(step, again=True))
                return False
            return True  # skipped or failed: said elsewhere

    def skipped(self, step: int, replace: tuple[int, ...], owner: object) -> None:
        """A claimed step was not handed over (the queue was full, on_full="skip"): it
        may come again in a later run; copies of it from other devices in this run
        are dropped until `end_run` ends the run's save."""
        with self._cond:
            self._unclaim(step, replace)
            if owner is not None:
                self._skipped.add((owner, step))

    def unclaim(self, step: int, replace: tuple[int, ...] = ()) -> None:
        """`step` was not handed over after all (skipped, or failed): it may come again,
        and the other run's steps it was to replace count as the other run's again."""
        with self._cond:
            self._unclaim(step, replace)

    def _clash_message(self, step: int, clash: tuple[int, ...]) -> str:
        """Why `step` may not be written: steps another run left, `clash`, are >= it. A
        plain Orbax one among them cannot be replaced (never deleted): save above it."""
        shown = ", ".join(map(str, clash[:5])) + (", ..." if len(clash) > 5 else "")
        plain = [s for s in clash if self._is_plain(s)]
        if plain:
            return (
                f"saving step {step} to {self.directory!r}: the directory already holds "
                f"step(s) {shown} >= {step}, of which {', '.join(map(str, plain[:5]))} "
                f"{'is a plain Orbax step' if len(plain) == 1 else 'are plain Orbax steps'} "
                "(written by Orbax's CheckpointManager, not by jax_cb_ckpt), and mixing two "
                "runs would make the latest checkpoint belong to the other. Nothing was "
                "changed on disk. jax_cb_ckpt never deletes Orbax's steps, so "
                "on_existing='replace' cannot make room. Fix: save above step "
                f"{max(clash)} (resume from it: ckpt.restore_or_init(...) / ckpt.run(...) "
                "go on after the latest step), or use another directory."
            )
        return (
            f"saving step {step} to {self.directory!r}: the directory already "
            f"holds step(s) {shown} >= {step} written before this run started (by an "
            "earlier run, or by this Checkpointer before its last restore()), and "
            "mixing two runs would make the latest checkpoint belong to the other. "
            "Nothing was changed on disk. Fix: use a new directory for a new run; "
            "or resume from the latest step (ckpt.restore(like) / ckpt.run(...)) "
            "so new steps come after it; or, to discard that run's steps from "
            f"step {step} on, create the Checkpointer with on_existing='replace'."
        )

    def _restart_message(self, step: int, restored: int, clash: tuple[int, ...]) -> str:
        plain = [s for s in clash if self._is_plain(s)]
        over = (
            f"To start over from step {step} instead, create the Checkpointer with "
            "on_existing='replace' (it deletes the steps from there on)."
            if not plain
            else f"Step(s) {', '.join(map(str, plain[:5]))} there are plain Orbax steps "
            "(written by Orbax's CheckpointManager), which jax_cb_ckpt never deletes: "
            "on_existing='replace' cannot make room for this step."
        )
        return (
            f"saving step {step} to {self.directory!r}: this Checkpointer resumed from "
            f"step {restored} (restore_or_init, restore or run), and step {step} is not "
            "after it. The loop's step counter started again after the resume: a scan "
            "index or fori_loop counter that starts at 0 in every call counts the "
            "updates of this call, not of the run (checkpoint k = the state after k "
            "updates of the whole run). Nothing was changed on disk. Fix: pass the "
            "resumed step into the jitted function and save `start + i + 1` for a scan "
            "index i, or loop with `lax.fori_loop(start, num_updates, body, state)` and "
            f"save `i + 1`; `ckpt.run(update, init, num_steps)` does both. {over}"
        )

    def _duplicate_message(self, step: int, again: bool = False) -> str:
        """`again`: the same traced save (one `maybe_save` call site) handed the step
        over before, in this program run or an earlier one."""
        if not again:
            why = "a repeated save, or a remat recomputation"
        else:
            why = (
                "most likely the same step at every iteration of a loop: a step that is a "
                "Python number in a scan or fori_loop body, or a counter bumped there "
                "(`step += 1`), is traced once and never changes; fix: pass the loop's "
                "counter, `i + 1`. Otherwise: the jitted function called again with the "
                "same steps, or a remat recomputation"
            )
        why += (
            "; under vmap of a lax.while_loop, a member that had left the loop, whose body "
            "runs on, asking its frozen step again: loop with ckpt.while_loop"
        )
        return (
            f"jax_cb_ckpt: step {step} was handed over again by the same Checkpointer "
            f"on {self.directory!r} ({why}); the first save of it is kept, this one was "
            "dropped."
        )

    def _order_message(self, step: int, highest: int) -> str:
        return (
            f"jax_cb_ckpt: step {step} was saved after step {highest} by the same "
            f"Checkpointer on {self.directory!r}. It is written, but it is not the latest "
            f"checkpoint (restore() and latest_step() give step {highest} or later), and "
            f"max_to_keep retention, which keeps the highest steps, deletes it as soon as "
            "it is written. A step counts the updates of the whole run (checkpoint k = "
            "the state after k updates); a counter that restarts (a second jitted call "
            "whose scan index starts at 0 again) saves lower steps. Fix: pass the "
            "updates done in the whole run (`start + i + 1` for a scan that continues a "
            f"run, or a TrainState.step); to start over from step {step}, close this "
            "Checkpointer and create one with on_existing='replace' (it deletes the "
            f"steps from {step} on). Said once per Checkpointer."
        )

    def _unclaim(self, step: int, replace: tuple[int, ...]) -> None:
        owner = self._handed.pop(step, None)
        if self._settled is not None and step == self._settled:  # not written after all
            self._settled = self._handed.highest_below(step)
        self._arrived.discard((owner, step))
        if replace:
            self._old = sorted(set(self._old) | set(replace))

    def admit(self, step: int, owner: object, *, in_callback: bool) -> Claim | None:
        """Claim `step` and take a slot for it (the caller then owes the slot back,
        `unclaim_slot`, or a submitted save): the claim, or None when it is not to be
        written (another device's copy; a repeated step, noted; skipped, the queue being
        full with on_full="skip", noted and counted). With on_full="block" a full queue
        blocks the caller (in a callback: the device program) until the writer frees a
        slot; with "newest" it gives up its oldest waiting save instead (counted in
        `superseded`)."""
        try:
            replace = self.claim(step, owner, in_order=not in_callback)
        except CheckpointError as e:
            if in_callback:  # JAX re-wraps it: keep ours for wait()/close()
                self.record(e)
            raise
        if replace == "replica":  # another device's copy of a save already decided
            return None
        self.stats.crossed()
        if replace == "duplicate":  # noted for the user
            self.stats.duplicate()
            return None
        if self.take_slot(block=False):
            return Claim(step, replace)
        if self.on_full == "block":
            # Nothing is lost: the device waits for the writer to free a slot.
            self.stats.queue_wait()
            self.take_slot(block=True)
            return Claim(step, replace)
        if self.on_full == "newest":
            # The oldest save still waiting gives its slot (and staging) to this one.
            # None waits when every save in flight is being written or handed over
            # (per-device saves take their slot at the first device): then wait.
            older = self.supersede()
            if older is not None:
                older.release()
                self.stats.superseded()
            else:
                self.stats.queue_wait()
                self.take_slot(block=True)
            return Claim(step, replace)
        # on_full="skip". Never written: a later run's save of it is welcome (other
        # devices' copies of this one are dropped, see `skipped`).
        self.skipped(step, replace, owner)
        self.stats.skipped()
        self.note(
            SkippedSaveWarning,
            f"jax_cb_ckpt: skipped the save of step {step}: the queue was full "
            f"({self._queue_size} saves in flight, on_full='skip').",
        )
        return None

    def hand_over(
        self, step: int, owner: object, item: Callable[[Claim], SaveItem], *, in_callback: bool
    ) -> int | None:
        """One save handed over: its step admitted (`admit`), then `item(claim)` (the
        host copy, run here in the caller's thread) queued (`fill`). The saves in
        flight, or None when it is not to be written (`admit`)."""
        claim = self.admit(step, owner, in_callback=in_callback)
        if claim is None:
            return None
        return self.fill(claim, item)

    def fill(self, claim: Claim, item: Callable[[Claim], SaveItem]) -> int:
        """Queue the save `item(claim)` makes for a claim (its slot taken); when making
        it fails, the claim and its slot are given back before the error propagates.
        The saves in flight."""
        try:
            made = item(claim)
        except BaseException:
            self.unclaim_slot(claim)
            raise
        return self.submit(made)

    def unclaim_slot(self, claim: Claim) -> None:
        """A claimed save that will not be submitted after all: its step may come
        again, and its slot is free."""
        self.unclaim(claim.step, claim.replace)
        self._slots.release()

    def take_slot(self, block: bool) -> bool:
        return self._slots.acquire(blocking=block)

    def submit(self, item: SaveItem) -> int:
        """Queue a save (its slot taken); returns how many saves are now in flight."""
        with self._cond:
            self._pending += 1
            self._queue.append(item)
            self._cond.notify_all()
            return self._pending

    def supersede(self) -> SaveItem | None:
        """Take the oldest save still waiting for the writer out of the queue (the queue
        is full and on_full="newest"): the caller releases it and its slot becomes the
        caller's. None when every save in flight is being written or handed over."""
        with self._cond:
            for item in self._queue:
                if item is not _STOP:
                    self._queue.remove(item)
                    self._unclaim(item.step, item.replace)
                    self._pending -= 1
                    self._cond.notify_all()
                    return item
            return None

    def peek_error(self) -> CheckpointError | None:
        with self._cond:
            return self._error

    def record(self, error: CheckpointError) -> None:
        """An error raised on the callback side: JAX re-wraps it for the program, so it
        is also kept here and re-raised as is by wait()/close()."""
        with self._cond:
            self._keep_first(error)

    def _keep_first(self, error: CheckpointError) -> None:
        if self._error is None:
            self._error = error

    def note(self, category: type[Warning], message: str) -> None:
        """A warning for the user's thread, emitted at the next wait()/close()/save."""
        with self._cond:
            self._note(category, message)

    def _note(self, category: type[Warning], message: str) -> None:
        self._notes.append((category, message))

    # -- writer thread --------------------------------------------------------------

    def next_item(self) -> SaveItem | None:
        """The next save to write, or None: stop (every save queued before is done)."""
        with self._cond:
            while not self._queue:
                self._cond.wait()
            item = self._queue.popleft()
            return None if item is _STOP else item

    def stop_writer(self) -> None:
        with self._cond:
            self._queue.append(_STOP)
            self._cond.notify_all()

    def finished(self, claim: Claim, error: SaveError | None) -> None:
        """The writer is done with a submitted save (written, or failed with `error`): its
        claim is given back (the slot freed; a failed step may come again)."""
        self._slots.release()
        with self._cond:
            if error is not None:
                self._unclaim(claim.step, claim.replace)
                self._keep_first(error)
            self._pending -= 1
            self._cond.notify_all()

    # -- user thread ----------------------------------------------------------------

    def close(self, why: Closed) -> None:
        """No more saves are taken; `why` is what a late save is told (the latest)."""
        with self._cond:
            self.closed = why

    @property
    def pending(self) -> int:
        with self._cond:
            return self._pending

    def drain(self) -> None:
        """Block until every submitted save has been written or has failed."""
        with self._cond:
            while self._pending:
                self._cond.wait()

    def settle(self) -> None:
        """Every save the caller's programs dispatched so far has arrived (wait(), after
        `jax.effects_barrier()`): a step handed over from now on below the highest one
        now is a later program's, a counter that restarted (see `claim`)."""
        with self._cond:
            self._settled = self._handed.highest()

    def take_error(self) -> CheckpointError | None:
        with self._cond:
            error, self._error = self._error, None
            return error

    def take_notes(self) -> list[tuple[type[Warning], str]]:
        with self._cond:
            notes, self._notes = self._notes, []
            return notes

    def emit_notes(self) -> None:
        """Issue the warnings the callback side and the writer noted, in this thread (at
        the caller's first line outside the package, `_warn`)."""
        for category, message in self.take_notes():
            _warn.warn(message, category)

    # -- reporting: the on_error rule, in one place -----------------------------------

    def stops_saving(self, error: CheckpointError) -> bool:
        """Whether `error` ends the run's saving: every error but a failed write with
        on_error="continue" (a refusal always does)."""
        return self.on_error == "raise" or not is_failed_write(error)

    def refuse_if_failed(self) -> None:
        """Raise the first error when it ends the run's saving (in a callback: fail the
        running computation, so no hours of training go unsaved); it stays recorded for
        `report`."""
        error = self.peek_error()
        if error is not None and self.stops_saving(error):
            raise error

    def report(self) -> None:
        """In the user's thread: issue the pending warnings (at the user's line) and
        raise the first error, or warn about it when training continues past it."""
        self.emit_notes()
        error = self.take_error()
        if error is None:
            return
        if not self.stops_saving(error):
            _warn.warn(
                f"jax_cb_ckpt: {self.stats.snapshot().failed} save(s) failed so far and "
                f"training continued (on_error='continue'); the first: {error}",
                SaveFailedWarning,
            )
            return
        raise error

    def forget(self, steps_on_disk: list[int], restored: int | None = None) -> None:
        """After a restore: the run continues from a restored step, so every step now on
        disk counts as another run's (saving at or below one of them is a conflict); a
        save at or below `restored` (the step restored) is one whose loop counter
        started again, and is told so."""
        with self._cond:
            self._restored = restored
            self._handed.clear()
            self._arrived.clear()
            self._skipped.clear()
            self._order_noted = False
            self._settled = None
            self._old = sorted(steps_on_disk)
