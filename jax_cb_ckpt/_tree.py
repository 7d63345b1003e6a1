"""Pytree bookkeeping: which leaves a state has, how they are stored, how they come back.

Everything here runs in Python while tracing (or eagerly), never inside a callback. A
state is described by one `LeafSpec` per leaf; the specs travel with each checkpoint as
JSON (never pickle), so restore can check a `like` leaf by leaf and re-wrap typed PRNG
keys, whose key type numpy cannot represent.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ._errors import InvalidStateError, StructureMismatchError

ARRAY = "array"  # a jax/numpy array leaf, stored as is
KEY = "key"  # a typed PRNG key array, stored as its raw uint32 key data
SCALAR = "scalar"  # a Python bool/int/float/complex, stored as a 0-d array

_PY_SCALARS = (bool, int, float, complex)
_ROOT_NAME = "value"  # name of the single leaf when the state itself is an array


@dataclasses.dataclass(frozen=True)
class LeafSpec:
    """How one leaf of a state is stored.

    `shape` is the leaf's own shape (for keys, the shape of the key array, without the
    trailing key-data axis); `dtype` is the stored numpy dtype (uint32 for keys).
    """

    path: str  # jax.tree_util.keystr of the leaf, for messages
    name: tuple[str, ...]  # position in the nested dict that Orbax stores
    kind: str
    dtype: str
    shape: tuple[int, ...]
    impl: str | None = None  # PRNG implementation of a typed key
    pytype: str | None = None  # Python type of a scalar leaf

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
            "kind": self.kind,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "impl": self.impl,
            "pytype": self.pytype,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> LeafSpec:
        return cls(
            path=str(data["path"]),
            name=tuple(str(n) for n in data["name"]),
            kind=str(data["kind"]),
            dtype=str(data["dtype"]),
            shape=tuple(int(d) for d in data["shape"]),
            impl=data.get("impl"),
            pytype=data.get("pytype"),
        )


def _key_name(entry: Any, where: str, path: str) -> str:
    """One component of a leaf's stored name, from one entry of its key path."""
    if isinstance(entry, jax.tree_util.DictKey):
        key = entry.key
        if isinstance(key, bool) or not isinstance(key, (str, int)):
            raise InvalidStateError(
                f"{where}: leaf {path} sits under a dict key of type "
                f"{type(key).__name__} ({key!r}); only str and int dict keys can be "
                "stored in a checkpoint. Fix: use str keys for the dicts in the state."
            )
        name = str(key)
    elif isinstance(entry, jax.tree_util.SequenceKey):
        name = str(entry.idx)
    elif isinstance(entry, jax.tree_util.GetAttrKey):
        name = entry.name
    elif isinstance(entry, jax.tree_util.FlattenedIndexKey):
        name = str(entry.key)
    else:  # a custom key type of a user-registered pytree node
        name = str(entry)
    if not name or "." in name or "/" in name:
        raise InvalidStateError(
            f"{where}: leaf {path} sits under the key {name!r}; keys stored in a "
            "checkpoint must be non-empty and contain neither '.' nor '/' (Orbax joins "
            "names with them). Fix: rename that key."
        )
    return name


def _is_key(dtype: Any) -> bool:
    return jnp.issubdtype(dtype, jax.dtypes.prng_key)


def _check_dtype(dtype: Any, where: str, path: str, leaf: Any) -> np.dtype:
    try:
        np_dtype = np.dtype(dtype)
    except TypeError:
        np_dtype = None
    ok = np_dtype is not None and (
        np_dtype.kind in "biufc" or np_dtype.name.startswith(("bfloat", "float8", "float4"))
    )
    if not ok or np_dtype is None:
        raise InvalidStateError(
            f"{where}: leaf {path} has dtype {dtype} ({type(leaf).__name__}), which "
            "cannot be saved. Saved arrays must have a bool, integer, floating or "
            "complex dtype (bfloat16 included) or be typed PRNG keys. Fix: convert the "
            "leaf to a numeric array, or keep it out of the saved state."
        )
    return np_dtype


def leaf_spec(path: str, name: tuple[str, ...], leaf: Any, where: str, *, abstract_ok: bool):
    """The `LeafSpec` of one leaf, or an `InvalidStateError` that says how to fix it."""
    if isinstance(leaf, _PY_SCALARS):
        dtype = jnp.asarray(leaf).dtype
        return LeafSpec(path, name, SCALAR, np.dtype(dtype).name, (), pytype=type(leaf).__name__)
    is_abstract = isinstance(leaf, jax.ShapeDtypeStruct)
    if is_abstract and not abstract_ok:
        raise InvalidStateError(
            f"{where}: leaf {path} is a jax.ShapeDtypeStruct, which has no data to "
            "save. Fix: pass the concrete state (ShapeDtypeStructs are for `like`)."
        )
    if isinstance(leaf, (jax.Array, np.ndarray, np.generic)) or is_abstract:
        shape = tuple(int(d) for d in leaf.shape)
        if _is_key(leaf.dtype):
            impl = _abstract_impl(leaf) if is_abstract else _impl_name(jax.random.key_impl(leaf))  # type: ignore[arg-type]
            return LeafSpec(path, name, KEY, "uint32", shape, impl=impl)
        np_dtype = _check_dtype(leaf.dtype, where, path, leaf)
        return LeafSpec(path, name, ARRAY, np_dtype.name, shape)
    shown = repr(leaf)
    if len(shown) > 60:
        shown = shown[:57] + "..."
    raise InvalidStateError(
        f"{where}: leaf {path} is a {type(leaf).__name__} ({shown}), which cannot be "
        "saved. Only arrays (jax or numpy) and Python numbers can be leaves of a saved "
        "state. Fix: keep static values such as strings and config objects out of the "
        "saved state, or convert numbers to arrays with jnp.asarray."
    )


def _impl_name(impl: Any) -> str:
    """The name `jax.random.wrap_key_data(impl=...)` accepts: `key_impl` returns a str in
    some JAX versions and a PRNGSpec (wrapping a PRNGImpl) in others."""
    if isinstance(impl, str):
        return impl
    for candidate in (impl, getattr(impl, "_impl", None)):
        name = getattr(candidate, "name", None)
        if isinstance(name, str):
            return name
    return str(impl)


def _abstract_impl(leaf: Any) -> str | None:
    """The PRNG impl named by an abstract key dtype (`key<fry>` -> threefry2x32)."""
    impl = getattr(leaf.dtype, "_impl", None)
    return getattr(impl, "name", None)


def describe_state(
    tree: Any, where: str, *, prefix: str = "state", abstract_ok: bool = False
) -> tuple[Any, tuple[LeafSpec, ...], list[Any]]:
    """Flatten `tree` into (treedef, specs, leaves), checking every leaf.

    Raises `InvalidStateError` naming the first leaf that cannot be saved, and for
    leaves whose stored names would collide.
    """
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
    if not flat:
        raise InvalidStateError(
            f"{where}: the {prefix} has no leaves, so there is nothing to save "
            f"(got {type(tree).__name__}). Fix: pass the pytree of arrays to save."
        )
    specs = []
    seen: dict[str, str] = {}
    for key_path, leaf in flat:
        path = prefix + jax.tree_util.keystr(key_path)
        name = tuple(_key_name(e, where, path) for e in key_path) or (_ROOT_NAME,)
        joined = ".".join(name)
        if joined in seen:
            raise InvalidStateError(
                f"{where}: leaves {seen[joined]} and {path} would be stored under the "
                f"same name {joined!r}. Fix: give them distinct keys (e.g. do not mix "
                "int and str keys that print the same)."
            )
        seen[joined] = path
        specs.append(leaf_spec(path, name, leaf, where, abstract_ok=abstract_ok))
    _check_prefixes(specs, where)
    return treedef, tuple(specs), [leaf for _, leaf in flat]


def _check_prefixes(specs: list[LeafSpec], where: str) -> None:
    """A stored name cannot be both a leaf and a node (`{'a': x, 'a.b': y}` style)."""
    names = {spec.name: spec.path for spec in specs}
    for spec in specs:
        for cut in range(1, len(spec.name)):
            if spec.name[:cut] in names:
                raise InvalidStateError(
                    f"{where}: leaf {names[spec.name[:cut]]} would be stored where "
                    f"{spec.path} needs a sub-tree. Fix: give them distinct keys."
                )


def to_payload(spec: LeafSpec, leaf: Any) -> Any:
    """The array handed to the host for one leaf: key data for keys, an array otherwise."""
    if spec.kind == KEY:
        return jax.random.key_data(leaf)
    return jnp.asarray(leaf)


def nest(specs: tuple[LeafSpec, ...], arrays: list[np.ndarray]) -> dict[str, Any]:
    """The nested dict {name: {...: array}} that Orbax writes."""
    out: dict[str, Any] = {}
    for spec, array in zip(specs, arrays, strict=True):
        node = out
        for part in spec.name[:-1]:
            node = node.setdefault(part, {})
        node[spec.name[-1]] = array
    return out


def unnest(tree: dict[str, Any], spec: LeafSpec) -> Any:
    """The array stored under `spec.name` in a restored nested dict, or None."""
    node: Any = tree
    for part in spec.name:
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def check_like(like_specs: tuple[LeafSpec, ...], saved: tuple[LeafSpec, ...], where: str) -> None:
    """Raise `StructureMismatchError` naming the first leaf where `like` and the save differ."""
    saved_by_name = {spec.name: spec for spec in saved}
    like_names = {spec.name for spec in like_specs}
    fix = (
        " Fix: pass a `like` with the structure of the saved state (for example "
        "jax.eval_shape of the function that built it), or restore another step."
    )
    for spec in like_specs:
        other = saved_by_name.get(spec.name)
        if other is None:
            raise StructureMismatchError(
                f"{where}: leaf {spec.path} ({spec.describe()}) is not in the "
                f"checkpoint, which has {len(saved)} leaves." + fix
            )
        if not _compatible(spec, other):
            raise StructureMismatchError(
                f"{where}: leaf {spec.path} differs: the checkpoint has "
                f"{other.describe()}, like has {spec.describe()}." + fix
            )
    for other in saved:
        if other.name not in like_names:
            raise StructureMismatchError(
                f"{where}: the checkpoint has leaf {other.path} ({other.describe()}), "
                "which like does not have." + fix
            )


def _compatible(like: LeafSpec, saved: LeafSpec) -> bool:
    if like.kind == SCALAR:
        # A Python number in `like` accepts a saved 0-d array of the same kind of number.
        if saved.shape != ():
            return False
        kinds = {"bool": "b", "int": "iu", "float": "f", "complex": "c"}
        saved_kind = np.dtype(saved.dtype).kind if saved.kind != KEY else "K"
        if np.dtype(saved.dtype).name.startswith("bfloat"):
            saved_kind = "f"
        return saved_kind in kinds.get(like.pytype or "", "")
    if like.kind == ARRAY and saved.kind == SCALAR:
        # A Python number saved eagerly comes back as the 0-d array a traced run has.
        return like.shape == () and like.dtype == saved.dtype
    if like.kind != saved.kind or like.shape != saved.shape:
        return False
    if like.kind == KEY:
        return like.impl is None or like.impl == saved.impl
    return like.dtype == saved.dtype


def rebuild(like_leaf: Any, spec: LeafSpec, saved: LeafSpec, array: np.ndarray) -> Any:
    """One restored leaf, of the same type as the `like` leaf."""
    if saved.kind == KEY:
        key = jax.random.wrap_key_data(jnp.asarray(array), impl=saved.impl)
        return _place(key, like_leaf)
    if isinstance(like_leaf, _PY_SCALARS):
        return type(like_leaf)(array.item())
    if isinstance(like_leaf, np.generic):
        return np.dtype(spec.dtype).type(array.item() if array.shape == () else array)
    if isinstance(like_leaf, np.ndarray):
        return np.array(array, dtype=spec.dtype, copy=True)
    return _place(jnp.asarray(array, dtype=spec.dtype), like_leaf)


def _place(value: jax.Array, like_leaf: Any) -> jax.Array:
    """Put a restored array where the `like` leaf lives (its sharding), when it says."""
    sharding = getattr(like_leaf, "sharding", None)
    if sharding is None:
        return value
    return jax.device_put(value, sharding)
