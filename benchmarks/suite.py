"""Workloads, the five checkpointing methods, and the floors they are compared with.

Every method runs the same training step on the same initial state for the same number
of steps and saves at the same steps (the state's own counter, `state["step"]`, reaching
a multiple of `every`); each returns its wall time including the final flush to disk.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import io_callback

import jax_cb_ckpt

# -- workloads -------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Workload:
    name: str
    init: Callable[[], Any]  # a fresh state; state["step"] is an int32 counter
    step: Callable[[Any], Any]  # one training step; increments state["step"]
    state_bytes: int


def _mlp_workload(name: str, sizes: tuple[int, ...], batch: int, momentum: bool) -> Workload:
    def init():
        key = jax.random.key(0)
        params = {}
        for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:], strict=True)):
            key, sub = jax.random.split(key)
            params[f"w{i}"] = jax.random.normal(sub, (a, b)) / np.sqrt(a)
            params[f"b{i}"] = jnp.zeros(b)
        state = {"params": params, "key": key, "step": jnp.int32(0)}
        if momentum:
            state["velocity"] = jax.tree_util.tree_map(jnp.zeros_like, params)
        return state

    def loss(params, x, y):
        h = x
        n = len(sizes) - 1
        for i in range(n):
            h = h @ params[f"w{i}"] + params[f"b{i}"]
            if i < n - 1:
                h = jnp.tanh(h)
        return jnp.mean((h - y) ** 2)

    def step(state):
        key, sub = jax.random.split(state["key"])
        x = jax.random.normal(sub, (batch, sizes[0]))
        y = jnp.sin(x.sum(axis=1, keepdims=True))
        grads = jax.grad(loss)(state["params"], x, y)
        new = dict(state, key=key, step=state["step"] + 1)
        if momentum:
            velocity = jax.tree_util.tree_map(lambda v, g: 0.9 * v + g, state["velocity"], grads)
            new["velocity"] = velocity
            grads = velocity
        new["params"] = jax.tree_util.tree_map(lambda p, g: p - 1e-3 * g, state["params"], grads)
        return new

    nbytes = sum(np.asarray(x).nbytes for x in jax.tree_util.tree_leaves(_raw(init())))
    return Workload(name, init, step, nbytes)


def tiny() -> Workload:
    """A dispatch-bound step: an 8-64-1 MLP, SGD, batch 32 (about 2.6 KB of state)."""
    return _mlp_workload("tiny", (8, 64, 1), 32, momentum=False)


def medium() -> Workload:
    """A compute-bound step: a 128-512-512-1 MLP with momentum, batch 256 (about 2.6 MB)."""
    return _mlp_workload("medium", (128, 512, 512, 1), 256, momentum=True)


def sized(nbytes: int) -> Workload:
    """A fixed cheap elementwise step on a state of about `nbytes` bytes."""
    n = max(nbytes // 4, 1)

    def init():
        # Random values: a constant state compresses to nothing, which would measure
        # Orbax's compression instead of the hand-off and the write.
        x = jax.random.normal(jax.random.key(0), (n,), jnp.float32)
        return {"x": x, "step": jnp.int32(0)}

    def step(state):
        return {"x": state["x"] * 0.999 + 1e-3, "step": state["step"] + 1}

    return Workload(f"state_{_human(nbytes)}", init, step, n * 4 + 4)


def _raw(state):
    return jax.tree_util.tree_map(
        lambda x: (
            jax.random.key_data(x)
            if jnp.issubdtype(getattr(x, "dtype", np.float32), jax.dtypes.prng_key)
            else x
        ),
        state,
    )


def _human(nbytes: int) -> str:
    for unit, size in (("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10)):
        if nbytes >= size:
            return f"{nbytes // size}{unit}"
    return f"{nbytes}B"


# -- peak memory -----------------------------------------------------------------------


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRSS:
    """Samples the resident set size in a thread; `peak - base` is what a run added."""

    def __init__(self, period_s: float = 0.002) -> None:
        self._period = period_s
        self._stop = threading.Event()
        self.base = self.peak = rss_bytes()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_bytes())
            time.sleep(self._period)

    def __enter__(self) -> PeakRSS:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_bytes())

    @property
    def added(self) -> int:
        return self.peak - self.base


# -- methods ---------------------------------------------------------------------------


def _orbax_manager(directory: str, *, async_: bool) -> ocp.CheckpointManager:
    return ocp.CheckpointManager(
        directory,
        options=ocp.CheckpointManagerOptions(
            max_to_keep=2, enable_async_checkpointing=async_, create=True
        ),
    )


def _start(wl: Workload, offset: int):
    """The initial state, with its counter at `offset` so every run saves new steps."""
    state = wl.init()
    return dict(state, step=jnp.int32(offset))


OFFSET = 10**6  # timed run r starts its step counter at (r + 1) * OFFSET


class Method:
    """One way to train `n` steps saving every `every`.

    `run(offset)` -> (train_s, total_s): the time until the training loop has finished on
    the device (every save handed over), and the time until its checkpoints are also on
    disk (the final flush included).
    """

    name = ""
    saves_in_jit = False

    def __init__(
        self, wl: Workload, n: int, every: int, directory: str, *, queue_size: int = 2
    ) -> None:
        self.wl, self.n, self.every, self.directory = wl, n, every, directory
        self.queue_size = queue_size  # used by maybe_save: saves in flight at most

    def prepare(self) -> None:
        """Compile and warm up (outside the timed region); timed runs use offsets from
        `OFFSET` on, so their steps are new and sort after the warm-up's."""
        self.run(offset=0)

    def run(self, offset: int) -> tuple[float, float]:
        raise NotImplementedError

    def close(self) -> None:
        pass


class Bare(Method):
    """1. The whole loop in one jitted lax.scan, no checkpoint: the compute floor."""

    name = "bare"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        step, n = self.wl.step, self.n
        self.fn = jax.jit(lambda s: jax.lax.scan(lambda s, _: (step(s), None), s, None, n)[0])

    def run(self, offset: int) -> tuple[float, float]:
        state = _start(self.wl, offset)
        start = time.perf_counter()
        jax.block_until_ready(self.fn(state))
        elapsed = time.perf_counter() - start
        return elapsed, elapsed


class InJit(Method):
    """The loop in one jitted lax.scan with a save hook in the body."""

    saves_in_jit = True

    def save_hook(self, state: Any) -> None:
        raise NotImplementedError

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        step, n = self.wl.step, self.n

        def body(s, _):
            s = step(s)
            self.save_hook(s)
            return s, None

        self.fn = jax.jit(lambda s: jax.lax.scan(body, s, None, n)[0])

    def flush(self) -> None:
        jax.effects_barrier()

    def run(self, offset: int) -> tuple[float, float]:
        state = _start(self.wl, offset)
        jax.effects_barrier()
        start = time.perf_counter()
        jax.block_until_ready(self.fn(state))
        jax.effects_barrier()  # every callback (hand-off) has returned
        trained = time.perf_counter() - start
        self.flush()
        return trained, time.perf_counter() - start


class MaybeSave(InJit):
    """2. jax_cb_ckpt: ckpt.maybe_save(state, step) in the scan body."""

    name = "maybe_save"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.ckpt = jax_cb_ckpt.Checkpointer(
            os.path.join(self.directory, self.name),
            every=self.every,
            max_to_keep=2,
            queue_size=self.queue_size,
            compression=True,  # as Orbax's default, which the outer loops use: same bytes
        )

    def save_hook(self, state: Any) -> None:
        self.ckpt.maybe_save(state, state["step"])

    def flush(self) -> None:
        self.ckpt.wait()  # includes jax.effects_barrier()

    def close(self) -> None:
        self.ckpt.close()


class Never(MaybeSave):
    """maybe_save whose predicate never holds (the cost of having it in the loop)."""

    name = "maybe_save_never"

    def save_hook(self, state: Any) -> None:
        self.ckpt.maybe_save(state, state["step"], when=state["step"] < -(10**9))


class CkptScan(MaybeSave):
    """jax_cb_ckpt's `ckpt.scan`: the loop as chunks of `every` steps with a save between
    two chunks, no conditional in the step loop."""

    name = "ckpt_scan"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        step, n = self.wl.step, self.n

        def train(s):
            return self.ckpt.scan(lambda s, _: (step(s), None), s, None, n, start=s["step"])[0]

        self.fn = jax.jit(train)


class NoopDebug(InJit):
    """Floor: the same cond with a no-op jax.debug.callback taking the state."""

    name = "noop_debug_callback"

    def save_hook(self, state: Any) -> None:
        jax.lax.cond(
            state["step"] % self.every == 0,
            lambda s: jax.debug.callback(lambda *_: None, s),
            lambda s: None,
            state,
        )


class NoopIO(InJit):
    """Floor: the same cond with a no-op io_callback(ordered=True) taking the state."""

    name = "noop_io_callback"

    def save_hook(self, state: Any) -> None:
        jax.lax.cond(
            state["step"] % self.every == 0,
            lambda s: io_callback(lambda *_: None, None, s, ordered=True),
            lambda s: None,
            state,
        )


class OuterLoop(Method):
    """3. A Python loop over a jitted step; Orbax async saves every `every` steps."""

    name = "outer_loop_orbax"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fn = jax.jit(self.wl.step)
        self.mgr = _orbax_manager(os.path.join(self.directory, self.name), async_=True)

    def run(self, offset: int) -> tuple[float, float]:
        state = _start(self.wl, offset)
        start = time.perf_counter()
        for i in range(1, self.n + 1):
            state = self.fn(state)
            if (offset + i) % self.every == 0:
                self.mgr.save(offset + i, args=ocp.args.StandardSave(state))
        jax.block_until_ready(state)
        trained = time.perf_counter() - start
        self.mgr.wait_until_finished()
        return trained, time.perf_counter() - start

    def close(self) -> None:
        self.mgr.close()


class Chunked(OuterLoop):
    """4. A Python loop over jitted chunks of `every` steps (lax.scan inside); Orbax
    async saves between chunks (the Brax / Stoix / Mava pattern)."""

    name = "chunked_orbax"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        step, every = self.wl.step, self.every
        self.fn = jax.jit(lambda s: jax.lax.scan(lambda s, _: (step(s), None), s, None, every)[0])

    def run(self, offset: int) -> tuple[float, float]:
        state = _start(self.wl, offset)
        start = time.perf_counter()
        for c in range(1, self.n // self.every + 1):
            state = self.fn(state)
            self.mgr.save(offset + c * self.every, args=ocp.args.StandardSave(state))
        jax.block_until_ready(state)
        trained = time.perf_counter() - start
        self.mgr.wait_until_finished()
        return trained, time.perf_counter() - start


class Naive(InJit):
    """5. The snippet people paste: a jax.debug.callback on every step that calls Orbax
    synchronously when the step is a multiple of `every`."""

    name = "naive_debug_callback"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.mgr = _orbax_manager(os.path.join(self.directory, "naive"), async_=False)

    def _callback(self, state: Any) -> None:
        step = int(state["step"])
        if step % self.every == 0 and step >= 0:
            host = jax.tree_util.tree_map(np.asarray, _raw(state))  # never Orbax on jax arrays here
            self.mgr.save(step, args=ocp.args.StandardSave(host))

    def save_hook(self, state: Any) -> None:
        jax.debug.callback(self._callback, state)

    def close(self) -> None:
        self.mgr.close()


METHODS: dict[str, type[Method]] = {
    m.name: m
    for m in (Bare, MaybeSave, CkptScan, OuterLoop, Chunked, Naive, Never, NoopDebug, NoopIO)
}


def copy_floor(nbytes: int, reps: int = 5) -> float:
    """Median time of one np.copyto of `nbytes` into an already-touched buffer."""
    src = np.ones(max(nbytes // 4, 1), np.float32)
    dst = np.zeros_like(src)
    dst += 1  # touch every page
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def device_to_host_floor(wl: Workload, reps: int = 5) -> float | None:
    """On an accelerator: median time of one device-to-host copy of the state."""
    if jax.default_backend() == "cpu":
        return None
    times = []
    for _ in range(reps):
        state = jax.block_until_ready(wl.init())
        start = time.perf_counter()
        jax.device_get(_raw(state))
        times.append(time.perf_counter() - start)
    return float(np.median(times))
