"""`extra=`: JSON beside the state (issue 56 item 2), end to end: an eager save with a
dict, a jitted scan with a function of the step, `run`, `scan`, `vmap`; plain Orbax
reads the item (the bytes Orbax's own JsonSave writes); `restore_extra`, `metadata`,
`verify` and `jax-cb-ckpt show` return it; bad input refused by name, at the call for
a dict and from `wait()` for a function's result, with the steps already written kept;
a hostile file read back bounded and checked before it is parsed."""

import json
import os
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import needs, run_child

import jax_cb_ckpt
from jax_cb_ckpt import ConfigError, DamagedStepError
from jax_cb_ckpt._cli._main import main
from jax_cb_ckpt._layout import _format

CONFIG = {"config": {"lr": 0.1, "layers": [64, 64], "name": "ppo"}, "git": "3ee59b7", "ok": None}


def _steps_extra(directory):
    return {
        s: jax_cb_ckpt.restore_extra(directory, step=s) for s in jax_cb_ckpt.all_steps(directory)
    }


def test_eager_dict_is_stored_as_orbax_json_item_and_read_back(tmp_path):
    import orbax.checkpoint as ocp

    d = tmp_path / "ck"
    value = json.loads(json.dumps(CONFIG))
    with jax_cb_ckpt.Checkpointer(d) as ckpt:
        ckpt.save({"w": np.arange(4.0)}, 3, extra=value)
        value["git"] = "changed after the call"  # taken as it was at the call
        ckpt.wait()
        assert ckpt.restore_extra(3) == CONFIG
        assert ckpt.metadata(3)["extra"] == CONFIG
    assert jax_cb_ckpt.restore_extra(d) == CONFIG
    assert jax_cb_ckpt.verify(d) == [3]
    # Plain Orbax: the item is named in the step file and read by JsonRestore.
    with ocp.CheckpointManager(d) as manager:
        got = manager.restore(3, args=ocp.args.Composite(extra=ocp.args.JsonRestore()))
    assert got["extra"] == CONFIG
    # The bytes are the ones Orbax's own JsonSave writes for the same value.
    theirs = tmp_path / "orbax"
    with ocp.CheckpointManager(theirs) as manager:
        manager.save(3, args=ocp.args.Composite(extra=ocp.args.JsonSave(CONFIG)))
        manager.wait_until_finished()
    assert (d / "3/extra/metadata").read_bytes() == (theirs / "3/extra/metadata").read_bytes()


def test_a_step_without_extra_has_no_item_and_returns_none(tmp_path):
    d = tmp_path / "ck"
    with jax_cb_ckpt.Checkpointer(d) as ckpt:
        ckpt.save({"w": np.arange(4.0)}, 1)
    assert not (d / "1/extra").exists()
    record = json.loads((d / "1" / _format.ORBAX_STEP_FILE).read_text())
    assert "extra" not in record["item_handlers"]
    assert "extra_bytes" not in record["custom_metadata"]["jax_cb_ckpt"]
    assert jax_cb_ckpt.restore_extra(d, step=1) is None
    assert "extra" not in jax_cb_ckpt.metadata(d, step=1)


def test_jitted_scan_calls_the_function_on_the_host_with_each_saved_step(tmp_path):
    d = tmp_path / "ck"
    calls = []

    def position(step):
        calls.append(step)
        return {"data_position": step * 32, "kind": type(step).__name__}

    with jax_cb_ckpt.Checkpointer(d, every=3) as ckpt:

        @jax.jit
        def train(x, start):
            def body(c, i):
                c = c + 1.0
                ckpt.maybe_save(c, start + i + 1, extra=position)
                return c, None

            return jax.lax.scan(body, x, jnp.arange(10))[0]

        train(jnp.zeros(3), 0)
        ckpt.wait()
        assert calls == [3, 6, 9]  # never at trace time, never at steps that do not save
        train(jnp.zeros(3), 10)  # (the same program: the function is called again)
    assert calls == [3, 6, 9, 12, 15, 18]
    saved = (3, 6, 9, 12, 15, 18)
    assert _steps_extra(d) == {s: {"data_position": s * 32, "kind": "int"} for s in saved}


def test_vmap_saves_one_extra_per_step(tmp_path):
    d = tmp_path / "ck"
    calls = []

    def extra(step):
        calls.append(step)
        return {"step": step}

    with jax_cb_ckpt.Checkpointer(d, every=2) as ckpt:

        def train(x):
            def body(c, i):
                c = c + x
                ckpt.maybe_save(c, i + 1, extra=extra)
                return c, None

            return jax.lax.scan(body, x, jnp.arange(4))[0]

        jax.jit(jax.vmap(train))(jnp.arange(3.0))
    assert calls == [2, 4]  # once per saved step, for the whole batch of 3
    assert _steps_extra(d) == {2: {"step": 2}, 4: {"step": 4}}
    assert jax_cb_ckpt.metadata(d, step=4)["batch_shape"] == [3]


def test_run_and_scan_store_extra_with_each_of_their_saves(tmp_path):
    def body(state, step):
        return state + 1.0

    with jax_cb_ckpt.Checkpointer(tmp_path / "run", every=4) as ckpt:
        ckpt.run(body, jnp.zeros(2), num_steps=10, quiet=True, extra=lambda s: {"at": s})
    assert _steps_extra(tmp_path / "run") == {4: {"at": 4}, 8: {"at": 8}, 10: {"at": 10}}

    with jax_cb_ckpt.Checkpointer(tmp_path / "scan", every=5) as ckpt:
        jax.jit(lambda x: ckpt.scan(lambda c, _: (c + 1.0, None), x, length=10, extra=CONFIG))(
            jnp.zeros(2)
        )
    assert _steps_extra(tmp_path / "scan") == {5: CONFIG, 10: CONFIG}


@pytest.mark.parametrize(
    "bad, said",
    [
        ([1, 2], "extra must be a dict"),
        ({"lr": np.float32(0.1)}, "extra['lr'] is of type numpy.float32"),
        ({"a": {"b": [1, {2}]}}, "extra['a']['b'][1] is of type builtins.set"),
        ({"loss": float("nan")}, "extra['loss'] is nan"),
        ({"a": {3: "x"}}, "extra['a'] has the key 3 of type int"),
        ({"blob": "x" * (1 << 20)}, "more than the 1048576 bytes (1 MiB)"),
        ({"seed": [-(10**4300)]}, "extra['seed'][0] is an int of more than 4300 digits"),
    ],
)
def test_a_bad_dict_is_refused_at_the_call_naming_extra(tmp_path, bad, said):
    with jax_cb_ckpt.Checkpointer(tmp_path / "ck", every=1) as ckpt:
        with pytest.raises(ConfigError, match="extra") as info:
            ckpt.save({"w": np.zeros(2)}, 1, extra=bad)
        assert said in str(info.value) and "Fix" in str(info.value)
        with pytest.raises(ConfigError, match=r"extra\['t'\] is of type .*Tracer.*traced"):
            jax.jit(lambda x: ckpt.save(x, 2, extra={"t": x}))(jnp.zeros(2))
    assert jax_cb_ckpt.all_steps(tmp_path / "ck") == []


def test_a_bad_function_result_fails_its_save_from_wait_and_keeps_the_written(tmp_path):
    d = tmp_path / "ck"
    ckpt = jax_cb_ckpt.Checkpointer(d, every=2)

    def extra(step):
        return {"step": step} if step < 4 else {"seen": {step}}

    @jax.jit
    def train(x):
        def body(c, i):
            ckpt.maybe_save(c + i, i + 1, extra=extra)
            return c + 1.0, None

        return jax.lax.scan(body, x, jnp.arange(6))[0]

    try:
        jax.block_until_ready(train(jnp.zeros(2)))
    except Exception:  # (JAX's wrapping of the callback's failure, where it shows)
        pass
    with pytest.raises(ConfigError, match=r"extra=.*at step 4.*\['seen'\] is of type builtins.set"):
        ckpt.wait()
    ckpt.close()
    assert _steps_extra(d) == {2: {"step": 2}}  # the step written before is kept
    # Eagerly the host side is the call itself: raised there.
    with jax_cb_ckpt.Checkpointer(d, on_existing="replace") as again:
        with pytest.raises(ConfigError, match="calling it with step 7 raised ZeroDivisionError"):
            again.save({"w": np.zeros(2)}, 7, extra=lambda s: {"x": 1 / 0})
    assert jax_cb_ckpt.all_steps(d) == [2]


def test_fori_loop_without_every_refuses_extra(tmp_path):
    with jax_cb_ckpt.Checkpointer(tmp_path / "ck", every=2) as ckpt:
        with pytest.raises(ConfigError, match=r"fori_loop\(extra=...\).*saves nothing itself"):
            ckpt.fori_loop(0, 4, lambda i, v: v + 1, jnp.zeros(2), extra=CONFIG)
        out = ckpt.fori_loop(0, 4, lambda i, v: v + 1, jnp.zeros(2), every=2, extra=CONFIG)
    assert float(out[0]) == 4.0
    assert _steps_extra(tmp_path / "ck") == {2: CONFIG, 4: CONFIG}


def _rewrite(step_dir, data):
    """The extra item replaced by `data`, and our record made to match it (a forger who
    knows the format): the reader's checks after the CRC-32 are what stops it."""
    (step_dir / "extra/metadata").write_bytes(data)
    step_file = step_dir / _format.ORBAX_STEP_FILE
    content = json.loads(step_file.read_text())
    record = content["custom_metadata"]["jax_cb_ckpt"]
    record.update(extra_bytes=len(data), extra_crc32=zlib.crc32(data))
    step_file.write_text(json.dumps(content))


def test_a_hostile_extra_file_is_refused_before_it_is_parsed(tmp_path, capsys):
    d = tmp_path / "ck"
    with jax_cb_ckpt.Checkpointer(d) as ckpt:
        for step in (1, 2, 3, 4):
            ckpt.save({"w": np.zeros(2)}, step, extra=CONFIG)
    path = d / "1/extra/metadata"
    path.write_bytes(path.read_bytes().replace(b"ppo", b"PPO"))  # same size, other CRC
    with pytest.raises(DamagedStepError, match="does not match the CRC-32"):
        jax_cb_ckpt.restore_extra(d, step=1)
    with pytest.raises(DamagedStepError, match="'extra' item is damaged"):
        jax_cb_ckpt.verify(d, step=1)
    (d / "2/extra/metadata").write_bytes(b" " * (_format.EXTRA_MAX_BYTES + 10))
    with pytest.raises(DamagedStepError, match=f"larger than {_format.EXTRA_MAX_BYTES} bytes"):
        jax_cb_ckpt.metadata(d, step=2)
    _rewrite(d / "3", b"[" * 200_000)  # nested past the parser's recursion
    with pytest.raises(DamagedStepError, match="nested too deeply"):
        jax_cb_ckpt.restore_extra(d, step=3)
    _rewrite(d / "4", b"[1, 2]")
    with pytest.raises(DamagedStepError, match="holds a JSON list, not an object"):
        jax_cb_ckpt.restore_extra(d, step=4)
    os.remove(d / "4/extra/metadata")
    assert main(["show", str(d), "--step", "4"]) == 0
    assert "extra         damaged: 'extra/metadata' is missing" in capsys.readouterr().out
    assert jax_cb_ckpt.restore(d, {"w": np.zeros(2)}, step=4)["w"].tolist() == [0.0, 0.0]


def test_show_prints_the_extra(tmp_path, capsys):
    d = tmp_path / "ck"
    with jax_cb_ckpt.Checkpointer(d) as ckpt:
        ckpt.save({"w": np.zeros(2)}, 1, extra=CONFIG)
        ckpt.save({"w": np.zeros(2)}, 2, extra={"long": "y" * 1000})
    capsys.readouterr()
    assert main(["show", str(d), "--step", "1"]) == 0
    assert f"  extra         {json.dumps(CONFIG)}\n" in capsys.readouterr().out
    assert main(["show", str(d)]) == 0
    assert "(1012 characters; --json shows all)" in capsys.readouterr().out
    assert main(["show", str(d), "--step", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["extra"] == CONFIG


def test_a_bucket_step_holds_the_extra_item_with_its_commit_marker(remote):
    from jax_cb_ckpt._storage import _remote

    with jax_cb_ckpt.Checkpointer(remote.url) as ckpt:
        ckpt.save({"w": np.zeros(2)}, 5, extra=CONFIG)
        ckpt.save({"w": np.zeros(2)}, 6)
        assert ckpt.restore_extra(5) == CONFIG and ckpt.restore_extra(6) is None
    keys = _remote.list_keys(remote.url + "/5")
    assert {"extra/metadata", "extra/commit_success.txt"} <= set(keys), keys
    assert not [k for k in _remote.list_keys(remote.url + "/6") if k.startswith("extra")]
    assert jax_cb_ckpt.verify(remote.url) == [5, 6]


@pytest.mark.slow  # (gcsfs, which Orbax needs for gs://, comes with the slow extra)
@needs("gcsfs", "slow")
@pytest.mark.parametrize("remote", ["gs"], indirect=True)
def test_plain_orbax_reads_the_extra_item_of_a_gs_step(remote):
    with jax_cb_ckpt.Checkpointer(remote.url) as ckpt:
        ckpt.save({"w": np.zeros(2)}, 5, extra=CONFIG)
    code = f"""
import json, orbax.checkpoint as ocp
manager = ocp.CheckpointManager("{remote.url}")
got = manager.restore(5, args=ocp.args.Composite(extra=ocp.args.JsonRestore()))
print(json.dumps(got["extra"]))
"""
    env = dict(
        remote.env,
        TENSORSTORE_GCS_HTTP_URL=remote.env["STORAGE_EMULATOR_HOST"],
        GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT="false",  # (see test_storage.py)
    )
    result = run_child(["python", "-c", code], env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout.strip().splitlines()[-1]) == CONFIG
