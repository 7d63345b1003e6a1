"""`_base/_warn.py`: `warn` attributes a warning to the first frame outside the package
(the user's line), however many of the package's own frames lie between."""

import sys
import types
import warnings

import pytest

from jax_cb_ckpt import CheckpointWarning
from jax_cb_ckpt._base import _warn


def _package_frames(depth):
    """A function compiled as if it were a file of the package, calling `warn` through
    `depth` of its own frames (as a public call reaches a warning through ours)."""
    code = (
        "def inner(n):\n"
        "    if n == 0:\n"
        "        warn('deep', category)\n"
        "    else:\n"
        "        inner(n - 1)\n"
    )
    namespace = {"warn": _warn.warn, "category": CheckpointWarning}
    exec(compile(code, _warn._PACKAGE + "_fake_module.py", "exec"), namespace)
    return namespace["inner"]


@pytest.mark.parametrize("depth", [0, 1, 5])
def test_the_warning_points_at_the_first_frame_outside_the_package(depth):
    inner = _package_frames(depth)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        line = sys._getframe().f_lineno + 1
        inner(depth)
    assert len(caught) == 1
    assert caught[0].filename == __file__
    assert caught[0].lineno == line
    assert caught[0].category is CheckpointWarning
    assert str(caught[0].message) == "deep"


def test_a_direct_call_from_outside_points_at_the_caller():
    with pytest.warns(CheckpointWarning, match="^direct$") as caught:
        line = sys._getframe().f_lineno + 1
        _warn.warn("direct", CheckpointWarning)
    assert caught[0].filename == __file__
    assert caught[0].lineno == line


def test_the_package_folder_is_the_package_itself():
    import jax_cb_ckpt

    assert isinstance(jax_cb_ckpt, types.ModuleType)
    assert jax_cb_ckpt.__file__.startswith(_warn._PACKAGE)
    assert _warn._PACKAGE.endswith("jax_cb_ckpt/")


def test_in_a_thread_that_starts_in_the_package_it_points_at_threading():
    """The writer thread's case: every frame of ours, the first outside is threading's."""
    import threading

    code = (
        "def target(out):\n"
        "    import warnings\n"
        "    with warnings.catch_warnings(record=True) as got:\n"
        "        warnings.simplefilter('always')\n"
        "        warn('from our thread', category)\n"
        "    out.extend(got)\n"
    )
    namespace = {"warn": _warn.warn, "category": CheckpointWarning}
    exec(compile(code, _warn._PACKAGE + "_fake_writer.py", "exec"), namespace)
    caught = []
    thread = threading.Thread(target=namespace["target"], args=(caught,))
    thread.start()
    thread.join()
    assert len(caught) == 1
    assert caught[0].filename == threading.__file__
