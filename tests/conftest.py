"""Strict settings for every test: several CPU devices, rank promotion raises,
warnings are errors (see pyproject.toml)."""

import os
import subprocess
import tempfile

# Must be set before jax initialises its backends.
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

import jax_cb_ckpt  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")


@pytest.fixture
def ckpt_dir(tmp_path):
    return tmp_path / "ckpt"


@pytest.fixture
def make_ckpt(ckpt_dir):
    """Checkpointers that are closed at the end of the test, whatever happens."""
    made = []

    def make(directory=None, **kwargs):
        ckpt = jax_cb_ckpt.Checkpointer(directory or ckpt_dir, **kwargs)
        made.append(ckpt)
        return ckpt

    yield make
    for ckpt in made:
        try:
            ckpt.close()
        except jax_cb_ckpt.CheckpointError:
            pass


@pytest.fixture
def small_disk():
    """`small_disk("512k")`: a directory on a tmpfs of that size (a disk that fills up).
    Mounting needs root, as in CI here; elsewhere the test is skipped, saying why."""
    mounts = []

    def make(size):
        path = tempfile.mkdtemp()
        result = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", path], capture_output=True
        )
        if result.returncode != 0:
            os.rmdir(path)
            pytest.skip(f"cannot mount a small tmpfs here: {result.stderr.decode().strip()}")
        mounts.append(path)
        return path

    yield make
    for path in mounts:
        subprocess.run(["umount", "-l", path], check=False)
        os.rmdir(path)


def toy_state(n=4):
    """A small state with every kind of leaf the loop tests use."""
    return {
        "x": jnp.arange(n, dtype=jnp.float32),
        "count": jnp.asarray(0, jnp.int32),
        "key": jax.random.key(0),
        "half": jnp.zeros((n,), jnp.bfloat16),
    }


def toy_update(state, step):
    """Exactly representable arithmetic: any compilation gives the same bits."""
    key, _ = jax.random.split(state["key"])
    x = state["x"] * 0.5 + step.astype(jnp.float32)
    return {
        "x": x,
        "count": state["count"] + step,
        "key": key,
        "half": x.astype(jnp.bfloat16),
    }


def toy_reference(n_steps, n=4, state=None):
    """The state after each step, computed eagerly one step at a time (no checkpointing),
    from `state` (default: `toy_state(n)`)."""
    state = toy_state(n) if state is None else state
    out = {}
    for step in range(n_steps):
        state = toy_update(state, jnp.asarray(step, jnp.int32))
        out[step] = state
    return out


def assert_same_state(a, b):
    """Bit-for-bit equality of two states with the same pytree structure and types."""
    assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
    for (path, x), y in zip(
        jax.tree_util.tree_flatten_with_path(a)[0], jax.tree_util.tree_leaves(b), strict=True
    ):
        name = jax.tree_util.keystr(path)
        assert type(x) is type(y) or (isinstance(x, jax.Array) and isinstance(y, jax.Array)), name
        if isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            assert jax.random.key_impl(x) == jax.random.key_impl(y), name
            x, y = jax.random.key_data(x), jax.random.key_data(y)
        xa, ya = np.asarray(x), np.asarray(y)
        assert xa.dtype == ya.dtype, name
        assert xa.shape == ya.shape, name
        assert xa.tobytes() == ya.tobytes(), name
