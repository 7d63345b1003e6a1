"""Restoring one member of a batch saved under vmap (`restore(like, member=k)`): exact
for every member, with one or two batch axes; only the member's chunks are read (bytes
read counted by the kernel, /proc/self/io); a flipped byte in them is detected; a
member that did not save, a `like` with or without the batch axes and a bad index are
refused with errors that say what to pass."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import data_files, flip

import jax_cb_ckpt

MEMBER_MIB = 8  # a 64 MiB batch of 8: stored in 16 MiB chunks of two members each


def init(seed):
    key = jax.random.key(seed)
    w = jax.random.normal(key, (MEMBER_MIB * 2**18,))
    return {"w": w, "key": key, "n": jnp.int32(seed), "small": jnp.arange(3.0) + seed}


def member_like():
    return jax.eval_shape(lambda: init(0))


@pytest.fixture(scope="module")
def batched(tmp_path_factory):
    """Step 1: 8 members of `init`, saved from jit(vmap)."""
    directory = tmp_path_factory.mktemp("member") / "ckpt"
    with jax_cb_ckpt.Checkpointer(directory) as ckpt:

        def save(state):
            ckpt.maybe_save(state, 1, when=True)
            return state

        jax.block_until_ready(jax.jit(jax.vmap(save))(jax.vmap(init)(jnp.arange(8))))
    return directory


def bytes_read():
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar")).split()[1])


def test_every_member_restores_exactly(batched):
    for k in range(8):
        restored = jax_cb_ckpt.restore(batched, member_like(), member=k)
        assert jax_cb_ckpt.same_bits(restored, init(k)), k
    assert jax_cb_ckpt.restore(batched, init(0), member=(3,))["n"] == 3  # a 1-tuple too


def test_a_member_reads_its_chunks_not_the_batch(batched):
    before = bytes_read()
    jax_cb_ckpt.restore(batched, member_like(), member=5)
    member = bytes_read() - before
    before = bytes_read()
    jax_cb_ckpt.restore(batched, jax.eval_shape(lambda: jax.vmap(init)(jnp.arange(8))))
    whole = bytes_read() - before
    print(f"\nbytes read: member {member / 2**20:.1f} MiB, whole batch {whole / 2**20:.1f} MiB")
    assert whole >= 8 * MEMBER_MIB * 2**20
    assert member <= 2.5 * MEMBER_MIB * 2**20  # its chunk (two members), not eight


def test_two_batch_axes_and_a_member_that_did_not_save(tmp_path):
    with jax_cb_ckpt.Checkpointer(tmp_path / "ckpt") as ckpt:

        def save(state, keep):
            ckpt.maybe_save(state, 2, when=keep)
            return state

        seeds = jnp.arange(6).reshape(2, 3)
        keep = jnp.array([[True, True, False], [True, True, True]])
        states = jax.vmap(jax.vmap(lambda s: {"x": jnp.full((4,), s, jnp.float32)}))(seeds)
        jax.jit(jax.vmap(jax.vmap(save)))(states, keep)
    like = {"x": jnp.zeros(4)}
    for i, j in [(0, 0), (1, 2), (0, 1)]:
        x = jax_cb_ckpt.restore(tmp_path / "ckpt", like, member=(i, j))["x"]
        np.testing.assert_array_equal(x, np.full(4, 3 * i + j, np.float32))
    with pytest.raises(jax_cb_ckpt.RestoreError, match=r"member \(0, 2\) did not save at step 2"):
        jax_cb_ckpt.restore(tmp_path / "ckpt", like, member=(0, 2))
    with pytest.raises(jax_cb_ckpt.ConfigError, match=r"a tuple of 2 ints"):
        jax_cb_ckpt.restore(tmp_path / "ckpt", like, member=1)


def test_a_flipped_byte_in_the_members_chunk_is_detected(batched, tmp_path):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(batched, copy)
    biggest = data_files(os.path.join(copy, "1"))[0]
    flip(biggest, os.path.getsize(biggest) // 2)
    failed = []
    for k in range(8):
        try:
            jax_cb_ckpt.restore(copy, member_like(), member=k)
        except jax_cb_ckpt.RestoreError as e:
            assert "leaf state['w'] is corrupted" in str(e), e
            failed.append(k)
    assert failed and len(failed) <= 2, failed  # the members of the flipped chunk only


def test_a_like_with_or_without_the_batch_is_told_how_to_pick(batched):
    with pytest.raises(
        jax_cb_ckpt.StructureMismatchError,
        match=r"a batch saved under vmap, of shape \(8,\).*restore\(like, member=k\)",
    ):
        jax_cb_ckpt.restore(batched, member_like())
    with pytest.raises(jax_cb_ckpt.StructureMismatchError, match=r"like has the batch axes \(8,\)"):
        jax_cb_ckpt.restore(batched, jax.vmap(init)(jnp.arange(8)), member=1)
    with pytest.raises(jax_cb_ckpt.ConfigError, match=r"member=8 is not a member .* \(8,\)"):
        jax_cb_ckpt.restore(batched, member_like(), member=8)
    with pytest.raises(jax_cb_ckpt.ConfigError, match=r"member=True"):
        jax_cb_ckpt.restore(batched, member_like(), member=True)


def test_member_of_a_checkpoint_without_a_batch_is_refused(make_ckpt):
    ckpt = make_ckpt()
    ckpt.save({"x": jnp.ones(3)}, 1)
    ckpt.wait()
    with pytest.raises(jax_cb_ckpt.ConfigError, match=r"not saved under vmap"):
        ckpt.restore({"x": jnp.ones(3)}, member=0)
