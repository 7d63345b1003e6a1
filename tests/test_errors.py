"""Bad input is caught while tracing with a message that names and fixes it; writer
failures reach the user's thread with the step, the directory and the cause."""

import json
import os
import re
import shutil
import subprocess
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from helpers import state_at

import jax_cb_ckpt
from jax_cb_ckpt import ConfigError, InvalidStateError, RestoreError, SaveError
from jax_cb_ckpt._layout import _ocdbt
from jax_cb_ckpt._storage import _places


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(every=0), r"every must be a positive int or None .* got 0"),
        (dict(every=-3), r"every must be a positive int or None .* got -3"),
        (dict(every=2.5), r"every must be a positive int or None .* got 2.5 of type float"),
        (dict(every=True), r"every must be a positive int or None .* got True of type bool"),
        (dict(max_to_keep=0), r"max_to_keep must be a positive int or None"),
        (dict(queue_size=0), r"queue_size must be a positive int \(saves in flight"),
        (dict(queue_size=None), r"queue_size must be a positive int \("),
        (dict(on_full="drop"), r"on_full must be one of \('block', 'skip', 'newest'\)"),
    ],
)
def test_bad_config(ckpt_dir, kwargs, match):
    with pytest.raises(ConfigError, match=match):
        jax_cb_ckpt.Checkpointer(ckpt_dir, **kwargs)


def test_directory_is_a_file(tmp_path):
    path = tmp_path / "a_file"
    path.write_text("not a directory")
    with pytest.raises(ConfigError, match=r"that path is an existing file, not a directory"):
        jax_cb_ckpt.Checkpointer(path)
    assert path.read_text() == "not a directory"


def test_directory_wrong_type():
    with pytest.raises(ConfigError, match=r"directory must be a str or os.PathLike, got int"):
        jax_cb_ckpt.Checkpointer(3)  # type: ignore[arg-type]


class Opaque:
    pass


class Twin:
    """A pytree node whose two children claim the same key: their stored names collide."""

    def __init__(self, x, y):
        self.x, self.y = x, y


jax.tree_util.register_pytree_with_keys(
    Twin,
    lambda t: (((jax.tree_util.GetAttrKey("a"), t.x), (jax.tree_util.GetAttrKey("a"), t.y)), None),
    lambda _, children: Twin(*children),
)


@pytest.mark.parametrize(
    "state, match",
    [
        (
            {"params": jnp.zeros(2), "name": "adam"},
            r"maybe_save: leaf state\['name'\] is a str \('adam'\), which cannot be saved",
        ),
        (
            {"cfg": [jnp.zeros(2), Opaque()]},
            r"leaf state\['cfg'\]\[1\] is a Opaque \(.*\), which cannot be saved",
        ),
        (
            {"s": np.array(["a", "b"])},
            r"leaf state\['s'\] has dtype <U1 \(ndarray\), which cannot be saved",
        ),
        (
            {"a.b": jnp.zeros(2)},
            r"under the key 'a.b'; keys stored in a checkpoint must be non-empty and contain",
        ),
        (Twin(jnp.zeros(2), jnp.ones(2)), r"would be stored under the same name 'a'"),
        ({"b": {True: jnp.zeros(2)}}, r"sits under a dict key of type bool \(True\)"),
        ({}, r"the state has no leaves, so there is nothing to save"),
        (
            {"w": jax.ShapeDtypeStruct((2,), jnp.float32)},
            r"leaf state\['w'\] is a jax.ShapeDtypeStruct, which has no data to save",
        ),
    ],
)
def test_bad_state_is_caught_while_tracing(make_ckpt, state, match):
    ckpt = make_ckpt(every=1)
    with pytest.raises(InvalidStateError, match=match):
        jax.jit(lambda step: ckpt.maybe_save(state, step))(jnp.int32(0))
    assert ckpt.stats.saves == 0


@pytest.mark.parametrize(
    "step, match",
    [
        (jnp.float32(3.0), r"step must be an integer scalar .* got float32\[\]"),
        (3.0, r"step must be an integer scalar .* got float \(3.0\)"),
        (True, r"step must be an integer scalar .* got bool \(True\)"),
        (jnp.arange(3), r"step must be an integer scalar .* got int32\[3\]"),
    ],
)
def test_bad_step(make_ckpt, step, match):
    ckpt = make_ckpt(every=2)
    with pytest.raises(InvalidStateError, match=match):
        ckpt.maybe_save({"x": jnp.zeros(2)}, step)
    with pytest.raises(InvalidStateError, match=match):
        ckpt.save({"x": jnp.zeros(2)}, step)


def test_bad_when_and_missing_predicate(make_ckpt):
    ckpt = make_ckpt()
    with pytest.raises(InvalidStateError, match=r"when must be a boolean scalar .* got int32\[\]"):
        ckpt.maybe_save({"x": jnp.zeros(2)}, 1, when=jnp.int32(1))
    with pytest.raises(ConfigError, match=r"maybe_save: no predicate. Fix: pass when="):
        ckpt.maybe_save({"x": jnp.zeros(2)}, 1)


def test_closed_checkpointer_refuses_saves(make_ckpt):
    ckpt = make_ckpt(every=1)
    ckpt.close()
    ckpt.close()  # idempotent
    with pytest.raises(jax_cb_ckpt.CheckpointerClosedError, match="is closed"):
        ckpt.save({"x": jnp.zeros(2)}, 1)


def wait_for_failure(ckpt, timeout=30.0):
    deadline = time.monotonic() + timeout
    while ckpt.stats.failed == 0:
        assert time.monotonic() < deadline, "the writer never failed"
        time.sleep(0.01)


def test_directory_removed_mid_run_surfaces_everywhere(make_ckpt, ckpt_dir):
    ckpt = make_ckpt(every=2)

    @jax.jit
    def run(x, steps):
        def body(x, i):
            x = x + 1
            ckpt.maybe_save({"x": x}, i)
            return x, None

        return jax.lax.scan(body, x, steps)[0]

    x = run(jnp.zeros(3), jnp.arange(0, 4))
    ckpt.wait()
    assert ckpt.all_steps() == [0, 2]
    shutil.rmtree(ckpt_dir)
    x = run(x, jnp.arange(4, 6))  # one save (step 4), which fails in the writer
    wait_for_failure(ckpt)
    # The next hand-off inside jitted code fails the computation, naming the cause...
    with pytest.raises(Exception, match=r"saving step 4 to .* no longer exists"):
        jax.block_until_ready(run(x, jnp.arange(8, 12)))
    # ...and the user's thread gets the real SaveError with the cause chained.
    with pytest.raises(SaveError) as info:
        ckpt.wait()
    assert f"saving step 4 to {str(ckpt_dir)!r} failed" in str(info.value)
    assert isinstance(info.value.__cause__, FileNotFoundError)
    assert not ckpt_dir.exists()  # never silently re-created


def test_eager_save_after_failure_raises_in_user_thread(make_ckpt, ckpt_dir):
    ckpt = make_ckpt()
    ckpt.save({"x": jnp.zeros(3)}, 1)
    ckpt.wait()
    shutil.rmtree(ckpt_dir)
    ckpt_dir.write_text("replaced by a file")
    raised = []
    for step in (2, 3):  # step 2's failure surfaces at the first call after it happened:
        try:  # save(2) itself when the writer fails it before save(2) returns, else save(3)
            ckpt.save({"x": jnp.zeros(3)}, step)
        except SaveError as e:
            raised.append(str(e))
            break
        wait_for_failure(ckpt)
    assert len(raised) == 1, raised
    assert re.search(r"saving step 2 to .* is no longer a directory", raised[0]), raised
    ckpt.close()  # the error was delivered once; closing is clean
    assert ckpt_dir.read_text() == "replaced by a file"


def test_error_at_context_exit(ckpt_dir):
    with pytest.raises(SaveError, match="saving step 2"):
        with jax_cb_ckpt.Checkpointer(ckpt_dir) as ckpt:
            ckpt.save({"x": jnp.zeros(3)}, 1)
            ckpt.wait()
            shutil.rmtree(ckpt_dir)
            ckpt.save({"x": jnp.zeros(3)}, 2)


def test_disk_full_keeps_earlier_checkpoints(make_ckpt, small_disk):
    directory = os.path.join(small_disk("512k"), "ckpt")
    ckpt = make_ckpt(directory)
    small = {"x": jnp.arange(4.0)}
    ckpt.save(small, 1)
    ckpt.wait()
    ckpt.save({"x": jnp.zeros(1 << 20)}, 2)  # 4 MB cannot fit
    with pytest.raises(SaveError, match=r"saving step 2 to .* No space left on device") as info:
        ckpt.wait()
    assert "Earlier checkpoints in it are untouched" in str(info.value)
    assert ckpt.all_steps() == [1]
    # The partial write was cleaned up, so a later small save fits again.
    assert not [n for n in os.listdir(directory) if "tmp" in n]
    ckpt.save(small, 3)
    ckpt.close()
    assert jax_cb_ckpt.all_steps(directory) == [1, 3]
    np.testing.assert_array_equal(jax_cb_ckpt.restore(directory, small, step=1)["x"], small["x"])


def test_disk_full_with_on_error_continue_trains_on(small_disk):
    directory = os.path.join(small_disk("1m"), "ckpt")
    ckpt = jax_cb_ckpt.Checkpointer(directory, every=1, on_error="continue")
    small = {"x": jax.numpy.zeros(16)}
    ckpt.save(small, 1)
    ckpt.wait()

    @jax.jit
    def train(x):
        def body(x, i):
            x = x + 1.0
            ckpt.save({"x": x}, i)  # 2 MB each: none fits
            return x, None

        return jax.lax.scan(body, x, jax.numpy.arange(2, 6))[0]

    out = train(jax.numpy.zeros(1 << 19))
    with pytest.warns(
        jax_cb_ckpt.SaveFailedWarning, match=r"4 save\(s\) failed so far and training continued"
    ):
        ckpt.wait()
    np.testing.assert_array_equal(np.asarray(out), np.full(1 << 19, 4.0, np.float32))
    assert ckpt.stats.failed == 4 and ckpt.stats.saves == 1
    assert ckpt.all_steps() == [1]  # the earlier checkpoint is intact
    np.testing.assert_array_equal(ckpt.restore(small)["x"], np.zeros(16, np.float32))
    assert not [n for n in os.listdir(directory) if "tmp" in n]
    ckpt.close()


def test_read_only_directory_error_keeps_earlier_checkpoints(make_ckpt, small_disk):
    """A file system remounted read-only (chmod means nothing to root; a read-only
    mount stops everyone)."""
    mount = small_disk("4m")
    directory = os.path.join(mount, "ckpt")
    ckpt = make_ckpt(directory)
    state = {"x": jnp.arange(8.0)}
    ckpt.save(state, 1)
    ckpt.wait()
    subprocess.run(["mount", "-o", "remount,ro", mount], check=True)
    try:
        ckpt.save(state, 2)
        with pytest.raises(SaveError, match=r"saving step 2 to .* Read-only file system") as info:
            ckpt.wait()
        assert str(directory) in str(info.value)
        assert ckpt.all_steps() == [1]
        np.testing.assert_array_equal(ckpt.restore(state)["x"], state["x"])
    finally:
        subprocess.run(["mount", "-o", "remount,rw", mount], check=True)


def test_run_names_a_scan_style_body(make_ckpt):
    ckpt = make_ckpt(every=2)

    def scan_body(state, i):
        return state + 1.0, i  # lax.scan's (carry, output) shape

    with pytest.raises(
        ConfigError, match=r"body\(state, step\) must return the next state.*scan_body\(s, i\)\[0\]"
    ):
        ckpt.run(scan_body, jnp.zeros(3), 4)
    final = ckpt.run(lambda s, i: scan_body(s, i)[0], jnp.zeros(3), 4)
    np.testing.assert_array_equal(final, np.full(3, 4.0))


def test_bad_leaf_messages_point_at_framework_fixes(make_ckpt):
    ckpt = make_ckpt()
    with pytest.raises(InvalidStateError, match=r"leaf state\['act'\] is a .*eqx.filter"):
        ckpt.save({"w": jnp.ones(2), "act": jax.nn.relu}, 1)
    ckpt.save({"w": jnp.ones(2)}, 1)
    ckpt.wait()
    with pytest.raises(InvalidStateError, match=r"which cannot be restored into: `like`") as e:
        ckpt.restore({"w": jnp.ones(2), "name": "adam"})
    assert "cannot be saved" not in str(e.value)
    with pytest.raises(
        jax_cb_ckpt.StructureMismatchError, match=r"under the top-level keys \['w'\]"
    ):
        ckpt.restore({"params": {"w": jnp.ones(2)}})  # one level too deep


def test_cached_jitted_function_of_a_closed_checkpointer_names_the_cause(make_ckpt):
    ckpt = make_ckpt()
    train = jax.jit(lambda x: ckpt.save({"x": x}, 1))  # traced once, with this Checkpointer
    train(jnp.zeros(2))
    ckpt.close()
    with pytest.raises(Exception, match=r"CheckpointerClosedError") as info:
        train(jnp.zeros(2))  # the cached program still calls the closed one
        jax.effects_barrier()
    assert "a jitted function traced with an earlier Checkpointer keeps using that one" in str(
        info.value
    )
    assert "re-create the jitted function" in str(info.value)
    # Kept for the user's thread too (issue 54): on an accelerator a program with no
    # outputs may fail after the call returned, unseen; close() and wait() say it.
    with pytest.raises(jax_cb_ckpt.CheckpointerClosedError, match="re-create the jitted"):
        ckpt.close()


def test_any_failure_inside_a_callback_is_kept_for_wait_with_its_text(tmp_path):
    """Issue 54: an exception that is not ours, raised on the callback side (here a
    token the host cannot write; on the H200, a buffer __cuda_array_interface__ refused),
    failed the program, and JAX's failure was all there was: wait() swallowed it and
    returned with nothing on disk. It is kept as a CheckpointError naming the directory
    and the cause, and raised by wait()/close() whatever XLA did with the callback's."""
    from jax_cb_ckpt._handoff._exchange import Exchange
    from jax_cb_ckpt._save._buffer import CpuBuffer
    from jax_cb_ckpt._save._host import HostSide

    exchange = Exchange(str(tmp_path), queue_size=2, on_existing="raise", old_steps=[])
    host = HostSide(exchange, 2)
    token = np.zeros(1, np.int32)
    token.flags.writeable = False
    read = CpuBuffer().receive
    with pytest.raises(jax_cb_ckpt.CheckpointError) as raised:
        host.receive(read, None, {}, None, token, np.int32(3), np.bool_(True), np.zeros(2))
    kept = exchange.take_error()
    assert kept is raised.value and isinstance(kept.__cause__, ValueError)
    assert repr(str(tmp_path)) in str(kept) and "read-only" in str(kept)
    assert exchange.pending == 0  # nothing was queued; the step may be saved again
    assert exchange.claim(3) == ()


def test_an_unwritable_directory_is_a_config_error_with_a_fix(small_disk):
    """Issue 21 5(b): a directory that cannot be written read as "another writer"
    (DirectoryLockedError); one that cannot be created had no Fix line."""
    mount = small_disk("1m")
    os.makedirs(os.path.join(mount, "existing"))
    subprocess.run(["mount", "-o", "remount,ro", mount], check=True)
    try:
        with pytest.raises(ConfigError, match=r"the directory is not writable") as info:
            jax_cb_ckpt.Checkpointer(os.path.join(mount, "existing"))
        assert not isinstance(info.value, jax_cb_ckpt.DirectoryLockedError)
        assert "Read-only file system" in str(info.value) and "Fix: make it writable" in str(
            info.value
        )
        with pytest.raises(ConfigError, match=r"cannot create the directory: .*Fix: check"):
            jax_cb_ckpt.Checkpointer(os.path.join(mount, "new"))
    finally:
        subprocess.run(["mount", "-o", "remount,rw", mount], check=True)


def test_a_closed_checkpointer_says_so_before_running(make_ckpt):
    """Issue 21 5(a): `with ckpt:` on a closed Checkpointer, and run() on one, failed only
    inside the program, as a JaxRuntimeError around our text."""
    ckpt = make_ckpt(every=2)
    with ckpt:
        ckpt.save({"x": jnp.ones(2)}, 1)
    with pytest.raises(jax_cb_ckpt.CheckpointerClosedError, match=r"with ckpt: .* is closed"):
        with ckpt:
            pass
    with pytest.raises(jax_cb_ckpt.CheckpointerClosedError, match=r"run: .* is closed"):
        ckpt.run(lambda s, i: s + 1.0, jnp.zeros(2), 4)
    assert ckpt.all_steps() == [1]


def test_a_float_step_error_says_how_to_fix_a_python_float(make_ckpt):
    """Issue 21 5(f): the fix offered for a Python float was `step.astype(jnp.int32)`."""
    ckpt = make_ckpt()
    with pytest.raises(
        InvalidStateError, match=r"pass int\(step\) for a Python float \(int\(3\.0\)\)"
    ):
        ckpt.save({"x": jnp.ones(2)}, 3.0)
    with pytest.raises(
        InvalidStateError, match=r"step\.astype\(jnp\.int32\) if it is a float array"
    ):
        ckpt.save({"x": jnp.ones(2)}, jnp.float32(3.0))


# -- every error is ours, and names the input and the fix ------------------------------


def test_plain_orbax_checkpoint_is_explained(tmp_path):
    """A plain Orbax step is read by restore (issue 41 item 3: test_restart.py); its
    metadata says it is Orbax's, unverified (issue 52 item 4: it was a NoCheckpointError)."""
    directory = tmp_path / "plain"
    with ocp.CheckpointManager(directory) as manager:
        manager.save(3, args=ocp.args.StandardSave({"w": np.ones(3)}))
    np.testing.assert_array_equal(jax_cb_ckpt.restore(directory, {"w": np.ones(3)})["w"], 1.0)
    meta = jax_cb_ckpt.metadata(directory)
    assert meta["format"] == "orbax" and meta["step"] == 3 and meta["checksums"] is None


@pytest.mark.parametrize("step", [5.0, "5", True, np.float32(5)])
def test_bad_restore_step(make_ckpt, step):
    ckpt = make_ckpt()
    ckpt.save(state_at(5), 5)
    ckpt.wait()
    with pytest.raises(ConfigError, match=r"restore\(step=.*\): step must be a non-negative int"):
        ckpt.restore(state_at(0), step=step)


@pytest.mark.parametrize(
    "edit, match",
    [
        # Another format tag under our record of the step: damaged (never listed or
        # deleted), said as such by a restore without step= (every step is damaged).
        (lambda m: m.update(format="other/9"), r"step 1 .* has format tag 'other/9'"),
        (lambda m: m.update(leaves="x"), r"'leaves' is a str"),
        (
            lambda m: m["leaves"][0].update(dtype="int64"),
            r"has dtype int32, where the description gives int64",
        ),
        (lambda m: m["leaves"][0].update(shape=[4]), r"differs: the checkpoint has int32\[4\]"),
        (lambda m: m["leaves"][0].update(dtype="no_such_type"), r"meta' item is invalid"),
        (lambda m: m["leaves"][0].update(kind="pickle"), r"leaf kind 'pickle'"),
        (lambda m: m["leaves"][0].update(shape=[-3]), r"non-negative ints"),
        (lambda m: m["leaves"][1].update(impl="nope"), r"meta' item is invalid"),
    ],
)
def test_hand_edited_metadata_is_a_restore_error(make_ckpt, ckpt_dir, edit, match):
    ckpt = make_ckpt()
    ckpt.save({"w": np.ones(3, np.int32), "z_key": jax.random.key(0)}, 1)
    ckpt.wait()
    path = ckpt_dir / "1" / "meta" / "metadata"
    meta = json.loads(path.read_text())
    edit(meta)
    # Rewritten with its record in the step file, as the writer would have written it:
    # the description itself must be checked (an edit alone is found damaged earlier,
    # test_hostile.py).
    _places.at(str(ckpt_dir)).write_meta(str(ckpt_dir / "1"), meta)
    # A numpy int64 `like` matches an edited int64 description: the data must be checked.
    like_w = np.ones(3, np.int64) if "int64" in match else np.ones(3, np.int32)
    with warnings.catch_warnings():  # a re-tagged step is also reported as damaged
        warnings.simplefilter("ignore", jax_cb_ckpt.DamagedStepWarning)
        with pytest.raises(RestoreError, match=match):
            ckpt.restore({"w": like_w, "z_key": jax.random.key(0)})


# -- the habits users bring (issue 30 item 5) ---------------------------------------------


def test_a_step_passed_positionally_is_told_to_pass_it_by_keyword(make_ckpt, ckpt_dir):
    """Orbax users write `manager.restore(20)`: Python's own answer was "takes 2
    positional arguments but 3 were given"."""
    ckpt = make_ckpt()
    ckpt.save(state_at(20), 20)
    ckpt.wait()
    like = state_at(0)
    calls = {
        "restore(directory, like, step=20)": lambda: jax_cb_ckpt.restore(ckpt_dir, like, 20),
        "restore(like, step=20)": lambda: ckpt.restore(like, 20),
        "metadata(directory, step=20)": lambda: jax_cb_ckpt.metadata(ckpt_dir, 20),
        "verify(directory, step=20)": lambda: jax_cb_ckpt.verify(ckpt_dir, 20),
    }
    for fix, call in calls.items():
        with pytest.raises(ConfigError, match=r"the step is passed by keyword") as info:
            call()
        assert str(info.value).endswith(f"Fix: {fix}."), str(info.value)
    assert int(ckpt.restore(like, step=20)["step"]) == 20


def test_a_value_shown_in_a_message_is_one_short_line(make_ckpt):
    """`maybe_save(s.step, s)` with the arguments swapped: the message held the whole
    state's repr (1,130 characters for a TrainState)."""
    ckpt = make_ckpt(every=1)
    big = {f"leaf{i}": np.arange(50.0) for i in range(20)}
    with pytest.raises(InvalidStateError, match=r"step must be an integer scalar") as info:
        ckpt.maybe_save(jnp.int32(3), big)
    text = str(info.value)
    assert len(text) < 600 and "characters)" in text, (len(text), text)


def test_restore_into_nothing_says_restore_not_save(ckpt_dir, make_ckpt):
    ckpt = make_ckpt()
    ckpt.save(state_at(1), 1)
    ckpt.wait()
    with pytest.raises(
        InvalidStateError, match=r"like has no leaves, so there is nothing to restore into"
    ):
        jax_cb_ckpt.restore(ckpt_dir, None)


def test_a_damaged_database_says_what_which_file_and_what_to_do(make_ckpt, ckpt_dir):
    """A byte changed in the step's database (its B-tree node: a raw TensorStore "ZSTD_
    decompressStream() failed" before), in restore and in verify, which returns nothing
    and so does not say "Nothing was returned"."""
    ckpt = make_ckpt()
    ckpt.save({"w": np.arange(100_000, dtype=np.float32)}, 1)
    ckpt.wait()
    # The B-tree's root, where the manifest says it is (the writer may put it in a data
    # file of its own, and leave bytes no node points at after the values).
    state = ckpt_dir / "1" / "state"
    _, root, root_end = _ocdbt.indexed_bytes((state / "manifest.ocdbt").read_bytes(), "")
    data = state / root
    with open(data, "r+b") as f:
        f.seek(root_end - 20)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(RestoreError) as restoring:
        jax_cb_ckpt.restore(ckpt_dir, {"w": np.zeros(100_000, np.float32)})
    with pytest.raises(RestoreError) as verifying:
        jax_cb_ckpt.verify(ckpt_dir)
    for error, outcome in (
        (restoring, "Nothing was returned."),
        (verifying, "The step fails verification."),
    ):
        text = str(error.value)
        assert str(data) in text and "A file of the step was changed" in text, text
        assert outcome in text and "Fix: restore another step" in text, text
        assert "tensorstore_spec" not in text and "{" not in text, text
    assert "Nothing was returned" not in str(verifying.value)


@pytest.mark.parametrize(
    "orbax, ours",
    [
        ("keep_period", "keep_every=K"),
        ("best_mode", "mode='max'"),
        ("save_interval_steps", "every=N"),
        ("best_fn", "best='<metric name>'"),
        ("keep_time_interval", "keep_every_seconds=T"),
        ("enable_async_checkpointing", "always written in the background"),
    ],
)
def test_orbax_option_names_are_answered_with_ours(ckpt_dir, orbax, ours):
    """Issue 44 item 4: Orbax's option names got a bare `TypeError: unexpected keyword`."""
    with pytest.raises(ConfigError, match=rf"{orbax} is Orbax's .* here it is .*{re.escape(ours)}"):
        jax_cb_ckpt.Checkpointer(ckpt_dir, **{orbax: 3})
    with pytest.raises(TypeError, match="unexpected keyword"):  # any other name: Python's
        jax_cb_ckpt.Checkpointer(ckpt_dir, no_such_option=3)


# -- errors that point the right way (issue 52 item 7) ---------------------------------


def test_a_function_passed_as_like_is_told_to_use_eval_shape(make_ckpt, ckpt_dir):
    def init(key):
        return {"w": jnp.zeros(2)}

    ckpt = make_ckpt()
    ckpt.save(init(0), 1)
    ckpt.wait()
    fix = r"leaf like is a function .*not the function that makes it.*jax\.eval_shape\(init, key\)"
    with pytest.raises(InvalidStateError, match=fix):
        ckpt.restore(init)
    with pytest.raises(InvalidStateError, match=fix):
        jax_cb_ckpt.restore(ckpt_dir, jax.jit(init))
    with pytest.raises(InvalidStateError, match=r"leaf state is a function .*pass the state"):
        ckpt.save(init, 2)


def test_a_directory_nobody_can_write_is_a_config_error_with_the_errno():
    """/proc/self exists and no lock is held there: not a DirectoryLockedError."""
    with pytest.raises(
        ConfigError, match=r"the directory is not writable.*\(errno \d+, E[A-Z]+"
    ) as info:
        jax_cb_ckpt.Checkpointer("/proc/self")
    assert not isinstance(info.value, jax_cb_ckpt.DirectoryLockedError)
    assert "/proc/" in str(info.value)


def test_an_error_of_ours_under_jit_is_raised_as_ours_by_ckpt_scan_and_the_next_calls(
    make_ckpt, ckpt_dir
):
    """A refusal in a callback reaches the jitted call as `JaxRuntimeError: INTERNAL:
    ...`: `ckpt.scan` run eagerly (its own program) raises ours instead; after a
    user's own jitted call, the next maybe_save (and close) raises ours."""
    with jax_cb_ckpt.Checkpointer(ckpt_dir) as other_run:
        other_run.save({"w": np.zeros(2, np.float32)}, 5)
    ckpt = make_ckpt(every=5)

    def f(state, x):
        return {"w": state["w"] + 1.0}, None

    with pytest.raises(jax_cb_ckpt.StepExistsError, match=r"^saving step 5 ") as info:
        ckpt.scan(f, {"w": jnp.zeros(2)}, length=10)
    assert isinstance(info.value.__cause__, jax.errors.JaxRuntimeError)

    train = jax.jit(lambda s: ckpt.scan(f, s, length=10)[0])
    with pytest.raises(jax.errors.JaxRuntimeError, match="StepExistsError"):  # JAX's own
        train({"w": jnp.zeros(2)})
    with pytest.raises(jax_cb_ckpt.StepExistsError, match=r"^saving step 5 "):
        ckpt.maybe_save({"w": np.zeros(2, np.float32)}, 7)
    with pytest.raises(jax.errors.JaxRuntimeError):
        train({"w": jnp.zeros(2)})
    with pytest.raises(jax_cb_ckpt.StepExistsError, match=r"^saving step 5 "):
        ckpt.close()
    assert jax_cb_ckpt.all_steps(ckpt_dir) == [5]
