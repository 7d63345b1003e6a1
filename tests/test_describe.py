"""Unit tests of how a state's leaves are described and stored (`_layout/_describe.py`,
`_layout/_spec.py`): each kind of
leaf's description survives the round trip through the metadata's JSON, and a damaged
description is refused saying what is wrong. Fast: no compile, no disk."""

import json

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jax_cb_ckpt._layout import _describe, _spec
from jax_cb_ckpt._layout._describe import describe_state
from jax_cb_ckpt._layout._spec import ARRAY, KEY, SCALAR, LeafSpec


def _state():
    return {
        "w": np.zeros((3, 4), np.float32),
        "h": jnp.zeros((2,), jnp.bfloat16),
        "q": np.zeros((5,), ml_dtypes.int4),
        "key": jax.random.key(0),
        "keys": jax.random.split(jax.random.key(1, impl="rbg"), 3),
        "n": 7,
        "lr": 0.5,
        "on": True,
        "z": 1j,
        "nested": [{"a": np.zeros((), np.int64)}],
    }


def test_every_kind_of_leaf_survives_the_json_round_trip():
    _, specs, _ = describe_state(_state())
    for spec in specs:
        back = LeafSpec.from_json(json.loads(json.dumps(spec.to_json())))
        assert back == spec, spec.path
    by_path = {s.path.removeprefix("state"): s for s in specs}
    assert len(by_path) == 10
    assert by_path["['key']"].kind == KEY and by_path["['key']"].stored_shape == (2,)
    assert by_path["['keys']"].impl == "rbg" and by_path["['keys']"].stored_shape == (3, 4)
    assert by_path["['n']"].kind == SCALAR and by_path["['n']"].pytype == "int"
    assert by_path["['q']"].dtype == "int4" and by_path["['h']"].dtype == "bfloat16"
    assert by_path["['nested'][0]['a']"].name == ("nested", "0", "a")


def _good():
    return LeafSpec.from_json(
        {"path": "['w']", "name": ["w"], "kind": "array", "dtype": "float32", "shape": [2]}
    ).to_json()


@pytest.mark.parametrize(
    "change, error, words",
    [
        ({"name": []}, ValueError, "leaf name [] is not a list of non-empty strings"),
        ({"name": ["a", ""]}, ValueError, "is not a list of non-empty strings"),
        ({"kind": "tensor"}, ValueError, "leaf kind 'tensor' is not one of"),
        ({"shape": [2, -1]}, ValueError, "leaf shape [2, -1] is not a list of non-negative"),
        ({"shape": [True]}, ValueError, "is not a list of non-negative ints"),
        ({"shape": "2"}, ValueError, "is not a list of non-negative ints"),
        ({"dtype": "float33"}, TypeError, "float33"),
        ({"kind": "key", "impl": None}, ValueError, "key leaf has no PRNG implementation"),
        ({"kind": "key", "impl": "nope"}, ValueError, "nope"),
        ({"kind": "scalar", "pytype": "str"}, ValueError, "scalar leaf has Python type 'str'"),
    ],
)
def test_a_damaged_description_is_refused_saying_what_is_wrong(change, error, words):
    data = dict(_good(), **change)
    with pytest.raises(error) as caught:
        LeafSpec.from_json(data)
    assert words in str(caught.value)


def test_a_description_that_is_not_an_object_or_lacks_a_field_is_refused():
    with pytest.raises(TypeError, match="a leaf description is a list, not an object"):
        LeafSpec.from_json([])  # type: ignore[arg-type]
    data = _good()
    del data["kind"]
    with pytest.raises(KeyError, match="kind"):
        LeafSpec.from_json(data)


def test_a_remembered_description_follows_every_change_of_a_leaf():
    """Descriptions are remembered per structure, leaf types, shapes and dtypes (an
    eager save of the same state skips the checks): each of those changes, and a Python
    number's value, gives a new description; a leaf that cannot be saved is refused
    every time, also after a saveable state of the same structure."""
    from jax_cb_ckpt._base._errors import InvalidStateError

    _, first, _ = describe_state(_state())
    _, again, _ = describe_state(_state())
    assert again == first
    changed = {
        "w": np.zeros((3, 5), np.float32),  # shape
        "h": jnp.zeros((2,), jnp.float16),  # dtype
        "keys": jax.random.split(jax.random.key(1), 3),  # key implementation
        "n": True,  # type: a bool, no longer an int
        "nested": [{"a": np.zeros((), np.int32)}],
    }
    for name, value in changed.items():
        state = dict(_state(), **{name: value})
        _, specs, _ = describe_state(state)
        before = {s.path: s for s in first}
        after = {s.path: s for s in specs}
        differ = [p for p in after if after[p] != before[p]]
        assert differ and all(name in p for p in differ), (name, differ)
    for bad, words in [
        (2**63, "does not fit in int64"),
        ("text", "is a str"),
    ]:
        for _ in range(2):
            with pytest.raises(InvalidStateError, match=words):
                describe_state(dict(_state(), n=bad))
    _, prefixed, _ = describe_state(_state(), prefix="like")
    assert all(s.path.startswith("like") for s in prefixed)


def test_a_remembered_description_is_never_lent_to_keys_that_only_compare_equal():
    """JAX's tree structure compares dict keys with ==: after {1: x} was described,
    {True: x}, {1.0: x} and a str Enum key equal to 'a' must still be refused as on
    their own (found by a review: they were accepted, under the name '1')."""
    import enum

    from jax_cb_ckpt._base._errors import InvalidStateError

    class Letter(str, enum.Enum):  # noqa: UP042 (a str mixin, as users write it)
        A = "a"

    x = np.zeros(2, np.float32)
    describe_state({1: x})
    describe_state({"a": x})
    for key, words in [
        (True, "dict key of type bool"),
        (1.0, "dict key of type float"),
        (np.int64(1), "dict key of type int64"),
        (Letter.A, "contain neither"),
    ]:
        with pytest.raises(InvalidStateError, match=words):
            describe_state({key: x})


def test_a_python_number_in_the_state_does_not_fill_the_memory_of_descriptions():
    """A step counter kept as a Python int changes at every save: it is remembered by
    its type and range, not its value."""

    x = np.zeros(2, np.float32)
    describe_state({"w": x, "n": 0})
    before = len(_describe._DESCRIBED)
    for n in range(1, 40):
        _, specs, _ = describe_state({"w": x, "n": n, "lr": n / 3})
        assert specs[1].pytype == "int" and specs[0].pytype == "float"
    assert len(_describe._DESCRIBED) <= before + 1


def _orbax_order(names):
    """The order Orbax writes a nested dict {name[0]: {name[1]: ...}} in: the dict built
    leaf by leaf, then walked (the writer did exactly this before `stored_leaves`)."""
    tree = {}
    for name in names:
        node = tree
        for part in name[:-1]:
            node = node.setdefault(part, {})
        node[name[-1]] = name

    def walk(node):
        for value in node.values():
            yield from walk(value) if isinstance(value, dict) else [value]

    return list(walk(tree))


def test_stored_leaves_come_in_the_order_of_orbax_s_nested_dict():
    """Leaves of one group that are not next to each other (a name's groups interleave)
    are stored together, the groups in the order they first appear, as Orbax's nested
    dict orders them; zero-size leaves are left out; nothing stored is a placeholder."""
    names = [("b", "x", "1"), ("a",), ("b", "y"), ("c", "z"), ("b", "x", "0"), ("c", "e")]
    specs = tuple(
        LeafSpec(name=n, path="/".join(n), kind=ARRAY, dtype="float32", shape=(2,)) for n in names
    )
    arrays = [np.full(2, i, np.float32) for i in range(len(names))]
    stored = _spec.stored_leaves(specs, arrays)
    assert [name for name, _ in stored] == _orbax_order(names)
    assert [name for name, _ in stored][:3] == [("b", "x", "1"), ("b", "x", "0"), ("b", "y")]
    for name, array in stored:
        assert np.array_equal(array, arrays[names.index(name)])
    zero = [np.zeros(0, np.float32)] * len(names)
    assert [n for n, _ in _spec.stored_leaves(specs, zero)] == [(_spec.EMPTY_NAME,)]
    some = arrays[:2] + zero[2:]
    assert [n for n, _ in _spec.stored_leaves(specs, some)] == names[:2]
