"""What a save hands over: for each leaf, the array that crosses through JAX (key data
for typed keys, an owned copy of a constant) or, outside any trace, its host value;
and the step as the integer array that crosses with them.

Runs in Python while tracing (or eagerly); `_route` calls it once its state is
described (`is_tracing` says which of the two a save is).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Hashable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.core import Tracer

from .._base._errors import InvalidStateError, where
from .._base._types import Gather, PyTree
from .._layout._describe import PY_SCALARS
from .._layout._spec import KEY, LeafSpec, key_data_shape

if TYPE_CHECKING:
    from jax.typing import ArrayLike


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


def eager_values(specs: Sequence[LeafSpec], leaves: Sequence[Any]) -> list[Any]:
    """Every leaf's host value, for a save made outside any trace (`eager_value`)."""
    return [eager_value(spec, leaf) for spec, leaf in zip(specs, leaves, strict=True)]


class Split(NamedTuple):
    """A traced save's leaves: those Python knows (`constants`, by index: copied now,
    they never cross), and the rest (`payload`, the arrays that cross; `crossing`, their
    indices; `ndims`, each leaf's number of dimensions as it is handed over)."""

    constants: tuple[tuple[int, np.ndarray], ...]
    payload: list[jax.Array]
    crossing: list[int]
    ndims: tuple[int, ...]


def split(
    specs: Sequence[LeafSpec], leaves: Sequence[Any], gather: Gather, axis_name: Hashable | None
) -> Split:
    """Inside a trace: leaves Python knows are constants of the program are copied now and
    never cross through JAX (which would narrow 64-bit dtypes); concatenated over devices
    (`gather="concat"`) they must cross, to be concatenated like the rest. A zero-size
    leaf is only a shape: nothing crosses (nor is all_gathered, which crashes some XLA
    versions on zero-size operands)."""
    constants, payload, crossing = [], [], []
    for index, (spec, leaf) in enumerate(zip(specs, leaves, strict=True)):
        if is_constant(leaf) and gather != "concat":
            constants.append((index, host_copy(spec, leaf)))
        elif 0 in spec.shape:
            shape = spec.shape
            if gather == "concat":  # the global shape: blocks along the first axis
                assert axis_name is not None  # (_route: concat needs an axis_name)
                shape = (shape[0] * axis_size(axis_name), *shape[1:])
            constants.append((index, empty_data(spec, shape)))
        else:
            payload.append(to_payload(spec, leaf))
            crossing.append(index)
    known, crossed = dict(constants), iter(payload)
    ndims = tuple(known[i].ndim if i in known else next(crossed).ndim for i in range(len(specs)))
    return Split(tuple(constants), payload, crossing, ndims)


def traced_step(step: ArrayLike, value: int | None) -> jax.Array:
    """`step` as the integer array that crosses through JAX (checked to fit)."""
    if value is not None:
        dtype = jax.dtypes.canonicalize_dtype(getattr(step, "dtype", np.int64))
        if value > np.iinfo(dtype).max:
            raise InvalidStateError(
                f"{where()}: step {value} does not fit {np.dtype(dtype).name}, JAX's integer "
                "type here (jax_enable_x64 is off), and would wrap around. Fix: enable "
                "x64 (jax.config.update('jax_enable_x64', True)), save eagerly (outside "
                "jit, where steps are exact), or number steps below 2**31."
            )
        return jnp.asarray(value, dtype)
    return jnp.asarray(step)


def is_tracing(*values: PyTree) -> bool:
    """Are we inside a trace (jit, scan, vmap, grad, ...) rather than running eagerly?

    Either an argument is a tracer, or a fresh array is one: inside `jit` even a function
    of constants only is staged out and runs later, so it must save at run time.
    """
    leaves = jax.tree_util.tree_leaves(values)
    if any(isinstance(leaf, Tracer) for leaf in leaves):
        return True
    if _trace_state_clean is not None and _trace_state_clean():
        return False  # no trace at all (JAX's own test; 0.1 ms less than the array's)
    return isinstance(jnp.zeros(()), Tracer)


# JAX's "no trace and no named axis is active" (private; where it is missing, the fresh
# array alone decides). True only where jnp.zeros(()) would be concrete.
_trace_state_clean: Callable[[], bool] | None
try:
    from jax._src.core import trace_state_clean as _trace_state_clean
except ImportError:  # pragma: no cover - a JAX that moved it
    _trace_state_clean = None


# What JAX's traces say they were made for (`DebugInfo.traced_for`): the body of a loop,
# which runs once per iteration; and a branch of a conditional, which may not.
_LOOP_BODIES = {"scan": "lax.scan", "fori_loop": "lax.fori_loop", "while_body": "lax.while_loop"}
_BRANCHES = {"cond", "switch", "while_cond"}


def loop_body() -> str | None:
    """The loop ("lax.scan", "lax.fori_loop", "lax.while_loop") whose body is being
    traced now, or None: outside any loop, in a branch of a `cond` (a save there may be
    meant to happen once), or where JAX does not say. The traces are walked from the
    innermost outwards: `vmap`/`grad` traces and staged functions such as a `jit` called
    inside the body are passed over, a loop body or a branch decides. Reads JAX's
    private trace context (`jax._src.core.trace_ctx`); a JAX without it gives None."""
    trace = getattr(getattr(_core, "trace_ctx", None), "trace", None)
    while trace is not None:
        info = getattr(getattr(trace, "frame", None), "debug_info", None)
        traced_for = getattr(info, "traced_for", None)
        if traced_for in _BRANCHES:
            return None
        if traced_for in _LOOP_BODIES:
            return _LOOP_BODIES[traced_for]
        trace = getattr(trace, "parent_trace", None)
    return None


def loops_run_once() -> bool:
    """Does every loop whose body is being traced run exactly once (a `lax.scan` of
    length 1, a `fori_loop(0, 1, ...)`)? A constant step saved there is not repeated.
    JAX's traces do not say a scan's length; its `scan` function knows it (its local
    `length`, set before the body is traced), so the frames of JAX's loops on the stack
    decide: every scan's length 1, and no `while_loop` (no trip count). False wherever
    unsure (a JAX whose loops differ): the warning then stays."""
    frame, seen = sys._getframe(1), False
    while frame is not None:
        code = frame.f_code
        if code.co_filename == _LOOPS_FILE and code.co_name in ("scan", "scan_nocarry"):
            length = frame.f_locals.get("length")
            if type(length) is not int or length != 1:
                return False
            seen = True
        elif code.co_filename == _LOOPS_FILE and code.co_name == "while_loop":
            return False
        frame = frame.f_back
    return seen


try:
    from jax._src import core as _core
except ImportError:  # pragma: no cover - a JAX that moved it
    _core = None

# The file of JAX's lax.scan and lax.while_loop (private; missing: never "once").
try:
    from jax._src.lax.control_flow import loops as _loops

    _LOOPS_FILE: str | None = _loops.__file__
except ImportError:  # pragma: no cover - a JAX that moved it
    _LOOPS_FILE = None


def axis_size(axis_name: Hashable) -> int:
    """How many devices the mapped axis (or axes) `axis_name` spans, while tracing."""
    names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
    return int(np.prod([jax.lax.axis_size(name) for name in names]))
