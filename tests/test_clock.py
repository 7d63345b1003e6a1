"""`_user/_clock.py`: `SaveClock.due()` is true once `every_seconds` passed since the last
hand-off (any save) or the opening; `read` answers in the step's shape; from traced
code, `guarded` asks the host only every `check_every` steps (False in between, and no
crossing), records the highest step it asked at, and under vmap asks once per batch."""

import time

import jax
import jax.numpy as jnp
import numpy as np

from jax_cb_ckpt._handoff._stats import StatsRecorder
from jax_cb_ckpt._user._clock import SaveClock


def _clock(every=10.0, ago=0.0):
    stats = StatsRecorder()
    stats.last_handoff = time.monotonic() - ago
    return SaveClock(every, stats), stats


def test_due_counts_from_the_last_hand_off():
    clock, stats = _clock(every=10.0, ago=5.0)
    assert not clock.due()
    stats.last_handoff = time.monotonic() - 10.5
    assert clock.due()
    stats.handed_off(0.0)  # any save resets it
    assert not clock.due()


def test_a_fresh_recorder_counts_from_the_opening():
    clock = SaveClock(0.3, StatsRecorder())
    assert not clock.due()
    time.sleep(0.31)
    assert clock.due()


def test_read_answers_in_the_steps_shape():
    clock, _ = _clock(every=1.0, ago=2.0)
    assert clock.read(np.int32(3)).shape == ()
    out = clock.read(np.arange(4))
    assert out.shape == (4,) and out.dtype == bool and out.all()


def test_guarded_asks_only_every_check_every_steps_and_records_the_step():
    clock, _ = _clock(every=1.0, ago=2.0)  # due whenever asked
    asked = []
    read = clock._read_in_loop
    clock._read_in_loop = lambda step: asked.append(int(step)) or read(step)

    def loop(n):
        return jax.lax.map(lambda s: clock.guarded(s, 3), jnp.arange(n, dtype=jnp.int32))

    out = jax.jit(loop, static_argnums=0)(8)
    np.testing.assert_array_equal(out, [s % 3 == 0 for s in range(8)])
    assert asked == [0, 3, 6]
    assert clock.seen == 6


def test_not_due_is_false_even_where_asked():
    clock, _ = _clock(every=100.0, ago=0.0)
    out = jax.jit(lambda s: clock.guarded(s, 2))(jnp.int32(4))
    assert not bool(out)
    assert clock.seen == 4


def test_under_vmap_the_clock_is_read_once_per_batch():
    clock, _ = _clock(every=1.0, ago=2.0)
    asked = []
    read = clock._read_in_loop
    clock._read_in_loop = lambda step: asked.append(np.shape(step)) or read(step)
    steps = jnp.array([2, 3, 4, 6], jnp.int32)
    out = jax.jit(jax.vmap(lambda s: clock.guarded(s, 2)))(steps)
    np.testing.assert_array_equal(out, [True, False, True, True])
    assert asked == [()]  # one read, for the batch, at its highest step
    assert clock.seen == 6
