"""Unit tests of `_exchange.Exchange`, the state machine the callback side, the writer
thread and the user share (no JAX program, no disk: milliseconds each)."""

import random
import sys
import threading
import time

import pytest

from jax_cb_ckpt import (
    DuplicateStepWarning,
    SaveError,
    SaveFailedWarning,
    SkippedSaveWarning,
    StepExistsError,
    StepOrderWarning,
)
from jax_cb_ckpt._handoff._exchange import Exchange, HandedSteps, is_failed_write
from jax_cb_ckpt._handoff._items import Claim


def exchange(old=(), on_existing="raise", queue_size=2):
    return Exchange("/d", queue_size=queue_size, on_existing=on_existing, old_steps=list(old))


class Item:
    """A queued save as the exchange sees it: its claim (step, replaced steps)."""

    def __init__(self, step, replace=()):
        self.claim = Claim(step, replace)
        self.step, self.replace = step, replace


def test_a_step_is_claimed_once_then_a_repeat_is_a_noted_duplicate():
    ex = exchange()
    assert ex.claim(5) == ()
    assert ex.claim(5) == "duplicate"
    [(category, message)] = ex.take_notes()
    assert category is DuplicateStepWarning and "step 5" in message
    assert ex.take_notes() == []


def test_a_step_below_one_handed_over_is_claimed_and_noted_once():
    """A counter that restarted (issue 29 item 4): 100, 200, then 5 and 6. Step 5 is
    written, but said once, naming both steps and the fix; a restore starts over."""
    ex = exchange()
    assert ex.claim(100) == () and ex.claim(200) == () and ex.take_notes() == []
    assert ex.claim(5) == ()
    assert ex.claim(6) == ()  # said once per Checkpointer
    [(category, message)] = ex.take_notes()
    assert category is StepOrderWarning
    assert "step 5 was saved after step 200" in message
    assert "start + i + 1" in message and "on_existing='replace'" in message
    ex.unclaim(200)  # a step that was not written after all is not the highest
    ex.forget([])  # after a restore the run goes on from there: said again if it happens
    assert ex.claim(300) == () and ex.claim(7) == ()
    assert [c for c, _ in ex.take_notes()] == [StepOrderWarning]


def test_crossings_of_one_program_may_arrive_out_of_order_a_later_program_is_said():
    """Issue 54: on a GPU the crossings of one program arrive in any order (step 0 of an
    unrolled loop after its step 4: XLA orders neither pure callbacks nor unordered
    effects), and the StepOrderWarning failed the run. Crossings (`in_order=False`) are
    judged against the steps handed over when the user's thread last settled (wait()),
    so one program's order does not count; a lower step after a wait() is a counter
    that restarted and is said; eager saves (made in order) count every step."""
    ex = exchange()
    for step in (4, 0, 12, 8):  # one program's crossings, as a GPU delivered them
        assert ex.claim(step, in_order=False) == ()
    assert ex.take_notes() == []
    ex.settle()  # wait(): every save dispatched so far has arrived
    assert ex.claim(16, in_order=False) == () and ex.claim(14, in_order=False) == ()
    assert ex.take_notes() == []  # 14 is below 16, but both come after the wait
    assert ex.claim(2, in_order=False) == ()  # below 12, handed before the wait
    [(category, message)] = ex.take_notes()
    assert category is StepOrderWarning and "step 2 was saved after step 12" in message
    ex.forget([])  # after a restore: said again, and eager saves count every step
    assert ex.claim(30) == () and ex.claim(25) == ()
    [(category, message)] = ex.take_notes()
    assert "step 25 was saved after step 30" in message
    ex.forget([])
    assert ex.claim(40, in_order=False) == () and ex.claim(20, in_order=False) == ()
    ex.settle()
    ex.unclaim(40)  # the settled highest was not written after all: the next below counts
    assert ex.claim(35, in_order=False) == () and ex.take_notes() == []
    assert ex.claim(10, in_order=False) == ()
    [(category, message)] = ex.take_notes()
    assert "step 10 was saved after step 20" in message


def test_handed_steps_know_their_highest():
    steps = HandedSteps()
    assert steps.highest() is None
    for step in (10, 20, 30, 5):
        steps.add(step, "a")
    assert steps.highest() == 30
    steps.pop(30)
    assert steps.highest() == 20
    steps.add(40, "b")
    steps.pop(40)
    steps.pop(20)
    steps.pop(10)
    assert steps.highest() == 5


def test_copies_from_one_crossing_are_replicas_and_end_run_ends_the_run():
    ex, owner = exchange(), object()
    assert ex.claim(3, owner) == ()
    assert ex.claim(3, owner) == "replica"  # another device's copy: silent
    assert ex.end_run(3, owner) is True
    assert ex.take_notes() == []
    # The same crossing in a later program run hands step 3 again: dropped, noted.
    assert ex.claim(3, owner) == "replica"
    assert ex.end_run(3, owner) is False
    assert [c for c, _ in ex.take_notes()] == [DuplicateStepWarning]


def test_a_step_at_or_below_another_runs_step_is_refused_or_replaces():
    with pytest.raises(StepExistsError, match="step 4 to '/d'.*step\\(s\\) 4, 8 >= 4"):
        exchange(old=[2, 4, 8]).claim(4)
    ex = exchange(old=[2, 4, 8], on_existing="replace")
    assert ex.claim(4) == (4, 8)  # the other run's steps from 4 on
    assert ex.claim(9) == ()  # beyond every old step
    assert ex.claim(1) == (2,)  # the one old step left above 1


def test_an_unclaimed_step_may_come_again_and_its_replaced_steps_count_again():
    ex = exchange(old=[4, 8], on_existing="replace")
    assert ex.claim(6) == (8,)
    ex.unclaim(6, (8,))
    assert ex.claim(6) == (8,)  # 8 is the other run's again, and 6 is free again


def test_a_skipped_save_drops_its_copies_until_the_run_ends_then_may_be_saved_again():
    ex, owner = exchange(), object()
    assert ex.claim(7, owner) == ()
    ex.skipped(7, (), owner)
    assert ex.claim(7, owner) == "replica"  # another device's copy of the skipped save
    assert ex.end_run(7, owner) is True
    assert ex.claim(7, owner) == ()  # a later run saves it


def test_slots_bound_the_saves_in_flight_and_finished_frees_them():
    ex = exchange(queue_size=2)
    for step in (1, 2):
        assert ex.claim(step) == ()
        assert ex.take_slot(block=False)
        assert ex.submit(Item(step)) == step
    assert ex.claim(3) == ()
    assert not ex.take_slot(block=False)  # full
    assert ex.next_item().step == 1
    ex.finished(Claim(1, ()), None)
    assert ex.take_slot(block=False)
    assert ex.pending == 1


def test_a_hand_over_admits_then_queues_and_a_failed_copy_gives_everything_back():
    """`hand_over`: the item is made only for an admitted step (a repeat makes none); a
    copy that fails gives back the claim and the slot before its error propagates."""
    ex = exchange(queue_size=1)
    made = []

    def item(claim):
        made.append(claim)
        return Item(claim.step, claim.replace)

    assert ex.hand_over(1, None, item, in_callback=False) == 1
    assert made == [Claim(1, ())] and ex.next_item().step == 1
    assert ex.hand_over(1, None, item, in_callback=False) is None  # a repeat
    assert len(made) == 1
    ex.finished(Claim(1, ()), None)

    def failing(claim):
        raise MemoryError("no staging memory")

    with pytest.raises(MemoryError):
        ex.hand_over(2, None, failing, in_callback=False)
    assert ex.claim(2) == ()  # step 2 may come again
    assert ex.take_slot(block=False)  # and the slot came back


def test_a_failed_write_keeps_the_first_error_and_the_step_may_come_again():
    ex = exchange()
    for step in (1, 2):
        ex.claim(step)
        ex.take_slot(block=False)
        ex.submit(Item(step))
    first, second = SaveError("one"), SaveError("two")
    ex.finished(ex.next_item().claim, first)
    ex.finished(ex.next_item().claim, second)
    assert ex.take_error() is first and ex.take_error() is None
    assert ex.claim(1) == ()  # never written: may be saved again
    assert is_failed_write(first) and not is_failed_write(StepExistsError("x"))


def test_newest_supersedes_the_oldest_waiting_save():
    ex = exchange(queue_size=2)
    items = [Item(1), Item(2)]
    for item in items:
        ex.claim(item.step)
        ex.take_slot(block=False)
        ex.submit(item)
    assert ex.supersede() is items[0]
    assert ex.pending == 1
    assert ex.claim(1) == ()  # superseded: never written, may come again


def test_drain_waits_for_the_writer_and_stop_ends_it_after_the_queue():
    ex = exchange()
    ex.claim(1)
    ex.take_slot(block=False)
    ex.submit(Item(1))
    ex.stop_writer()
    done = []

    def writer():
        while (item := ex.next_item()) is not None:
            time.sleep(0.05)
            ex.finished(item.claim, None)
        done.append(True)

    thread = threading.Thread(target=writer)
    thread.start()
    ex.drain()
    assert ex.pending == 0
    thread.join(5)
    assert done == [True]


def test_forget_makes_every_step_on_disk_another_runs():
    ex = exchange()
    ex.claim(3)
    ex.forget([3, 6])
    with pytest.raises(StepExistsError):
        ex.claim(5)
    assert ex.claim(7) == ()


def test_unclaim_slot_frees_the_step_and_the_slot():
    ex = exchange(queue_size=1)
    ex.claim(2)
    assert ex.take_slot(block=False)
    ex.unclaim_slot(Claim(2, ()))
    assert ex.take_slot(block=False)
    assert ex.claim(2) == ()


def test_handed_steps_answers_as_a_dict_would_under_random_use():
    """`HandedSteps` stores regular progressions as runs; whatever the order of adds and
    pops (regular, out of order, two owners interleaved, pops from a run's middle), it
    must answer exactly as the plain dict it replaces."""
    owners = [object(), object(), None]
    for seed in range(60):
        rng = random.Random(seed)
        handed, model = HandedSteps(), {}
        step = 0
        for _ in range(300):
            op = rng.random()
            if op < 0.6:
                step += rng.choice([1, 5, 5, 5, 10])
                target = step if rng.random() < 0.9 else rng.randrange(step + 1)
                owner = owners[0] if rng.random() < 0.8 else rng.choice(owners)
                if target not in model:
                    handed.add(target, owner)
                    model[target] = owner
            elif op < 0.9 and model:
                target = rng.choice(list(model)) if rng.random() < 0.7 else max(model)
                assert handed.pop(target, "none") is model.pop(target)
            else:
                target = rng.randrange(step + 12)
                assert handed.pop(target, "none") is model.pop(target, "none")
            for probe in range(max(0, step - 25), step + 12):
                assert (probe in handed) == (probe in model), (seed, probe)
                assert handed.get(probe, "none") is model.get(probe, "none"), (seed, probe)
                below = max((s for s in model if s < probe), default=None)
                assert handed.highest_below(probe) == below, (seed, probe)
        assert len(handed) == len(model)
        handed.clear()
        assert len(handed) == 0 and 0 not in handed


def test_handed_steps_keeps_a_regular_run_of_saves_in_constant_memory():
    """A run saving every 100 steps from one crossing is one entry, not one per save: a
    million saves cost as much memory as ten (the dict it replaces grew ~100 B a save)."""
    owner = object()

    def footprint(n):
        handed = HandedSteps()
        for i in range(n):
            handed.add(i * 100, owner)
        return sys.getsizeof(handed._runs) + sys.getsizeof(handed._odd), handed

    small, _ = footprint(10)
    big, handed = footprint(1_000_000)
    assert big == small
    assert 99_999_900 in handed and 99_999_950 not in handed and 100_000_000 not in handed


# -- admission (`admit`: the on_existing and on_full rules) and the on_error rule


class Waiting:
    """A save in the queue, as `supersede` hands it back: its release is counted."""

    def __init__(self, step):
        self.claim, self.step, self.replace, self.released = Claim(step, ()), step, (), 0

    def release(self):
        self.released += 1


def admitted(on_full, queue_size=1):
    """An exchange whose one slot is held by a waiting save of step 1."""
    ex = Exchange("/d", queue_size=queue_size, on_existing="raise", old_steps=[], on_full=on_full)
    first = Waiting(1)
    assert ex.admit(1, None, in_callback=False) == Claim(1, ())
    ex.submit(first)
    return ex, first


def test_admit_skip_drops_a_save_that_finds_the_queue_full_and_says_so():
    ex, _ = admitted("skip")
    assert ex.admit(2, None, in_callback=True) is None
    snap = ex.stats.snapshot()
    assert snap.skipped == 1 and snap.queue_waits == 0
    [(category, message)] = ex.take_notes()
    assert category is SkippedSaveWarning and "step 2" in message and "on_full='skip'" in message
    ex.next_item()
    ex.finished(Claim(1, ()), None)
    assert ex.admit(2, None, in_callback=True) == Claim(2, ())  # never written: may come again


def test_admit_newest_gives_the_oldest_waiting_save_s_slot_to_the_new_one():
    ex, first = admitted("newest")
    assert ex.admit(2, None, in_callback=True) == Claim(2, ())
    assert first.released == 1 and ex.stats.snapshot().superseded == 1
    assert ex.pending == 0  # the superseded save left the queue
    assert ex.claim(1) == ()  # never written: may come again


def test_admit_block_waits_for_the_writer_to_free_a_slot():
    ex, _ = admitted("block")
    got = []
    waiter = threading.Thread(target=lambda: got.append(ex.admit(2, None, in_callback=True)))
    waiter.start()
    time.sleep(0.2)
    assert got == [] and waiter.is_alive()  # the device waits: nothing is lost
    ex.next_item()
    ex.finished(Claim(1, ()), None)
    waiter.join(timeout=10)
    assert got == [Claim(2, ())] and ex.stats.snapshot().queue_waits == 1


def test_admit_drops_repeats_and_replicas_and_keeps_a_refusal_raised_in_a_callback():
    ex = Exchange("/d", queue_size=2, on_existing="raise", old_steps=[9])
    owner = object()
    assert ex.admit(12, owner, in_callback=True) == Claim(12, ())
    assert ex.admit(12, owner, in_callback=True) is None  # the same crossing's copy
    assert ex.admit(12, None, in_callback=True) is None  # a repeat: noted and counted
    assert ex.stats.snapshot().duplicates == 1
    with pytest.raises(StepExistsError):
        ex.admit(5, None, in_callback=True)
    assert isinstance(ex.take_error(), StepExistsError)  # kept for wait()/close()
    with pytest.raises(StepExistsError):
        ex.admit(5, None, in_callback=False)  # the caller sees it itself
    assert ex.take_error() is None


@pytest.mark.parametrize("on_error", ["raise", "continue"])
def test_the_on_error_rule_is_applied_in_one_place(on_error):
    """A failed write stops the saving with on_error="raise" (the next crossing fails,
    wait() raises it) and is a warning with "continue"; a refusal always stops it."""
    ex = Exchange("/d", queue_size=2, on_existing="raise", old_steps=[], on_error=on_error)
    ex.admit(1, None, in_callback=False)
    ex.submit(Item(1))
    failure = SaveError("disk full")
    ex.stats.failed()
    ex.finished(ex.next_item().claim, failure)
    if on_error == "raise":
        with pytest.raises(SaveError, match="disk full"):
            ex.refuse_if_failed()
        with pytest.raises(SaveError, match="disk full"):
            ex.report()
    else:
        ex.refuse_if_failed()  # training goes on
        with pytest.warns(SaveFailedWarning, match="1 save.s. failed so far.*disk full"):
            ex.report()
    ex.report()  # reported once
    ex.record(StepExistsError("another run's steps"))
    with pytest.raises(StepExistsError):
        ex.refuse_if_failed()
    with pytest.raises(StepExistsError):
        ex.report()
