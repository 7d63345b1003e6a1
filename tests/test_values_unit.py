"""`_save/_values.py`: what one leaf hands over. `to_payload` crosses key data for keys,
an owned copy of a constant (refused, naming the leaf, when it is 64-bit without x64:
JAX would change its values), and a JAX array as is; `eager_value` keeps the exact dtype;
`empty_data` has a key's trailing axis; `is_constant` tells Python-known values."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_cb_ckpt import InvalidStateError
from jax_cb_ckpt._base._errors import calling
from jax_cb_ckpt._layout._spec import ARRAY, KEY, SCALAR, LeafSpec
from jax_cb_ckpt._save import _values


def _spec(dtype, shape=(), kind=ARRAY, **kw):
    return LeafSpec("['leaf']", ("leaf",), kind, dtype, shape, **kw)


@pytest.mark.parametrize(
    "leaf, expected",
    [
        (np.zeros(2), True),
        (np.float32(1), True),
        (3, True),
        (2.5, True),
        (True, True),
        (1j, True),
        (jnp.zeros(2), False),
        ("text", False),
    ],
)
def test_is_constant(leaf, expected):
    assert _values.is_constant(leaf) is expected


@pytest.mark.parametrize(
    "leaf, dtype", [(np.arange(3, dtype=np.int64), "int64"), (np.float64(0.1), "float64")]
)
def test_a_64_bit_constant_without_x64_is_refused_naming_the_leaf(leaf, dtype):
    assert not jax.config.jax_enable_x64
    with (
        calling("save"),
        pytest.raises(
            InvalidStateError, match=rf"^save: leaf \['leaf'\] is a {dtype} constant.*enable x64"
        ),
    ):
        _values.to_payload(_spec(dtype, np.shape(leaf)), leaf)


def test_a_64_bit_constant_is_refused_also_while_tracing():
    spec = _spec("int64", (3,))

    def f(x):
        return _values.to_payload(spec, np.arange(3, dtype=np.int64)) + x

    with calling("maybe_save"), pytest.raises(InvalidStateError, match="^maybe_save: leaf"):
        jax.jit(f).trace(jnp.zeros(3, jnp.int32))


def test_a_32_bit_constant_crosses_as_an_owned_copy():
    leaf = np.arange(3, dtype=np.float32)
    out = _values.to_payload(_spec("float32", (3,)), leaf)
    leaf[0] = 42  # the caller's later change does not reach what crosses
    assert isinstance(out, jax.Array) and out.dtype == jnp.float32
    np.testing.assert_array_equal(out, [0, 1, 2])


def test_a_python_scalar_takes_the_specs_dtype():
    out = _values.to_payload(_spec("int32", kind=SCALAR, pytype="int"), 7)
    assert out.dtype == jnp.int32 and int(out) == 7


def test_keys_cross_as_their_key_data():
    key = jax.random.key(3)
    spec = _spec("uint32", kind=KEY, impl="threefry2x32")
    np.testing.assert_array_equal(_values.to_payload(spec, key), jax.random.key_data(key))
    np.testing.assert_array_equal(_values.eager_value(spec, key), jax.random.key_data(key))


def test_a_jax_array_crosses_as_is():
    x = jnp.arange(4, dtype=jnp.bfloat16)
    out = _values.to_payload(_spec("bfloat16", (4,)), x)
    assert out.dtype == jnp.bfloat16
    np.testing.assert_array_equal(out, x)


def test_eager_values_keep_the_exact_dtype_even_64_bit():
    value = _values.eager_value(_spec("int64", (2,)), np.array([2**40, -1], np.int64))
    assert value.dtype == np.int64 and value[0] == 2**40
    assert _values.eager_value(_spec("float64", kind=SCALAR, pytype="float"), 0.1) == 0.1
    x = jnp.ones(2)
    assert _values.eager_value(_spec("float32", (2,)), x) is x


def test_empty_data_has_the_shape_and_a_keys_trailing_axis():
    assert _values.empty_data(_spec("float32", (0, 3)), (0, 3)).shape == (0, 3)
    key = _spec("uint32", (0,), kind=KEY, impl="rbg")
    data = _values.empty_data(key, (2, 0))
    assert data.shape == (2, 0, 4) and data.dtype == np.uint32
