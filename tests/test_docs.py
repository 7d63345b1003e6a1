"""The documentation's scripts run: every ```python block of docs/frameworks.md (and
transforms.md's pmap restart recipe) is a complete program, executed in a fresh process
in a temporary working directory, twice in a row there (a reader runs a script again: a
second run must not trip over the first run's checkpoints). The plain-Orbax recipes of
docs/usage.md read a checkpoint saved on 4 devices with 1 and 2 devices."""

import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import run_script, run_twice
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC = os.path.join(ROOT, "docs", "frameworks.md")
USAGE = os.path.join(ROOT, "docs", "usage.md")


def sections(path):
    """[(heading of the `## ` section, code of each ```python block in it)]."""
    with open(path) as f:
        text = f.read()
    found = re.findall(r"^## (.+?)$|^```python\n(.*?)^```$", text, re.M | re.S)
    out, title = [], None
    for heading, code in found:
        if heading:
            title = heading
        else:
            out.append((title, code))
    return out


def blocks(path):
    return [
        pytest.param(code, id=re.sub(r"\W+", "_", title or "top").strip("_"))
        for title, code in sections(path)
    ]


@pytest.mark.slow
@pytest.mark.parametrize("code", blocks(DOC))
def test_frameworks_doc_block_runs_twice(tmp_path, code):
    result = run_twice(tmp_path, code)
    assert " ok" in result.stdout, result.stdout


TRANSFORMS = os.path.join(ROOT, "docs", "transforms.md")


@pytest.mark.slow
def test_transforms_pmap_restart_recipe_runs_twice(tmp_path):
    """transforms.md's pmap restart recipe (issue 53): a pmapped epoch saving with
    axis_name=, stopped and restarted with a concrete like, ends bit for bit as the
    uninterrupted run (before issue 53: the resumed state was refused by the pmap)."""
    [code] = [code for title, code in sections(TRANSFORMS) if title == "Restarting a pmap run"]
    result = run_twice(tmp_path, code)
    assert "pmap restart ok" in result.stdout, result.stdout + result.stderr


# The usage.md recipes, between the lines a reader would have: where the checkpoint is,
# on how many devices to read it, and what each recipe must have given.
RECIPE_PREAMBLE = """
import os, sys
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={sys.argv[2]}"
import numpy as np
directory, step = sys.argv[1], 300
"""
RECIPE_CHECKS = [
    """
assert isinstance(arrays["params"]["w"], np.ndarray) and meta["leaves"], meta
np.testing.assert_array_equal(arrays["params"]["w"], np.load(sys.argv[3]))
""",
    """
w = state["params"]["w"]
assert w.sharding == rows and len(w.addressable_shards) == jax.device_count() == int(sys.argv[2])
np.testing.assert_array_equal(np.asarray(w), np.load(sys.argv[3]))
assert int(state["step"]) == 300
""",
    """
assert state["params"]["w"].sharding == whole
np.testing.assert_array_equal(np.asarray(state["params"]["w"]), np.load(sys.argv[3]))
print("recipes ok")
""",
]


@pytest.fixture(scope="module")
def saved_on_four_devices(tmp_path_factory):
    """A checkpoint of the recipes' state, saved per device from a 4-device mesh."""
    import jax_cb_ckpt

    root = tmp_path_factory.mktemp("plain_orbax")
    mesh = jax.make_mesh((4,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
    shardings = {
        "params": {"w": NamedSharding(mesh, P("d"))},
        "step": NamedSharding(mesh, P()),
    }
    w = np.arange(512 * 128, dtype=np.float32).reshape(512, 128) / 7
    np.save(root / "w.npy", w)
    state = jax.device_put({"params": {"w": w}, "step": jnp.int32(300)}, shardings)
    with jax_cb_ckpt.Checkpointer(root / "ckpt") as ckpt:
        jax.jit(lambda s: ckpt.save(s, 300, shardings=shardings))(state)
    return root


@pytest.mark.parametrize("devices", [1, 2])
def test_plain_orbax_recipes_read_on_another_device_count(tmp_path, saved_on_four_devices, devices):
    recipes = [
        code for title, code in sections(USAGE) if title == "Reading checkpoints with plain Orbax"
    ]
    assert len(recipes) == len(RECIPE_CHECKS), "usage.md's plain-Orbax recipes changed"
    script = RECIPE_PREAMBLE + "".join(
        code + check for code, check in zip(recipes, RECIPE_CHECKS, strict=True)
    )
    root = saved_on_four_devices
    result = run_script(tmp_path, script, root / "ckpt", devices, root / "w.npy", timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "recipes ok" in result.stdout, result.stdout
