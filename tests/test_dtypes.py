"""`_base/_dtypes.py`: the dtype tables. `named` finds numpy's and ml_dtypes' types by
name and refuses others with TypeError; `packed` is true for the types XLA packs;
`storable` then `from_storage` gives back the same bits for every type (widened exactly,
or stored as bits for float8_e4m3's NaN payloads); a stored dtype a type is not stored
as gives None."""

import ml_dtypes
import numpy as np
import pytest

from jax_cb_ckpt._base import _dtypes

ALL = [
    "bool",
    "int8",
    "uint32",
    "float16",
    "float32",
    "float64",
    "complex64",
    "bfloat16",
    "float8_e4m3fn",
    "float8_e5m2",
    "float8_e4m3",
    "float6_e2m3fn",
    "float6_e3m2fn",
    "float4_e2m1fn",
    "int2",
    "int4",
    "uint2",
    "uint4",
]


@pytest.mark.parametrize("name", ALL)
def test_named_finds_every_type_by_its_name(name):
    assert _dtypes.named(name).name == name


@pytest.mark.parametrize("name", ["float99", "bfloat99", "", "not a dtype"])
def test_named_refuses_an_unknown_name(name):
    with pytest.raises(TypeError):
        _dtypes.named(name)


@pytest.mark.parametrize("name", ALL)
def test_packed_is_the_types_xla_packs(name):
    expected = name in ("int2", "int4", "uint2", "uint4") or name.startswith("float4")
    assert _dtypes.packed(np.dtype(_dtypes.named(name))) is expected


def _values(dtype):
    """Every bit pattern the type has (all of them for one-byte types)."""
    if dtype.itemsize == 1:
        bits = np.arange(256, dtype=np.uint8)
        if dtype.name in ("int2", "uint2", "int4", "uint4") or dtype.name.startswith(
            ("float4", "float6")
        ):
            info = ml_dtypes.iinfo(dtype) if "int" in dtype.name else None
            if info is not None:
                return np.arange(info.min, info.max + 1).astype(dtype)
            width = 4 if dtype.name.startswith("float4") else 6
            bits = np.arange(2**width, dtype=np.uint8)
        return bits.view(dtype)
    return np.linspace(-3, 3, 13).astype(dtype) if dtype.kind != "b" else np.array([1, 0], bool)


@pytest.mark.parametrize("name", ALL)
def test_storable_then_from_storage_keeps_every_bit(name):
    dtype = _dtypes.named(name)
    values = _values(dtype)
    stored = _dtypes.storable(values)
    assert stored.dtype == _dtypes.storage_dtype(dtype)
    back = _dtypes.from_storage(stored, dtype)
    assert back is not None and back.dtype == dtype
    assert back.tobytes() == values.tobytes()


def test_the_types_tensorstore_cannot_store_are_widened_or_stored_as_bits():
    assert _dtypes.storage_dtype(np.dtype(ml_dtypes.uint4)) == np.uint8
    assert _dtypes.storage_dtype(np.dtype(ml_dtypes.float6_e2m3fn)) == np.float32
    assert _dtypes.storage_dtype(np.dtype(ml_dtypes.float8_e4m3)) == np.uint8
    assert _dtypes.storage_dtype(np.dtype(np.float32)) == np.float32


def test_float8_e4m3_nan_payloads_survive():
    bits = np.array([0x7F, 0xFF, 0x79, 0x01], np.uint8)
    values = bits.view(ml_dtypes.float8_e4m3)
    stored = _dtypes.storable(values)
    back = _dtypes.from_storage(stored, values.dtype)
    np.testing.assert_array_equal(back.view(np.uint8), bits)


def test_a_non_contiguous_bits_array_is_stored_contiguously():
    values = np.arange(8, dtype=np.uint8).view(ml_dtypes.float8_e4m3)[::2]
    stored = _dtypes.storable(values)
    assert stored.dtype == np.uint8
    np.testing.assert_array_equal(stored, [0, 2, 4, 6])


def test_the_legacy_widening_of_float8_e4m3_is_still_read():
    values = np.array([0.5, -2.0, 0.0], ml_dtypes.float8_e4m3)
    back = _dtypes.from_storage(values.astype(np.float32), values.dtype)
    assert back is not None and back.tobytes() == values.tobytes()


@pytest.mark.parametrize(
    "stored, name", [("float64", "float32"), ("int32", "int8"), ("float32", "bfloat16")]
)
def test_from_storage_refuses_a_dtype_the_type_is_not_stored_as(stored, name):
    assert _dtypes.from_storage(np.zeros(2, stored), _dtypes.named(name)) is None


@pytest.mark.parametrize("name", [None, {"names": ["a"], "formats": ["<f4"]}])
def test_named_refuses_what_is_not_a_name(name):
    with pytest.raises(TypeError):
        _dtypes.named(name)
