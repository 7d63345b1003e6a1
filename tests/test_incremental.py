"""Incremental saves (`Checkpointer(..., incremental=True)`): a step writes the chunks
that changed since the step before it and links the rest, and each step stays a whole
plain Orbax checkpoint (docs/usage.md, "Incremental saves").

Real parts: real Orbax, real files, hard links checked on disk (`st_nlink`, inodes), a
local GCS and S3 server for the buckets. The state is a ring buffer in flashbax's
layout, (add_batch, time, features), that changes by a slice along time per save.
jit, vmap, sharded and multi-process saves: tests/test_incremental_dist.py.
"""

from __future__ import annotations

import hashlib
import os
import random
import shutil

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

import jax_cb_ckpt
from jax_cb_ckpt import ConfigError, DamagedStepError

B, T, F = 8, 4096, 256  # 32 MiB of float32


def _states(saves, fraction=1 / 32, seed=0, shape=(B, T, F)):
    """The states of a run that saves `saves` times: a ring buffer written a slice
    (`fraction` of its time axis) further each save, the parameters changed each save."""
    rng = np.random.default_rng(seed)
    buf = rng.standard_normal(shape, dtype=np.float32)
    params = rng.standard_normal((256, 256), dtype=np.float32)
    width = max(1, int(shape[1] * fraction))
    out = []
    for i in range(saves):
        start = (i * width) % shape[1]
        buf = buf.copy()
        buf[:, start : start + width] = rng.standard_normal(
            buf[:, start : start + width].shape, dtype=np.float32
        )
        params = params + np.float32(0.5)
        out.append({"buf": buf, "params": params, "index": np.int32(start + width)})
    return out


def _like(state):
    return jax.tree.map(np.zeros_like, state)


def _same(a, b):
    return jax_cb_ckpt.same_bits(a, b)


def _save_all(directory, states, **options):
    """Save `states` as steps 1..n, each waited for; the written bytes of each."""
    written = []
    with jax_cb_ckpt.Checkpointer(directory, incremental=True, **options) as ckpt:
        for step, state in enumerate(states, start=1):
            ckpt.save(state, step)
            ckpt.wait()
            written.append((ckpt.stats.recent[-1].written_bytes, ckpt.stats.recent[-1].nbytes))
    return written


def _data_files(directory, step):
    folder = os.path.join(directory, str(step), "state", "d")
    return {name: os.stat(os.path.join(folder, name)) for name in os.listdir(folder)}


def _plain_restore(directory, step, like):
    with ocp.CheckpointManager(directory) as manager:
        args = ocp.args.Composite(state=ocp.args.PyTreeRestore(like))
        return manager.restore(step, args=args)["state"]


def test_a_ring_buffer_that_changed_by_a_slice_costs_the_slice(tmp_path):
    directory = str(tmp_path / "ckpt")
    states = _states(6)
    written = _save_all(directory, states)
    nbytes = written[0][1]
    assert written[0][0] == nbytes  # the first save of a writer is whole
    for wrote, _ in written[1:]:
        assert wrote <= 0.15 * nbytes, (wrote, nbytes)  # 1/32 of the buffer + params
    # On disk: the bytes new in a linked step (files of one link) are the slice's, the
    # rest are links to the step before (the same inode).
    for step in range(2, 7):
        files, before = _data_files(directory, step), _data_files(directory, step - 1)
        new = sum(s.st_size for s in files.values() if s.st_nlink == 1)
        assert new <= 0.15 * nbytes, (step, new)
        shared = [n for n, s in files.items() if n in before and s.st_ino == before[n].st_ino]
        assert sum(files[n].st_size for n in shared) >= 0.8 * nbytes
    for step, state in enumerate(states, start=1):
        assert _same(jax_cb_ckpt.restore(directory, _like(state), step=step), state)


def test_full_every_writes_every_kth_save_whole(tmp_path):
    directory = str(tmp_path / "ckpt")
    states = _states(7)
    written = _save_all(directory, states, full_every=3)
    whole = [wrote == nbytes for wrote, nbytes in written]
    assert whole == [True, False, False, True, False, False, True]
    # A whole step shares no file with the step before it.
    files, before = _data_files(directory, 4), _data_files(directory, 3)
    assert not {s.st_ino for s in files.values()} & {s.st_ino for s in before.values()}


def test_each_step_alone_is_a_whole_plain_orbax_checkpoint(tmp_path):
    directory = str(tmp_path / "ckpt")
    states = _states(5)
    _save_all(directory, states)
    for step, state in enumerate(states, start=1):
        alone = str(tmp_path / f"alone{step}")
        os.makedirs(alone)
        shutil.copytree(os.path.join(directory, str(step)), os.path.join(alone, str(step)))
        assert _same(_plain_restore(alone, step, _like(state)), state)
        assert _same(jax_cb_ckpt.restore(alone, _like(state)), state)
        jax_cb_ckpt.verify(alone, step=step)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_deleting_steps_in_any_order_leaves_every_other_step_whole(tmp_path, seed):
    directory = str(tmp_path / "ckpt")
    states = _states(6)
    _save_all(directory, states, full_every=None)
    order = list(range(1, 7))
    random.Random(seed).shuffle(order)
    left = set(order)
    for step in order[:-1]:
        shutil.rmtree(os.path.join(directory, str(step)))
        left.discard(step)
        for other in sorted(left):
            jax_cb_ckpt.verify(directory, step=other)
            assert _same(
                jax_cb_ckpt.restore(directory, _like(states[other - 1]), step=other),
                states[other - 1],
            )
    last = left.pop()
    assert _same(_plain_restore(directory, last, _like(states[last - 1])), states[last - 1])


def test_retention_that_deletes_middle_steps_keeps_the_others_whole(tmp_path):
    """keep_best keeps the best step and the newest: it deletes steps in the middle of
    the chain, whose files newer steps link."""
    directory = str(tmp_path / "ckpt")
    states = _states(6)
    losses = [3.0, 1.0, 5.0, 4.0, 6.0, 2.0]  # step 2 stays best; 3, 4, 5 go, 6 is newest
    with jax_cb_ckpt.Checkpointer(
        directory, incremental=True, keep_best=1, best="loss", mode="min"
    ) as ckpt:
        for step, (state, loss) in enumerate(zip(states, losses, strict=True), start=1):
            ckpt.save(state, step, metrics={"loss": loss})
            ckpt.wait()
        assert ckpt.stats.recent[-1].written_bytes < ckpt.stats.recent[-1].nbytes / 4
    assert jax_cb_ckpt.all_steps(directory) == [2, 6]
    for step in (2, 6):
        jax_cb_ckpt.verify(directory, step=step)
        assert _same(jax_cb_ckpt.restore(directory, _like(states[0]), step=step), states[step - 1])


def test_a_linked_step_never_changes_the_files_of_the_step_before(tmp_path):
    directory = str(tmp_path / "ckpt")
    states = _states(4)

    def digests(step):
        root = os.path.join(directory, str(step))
        out = {}
        for folder, _, files in os.walk(root):
            for name in files:
                with open(os.path.join(folder, name), "rb") as f:
                    out[os.path.relpath(os.path.join(folder, name), root)] = hashlib.sha256(
                        f.read()
                    ).hexdigest()
        return out

    with jax_cb_ckpt.Checkpointer(directory, incremental=True) as ckpt:
        ckpt.save(states[0], 1)
        ckpt.wait()
        for step in range(2, 5):
            before = digests(step - 1)
            ckpt.save(states[step - 1], step)
            ckpt.wait()
            assert digests(step - 1) == before
            assert ckpt.stats.recent[-1].written_bytes < ckpt.stats.recent[-1].nbytes / 4


def test_the_newest_step_holds_only_files_it_reads(tmp_path):
    """Linked files whose every chunk was replaced are not linked on: after the ring
    went round twice, the newest step holds about one state's bytes, not every save's."""
    directory = str(tmp_path / "ckpt")
    states = _states(20, fraction=1 / 8, shape=(B, T // 4, F))  # 8 MiB, round twice+
    written = _save_all(directory, states, full_every=None, max_to_keep=2)
    nbytes = written[0][1]
    files = _data_files(directory, 20)
    total = sum(s.st_size for s in files.values())
    assert total <= 2 * nbytes, (total, nbytes)  # without pruning: 1 + 19/8 states
    assert _same(jax_cb_ckpt.restore(directory, _like(states[-1])), states[-1])


def test_a_flipped_bit_damages_every_step_that_links_it_and_a_restart_falls_back(tmp_path):
    directory = str(tmp_path / "ckpt")
    states = _states(6)
    _save_all(directory, states, full_every=3)  # 1 whole, 2-3 linked, 4 whole, 5-6 linked
    # The last chunk of the ring along time, which no save after step 4 changed: its
    # value in a data file step 4 wrote, which 5 and 6 link. Flip a byte in it.
    from jax_cb_ckpt._layout import _ocdbt

    index = _ocdbt.Database(os.path.join(directory, "4", "state"))
    keys = sorted(k for k in index.values if k.startswith(b"buf/") and b".zarray" not in k)
    where = index.locate(max(keys, key=lambda k: int(k.split(b".")[1])).decode())
    assert isinstance(where, _ocdbt.Indirect)
    name = where.path.split("/")[-1]
    files4 = _data_files(directory, 4)
    assert _data_files(directory, 6)[name].st_ino == files4[name].st_ino
    path = os.path.join(directory, "4", "state", "d", name)
    with open(path, "r+b") as f:
        f.seek(where.offset + where.length // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x10]))
    for step in (4, 5, 6):
        with pytest.raises(DamagedStepError):
            jax_cb_ckpt.verify(directory, step=step)
    for step in (1, 2, 3):
        jax_cb_ckpt.verify(directory, step=step)
    # A restart passes over the damaged steps to the newest intact one.
    with pytest.warns(UserWarning):
        with jax_cb_ckpt.Checkpointer(directory, incremental=True) as ckpt:
            got, step = ckpt.restore_or_init(lambda: states[0], like=_like(states[0]))
    assert step == 3
    assert _same(got, states[2])


def test_a_save_of_another_layout_or_without_its_previous_step_is_written_whole(tmp_path):
    directory = str(tmp_path / "ckpt")
    states = _states(3)
    with jax_cb_ckpt.Checkpointer(directory, incremental=True) as ckpt:
        ckpt.save(states[0], 1)
        ckpt.wait()
        other = dict(states[1], extra_leaf=np.arange(10.0))  # another tree: whole
        ckpt.save(other, 2)
        ckpt.wait()
        assert ckpt.stats.recent[-1].written_bytes == ckpt.stats.recent[-1].nbytes
        ckpt.save(dict(states[2], extra_leaf=np.arange(10.0)), 3)
        ckpt.wait()
        assert ckpt.stats.recent[-1].written_bytes < ckpt.stats.recent[-1].nbytes / 4
        shutil.rmtree(os.path.join(directory, "3"))  # the step to link from, gone
        ckpt.save(dict(states[0], extra_leaf=np.arange(10.0)), 4)
        ckpt.wait()
        assert ckpt.stats.recent[-1].written_bytes == ckpt.stats.recent[-1].nbytes
    want = dict(states[0], extra_leaf=np.arange(10.0))
    assert _same(jax_cb_ckpt.restore(directory, _like(want), step=4), want)


def test_compressed_steps_link_and_restore_exactly(tmp_path):
    directory = str(tmp_path / "ckpt")
    states = _states(4)
    written = _save_all(directory, states, compression=True)
    assert all(wrote < nbytes / 4 for wrote, nbytes in written[1:])
    for step, state in enumerate(states, start=1):
        assert _same(_plain_restore(directory, step, _like(state)), state)


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"incremental": "yes"}, "incremental"),
        ({"incremental": True, "full_every": 0}, "full_every"),
        ({"incremental": True, "full_every": 2.5}, "full_every"),
        ({"full_every": 4}, "full_every"),
    ],
)
def test_bad_options_are_refused_by_name(tmp_path, options, named):
    with pytest.raises(ConfigError, match=rf"Checkpointer\({named}="):
        jax_cb_ckpt.Checkpointer(str(tmp_path / "ckpt"), **options)
    assert not os.path.exists(tmp_path / "ckpt" / "1")


def test_in_a_bucket_steps_are_whole_and_deleted_in_any_order(remote):
    from jax_cb_ckpt._storage import _remote

    states = _states(4, shape=(4, 8192, 64))  # 8 MiB: the servers share this VM
    written = _save_all(remote.url, states, full_every=None)
    assert all(wrote < nbytes / 4 for wrote, nbytes in written[1:])
    left = [1, 2, 3, 4]
    for step in (2, 4, 1):
        _remote.delete_prefix(f"{remote.url}/{step}")
        left.remove(step)
        for other in left:
            jax_cb_ckpt.verify(remote.url, step=other)
            got = jax_cb_ckpt.restore(remote.url, _like(states[0]), step=other)
            assert _same(got, states[other - 1])


def test_the_save_after_a_failed_one_is_written_whole(tmp_path):
    directory = str(tmp_path / "ckpt")
    states = _states(4)
    with jax_cb_ckpt.Checkpointer(directory, incremental=True, on_error="continue") as ckpt:
        for step in (1, 2):
            ckpt.save(states[step - 1], step)
            ckpt.wait()
        assert ckpt.stats.recent[-1].written_bytes < ckpt.stats.recent[-1].nbytes / 4
        (tmp_path / "ckpt" / "3").write_text("a user's file in the way")
        ckpt.save(states[2], 3)
        with pytest.warns(jax_cb_ckpt.SaveFailedWarning, match=r"step 3 .* is not a checkpoint"):
            ckpt.wait()
        ckpt.save(states[3], 4)
        ckpt.wait()
        assert ckpt.stats.recent[-1].step == 4
        assert ckpt.stats.recent[-1].written_bytes == ckpt.stats.recent[-1].nbytes
    assert _same(jax_cb_ckpt.restore(directory, _like(states[3]), step=4), states[3])


def test_a_previous_step_replaced_meanwhile_is_not_linked_from(tmp_path):
    """The step a save would link from was replaced by another run's step of the same
    number (copied in by hand): its files are not the ones the digests describe, so the
    save is written whole, and holds its own state."""
    directory, other = str(tmp_path / "ckpt"), str(tmp_path / "other")
    states, others = _states(3), _states(2, seed=1)
    _save_all(other, others)
    with jax_cb_ckpt.Checkpointer(directory, incremental=True) as ckpt:
        for step in (1, 2):
            ckpt.save(states[step - 1], step)
            ckpt.wait()
        shutil.rmtree(os.path.join(directory, "2"))
        shutil.copytree(os.path.join(other, "2"), os.path.join(directory, "2"))
        ckpt.save(states[2], 3)
        ckpt.wait()
        assert ckpt.stats.recent[-1].written_bytes == ckpt.stats.recent[-1].nbytes
    jax_cb_ckpt.verify(directory, step=3)
    assert _same(jax_cb_ckpt.restore(directory, _like(states[2]), step=3), states[2])


@pytest.mark.parametrize(("scheme", "extra"), [("gs", "gcs"), ("s3", "s3")])
def test_a_bucket_without_its_copy_library_is_refused_at_construction(scheme, extra, monkeypatch):
    """Links in a bucket are server-side copies, made by the provider's client library:
    without it, `incremental=True` is refused when the Checkpointer is made (not at the
    first linked save), naming the extra to install."""
    for module in ("google.cloud.storage", "boto3"):
        monkeypatch.setitem(__import__("sys").modules, module, None)
    with pytest.raises(ConfigError, match=rf"incremental=True.*jax-cb-ckpt\[{extra}\]"):
        jax_cb_ckpt.Checkpointer(f"{scheme}://bucket-x/run", incremental=True)
