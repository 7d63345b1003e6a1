"""`Checkpointer.while_loop` and `Checkpointer.fori_loop`: JAX's loops, with every save
in the body held to the members that are still in the loop.

Under `vmap`, a `while_loop` whose predicate differs across members runs its body for
every member while any of them goes on; JAX's lowering then keeps, per member, the body's
result or the carry it had, by the predicate (a `select` after the body, which no save
in the body can see). A finished member's body still runs, on its frozen carry: a
`maybe_save` there would hand over a state the member never had, at a step its frozen
counter asks in every later iteration. No save can tell such a member from a live one
by what it hands over (the first step a frozen counter asks is one the member never
reached). The loop's predicate can: evaluated on the carry the body gets, it is that
`select`'s mask. So the body evaluates it once more and every save traced in the body
holds only where it holds (`_traced.members_live`). Unbatched it holds in every
iteration the body runs, and the saves are the ones `lax.while_loop` makes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import jax
from jax.core import Tracer

from .._base._errors import ConfigError
from .._save import _traced

if TYPE_CHECKING:
    from jax.typing import ArrayLike

Carry = TypeVar("Carry")


def while_loop(
    cond_fun: Callable[[Carry], ArrayLike], body_fun: Callable[[Carry], Carry], init_val: Carry
) -> Carry:
    """`jax.lax.while_loop(cond_fun, body_fun, init_val)`, whose body's saves are those
    of the members for which `cond_fun` holds (see the module's docstring)."""
    _check_callable("while_loop", cond_fun=cond_fun, body_fun=body_fun)

    def body_of_live_members(carry: Carry) -> Carry:
        with _traced.members_live(cond_fun(carry)):
            return body_fun(carry)

    return jax.lax.while_loop(cond_fun, body_of_live_members, init_val)


def fori_loop(
    lower: ArrayLike, upper: ArrayLike, body_fun: Callable[[Any, Carry], Carry], init_val: Carry
) -> Carry:
    """`jax.lax.fori_loop(lower, upper, body_fun, init_val)`. With bounds Python knows it
    is JAX's (a `scan`: every member runs every iteration, nothing is thrown away); with
    a traced bound (a `while_loop`, per member under `vmap`: a batched start from
    `restore_or_init`), the saves in the body hold where `i < upper`, the predicate of
    the `while_loop` JAX makes of it."""
    _check_callable("fori_loop", body_fun=body_fun)
    if not isinstance(lower, Tracer) and not isinstance(upper, Tracer):
        return jax.lax.fori_loop(lower, upper, body_fun, init_val)

    def body_of_live_members(i: jax.Array, value: Carry) -> Carry:
        with _traced.members_live(i < upper):
            return body_fun(i, value)

    return jax.lax.fori_loop(lower, upper, body_of_live_members, init_val)


def _check_callable(name: str, **functions: object) -> None:
    for argument, function in functions.items():
        if not callable(function):
            raise ConfigError(
                f"{name}({argument}={function!r}): {argument} must be a function, as for "
                f"jax.lax.{name}. Fix: pass the function itself, not its result."
            )
