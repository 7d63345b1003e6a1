"""The traced side of a save: checks in Python while tracing, then one guarded crossing.

The crossing (one `Crossing` object, chosen where the save is planned: _crossing.py) is
compiled in inside our own `lax.cond`, inside a `jax.custom_batching.custom_vmap`, on
`stop_gradient`-ed leaves. Each layer is there for a transformation (docs/transforms.md
and docs/handoff.md have the evidence):

- `lax.cond`: the predicate is evaluated on the device and only the true branch holds
  the crossing, so steps that do not save move no data to the host.
- `custom_vmap`: under `vmap` a `cond` with a batched predicate becomes a `select` that
  runs both branches (a callback in it would fire for every member on every step). Our
  batching rule instead does one `cond(any(wanted))` for the whole batch: one crossing per
  save step, carrying the per-member mask. Nested `vmap` applies the rule again.
- `stop_gradient`: a checkpoint saves primal values and must not touch gradients.
- The crossing itself (`Crossing.emit`): a pure `buffer_callback` kept alive by a
  `jax.debug.callback` (_buffer.py, _cuda.py), or a `jax.debug.callback` with the
  leaves (_callback.py, the fallback); each module says why its callbacks are those.
- Unordered: ordered effects are refused for programs on more than one device. Order is
  not needed: `jax.effects_barrier()` waits for unordered effects too, and the host side
  keys everything by step. A program's crossings may reach the host in any order (XLA
  runs them as their data is ready: on a GPU an unrolled loop's step 0 came after its
  step 4); the exchange judges the order of steps only across `wait()` (`settle`). Inside
  `pmap`/`shard_map` every device makes its own call: with `axis_name=` naming all
  the map's axes each device hands over its own block and the host assembles one step
  (`_per_device_in_map`, _shards.py); under `vmap` inside the map, naming only some
  axes, or with `gather="replicated"`, the state is gathered (or not, replicated) and
  the first device saves (`_gather_and_save`). With `shardings=` every device hands
  over its own block too (`cross_sharded`), by the crossing's `per_device()`.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import threading
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
from jax.core import Tracer

from .._base import _warn
from .._base._errors import ConstantStepWarning, InvalidStateError, shown, where
from .._base._types import Gather
from .._handoff._shards import Layout
from .._layout._format import MAX_STEP
from ._values import loop_body, loops_run_once

if TYPE_CHECKING:
    from jax.sharding import AbstractMesh, Mesh
    from jax.typing import ArrayLike

    from .._layout._spec import Signature
    from ._crossing import Crossing, Host
    from ._route import Traced

# One save's crossing, `save(step, wanted, payload)` (`_batched_save`).
_Save = Callable[[jax.Array, jax.Array, list[jax.Array]], object]


def _value_text(x: object) -> str:
    dtype = getattr(x, "dtype", None)
    shape = getattr(x, "shape", None)
    if dtype is not None and shape is not None:
        return f"{dtype}[{','.join(str(d) for d in shape)}]"
    return f"{type(x).__name__} ({shown(x)})"


def check_step(step: Any) -> int | None:
    """Check `step` (whatever the user passed: hence `Any`); returns its value when
    Python knows it (None for a tracer).

    A known step is checked here, in the caller's thread: it must be >= 0, and one that
    will cross through JAX must fit JAX's integer type (int32 unless jax_enable_x64),
    which would otherwise wrap it silently (2**32 + 5 would be saved as step 5).
    """
    ok = not isinstance(step, bool) and (
        isinstance(step, int)
        or (hasattr(step, "dtype") and jnp.issubdtype(step.dtype, jnp.integer))
    )
    if ok and jnp.shape(step) != ():
        ok = False
    if not ok:
        if isinstance(step, float):
            cast = f"pass int(step) for a Python float (int({shown(step)}))"
        else:
            cast = "cast with step.astype(jnp.int32) if it is a float array"
        raise InvalidStateError(
            f"{where()}: step must be an integer scalar (a Python int or an integer array "
            f"of shape ()), got {_value_text(step)}. Fix: pass the loop counter (e.g. the "
            f"scan index or TrainState.step), {cast}, or index out a single element if "
            "it is batched."
        )
    if isinstance(step, Tracer):
        return None
    value = int(step)
    if not 0 <= value <= MAX_STEP:
        raise InvalidStateError(
            f"{where()}: step {value} is out of range; checkpoint steps are integers from "
            f"0 to 2**63-1 (they name the step directories). Fix: pass the loop counter, "
            "e.g. the scan index or TrainState.step."
        )
    return value


def warn_if_constant_in_loop(step: int, due: bool) -> None:
    """A step Python knows, saved from the body of a loop without a traced predicate:
    the body is traced once, so every iteration asks for this same step (a counter
    bumped in the body, `step += 1`, counts traces, not iterations). Said while
    tracing (`ConstantStepWarning`): at run time the saves would be dropped as
    duplicates, or, at a step that is not due, never made at all. Not said where every
    loop around runs once (`loops_run_once`: a scan of length 1)."""
    loop = loop_body()
    if loop is None or loops_run_once():
        return
    what = (
        f"every iteration saves step {step}: the first is written, the others are dropped "
        "as duplicates"
        if due
        else f"step {step} is not a saving step, so no iteration saves anything"
    )
    _warn.warn(
        f"{where()}: step {step} is a Python number inside a {loop} body, which is traced "
        f"once: {what} (a counter bumped in the body, `step += 1`, counts traces, not "
        "iterations). Fix: pass the loop's counter, traced: `i + 1` for the index `i` of "
        "a scan (`jnp.arange(n)` as xs) or fori_loop (checkpoint k = the state after k "
        "updates), or a step carried in the state (TrainState.step); or, to save one "
        "step only once, a traced when= (when=i == n - 1).",
        ConstantStepWarning,
    )


def check_when(when: Any) -> jax.Array:
    """`when` (whatever the user passed: hence `Any`) as a boolean scalar array, or an
    error that says how to fix it."""
    ok = isinstance(when, bool) or (
        hasattr(when, "dtype") and jnp.issubdtype(when.dtype, jnp.bool_)
    )
    if ok and jnp.shape(when) != ():
        ok = False
    if not ok:
        raise InvalidStateError(
            f"{where()}: when must be a boolean scalar (a Python bool or a bool array of "
            f"shape ()), got {_value_text(when)}. Fix: compare to get a bool, e.g. "
            "when=(step % 500 == 0) | done."
        )
    return jnp.asarray(when)


class _Live(threading.local):
    """The predicates of the `ckpt.while_loop`s whose body this thread is tracing,
    outermost first (tracing is per thread)."""

    def __init__(self) -> None:
        self.stack: list[jax.Array] = []


_LIVE = _Live()

# While a `ckpt.while_loop`'s body is traced, a value of its own (`_BODIES`) in JAX's
# cache keys: a function traced there (a jitted step, a scan body defined elsewhere)
# reads `_LIVE`, a tracer of that body, which JAX cannot see as an input; without it,
# JAX's tracing caches would hand that jaxpr, holding the dead tracer, to a later
# call outside the loop (UnexpectedTracerError).
_BODY_KEY = jax.make_user_context(None)
_BODIES = itertools.count()


@contextlib.contextmanager
def members_live(live: ArrayLike) -> Iterator[None]:
    """While a `ckpt.while_loop`'s body is traced: every save traced in it holds only
    where `live` (the loop's predicate on the carry the body got) holds.

    Why: under `vmap` a `while_loop` whose predicate differs across members runs the
    body for every member while any goes on, and a `select` after the body (JAX's
    lowering, which no save can see) throws away the results of the members whose
    predicate was false. A save in the body would hand over, for such a finished
    member, a state it never had, at a step its frozen counter asks again and again.
    The predicate is exactly the mask of that select: a member is live in this
    iteration if and only if it holds. Unbatched, it holds in every iteration the body
    runs."""
    _LIVE.stack.append(jnp.asarray(live))
    try:
        with _BODY_KEY(next(_BODIES)):
            yield
    finally:
        _LIVE.stack.pop()


def live_members() -> jax.Array | None:
    """Where the saves being traced may hold (the predicates of the enclosing
    `ckpt.while_loop`s, all of them), or None outside any."""
    if not _LIVE.stack:
        return None
    return functools.reduce(jnp.logical_and, _LIVE.stack)


def only_live(
    wanted: bool, condition: jax.Array | None, step: ArrayLike, step_value: int | None
) -> tuple[bool, jax.Array | None, ArrayLike, int | None]:
    """A save's (wanted, condition, step, step_value) held to the members that are live
    in the enclosing `ckpt.while_loop`s (`members_live`); as they are outside any.

    Within one, the step that crosses says which members had left the loop: theirs is
    `-1 - step` (negative, where a step never is; `_host._member_steps` reads it
    back), so that the step records them (`meta["left"]`): their data there is the
    body's leftover, not a state they had. A member that left never asks (its
    condition is false), so the step of the save is always a live member's."""
    live = live_members()
    if live is None or not wanted:
        return wanted, condition, step, step_value
    condition = live if condition is None else jnp.logical_and(condition, live)
    step = jnp.asarray(step)
    if not jnp.issubdtype(step.dtype, jnp.signedinteger):  # (-1 - step must not wrap)
        step = step.astype(jax.dtypes.canonicalize_dtype(jnp.int64))
    return True, condition, jnp.where(live, step, -1 - step), None


def send(host: Host, route: Traced) -> None:
    """Compile in a traced save's crossing, as planned (`_route.Traced`): device by
    device (`route.layout`: `shardings=`), else gathered or in a map (`cross`)."""
    if route.layout is not None:
        assert route.mesh is not None  # (a route's layout and mesh are set together)
        cross_sharded(
            host,
            route.crossing,
            route.signature,
            route.layout,
            route.mesh,
            route.step,
            route.payload,
            route.condition,
        )
        return
    cross(
        host,
        route.crossing,
        route.signature,
        route.step,
        route.payload,
        route.condition,
        axis_name=route.axis_name,
        gather=route.gather,
    )


def cross(
    host: Host,
    crossing: Crossing,
    signature: Signature,
    step: jax.Array,
    payload: list[jax.Array],
    wanted: jax.Array | None,
    *,
    axis_name: Hashable | None = None,
    gather: Gather = "stack",
) -> None:
    """Hand `payload` to the host (`host.receive`, by `crossing`), if `wanted`.

    `wanted` is the device-side decision to save: a bool scalar, traced or not (under
    `vmap`, the rule makes it the per-member mask the host receives); with `wanted=None`
    the crossing is unconditional. Blocks the device program (not the
    Python caller) until the host side has taken the data. With `axis_name` (inside
    `pmap`/`shard_map`) naming all of the map's axes, each device hands over its own
    block (stacked on a new axis, or along the first axis when `gather="concat"`) and
    nothing is gathered; otherwise (some of the axes, `vmap` inside the map, or
    `gather="replicated"`) the state is gathered along that axis (not at all when
    `"replicated"`) and handed over once, by the first device.
    """
    payload = [jax.lax.stop_gradient(p) for p in payload]
    always = wanted is None and axis_name is None
    wanted = jnp.asarray(True) if wanted is None else wanted
    save = _batched_save(host, crossing, signature, always=always)
    if axis_name is None:
        save(step, wanted, payload)
        return
    names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
    manual = set(jax.sharding.get_abstract_mesh().manual_axes)
    if gather != "replicated" and set(names) == manual and payload:
        # Every device hands over its own block; nothing is gathered (_shards.py).
        crossing = crossing.per_device()
        _per_device_in_map(host, crossing, signature, step, wanted, payload, names, gather)
        return
    _gather_and_save(save, step, wanted, payload, axis_name, gather)


def _gather_and_save(
    save: _Save,
    step: jax.Array,
    wanted: jax.Array,
    payload: list[jax.Array],
    axis_name: Hashable,
    gather: Gather,
) -> None:
    """Gather the state along `axis_name` and let the first device save it."""
    # Every device must take the same branch around the collective below.
    anyone = jax.lax.pmax(wanted.astype(jnp.int32), axis_name) > 0

    def gather_and_save(step, wanted, payload):
        if gather != "stack":
            wanted = jnp.asarray(True)  # one state, not one per device: no per-device mask
        if gather == "concat":
            payload = [jax.lax.all_gather(p, axis_name, tiled=True) for p in payload]
        elif gather == "stack":
            payload = [jax.lax.all_gather(p, axis_name) for p in payload]
            wanted = jax.lax.all_gather(wanted, axis_name)  # per-device mask
            # Each device's own step beside its mask (under vmap a member's may be its
            # own, `-1 - step` where it had left its ckpt.while_loop: `only_live`).
            step = jax.lax.all_gather(step, axis_name)

        def first_device_saves():
            save(step, wanted, payload)

        jax.lax.cond(jax.lax.axis_index(axis_name) == 0, first_device_saves, lambda: None)

    jax.lax.cond(anyone, gather_and_save, lambda *_: None, step, wanted, payload)


def _per_device_in_map(host, crossing, signature, step, wanted, payload, names, gather):
    """Inside `pmap`/`shard_map` over exactly the axes `names`: each device crosses with
    its own block. `"stack"`: the saved leaf gets a leading axis of one block per device
    (the per-device mask, a few bytes, is gathered and travels along); `"concat"`: the
    blocks make up the leaf's first axis (0-d leaves: device 0's). Under `vmap` the
    batched state takes the gather path instead, exactly as before."""
    sizes = tuple(int(jax.lax.axis_size(name)) for name in names)
    fallback = _batched_save(host, crossing, signature)

    @jax.custom_batching.custom_vmap
    def save(step, wanted, payload):
        anyone = jax.lax.pmax(wanted.astype(jnp.int32), names) > 0
        if gather == "stack":
            blocks = [p[None] for p in payload]
            mask = jax.lax.all_gather(wanted, names).reshape(-1)
        else:
            blocks = list(payload)
            mask = jnp.asarray(True)
        dims = tuple((names,) if b.ndim else () for b in blocks)
        layout = Layout(names, sizes, dims)

        def branch(step, mask, blocks):
            _device_crosses(host, crossing, signature, layout, step, mask, blocks)

        jax.lax.cond(anyone, branch, lambda *_: None, step, mask, blocks)
        return ()

    @save.def_vmap
    def _rule(axis_size, in_batched, step, wanted, payload):
        _check_batched_metrics(signature)
        step_b, wanted_b, payload_b = in_batched
        in_axes = (
            0 if step_b else None,
            0 if wanted_b else None,
            [0 if b else None for b in payload_b],
        )
        jax.vmap(
            lambda s, p, x: _gather_and_save(fallback, s, p, x, names, gather),
            in_axes=in_axes,
            axis_size=axis_size,
        )(step, wanted, payload)
        return (), ()

    save(step, wanted, payload)


def cross_sharded(
    host: Host,
    crossing: Crossing,
    signature: Signature,
    layout: Layout,
    mesh: Mesh | AbstractMesh,
    step: jax.Array,
    payload: list[jax.Array],
    wanted: jax.Array | None,
) -> None:
    """Hand `payload` to the host device by device (`shardings=`; see _shards.py).

    Inside the `cond`, a `shard_map` over `mesh` gives every device its own block of each
    leaf (partitioned as `layout` says) and its coordinates in the mesh; each device
    crosses with those only. Under `vmap` the batched state is saved gathered instead
    (the `cross` path), since the batch axis is not part of the layout.
    """
    payload = [jax.lax.stop_gradient(p) for p in payload]
    wanted = jnp.asarray(True) if wanted is None else wanted
    specs = layout.partition_specs
    crossing = crossing.per_device()
    replicated = jax.sharding.PartitionSpec()

    def per_device(step, wanted, *blocks):
        _device_crosses(host, crossing, signature, layout, step, wanted, list(blocks))
        return ()

    @jax.custom_batching.custom_vmap
    def save(step, wanted, payload):
        def each_device(step, wanted, payload):
            jax.shard_map(
                per_device,
                mesh=mesh,
                in_specs=(replicated, replicated, *specs),
                out_specs=(),
                check_vma=False,
            )(step, wanted, *payload)

        try:
            jax.lax.cond(wanted, each_device, lambda *_: None, step, wanted, payload)
        except ValueError as e:
            if "devices" not in str(e):
                raise
            raise InvalidStateError(
                f"maybe_save(shardings=...): the shardings' mesh {dict(mesh.shape)} is not "
                f"made of the devices the program runs on, in their order: {e}. Fix: "
                "pass the shardings of the state's own mesh (e.g. x.sharding)."
            ) from e
        return ()

    @save.def_vmap
    def _rule(axis_size, in_batched, step, wanted, payload):
        _check_batched_metrics(signature)
        _batched_save(host, crossing, signature, levels=((axis_size, in_batched),))(
            step, wanted, payload
        )
        return (), ()

    save(step, wanted, payload)


def _device_crosses(host, crossing, signature, layout, step, mask, blocks) -> None:
    """One device's crossing with its own `blocks` and its coordinates in the mesh (in a
    manual context: `shard_map` or `pmap`); see _shards.py."""
    coords = jnp.stack([jax.lax.axis_index(name) for name in layout.axis_names])
    crossing.emit_blocks(host, signature, layout, step, mask, coords, blocks)


# The vmaps applied to a save so far, outermost first: (axis size, which of `step`,
# `wanted` and each payload leaf carry that axis), as a `custom_vmap` rule receives them.
Levels = tuple[tuple[int, tuple[bool, bool, list[bool]]], ...]


def _broadcast(x: jax.Array, flags: Sequence[tuple[int, bool]]) -> jax.Array:
    """`x` with the axis of every level it lacks, in place: `flags` is (size, batched)
    per level, outermost first (the axes of the levels it has are already there)."""
    x = jnp.asarray(x)
    for position, (size, batched) in enumerate(flags):
        if not batched:
            x = jnp.expand_dims(x, position)
            x = jnp.broadcast_to(x, (*x.shape[:position], size, *x.shape[position + 1 :]))
    return x


def _whole_batch(
    levels: Levels, step: jax.Array, wanted: jax.Array, payload: list[jax.Array]
) -> tuple[jax.Array, jax.Array, list[jax.Array]]:
    """A save's operands with every vmap's axis on each: the unbatched ones broadcast,
    so the host gets the whole batch and a per-member mask. Done inside the save's
    branch: a step that does not save broadcasts nothing."""
    return (
        _broadcast(step, [(size, b[0]) for size, b in levels]),
        _broadcast(wanted, [(size, b[1]) for size, b in levels]),
        [_broadcast(p, [(size, b[2][i]) for size, b in levels]) for i, p in enumerate(payload)],
    )


def _batched_save(
    host: Host,
    crossing: Crossing,
    signature: Signature,
    *,
    always: bool = False,
    levels: Levels = (),
) -> _Save:
    """`save(step, wanted, payload)`: one crossing when any member's `wanted` holds
    (`always`: the save is unconditional, and crosses with no `cond` around it).

    Unbatched, `wanted` is a scalar. Each `vmap` applied from outside gives the host its
    axis on `wanted`, `step` and every payload leaf (`levels`: the rule makes a new save
    that knows it), so the host gets the whole batch with a leading axis per `vmap` and
    the per-member mask. Operands go into the `cond` as they are and are broadcast in
    its branch: each one that enters is a thunk in the loop body at every step, and
    XLA:CPU runs a body of up to 8 thunks in order, a longer one through its dataflow
    executor (~0.5 us a step more on a tiny step; docs/benchmarks.md).
    """

    @jax.custom_batching.custom_vmap
    def save(step, wanted, payload):
        def branch(step, wanted, payload):
            step, wanted, payload = _whole_batch(levels, step, wanted, payload)
            crossing.emit(host, signature, step, wanted, payload)

        if always:
            branch(step, wanted, payload)
        elif jnp.ndim(wanted) == 0:
            # One decision for every member: the branch runs only when it holds, so
            # `wanted` is not passed in (an operand, and a thunk, less). A vmap over
            # no member has nothing to save (as `any` of its empty mask says).
            if any(size == 0 for size, _ in levels):
                return ()
            jax.lax.cond(
                wanted,
                lambda step, payload: branch(step, jnp.asarray(True), payload),
                lambda *_: None,
                step,
                payload,
            )
        else:
            jax.lax.cond(jnp.any(wanted), branch, lambda *_: None, step, wanted, payload)
        return ()

    @save.def_vmap
    def _rule(axis_size, in_batched, step, wanted, payload):
        _check_batched_metrics(signature)
        level = ((axis_size, in_batched),)
        _batched_save(host, crossing, signature, always=always, levels=level + levels)(
            step, wanted, payload
        )
        return (), ()

    return save


def _check_batched_metrics(signature: Signature) -> None:
    """Under vmap a metric is one scalar per member (stored in the batch's shape, ranked
    per member): a 1-D metric, allowed for a batch held without vmap, would be stored
    with the batch's axes and its own, and rank members that are not there."""
    for spec in signature.specs[signature.state_leaves :]:
        if spec.shape != ():
            raise InvalidStateError(
                f"maybe_save(metrics=...) under vmap: {spec.path} is {spec.describe()} per "
                "member; under vmap a metric is one real number per member (it is stored "
                "with the batch's shape and ranked per member). Fix: reduce it first (e.g. "
                "jnp.mean), or keep arrays in the state."
            )
