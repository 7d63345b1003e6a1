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


def test_a_compressed_chunk_that_does_not_decode_is_damage(tmp_path):
    """Issue 43 item 6: a zstd chunk garbled on disk makes TensorStore fail with
    FAILED_PRECONDITION ("ZSTD_decompressStream() failed"), which the message-text
    matching did not know: restore and verify raised a plain RestoreError, and a
    restart stopped there instead of going back to the step before. It is damage."""
    directory = tmp_path / "c"
    big = {"z": np.repeat(np.arange(1 << 18, dtype=np.float32), 4)}  # 4 MiB, compressible
    with jax_cb_ckpt.Checkpointer(directory, compression=True) as ckpt:
        ckpt.save(big, 1)
        ckpt.save(jax.tree.map(lambda x: x + 1, big), 2)
    [data] = [f for f in data_files(directory / "2") if os.path.getsize(f) > 1 << 12]
    garbled = bytearray(Path(data).read_bytes())
    for at in range(0, len(garbled) // 2, 1024):  # chunks' frames (the index is at the end)
        garbled[at : at + 32] = bytes(range(32))
    Path(data).write_bytes(bytes(garbled))
    for read in (
        lambda: jax_cb_ckpt.restore(directory, big, step=2),
        lambda: jax_cb_ckpt.verify(directory, step=2),
    ):
        with pytest.raises(jax_cb_ckpt.DamagedStepError) as caught:
            read()
        assert caught.value.why.startswith("cannot read"), caught.value.why
    with pytest.warns(jax_cb_ckpt.DamagedStepWarning, match="step 2"):
        with jax_cb_ckpt.Checkpointer(directory) as ckpt:
            restored, start = ckpt.restore_or_init(lambda: big)
    assert start == 1 and jax_cb_ckpt.same_bits(restored, big)


def test_tensorstore_errors_are_classified_by_status_code_not_by_their_words(tmp_path):
    """Issue 43 item 6: damage was told from a crash by words of TensorStore's messages
    ("Error decoding", "checksum", ...). Now by the status code each error begins with
    (absl's canonical codes): a reworded message keeps its class, and words of damage
    in an error of another code do not make it damage."""
    import tensorstore as ts

    from jax_cb_ckpt._read import _steps
    from jax_cb_ckpt._storage import _faults, _places

    with pytest.raises(ValueError) as real:  # a real TensorStore error
        ts.open({"driver": "zarr", "kvstore": f"file://{tmp_path}/none/"}, open=True).result()
    assert _faults.status(real.value) == "NOT_FOUND"
    with jax_cb_ckpt.Checkpointer(tmp_path / "c") as ckpt:
        ckpt.save({"w": np.arange(3.0)}, 1)
    storage = _places.at(str(tmp_path / "c"))
    seen = storage.open_step(1).identity

    def classified(error):
        return type(_steps.read_failure(error, storage, 1, seen, "leaf w"))

    try:
        raise RuntimeError("Orbax could not restore the item") from real.value
    except RuntimeError as wrapped:  # (Orbax re-raises TensorStore's errors)
        assert _faults.status(wrapped) == "NOT_FOUND"
        assert classified(wrapped) is jax_cb_ckpt.DamagedStepError
    for code in ("DATA_LOSS", "OUT_OF_RANGE", "NOT_FOUND", "FAILED_PRECONDITION"):
        reworded = ValueError(f"{code}: words no TensorStore release has used yet")
        assert classified(reworded) is jax_cb_ckpt.DamagedStepError, code
    for code in ("PERMISSION_DENIED", "UNAVAILABLE", "INVALID_ARGUMENT", "INTERNAL"):
        wordy = ValueError(f"{code}: Error decoding: checksum DATA_LOSS NOT_FOUND OUT_OF_RANGE")
        assert classified(wordy) is jax_cb_ckpt.RestoreError, code
    assert _faults.status(ValueError("no code here: DATA_LOSS")) is None
    assert classified(ValueError("Data corruption somewhere")) is jax_cb_ckpt.RestoreError
