"""jax_cb_ckpt: save Orbax checkpoints from inside jitted JAX code, restore them exactly."""

from ._checkpointer import Checkpointer as Checkpointer
from ._errors import (
    CheckpointError as CheckpointError,
    CheckpointerClosedError as CheckpointerClosedError,
    ConfigError as ConfigError,
    DuplicateStepWarning as DuplicateStepWarning,
    InvalidStateError as InvalidStateError,
    NoCheckpointError as NoCheckpointError,
    RestoreError as RestoreError,
    SaveError as SaveError,
    SkippedSaveWarning as SkippedSaveWarning,
    StructureMismatchError as StructureMismatchError,
    UnflushedSaveWarning as UnflushedSaveWarning,
)
from ._restore import (
    all_steps as all_steps,
    latest_step as latest_step,
    restore as restore,
)
from ._stats import SaveRecord as SaveRecord, Stats as Stats
from ._version import version as _version

__version__ = _version()
