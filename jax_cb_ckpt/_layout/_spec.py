"""How one leaf of a state is stored: `LeafSpec`, the description that travels with
every checkpoint as JSON (never pickle); and `Signature`, a traced state's specs fixed
at trace time (built by `_route`, read by the host side when the arrays arrive).

Below `_describe.py` (which builds specs from a state, with JAX) and imported by everything
that reads a checkpoint: it needs numpy only, so the reader and the command line
start without importing JAX.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
from collections.abc import Sequence
from typing import Any, Protocol, TypeVar, cast

import numpy as np

from .._base import _dtypes

# The key data of JAX's built-in PRNG implementations (jax.random.key_data's trailing
# shape), known without importing JAX; a user-registered implementation asks JAX.
_KEY_DATA = {"threefry2x32": (2,), "rbg": (4,), "unsafe_rbg": (4,)}


class HostLeaf(Protocol):
    """A leaf in host memory as the specs read it: a numpy array, or a leaf saved per
    device as its blocks (`_handoff/_shards.ShardedArray`, a stage above this one: it
    is described here, never imported)."""

    @property
    def shape(self) -> tuple[int, ...]: ...
    @property
    def ndim(self) -> int: ...
    @property
    def size(self) -> int: ...


Host = TypeVar("Host", bound=HostLeaf)  # the kind of host leaves a caller passes


class Kind(enum.StrEnum):
    """How a leaf is stored (the value is what the JSON metadata holds)."""

    ARRAY = "array"  # a jax/numpy array leaf, stored as is
    KEY = "key"  # a typed PRNG key array, stored as its raw uint32 key data
    SCALAR = "scalar"  # a Python bool/int/float/complex, stored as a 0-d array


ARRAY, KEY, SCALAR = Kind.ARRAY, Kind.KEY, Kind.SCALAR


@dataclasses.dataclass(frozen=True)
class LeafSpec:
    """How one leaf of a state is stored.

    `shape` is the leaf's own shape (for keys, the shape of the key array, without the
    trailing key-data axis); `dtype` is the stored numpy dtype (uint32 for keys).
    """

    path: str  # jax.tree_util.keystr of the leaf, for messages
    name: tuple[str, ...]  # position in the nested dict that Orbax stores
    kind: Kind
    dtype: str
    shape: tuple[int, ...]
    impl: str | None = None  # PRNG implementation of a typed key
    pytype: str | None = None  # Python type of a scalar leaf
    # A `like` leaf that is weakly typed (from a Python number: JAX gives it the dtype
    # of what it meets, as a loop's carry does). Not stored: a property of `like` only.
    weak: bool = dataclasses.field(default=False, compare=False)

    @property
    def stored_shape(self) -> tuple[int, ...]:
        """The shape of the array stored for this leaf: a key's has the key-data axis."""
        return self.shape + (key_data_shape(self.impl) if self.kind == KEY else ())

    def describe(self) -> str:
        """Human-readable value description, e.g. `float32[4,8]` or `key<threefry2x32>[]`."""
        dims = ",".join(str(d) for d in self.shape)
        if self.kind == KEY:
            return f"key<{self.impl}>[{dims}]"
        if self.kind == SCALAR:
            return f"Python {self.pytype} (stored as {self.dtype})"
        return f"{self.dtype}[{dims}]"

    def to_json(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "name": list(self.name),
            "kind": self.kind.value,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "impl": self.impl,
            "pytype": self.pytype,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> LeafSpec:
        """Parse one leaf description; `ValueError`/`TypeError` saying what is wrong."""
        if not isinstance(data, dict):
            raise TypeError(f"a leaf description is a {type(data).__name__}, not an object")
        name = data["name"]
        if (
            not isinstance(name, list)
            or not name
            or not all(isinstance(n, str) and n for n in name)
        ):
            raise ValueError(f"leaf name {name!r} is not a list of non-empty strings")
        try:
            kind = Kind(data["kind"])
        except ValueError:
            allowed = tuple(k.value for k in Kind)
            raise ValueError(f"leaf kind {data['kind']!r} is not one of {allowed}") from None
        shape = data["shape"]
        if not isinstance(shape, list) or not all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
        ):
            raise ValueError(f"leaf shape {shape!r} is not a list of non-negative ints")
        dtype = _dtypes.named(str(data["dtype"]))  # TypeError for an unknown dtype
        if not (dtype.kind in "biufc" or dtype.name.startswith(_dtypes.ML_DTYPES)):
            # (numpy also names objects, strings, raw bytes and dates: no save writes them)
            raise ValueError(f"leaf dtype {data['dtype']!r} is not a number type")
        impl = data.get("impl")
        if kind == KEY and not isinstance(impl, str):
            raise ValueError(f"key leaf has no PRNG implementation name (impl={impl!r})")
        if kind == KEY:
            key_data_shape(impl)  # ValueError for an unknown implementation
        pytype = data.get("pytype")
        if kind == SCALAR and pytype not in ("bool", "int", "float", "complex"):
            raise ValueError(f"scalar leaf has Python type {pytype!r}")
        return cls(
            path=str(data["path"]),
            name=tuple(name),
            kind=kind,
            dtype=dtype.name,
            shape=tuple(shape),
            impl=impl,
            pytype=pytype,
        )


@functools.lru_cache(maxsize=64)
def key_data_shape(impl: str | None) -> tuple[int, ...]:
    """The trailing shape of one key's data for a PRNG implementation."""
    if impl in _KEY_DATA:
        return _KEY_DATA[impl]
    import jax  # an implementation registered by the user: only JAX knows it

    return tuple(jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0, impl=impl))).shape)


class ExtraItem(Protocol):
    """A save's `extra=` as the host side sees it (`_extra.Extra`): the item's bytes for
    the save of `step`."""

    def bytes_at(self, step: int) -> bytes: ...


@dataclasses.dataclass(frozen=True, eq=False)
class Signature:
    """What the callback needs to know about a traced state, fixed at trace time.

    `constants` are the leaves that were concrete while tracing (numpy arrays, numpy and
    Python scalars): they are the same at every call of the compiled program, so they
    are copied once, here, and never cross through JAX (which would canonicalize their
    dtypes: an int64 leaf would arrive as int32 with x64 off).

    Metrics cross as leaves of their own after the state's: no second transfer or
    callback, and under vmap each has the batch's shape, like the state.
    """

    specs: tuple[LeafSpec, ...]
    data_ndims: tuple[int, ...]  # ndim of each leaf's data (key data has extra axes)
    constants: tuple[tuple[int, np.ndarray], ...] = ()  # (leaf index, host copy)
    # The names of `metrics=` (`_describe.describe_metrics`): its leaves follow the state's
    # in `specs` and cross with them; the writer records them in the step's meta.
    metrics: tuple[str, ...] = ()
    # The save's `extra=` (`_extra.Extra`): JSON the writer stores beside the state; the
    # host side turns it into bytes when the save fires (`SaveItem.extra`). Never traced.
    extra: ExtraItem | None = None

    @property
    def state_leaves(self) -> int:
        """How many of the leaves are the state's (the rest are the metrics)."""
        return len(self.specs) - len(self.metrics)

    def assemble(
        self, crossed: Sequence[Host], batch_shape: tuple[int, ...]
    ) -> list[Host | np.ndarray]:
        """Every leaf's host array, in order: the arrays that crossed, and the constants
        broadcast to the batch shape (vmap and device gathers prepend axes)."""
        constant = dict(self.constants)
        it = iter(crossed)
        out: list[Host | np.ndarray] = []
        for index in range(len(self.specs)):
            value = constant.get(index)
            if value is None:
                out.append(next(it))
            elif batch_shape:
                out.append(np.broadcast_to(value, batch_shape + value.shape))
            else:
                out.append(value)
        return out

    def stored(self, hosts: Sequence[HostLeaf]) -> tuple[LeafSpec, ...]:
        """The specs of the arrays as they arrive: vmap and device gathers add or widen
        leading axes, so the stored shape is read off the array (minus key-data axes)."""
        specs = []
        for spec, ndim, host in zip(self.specs, self.data_ndims, hosts, strict=True):
            trailing = ndim - len(spec.shape)  # key-data axes of a typed key
            shape = tuple(host.shape[: host.ndim - trailing])
            if shape == spec.shape:
                specs.append(spec)
            elif spec.kind == SCALAR:  # a Python number broadcast over a batch
                specs.append(dataclasses.replace(spec, kind=ARRAY, shape=shape))
            else:
                specs.append(dataclasses.replace(spec, shape=shape))
        return tuple(specs)


def _is_numpy(leaf: object) -> bool:
    """A numpy array or scalar (what `_dtypes.storable` takes), not a `ShardedArray`."""
    return isinstance(leaf, (np.ndarray, np.generic))


EMPTY_NAME = "_jax_cb_ckpt_empty"  # Orbax refuses an empty item: a placeholder leaf


def stored_leaves(
    specs: tuple[LeafSpec, ...], arrays: Sequence[Host]
) -> list[tuple[tuple[str, ...], Host | np.ndarray]]:
    """(name, array) of each leaf Orbax stores, in the order of the nested dict
    {name[0]: {name[1]: ...}} that it writes (a group's leaves together, the groups in
    the order they first appear): the order of the state's `_METADATA` and data files.

    Zero-size arrays are left out (Orbax cannot store them; the spec records the shape,
    and restore rebuilds them), and an item left with nothing gets a placeholder.
    """
    out = [
        # Per-device leaves (ShardedArray) are made storable by the writer.
        (spec.name, _dtypes.storable(cast(np.ndarray, a)) if _is_numpy(a) else a)
        for spec, a in zip(specs, arrays, strict=True)
        if a.size != 0
    ]
    if not out:
        return [((EMPTY_NAME,), np.zeros((), np.int8))]
    first: dict[tuple[str, ...], int] = {}
    for index, (name, _) in enumerate(out):
        for depth in range(1, len(name) + 1):
            first.setdefault(name[:depth], index)
    return sorted(out, key=lambda leaf: [first[leaf[0][:d]] for d in range(1, len(leaf[0]) + 1)])
