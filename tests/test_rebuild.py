"""`_read/_rebuild.py`: `compatible` says whether a saved leaf restores into a `like`
leaf (kind, shape, dtype, key implementation, a Python number's kind, a weakly typed
carry); `check_like` raises `StructureMismatchError` naming the first leaf that differs,
is missing, or is extra; `rebuild` gives each leaf `like`'s type, dtype and weak type
(a number that does not fit is refused); `same_bits` compares bits by leaf path (NaNs
equal themselves, -0.0 is not 0.0, keys by implementation and data)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_cb_ckpt import StructureMismatchError
from jax_cb_ckpt._base._errors import calling
from jax_cb_ckpt._layout._spec import ARRAY, KEY, SCALAR, LeafSpec
from jax_cb_ckpt._read import _rebuild


@pytest.fixture(autouse=True)
def _restore():
    """Messages name the public call under way (`calling`), as `restore` sets it."""
    with calling("restore"):
        yield


def _array(name, dtype="float32", shape=(2,), weak=False):
    return LeafSpec(f"['{name}']", (name,), ARRAY, dtype, shape, weak=weak)


def _key(name, impl="threefry2x32", shape=()):
    return LeafSpec(f"['{name}']", (name,), KEY, "uint32", shape, impl=impl)


def _scalar(name, pytype, dtype):
    return LeafSpec(f"['{name}']", (name,), SCALAR, dtype, (), pytype=pytype)


@pytest.mark.parametrize(
    "like, saved, expected",
    [
        (_array("a"), _array("a"), True),
        (_array("a"), _array("a", "bfloat16"), False),
        (_array("a"), _array("a", shape=(3,)), False),
        (_array("a", "int32", ()), _scalar("a", "int", "int64"), True),  # eager Python int
        (_array("a", "float32", ()), _scalar("a", "int", "int64"), False),
        (_scalar("a", "float", "float64"), _array("a", "bfloat16", ()), True),
        (_scalar("a", "int", "int64"), _array("a", "uint8", ()), True),
        (_scalar("a", "int", "int64"), _array("a", "float32", ()), False),
        (_scalar("a", "float", "float64"), _array("a", "float32", (1,)), False),
        (_key("k"), _key("k"), True),
        (_key("k"), _key("k", "rbg"), False),
        (LeafSpec("k", ("k",), KEY, "uint32", (), impl=None), _key("k", "rbg"), True),
        (_key("k"), _array("k", "uint32", ()), False),
        (_array("a", "float32", weak=True), _array("a", "bfloat16"), True),  # carried
        (_array("a", "int32", weak=True), _array("a", "float32"), True),  # 0 + float
        (_array("a", "float32", weak=True), _array("a", "int32"), False),  # 0.0 + int: float
        (_array("a", "float32", weak=False), _array("a", "bfloat16"), False),
    ],
)
def test_compatible(like, saved, expected):
    assert _rebuild.compatible(like, saved) is expected


def test_check_like_names_the_leaf_that_differs():
    with pytest.raises(
        StructureMismatchError,
        match=r"^restore: leaf \['b'\] differs: the checkpoint has float32\[3\], like has "
        r"float32\[2\]\. Fix: pass a `like`",
    ):
        _rebuild.check_like((_array("a"), _array("b")), (_array("a"), _array("b", shape=(3,))))


def test_check_like_names_a_leaf_the_checkpoint_lacks_and_its_keys():
    with pytest.raises(
        StructureMismatchError,
        match=r"leaf \['c'\] \(float32\[2\]\) is not in the checkpoint, which has 2 leaves "
        r"under the top-level keys \['a', 'b'\]",
    ):
        _rebuild.check_like((_array("c"),), (_array("a"), _array("b")))


def test_check_like_names_a_leaf_like_lacks():
    with pytest.raises(
        StructureMismatchError, match=r"the checkpoint has leaf \['b'\] \(key<rbg>\[\]\), which"
    ):
        _rebuild.check_like((_array("a"),), (_array("a"), _key("b", "rbg")))
    _rebuild.check_like((_array("a"),), (_array("a"),))


def test_rebuild_keeps_the_like_leafs_type_and_dtype():
    spec = _array("a", "float32", (2,))
    data = np.array([1.5, 2.5], np.float32)
    out = _rebuild.rebuild(jnp.zeros(2), spec, spec, data.copy())
    assert isinstance(out, jax.Array) and out.dtype == jnp.float32 and not out.weak_type
    np.testing.assert_array_equal(out, data)
    out = _rebuild.rebuild(np.zeros(2, np.float32), spec, spec, data)
    assert type(out) is np.ndarray
    scalar = _scalar("n", "int", "int64")
    assert _rebuild.rebuild(3, scalar, scalar, np.asarray(7, np.int64)) == 7
    assert type(_rebuild.rebuild(3, scalar, scalar, np.asarray(7, np.int64))) is int


def test_rebuild_keeps_weak_types():
    like = jnp.asarray(1.0)  # from a Python number: weakly typed
    assert like.weak_type
    spec = _array("a", "float32", (), weak=True)
    out = _rebuild.rebuild(like, spec, spec, np.asarray(2.0, np.float32))
    assert out.weak_type and float(out) == 2.0
    # Carried by a loop as bfloat16: restored as stored, strongly typed.
    saved = _array("a", "bfloat16", ())
    out = _rebuild.rebuild(like, spec, saved, np.asarray(2.0, jnp.bfloat16))
    assert out.dtype == jnp.bfloat16 and not out.weak_type


def test_rebuild_refuses_a_python_number_that_does_not_fit():
    spec, saved = _array("a", "int8", ()), _scalar("a", "int", "int64")
    with pytest.raises(
        StructureMismatchError, match=r"leaf \['a'\]: the checkpoint has the Python number 300"
    ):
        _rebuild.rebuild(jnp.int8(0), spec, saved, np.asarray(300, np.int64))
    out = _rebuild.rebuild(jnp.int8(0), spec, saved, np.asarray(100, np.int64))
    assert out.dtype == jnp.int8 and int(out) == 100


def test_a_python_float_too_large_for_float32_is_refused_without_numpy_s_warning(tmp_path):
    """A Python 1e300 restored into a float32 leaf: our clear error only. Before, the
    cast that finds it does not fit also leaked numpy's "overflow encountered in cast"
    RuntimeWarning (an error under -W error, or a stray line in the user's log)."""
    import warnings

    import jax_cb_ckpt

    with jax_cb_ckpt.Checkpointer(tmp_path / "ckpt") as ckpt:
        ckpt.save({"a": 1e300, "b": -1e300}, 1)
    like = {"a": np.float32(0), "b": np.zeros((), np.float32)}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any warning, ours or numpy's, fails the test
        with pytest.raises(StructureMismatchError, match=r"Python number 1e\+300, which"):
            jax_cb_ckpt.restore(tmp_path / "ckpt", like)
        spec, saved = _array("b", "float32", ()), _scalar("b", "float", "float64")
        with pytest.raises(StructureMismatchError, match=r"Python number -1e\+300"):
            _rebuild.rebuild(jnp.float32(0), spec, saved, np.asarray(-1e300))


def test_rebuild_wraps_key_data_as_the_saved_implementation():
    key = jax.random.key(1, impl="rbg")
    spec = _key("k", "rbg")
    out = _rebuild.rebuild(key, spec, spec, np.asarray(jax.random.key_data(key)))
    assert str(jax.random.key_impl(out)) == str(jax.random.key_impl(key))
    assert _rebuild.same_bits(out, key)


def test_same_bits_nan_equality_and_signed_zero():
    nan = {"x": jnp.array([jnp.nan, 1.0])}
    assert _rebuild.same_bits(nan, {"x": jnp.array([jnp.nan, 1.0])})
    assert not _rebuild.same_bits({"x": jnp.array(0.0)}, {"x": jnp.array(-0.0)})
    assert not _rebuild.same_bits({"x": jnp.zeros(2)}, {"x": jnp.zeros(2, jnp.bfloat16)})
    assert not _rebuild.same_bits({"x": jnp.zeros(2)}, {"x": jnp.zeros((1, 2))})
    assert not _rebuild.same_bits({"x": jnp.zeros(2)}, {"y": jnp.zeros(2)})


def test_same_bits_compares_keys_by_implementation_and_data():
    a = jax.random.key(0)
    assert _rebuild.same_bits({"k": a}, {"k": jax.random.key(0)})
    assert not _rebuild.same_bits({"k": a}, {"k": jax.random.key(1)})
    rbg = jax.random.wrap_key_data(jnp.zeros(4, jnp.uint32), impl="rbg")
    unsafe = jax.random.wrap_key_data(jnp.zeros(4, jnp.uint32), impl="unsafe_rbg")
    assert not _rebuild.same_bits({"k": rbg}, {"k": unsafe})
    assert not _rebuild.same_bits({"k": a}, {"k": jax.random.key_data(a)})


def test_same_bits_ignores_the_treedefs_static_parts():
    import equinox as eqx

    class State(eqx.Module):
        w: jax.Array
        fn: object = eqx.field(static=True)

    assert _rebuild.same_bits(State(jnp.ones(2), lambda: 1), State(jnp.ones(2), lambda: 2))


def test_a_saved_python_nan_restores_into_a_float32_scalar():
    spec, saved = _array("a", "float32", ()), _scalar("a", "float", "float64")
    out = _rebuild.rebuild(jnp.float32(0), spec, saved, np.asarray(np.nan))
    assert out.dtype == jnp.float32 and bool(jnp.isnan(out))
