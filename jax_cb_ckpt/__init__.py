"""jax_cb_ckpt: save Orbax checkpoints from inside jitted JAX code, restore them exactly."""

from ._checkpointer import Checkpointer as Checkpointer
from ._errors import CheckpointerClosedError as CheckpointerClosedError
from ._errors import CheckpointError as CheckpointError
from ._errors import CheckpointWarning as CheckpointWarning
from ._errors import ConfigError as ConfigError
from ._errors import DirectoryLockedError as DirectoryLockedError
from ._errors import DuplicateStepWarning as DuplicateStepWarning
from ._errors import InvalidStateError as InvalidStateError
from ._errors import NoCheckpointError as NoCheckpointError
from ._errors import RestoreError as RestoreError
from ._errors import SaveError as SaveError
from ._errors import SaveFailedWarning as SaveFailedWarning
from ._errors import SkippedSaveWarning as SkippedSaveWarning
from ._errors import StepExistsError as StepExistsError
from ._errors import StructureMismatchError as StructureMismatchError
from ._errors import UnflushedSaveWarning as UnflushedSaveWarning
from ._preempt import Preempted as Preempted
from ._restore import all_steps as all_steps
from ._restore import latest_step as latest_step
from ._restore import metadata as metadata
from ._restore import restore as restore
from ._restore import verify as verify
from ._stats import SaveRecord as SaveRecord
from ._stats import Stats as Stats
from ._tree import same_bits as same_bits
from ._version import version as _version

# isort: split
# Names added on branch issue29, kept at the end for an easy merge (sort them in then).
from ._errors import ForeignStepWarning as ForeignStepWarning

__version__ = _version()
