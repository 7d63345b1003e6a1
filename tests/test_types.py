"""`_base/_types.py`: the option value sets are closed `Literal`s, `Options` is a frozen
dataclass whose `slots` is `queue_size` plus one for on_full="newest", and a Checkpointer
is a `Saver` (every member the loops use exists on it)."""

import dataclasses
import typing

import pytest

import jax_cb_ckpt
from jax_cb_ckpt._base import _types


def _options(**changes):
    base = dict(
        directory="/tmp/x",
        every=None,
        max_to_keep=None,
        queue_size=2,
        on_full="block",
        compression=False,
        on_error="raise",
        on_existing="raise",
        crossing="auto",
        peer_timeout=60.0,
    )
    return _types.Options(**{**base, **changes})


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


@pytest.mark.parametrize("queue_size", [1, 3])
def test_slots_add_one_for_newest_only(queue_size):
    for on_full in ("block", "skip"):
        assert _options(queue_size=queue_size, on_full=on_full).slots == queue_size
    assert _options(queue_size=queue_size, on_full="newest").slots == queue_size + 1


def test_options_are_frozen_with_plain_defaults():
    options = _options()
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.queue_size = 5  # type: ignore[misc]
    assert options.every_seconds is None
    assert options.check_every == 100
    assert options.initial_save is False
    assert options.on_damaged == "fall_back"
    assert options.rules is None
    assert dataclasses.replace(options, queue_size=4).slots == 4


def test_a_checkpointer_has_every_member_of_saver():
    members = {
        name
        for name in vars(_types.Saver)
        if not name.startswith("_") and name not in ("_is_protocol",)
    }
    assert {"save_due", "restore", "save", "maybe_save", "wait", "stats"} <= members
    for name in members:
        assert hasattr(jax_cb_ckpt.Checkpointer, name), name
