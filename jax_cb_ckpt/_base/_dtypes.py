"""Dtypes, in one place: which a checkpoint stores, how XLA lays them out, and how each
is stored where TensorStore cannot store it as it is.

- `ML_DTYPES`: the ml_dtypes types numpy reports as kind 'V' that are numbers to JAX
  and Orbax (`_describe.py` accepts them in a state);
- `PACKED_AS`, `packed`: the types XLA packs several to a byte (the crossing,
  `_traced.py`, widens them on the device);
- `storage_dtype`, `storable`, `from_storage`: the exact widening (or bits) a type is
  stored as, and back (the writer and restore).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from numpy.typing import DTypeLike

# ml_dtypes types numpy reports as kind 'V'; JAX and Orbax handle them as numbers.
ML_DTYPES = ("bfloat", "float8", "float6", "float4", "int2", "int4", "uint2", "uint4")

# Dtypes XLA packs several to a byte (numpy views them one per byte), and the exact
# byte-per-element dtype each is widened to where that matters (float4 types: float32).
PACKED_AS = {"int2": np.int8, "uint2": np.uint8, "int4": np.int8, "uint4": np.uint8}


def named(name: str) -> np.dtype:
    """The dtype called `name` in a checkpoint's description or `.zarray`: numpy's, or
    an ml_dtypes type (bfloat16, float8_*, int4, ...), imported only then (~0.5 s: the
    command line reads numpy-only steps without it). TypeError for an unknown name."""
    if not isinstance(name, str):
        # numpy would read None as float64 and a dict as a structured dtype: a hostile
        # `.zarray` may give any JSON.
        raise TypeError(f"a dtype name must be a string, got {type(name).__name__} {name!r}")
    try:
        return np.dtype(name)
    except TypeError:
        if not name.startswith(ML_DTYPES):
            raise
    import ml_dtypes  # noqa: F401  registers its types with numpy by name

    return np.dtype(name)


def packed(dtype: DTypeLike) -> bool:
    """Is `dtype` stored packed (several elements per byte) in XLA's buffers?"""
    name = np.dtype(dtype).name
    return name in PACKED_AS or name.startswith("float4")


# Dtypes JAX and numpy handle that Orbax's TensorStore cannot store (measured with
# tensorstore 0.1.x): stored widened, which is exact, and cast back on restore; or, for
# a type with NaN payloads a widening would not keep, stored as its bits.
_STORED_AS = {
    "uint2": "uint8",
    "uint4": "uint8",
    "float6_e2m3fn": "float32",  # (finite only: no NaN, so widening is exact)
    "float6_e3m2fn": "float32",
    "float8_e4m3": "uint8",  # bits: float32 kept NaN but not its payload
}
_AS_BITS = {"float8_e4m3"}
_LEGACY = {"float8_e4m3": "float32"}  # stored widened before 2026-11-30


@functools.lru_cache(maxsize=256)
def storage_dtype(dtype: np.dtype) -> np.dtype:
    """The dtype an array of `dtype` is stored as (itself, or an exact widening).
    Cached: numpy computes a dtype's name anew each time (~8 us)."""
    return np.dtype(_STORED_AS.get(dtype.name, dtype))


def storable(array: np.ndarray) -> np.ndarray:
    stored = storage_dtype(array.dtype)
    if stored == array.dtype:
        return array
    if array.dtype.name in _AS_BITS:
        array = np.asarray(array)
        return (array if array.flags.c_contiguous else array.copy()).view(stored)
    return array.astype(stored)


def from_storage(array: np.ndarray, dtype: np.dtype) -> np.ndarray | None:
    """The stored data of a leaf of `dtype` as `dtype` (undoes `storable`), or None
    when its stored dtype is not one `dtype` is stored as."""
    if array.dtype == dtype:
        return array
    if array.dtype == storage_dtype(dtype):
        if dtype.name in _AS_BITS:
            return np.asarray(array).view(dtype)
        return array.astype(dtype)
    if array.dtype.name == _LEGACY.get(dtype.name):
        return array.astype(dtype)
    return None


def exact_cast(array: np.ndarray, dtype: np.dtype) -> np.ndarray | None:
    """`array` in `dtype` when every value survives the cast exactly (cast back, it is
    the same number; NaN stays NaN, inf stays inf); None when one does not (an int out
    of range, a float not representable in `dtype`, say 0.1 as float64 into float32).
    Silent: numpy's overflow warning on a refused cast (1e300 into float32) is not the
    user's to see."""
    with np.errstate(all="ignore"):
        cast = array.astype(dtype)
        back = cast.astype(array.dtype)
    same = back == array
    if array.dtype.kind in "fc":
        same = same | (np.isnan(back) & np.isnan(array))
    return cast if bool(np.all(same)) else None
