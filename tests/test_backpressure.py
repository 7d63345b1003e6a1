"""At most queue_size saves in flight; block loses nothing, skip drops and says so."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_cb_ckpt

N_SAVES = 30
SIZE = 1 << 18  # 1 MB of float32: each write takes far longer than a hand-off


def fast_saving_scan(ckpt):
    @jax.jit
    def run(x):
        def body(x, i):
            x = x + 1.0
            ckpt.save({"x": x}, i)  # a save on every step: much faster than the disk
            return x, None

        return jax.lax.scan(body, x, jnp.arange(N_SAVES))[0]

    return run(jnp.zeros(SIZE))


def test_block_loses_nothing(make_ckpt):
    ckpt = make_ckpt(queue_size=1, on_full="block")
    fast_saving_scan(ckpt)
    ckpt.wait()
    stats = ckpt.stats
    assert ckpt.all_steps() == list(range(N_SAVES))
    assert (stats.saves, stats.skipped) == (N_SAVES, 0)
    assert stats.queue_high_water == 1
    # The device waited for the writer, and each wait was counted.
    assert 0 < stats.queue_waits < N_SAVES
    for step in (0, 17, N_SAVES - 1):
        restored = ckpt.restore({"x": jnp.zeros(SIZE)}, step=step)
        np.testing.assert_array_equal(restored["x"], np.full(SIZE, step + 1, np.float32))


def test_skip_drops_counts_and_warns_with_step(make_ckpt):
    ckpt = make_ckpt(queue_size=1, on_full="skip")
    fast_saving_scan(ckpt)
    with pytest.warns(jax_cb_ckpt.SkippedSaveWarning) as record:
        ckpt.wait()
    stats = ckpt.stats
    saved = ckpt.all_steps()
    assert stats.skipped > 0
    assert stats.saves + stats.skipped == N_SAVES
    assert len(saved) == stats.saves and saved[0] == 0
    assert stats.queue_high_water == 1 and stats.queue_waits == 0
    skipped_steps = sorted(set(range(N_SAVES)) - set(saved))
    messages = [str(w.message) for w in record]
    assert len(messages) == stats.skipped
    for step, message in zip(skipped_steps, messages, strict=True):
        assert f"skipped the save of step {step}: the queue was full" in message
    for step in saved:  # what was saved is right
        restored = ckpt.restore({"x": jnp.zeros(SIZE)}, step=step)
        np.testing.assert_array_equal(restored["x"], np.full(SIZE, step + 1, np.float32))


def test_bigger_queue_absorbs_a_burst(make_ckpt):
    ckpt = make_ckpt(queue_size=N_SAVES, on_full="skip")
    fast_saving_scan(ckpt)
    ckpt.wait()
    assert ckpt.stats.skipped == 0
    assert ckpt.all_steps() == list(range(N_SAVES))
    assert 1 < ckpt.stats.queue_high_water <= N_SAVES


@pytest.mark.parametrize("queue_size", [1, 2])
def test_newest_never_blocks_keeps_the_last_save_and_counts_the_rest(make_ckpt, queue_size):
    """on_full='newest': a new save takes the place of the oldest one still waiting; the
    last save is always written, every written step is exact, and nothing is lost
    without being counted (saves + superseded == saves made)."""
    ckpt = make_ckpt(queue_size=queue_size, on_full="newest")
    fast_saving_scan(ckpt)
    ckpt.wait()
    stats = ckpt.stats
    saved = ckpt.all_steps()
    assert saved[-1] == N_SAVES - 1  # the last save of the run is on disk
    assert stats.superseded > 0 and stats.skipped == 0
    assert stats.saves + stats.superseded == N_SAVES and len(saved) == stats.saves
    assert stats.queue_high_water <= queue_size + 1  # queue_size waiting, one written
    # The device never waited for the disk: only for its own copies.
    assert stats.queue_waits == 0
    for step in saved:
        restored = ckpt.restore({"x": jnp.zeros(SIZE)}, step=step)
        np.testing.assert_array_equal(restored["x"], np.full(SIZE, step + 1, np.float32))


def test_newest_with_per_device_saves_writes_the_last_step(make_ckpt):
    """on_full='newest' with shardings=: the first device decides for all devices."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((4,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
    sharding = NamedSharding(mesh, P("d"))
    ckpt = make_ckpt(queue_size=1, on_full="newest")

    @jax.jit
    def run(x):
        def body(x, i):
            x = x + 1.0
            ckpt.save({"x": x}, i, shardings={"x": sharding})
            return x, None

        return jax.lax.scan(body, x, jnp.arange(N_SAVES))[0]

    run(jax.device_put(jnp.zeros(SIZE * 4), sharding)).block_until_ready()
    ckpt.wait()
    stats = ckpt.stats
    saved = ckpt.all_steps()
    assert saved[-1] == N_SAVES - 1
    assert stats.saves + stats.superseded == N_SAVES and len(saved) == stats.saves
    for step in saved[-3:]:
        restored = ckpt.restore({"x": jnp.zeros(SIZE * 4)}, step=step)
        np.testing.assert_array_equal(restored["x"], np.full(SIZE * 4, step + 1, np.float32))
