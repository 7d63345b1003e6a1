"""Plain Orbax checkpoints: a `CheckpointManager`'s steps, found beside ours and read.

PLACEHOLDER: replaced below once the layouts are confirmed.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ._format import Examined
from ._storage import Storage


@dataclasses.dataclass(frozen=True)
class PlainStep:
    step: int
    item: str


def steps(storage: Storage, found: dict[int, Examined]) -> dict[int, PlainStep]:
    return {}


def restore(found: PlainStep, like: Any, where: str, *, member: Any = None) -> Any:
    raise NotImplementedError
