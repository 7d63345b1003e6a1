"""What travels through the exchange from the host side to the writer: a `SaveItem`
(one state taken into host memory, with the `Claim` the exchange admitted it by).

The host side (`_save/_host.py`) builds a `SaveItem` once the exchange admitted its step
and hands it over (`Exchange.hand_over`); the writer thread takes it off the queue
(`Exchange.next_item`), describes and writes it, and gives its claim back
(`Exchange.finished`). Plain data: nothing here runs or blocks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from .._layout._spec import Signature

if TYPE_CHECKING:
    from ._shards import ShardedArray


@dataclasses.dataclass(frozen=True)
class Claim:
    """A save admitted by the exchange (`admit`), holding a slot: its step, and the other
    run's steps it replaces. It travels with the save (`SaveItem.claim`) to the writer,
    which gives it back (`finished`); a save dropped before it is submitted gives it back
    by `unclaim_slot`."""

    step: int
    replace: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class SaveItem:
    """One state handed off by the callback, waiting to be written."""

    claim: Claim  # its step and slot, admitted by the exchange
    # What the step is made of, as the host side took it: the leaves' specs as traced,
    # every leaf in host memory (numpy arrays, or per-device blocks), the vmap batch's
    # mask. The writer describes the step from them (its leaves and meta) when it takes
    # the save: a save that a newer one supersedes (on_full="newest") never costs the
    # device that ~0.1 ms.
    signature: Signature
    hosts: list[np.ndarray | ShardedArray]
    members: np.ndarray
    saved_at: float  # time.time() of the hand-off
    nbytes: int
    blocking_s: float
    handoff_s: float
    release: Callable[[], None]  # give the host buffers back (staging pool)
    ready: Callable[[], None] | None = None  # wait until the host arrays hold the data
    # Under vmap with a batched step: each member's own step, where some differ.
    member_steps: np.ndarray | None = None
    # Under vmap in a ckpt.while_loop: the members that had left it, where some had.
    left: np.ndarray | None = None
    # The `extra` item's bytes (`_layout/_extra`), made when the save fired; None: none.
    extra: bytes | None = None

    @property
    def step(self) -> int:
        return self.claim.step

    @property
    def replace(self) -> tuple[int, ...]:
        """Another run's steps to delete first (on_existing="replace")."""
        return self.claim.replace
