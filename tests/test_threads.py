"""Several threads on one Checkpointer during per-device saves (`shardings=`), and the
bound on host memory when devices run ahead of each other (4 CPU devices, conftest)."""

import threading
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import run_script
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_cb_ckpt


def mesh_1d():
    return jax.make_mesh((4,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))


def elementwise_run(ckpt, mesh, steps, n):
    """A scan whose update has no collective: the devices run independently."""
    sharding = NamedSharding(mesh, P("d"))
    state = jax.device_put(jnp.zeros((n,), jnp.float32), sharding)

    def body(x, i):
        x = x * 0.5 + i.astype(jnp.float32)
        ckpt.maybe_save({"x": x}, i + 1, shardings={"x": sharding})
        return x, None

    return jax.jit(lambda x: jax.lax.scan(body, x, jnp.arange(steps))[0])(state)


def expected(step, n):
    x = np.zeros((n,), np.float32)
    for i in range(step):
        x = x * np.float32(0.5) + np.float32(i)
    return x


def test_wait_from_another_thread_never_drops_or_mixes_steps(make_ckpt):
    """wait() in a second thread while a program saves per device: every step is written
    and holds its own bytes (it used to release staging the running program was still
    filling: steps dropped, and a listed step holding the next steps' bytes)."""
    mesh, steps, n = mesh_1d(), 40, 1 << 20  # 4 MiB, 1 MiB per device
    ckpt = make_ckpt(every=1, queue_size=2)
    done = threading.Event()

    def waiter():
        while not done.is_set():
            ckpt.wait()

    thread = threading.Thread(target=waiter)
    thread.start()
    try:
        elementwise_run(ckpt, mesh, steps, n).block_until_ready()
    finally:
        done.set()
        thread.join()
    ckpt.wait()
    assert ckpt.all_steps() == list(range(1, steps + 1))
    assert ckpt.stats.skipped == 0 and ckpt.stats.failed == 0
    like = {"x": jax.ShapeDtypeStruct((n,), jnp.float32)}
    for step in range(1, steps + 1):
        got = np.asarray(ckpt.restore(like, step=step)["x"])
        assert got.tobytes() == expected(step, n).tobytes(), step


@pytest.mark.slow
def test_devices_running_ahead_hold_at_most_queue_size_plus_one_states(tmp_path):
    """An update without a collective lets the devices run ahead of the one that
    completes a step; they used to copy every later step into new staging while the
    writer was busy (97 states of 16 MiB with queue_size=1). Peak RSS in a child."""
    result = run_script(
        tmp_path,
        """
        import os, resource, sys
        os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
        sys.path.insert(0, "tests")
        import jax, jax_cb_ckpt
        from test_threads import elementwise_run, mesh_1d

        n = 4 << 20  # 16 MiB of float32
        with jax_cb_ckpt.Checkpointer(sys.argv[1] + "/warm", every=1, queue_size=1) as c:
            elementwise_run(c, mesh_1d(), 2, n).block_until_ready()  # compile, warm up
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        with jax_cb_ckpt.Checkpointer(sys.argv[1] + "/run", every=1, queue_size=1) as c:
            elementwise_run(c, mesh_1d(), 40, n).block_until_ready()
        after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        print((after - before) / (n * 4), c.all_steps()[-1])
        """,
        tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    states, last = result.stdout.split()
    assert int(last) == 40
    # queue_size + 1 states in staging, plus what the writer and XLA keep: well under 6
    assert float(states) < 6, f"peak RSS grew by {float(states):.1f} states"


def test_skipped_per_device_saves_are_counted_and_written_ones_exact(make_ckpt):
    """on_full='skip' with per-device saves: the first device decides for all, so a step
    is written whole or skipped whole (counted, warned), never half."""
    mesh, steps, n = mesh_1d(), 30, 1 << 20
    ckpt = make_ckpt(every=1, queue_size=1, on_full="skip")
    elementwise_run(ckpt, mesh, steps, n).block_until_ready()
    skipped = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ckpt.wait()
        skipped = [w for w in caught if issubclass(w.category, jax_cb_ckpt.SkippedSaveWarning)]
    stats = ckpt.stats
    assert stats.saves + stats.skipped == steps and len(skipped) == stats.skipped
    like = {"x": jax.ShapeDtypeStruct((n,), jnp.float32)}
    for step in ckpt.all_steps():
        got = np.asarray(ckpt.restore(like, step=step)["x"])
        assert got.tobytes() == expected(step, n).tobytes(), step


def test_a_refused_per_device_save_gives_its_slot_back(make_ckpt, ckpt_dir):
    """A per-device save refused on its first device (a step another run left) fails the
    program; with queue_size=1 the next run must not wait forever for that slot."""
    mesh, n = mesh_1d(), 1 << 10
    with jax_cb_ckpt.Checkpointer(ckpt_dir, every=1) as other:
        other.save({"x": np.zeros((n,), np.float32)}, 5)
    ckpt = make_ckpt(every=1, queue_size=1)
    with pytest.raises(jax_cb_ckpt.StepExistsError):
        with ckpt:
            elementwise_run(ckpt, mesh, 3, n).block_until_ready()
    ckpt = make_ckpt(every=1, queue_size=1)
    ckpt.restore({"x": jax.ShapeDtypeStruct((n,), jnp.float32)})
    sharding = NamedSharding(mesh, P("d"))

    def body(x, i):
        x = x + 1.0
        ckpt.maybe_save({"x": x}, i, shardings={"x": sharding})
        return x, None

    state = jax.device_put(jnp.zeros((n,), jnp.float32), sharding)
    jax.jit(lambda x: jax.lax.scan(body, x, jnp.arange(6, 9))[0])(state).block_until_ready()
    ckpt.wait()
    assert ckpt.all_steps() == [5, 6, 7, 8]
