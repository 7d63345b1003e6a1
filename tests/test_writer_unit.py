"""The writer thread's contract (`_writer.Writer`), without a Checkpointer, a callback or
a JAX program: it takes saves off the exchange in order and writes each as a step every
reader lists, gives each save's host buffers back once written (or failed), keeps
`max_to_keep`, records a failure in the exchange with the step's slot given back and
its step free to come again, and stops once the saves queued before `stop` are done."""

import os
import time

import numpy as np
import pytest
from helpers import checked_options

import jax_cb_ckpt
from jax_cb_ckpt import SaveError
from jax_cb_ckpt._handoff._exchange import Exchange
from jax_cb_ckpt._handoff._items import Claim, SaveItem
from jax_cb_ckpt._layout import _format
from jax_cb_ckpt._layout._spec import ARRAY, LeafSpec, Signature
from jax_cb_ckpt._storage import _places
from jax_cb_ckpt._write._writer import Writer


def _item(step, tree, released):
    """A handed-off save of `tree` (numpy arrays by name), as the host side makes it."""
    specs = tuple(
        LeafSpec(repr(name), (name,), ARRAY, str(v.dtype), v.shape) for name, v in tree.items()
    )
    hosts = list(tree.values())
    signature = Signature(specs, tuple(v.ndim for v in hosts))
    nbytes = sum(v.nbytes for v in hosts)
    return SaveItem(
        Claim(step, ()),
        signature,
        hosts,
        np.asarray(True),
        time.time(),
        nbytes,
        0.0,
        0.0,
        lambda: released.append(step),
    )


class Parts:
    """A writer with its exchange, lock and counters, on `directory`."""

    def __init__(self, directory, max_to_keep=None):
        self.options = checked_options(directory, max_to_keep=max_to_keep, peer_timeout=10.0)
        self.exchange = Exchange(
            self.options.where.directory,
            queue_size=self.options.queue.slots,
            on_existing="raise",
            old_steps=[],
        )
        self.stats = self.exchange.stats
        storage = _places.at(self.options.where.directory)
        storage.make()  # (as the Checkpointer does before it takes the lock)
        self.lock = storage.lock(_format.LOCK_NAME)
        self.exited = []
        self.writer = Writer(
            self.exchange,
            self.lock,
            self.options.where.directory,
            rules=self.options.keep.rules,
            compression=self.options.where.compression,
            on_exit=lambda: self.exited.append(True),
        )

    def save(self, item):
        assert self.exchange.claim(item.step) == ()
        assert self.exchange.take_slot(block=True)
        self.exchange.submit(item)


@pytest.fixture
def parts(tmp_path):
    made = []

    def make(**kwargs):
        made.append(Parts(str(tmp_path / "ckpt"), **kwargs))
        return made[-1]

    yield make
    for p in made:
        p.writer.stop()


def test_saves_are_written_in_order_and_their_buffers_given_back(parts):
    p = parts()
    released = []
    w = np.arange(4 * 2**20, dtype=np.float32)  # 16 MiB: one chunk
    for step in (1, 2, 3):
        p.save(_item(step, {"w": w + step, "i": np.array([step], np.int32)}, released))
    p.exchange.drain()
    assert released == [1, 2, 3]
    assert jax_cb_ckpt.all_steps(p.options.where.directory) == [1, 2, 3]
    like = {"w": np.zeros_like(w), "i": np.zeros(1, np.int32)}
    got = jax_cb_ckpt.restore(p.options.where.directory, like, step=2)
    np.testing.assert_array_equal(got["w"], w + 2)
    stats = p.stats.snapshot()
    assert stats.saves == 3 and stats.failed == 0
    assert [r.step for r in stats.recent] == [1, 2, 3]
    assert p.exchange.take_error() is None
    assert not [n for n in os.listdir(p.options.where.directory) if "tmp" in n]  # no leftovers


def test_retention_keeps_the_newest_after_each_save(parts):
    p = parts(max_to_keep=2)
    released = []
    for step in (10, 20, 30, 40):
        p.save(_item(step, {"b": np.full(8, step, np.int64)}, released))
        p.exchange.drain()
        assert jax_cb_ckpt.all_steps(p.options.where.directory)[-1] == step
    assert jax_cb_ckpt.all_steps(p.options.where.directory) == [30, 40]
    p.writer.stop()  # (the steps set aside are deleted after each save is reported)
    assert sorted(os.listdir(p.options.where.directory)) == sorted(["30", "40", _format.LOCK_NAME])


def test_a_failed_save_is_recorded_its_slot_freed_and_its_step_may_come_again(parts):
    p = parts()
    os.makedirs(os.path.join(p.options.where.directory, "5"))  # a user's folder in the way
    released = []
    p.save(_item(5, {"b": np.ones(3, np.int64)}, released))
    p.exchange.drain()
    assert released == [5]  # given back although the write failed
    error = p.exchange.take_error()
    assert isinstance(error, SaveError) and "step 5" in str(error)
    assert "Earlier checkpoints in it are untouched" in str(error)
    assert p.stats.snapshot().failed == 1
    assert os.listdir(os.path.join(p.options.where.directory, "5")) == []  # not touched
    os.rmdir(os.path.join(p.options.where.directory, "5"))
    p.save(_item(5, {"b": np.ones(3, np.int64)}, released))  # claimed again: allowed
    p.exchange.drain()
    assert p.exchange.take_error() is None
    assert jax_cb_ckpt.all_steps(p.options.where.directory) == [5]


def test_stop_writes_what_was_queued_before_it_then_releases_the_lock(parts):
    p = parts()
    released = []
    for step in (1, 2):
        p.save(_item(step, {"b": np.full(4, step, np.int64)}, released))
    p.writer.stop()  # blocks until both are written
    assert released == [1, 2]
    assert jax_cb_ckpt.all_steps(p.options.where.directory) == [1, 2]
    again = _places.at(p.options.where.directory).lock(_format.LOCK_NAME)  # free again
    again.release()


# -- the writer's life: opening, finish, exit (issue 46 item 5) -------------------------


def test_opening_removes_what_a_killed_writer_left_and_nothing_else(tmp_path):
    directory = tmp_path / "ckpt"
    directory.mkdir()
    temp = directory / _format.temp_name(3)
    (temp / "state").mkdir(parents=True)
    deleting = directory / f"2.jax_cb_ckpt-deleting-{'a' * 32}"
    deleting.mkdir()
    mine = directory / "3.my-notes"
    mine.mkdir()
    p = Parts(str(directory))
    try:
        assert not temp.exists() and not deleting.exists()
        assert mine.is_dir()
    finally:
        p.writer.stop()


def test_finish_ends_the_thread_once_the_queued_saves_are_written(parts):
    p = parts()
    released = []
    p.save(_item(1, {"b": np.ones(4, np.int64)}, released))
    p.writer.finish()
    assert p.lock.finishing  # a new Checkpointer on the directory waits for it
    p.writer._thread.join(30)
    assert not p.writer._thread.is_alive()
    assert released == [1] and jax_cb_ckpt.all_steps(p.options.where.directory) == [1]
    again = _places.at(p.options.where.directory).lock(_format.LOCK_NAME)  # released at its end
    again.release()


def test_flush_at_exit_writes_pending_saves_and_says_so(parts):
    from jax_cb_ckpt import UnflushedSaveWarning

    p = parts()
    released = []
    big = np.zeros(2**22, np.float32)  # 16 MiB: still pending when flush_at_exit asks
    for step in (1, 2):
        p.save(_item(step, {"w": big + step}, released))
    with pytest.warns(
        UnflushedSaveWarning,
        match=r"save\(s\) to .* were still pending at "
        r"interpreter exit and were written now",
    ):
        p.writer.flush_at_exit()
    assert p.exited == [True]  # the Checkpointer was marked closed first
    assert released == [1, 2]
    assert jax_cb_ckpt.all_steps(p.options.where.directory) == [1, 2]


def test_a_step_records_its_leaves_and_is_read_back_by_plain_numpy_readers(parts):
    p = parts()
    p.save(_item(4, {"a": np.arange(3, dtype=np.int16), "b": np.ones((2, 2), np.float64)}, []))
    p.exchange.drain()
    meta = jax_cb_ckpt.metadata(p.options.where.directory, step=4)
    assert json_leaves(meta) == {"'a'": ("int16", [3]), "'b'": ("float64", [2, 2])}
    assert jax_cb_ckpt.verify(p.options.where.directory) == [4]


def json_leaves(meta):
    """{path: (dtype, shape)} of a step's described leaves."""
    leaves = meta.get("leaves") or meta.get("specs") or []
    return {leaf["path"]: (leaf["dtype"], leaf["shape"]) for leaf in leaves}
