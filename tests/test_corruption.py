"""What was written is what is read: a changed byte in a step's files is a RestoreError
naming the leaf and step (restore, and jax_cb_ckpt.verify), never wrong numbers."""

import os
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from helpers import data_files, flip, flip_stored, run_child
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_cb_ckpt

N = 1 << 16  # 256 KiB of float32: written through the zarr driver, in its own file


def state(compression_seed=0):
    rng = np.random.default_rng(compression_seed)
    return {
        "w": rng.standard_normal(N).astype(np.float32),
        "small": np.arange(8, dtype=np.int32),
        "z": np.repeat(np.arange(N // 64, dtype=np.float32), 64),  # compressible
    }


@pytest.mark.parametrize("compression", [False, True])
def test_one_flipped_byte_is_detected_on_restore_and_by_verify(make_ckpt, compression):
    ckpt = make_ckpt(compression=compression)
    ckpt.save(state(), 1)
    ckpt.save(state(1), 2)
    ckpt.wait()
    assert jax_cb_ckpt.verify(ckpt.directory) == [1, 2]
    like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state())
    step_dir = os.path.join(ckpt.directory, "1")
    files = data_files(step_dir)
    # the middle of the largest data file: array data, not the file's header
    flip(files[0], os.path.getsize(files[0]) // 2)
    with pytest.raises(jax_cb_ckpt.RestoreError) as caught:
        ckpt.restore(like, step=1)
    message = str(caught.value)
    if "is corrupted" in message:  # our checksum caught it
        assert "restore(step=1)" in message and "leaf state['" in message, message
        assert step_dir in message, message
    else:  # the codec refused it (zstd frames carry their size): ours, not numbers
        assert compression, message
    with pytest.raises(jax_cb_ckpt.RestoreError, match=r"verify\(step=1\)"):
        jax_cb_ckpt.verify(ckpt.directory)
    assert jax_cb_ckpt.verify(ckpt.directory, step=2) == [2]  # the other step is fine
    assert jax_cb_ckpt.same_bits(ckpt.restore(like, step=2), state(1))
    # verify=False reads what is there (for speed, at the user's risk)
    if not compression:
        got = ckpt.restore(like, step=1, verify=False)
        assert not jax_cb_ckpt.same_bits(got, state())


def test_plain_orbax_without_checksums_restores_the_flipped_number(make_ckpt):
    """Why the checksums exist: Orbax itself returns the changed value silently."""
    ckpt = make_ckpt()
    ckpt.save(state(), 1)
    ckpt.wait()
    step_dir = os.path.join(ckpt.directory, "1")
    flip(data_files(step_dir)[0], os.path.getsize(data_files(step_dir)[0]) // 2)
    plain = ocp.StandardCheckpointer().restore(os.path.join(step_dir, "state"))
    assert not all(np.array_equal(plain[k], v) for k, v in state().items())


def test_a_corrupted_block_of_a_sharded_restore_is_detected(make_ckpt):
    """Per-device saves keep a checksum per block; a restore with the save's sharding
    checks shard by shard, one with another sharding reads the leaf on the host."""
    mesh = jax.make_mesh((4,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
    sharding = NamedSharding(mesh, P("d"))
    ckpt = make_ckpt()
    x = jax.device_put(jnp.arange(4 * N, dtype=jnp.float32), sharding)

    @jax.jit
    def save(x):
        ckpt.save({"x": x}, 3, shardings={"x": sharding})
        return x

    save(x).block_until_ready()
    ckpt.wait()
    assert len(jax_cb_ckpt.metadata(ckpt.directory)["checksums"]["x"]) == 4
    step_dir = os.path.join(ckpt.directory, "3")
    # A byte of the third device's block, wherever it lies (the blocks go into one data
    # file or two, in any order, depending on TensorStore's timing).
    third = np.arange(4 * N, dtype=np.float32)[2 * N + 1000 : 2 * N + 1016]
    where = flip_stored(step_dir, third)
    for spec in (P("d"), P()):  # the save's sharding; another one
        like = {"x": jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, spec))}
        try:
            ckpt.restore(like)
        except jax_cb_ckpt.RestoreError as e:
            assert "leaf state['x'] is corrupted" in str(e), e
        else:
            files = [(f, os.path.getsize(f)) for f in data_files(step_dir)]
            pytest.fail(f"not detected with {spec}: flipped {where}; data files {files}")


def test_a_truncated_file_with_a_sharded_like_is_a_readable_error(make_ckpt):
    mesh = jax.make_mesh((4,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
    ckpt = make_ckpt()
    ckpt.save({"w": np.arange(4 * N, dtype=np.float32)}, 1)
    ckpt.wait()
    biggest = data_files(os.path.join(ckpt.directory, "1"))[0]
    os.truncate(biggest, os.path.getsize(biggest) // 2)
    sharding = NamedSharding(mesh, P("d"))
    like = {"w": jax.ShapeDtypeStruct((4 * N,), jnp.float32, sharding=sharding)}
    with pytest.raises(jax_cb_ckpt.RestoreError) as caught:
        ckpt.restore(like)
    message = str(caught.value)
    assert "restore(step=1)" in message and "bound method" not in message, message


def test_verify_fails_what_the_cli_fails(tmp_path):
    """Issue 42 item 7: `verify(d)` of a directory whose only step is damaged returned []
    (no error, no warning) where `jax-cb-ckpt verify d` exits 1; of an empty directory,
    [] where the CLI exits 2. `verify(d) and deploy()` must be as safe as the CLI."""
    d = tmp_path / "ckpt"
    with jax_cb_ckpt.Checkpointer(d) as ckpt:
        ckpt.save({"w": np.ones(3, np.float32)}, 1)
    with open(d / "1" / "meta" / "metadata", "ab") as f:
        f.write(b" ")  # edited
    with pytest.raises(jax_cb_ckpt.DamagedStepError, match=r"step 1 .* is damaged"):
        jax_cb_ckpt.verify(d)
    cli = Path(sys.executable).with_name("jax-cb-ckpt")
    assert run_child([cli, "verify", d]).returncode == 1
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(jax_cb_ckpt.NoCheckpointError, match="nothing was verified"):
        jax_cb_ckpt.verify(empty)
    assert run_child([cli, "verify", empty]).returncode == 2
