"""`_save/_crossing.py`: a crossing is one class, its traced `emit` and its host `receive`,
chosen in one place (`_route.chosen_crossing`). The "how to add a crossing" of
_save/README.md, tried: a throwaway crossing (the CPU buffer crossing, counting what it
receives) saves from a jitted scan through a real Checkpointer, gathered and device by
device, and its saves restore bit for bit."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_cb_ckpt._save import _route
from jax_cb_ckpt._save._buffer import CpuBuffer
from jax_cb_ckpt._save._callback import DebugCallback

STEPS = 6


class Counting(CpuBuffer):
    """The CPU buffer crossing, keeping the step of every save and device part it
    receives (the only change: its two host halves)."""

    def __init__(self):
        self.received = []
        self.blocks = []

    def receive(self, pools, signature, *args):
        arrival = super().receive(pools, signature, *args)
        self.received.append(int(np.asarray(arrival.step)))
        return arrival

    def receive_blocks(self, pools, *args):
        blocks = super().receive_blocks(pools, *args)
        self.blocks.append(int(np.asarray(blocks.step)))
        return blocks


def _states():
    x, out = np.arange(16, dtype=np.float32), {}
    for i in range(STEPS):
        x = (x * np.float32(0.5) + np.float32(i)).astype(np.float32)
        out[i + 1] = x
    return out


@pytest.mark.parametrize("per_device", [False, True], ids=["gathered", "shardings"])
def test_a_crossing_added_in_one_class_saves_a_jitted_scan_exactly(
    make_ckpt, monkeypatch, per_device
):
    counting = Counting()
    chosen = []

    def choose(name):
        chosen.append(name)
        return counting

    monkeypatch.setattr(_route, "chosen_crossing", choose)
    ckpt = make_ckpt(every=2)
    mesh = jax.make_mesh((4,), ("d",), devices=jax.devices()[:4])
    shardings = NamedSharding(mesh, P("d")) if per_device else None

    def body(x, i):
        x = x * 0.5 + i.astype(jnp.float32)
        ckpt.maybe_save(x, i + 1, shardings=shardings)
        return x, None

    x0 = jnp.arange(16, dtype=jnp.float32)
    if per_device:
        x0 = jax.device_put(x0, shardings)
    jax.jit(lambda x: jax.lax.scan(body, x, jnp.arange(STEPS))[0])(x0)
    ckpt.wait()

    assert chosen == ["auto"]  # chosen once, where the save was planned (one trace)
    if per_device:
        assert (counting.received, sorted(counting.blocks)) == ([], [2] * 4 + [4] * 4 + [6] * 4)
    else:
        assert (sorted(counting.received), counting.blocks) == ([2, 4, 6], [])
    assert ckpt.all_steps() == [2, 4, 6]
    for step in (2, 4, 6):
        restored = ckpt.restore(jnp.zeros(16), step=step)
        assert np.asarray(restored).tobytes() == _states()[step].tobytes(), step


def test_the_crossing_is_chosen_from_the_option_and_the_backend():
    if jax.default_backend() != "cpu":
        pytest.skip(f"the choice on a CPU; this run's backend is {jax.default_backend()}")
    assert type(_route.chosen_crossing("auto")) is CpuBuffer
    assert type(_route.chosen_crossing("buffer")) is CpuBuffer
    callback = _route.chosen_crossing("callback")
    assert isinstance(callback, DebugCallback)
    # per device on a CPU the buffer crossing (jax 0.10.2 hangs with debug.callback)
    assert type(callback.per_device()) is CpuBuffer
