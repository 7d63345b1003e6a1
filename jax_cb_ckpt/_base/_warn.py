"""Warnings that point at the user's line.

Every warning the library issues goes through `warn`, which attributes it to the first
frame outside this package (the user's call to `save`, `wait`, `restore`, ...), found by
walking out of the package's own frames: no stack level counted by hand, which broke
whenever a public call reached the warning through one more function of ours. In a
thread of the library's (the writer), that is the first frame of the thread outside
the package (`threading`'s own).
"""

from __future__ import annotations

import os
import sys
import warnings

# The package's folder (this file is in its `_base/`).
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def warn(message: str, category: type[Warning]) -> None:
    """`warnings.warn(message, category)`, attributed to the first caller outside
    jax_cb_ckpt."""
    level, frame = 2, sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        frame = frame.f_back
        level += 1
    warnings.warn(message, category, stacklevel=level)
