"""Exception and warning types of jax_cb_ckpt.

Every failure the library detects surfaces as one of these, in the user's thread.
Background failures (the writer thread) are stored and re-raised at the next save
hand-off, at `Checkpointer.wait()`, `Checkpointer.close()` or context-manager exit;
they are never only logged.
"""


class CheckpointError(Exception):
    """Base class of every error raised by jax_cb_ckpt."""


class InvalidStateError(CheckpointError, TypeError):
    """A state, step or predicate that cannot be saved (caught while tracing)."""


class ConfigError(CheckpointError, ValueError):
    """A Checkpointer argument is invalid (`every`, `queue_size`, `on_full`, `directory`, ...)."""


class SaveError(CheckpointError):
    """A checkpoint could not be written. Names the step and the directory.

    The underlying exception (disk full, permission denied, ...) is chained as
    `__cause__`. Checkpoints written before the failure stay on disk.
    """


class RestoreError(CheckpointError):
    """A checkpoint could not be restored into the requested structure."""


class StructureMismatchError(RestoreError, ValueError):
    """`like` differs from the saved checkpoint (structure, shape, dtype or key type)."""


class NoCheckpointError(RestoreError, FileNotFoundError):
    """No (complete) checkpoint exists for the requested step in the directory."""


class CheckpointerClosedError(CheckpointError, RuntimeError):
    """A save was handed to a `Checkpointer` after `close()`."""


class SkippedSaveWarning(UserWarning):
    """A save was dropped because the queue was full and `on_full="skip"`."""


class DuplicateStepWarning(UserWarning):
    """A save for a step that already exists on disk was dropped (the disk copy is kept)."""


class SaveFailedWarning(RuntimeWarning):
    """With `on_error="continue"`: saves failed and training went on without them."""


class UnflushedSaveWarning(RuntimeWarning):
    """Saves were still pending at interpreter exit; they were flushed then."""
