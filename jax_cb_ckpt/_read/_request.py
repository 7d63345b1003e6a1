"""What a restore asks for: `like` described once, for every reader of the restore.

A `Request` is made once per public read (`restore`, a restart's `resume`) and passed
to each reader it reaches: a step of ours (`_restore.read_step`), one member of a
vmap batch (`_restore._read_member`), a plain Orbax step (`_plain.restore`), and each
member a restart takes from an older step (`member`). `like` is described on first
use (`restore_or_init`'s default `like` is traced from the user's `init_fn` only when
there is a step to read), under the `calling` of the reader that first needs it, and
never again.

`partial` (`partial_restore=True`): `like` holds some of the checkpoint's leaves (the
parameters of a TrainState, say), found by their names; only those are read and
checked, and a leaf of `like` the checkpoint does not hold is still an error naming it.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from .._layout import _describe
from .._layout._spec import LeafSpec
from . import _rebuild


class Request:
    """`like` (made by `make` on first use) and whether it is `partial`."""

    def __init__(self, make: Callable[[], Any], *, partial: bool = False) -> None:
        self._make, self.partial = make, partial

    @classmethod
    def of(cls, like: Any, *, partial: bool = False) -> Request:
        """A request for `like` itself (not a function making it)."""
        return cls(lambda: like, partial=partial)

    @functools.cached_property
    def like(self) -> Any:
        return self._make()

    @functools.cached_property
    def _described(self) -> tuple[Any, tuple[LeafSpec, ...], list[Any]]:
        return _describe.describe_state(self.like, prefix="like", abstract_ok=True)

    @property
    def treedef(self) -> Any:
        return self._described[0]

    @property
    def specs(self) -> tuple[LeafSpec, ...]:
        """Each `like` leaf as its stored leaf would be described (name, kind, shape)."""
        return self._described[1]

    @property
    def leaves(self) -> list[Any]:
        return self._described[2]

    def check(self, saved: tuple[LeafSpec, ...]) -> None:
        """`StructureMismatchError` naming the first leaf where `like` and the leaves
        `saved` differ (with `partial`, a leaf of `saved` that `like` lacks is left out)."""
        _rebuild.check_like(self.specs, saved, partial=self.partial)

    def build(self, leaves: list[Any]) -> Any:
        """The restored tree: `leaves` (one per `like` leaf) in `like`'s structure."""
        return self.treedef.unflatten(leaves)

    def member(self, batched: set[tuple[str, ...]], index: tuple[int, ...], n: int) -> Request:
        """One member's request: the `batched` leaves (by name) without their `n` batch
        axes (a concrete leaf: its member `index`), described from this one's specs."""
        leaves, specs = [], []
        for spec, leaf in zip(self.specs, self.leaves, strict=True):
            if spec.name in batched:
                if isinstance(leaf, jax.ShapeDtypeStruct):
                    leaf = jax.ShapeDtypeStruct(leaf.shape[n:], leaf.dtype)
                else:
                    leaf = leaf[index]
                weak = bool(getattr(leaf, "weak_type", False))  # (as `_describe` has it)
                spec = dataclasses.replace(spec, shape=spec.shape[n:], weak=weak)
            leaves.append(leaf)
            specs.append(spec)
        one = Request(lambda: self.treedef.unflatten(leaves), partial=self.partial)
        one.__dict__["_described"] = (self.treedef, tuple(specs), leaves)
        return one

    def with_member(
        self, state: Any, batched: set[tuple[str, ...]], index: tuple[int, ...], one: Any
    ) -> Any:
        """`state` (restored from this request) with member `index` of its `batched`
        leaves replaced by the leaves of `one` (a member's state)."""
        out = []
        for spec, leaf, new in zip(
            self.specs, jax.tree.leaves(state), jax.tree.leaves(one), strict=True
        ):
            if spec.name not in batched:
                out.append(leaf)
            elif isinstance(leaf, np.ndarray):
                leaf = leaf.copy()
                leaf[index] = new
                out.append(leaf)
            else:
                out.append(leaf.at[index].set(new))
        return self.treedef.unflatten(out)
