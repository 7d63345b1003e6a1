"""`_save/_traced.py`, the checks made in Python while tracing, before any callback is
compiled in: `check_step` refuses a non-integer, batched, negative or too large step
(and says how to fix it), `traced_step` refuses a known step that would wrap in JAX's
integer type, `check_when` refuses a non-boolean or batched predicate, `check_axis_name`
refuses a save inside shard_map without (or with a wrong) `axis_name`; `is_tracing`
tells traced from eager; `_widen` widens the packed types exactly."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jax_cb_ckpt import InvalidStateError
from jax_cb_ckpt._base._errors import calling
from jax_cb_ckpt._save import _traced


@pytest.mark.parametrize(
    "step, match",
    [
        (1.0, r"got float \(1\.0\).*pass int\(step\) for a Python float \(int\(1\.0\)\)"),
        (True, r"got bool \(True\)"),
        (jnp.float32(3), r"got float32\[\].*cast with step\.astype\(jnp\.int32\)"),
        (jnp.arange(3), r"got int32\[3\].*index out a single element"),
        ("5", r"got str \('5'\)"),
    ],
)
def test_a_step_that_is_not_an_integer_scalar_is_refused(step, match):
    with (
        calling("maybe_save"),
        pytest.raises(InvalidStateError, match=r"^maybe_save: step must be an integer scalar"),
    ):
        _traced.check_step(step)
    with pytest.raises(InvalidStateError, match=match):
        _traced.check_step(step)


@pytest.mark.parametrize("step", [-1, 2**63, np.int64(-3)])
def test_a_known_step_out_of_range_is_refused(step):
    with (
        calling("save"),
        pytest.raises(InvalidStateError, match=rf"^save: step {int(step)} is out of range"),
    ):
        _traced.check_step(step)


def test_a_known_step_is_returned_and_a_traced_one_is_none():
    assert _traced.check_step(7) == 7
    assert _traced.check_step(np.uint8(200)) == 200
    assert _traced.check_step(2**63 - 1) == 2**63 - 1
    seen = []
    jax.jit(lambda s: seen.append(_traced.check_step(s)) or s)(jnp.int32(3))
    assert seen == [None]


def test_a_step_that_would_wrap_in_int32_is_refused():
    assert not jax.config.jax_enable_x64
    with pytest.raises(InvalidStateError, match=r"step 2147483648 does not fit int32.*x64"):
        _traced.traced_step(2**31, 2**31)
    out = _traced.traced_step(2**31 - 1, 2**31 - 1)
    assert out.dtype == jnp.int32 and int(out) == 2**31 - 1
    assert _traced.traced_step(np.uint8(9), 9).dtype == jnp.uint8


@pytest.mark.parametrize(
    "when, got",
    [(1, r"int \(1\)"), (jnp.int32(1), r"int32\[\]"), (jnp.array([True, False]), r"bool\[2\]")],
)
def test_a_predicate_that_is_not_a_boolean_scalar_is_refused(when, got):
    with (
        calling("maybe_save"),
        pytest.raises(
            InvalidStateError,
            match=rf"^maybe_save: when must be a boolean scalar .*got {got}\. Fix",
        ),
    ):
        _traced.check_when(when)


def test_a_boolean_predicate_is_an_array():
    assert _traced.check_when(True).dtype == jnp.bool_
    assert bool(_traced.check_when(jnp.asarray(False))) is False


def _in_shard_map(check):
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("d",))

    def body(x):
        check()
        return x

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("d"), out_specs=P("d"))).trace(
        jnp.zeros(4)
    )


def test_inside_shard_map_an_axis_name_is_required():
    with pytest.raises(
        InvalidStateError,
        match=r"inside pmap/shard_map over axes \('d',\).*"
        r"axis_name='d'",
    ):
        _in_shard_map(lambda: _traced.check_axis_name(None))


def test_inside_shard_map_the_axis_name_must_be_mapped():
    with pytest.raises(InvalidStateError, match=r"axis_name='e' is not a pmap/shard_map axis"):
        _in_shard_map(lambda: _traced.check_axis_name("e"))
    _in_shard_map(lambda: _traced.check_axis_name("d"))
    _traced.check_axis_name(None)  # outside any map: nothing to require


def test_is_tracing_tells_traced_from_eager():
    assert _traced.is_tracing(jnp.zeros(2)) is False
    assert _traced.is_tracing({"a": 1}) is False
    seen = []
    jax.jit(lambda: seen.append(_traced.is_tracing()) or jnp.zeros(()))()  # constants only
    jax.jit(lambda x: seen.append(_traced.is_tracing(x)) or x)(jnp.zeros(()))
    jax.vmap(lambda x: seen.append(_traced.is_tracing(x)) or x)(jnp.zeros(2))
    assert seen == [True, True, True]


def test_widen_turns_packed_types_into_exact_bytes():
    values = [
        jnp.array([-8, 7], ml_dtypes.int4),
        jnp.array([0.5, -6.0], ml_dtypes.float4_e2m1fn),
        jnp.zeros(2, jnp.float32),
    ]
    widened, crossing = _traced._widen(values)
    assert widened == {0: np.dtype(ml_dtypes.int4), 1: np.dtype(ml_dtypes.float4_e2m1fn)}
    assert [c.dtype for c in crossing] == [jnp.int8, jnp.float32, jnp.float32]
    assert crossing[2] is values[2]
    np.testing.assert_array_equal(crossing[0], [-8, 7])
    np.testing.assert_array_equal(crossing[1], [0.5, -6.0])


def test_the_buffer_crossing_is_the_default_on_cpu():
    assert jax.default_backend() == "cpu"
    assert _traced.buffer_by_default() is True


# -- through the façade: raised while tracing, before any callback is compiled in -------


def test_a_bad_step_raises_while_tracing_and_nothing_crosses(make_ckpt, ckpt_dir):
    import jax_cb_ckpt

    ckpt = make_ckpt()
    state = {"w": jnp.zeros(3)}

    def step_fn(state, step):
        ckpt.maybe_save(state, step)
        return state

    with pytest.raises(InvalidStateError, match=r"^maybe_save: step must be an integer scalar"):
        jax.jit(step_fn).trace(state, jnp.float32(1))
    ckpt.wait()
    assert ckpt.stats.crossings == 0
    assert jax_cb_ckpt.all_steps(ckpt_dir) == []


def test_a_metric_that_is_not_one_number_per_member_is_refused_under_vmap(make_ckpt):
    ckpt = make_ckpt()

    def step_fn(w, step):
        ckpt.maybe_save({"w": w}, step, when=step >= 0, metrics={"loss": w})
        return w

    with pytest.raises(
        InvalidStateError,
        match=r"metrics=\.\.\.\) under vmap: metrics\['loss'\] is float32\[3\] per member",
    ):
        jax.jit(jax.vmap(step_fn, in_axes=(0, None))).trace(jnp.zeros((2, 3)), jnp.int32(0))
