"""Pytree bookkeeping: which leaves a state has, how they are stored, how they come back.

Everything here runs in Python while tracing (or eagerly), never inside a callback. A
state is described by one `LeafSpec` per leaf; the specs travel with each checkpoint as
JSON (never pickle), so restore can check a `like` leaf by leaf and re-wrap typed PRNG
keys, whose key type numpy cannot represent.
"""

from __future__ import annotations

import collections
import functools
import threading
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from jax._src.lax import lax as _jax_lax  # private: see _weakly_typed
from jax.sharding import NamedSharding, PartitionSpec

from . import _dtypes, _format
from ._dtypes import ML_DTYPES
from ._errors import InvalidStateError, StructureMismatchError
from ._errors import shown as _shown
from ._spec import ARRAY, KEY, SCALAR, LeafSpec, key_data_shape
from ._types import PyTree

if TYPE_CHECKING:
    from ._shards import ShardedArray

_PY_SCALARS = (bool, int, float, complex)
_ROOT_NAME = "value"  # name of the single leaf when the state itself is an array


def _key_name(entry: Any, where: str, path: str, *, free: bool = False) -> str:
    """One component of a leaf's stored name, from one entry of its key path (`free`:
    a metric's, which may hold '.' and '/': it names a JSON entry, not an array)."""
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
    if not name or (not free and ("." in name or "/" in name)):
        raise InvalidStateError(
            f"{where}: leaf {path} sits under the key {name!r}; keys stored in a "
            "checkpoint must be non-empty and contain neither '.' nor '/' (Orbax joins "
            "names with them). Fix: rename that key."
        )
    return name


@functools.lru_cache(maxsize=256)
def _is_key(dtype: Any) -> bool:
    return jnp.issubdtype(dtype, jax.dtypes.prng_key)


@functools.lru_cache(maxsize=256)
def _numeric(dtype: np.dtype) -> str | None:
    """The name of a dtype a checkpoint stores, else None (cached: numpy computes a
    dtype's name anew each time)."""
    if dtype.kind in "biufc" or dtype.name.startswith(ML_DTYPES):
        return dtype.name
    return None


def _check_dtype(dtype: Any, where: str, path: str, leaf: Any) -> np.dtype:
    if isinstance(dtype, np.dtype) and _numeric(dtype) is not None:
        return dtype
    try:
        np_dtype = np.dtype(dtype)
    except TypeError:
        np_dtype = None
    ok = np_dtype is not None and (np_dtype.kind in "biufc" or np_dtype.name.startswith(ML_DTYPES))
    if not ok or np_dtype is None:
        raise InvalidStateError(
            f"{where}: leaf {path} has dtype {dtype} ({type(leaf).__name__}), which "
            "cannot be saved. Saved arrays must have a bool, integer (int2/int4 "
            "included), floating (bfloat16, float8 included) or complex dtype, or be "
            "typed PRNG keys. Fix: convert the leaf to a numeric array, or keep it out of "
            "the saved state."
        )
    return np_dtype


def _scalar_dtype(leaf: Any, where: str, path: str) -> str:
    """The exact dtype a Python number is stored as (independent of jax_enable_x64)."""
    if isinstance(leaf, bool):
        return "bool"
    if isinstance(leaf, int):
        if not -(2**63) <= leaf < 2**63:
            raise InvalidStateError(
                f"{where}: leaf {path} is the Python int {leaf}, which does not fit in "
                "int64, the widest integer a checkpoint stores. Fix: keep integers in the "
                "saved state within int64, or keep this value out of it."
            )
        return "int64"
    return "float64" if isinstance(leaf, float) else "complex128"


def leaf_spec(path: str, name: tuple[str, ...], leaf: Any, where: str, *, abstract_ok: bool):
    """The `LeafSpec` of one leaf, or an `InvalidStateError` that says how to fix it."""
    # numpy scalars first: np.float64 and np.complex128 are also Python float/complex.
    if isinstance(leaf, _PY_SCALARS) and not isinstance(leaf, np.generic):
        dtype = _scalar_dtype(leaf, where, path)
        return LeafSpec(path, name, SCALAR, dtype, (), pytype=type(leaf).__name__)
    is_abstract = isinstance(leaf, jax.ShapeDtypeStruct)
    if is_abstract and not abstract_ok:
        raise InvalidStateError(
            f"{where}: leaf {path} is a jax.ShapeDtypeStruct, which has no data to "
            "save. Fix: pass the concrete state (ShapeDtypeStructs are for `like`)."
        )
    if isinstance(leaf, (jax.Array, np.ndarray, np.generic)) or is_abstract:
        shape = tuple(int(d) for d in leaf.shape)
        if _is_key(leaf.dtype):
            impl = _abstract_impl(leaf) if is_abstract else str(jax.random.key_impl(leaf))  # type: ignore[arg-type]
            return LeafSpec(path, name, KEY, "uint32", shape, impl=impl)
        np_dtype = _check_dtype(leaf.dtype, where, path, leaf)
        weak = bool(getattr(leaf, "weak_type", False))
        return LeafSpec(path, name, ARRAY, _numeric(np_dtype) or np_dtype.name, shape, weak=weak)
    shown = repr(leaf)
    if len(shown) > 60:
        shown = shown[:57] + "..."
    if where.startswith("restore"):
        what = "cannot be restored into: `like` must have the structure of the saved state"
    else:
        what = "cannot be saved: only arrays (jax or numpy) and Python numbers can be leaves"
    if any(c.__module__.startswith("flax.nnx") for c in type(leaf).__mro__):
        fix = (
            "Fix: this Flax NNX module is not a pytree (declared pytree=False, or an "
            "older flax): save `nnx.state(model)` and rebuild with "
            "`nnx.merge(graphdef, restored)` (docs/frameworks.md)."
        )
    elif callable(leaf):
        fix = (
            "Fix: a model object that holds functions next to its arrays (an "
            "equinox Module) must be split first: save `eqx.filter(model, "
            "eqx.is_array)` and rebuild with `eqx.combine`. A Flax NNX module saves as "
            "it is with flax >= 0.12; one declared pytree=False (or from an older "
            "flax) is a single leaf: save `nnx.state(model)` and rebuild with "
            "`nnx.merge` (docs/frameworks.md)."
        )
    else:
        fix = (
            "Fix: keep static values such as strings and config objects out of the "
            "state (a Flax TrainState keeps them in static fields), or convert numbers "
            "to arrays with jnp.asarray."
        )
    raise InvalidStateError(
        f"{where}: leaf {path} is a {type(leaf).__name__} ({shown}), which {what}. {fix}"
    )


def _abstract_impl(leaf: Any) -> str | None:
    """The PRNG impl named by an abstract key dtype (`key<fry>` -> threefry2x32)."""
    impl = getattr(leaf.dtype, "_impl", None)
    return getattr(impl, "name", None)


def describe_state(
    tree: PyTree,
    where: str,
    *,
    prefix: str = "state",
    abstract_ok: bool = False,
    free_names: bool = False,
) -> tuple[Any, tuple[LeafSpec, ...], list[Any]]:
    """Flatten `tree` into (treedef, specs, leaves), checking every leaf.

    Raises `InvalidStateError` naming the first leaf that cannot be saved, and for
    leaves whose stored names would collide. A state described before (the same key
    paths, exactly, and the same leaf types, shapes and dtypes) is not checked again:
    its specs are remembered (`_DESCRIBED`), since an eager save of 80 leaves spent ~1
    ms here on every call.
    """
    try:
        flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
    except (TypeError, ValueError) as e:  # e.g. a dict mixing int and str keys
        raise InvalidStateError(
            f"{where}: JAX cannot flatten the {prefix}: {e}. Fix: a dict must have keys "
            "of one sortable type (use str keys), and custom nodes must be registered "
            "pytrees."
        ) from e
    leaves = [leaf for _, leaf in flat]
    paths = tuple(tuple(_entry_key(e) for e in path) for path, _ in flat)
    leaf_keys = tuple(_leaf_key(leaf) for leaf in leaves)
    key = None
    if None not in leaf_keys and not any(None in path for path in paths):
        key = (treedef, prefix, abstract_ok, free_names, paths, leaf_keys)
        try:
            hash(key)
        except TypeError:  # a custom node's unhashable data: never remembered
            key = None
    if key is not None:
        with _DESCRIBED_LOCK:
            specs = _DESCRIBED.get(key)
            if specs is not None:
                _DESCRIBED.move_to_end(key)
                return treedef, specs, leaves
    specs = _describe(tree, flat, where, prefix, abstract_ok, free_names)
    if key is not None:
        with _DESCRIBED_LOCK:
            _DESCRIBED[key] = specs
            while len(_DESCRIBED) > _DESCRIBED_MAX:
                _DESCRIBED.popitem(last=False)
    return treedef, specs, leaves


_MAX_MEMBERS = 1 << 16  # a metric given as one value per member of a batch


def describe_metrics(
    metrics: PyTree, where: str
) -> tuple[tuple[str, ...], tuple[LeafSpec, ...], list[Any]]:
    """(names, specs, leaves) of `metrics=`: a small pytree of real scalars (traced or
    not; or 1-D, one per member of a batch the state holds without vmap), named by
    their key paths joined with "/" (`{"eval": {"return": r}}` is "eval/return").
    Raises `InvalidStateError` naming the metric that is not one."""
    if not jax.tree.leaves(metrics):
        raise InvalidStateError(
            f"{where}(metrics=...): {_shown(metrics)} holds no values. Fix: pass a dict of "
            "scalars, e.g. metrics={'return': ret}, or leave metrics= out."
        )
    # A metric's name is its key path joined with "/" (TensorBoard's "eval/return" is
    # `{"eval/return": r}` or `{"eval": {"return": r}}`: one name, refused when both).
    _, specs, leaves = describe_state(
        metrics, f"{where}(metrics=...)", prefix="metrics", free_names=True
    )
    named: dict[str, str] = {}
    for spec in specs:
        other = named.setdefault("/".join(spec.name), spec.path)
        if other != spec.path:
            raise InvalidStateError(
                f"{where}(metrics=...): {other} and {spec.path} are both named "
                f"{'/'.join(spec.name)!r} (a metric's name is its keys joined with '/'). "
                "Fix: give them distinct names."
            )
    if len(specs) > _format.MAX_METRICS:
        raise InvalidStateError(
            f"{where}(metrics=...): {len(specs)} metrics, more than the {_format.MAX_METRICS} a "
            "step records. Fix: pass a few scalars (a loss, a return), not arrays of them; "
            "keep larger results in the state."
        )
    names = []
    for spec in specs:
        name = "/".join(spec.name)
        real = np.dtype(spec.dtype).kind in "biuf" or spec.dtype.startswith(("bfloat", "float8"))
        per_member = len(spec.shape) == 1 and spec.shape[0] <= _MAX_MEMBERS
        if spec.kind == KEY or not (spec.shape == () or per_member) or not real:
            raise InvalidStateError(
                f"{where}(metrics=...): {spec.path} is {spec.describe()}; a metric is one "
                "real number per step (a bool, integer or floating scalar; under vmap "
                "one per member; a 1-D array of at most "
                f"{_MAX_MEMBERS} for a batch held without vmap). Fix: reduce it first "
                "(e.g. jnp.mean), or keep arrays in the state."
            )
        if len(name) > _format.MAX_METRIC_NAME:
            raise InvalidStateError(
                f"{where}(metrics=...): the metric name {name[:40]!r}... has {len(name)} "
                f"characters, more than {_format.MAX_METRIC_NAME}. Fix: use a shorter key."
            )
        names.append(name)
    return tuple(names), specs, leaves


# States described before: (treedef, prefix, abstract_ok, key paths, leaf keys) ->
# specs. A few entries: a run saves one or two structures (its state; a restore's `like`).
_DESCRIBED: collections.OrderedDict[Any, tuple[LeafSpec, ...]] = collections.OrderedDict()
_DESCRIBED_MAX = 16
_DESCRIBED_LOCK = threading.Lock()


def _entry_key(entry: Any) -> Any:
    """One step of a leaf's key path, exactly (the name and path it is stored under
    depend on it): a dict key only when it is exactly a str or an int (JAX's tree
    structure compares keys with ==, so 1, 1.0 and True would share one entry); None
    for anything else, which is never remembered."""
    if isinstance(entry, jax.tree_util.DictKey):
        key = entry.key
        return (0, key) if type(key) is str or type(key) is int else None
    if isinstance(entry, jax.tree_util.SequenceKey):
        return 1, entry.idx
    if isinstance(entry, jax.tree_util.GetAttrKey):
        return 2, entry.name
    if isinstance(entry, jax.tree_util.FlattenedIndexKey):
        return 3, entry.key
    return None


def _leaf_key(leaf: Any) -> Any:
    """What a leaf's spec depends on besides its position: its type, shape, dtype and
    weak type (a Python int's range, which is checked); None for anything else, which is never
    remembered."""
    if isinstance(leaf, (jax.Array, np.ndarray, jax.ShapeDtypeStruct, np.generic)):
        return type(leaf), leaf.shape, leaf.dtype, bool(getattr(leaf, "weak_type", False))
    if isinstance(leaf, int) and not isinstance(leaf, bool):
        return type(leaf), -(2**63) <= leaf < 2**63
    if isinstance(leaf, _PY_SCALARS):
        return (type(leaf),)
    return None


def _describe(
    tree: PyTree,
    flat: list[tuple[Any, Any]],
    where: str,
    prefix: str,
    abstract_ok: bool,
    free_names: bool = False,
) -> tuple[LeafSpec, ...]:
    """The checked specs of `tree`, flattened as `flat` (key path, leaf)."""
    if not flat:
        if prefix == "like":
            raise InvalidStateError(
                f"{where}: like has no leaves, so there is nothing to restore into (got "
                f"{type(tree).__name__}). Fix: pass a pytree shaped like the saved state: "
                "the initial state, or jax.eval_shape of the function that makes it."
            )
        raise InvalidStateError(
            f"{where}: the {prefix} has no leaves, so there is nothing to save "
            f"(got {type(tree).__name__}). Fix: pass the pytree of arrays to save."
        )
    specs = []
    seen: dict[str, str] = {}
    for key_path, leaf in flat:
        path = prefix + jax.tree_util.keystr(key_path)
        name = tuple(_key_name(e, where, path, free=free_names) for e in key_path)
        name = name or (_ROOT_NAME,)
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
    return tuple(specs)


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


def is_constant(leaf: Any) -> bool:
    """A leaf whose value Python knows (numpy arrays and scalars, Python numbers): inside
    a trace it is a constant of the compiled program."""
    return isinstance(leaf, (np.ndarray, np.generic, *_PY_SCALARS))


def host_copy(spec: LeafSpec, leaf: Any) -> np.ndarray:
    """An owned copy of a constant leaf with its exact dtype (a later in-place change of
    the caller's array does not reach the checkpoint)."""
    return np.array(leaf, dtype=np.dtype(spec.dtype), copy=True)


def empty_data(spec: LeafSpec, shape: tuple[int, ...]) -> np.ndarray:
    """The stored data of a zero-size leaf of `shape` (all there is to it is its shape)."""
    trailing = key_data_shape(spec.impl) if spec.kind == KEY else ()
    return np.zeros(shape + trailing, np.dtype(spec.dtype))


def to_payload(spec: LeafSpec, leaf: Any, where: str) -> Any:
    """The array that crosses through JAX for one leaf: key data for keys."""
    if spec.kind == KEY:
        return jax.random.key_data(leaf)
    if is_constant(leaf):
        value = host_copy(spec, leaf)
        if np.dtype(jax.dtypes.canonicalize_dtype(value.dtype)) != value.dtype:
            raise InvalidStateError(
                f"{where}: leaf {spec.path} is a {value.dtype} constant, which JAX would "
                f"turn into {jax.dtypes.canonicalize_dtype(value.dtype)} here (64-bit "
                "types need jax_enable_x64), changing the saved values. Fix: pass it as a "
                "jax array of a 32-bit type, save it outside jit, or enable x64."
            )
        return jnp.asarray(value)
    return jnp.asarray(leaf)


def eager_value(spec: LeafSpec, leaf: Any) -> Any:
    """The host value of one leaf of a save made outside any trace (exact dtype)."""
    if spec.kind == KEY:
        return jax.random.key_data(leaf)
    if is_constant(leaf):
        return np.asarray(leaf, dtype=np.dtype(spec.dtype))
    return leaf


EMPTY_NAME = "_jax_cb_ckpt_empty"  # Orbax refuses an empty item: a placeholder leaf


def stored_leaves(
    specs: tuple[LeafSpec, ...], arrays: Sequence[np.ndarray | ShardedArray]
) -> list[tuple[tuple[str, ...], np.ndarray | ShardedArray]]:
    """(name, array) of each leaf Orbax stores, in the order of the nested dict
    {name[0]: {name[1]: ...}} that it writes (a group's leaves together, the groups in
    the order they first appear): the order of the state's `_METADATA` and data files.

    Zero-size arrays are left out (Orbax cannot store them; the spec records the shape,
    and restore rebuilds them), and an item left with nothing gets a placeholder.
    """
    out = [
        # Per-device leaves (ShardedArray) are made storable by the writer.
        (spec.name, _dtypes.storable(a) if isinstance(a, (np.ndarray, np.generic)) else a)
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
            top = sorted({s.name[0] for s in saved})
            shown = ", ".join(repr(t) for t in top[:12]) + (", ..." if len(top) > 12 else "")
            raise StructureMismatchError(
                f"{where}: leaf {spec.path} ({spec.describe()}) is not in the "
                f"checkpoint, which has {len(saved)} leaves under the top-level keys "
                f"[{shown}] (a `like` nested one level too deep or too shallow shows "
                "here)." + fix
            )
        if not compatible(spec, other):
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


def compatible(like: LeafSpec, saved: LeafSpec) -> bool:
    """Whether the stored leaf `saved` restores into the `like` leaf `like`."""
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
        # A Python number saved eagerly comes back as the 0-d array a traced run has
        # (rebuild checks that the value survives the cast).
        return like.shape == () and _number_kind(like.dtype) == _number_kind(saved.dtype)
    if like.kind != saved.kind or like.shape != saved.shape:
        return False
    if like.kind == KEY:
        return like.impl is None or like.impl == saved.impl
    return like.dtype == saved.dtype or carried_as(like, saved)


def carried_as(like: LeafSpec, saved: LeafSpec) -> bool:
    """A weakly typed `like` leaf (a Python number of the initial state) that a loop
    carries as `dtype`: JAX promotes a weakly typed carry to `result_type(leaf, what
    the body returns)`, so a checkpoint holds it in that dtype. Restored as stored.
    (A Python number of the leaf's kind stands for it: `result_type` reads a
    ShapeDtypeStruct as strongly typed.)"""
    dtype = saved.dtype
    if not like.weak or like.kind != ARRAY or saved.kind != ARRAY or like.dtype == dtype:
        return False
    kind = np.dtype(like.dtype).kind
    number = {"b": False, "i": 0, "u": 0, "f": 0.0, "c": 0j}.get(kind)
    if number is None:
        return False
    with warnings.catch_warnings():  # (a 64-bit dtype without x64 is said, and differs)
        warnings.simplefilter("ignore")
        try:
            return np.dtype(jnp.result_type(number, _dtypes.named(dtype))).name == dtype
        except TypeError:
            return False


def as_carried(state: PyTree, like: PyTree) -> PyTree:
    """`state` with each weakly typed leaf (a Python number, or an array made from one)
    in the dtype of the `like` leaf at its place, where JAX's promotion of the leaf to
    that dtype gives it (as a loop carries it): a fresh start then passes a loop the
    signature a resumed one does. Any other leaf, or a `like` of another structure,
    stays as it is."""
    leaves, treedef = jax.tree_util.tree_flatten(state)
    likes = jax.tree_util.tree_leaves(like)
    if len(likes) != len(leaves) or jax.tree_util.tree_structure(like) != treedef:
        return state

    def carried(leaf: Any, target: Any) -> Any:
        weak = isinstance(leaf, (int, float, complex)) and not isinstance(leaf, bool)
        weak = weak or bool(getattr(leaf, "weak_type", False))
        dtype = getattr(target, "dtype", None)
        if not weak or dtype is None or _is_key(dtype) or jnp.shape(leaf) != target.shape:
            return leaf
        if getattr(target, "weak_type", False) or jnp.result_type(leaf, dtype) != dtype:
            return leaf
        return jax.lax.convert_element_type(leaf, dtype)  # (strongly typed, as like)

    return treedef.unflatten([carried(a, b) for a, b in zip(leaves, likes, strict=True)])


def _number_kind(dtype: str) -> str:
    kind = np.dtype(dtype).kind
    if dtype.startswith(ML_DTYPES):
        return "i" if "int" in dtype else "f"
    return "i" if kind == "u" else kind


def rebuild(like_leaf: Any, spec: LeafSpec, saved: LeafSpec, array: Any, where: str) -> Any:
    """One restored leaf, of the same type as the `like` leaf, from `array`: the leaf's
    data as saved, a numpy array the caller gives up (it is returned as it is where
    `like` wants numpy of its dtype: no copy), or a placed `jax.Array`."""
    if saved.kind == SCALAR and spec.kind == ARRAY and saved.dtype != spec.dtype:
        cast = array.astype(spec.dtype)
        if cast.astype(saved.dtype) != array:
            raise StructureMismatchError(
                f"{where}: leaf {spec.path}: the checkpoint has the Python number "
                f"{array.item()!r}, which like's {spec.describe()} cannot hold exactly. "
                "Fix: restore into a Python number or a wider dtype."
            )
        array = cast
    if saved.kind == KEY:
        sharding = getattr(like_leaf, "sharding", None)
        if isinstance(sharding, NamedSharding) and not sharding.is_fully_addressable:
            # Across processes: place the key data (one more axis) and wrap it there.
            data_spec = PartitionSpec(*sharding.spec, *[None] * (array.ndim - len(sharding.spec)))
            data = _place(jnp.asarray(array), NamedSharding(sharding.mesh, data_spec))
            return jax.random.wrap_key_data(data, impl=saved.impl)
        key = jax.random.wrap_key_data(jnp.asarray(array), impl=saved.impl)
        return _place(key, sharding)
    if isinstance(like_leaf, _PY_SCALARS):
        return type(like_leaf)(array.item())
    if isinstance(like_leaf, np.generic):
        return np.dtype(spec.dtype).type(array.item() if array.shape == () else array)
    if isinstance(like_leaf, np.ndarray):
        return np.asarray(array, dtype=spec.dtype)
    weak = getattr(like_leaf, "weak_type", False)
    if (
        isinstance(array, jax.Array)
        and not weak
        and array.dtype == np.dtype(spec.dtype)
        and getattr(like_leaf, "sharding", None) in (None, array.sharding)
    ):
        return array  # placed already, as like wants it (`_restore`)
    # A weakly typed leaf the loop carried in another dtype comes back as stored, as
    # the loop carries it (strongly typed); one stored in its own dtype stays weak.
    carried = carried_as(spec, saved)
    dtype = saved.dtype if carried else spec.dtype
    if isinstance(array, np.ndarray):
        # device_put, not jnp.asarray: on a CPU it adopts an aligned host array without
        # a copy (the read allocates aligned arrays, `_read`); jnp.asarray always copies
        # (256 MiB: ~100 ms here, ~260 ms from unaligned memory).
        value = jax.device_put(np.asarray(array, dtype=dtype))
    else:
        value = jnp.asarray(array, dtype=dtype)
    if weak and not carried:
        value = _weakly_typed(value)
    return _place(value, getattr(like_leaf, "sharding", None))


def _weakly_typed(value: jax.Array) -> jax.Array:
    """`value` marked weakly typed, as the `like` leaf is (a Python-number-derived scalar
    of a carry): a strong leaf would change type promotion in a resumed program, and a
    scan whose carry goes in strong and comes out weak fails to trace. JAX has no public
    call for it; its internal one is used, and checked by the tests on every JAX we test."""
    weak = _jax_lax._convert_element_type(value, value.dtype, weak_type=True)
    return weak  # pyright: ignore[reportReturnType]


def _place(value: jax.Array, sharding: jax.sharding.Sharding | None) -> jax.Array:
    """Put a restored array where the `like` leaf lives (its sharding), when it says.
    A sharding over several processes' devices gets this process's blocks only (every
    process holds the whole value here; `device_put` refuses devices of others)."""
    if sharding is None:
        return value
    if sharding.is_fully_addressable or not value.is_fully_addressable:  # (Orbax placed it)
        return jax.device_put(value, sharding)
    host = np.asarray(value)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def same_bits(a: PyTree, b: PyTree) -> bool:
    """Whether two states are equal bit for bit: the same leaves (by pytree path), of
    the same dtype, shape and bytes (typed PRNG keys: the same implementation and key
    data; NaNs equal themselves). What a resumed run promises to match.

    Example:
        ```python
        assert jax_cb_ckpt.same_bits(resumed_final_state, uninterrupted_final_state)
        ```
    """
    # Compared by leaf paths, not treedefs: static fields (a TrainState's apply_fn, a
    # closure made anew by each run) are code, not state, and need not be the same object.
    flat_a = jax.tree_util.tree_flatten_with_path(a)[0]
    flat_b = jax.tree_util.tree_flatten_with_path(b)[0]
    if [path for path, _ in flat_a] != [path for path, _ in flat_b]:
        return False
    for (_, x), (_, y) in zip(flat_a, flat_b, strict=True):
        keys = [_is_key(getattr(v, "dtype", np.float32)) for v in (x, y)]
        if keys[0] != keys[1]:
            return False
        if keys[0]:
            if str(jax.random.key_impl(x)) != str(jax.random.key_impl(y)):
                return False
            x, y = jax.random.key_data(x), jax.random.key_data(y)
        xa, ya = np.asarray(x), np.asarray(y)
        if (xa.dtype, xa.shape) != (ya.dtype, ya.shape) or xa.tobytes() != ya.tobytes():
            return False
    return True
