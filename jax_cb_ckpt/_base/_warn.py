"""Warnings that point at the user's line.

Every warning the library issues goes through `warn`, which attributes it to the first
frame outside this package and outside JAX (the user's call to `save`, `wait`,
`restore`, ...), found by walking out of those frames: no stack level counted by hand,
which broke whenever a public call reached the warning through one more function of
ours. JAX's frames are passed over because our own calls run through them: `ckpt.scan`
and `ckpt.run` trace their loop body, which saves, inside `lax.scan`. In a thread of the
library's (the writer), that is the first frame of the thread outside the package
(`threading`'s own); where nothing lies beyond JAX's frames, the first frame outside
the package.
"""

from __future__ import annotations

import os
import sys
import warnings

# The package's folder (this file is in its `_base/`).
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def warn(message: str, category: type[Warning]) -> None:
    """`warnings.warn(message, category)`, attributed to the first caller outside
    jax_cb_ckpt and JAX."""
    jax = _jax_folders()
    level, frame = 2, sys._getframe(1)
    first_outside = None
    while frame is not None:
        name = frame.f_code.co_filename
        if not name.startswith(_PACKAGE):
            if first_outside is None:
                first_outside = level
            if not (jax and name.startswith(jax)):
                break
        frame = frame.f_back
        level += 1
    else:  # nothing but our frames and JAX's: the first outside ours
        level = level if first_outside is None else first_outside
    warnings.warn(message, category, stacklevel=level)


def _jax_folders() -> tuple[str, ...]:
    """The folders of JAX and jaxlib, where they are imported (the package imports
    them; this module does not, to stay below every stage)."""
    folders = []
    for name in ("jax", "jaxlib"):
        file = getattr(sys.modules.get(name), "__file__", None)
        if file:
            folders.append(os.path.dirname(os.path.abspath(file)) + os.sep)
    return tuple(folders)
