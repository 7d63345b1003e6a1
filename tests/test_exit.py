"""`_write/_exit.py`: the exit hook. A Checkpointer left unclosed has what it was handed
written before the interpreter ends (its writer thread is a daemon: without the hook
the saves would be lost); a non-daemon thread still training when the main thread
ends is waited for first, so a Checkpointer it creates later still writes. A writer is
in `LIVE` while its thread runs and leaves it once closed; the hook is registered with
`threading`'s exit hooks (before the thread pools shut down) at import."""

import os
import sys

import jax.numpy as jnp
from helpers import run_child

import jax_cb_ckpt
from jax_cb_ckpt._write import _exit

# One child for both scenarios (a JAX child costs seconds): the main thread hands
# saves to a Checkpointer it never closes, and a thread creates its own Checkpointer
# only after the main thread has ended.
CHILD = """
import sys, threading, time
import jax.numpy as jnp
import jax_cb_ckpt

def train():
    time.sleep(0.5)  # the main thread has ended by now
    late = jax_cb_ckpt.Checkpointer(sys.argv[2])
    for step in range(3):
        late.save({"w": jnp.full((4,), float(step))}, step)

def train_run(runner):
    time.sleep(0.5)  # the main thread has ended by now
    runner.run(lambda state, step: state + 1.0, jnp.zeros(3), 10, quiet=True)

ckpt = jax_cb_ckpt.Checkpointer(sys.argv[1], queue_size=16)
for step in range(6):
    ckpt.save({"w": jnp.full((20000,), float(step))}, step)
threading.Thread(target=train).start()
threading.Thread(target=train_run, args=(jax_cb_ckpt.Checkpointer(sys.argv[3], every=5),)).start()
print("main thread ends", flush=True)
# no close(), no wait()
"""


def test_unclosed_checkpointers_and_late_threads_are_written_at_exit(tmp_path):
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    first, late, ran = tmp_path / "first", tmp_path / "late", tmp_path / "ran"
    done = run_child(["python", script, first, late, ran], timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "main thread ends"
    # The unclosed Checkpointer's saves are written on every Python, also where no new
    # thread may start any more (its fsyncs then run in the exit hook's thread).
    assert jax_cb_ckpt.all_steps(first) == list(range(6)), done.stderr
    assert float(jax_cb_ckpt.restore(first, {"w": jnp.zeros((20000,))})["w"][0]) == 5.0
    # A Checkpointer opened before the main thread ended runs `run` in a thread still
    # training after it (3.12.0/3.12.1: `run` starts no helper thread there, it raised
    # "can't create new thread at interpreter shutdown").
    assert jax_cb_ckpt.all_steps(ran) == [5, 10], done.stderr
    if sys.version_info[:3] in ((3, 12, 0), (3, 12, 1)):
        # These refuse every new thread once the main thread has ended: a Checkpointer
        # created then cannot start its writer, and says so (nothing is half-written).
        assert "jax_cb_ckpt.SaveError: could not open" in done.stderr, done.stderr
        assert "refuses to start a thread once the main thread has ended" in done.stderr
        assert "Fix: create the Checkpointer before the main thread ends" in done.stderr
        assert "saving step" not in done.stderr  # the first one's saves all succeeded
        assert jax_cb_ckpt.all_steps(late) == []
    else:
        assert "Traceback" not in done.stderr, done.stderr
        assert jax_cb_ckpt.all_steps(late) == [0, 1, 2]


def test_a_writer_is_live_while_open_and_not_after_close(make_ckpt, ckpt_dir):
    def live():
        return [w for w in _exit.LIVE if w.directory == os.fspath(ckpt_dir)]

    ckpt = make_ckpt()
    assert len(live()) == 1
    ckpt.save({"w": jnp.zeros(2)}, 1)
    ckpt.close()
    assert live() == []


def _hooked(hook):
    """The function a `threading._register_atexit` entry calls: a `functools.partial`
    (Python 3.11, 3.12) or a lambda closing over it (3.13)."""
    if getattr(hook, "func", None) is not None:
        return hook.func
    cells = [c.cell_contents for c in getattr(hook, "__closure__", None) or ()]
    return next((value for value in cells if callable(value)), hook)


def test_the_hook_is_one_of_threadings_exit_hooks():
    import threading

    hooks = [_hooked(h) for h in threading._threading_atexits]  # type: ignore[attr-defined]
    assert hooks.count(_exit._flush_at_exit) == 1
