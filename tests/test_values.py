"""Every value a save accepts is saved exactly or refused: eager saves are snapshots,
64-bit leaves and steps are exact without x64, negative steps are refused, every leaf
type round-trips, and dtypes of one width never share bits. Each test failed before
its fix (adversarial testing)."""

import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from helpers import assert_same_state, state_at

import jax_cb_ckpt
from jax_cb_ckpt import ConfigError, InvalidStateError

# -- an eager save is a snapshot ----------------------------------------------------


@pytest.mark.parametrize("dtype", [np.float32, pytest.param(np.float64, marks=pytest.mark.slow)])
def test_eager_numpy_save_is_a_snapshot(make_ckpt, dtype):
    ckpt = make_ckpt(queue_size=4)
    big = {"obs": np.zeros(1 << 24, np.float32)}  # 64 MB: the writer stays busy
    for step in range(3):
        obs = np.full(1 << 22, step, dtype)
        ckpt.save({"obs": obs}, 2 * step)
        obs += 100  # after save() returned: must not reach the checkpoint
        ckpt.save(big, 2 * step + 1)
        big["obs"] += 1
    ckpt.wait()
    for step in range(3):
        saved = ckpt.restore({"obs": np.zeros(1 << 22, dtype)}, step=2 * step)["obs"]
        np.testing.assert_array_equal(saved, np.full(1 << 22, step, dtype))
        big_saved = jax_cb_ckpt.restore(ckpt.directory, big, step=2 * step + 1)["obs"]
        assert (big_saved == step).all()


def test_a_cpu_array_kept_without_a_copy_outlives_delete_and_donation():
    """An eager save keeps a CPU jax.Array's own buffer (a numpy view, no copy): while
    the view lives JAX neither frees that memory on delete() nor lets a jit given the
    array donated write into it (jax 0.10 copies and keeps the array; 0.12 marks the array
    deleted, and writes its result elsewhere). Checked here on every JAX the tests run
    on: if a version freed or reused such a buffer, saves would hold garbage. (On the
    CPU device whatever the default backend: a GPU array is copied instead, below.)"""
    from jax_cb_ckpt._save._host import _immutable_view

    cpu = jax.devices("cpu")[0]
    x, y = (jax.device_put(np.arange(1 << 20, dtype=np.float32), cpu) for _ in range(2))
    xv, yv = _immutable_view(x), _immutable_view(y)
    assert xv is not None and yv is not None and not xv.flags.writeable
    x.delete()
    twice = jax.jit(lambda a: a * 2, donate_argnums=0)
    out, held = y, {xv.ctypes.data, yv.ctypes.data}
    for _ in range(3):  # a donation chain: any memory the jit may reuse, it does
        out = twice(out)
        assert out.unsafe_buffer_pointer() not in held
    del x, y
    garbage = [jax.device_put(np.full(1 << 20, -1.0), cpu) for _ in range(8)]  # reuse freed memory
    expected = np.arange(1 << 20, dtype=np.float32)
    np.testing.assert_array_equal(xv, expected)
    np.testing.assert_array_equal(yv, expected)
    np.testing.assert_array_equal(out, expected * 8)
    assert len(garbage) == 8
    # numpy, and arrays on another platform or on several devices, are copied instead
    assert _immutable_view(np.arange(3)) is None
    others = [d for d in jax.devices() if d.platform != "cpu"]
    if others:  # a GPU run: an array in its memory is never viewed
        assert _immutable_view(jax.device_put(np.arange(3), others[0])) is None


@pytest.mark.parametrize("how", ["delete", "donate"])
def test_an_eager_save_of_jax_arrays_is_a_snapshot(make_ckpt, how):
    """The same, end to end: saves kept without a copy, then deleted or donated by the
    caller while the writer is still busy, restore as saved."""
    ckpt = make_ckpt(queue_size=4)
    big = {"obs": np.zeros(1 << 24, np.float32)}  # 64 MB: the writer stays busy
    step_fn = jax.jit(lambda a: a + 100, donate_argnums=0)
    for step in range(3):
        obs = jnp.full(1 << 22, step, jnp.float32)
        ckpt.save(big, 2 * step)
        ckpt.save({"obs": obs}, 2 * step + 1)
        if how == "delete":
            obs.delete()
        else:
            obs = step_fn(obs)
    ckpt.wait()
    for step in range(3):
        saved = ckpt.restore({"obs": np.zeros(1 << 22, np.float32)}, step=2 * step + 1)
        np.testing.assert_array_equal(saved["obs"], np.full(1 << 22, step, np.float32))


def test_traced_numpy_constant_is_copied_when_traced(make_ckpt):
    ckpt = make_ckpt()
    table = np.arange(8, dtype=np.int64) + 2**40

    @jax.jit
    def run(x):
        ckpt.save({"x": x, "table": table}, 1)
        return x

    jax.block_until_ready(run(jnp.ones(2)))
    jax.effects_barrier()
    table += 1  # after tracing: the compiled program's constant is what was traced
    ckpt.wait()
    restored = ckpt.restore({"x": jnp.ones(2), "table": table})
    np.testing.assert_array_equal(restored["table"], np.arange(8, dtype=np.int64) + 2**40)
    assert restored["table"].dtype == np.int64


# -- 64-bit values are exact or refused ---------------------------------------------


def test_64_bit_leaves_and_steps_are_exact_without_x64(make_ckpt):
    assert not jax.config.jax_enable_x64
    state = {
        "i": np.array([2**40 + 1, -(2**62)], np.int64),
        "u": np.array([np.iinfo(np.uint64).max], np.uint64),
        "f": np.array([1e-320, 1 / 3], np.float64),
        "c": np.array([1e-320 + 1j / 3], np.complex128),
        "py_int": 2**40 + 1,
        "py_float": 1e-320,
        "np_int": np.int64(2**40 + 1),
    }
    ckpt = make_ckpt()
    step = np.int64(2**32 + 5)
    ckpt.save(state, step)
    ckpt.wait()
    assert ckpt.all_steps() == [2**32 + 5]
    assert_same_state(ckpt.restore(state), state)


def test_traced_step_that_would_wrap_is_refused(make_ckpt):
    ckpt = make_ckpt()
    with pytest.raises(InvalidStateError, match=r"step 4294967301 does not fit int32"):
        jax.jit(lambda x: ckpt.save({"x": x}, np.int64(2**32 + 5)))(jnp.ones(2))
    with pytest.raises(InvalidStateError, match=r"step 2147483648 does not fit int32"):
        jax.jit(lambda x: ckpt.save({"x": x}, 2**31))(jnp.ones(2))
    ckpt.save({"x": jnp.ones(2)}, 2**31)  # eagerly: exact
    ckpt.wait()
    assert ckpt.all_steps() == [2**31]


def test_python_int_beyond_int64_is_refused(make_ckpt):
    with pytest.raises(InvalidStateError, match=r"state\['n'\] is the Python int .* int64"):
        make_ckpt().save({"n": 2**70}, 1)


# -- negative steps are refused everywhere ----------------------------------------------


def test_negative_steps_are_refused(make_ckpt, ckpt_dir):
    ckpt = make_ckpt()
    with pytest.raises(InvalidStateError, match=r"step -1 is out of range"):
        ckpt.save(state_at(1), -1)
    with pytest.raises(Exception, match=r"step -2 is negative"):
        jax.jit(lambda s, i: ckpt.save(s, i))(state_at(1), jnp.int32(-2))
        jax.effects_barrier()
    with pytest.raises(InvalidStateError, match=r"step -2 is negative"):
        ckpt.wait()
    assert os.listdir(ckpt_dir) == [".jax_cb_ckpt.lock"]
    with pytest.raises(ConfigError, match=r"step must be a non-negative int"):
        jax_cb_ckpt.restore(ckpt_dir, state_at(0), step=-1)


# -- every leaf type that save accepts restores -------------------------------------

NUMPY_DTYPES = [
    np.bool_,
    np.int8,
    np.int16,
    np.int32,
    np.int64,
    np.uint8,
    np.uint16,
    np.uint32,
    np.uint64,
    np.float16,
    np.float32,
    np.float64,
    np.complex64,
    np.complex128,
    ml_dtypes.bfloat16,
    ml_dtypes.float8_e4m3fn,
    ml_dtypes.float8_e5m2,
    ml_dtypes.float8_e4m3,  # stored widened: TensorStore lacks it
    ml_dtypes.float4_e2m1fn,
    ml_dtypes.int2,
    ml_dtypes.int4,
    ml_dtypes.uint2,  # stored widened
    ml_dtypes.uint4,  # stored widened
]
JAX_DTYPES = [d for d in NUMPY_DTYPES if np.dtype(d).itemsize < 8 and d is not np.complex128]


def every_leaf_type():
    state = {"py": {"bool": True, "int": -7, "float": 0.1, "complex": 1.5 - 0.25j}}
    for dtype in NUMPY_DTYPES:
        name = np.dtype(dtype).name
        values = np.arange(6).reshape(2, 3).astype(dtype)
        state[f"np_{name}"] = values
        state[f"np_scalar_{name}"] = values.reshape(-1)[1]  # a numpy scalar
        state[f"np_empty_{name}"] = np.zeros((0, 3), dtype)
    for dtype in JAX_DTYPES:
        name = np.dtype(dtype).name
        state[f"jax_{name}"] = jnp.arange(6).reshape(2, 3).astype(dtype)
        state[f"jax_empty_{name}"] = jnp.zeros((3, 0), dtype)
    state["key_threefry"] = jax.random.key(1)
    state["key_rbg"] = jax.random.split(jax.random.key(2, impl="rbg"), 3)
    state["key_empty"] = jax.random.split(jax.random.key(3), 0)
    return state


def test_every_accepted_leaf_type_round_trips(make_ckpt):
    state = every_leaf_type()
    assert isinstance(state["np_scalar_float64"], float)  # np.float64 is a Python float
    ckpt = make_ckpt()
    ckpt.save(state, 1)
    ckpt.wait()
    assert_same_state(ckpt.restore(state), state)


def test_every_jax_leaf_type_round_trips_from_jit(make_ckpt):
    state = {k: v for k, v in every_leaf_type().items() if k.startswith(("jax_", "key_"))}
    ckpt = make_ckpt()
    jax.jit(lambda s: ckpt.save(s, 1))(state)
    ckpt.wait()
    assert_same_state(ckpt.restore(state), state)
    assert_same_state(jax_cb_ckpt.restore(ckpt.directory, jax.eval_shape(lambda: state)), state)


def test_python_number_under_vmap_restores(make_ckpt):
    ckpt = make_ckpt()
    jax.vmap(lambda x: ckpt.save({"x": x, "lr": 0.5}, 3))(jnp.arange(3.0))
    ckpt.wait()
    restored = ckpt.restore({"x": jnp.zeros(3), "lr": np.zeros(3)})
    np.testing.assert_array_equal(restored["lr"], np.full(3, 0.5))


def test_zero_size_leaf_concatenated_over_devices_keeps_its_global_shape(make_ckpt):
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()[:4]), ("d",))
    x = jax.device_put(jnp.arange(8.0), NamedSharding(mesh, P("d")))
    ckpt = make_ckpt()

    def save(x):
        # Each device's block of a (8, 0) leaf (made here: jax 0.11.2 crashes on a
        # zero-size shard_map *input*, with or without this library).
        ckpt.save({"x": x, "z": jnp.zeros((2, 0))}, 3, axis_name="d", gather="concat")
        return x

    jax.jit(jax.shard_map(save, mesh=mesh, in_specs=P("d"), out_specs=P("d")))(x)
    ckpt.wait()
    restored = ckpt.restore({"x": jnp.zeros(8), "z": jnp.zeros((8, 0))})
    assert restored["z"].shape == (8, 0)
    np.testing.assert_array_equal(restored["x"], np.arange(8.0))


# -- dtypes whose bits must survive ------------------------------------------------------


def test_float8_e4m3_nan_payloads_round_trip_bit_for_bit(make_ckpt):
    """float8_e4m3 is stored as its bits: widening it (as TensorStore needs) kept NaN
    but not the NaN's payload, so a state with NaNs did not restore bit for bit."""
    bits = np.array([0x79, 0x7A, 0x7F, 0xF9, 0x00, 0x38], np.uint8)
    value = bits.view(ml_dtypes.float8_e4m3)
    ckpt = make_ckpt()
    ckpt.save({"f8": value}, 1)
    jax.jit(lambda x: ckpt.save({"f8": x}, 2))(jnp.asarray(value))
    ckpt.wait()
    for step in (1, 2):
        restored = ckpt.restore({"f8": value}, step=step)
        assert np.asarray(restored["f8"]).view(np.uint8).tolist() == bits.tolist()


def test_staging_buffers_are_never_reused_across_dtypes_of_the_same_width(make_ckpt):
    """Staging buffers are reused by layout. Every float8 type (and int4, ...) has the
    dtype string "<V1": keyed by that, a float8_e4m3fn buffer was reused for a
    float8_e5m2fnuz save of the same shape, and np.copyto cast the values into it."""
    bits = np.arange(256, dtype=np.uint8).reshape(16, 16)
    first = bits.view(ml_dtypes.float8_e4m3fn)
    second = bits.view(ml_dtypes.float8_e5m2fnuz)
    ckpt = make_ckpt()
    ckpt.save({"x": first}, 1)
    ckpt.wait()  # the first set of buffers is back in the pool
    ckpt.save({"x": second}, 2)
    ckpt.wait()
    restored = ckpt.restore({"x": second}, step=2)
    assert np.asarray(restored["x"]).dtype == second.dtype
    assert np.asarray(restored["x"]).view(np.uint8).tolist() == bits.tolist()
