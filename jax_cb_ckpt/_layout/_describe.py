"""A pytree described as the leaves it is stored as: one `LeafSpec` per leaf (its name
from the key path, kind, dtype, shape), for a state that is saved, its metrics, and a
`like` that a restore fills. The one description both sides use: a save names its
leaves with it and a restore checks `like` against the names it finds, so the two
cannot drift apart.

Runs in Python while tracing (or eagerly), never inside a callback; nothing blocks.
The specs travel with each checkpoint as JSON (never pickle), so restore can check a
`like` leaf by leaf and re-wrap typed PRNG keys, whose key type numpy cannot represent.
The only module of `_layout/` that imports JAX (for its tree and dtype utilities).
"""

from __future__ import annotations

import collections
import functools
import threading
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from .._base._dtypes import ML_DTYPES
from .._base._errors import InvalidStateError, calling, where
from .._base._errors import shown as _shown
from .._base._types import PyTree
from . import _format
from ._spec import ARRAY, KEY, SCALAR, LeafSpec

# Python's numbers, stored as SCALAR leaves (`_save/_values`, `_read/_rebuild` too).
PY_SCALARS = (bool, int, float, complex)


_ROOT_NAME = "value"  # name of the single leaf when the state itself is an array


def _key_name(entry: Any, path: str, *, free: bool = False) -> str:
    """One component of a leaf's stored name, from one entry of its key path (`free`:
    a metric's, which may hold '.' and '/': it names a JSON entry, not an array)."""
    if isinstance(entry, jax.tree_util.DictKey):
        key = entry.key
        if isinstance(key, bool) or not isinstance(key, (str, int)):
            raise InvalidStateError(
                f"{where()}: leaf {path} sits under a dict key of type "
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
            f"{where()}: leaf {path} sits under the key {name!r}; keys stored in a "
            "checkpoint must be non-empty and contain neither '.' nor '/' (Orbax joins "
            "names with them). Fix: rename that key."
        )
    return name


@functools.lru_cache(maxsize=256)
def is_key(dtype: Any) -> bool:
    return jnp.issubdtype(dtype, jax.dtypes.prng_key)


@functools.lru_cache(maxsize=256)
def _numeric(dtype: np.dtype) -> str | None:
    """The name of a dtype a checkpoint stores, else None (cached: numpy computes a
    dtype's name anew each time)."""
    if dtype.kind in "biufc" or dtype.name.startswith(ML_DTYPES):
        return dtype.name
    return None


def _check_dtype(dtype: Any, path: str, leaf: Any) -> np.dtype:
    if isinstance(dtype, np.dtype) and _numeric(dtype) is not None:
        return dtype
    try:
        np_dtype = np.dtype(dtype)
    except TypeError:
        np_dtype = None
    ok = np_dtype is not None and (np_dtype.kind in "biufc" or np_dtype.name.startswith(ML_DTYPES))
    if not ok or np_dtype is None:
        raise InvalidStateError(
            f"{where()}: leaf {path} has dtype {dtype} ({type(leaf).__name__}), which "
            "cannot be saved. Saved arrays must have a bool, integer (int2/int4 "
            "included), floating (bfloat16, float8 included) or complex dtype, or be "
            "typed PRNG keys. Fix: convert the leaf to a numeric array, or keep it out of "
            "the saved state."
        )
    return np_dtype


def _scalar_dtype(leaf: Any, path: str) -> str:
    """The exact dtype a Python number is stored as (independent of jax_enable_x64)."""
    if isinstance(leaf, bool):
        return "bool"
    if isinstance(leaf, int):
        if not -(2**63) <= leaf < 2**63:
            raise InvalidStateError(
                f"{where()}: leaf {path} is the Python int {leaf}, which does not fit in "
                "int64, the widest integer a checkpoint stores. Fix: keep integers in the "
                "saved state within int64, or keep this value out of it."
            )
        return "int64"
    return "float64" if isinstance(leaf, float) else "complex128"


def leaf_spec(path: str, name: tuple[str, ...], leaf: Any, *, abstract_ok: bool):
    """The `LeafSpec` of one leaf, or an `InvalidStateError` that says how to fix it."""
    # numpy scalars first: np.float64 and np.complex128 are also Python float/complex.
    if isinstance(leaf, PY_SCALARS) and not isinstance(leaf, np.generic):
        dtype = _scalar_dtype(leaf, path)
        return LeafSpec(path, name, SCALAR, dtype, (), pytype=type(leaf).__name__)
    is_abstract = isinstance(leaf, jax.ShapeDtypeStruct)
    if is_abstract and not abstract_ok:
        raise InvalidStateError(
            f"{where()}: leaf {path} is a jax.ShapeDtypeStruct, which has no data to "
            "save. Fix: pass the concrete state (ShapeDtypeStructs are for `like`)."
        )
    if isinstance(leaf, (jax.Array, np.ndarray, np.generic)) or is_abstract:
        shape = tuple(int(d) for d in leaf.shape)
        if is_key(leaf.dtype):
            impl = _abstract_impl(leaf) if is_abstract else str(jax.random.key_impl(leaf))  # type: ignore[arg-type]
            return LeafSpec(path, name, KEY, "uint32", shape, impl=impl)
        np_dtype = _check_dtype(leaf.dtype, path, leaf)
        weak = bool(getattr(leaf, "weak_type", False))
        return LeafSpec(path, name, ARRAY, _numeric(np_dtype) or np_dtype.name, shape, weak=weak)
    raise _not_a_leaf(path, leaf)


def _not_a_leaf(path: str, leaf: Any) -> InvalidStateError:
    """What `leaf_spec` says of a leaf that is neither an array nor a number: what it
    is, and how to fix the state (or `like`) for its kind."""
    kind = type(leaf).__name__
    shown = repr(leaf)
    if len(shown) > 60:
        shown = shown[:57] + "..."
    if where().startswith("restore"):
        what = "cannot be restored into: `like` must have the structure of the saved state"
    else:
        what = "cannot be saved: only arrays (jax or numpy) and Python numbers can be leaves"
    if any(c.__module__.startswith("flax.nnx") for c in type(leaf).__mro__):
        fix = (
            "Fix: this Flax NNX module is not a pytree (declared pytree=False, or an "
            "older flax): save `nnx.state(model)` and rebuild with "
            "`nnx.merge(graphdef, restored)` (docs/frameworks.md)."
        )
    elif callable(leaf) and path in ("like", "state") and not isinstance(leaf, type):
        # The whole tree is a function (a jitted one too): the one that makes the state.
        kind = "function"
        maker = getattr(leaf, "__name__", None) or "init"
        if path == "like":
            fix = (
                f"Fix: `like` is the state to restore into, not the function that makes "
                f"it: pass its shapes, `jax.eval_shape({maker}, key)` (with {maker}'s "
                "arguments; nothing is computed), or call "
                f"`ckpt.restore_or_init({maker}, key)`, which restores or calls {maker}."
            )
        else:
            fix = f"Fix: pass the state, `{maker}(...)`, not the function that makes it."
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
    return InvalidStateError(f"{where()}: leaf {path} is a {kind} ({shown}), which {what}. {fix}")


def _abstract_impl(leaf: Any) -> str | None:
    """The PRNG impl named by an abstract key dtype (`key<fry>` -> threefry2x32)."""
    impl = getattr(leaf.dtype, "_impl", None)
    return getattr(impl, "name", None)


def describe_state(
    tree: PyTree,
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
            f"{where()}: JAX cannot flatten the {prefix}: {e}. Fix: a dict must have keys "
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
    specs = _describe(tree, flat, prefix, abstract_ok, free_names)
    if key is not None:
        with _DESCRIBED_LOCK:
            _DESCRIBED[key] = specs
            while len(_DESCRIBED) > _DESCRIBED_MAX:
                _DESCRIBED.popitem(last=False)
    return treedef, specs, leaves


_MAX_MEMBERS = 1 << 16  # a metric given as one value per member of a batch


def describe_metrics(
    metrics: PyTree,
) -> tuple[tuple[str, ...], tuple[LeafSpec, ...], list[Any]]:
    """(names, specs, leaves) of `metrics=`: a small pytree of real scalars (traced or
    not; or 1-D, one per member of a batch the state holds without vmap), named by
    their key paths joined with "/" (`{"eval": {"return": r}}` is "eval/return").
    Raises `InvalidStateError` naming the metric that is not one."""
    if not jax.tree.leaves(metrics):
        raise InvalidStateError(
            f"{where()}(metrics=...): {_shown(metrics)} holds no values. Fix: pass a dict of "
            "scalars, e.g. metrics={'return': ret}, or leave metrics= out."
        )
    # A metric's name is its key path joined with "/" (TensorBoard's "eval/return" is
    # `{"eval/return": r}` or `{"eval": {"return": r}}`: one name, refused when both).
    with calling(f"{where()}(metrics=...)"):
        _, specs, leaves = describe_state(metrics, prefix="metrics", free_names=True)
    named: dict[str, str] = {}
    for spec in specs:
        other = named.setdefault("/".join(spec.name), spec.path)
        if other != spec.path:
            raise InvalidStateError(
                f"{where()}(metrics=...): {other} and {spec.path} are both named "
                f"{'/'.join(spec.name)!r} (a metric's name is its keys joined with '/'). "
                "Fix: give them distinct names."
            )
    if len(specs) > _format.MAX_METRICS:
        raise InvalidStateError(
            f"{where()}(metrics=...): {len(specs)} metrics, more than the {_format.MAX_METRICS} a "
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
                f"{where()}(metrics=...): {spec.path} is {spec.describe()}; a metric is one "
                "real number per step (a bool, integer or floating scalar; under vmap "
                "one per member; a 1-D array of at most "
                f"{_MAX_MEMBERS} for a batch held without vmap). Fix: reduce it first "
                "(e.g. jnp.mean), or keep arrays in the state."
            )
        if len(name) > _format.MAX_METRIC_NAME:
            raise InvalidStateError(
                f"{where()}(metrics=...): the metric name {name[:40]!r}... has {len(name)} "
                f"characters, more than {_format.MAX_METRIC_NAME}. Fix: use a shorter key."
            )
        names.append(name)
    return tuple(names), specs, leaves


class Described(NamedTuple):
    """What one save hands over, described (`describe_save`): the state's leaves, then
    the metrics' (`specs`, `leaves`); the metrics' names; how many leaves are the
    state's."""

    specs: tuple[LeafSpec, ...]
    leaves: list[Any]
    metrics: tuple[str, ...]
    state_leaves: int


def describe_save(state: PyTree, metrics: PyTree) -> Described:
    """`state` and `metrics=` (None: none) of one save, described in one pass: each leaf
    checked (`describe_state`, `describe_metrics`)."""
    _, specs, leaves = describe_state(state)
    if metrics is None:
        return Described(specs, leaves, (), len(specs))
    names, metric_specs, metric_leaves = describe_metrics(metrics)
    return Described(specs + metric_specs, leaves + metric_leaves, names, len(specs))


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
    if isinstance(leaf, PY_SCALARS):
        return (type(leaf),)
    return None


def _describe(
    tree: PyTree,
    flat: list[tuple[Any, Any]],
    prefix: str,
    abstract_ok: bool,
    free_names: bool = False,
) -> tuple[LeafSpec, ...]:
    """The checked specs of `tree`, flattened as `flat` (key path, leaf)."""
    if not flat:
        if prefix == "like":
            raise InvalidStateError(
                f"{where()}: like has no leaves, so there is nothing to restore into (got "
                f"{type(tree).__name__}). Fix: pass a pytree shaped like the saved state: "
                "the initial state, or jax.eval_shape of the function that makes it."
            )
        raise InvalidStateError(
            f"{where()}: the {prefix} has no leaves, so there is nothing to save "
            f"(got {type(tree).__name__}). Fix: pass the pytree of arrays to save."
        )
    specs = []
    seen: dict[str, str] = {}
    for key_path, leaf in flat:
        path = prefix + jax.tree_util.keystr(key_path)
        name = tuple(_key_name(e, path, free=free_names) for e in key_path)
        name = name or (_ROOT_NAME,)
        joined = ".".join(name)
        if joined in seen:
            raise InvalidStateError(
                f"{where()}: leaves {seen[joined]} and {path} would be stored under the "
                f"same name {joined!r}. Fix: give them distinct keys (e.g. do not mix "
                "int and str keys that print the same)."
            )
        seen[joined] = path
        specs.append(leaf_spec(path, name, leaf, abstract_ok=abstract_ok))
    _check_prefixes(specs)
    return tuple(specs)


def _check_prefixes(specs: list[LeafSpec]) -> None:
    """A stored name cannot be both a leaf and a node (`{'a': x, 'a.b': y}` style)."""
    names = {spec.name: spec.path for spec in specs}
    for spec in specs:
        for cut in range(1, len(spec.name)):
            if spec.name[:cut] in names:
                raise InvalidStateError(
                    f"{where()}: leaf {names[spec.name[:cut]]} would be stored where "
                    f"{spec.path} needs a sub-tree. Fix: give them distinct keys."
                )
