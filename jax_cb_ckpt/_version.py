"""The installed version of jax_cb_ckpt."""

import functools
import importlib.metadata


@functools.cache
def version() -> str:
    try:
        return importlib.metadata.version("jax_cb_ckpt")
    except importlib.metadata.PackageNotFoundError:  # running from a source tree
        return "0+unknown"
