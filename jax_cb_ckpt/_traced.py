"""The traced side of a save: checks in Python while tracing, then one guarded crossing.

The crossing is `jax.debug.callback`, inside our own `lax.cond`, inside a
`jax.custom_batching.custom_vmap`, on `stop_gradient`-ed leaves. Each layer is there for a
transformation (docs/transforms.md has the evidence):

- `lax.cond`: the predicate is evaluated on the device and only the true branch holds
  the callback, so steps that do not save move no data to the host.
- `custom_vmap`: under `vmap` a `cond` with a batched predicate becomes a `select` that
  runs both branches (a callback in it would fire for every member on every step), and
  `io_callback` in a vmapped `cond` is refused outright. Our batching rule instead does
  one `cond(any(pred))` for the whole batch: one crossing per save step, carrying the
  per-member mask. Nested `vmap` applies the rule again (seeds x hyperparameters).
- `stop_gradient`: a checkpoint saves primal values and must not touch gradients.
- Why not `io_callback`: it refuses JVP ("IO callbacks do not support JVP"), refuses
  `jax.checkpoint` (remat), and, worse, under `grad` of a `lax.scan` with
  stop-gradient inputs it is silently dropped (JAX's partial evaluation does not keep
  IO effects, so the backward pass never runs it): a training loop would save nothing.
  `debug.callback` is kept by partial evaluation, has a JVP rule that runs on primals,
  and is allowed under remat. Its documented caveat (it may be duplicated, e.g. by
  remat recomputation) is handled on the host: a step handed over twice is dropped.
- Why not `pure_callback`: it has no effect, so dead-code elimination removes it.
- Unordered: ordered debug effects are refused for programs on more than one device
  (any sharded state under `jit`), while an unordered callback on sharded arrays is made
  once, with the arrays gathered. Order is not needed: a loop's iterations run one after
  another, `jax.effects_barrier()` waits for unordered effects too, and the host side
  keys everything by step. Inside `pmap`/`shard_map` every device would make its own
  call, so there (`axis_name=` given) the state is gathered and the first device saves.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from ._errors import InvalidStateError


def _describe(x: Any) -> str:
    dtype = getattr(x, "dtype", None)
    shape = getattr(x, "shape", None)
    if dtype is not None and shape is not None:
        return f"{dtype}[{','.join(str(d) for d in shape)}]"
    return f"{type(x).__name__} ({x!r})"


def check_step(step: Any, where: str) -> jax.Array:
    """`step` as an integer scalar array, or an error that says how to fix it."""
    ok = not isinstance(step, bool) and (
        isinstance(step, int)
        or (hasattr(step, "dtype") and jnp.issubdtype(step.dtype, jnp.integer))
    )
    if ok and jnp.shape(step) != ():
        ok = False
    if not ok:
        raise InvalidStateError(
            f"{where}: step must be an integer scalar (a Python int or an integer array "
            f"of shape ()), got {_describe(step)}. Fix: pass the loop counter (e.g. the "
            "scan index or TrainState.step), cast with step.astype(jnp.int32) if it is "
            "a float, or index out a single element if it is batched."
        )
    return jnp.asarray(step)


def check_when(when: Any, where: str) -> jax.Array:
    """`when` as a boolean scalar array, or an error that says how to fix it."""
    ok = isinstance(when, bool) or (
        hasattr(when, "dtype") and jnp.issubdtype(when.dtype, jnp.bool_)
    )
    if ok and jnp.shape(when) != ():
        ok = False
    if not ok:
        raise InvalidStateError(
            f"{where}: when must be a boolean scalar (a Python bool or a bool array of "
            f"shape ()), got {_describe(when)}. Fix: compare to get a bool, e.g. "
            "when=(step % 500 == 0) | done."
        )
    return jnp.asarray(when)


def check_axis_name(axis_name: Any, where: str) -> None:
    """Inside `pmap`/`shard_map` every device would save its own part as the same step:
    require `axis_name`, and that it names a mapped axis."""
    get_mesh = getattr(jax.sharding, "get_abstract_mesh", None)
    mesh = get_mesh() if get_mesh is not None else None
    manual = tuple(getattr(mesh, "manual_axes", ()) or ())
    if axis_name is None and manual:
        raise InvalidStateError(
            f"{where} is inside pmap/shard_map over axes {manual}: every device would "
            f"save its own part of the state as the same step. Fix: pass "
            f"axis_name={manual[0]!r} (add replicated=True if the state is the same on "
            "every device, tiled=True to concatenate shard_map blocks)."
        )
    names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
    if axis_name is not None and manual and not set(names) <= set(manual):
        raise InvalidStateError(
            f"{where}: axis_name={axis_name!r} is not a pmap/shard_map axis here; the "
            f"mapped axes are {manual}."
        )


def cross(
    host_fn: Any,
    signature: Any,
    step: jax.Array,
    payload: list[Any],
    pred: Any,
    *,
    axis_name: Any = None,
    replicated: bool = False,
    tiled: bool = False,
) -> None:
    """Hand `payload` to `host_fn(signature, step, pred, *payload)` on the host, if `pred`.

    With `pred=None` the crossing is unconditional. Blocks the device program (not the
    Python caller) until the host side has taken the data. With `axis_name` (inside
    `pmap`/`shard_map`) the state is gathered along that axis (stacked, or concatenated
    when `tiled`; not at all when `replicated`) and handed over once, by the first device.
    """
    payload = [jax.lax.stop_gradient(p) for p in payload]
    pred = jnp.asarray(True) if pred is None else pred
    save = _batched_save(host_fn, signature)
    if axis_name is None:
        save(step, pred, payload)
        return
    # Every device must take the same branch around the collective below.
    anyone = jax.lax.pmax(pred.astype(jnp.int32), axis_name) > 0

    def gather_and_save(step, pred, payload):
        if replicated or tiled:
            pred = jnp.asarray(True)  # one state, not one per device: no per-device mask
        if tiled:
            payload = [jax.lax.all_gather(p, axis_name, tiled=True) for p in payload]
        elif not replicated:
            payload = [jax.lax.all_gather(p, axis_name) for p in payload]
            pred = jax.lax.all_gather(pred, axis_name)  # per-device mask

        def first_device_saves():
            save(step, pred, payload)

        jax.lax.cond(jax.lax.axis_index(axis_name) == 0, first_device_saves, lambda: None)

    jax.lax.cond(anyone, gather_and_save, lambda *_: None, step, pred, payload)


def _broadcast(x: Any, batched: bool, size: int) -> jax.Array:
    x = jnp.asarray(x)
    return x if batched else jnp.broadcast_to(x, (size, *x.shape))


def _batched_save(host_fn: Any, signature: Any):
    """`save(step, pred, payload)`: one crossing when any member's `pred` holds.

    Unbatched, `pred` is a scalar. Each `vmap` applied from outside prepends its axis to
    `pred`, `step` and every payload leaf (broadcasting unbatched ones), so the host gets
    the whole batch with a leading axis per `vmap` and the per-member mask.
    """
    callback = functools.partial(host_fn, signature)

    @jax.custom_batching.custom_vmap
    def save(step, pred, payload):
        def crossing(step, pred, payload):
            jax.debug.callback(callback, step, pred, *payload)

        jax.lax.cond(jnp.any(pred), crossing, lambda *_: None, step, pred, payload)
        return ()

    @save.def_vmap
    def _rule(axis_size, in_batched, step, pred, payload):
        step_b, pred_b, payload_b = in_batched
        save(
            _broadcast(step, step_b, axis_size),
            _broadcast(pred, pred_b, axis_size),
            [_broadcast(p, b, axis_size) for p, b in zip(payload, payload_b, strict=True)],
        )
        return (), ()

    return save
