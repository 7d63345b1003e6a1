"""Several Checkpointers in one process, and the user's own Orbax beside them.

Users keep a best-model or eval checkpoint next to the training one; both write while
the same jitted program runs. Run in a child with a hard timeout: the failure this
guards against was a 300 s stall inside Orbax's signalling."""

import subprocess

import pytest
from helpers import run_script

SCRIPT = """
import sys, threading
import jax, jax.numpy as jnp, numpy as np
import orbax.checkpoint as ocp
import jax_cb_ckpt

root = sys.argv[1]
a = jax_cb_ckpt.Checkpointer(root + "/a", every=1, queue_size=1)
b = jax_cb_ckpt.Checkpointer(root + "/b", every=2, queue_size=1)

@jax.jit
def train(x):
    def body(x, i):
        x = x * 0.5 + i.astype(jnp.float32)
        a.maybe_save({"x": x}, i + 1)
        b.maybe_save({"x": x, "twice": x * 2}, i + 1)
        return x, None
    return jax.lax.scan(body, x, jnp.arange(40))[0]

own = ocp.StandardCheckpointer()  # the user's own Orbax, saving in the main thread
result = train(jnp.zeros(4096, jnp.float32))
for k in range(5):
    own.save(f"{root}/own/{k}", {"w": np.full(1024, k, np.float32)})
own.wait_until_finished()
with a, b:
    pass
x = np.zeros(4096, np.float32)
want = {}
for i in range(40):
    x = x * np.float32(0.5) + np.float32(i)
    want[i + 1] = x.copy()
like = {"x": jax.ShapeDtypeStruct((4096,), jnp.float32)}
assert a.all_steps() == list(range(1, 41)), a.all_steps()
assert b.all_steps() == list(range(2, 41, 2)), b.all_steps()
for s in a.all_steps():
    got = jax_cb_ckpt.restore(root + "/a", like, step=s)
    assert np.asarray(got["x"]).tobytes() == want[s].tobytes()
like_b = dict(like, twice=like["x"])
for s in b.all_steps():
    got = jax_cb_ckpt.restore(root + "/b", like_b, step=s)
    assert np.asarray(got["twice"]).tobytes() == (want[s] * 2).tobytes()
for k in range(5):
    got = own.restore(f"{root}/own/{k}")
    assert np.asarray(got["w"]).tobytes() == np.full(1024, k, np.float32).tobytes()
print("ok")
"""


def test_two_checkpointers_and_the_users_orbax_side_by_side(tmp_path):
    try:
        result = run_script(tmp_path, SCRIPT, tmp_path, timeout=150)
    except subprocess.TimeoutExpired:
        pytest.fail("two Checkpointers and the user's Orbax stalled (150 s)")
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-4000:]
