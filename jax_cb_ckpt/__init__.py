"""jax_cb_ckpt: save Orbax checkpoints from inside jitted JAX code, restore them exactly.

The names that need JAX are imported when first used (PEP 562), so that the command
line (`jax-cb-ckpt ls`, which reads JSON files) starts without importing JAX (~1.8 s)
and importing the package installs no third-party logging handler. The exception and
warning types are imported at once: they need nothing.
"""

from typing import TYPE_CHECKING as _TYPE_CHECKING

from ._base._errors import CheckpointerClosedError as CheckpointerClosedError
from ._base._errors import CheckpointError as CheckpointError
from ._base._errors import CheckpointWarning as CheckpointWarning
from ._base._errors import ConfigError as ConfigError
from ._base._errors import ConstantStepWarning as ConstantStepWarning
from ._base._errors import DamagedStepError as DamagedStepError
from ._base._errors import DamagedStepWarning as DamagedStepWarning
from ._base._errors import DirectoryLockedError as DirectoryLockedError
from ._base._errors import DuplicateStepWarning as DuplicateStepWarning
from ._base._errors import ForeignStepWarning as ForeignStepWarning
from ._base._errors import InvalidStateError as InvalidStateError
from ._base._errors import MemberStateWarning as MemberStateWarning
from ._base._errors import NoCheckpointError as NoCheckpointError
from ._base._errors import RestoreError as RestoreError
from ._base._errors import SaveError as SaveError
from ._base._errors import SaveFailedWarning as SaveFailedWarning
from ._base._errors import SkippedSaveWarning as SkippedSaveWarning
from ._base._errors import StepExistsError as StepExistsError
from ._base._errors import StepOrderWarning as StepOrderWarning
from ._base._errors import StructureMismatchError as StructureMismatchError
from ._base._errors import UnflushedSaveWarning as UnflushedSaveWarning
from ._version import version as _version
from ._write import _exit  # noqa: F401  (the exit hook: registered at import, _write/_exit.py)

if _TYPE_CHECKING:
    from ._handoff._stats import SaveRecord as SaveRecord
    from ._handoff._stats import Stats as Stats
    from ._layout._keep_best import BestN as BestN
    from ._layout._keep_every import EveryNSteps as EveryNSteps
    from ._layout._keep_latest import LatestN as LatestN
    from ._layout._keep_seconds import EveryNSeconds as EveryNSeconds
    from ._read._rebuild import same_bits as same_bits
    from ._read._restore import restore as restore
    from ._read._steps import all_steps as all_steps
    from ._read._steps import best_step as best_step
    from ._read._steps import latest_step as latest_step
    from ._read._steps import metadata as metadata
    from ._read._steps import metrics as metrics
    from ._read._steps import metrics_table as metrics_table
    from ._read._steps import restore_extra as restore_extra
    from ._read._steps import verify as verify
    from ._user._checkpointer import Checkpointer as Checkpointer
    from ._user._preempt import Preempted as Preempted

# {public name: the private module it comes from}, imported on first use.
_LAZY = {
    "Checkpointer": "_user._checkpointer",
    "BestN": "_layout._keep_best",  # the retention rules (Checkpointer's keep=)
    "EveryNSeconds": "_layout._keep_seconds",
    "EveryNSteps": "_layout._keep_every",
    "LatestN": "_layout._keep_latest",
    "Preempted": "_user._preempt",
    "all_steps": "_read._steps",
    "best_step": "_read._steps",
    "latest_step": "_read._steps",
    "metadata": "_read._steps",
    "metrics": "_read._steps",
    "metrics_table": "_read._steps",
    "restore": "_read._restore",
    "restore_extra": "_read._steps",
    "verify": "_read._steps",
    "SaveRecord": "_handoff._stats",
    "Stats": "_handoff._stats",
    "same_bits": "_read._rebuild",
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
