"""`_save/_traced.py`, the checks made in Python while tracing, before any callback is
compiled in: `check_step` refuses a non-integer, batched, negative or too large step
(and says how to fix it), `check_when` refuses a non-boolean or batched predicate;
`_buffer.widen` widens the packed types exactly. (The step as it crosses and `is_tracing` are
`_values`'s, the axis name a check of `_route`'s: tests/test_route.py.)"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jax_cb_ckpt import InvalidStateError
from jax_cb_ckpt._base._dtypes import packed
from jax_cb_ckpt._base._errors import calling
from jax_cb_ckpt._save import _buffer, _route, _traced


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


def test_widen_turns_packed_types_into_exact_bytes():
    values = [
        jnp.array([-8, 7], ml_dtypes.int4),
        jnp.array([0.5, -6.0], ml_dtypes.float4_e2m1fn),
        jnp.zeros(2, jnp.float32),
    ]
    widened, crossing = _buffer.widen(values)
    assert widened == {0: np.dtype(ml_dtypes.int4), 1: np.dtype(ml_dtypes.float4_e2m1fn)}
    assert [c.dtype for c in crossing] == [jnp.int8, jnp.float32, jnp.float32]
    assert crossing[2] is values[2]
    np.testing.assert_array_equal(crossing[0], [-8, 7])
    np.testing.assert_array_equal(crossing[1], [0.5, -6.0])


# The dtypes jaxlib's GPU `Buffer.__cuda_array_interface__` serves (jaxlib/ffi.cc, 0.11).
CUDA_ARRAY_INTERFACE = {
    *("bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"),
    *("bfloat16", "float16", "float32", "float64", "complex64", "complex128"),
}


def test_every_leaf_crosses_as_a_dtype_the_gpu_buffer_interface_serves():
    """Issue 54: on a GPU the buffer crossing reads each operand through
    `__cuda_array_interface__`, which jaxlib refuses for float8 (the H200 run saved
    nothing from a jitted save of one, and wait() said nothing). Every leaf now crosses
    as a dtype it serves, on every backend, and comes back bit for bit (NaN payloads of
    float8_e4m3 included) through the host's turn back."""
    from jax_cb_ckpt._save._buffer import as_saved_dtypes

    bits = np.array([0x79, 0x7A, 0x7F, 0xF9, 0x00, 0x38], np.uint8)
    names = [
        "float8_e4m3", "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2",
        "float8_e5m2fnuz", "float8_e4m3b11fnuz", "float8_e3m4", "float8_e8m0fnu",
        "int4", "uint4", "float4_e2m1fn", "bfloat16", "float32", "bool",
    ]  # fmt: skip
    dtypes = [np.dtype(getattr(ml_dtypes, n, None) or n) for n in names]
    values = [
        jnp.asarray(bits.view(d)) if d.itemsize == 1 and not packed(d) and d.kind == "V"
        else jnp.zeros(6, d)
        for d in dtypes
    ]  # fmt: skip
    widened, crossing = _buffer.widen(values)
    crossed = {np.dtype(c.dtype).name for c in crossing}
    assert crossed <= CUDA_ARRAY_INTERFACE, crossed - CUDA_ARRAY_INTERFACE
    back = as_saved_dtypes([np.asarray(c) for c in crossing], widened)
    for value, restored in zip(values, back, strict=True):
        assert restored.dtype == value.dtype
        assert restored.tobytes() == np.asarray(value).tobytes()


def test_the_buffer_crossing_is_the_default_on_cpu():
    if jax.default_backend() != "cpu":  # (the suite on CUDA: gpu_check.py checks it there)
        pytest.skip(f"the default on a CPU; this run's backend is {jax.default_backend()}")
    assert _route.buffer_by_default() is True


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
