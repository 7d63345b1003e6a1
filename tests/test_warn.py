"""`_base/_warn.py`: `warn` attributes a warning to the first frame outside the package
(the user's line), however many of the package's own frames lie between, and passing
over JAX's frames where our call runs through them (`ckpt.scan` tracing its body)."""

import sys
import types
import warnings

import pytest

from jax_cb_ckpt import CheckpointWarning
from jax_cb_ckpt._base import _warn


def _compiled(code, filename, **names):
    """The names `code` defines, compiled as if it were the file `filename` (a file of
    the package, or of JAX), with `names` in scope."""
    namespace = dict(names)
    exec(compile(code, filename, "exec"), namespace)
    return namespace


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
    namespace = _compiled(
        code, _warn._PACKAGE + "_fake_module.py", warn=_warn.warn, category=CheckpointWarning
    )
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
    namespace = _compiled(
        code, _warn._PACKAGE + "_fake_writer.py", warn=_warn.warn, category=CheckpointWarning
    )
    caught = []
    thread = threading.Thread(target=namespace["target"], args=(caught,))
    thread.start()
    thread.join()
    assert len(caught) == 1
    assert caught[0].filename == threading.__file__


def test_jax_frames_between_ours_are_passed_over():
    """`ckpt.scan`'s case: our call traces a body of ours inside JAX (`lax.scan`), and
    the body warns: the warning still points at the user's line."""
    import jax

    jax_file = _warn._jax_folders()[0] + "_src/_fake_tracing.py"
    assert jax_file.startswith(jax.__file__.rsplit("__init__.py", 1)[0])
    ours = _compiled(
        "def body():\n    warn('in the body', category)\n",
        _warn._PACKAGE + "_fake_body.py",
        warn=_warn.warn,
        category=CheckpointWarning,
    )
    tracing = _compiled("def trace(f):\n    f()\n", jax_file)
    entry = _compiled(
        "def public():\n    trace(body)\n",
        _warn._PACKAGE + "_fake_entry.py",
        trace=tracing["trace"],
        body=ours["body"],
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        line = sys._getframe().f_lineno + 1
        entry["public"]()
    assert [(c.filename, c.lineno) for c in caught] == [(__file__, line)]


def test_a_user_function_jax_calls_is_the_users_line():
    """A user's step function that saves, traced by JAX: the user's own line in it (the
    first frame outside ours that is not JAX's), not the outer call."""
    jax_file = _warn._jax_folders()[0] + "_src/_fake_tracing.py"
    ours = _compiled(
        "def maybe_save():\n    warn('here', category)\n",
        _warn._PACKAGE + "_fake_save.py",
        warn=_warn.warn,
        category=CheckpointWarning,
    )
    lines = []

    def user_step():
        lines.append(sys._getframe().f_lineno + 1)
        ours["maybe_save"]()

    tracing = _compiled("def trace(f):\n    f()\n", jax_file)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tracing["trace"](user_step)
    assert [(c.filename, c.lineno) for c in caught] == [(__file__, lines[0])]


def test_a_keep_best_warning_from_ckpt_scan_points_at_the_scan_call(make_ckpt):
    import jax.numpy as jnp

    ckpt = make_ckpt(every=2, keep_best=1, best="return")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        line = sys._getframe().f_lineno + 1
        ckpt.scan(
            lambda c, _: (c + 1, None), jnp.zeros(()), length=4, metrics=lambda c: {"loss": c}
        )
    ours = [c for c in caught if issubclass(c.category, CheckpointWarning)]
    assert ours and all((c.filename, c.lineno) == (__file__, line) for c in ours), [
        (c.filename, c.lineno, str(c.message)[:60]) for c in ours
    ]
    assert "without 'return'" in str(ours[0].message)
