"""The user's JSON beside the state: a save's `extra=`, stored as an Orbax JSON item.

A save given `extra=` (a JSON object, or a function of the step returning one) writes
`<step>/extra/metadata`: the bytes Orbax's `JsonCheckpointHandler` writes for
`Composite(extra=JsonSave(value))` (`json.dumps(value)`), named in Orbax's step file
(`item_handlers`), so `CheckpointManager(directory).restore(step,
args=Composite(extra=JsonRestore()))` returns it. Its size and CRC-32 go into our
record in that step file (`_format.meta_files`), as the `meta` item's do: a cut or
edited item is found damaged, never returned. A step saved without `extra=` has
neither the item nor the record's fields: its bytes are those of before.

Only what JSON spells one way is accepted, so that what is read back equals what was
given: objects with string keys, lists (a tuple is stored as a list), strings, finite
numbers, booleans and None; at most `EXTRA_MAX_BYTES` encoded, `MAX_DEPTH` levels.
"""

from __future__ import annotations

import dataclasses
import json
import math
import zlib
from collections.abc import Callable
from typing import Any

from .._base._errors import ConfigError
from ._format import (
    EXTRA_ITEM,
    EXTRA_MAX_BYTES,
    META_FILE,
    ORBAX_STEP_FILE,
    SMALL_FILE_MAX_BYTES,
    DamagedStep,
    load_json,
    record_of,
)

MAX_DEPTH = 64  # nesting levels of a value (a reader's parser recurses per level)
FILE = f"{EXTRA_ITEM}/{META_FILE}"  # the item's one file, inside the step
# Python's json writes and reads an int of at most this many digits (the default of
# `sys.get_int_max_str_digits`; a reader's, whatever the writer's setting).
_INT_DIGITS = 4300
_INT_BOUND = 10**_INT_DIGITS
_FIX = (
    "Fix: pass a dict of JSON values (str, int, finite float, bool, None, lists and "
    "dicts with str keys), e.g. extra={'config': vars(args), 'data_position': 1200}; "
    "convert numpy values with .item() or .tolist()"
)


@dataclasses.dataclass(frozen=True)
class Extra:
    """A save's `extra=`: its bytes (a dict, encoded at the call), or a function of the
    step, called on the host when the save fires (`bytes_at`). Hashable (a loop's
    cache key): bytes, or the function itself."""

    data: bytes | None = None
    fn: Callable[[int], Any] | None = None

    def __call__(self, step: int) -> Any:
        """The value of the save of `step` (a function of the step, as `extra=` takes
        one: a loop passes its checked `Extra` on to its saves as it is)."""
        if self.fn is not None:
            return self.fn(step)
        assert self.data is not None
        return json.loads(self.data)

    def bytes_at(self, step: int) -> bytes:
        """The item's bytes for the save of `step`: the function's result checked
        (`ConfigError` naming `extra`, the step and what is wrong)."""
        if self.fn is None:
            assert self.data is not None
            return self.data
        name = getattr(self.fn, "__qualname__", type(self.fn).__name__)
        try:
            value = self.fn(step)
        except Exception as e:
            raise ConfigError(
                f"extra={name}: calling it with step {step} raised {type(e).__name__}: "
                f"{e}. The step was not saved; earlier checkpoints are untouched. Fix: make "
                "extra= a function of the step (an int) that returns a dict of JSON values."
            ) from e
        return encode(value, f"extra={name} (its result at step {step})")


def of(extra: object, call: str) -> Extra | None:
    """A save's `extra=` argument checked (`call`: the public call, for messages): None,
    a function (called at each save), or a dict encoded now."""
    if extra is None or isinstance(extra, Extra):  # (a loop's, checked at its start)
        return extra
    if callable(extra):
        return Extra(fn=extra)
    return Extra(data=encode(extra, f"{call}(extra=...)"))


def encode(value: object, what: str) -> bytes:
    """`value`'s bytes as Orbax's JsonSave writes them, once it is a JSON object within
    the bounds; else `ConfigError` naming `what`, the first offending key path and its
    type, and the fix."""
    if not isinstance(value, dict):
        raise ConfigError(
            f"{what}: extra must be a dict (a JSON object) or a function of the step "
            f"returning one; got {type(value).__name__}. {_FIX}."
        )
    _check(value, "extra", 0, what)
    data = json.dumps(value, allow_nan=False).encode()
    if len(data) > EXTRA_MAX_BYTES:
        raise ConfigError(
            f"{what}: extra is {len(data)} bytes as JSON, more than the "
            f"{EXTRA_MAX_BYTES} bytes (1 MiB) a step's extra may hold. Fix: keep large "
            "data in the state (arrays) or in files of your own, and record their name "
            "in extra."
        )
    return data


def _check(value: object, path: str, depth: int, what: str) -> None:
    """Every value under `value` is one JSON spells one way (depth first, in order)."""
    if depth > MAX_DEPTH:
        raise ConfigError(f"{what}: {path} is nested deeper than {MAX_DEPTH} levels. {_FIX}.")
    if value is None or isinstance(value, (str, bool)):
        return
    if type(value) is int:
        if not -_INT_BOUND < value < _INT_BOUND:
            raise ConfigError(
                f"{what}: {path} is an int of more than {_INT_DIGITS} digits, which "
                "Python's json refuses to write or read back. Fix: store it as a string "
                "(str(x), after sys.set_int_max_str_digits) or in the state."
            )
        return
    if type(value) is float:
        if not math.isfinite(value):
            raise ConfigError(
                f"{what}: {path} is {value!r}, which JSON cannot hold. Fix: store it as a "
                "string (str(x)) or None."
            )
        return
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise ConfigError(
                    f"{what}: {path} has the key {key!r} of type {type(key).__name__}; "
                    f"JSON keys are strings (json would turn it into {str(key)!r}). {_FIX}."
                )
            _check(item, f"{path}[{key!r}]", depth + 1, what)
        return
    if isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            _check(item, f"{path}[{index}]", depth + 1, what)
        return
    traced = "Tracer" in type(value).__name__
    why = " (a traced value: extra is host data; record it as metrics= or in the state)"
    raise ConfigError(
        f"{what}: {path} is of type {type(value).__module__}.{type(value).__qualname__}"
        f"{why if traced else ''}, which is not a JSON value. {_FIX}."
    )


def check_bytes(data: bytes | None, record: dict[str, Any] | None) -> dict[str, Any] | None:
    """A step's `extra` item read back (hostile: `data` was read within
    `EXTRA_MAX_BYTES`), checked against our `record` of it (the step file's) before it is
    parsed: None when the record names none; `DamagedStep` when it is missing, cut,
    changed, or not a JSON object."""
    if record is None or "extra_bytes" not in record:
        return None  # (a file the record does not name is not the step's)
    size, crc = record.get("extra_bytes"), record.get("extra_crc32")
    if type(size) is not int or not 0 < size <= EXTRA_MAX_BYTES or type(crc) is not int:
        raise DamagedStep(f"the step file's record of '{FILE}' is not a size and a CRC-32")
    if data is None:
        raise DamagedStep(f"'{FILE}' is missing (the step file records {size} bytes)")
    if len(data) != size:
        raise DamagedStep(f"'{FILE}' holds {len(data)} bytes where {size} were written")
    if zlib.crc32(data) != crc:
        raise DamagedStep(f"'{FILE}' does not match the CRC-32 recorded when it was written")
    value = load_json(data, f"'{FILE}'")
    if not isinstance(value, dict):
        raise DamagedStep(f"'{FILE}' holds a JSON {type(value).__name__}, not an object")
    return value


def read(file: Callable[[str, int], bytes | None]) -> dict[str, Any] | None:
    """A step's `extra` item, or None when it has none: `file(name, limit)` reads a file
    of the step within `limit` bytes (None: absent; `Storage.step_file`). Our record in
    Orbax's step file first, then the item checked against it (`check_bytes`):
    `DamagedStep` saying what is wrong."""
    text = file(ORBAX_STEP_FILE, SMALL_FILE_MAX_BYTES)
    record = None if text is None else record_of(text)
    if record is None or "extra_bytes" not in record:
        return None
    return check_bytes(file(FILE, EXTRA_MAX_BYTES), record)
