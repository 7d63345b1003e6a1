"""Run by .ci/run from outside the source tree, with the built wheel installed in a
fresh venv: the package works from what the wheel holds alone (a file only the source
tree has fails here), its types ship (py.typed), and the command line is installed."""

import os
import subprocess
import sys
import tempfile

import numpy as np

import jax_cb_ckpt

SOURCE = sys.argv[1]
here = os.path.dirname(os.path.abspath(jax_cb_ckpt.__file__))
assert not here.startswith(os.path.abspath(SOURCE)), f"imported from the source tree: {here}"
assert os.path.exists(os.path.join(here, "py.typed")), "py.typed is not in the wheel"
directory = os.path.join(tempfile.mkdtemp(), "ckpt")
state = {"w": np.arange(10, dtype=np.float32), "n": np.int32(3)}
with jax_cb_ckpt.Checkpointer(directory, every=1, max_to_keep=2) as ckpt:
    for step in (1, 2, 3):
        ckpt.save(state, step)
assert jax_cb_ckpt.all_steps(directory) == [2, 3]
assert jax_cb_ckpt.same_bits(jax_cb_ckpt.restore(directory, state), state)
assert jax_cb_ckpt.verify(directory) == [2, 3]
cli = os.path.join(os.path.dirname(sys.executable), "jax-cb-ckpt")
for command in ("ls", "show", "verify"):
    done = subprocess.run([cli, command, directory], capture_output=True, text=True)
    assert done.returncode == 0, (command, done.stdout, done.stderr)
print(f"installed package ok: jax_cb_ckpt {jax_cb_ckpt.__version__} from {here}")
