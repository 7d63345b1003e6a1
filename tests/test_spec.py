"""`_layout/_spec.py`: `LeafSpec` goes to JSON and back unchanged, and `from_json` refuses a
damaged field saying which; `Signature` assembles crossed leaves with its constants and
reads stored shapes off the arrays; `stored_leaves` orders leaves as Orbax's nested dict
(a group's leaves together, groups by first appearance), leaves out zero-size arrays,
stores each leaf's storable form, and gives an empty item a placeholder."""

import json

import ml_dtypes
import numpy as np
import pytest

from jax_cb_ckpt._layout._spec import (
    ARRAY,
    EMPTY_NAME,
    KEY,
    SCALAR,
    LeafSpec,
    Signature,
    key_data_shape,
    stored_leaves,
)

SPECS = [
    LeafSpec("['w']", ("w",), ARRAY, "float32", (4, 8)),
    LeafSpec("['k']", ("k",), KEY, "uint32", (3,), impl="threefry2x32"),
    LeafSpec("['r']", ("a", "r"), KEY, "uint32", (), impl="rbg"),
    LeafSpec("['n']", ("n",), SCALAR, "int64", (), pytype="int"),
    LeafSpec("['h']", ("h",), ARRAY, "bfloat16", (0, 2)),
]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.path)
def test_json_round_trip(spec):
    text = json.dumps(spec.to_json())
    back = LeafSpec.from_json(json.loads(text))
    assert back == spec
    assert back.kind is spec.kind


def test_stored_shape_and_describe():
    w, k, r, n, _ = SPECS
    assert w.stored_shape == (4, 8) and w.describe() == "float32[4,8]"
    assert k.stored_shape == (3, 2) and k.describe() == "key<threefry2x32>[3]"
    assert r.stored_shape == (4,)
    assert n.describe() == "Python int (stored as int64)"
    assert key_data_shape("unsafe_rbg") == (4,)


def _damaged(**changes):
    data = SPECS[1].to_json()
    data.update(changes)
    return data


@pytest.mark.parametrize(
    "changes, error, match",
    [
        ({"name": []}, ValueError, "leaf name .* not a list of non-empty strings"),
        ({"name": ["a", ""]}, ValueError, "not a list of non-empty strings"),
        ({"name": "k"}, ValueError, "not a list of non-empty strings"),
        ({"kind": "tensor"}, ValueError, r"leaf kind 'tensor' is not one of \('array'"),
        ({"shape": [2, -1]}, ValueError, r"leaf shape \[2, -1\] is not a list of non-neg"),
        ({"shape": [True]}, ValueError, "not a list of non-negative ints"),
        ({"shape": [2.0]}, ValueError, "not a list of non-negative ints"),
        ({"dtype": "float99"}, TypeError, "float99"),
        ({"impl": None}, ValueError, "key leaf has no PRNG implementation name"),
        ({"kind": "scalar", "pytype": "str"}, ValueError, "scalar leaf has Python type 'str'"),
    ],
)
def test_from_json_refuses_a_damaged_field(changes, error, match):
    with pytest.raises(error, match=match):
        LeafSpec.from_json(_damaged(**changes))


def test_from_json_refuses_a_non_object():
    with pytest.raises(TypeError, match="a leaf description is a list, not an object"):
        LeafSpec.from_json([1, 2])  # type: ignore[arg-type]


def test_weak_is_not_stored_and_not_compared():
    weak = LeafSpec("x", ("x",), ARRAY, "float32", (), weak=True)
    assert "weak" not in weak.to_json()
    assert weak == LeafSpec("x", ("x",), ARRAY, "float32", ())


def test_signature_assembles_constants_among_crossed_leaves():
    specs = (
        LeafSpec("a", ("a",), ARRAY, "float32", (2,)),
        LeafSpec("c", ("c",), ARRAY, "int64", (3,)),
        LeafSpec("m", ("m",), ARRAY, "float32", ()),
    )
    constant = np.arange(3, dtype=np.int64)
    sig = Signature(specs, (1, 1, 0), constants=((1, constant),), metrics=("m",))
    assert sig.state_leaves == 2
    a, m = np.zeros(2, np.float32), np.float32(1)
    assert [x is y for x, y in zip(sig.assemble([a, m], ()), [a, constant, m], strict=True)] == [
        True
    ] * 3
    batched = sig.assemble([np.zeros((5, 2), np.float32), np.zeros(5, np.float32)], (5,))
    assert batched[1].shape == (5, 3)
    np.testing.assert_array_equal(batched[1][4], constant)


def test_signature_reads_stored_shapes_off_the_arrays():
    specs = (
        LeafSpec("k", ("k",), KEY, "uint32", (3,), impl="threefry2x32"),
        LeafSpec("n", ("n",), SCALAR, "float32", (), pytype="float"),
        LeafSpec("a", ("a",), ARRAY, "float32", (2,)),
    )
    sig = Signature(specs, (2, 0, 1))
    same = sig.stored([np.zeros((3, 2), np.uint32), np.float32(0), np.zeros(2, np.float32)])
    assert same == specs
    batched = sig.stored(
        [np.zeros((5, 3, 2), np.uint32), np.zeros(5, np.float32), np.zeros((5, 2), np.float32)]
    )
    assert [s.shape for s in batched] == [(5, 3), (5,), (5, 2)]
    assert batched[1].kind is ARRAY  # a Python number broadcast over a batch is an array
    assert batched[0].kind is KEY


def _spec(name, dtype="float32", shape=(1,)):
    return LeafSpec(str(name), name, ARRAY, dtype, shape)


def test_stored_leaves_keep_a_groups_leaves_together_in_first_appearance_order():
    names = [("b", "x"), ("a",), ("b", "y"), ("c", "p", "q"), ("a2",), ("c", "z")]
    specs = tuple(_spec(n) for n in names)
    arrays = [np.full(1, i, np.float32) for i in range(len(names))]
    out = stored_leaves(specs, arrays)
    assert [n for n, _ in out] == [
        ("b", "x"),
        ("b", "y"),
        ("a",),
        ("c", "p", "q"),
        ("c", "z"),
        ("a2",),
    ]
    assert [int(a[0]) for _, a in out] == [0, 2, 1, 3, 5, 4]


def test_stored_leaves_leave_out_zero_size_and_store_the_storable_form():
    specs = (_spec(("e",), shape=(0,)), _spec(("u",), "uint4", (2,)))
    out = stored_leaves(specs, [np.zeros(0, np.float32), np.array([1, 15], ml_dtypes.uint4)])
    assert [n for n, _ in out] == [("u",)]
    assert out[0][1].dtype == np.uint8
    np.testing.assert_array_equal(out[0][1], [1, 15])


def test_an_item_with_nothing_stored_gets_the_placeholder():
    assert stored_leaves((), []) == [((EMPTY_NAME,), np.zeros((), np.int8))]
    out = stored_leaves((_spec(("e",), shape=(0, 3)),), [np.zeros((0, 3), np.float32)])
    assert [n for n, _ in out] == [(EMPTY_NAME,)]
    assert out[0][1].shape == () and out[0][1].dtype == np.int8


@pytest.mark.parametrize("dtype", ["object", "U3", "V8", "datetime64[s]"])
def test_from_json_refuses_a_dtype_no_save_writes(dtype):
    with pytest.raises((TypeError, ValueError)):
        LeafSpec.from_json(_damaged(kind="array", impl=None, dtype=dtype))
