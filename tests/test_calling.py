"""`_base/_errors.py`'s context of a public call: `calling(name)` sets the name every
message of the call starts with (`where()`), for one block, in one thread; a public
call sets it once and inner functions read it instead of taking a `where: str`. A
message built deep inside a call still names the call."""

import os
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import flip_stored

import jax_cb_ckpt
from jax_cb_ckpt import ConfigError, DamagedStepError, InvalidStateError, StructureMismatchError
from jax_cb_ckpt._base._errors import calling, where
from jax_cb_ckpt._storage import _places

OUTSIDE = "jax_cb_ckpt"  # where() outside any public call


def test_calling_sets_the_name_for_its_block_and_nests():
    assert where() == OUTSIDE
    with calling("restore"):
        assert where() == "restore"
        with calling("restore(step=3) from '/d'"):
            assert where() == "restore(step=3) from '/d'"
        assert where() == "restore"
    assert where() == OUTSIDE


def test_calling_is_reset_after_an_exception():
    with pytest.raises(KeyError), calling("verify"):
        with calling("verify(step=1) of '/d'"):
            raise KeyError("x")
    assert where() == OUTSIDE


def test_another_thread_does_not_see_the_callers_name():
    seen = []
    with calling("maybe_save"):
        thread = threading.Thread(target=lambda: seen.append(where()))
        thread.start()
        thread.join()
        assert where() == "maybe_save"
    assert seen == [OUTSIDE]


def test_a_thread_s_name_does_not_reach_the_caller():
    inside = threading.Event()
    leave = threading.Event()

    def other():
        with calling("verify"):
            inside.set()
            leave.wait(10)

    thread = threading.Thread(target=other)
    thread.start()
    assert inside.wait(10)
    try:
        assert where() == OUTSIDE
    finally:
        leave.set()
        thread.join()


def test_a_public_call_sets_its_name_and_resets_it_after_also_when_it_raises(tmp_path, monkeypatch):
    jax_cb_ckpt.Checkpointer(tmp_path / "c").close()
    seen = []
    resolve = _places.resolve

    def recording(directory):
        seen.append(where())
        return resolve(directory)

    monkeypatch.setattr(_places, "resolve", recording)
    assert jax_cb_ckpt.all_steps(tmp_path / "c") == []
    assert jax_cb_ckpt.latest_step(tmp_path / "c") is None
    assert where() == OUTSIDE
    with pytest.raises(ConfigError, match=r"^metrics_table: directory must be a str"):
        jax_cb_ckpt.metrics_table(12)  # type: ignore[arg-type]
    assert where() == OUTSIDE
    assert seen == ["all_steps", "latest_step", "metrics_table"]


def test_a_like_mismatch_deep_in_restore_names_the_call_and_step(tmp_path):
    with jax_cb_ckpt.Checkpointer(tmp_path / "c") as ckpt:
        ckpt.save({"w": np.zeros(3, np.float32)}, 1)
    with pytest.raises(StructureMismatchError, match=r"^restore\(step=1\) from '.*': leaf "):
        jax_cb_ckpt.restore(tmp_path / "c", {"w": np.zeros(2, np.float32)}, step=1)
    assert where() == OUTSIDE
    with (
        jax_cb_ckpt.Checkpointer(tmp_path / "c") as ckpt,
        pytest.raises(StructureMismatchError, match=r"^restore\(step=1\) from '.*': leaf "),
    ):
        ckpt.restore({"w": np.zeros(2, np.float32)})  # a restart: the Checkpointer's
    assert where() == OUTSIDE


def test_a_bad_leaf_found_while_tracing_maybe_save_names_the_call(tmp_path):
    with jax_cb_ckpt.Checkpointer(tmp_path / "c") as ckpt:

        @jax.jit
        def step(x):
            ckpt.maybe_save({"w": x, "name": "run-1"}, 1, when=True)
            return x

        with pytest.raises(InvalidStateError, match=r"^maybe_save: leaf state\['name'\] is a str"):
            step(jnp.zeros(2))
        with pytest.raises(InvalidStateError, match=r"^save\(metrics=\.\.\.\): "):
            ckpt.save({"w": np.zeros(2)}, 1, metrics={})
    assert where() == OUTSIDE


def test_a_corrupted_leaf_found_by_verify_names_the_call_and_step(tmp_path):
    values = np.arange(50_000, dtype=np.float32)
    with jax_cb_ckpt.Checkpointer(tmp_path / "c") as ckpt:
        ckpt.save({"w": values}, 1)
    flip_stored(os.path.join(tmp_path, "c", "1"), values[20_000:20_016])
    with pytest.raises(DamagedStepError) as raised:
        jax_cb_ckpt.verify(tmp_path / "c")
    text = str(raised.value)
    assert text.startswith(f"verify(step=1) of {str(tmp_path / 'c')!r}: leaf "), text
    assert "The step fails verification." in text, text
    assert where() == OUTSIDE
