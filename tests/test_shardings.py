"""`maybe_save(..., shardings=...)`: every device hands over its own block, in process
(4 CPU devices, set by conftest). The 32 MiB multi-device cases run in a subprocess
with 8 devices (test_multidevice.py); these cover the protocol and the errors."""

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_cb_ckpt

N_DEV = 4


def auto_mesh():
    return jax.make_mesh((2, 2), ("a", "b"), axis_types=(jax.sharding.AxisType.Auto,) * 2)


def sharded_state(mesh):
    state = {
        "w": jnp.arange(64 * 32, dtype=jnp.float32).reshape(64, 32),
        "v": jnp.arange(16, dtype=jnp.bfloat16),
        "i4": jnp.arange(8, dtype=jnp.int4).reshape(8, 1),
        "n": jnp.int32(7),
        "key": jax.random.split(jax.random.key(1), 4),
    }
    shardings = {
        "w": NamedSharding(mesh, P("a", "b")),  # split over both axes
        "v": NamedSharding(mesh, P(("a", "b"))),  # one dimension over both axes
        "i4": NamedSharding(mesh, P("b")),  # replicated over "a": written once
        "n": NamedSharding(mesh, P()),
        "key": NamedSharding(mesh, P("a")),
    }
    return jax.device_put(state, shardings), shardings


def update(state, i):
    top = jnp.max(state["w"])  # a cross-device reduction
    return {
        "w": state["w"] * 0.5 + top,
        "v": state["v"] + jnp.bfloat16(1),
        "i4": state["i4"] + jnp.int4(1),
        "n": state["n"] + i,
        "key": jax.vmap(lambda k: jax.random.split(k)[0])(state["key"]),
    }


def run(ckpt, state, shardings, steps, *, every=1):
    def body(s, i):
        s = update(s, i)
        ckpt.maybe_save(s, i + 1, when=(i + 1) % every == 0, shardings=shardings)
        return s, None

    return jax.jit(lambda s: jax.lax.scan(body, s, jnp.arange(steps))[0])(state)


def references(state, steps):
    out, fn = {}, jax.jit(update)
    for i in range(steps):
        state = fn(state, jnp.int32(i))
        out[i + 1] = jax.device_get(state)
    return out


def assert_exact(got, want):
    assert jax_cb_ckpt.same_bits(jax.device_get(got), want)


def test_each_device_hands_over_its_block_and_every_step_is_exact(make_ckpt):
    mesh = auto_mesh()
    state, shardings = sharded_state(mesh)
    refs = references(state, 6)
    ckpt = make_ckpt(queue_size=1)  # the writer builds arrays while the program runs
    run(ckpt, state, shardings, 6)
    ckpt.wait()
    assert ckpt.all_steps() == [1, 2, 3, 4, 5, 6]
    assert ckpt.stats.crossings == 6 and ckpt.stats.duplicates == 0
    for step in range(1, 7):
        restored = ckpt.restore(jax.device_get(state), step=step)
        assert_exact(restored, refs[step])
    placed = ckpt.restore(state)  # like is sharded: read sharded, placed as like
    assert_exact(placed, refs[6])
    for name in ("w", "v", "i4"):
        assert placed[name].sharding == state[name].sharding


def test_plain_orbax_reads_the_sharded_format(make_ckpt, ckpt_dir):
    mesh = auto_mesh()
    state, shardings = sharded_state(mesh)
    state = {k: v for k, v in state.items() if k != "key"}
    shardings = {k: v for k, v in shardings.items() if k != "key"}
    refs = references({**state, "key": jax.random.split(jax.random.key(1), 4)}, 2)
    ckpt = make_ckpt(every=1)

    def body(s, i):
        full = update({**s, "key": jax.random.split(jax.random.key(1), 4)}, i)
        s = {k: v for k, v in full.items() if k != "key"}
        ckpt.maybe_save(s, i + 1, shardings=shardings)
        return s, None

    jax.jit(lambda s: jax.lax.scan(body, s, jnp.arange(2))[0])(state)
    ckpt.wait()
    target = {
        name: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, P()))
        for name, x in state.items()
    }
    plain = ocp.StandardCheckpointer().restore(ckpt_dir / "2" / "state", target)
    for name in ("w", "v", "i4", "n"):
        assert np.asarray(plain[name]).tobytes() == np.asarray(refs[2][name]).tobytes(), name


def test_repeating_a_run_warns_once_per_step(make_ckpt):
    mesh = auto_mesh()
    state, shardings = sharded_state(mesh)
    ckpt = make_ckpt()
    run(ckpt, state, shardings, 2)
    ckpt.wait()
    with pytest.warns(jax_cb_ckpt.DuplicateStepWarning, match=r"step [12] was handed") as record:
        run(ckpt, state, shardings, 2)
        ckpt.wait()
    assert len([w for w in record if "was handed over again" in str(w.message)]) == 2
    assert ckpt.stats.duplicates == 2 and ckpt.all_steps() == [1, 2]


def test_skipped_sharded_save_is_counted_and_can_be_saved_later(make_ckpt):
    mesh = auto_mesh()
    state, shardings = sharded_state(mesh)
    ckpt = make_ckpt(queue_size=1, on_full="skip")
    with pytest.warns(jax_cb_ckpt.SkippedSaveWarning):
        run(ckpt, state, shardings, 8)
        ckpt.wait()
    steps = ckpt.all_steps()
    assert ckpt.stats.saves == len(steps) and ckpt.stats.saves + ckpt.stats.skipped == 8
    refs = references(state, 8)
    for step in steps:
        assert_exact(ckpt.restore(jax.device_get(state), step=step), refs[step])


def test_under_vmap_the_batch_is_saved_gathered(make_ckpt):
    mesh = auto_mesh()
    state, shardings = sharded_state(mesh)
    w = jnp.stack([state["w"], state["w"] + 1])
    ckpt = make_ckpt()

    def train(w):
        ckpt.save({"w": w}, 3, shardings={"w": shardings["w"]})
        return w

    jax.jit(jax.vmap(train))(w)
    ckpt.wait()
    assert np.asarray(ckpt.restore({"w": np.asarray(w)})["w"]).tobytes() == np.asarray(w).tobytes()


@pytest.mark.parametrize(
    ("shardings", "message"),
    [
        ({"w": "nope"}, "not a prefix|NamedSharding"),
        (
            jax.sharding.SingleDeviceSharding(jax.devices()[0]),
            "leaf state\\['w'\\] has SingleDeviceSharding",
        ),
        (NamedSharding(auto_mesh(), P("a", "b", None)), "spec .* has 3 entries"),
        (NamedSharding(jax.make_mesh((4,), ("d",)), P(None, "d")), "splits into 4 equal"),
    ],
)
def test_bad_shardings_are_clear_errors(make_ckpt, shardings, message):
    ckpt = make_ckpt()
    state = {"w": jnp.ones((8, 6))}
    with pytest.raises(jax_cb_ckpt.InvalidStateError, match=message):
        jax.jit(lambda s: ckpt.save(s, 1, shardings=shardings))(state)
    assert ckpt.all_steps() == []


def test_shardings_with_axis_name_is_a_config_error(make_ckpt):
    ckpt = make_ckpt()
    mesh = jax.make_mesh((N_DEV,), ("d",))
    with pytest.raises(jax_cb_ckpt.ConfigError, match="shardings= is for"):
        ckpt.save({"w": jnp.ones(4)}, 1, axis_name="d", shardings=NamedSharding(mesh, P()))


@pytest.mark.parametrize("per_device", [True, False])
def test_a_refused_save_on_several_devices_raises_the_librarys_error(
    make_ckpt, ckpt_dir, per_device
):
    """A callback error in a multi-device program: JAX re-raises its wrapper from every
    later effects barrier; wait() raises our StepExistsError once, then works again."""
    with jax_cb_ckpt.Checkpointer(ckpt_dir) as other_run:
        other_run.save({"x": np.zeros(8, np.int32)}, 10)
    mesh = jax.make_mesh((N_DEV,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
    sharding = NamedSharding(mesh, P("d"))
    ckpt = make_ckpt(every=2)

    def body(s, i):
        s = s + 1
        ckpt.maybe_save({"x": s}, i + 1, shardings=sharding if per_device else None)
        return s, None

    x = jax.device_put(jnp.zeros(8, jnp.int32), sharding)
    with pytest.raises(jax.errors.JaxRuntimeError):
        jax.jit(lambda s: jax.lax.scan(body, s, jnp.arange(4))[0])(x).block_until_ready()
    with pytest.raises(jax_cb_ckpt.StepExistsError, match="step 2"):
        ckpt.wait()
    ckpt.wait()  # reported once
    ckpt.close()
    assert jax_cb_ckpt.all_steps(ckpt_dir) == [10]


def test_gathered_multi_device_save_counts_one_crossing_per_step(make_ckpt):
    mesh = jax.make_mesh((N_DEV,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
    x = jax.device_put(jnp.arange(16.0), NamedSharding(mesh, P("d")))
    ckpt = make_ckpt(every=2)

    def body(s, i):
        s = s * 2
        ckpt.maybe_save({"x": s}, i + 1)  # gathered: every device runs the crossing
        return s, None

    train = jax.jit(lambda s: jax.lax.scan(body, s, jnp.arange(4))[0])
    train(x)
    ckpt.wait()
    assert ckpt.all_steps() == [2, 4]
    assert ckpt.stats.crossings == 2 and ckpt.stats.duplicates == 0
    with pytest.warns(jax_cb_ckpt.DuplicateStepWarning, match=r"step [24] was handed") as record:
        train(x)
        ckpt.wait()
    assert len(record) == 2 and ckpt.stats.duplicates == 2
