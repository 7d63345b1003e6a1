"""Where checkpoints live, chosen once: a local directory or a prefix in a bucket.

`resolve` makes a directory argument an absolute path or a canonical URL; `at` gives
the one object that knows where its steps are, a `Storage` (`_protocol.py`) of a step
store and a chunk store: `Local` and `LocalChunks` (`_local.py`) or `Bucket` and
`BucketChunks` (`_bucket.py`). `at` picks the kind of a location; every stage then
calls `Storage`'s verbs, and reads no flag of the kind.
"""

from __future__ import annotations

import os
import re

from .._base._errors import ConfigError, where
from . import _copy, _remote
from ._bucket import Bucket, BucketChunks
from ._local import Local, LocalChunks
from ._protocol import Storage

_URL = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)://")  # gs://, s3://, file://, ...

# A storage URL with a slash missing (s3:/x, gs:bucket), not a local name like "exp:1".
_URL_SLIP = re.compile(r"(gs|gcs|s3|s3a|hdfs|file|az|abfs|https?):/?(?!/)", re.IGNORECASE)


def resolve(directory: object) -> str:
    """The absolute path of a checkpoint directory argument, or a `ConfigError`.

    Every public function takes the same forms: a non-empty str or os.PathLike,
    absolute or relative to the working directory (Orbax itself wants absolute paths).
    """
    if not isinstance(directory, (str, os.PathLike)):
        raise ConfigError(
            f"{where()}: directory must be a str or os.PathLike, got "
            f"{type(directory).__name__} ({directory!r})."
        )
    path = os.fspath(directory)
    if not isinstance(path, str) or not path:
        raise ConfigError(
            f"{where()}: directory is empty ({directory!r}). Fix: name the checkpoint "
            "directory, e.g. 'runs/exp1' (use '.' to mean the working directory)."
        )
    if "\0" in path:
        raise ConfigError(f"{where()}: directory {path!r} contains a NUL character.")
    if _URL.match(path):
        return _remote.canonical(path)
    slip = _URL_SLIP.match(path)
    if slip:
        # Taken as a local path, "s3:/bucket/run" is a folder "s3:" in the working
        # directory: a run that looks checkpointed until its machine is gone.
        raise ConfigError(
            f"{where()}: directory {path!r} looks like a {slip.group(1)}:// URL with a "
            f"slash missing, and would be taken for a local folder named "
            f"{slip.group(1) + ':'!r}. Fix: write {slip.group(1)}://bucket/path, or "
            "./" + f"{path} if a local folder of that name is really meant."
        )
    # realpath, not abspath: `link/../x` must name the directory the OS means (abspath
    # would drop `link/..` without following the link).
    return os.path.realpath(path)


def at(directory: str) -> Storage:
    """The storage of a checkpoint directory (canonical: `resolve`): its step store and
    its chunk store."""
    if _remote.is_url(directory):
        return Storage(Bucket(directory), BucketChunks(directory))
    return Storage(Local(directory), LocalChunks(directory))


def is_url(directory: str) -> bool:
    """`directory` (canonical: `resolve`) is in object storage, not a local path."""
    return _remote.is_url(directory)


def check_links(directory: str) -> None:
    """`ConfigError` when a link in `directory` (canonical) cannot be made without
    copying through this process: a bucket whose client library (`_copy`) is missing."""
    if _remote.is_url(directory):
        _copy.check_library(directory)
