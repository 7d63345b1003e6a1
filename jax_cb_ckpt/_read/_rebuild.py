"""The read side of a pytree: whether a saved leaf restores into a `like` leaf
(`check_like`, `compatible`), each restored leaf rebuilt as the `like` leaf's type and
placement (`rebuild`), and `same_bits`, what a resumed run promises to match.

Runs in the caller's thread after the arrays were read; `rebuild` may place arrays on
devices (`jax.device_put`), which returns once the transfer is enqueued.
"""

from __future__ import annotations

import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax._src.lax import lax as _jax_lax  # private: see _weakly_typed
from jax.sharding import NamedSharding, PartitionSpec

from .._base import _dtypes
from .._base._dtypes import ML_DTYPES
from .._base._errors import StructureMismatchError, where
from .._base._types import PyTree
from .._layout._describe import PY_SCALARS
from .._layout._describe import is_key as _is_key
from .._layout._spec import ARRAY, KEY, SCALAR, LeafSpec


def check_like(
    like_specs: tuple[LeafSpec, ...], saved: tuple[LeafSpec, ...], *, partial: bool = False
) -> None:
    """Raise `StructureMismatchError` naming the first leaf where `like` and the save
    differ; with `partial` (`partial_restore=True`), a saved leaf `like` lacks is left out."""
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
                f"{where()}: leaf {spec.path} ({spec.describe()}) is not in the "
                f"checkpoint, which has {len(saved)} leaves under the top-level keys "
                f"[{shown}] (a `like` nested one level too deep or too shallow shows "
                "here)." + fix
            )
        if not compatible(spec, other):
            raise StructureMismatchError(
                f"{where()}: leaf {spec.path} differs: the checkpoint has "
                f"{other.describe()}, like has {spec.describe()}." + fix
            )
    for other in () if partial else saved:
        if other.name not in like_names:
            raise StructureMismatchError(
                f"{where()}: the checkpoint has leaf {other.path} ({other.describe()}), "
                "which like does not have." + fix + " To restore only like's leaves (the "
                "parameters without the optimizer state, say), pass partial_restore=True."
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


def rebuild(like_leaf: Any, spec: LeafSpec, saved: LeafSpec, array: Any) -> Any:
    """One restored leaf, of the same type as the `like` leaf, from `array`: the leaf's
    data as saved, a numpy array the caller gives up (it is returned as it is where
    `like` wants numpy of its dtype: no copy), or a placed `jax.Array`."""
    free = loose(like_leaf)
    if free is None:
        return _rebuild(like_leaf, spec, saved, array)
    # An uncommitted `like` leaf: what is made from host data lands on its device,
    # uncommitted (weak type and key type kept), as the default device's would.
    with jax.default_device(next(iter(free.device_set))):
        return _rebuild(like_leaf, spec, saved, array)


def _rebuild(like_leaf: Any, spec: LeafSpec, saved: LeafSpec, array: Any) -> Any:
    if saved.kind == SCALAR and spec.kind == ARRAY and saved.dtype != spec.dtype:
        cast = _dtypes.exact_cast(np.asarray(array), _dtypes.named(spec.dtype))
        if cast is None:  # (exactly: the same number back, NaN as NaN; no numpy warning)
            raise StructureMismatchError(
                f"{where()}: leaf {spec.path}: the checkpoint has the Python number "
                f"{array.item()!r}, which like's {spec.describe()} cannot hold exactly. "
                "Fix: restore into a Python number or a wider dtype."
            )
        array = cast
    if saved.kind == KEY:
        sharding = getattr(like_leaf, "sharding", None)
        if isinstance(sharding, NamedSharding) and not sharding.is_fully_addressable:
            # Across processes: place the key data (one more axis) and wrap it there.
            data_spec = PartitionSpec(*sharding.spec, *[None] * (array.ndim - len(sharding.spec)))
            data = _put(jnp.asarray(array), NamedSharding(sharding.mesh, data_spec))
            return jax.random.wrap_key_data(data, impl=saved.impl)
        key = jax.random.wrap_key_data(jnp.asarray(array), impl=saved.impl)
        return _place(key, like_leaf)
    if isinstance(like_leaf, PY_SCALARS):
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
        and _placed_as(array, like_leaf)
    ):
        return array  # placed already, as like wants it (`_restore`)
    # A weakly typed leaf the loop carried in another dtype comes back as stored, as
    # the loop carries it (strongly typed); one stored in its own dtype stays weak.
    carried = carried_as(spec, saved)
    dtype = saved.dtype if carried else spec.dtype
    if isinstance(array, np.ndarray):
        # device_put, not jnp.asarray: on a CPU it adopts an aligned host array without
        # a copy (the read allocates aligned arrays, `_arrays`); jnp.asarray always copies
        # (256 MiB: ~100 ms here, ~260 ms from unaligned memory).
        value = jax.device_put(np.asarray(array, dtype=dtype))
    else:
        value = jnp.asarray(array, dtype=dtype)
    if weak and not carried:
        value = _weakly_typed(value)
    return _place(value, like_leaf)


def _weakly_typed(value: jax.Array) -> jax.Array:
    """`value` marked weakly typed, as the `like` leaf is (a Python-number-derived scalar
    of a carry): a strong leaf would change type promotion in a resumed program, and a
    scan whose carry goes in strong and comes out weak fails to trace. JAX has no public
    call for it; its internal one is used, and checked by the tests on every JAX we test."""
    weak = _jax_lax._convert_element_type(value, value.dtype, weak_type=True)
    return weak  # pyright: ignore[reportReturnType]


def loose(like_leaf: Any) -> jax.sharding.Sharding | None:
    """The sharding (one device) of a `like` leaf that is an uncommitted `jax.Array`
    (made on the host: `jnp.zeros`, `jax.random.split`, not put on a device by name),
    else None. Its restored leaf is uncommitted on that device too: JAX moves an
    uncommitted array to wherever a computation runs (a `pmap` splits it over its
    devices) and refuses a committed one placed elsewhere, so a committed copy would be
    refused by a program that took the leaf it was restored from."""
    if not isinstance(like_leaf, jax.Array) or like_leaf.committed:
        return None
    sharding = like_leaf.sharding
    return sharding if len(sharding.device_set) == 1 else None


def put_loose(values: list[Any], sharding: jax.sharding.Sharding) -> list[jax.Array]:
    """`values` (host arrays) put uncommitted on the one device of `sharding` (`loose`),
    as `jax.device_put` without a device puts them on the default device (one call for
    all of them)."""
    with jax.default_device(next(iter(sharding.device_set))):
        return jax.device_put(values)


def _placed_as(array: jax.Array, like_leaf: Any) -> bool:
    """Whether `array` sits where the `like` leaf does: with its sharding (where it
    says one), committed exactly where the `like` leaf is."""
    sharding = getattr(like_leaf, "sharding", None)
    if sharding is None:
        return True
    return array.sharding == sharding and array.committed == (loose(like_leaf) is None)


def _place(value: jax.Array, like_leaf: Any) -> jax.Array:
    """Put a restored array where the `like` leaf lives (its sharding), when it says;
    committed only where the `like` leaf is (`loose`). A sharding over several
    processes' devices gets this process's blocks only (every process holds the whole
    value here; `device_put` refuses devices of others)."""
    sharding = getattr(like_leaf, "sharding", None)
    if sharding is None:
        return value
    if loose(like_leaf) is not None:
        if not value.committed and value.sharding.device_set == sharding.device_set:
            return value
        if _is_key(value.dtype):  # (numpy holds no typed key: its data, wrapped again)
            data = _place(jax.random.key_data(value), like_leaf)
            return jax.random.wrap_key_data(data, impl=jax.random.key_impl(value))
        moved = put_loose([np.asarray(value)], sharding)[0]
        return _weakly_typed(moved) if value.weak_type else moved
    return _put(value, sharding)


def _put(value: jax.Array, sharding: jax.sharding.Sharding) -> jax.Array:
    """`value` placed with `sharding`, committed (see `_place`)."""
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
