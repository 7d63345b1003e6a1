"""What one leaf of a save hands over: the array that crosses through JAX (key data
for typed keys, an owned copy of a constant), or, outside any trace, its host value.

Runs in Python while tracing (or eagerly); `_route` calls it for each leaf of a plan.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._base._errors import InvalidStateError, where
from .._layout._describe import PY_SCALARS
from .._layout._spec import KEY, LeafSpec, key_data_shape


def is_constant(leaf: Any) -> bool:
    """A leaf whose value Python knows (numpy arrays and scalars, Python numbers): inside
    a trace it is a constant of the compiled program."""
    return isinstance(leaf, (np.ndarray, np.generic, *PY_SCALARS))


def host_copy(spec: LeafSpec, leaf: Any) -> np.ndarray:
    """An owned copy of a constant leaf with its exact dtype (a later in-place change of
    the caller's array does not reach the checkpoint)."""
    return np.array(leaf, dtype=np.dtype(spec.dtype), copy=True)


def empty_data(spec: LeafSpec, shape: tuple[int, ...]) -> np.ndarray:
    """The stored data of a zero-size leaf of `shape` (all there is to it is its shape)."""
    trailing = key_data_shape(spec.impl) if spec.kind == KEY else ()
    return np.zeros(shape + trailing, np.dtype(spec.dtype))


def to_payload(spec: LeafSpec, leaf: Any) -> Any:
    """The array that crosses through JAX for one leaf: key data for keys."""
    if spec.kind == KEY:
        return jax.random.key_data(leaf)
    if is_constant(leaf):
        value = host_copy(spec, leaf)
        if np.dtype(jax.dtypes.canonicalize_dtype(value.dtype)) != value.dtype:
            raise InvalidStateError(
                f"{where()}: leaf {spec.path} is a {value.dtype} constant, which JAX would "
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
