"""jax_cb_ckpt: save Orbax checkpoints from inside jitted JAX code, restore them exactly.

The names that need JAX are imported when first used (PEP 562), so that the command
line (`jax-cb-ckpt ls`, which reads JSON files) starts without importing JAX (~1.8 s)
and importing the package installs no third-party logging handler. The exception and
warning types are imported at once: they need nothing.
"""

from typing import TYPE_CHECKING as _TYPE_CHECKING

from . import _exit  # noqa: F401  (the exit hook: registered at import, _exit.py)
from ._errors import CheckpointerClosedError as CheckpointerClosedError
from ._errors import CheckpointError as CheckpointError
from ._errors import CheckpointWarning as CheckpointWarning
from ._errors import ConfigError as ConfigError
from ._errors import DamagedStepError as DamagedStepError
from ._errors import DamagedStepWarning as DamagedStepWarning
from ._errors import DirectoryLockedError as DirectoryLockedError
from ._errors import DuplicateStepWarning as DuplicateStepWarning
from ._errors import ForeignStepWarning as ForeignStepWarning
from ._errors import InvalidStateError as InvalidStateError
from ._errors import NoCheckpointError as NoCheckpointError
from ._errors import RestoreError as RestoreError
from ._errors import SaveError as SaveError
from ._errors import SaveFailedWarning as SaveFailedWarning
from ._errors import SkippedSaveWarning as SkippedSaveWarning
from ._errors import StepExistsError as StepExistsError
from ._errors import StepOrderWarning as StepOrderWarning
from ._errors import StructureMismatchError as StructureMismatchError
from ._errors import UnflushedSaveWarning as UnflushedSaveWarning
from ._version import version as _version

if _TYPE_CHECKING:
    from ._checkpointer import Checkpointer as Checkpointer
    from ._preempt import Preempted as Preempted
    from ._restore import restore as restore
    from ._stats import SaveRecord as SaveRecord
    from ._stats import Stats as Stats
    from ._steps import all_steps as all_steps
    from ._steps import best_step as best_step
    from ._steps import latest_step as latest_step
    from ._steps import metadata as metadata
    from ._steps import metrics as metrics
    from ._steps import metrics_table as metrics_table
    from ._steps import verify as verify
    from ._tree import same_bits as same_bits

# {public name: the private module it comes from}, imported on first use.
_LAZY = {
    "Checkpointer": "_checkpointer",
    "Preempted": "_preempt",
    "all_steps": "_steps",
    "best_step": "_steps",
    "latest_step": "_steps",
    "metadata": "_steps",
    "metrics": "_steps",
    "metrics_table": "_steps",
    "restore": "_restore",
    "verify": "_steps",
    "SaveRecord": "_stats",
    "Stats": "_stats",
    "same_bits": "_tree",
}

__version__ = _version()


def __getattr__(name: str) -> object:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'jax_cb_ckpt' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value  # once: later lookups do not come here
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
