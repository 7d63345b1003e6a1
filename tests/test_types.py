"""`_base/_types.py`: the option value sets are closed `Literal`s, and a Checkpointer is a
`Saver` (every member the loops use exists on it). (The checked options and their
groups: tests/test_options.py.)"""

import typing

import pytest

import jax_cb_ckpt
from jax_cb_ckpt._base import _types


@pytest.mark.parametrize(
    "name, values",
    [
        ("OnFull", {"block", "skip", "newest"}),
        ("OnError", {"raise", "continue"}),
        ("OnExisting", {"raise", "replace"}),
        ("OnDamaged", {"fall_back", "raise"}),
        ("Crossing", {"auto", "buffer", "callback"}),
        ("Gather", {"stack", "concat", "replicated"}),
        ("BestMode", {"max", "min"}),
    ],
)
def test_each_option_is_a_closed_literal(name, values):
    kind = getattr(_types, name)
    assert typing.get_origin(kind) is typing.Literal
    assert set(typing.get_args(kind)) == values


def test_a_checkpointer_has_every_member_of_saver():
    members = {
        name
        for name in vars(_types.Saver)
        if not name.startswith("_") and name not in ("_is_protocol",)
    }
    assert {"save_due", "restore", "save", "maybe_save", "wait", "stats"} <= members
    for name in members:
        assert hasattr(jax_cb_ckpt.Checkpointer, name), name
