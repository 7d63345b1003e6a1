"""Exception and warning types of jax_cb_ckpt.

Every failure the library detects surfaces as one of these, in the user's thread.
Background failures (the writer thread) are stored and re-raised at the next save
hand-off, at `Checkpointer.wait()`, `Checkpointer.close()` or context-manager exit;
they are never only logged.
"""

import contextlib
import contextvars
import functools
from collections.abc import Callable, Iterator
from typing import ParamSpec, TypeVar

_P = ParamSpec("_P")
_R = TypeVar("_R")

# The public call an error is raised under ("restore", "verify(step=3) of '/ckpt'",
# "maybe_save"), the prefix of its message: set once where the call
# enters the library (`calling`), read where a message is built (`where`), instead of
# a `where: str` passed down through every signature. A ContextVar is per thread (and
# per asyncio task): a pool thread or the writer thread does not see the caller's
# value; code that builds messages there is given its name explicitly, or is run with
# `contextvars.copy_context().run`.
_CALL: contextvars.ContextVar[str] = contextvars.ContextVar("jax_cb_ckpt_call")


@contextlib.contextmanager
def calling(name: str) -> Iterator[None]:
    """Within the block, messages say they come from `name` (`where()`); the caller's
    value comes back after it, also when it raises. Nests."""
    token = _CALL.set(name)
    try:
        yield
    finally:
        _CALL.reset(token)


def entry(name: str) -> Callable[[Callable[_P, _R]], Callable[_P, _R]]:
    """A public entry point: the decorated function runs under `calling(name)`. (Not
    `calling` as a decorator: contextlib's frame would sit between the user's line and
    ours, and `_warn` attributes a warning to the first frame outside the package.)"""

    def decorate(function: Callable[_P, _R]) -> Callable[_P, _R]:
        @functools.wraps(function)
        def named(*args: _P.args, **kwargs: _P.kwargs) -> _R:
            with calling(name):
                return function(*args, **kwargs)

        return named

    return decorate


def where() -> str:
    """The public call under way in this thread (`calling`), for the start of a message;
    "jax_cb_ckpt" outside one."""
    return _CALL.get("jax_cb_ckpt")


def shown(value: object, limit: int = 80) -> str:
    """`repr(value)` for a message: one line of at most `limit` characters (a whole
    TrainState passed where a step goes made a 1,130-character message)."""
    text = " ".join(repr(value).split())
    if len(text) <= limit:
        return text
    return f"{text[: limit - 25]}... ({len(text)} characters)"


class CheckpointError(Exception):
    """Base class of every error raised by jax_cb_ckpt."""


class InvalidStateError(CheckpointError, TypeError):
    """A state, step or predicate that cannot be saved (caught while tracing)."""


class ConfigError(CheckpointError, ValueError):
    """An argument is invalid (`every`, `queue_size`, `on_full`, `directory`, `step`, ...)."""


class DirectoryLockedError(ConfigError):
    """Another live writer (Checkpointer or process) holds the checkpoint directory."""


class SaveError(CheckpointError):
    """A checkpoint could not be written. Names the step and the directory.

    The underlying exception (disk full, permission denied, ...) is chained as
    `__cause__`. Checkpoints written before the failure stay on disk.
    """


class StepExistsError(SaveError):
    """A save would mix this run with another run's checkpoints in the same directory.

    Raised at the first save of a step that is at or below a step an earlier run (or an
    earlier Checkpointer) left in the directory. Nothing on disk is changed.
    """


class RestoreError(CheckpointError):
    """A checkpoint could not be restored into the requested structure."""


class DamagedStepError(RestoreError):
    """A step's files are not what was written: a checksum that does not match, a
    description that was cut or edited, a missing or truncated file. A restart
    (`restore_or_init`, `run`, `restore` without `step=`) passes over such a step to the
    newest one that passes its checks, naming it (`DamagedStepWarning`); a step named by
    `step=` never falls back, and raises this. `why` says what is wrong in a few
    words (for the warning that names the steps a restart passed over)."""

    def __init__(self, message: str, why: str | None = None) -> None:
        super().__init__(message)
        self.why = message if why is None else why


class StructureMismatchError(RestoreError, ValueError):
    """`like` differs from the saved checkpoint (structure, shape, dtype or key type)."""


class NoCheckpointError(RestoreError, FileNotFoundError):
    """No (complete) checkpoint exists for the requested step in the directory."""


class CheckpointerClosedError(CheckpointError, RuntimeError):
    """A save was handed to a `Checkpointer` after `close()`."""


class CheckpointWarning(UserWarning):
    """Base class of every warning issued by jax_cb_ckpt."""


class SkippedSaveWarning(CheckpointWarning):
    """A save was dropped because the queue was full and `on_full="skip"`."""


class DuplicateStepWarning(CheckpointWarning):
    """A step handed over again by the same Checkpointer was dropped (the first is kept)."""


class ConstantStepWarning(CheckpointWarning):
    """`maybe_save` or `save` was traced in the body of a `lax.scan`, `fori_loop` or
    `while_loop` with a step Python knows (a Python int or numpy number, such as a
    counter bumped in the body) and no traced `when=`: the body is traced once, so every
    iteration asks for the same step. Issued while tracing; the fix is the loop's own
    counter (`i + 1`)."""


class StepOrderWarning(CheckpointWarning):
    """A step lower than one this Checkpointer already handed over was saved (a counter
    that restarted): it is written, but it is not the latest, and `max_to_keep`
    retention deletes it at once. Issued once per Checkpointer."""


class SaveFailedWarning(CheckpointWarning, RuntimeWarning):
    """With `on_error="continue"`: saves failed and training went on without them."""


class UnflushedSaveWarning(CheckpointWarning, RuntimeWarning):
    """Saves were still pending at interpreter exit (or when a Checkpointer was garbage
    collected unclosed); they were written then."""


class DamagedStepWarning(CheckpointWarning):
    """A step-named folder of the checkpoint directory claims to be a jax_cb_ckpt
    checkpoint but is not whole (a partial copy, a cut or edited file, a folder renamed
    to another step): it is not listed or restored, and never deleted. Issued by
    `all_steps`, `latest_step` and `restore` without `step=`, naming the step."""


class MemberStateWarning(CheckpointWarning):
    """A restore of a batch saved under `vmap` returned, for members that did not ask for
    the step it read (and for no older one), the data that step holds for them: not a
    state of theirs (a finished member of a vmapped loop holds its body's leftover).
    Names the members; `restore_or_init` starts them again from `init_fn` instead."""


class ForeignStepWarning(CheckpointWarning):
    """In object storage, an uncommitted step prefix holding a whole step that this
    library did not provably begin (a step copied there without its commit marker) was
    found when a Checkpointer opened the location; it was left untouched."""


# Tracebacks and reprs name the classes where users import them from
# (`jax_cb_ckpt.StepExistsError`, not `jax_cb_ckpt._errors.StepExistsError`), as JAX and
# Equinox name theirs; `tests/test_public_api.py` checks every public class.
for _public in list(globals().values()):
    if isinstance(_public, type) and issubclass(_public, CheckpointError | CheckpointWarning):
        _public.__module__ = "jax_cb_ckpt"
del _public
