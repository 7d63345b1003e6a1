"""One process of a 2-process x 4-CPU-device run (tests/test_multiprocess.py).

    python multiprocess_worker.py MODE PROCESS_ID NUM_PROCESSES PORT DIRECTORY

jax.distributed with gloo collectives on 127.0.0.1. A 32 MiB float32 state sharded
over all 8 devices (plus a sharded int leaf and a replicated scalar) is trained in a
jitted scan whose body has a cross-device reduction, and saved with
`maybe_save(..., shardings=...)`. Modes:

- `train`: save steps 2 and 4, restore on every process (ours and plain Orbax), print
  one JSON line of findings; exit 1 when anything differs from the final state.
- `kill`: as `train`, then a second run of 20 steps in which process 1 exits hard
  after its first save of that run; process 0 must fail with our error.
- `run`: `ckpt.run(...)` of many steps; the test sends SIGTERM to every process.
- `restore`: a single process (any device count) restores the latest checkpoint with
  the state sharded over its own devices and checks it against a fresh computation.
- `stopped`: process 0 stops itself (SIGSTOP) just before a commit; process 1 must
  give up in bounded time, saying the outcome is unknown (the test sends SIGCONT).
- `late`: process 1 hands a step over after process 0 gave up on it; nothing of the
  failed attempt may be left on disk.
- `unshared`: DIRECTORY is not the same directory in every process (the test mounts
  a private tmpfs there for process 1): opening must fail on every process; what a
  run would do there otherwise is reported too.
"""

import json
import os
import sys
import time

MODE, PID, NPROC, PORT, DIRECTORY = sys.argv[1:6]
PID, NPROC = int(PID), int(NPROC)
DEVICES = int(os.environ.get("WORKER_DEVICES", "4"))
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={DEVICES}"

import jax  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")
if NPROC > 1:
    jax.distributed.initialize(f"127.0.0.1:{PORT}", num_processes=NPROC, process_id=PID)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_cb_ckpt  # noqa: E402

MIB = 32
ROWS = 64 * 8  # divisible by any device count used (8, 2)
TIMEOUT = float(os.environ.get("WORKER_PEER_TIMEOUT", "20"))
SLOW_PEER_TIMEOUT = float(os.environ.get("WORKER_SLOW_PEER_TIMEOUT", "0.5"))


def host_initial():
    n = MIB * 2**20 // 4
    return {
        "w": (np.arange(n, dtype=np.float32) * 1e-6).reshape(ROWS, -1),
        "b": np.arange(ROWS * 4, dtype=np.int32).reshape(ROWS, 4),
        "n": np.zeros((), np.int32),
    }


def shardings_for(mesh):
    return {
        "w": NamedSharding(mesh, P("d")),
        "b": NamedSharding(mesh, P("d")),
        "n": NamedSharding(mesh, P()),
    }


def place(host, shardings):
    return {
        k: jax.make_array_from_callback(v.shape, shardings[k], lambda idx, v=v: v[idx])
        for k, v in host.items()
    }


def update(s, i, collective=True):
    top = jnp.max(s["w"]) if collective else 1.0  # a reduction over every device
    return {"w": s["w"] * 0.999 + top * 1e-9, "b": s["b"] + i, "n": s["n"] + 1}


def train_fn(ckpt, shardings, steps, start=0, collective=True, extra=None):
    def body(s, i):
        s = update(s, i, collective)
        if ckpt is not None:
            ckpt.maybe_save(s, i + 1, shardings=shardings, extra=extra)
        return s, None

    return jax.jit(
        lambda s: jax.lax.scan(body, s, start + jnp.arange(steps))[0], out_shardings=shardings
    )


def reference(step, shardings):
    """The state after `step` steps as the modes compute it: steps 1-4 with the
    cross-device reduction (`train`), later ones without it (`kill`'s second run)."""
    state = place(host_initial(), shardings)
    state = train_fn(None, shardings, min(step, 4))(state)
    if step > 4:
        state = train_fn(None, shardings, step - 4, start=4, collective=False)(state)
    return state


def bytes_read():
    """Bytes this process has read from files so far, counted by the kernel."""
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar")).split()[1])


def local_bytes(tree):
    """This process's blocks of every leaf, in device order, as bytes."""
    out = {}
    for k, v in tree.items():
        if jnp.issubdtype(v.dtype, jax.dtypes.prng_key):
            v = jax.random.key_data(v)
        shards = sorted(v.addressable_shards, key=lambda s: s.device.id)
        out[k] = [np.asarray(s.data).tobytes() for s in shards]
    return out


def plain_orbax_outer_loop(shardings):
    """Wall time of the same run and saves the usual way, for comparison: the loop
    broken at every save, plain Orbax (multi-process) saving between the pieces."""
    state = place(host_initial(), shardings)
    start = time.perf_counter()

    @jax.jit
    def chunk(s, first):
        return jax.lax.scan(lambda s, i: (update(s, i), None), s, first + jnp.arange(2))[0]

    with ocp.CheckpointManager(
        os.path.join(os.path.dirname(os.path.abspath(DIRECTORY)), "plain-orbax")
    ) as manager:
        for step in (2, 4):
            state = chunk(state, step - 2)
            manager.save(step, args=ocp.args.StandardSave(state))
        manager.wait_until_finished()
    return time.perf_counter() - start


def error_of(fn):
    """`fn()`'s exception as `type: message`, or None when it returned."""
    try:
        fn()
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return None


def slow_writer(mesh):
    """A 256 MiB replicated leaf, which process 0 writes alone, under a peer_timeout
    far shorter than that write: process 1 waits for the commit as long as process 0
    is at work on it, and both list the steps."""
    shardings = {"r": NamedSharding(mesh, P()), "w": NamedSharding(mesh, P("d"))}
    make = jax.jit(
        lambda: {"r": jnp.ones((64, 2**20), jnp.float32), "w": jnp.zeros((ROWS, 8))},
        out_shardings=shardings,
    )
    ckpt = jax_cb_ckpt.Checkpointer(DIRECTORY, peer_timeout=SLOW_PEER_TIMEOUT)
    save = jax.jit(
        lambda s, i: (ckpt.save({k: v + i for k, v in s.items()}, i, shardings=shardings), s)[1]
    )
    start = time.perf_counter()
    state = jax.block_until_ready(make())
    compiled = save.lower(state, 1).compile()
    # Both processes start saving together: a process still compiling (or making the
    # state) when the other's writer waits for it is a peer not yet at the step, which
    # the wait does not extend for (what this tests is a slow write).
    from jax.experimental import multihost_utils

    multihost_utils.sync_global_devices("slow_writer: compiled")
    for i in (1, 2):
        state = compiled(state, i)
    jax.block_until_ready(state)
    found = {"error": error_of(ckpt.wait), "wait_s": time.perf_counter() - start}
    found["steps"] = ckpt.all_steps()
    found["failed"] = ckpt.stats.failed
    found["write_max_s"] = ckpt.stats.write_max_s
    ckpt.close()
    return found


def diverging_save(state, shardings):
    """Process 1 makes a save process 0 never makes: process 1 fails after
    peer_timeout (process 0, alive but not at work on that save, extends nothing)."""
    ckpt = jax_cb_ckpt.Checkpointer(DIRECTORY, peer_timeout=TIMEOUT)
    only_here = PID == 1
    run = jax.jit(lambda s: (ckpt.maybe_save(s, 7, when=only_here, shardings=shardings), s)[1])
    start = time.perf_counter()
    jax.block_until_ready(run(state))
    found = {"error": error_of(ckpt.wait), "failed_after_s": time.perf_counter() - start}
    found["steps"] = ckpt.all_steps()
    from jax._src import distributed

    client = distributed.global_state.client
    if PID == 1:
        client.key_value_set("test/diverge_done", "1")
    else:  # alive (its heartbeat goes on) until process 1 has given up
        client.blocking_key_value_get("test/diverge_done", int((TIMEOUT + 60) * 1000))
    ckpt.close()
    return found


def refusals(state, shardings):
    """What a multi-process run refuses, each as `error type: message`; a write that
    fails on every process (process 0 cannot start it) with nothing listed; a packed
    dtype sharded over the processes, written block by block and restored exactly."""
    found = {}

    def attempt(name, fn):
        found[name] = error_of(fn) or "accepted"

    attempt("on_full_skip", lambda: jax_cb_ckpt.Checkpointer(DIRECTORY, on_full="skip"))
    tier = dict(persistent=DIRECTORY + "-persistent", persistent_every=2)
    attempt("persistent", lambda: jax_cb_ckpt.Checkpointer(DIRECTORY, **tier))
    with jax_cb_ckpt.Checkpointer(DIRECTORY, every=2, peer_timeout=TIMEOUT) as ckpt:
        attempt("eager_save", lambda: ckpt.save(state, 1))
        attempt("gathered", lambda: jax.jit(lambda s: ckpt.save(s, 2))(state))
        with_host_leaf = {**state, "h": np.zeros(3)}
        attempt("run_host_leaf", lambda: ckpt.run(lambda s, i: s, with_host_leaf, 2))
        # A step process 0 cannot start (a user's file where the step goes): the write
        # fails on every process and nothing is listed.
        blocker = os.path.join(DIRECTORY, "3")
        if jax.process_index() == 0:
            with open(blocker, "w") as f:
                f.write("a user's file")
        attempt(
            "blocked",
            lambda: (
                jax.jit(lambda s: ckpt.save(s, 3, shardings=shardings))(state),
                ckpt.wait(),
            ),
        )
        found["steps"] = ckpt.all_steps()
        attempt("after", ckpt.wait)
        if jax.process_index() == 0:
            os.remove(blocker)
        # The failed step saved again: a new attempt, written.
        attempt(
            "retry",
            lambda: (
                jax.jit(lambda s: ckpt.save(s, 3, shardings=shardings))(state),
                ckpt.wait(),
            ),
        )
        found["steps_after_retry"] = ckpt.all_steps()
        # A packed dtype sharded over the processes: each process writes its blocks.
        packed = {"q": jax.device_put(jnp.arange(ROWS * 8).reshape(ROWS, 8) % 7, shardings["w"])}
        packed = {"q": packed["q"].astype(jnp.int4)}
        attempt(
            "packed",
            lambda: (
                jax.jit(lambda s: ckpt.save(s, 5, shardings={"q": shardings["w"]}))(packed),
                ckpt.wait(),
            ),
        )
        back = ckpt.restore(packed, step=5)
        found["packed_exact"] = all(
            np.asarray(a.data).astype(np.int8).tobytes()
            == np.asarray(b.data).astype(np.int8).tobytes()
            for a, b in zip(
                back["q"].addressable_shards, packed["q"].addressable_shards, strict=True
            )
        )
    return found


def _small_saver(mesh, ckpt):
    """A small sharded state and a jitted `save(state, step)` of it, compiled on both
    processes, which then start together."""
    from jax.experimental import multihost_utils

    shardings = {"w": NamedSharding(mesh, P("d"))}
    state = jax.device_put({"w": jnp.arange(ROWS * 8, dtype=jnp.float32).reshape(ROWS, 8)})
    state = jax.device_put(state, shardings)
    save = jax.jit(
        lambda s, i: (ckpt.save({k: v + i for k, v in s.items()}, i, shardings=shardings), s)[1]
    )
    compiled = save.lower(state, 1).compile()
    multihost_utils.sync_global_devices("small saver: compiled")
    return state, compiled


def stopped_before_commit(mesh):
    """Process 0 stops itself (SIGSTOP) just before it commits step 2, until the test
    sends SIGCONT. Process 1 must give up on the verdict in bounded time while process
    0 is stopped, saying the outcome is unknown (it was "not committed", although
    process 0 committed it once it ran again; and its calls to the coordination
    service blocked for the whole stop). Process 1 prints a first line as soon as it
    knows; both print the steps once process 0 is done."""
    import signal

    from jax._src import distributed

    if PID == 0:
        from jax_cb_ckpt._storage import _places

        commits = []
        commit_step = _places.Local.commit

        def stopping(*args):
            commits.append(args)
            if len(commits) == 2:
                os.kill(os.getpid(), signal.SIGSTOP)
            return commit_step(*args)

        _places.Local.commit = stopping
    ckpt = jax_cb_ckpt.Checkpointer(DIRECTORY, peer_timeout=TIMEOUT)
    state, save = _small_saver(mesh, ckpt)
    start = time.perf_counter()
    for i in (1, 2):
        state = save(state, i)
    jax.block_until_ready(state)
    found = {"error": error_of(ckpt.wait), "failed_after_s": time.perf_counter() - start}
    client = distributed.global_state.client
    if PID == 1:
        print(json.dumps(found), flush=True)  # while process 0 is still stopped
        client.blocking_key_value_get("test/stopped_done", int((TIMEOUT + 120) * 1000))
    else:
        client.key_value_set("test/stopped_done", "1")
    found["steps"] = ckpt.all_steps()
    ckpt.close()
    return found


def late_for_a_step(mesh):
    """Process 1 hands step 1 over long after process 0 gave up on it (peer_timeout):
    it must not re-create the attempt's temporary directory that process 0 removed.
    Then process 1 re-creates it as a write racing process 0's removal would, and
    committing step 2 must remove it: nothing of the run's attempts is left."""
    from jax.experimental import multihost_utils

    def temps():
        return sorted(n for n in os.listdir(DIRECTORY) if ".jax_cb_ckpt-tmp-" in n)

    ckpt = jax_cb_ckpt.Checkpointer(DIRECTORY, peer_timeout=TIMEOUT)
    state, save = _small_saver(mesh, ckpt)
    if PID == 1:
        time.sleep(TIMEOUT + 6)  # process 0 waits TIMEOUT for this part, then gives up
    jax.block_until_ready(save(state, 1))
    found = {"late_error": error_of(ckpt.wait)}
    multihost_utils.sync_global_devices("late: step 1 over")
    found["temps_after_step_1"] = temps()
    multihost_utils.sync_global_devices("late: step 1 listed")
    if PID == 1:  # the race the refusal cannot close: a late write past its check
        gone = found["late_error"].split("its temporary directory '")[1].split("'")[0]
        part = os.path.join(DIRECTORY, gone, "state", "ocdbt.process_1")
        os.makedirs(part)
        with open(os.path.join(part, "manifest.ocdbt"), "wb") as f:
            f.write(b"late")
    jax.block_until_ready(save(state, 2))
    found["error"] = error_of(ckpt.wait)
    multihost_utils.sync_global_devices("late: step 2 over")
    found["temps_after_step_2"] = temps()
    found["steps"] = ckpt.all_steps()
    ckpt.close()
    return found


def unshared(state, shardings):
    """Each process opens DIRECTORY, which is a different directory in each: the
    opening fails everywhere, naming the process that does not see process 0's
    directory. (Before the opening checked it, both saved, and process 0 listed steps
    that no process could restore: process 1's blocks were in its private mount.)"""
    found = {"opening": "accepted"}
    try:
        ckpt = jax_cb_ckpt.Checkpointer(DIRECTORY, every=2, peer_timeout=TIMEOUT)
    except Exception as e:
        found["opening"] = f"{type(e).__name__}: {e}"
        ckpt = None
    if ckpt is not None:
        jax.block_until_ready(train_fn(ckpt, shardings, 4)(state))
        found["save"] = error_of(ckpt.wait)
        found["steps"] = ckpt.all_steps()
        like = place(host_initial(), shardings)
        found["restore"] = error_of(lambda: jax_cb_ckpt.restore(DIRECTORY, like, step=4))
        ckpt.close()
    found["left"] = sorted(os.listdir(DIRECTORY))
    return found


def killed_mid_run(ckpt, shardings, final, findings):
    """The run goes on from `final` (steps 2 and 4 saved); the victim process dies hard
    (exit 17) once step 6 is on disk; the survivor reports what its next save said."""
    steps = 20
    # No cross-process collective in this program: process 0 runs on alone, and
    # its next save waits for process 1 in vain (a collective would block inside
    # XLA instead, where JAX's heartbeat check ends the process; see the docs).
    run = train_fn(ckpt, shardings, steps, start=4, collective=False)
    if PID == int(os.environ.get("WORKER_VICTIM", "1")):
        # Die hard as soon as this run's first save is on disk (the scan goes on).
        def die():
            while 6 not in jax_cb_ckpt.all_steps(DIRECTORY):
                time.sleep(0.01)
            os._exit(17)

        import threading

        threading.Thread(target=die, daemon=True).start()
    start = time.perf_counter()
    try:
        jax.block_until_ready(run(final))
        ckpt.wait()
        findings["second_run"] = "finished"
    except Exception as e:  # process 0: the save of a later step names process 1
        findings["second_run"] = f"{type(e).__name__}: {e}"
    findings["failed_after_s"] = time.perf_counter() - start
    findings["steps_after"] = jax_cb_ckpt.all_steps(DIRECTORY)
    print(json.dumps(findings), flush=True)
    os._exit(0)  # the distributed client would wait for the dead process at exit


def main():
    mesh = Mesh(np.array(jax.devices()), ("d",))
    shardings = shardings_for(mesh)
    findings = {"process": jax.process_index(), "devices": len(jax.devices())}

    if MODE == "restore":
        like = place(host_initial(), shardings)
        step = jax_cb_ckpt.latest_step(DIRECTORY)
        expected = reference(step, shardings)
        restored = jax_cb_ckpt.restore(DIRECTORY, like, step=step)
        findings["step"] = step
        findings["exact"] = local_bytes(restored) == local_bytes(expected)
        findings["sharding"] = list(restored["w"].sharding.spec)
        print(json.dumps(findings), flush=True)
        return 0 if findings["exact"] else 1

    state = place(host_initial(), shardings)
    if MODE == "slow":
        findings.update(slow_writer(mesh))
        print(json.dumps(findings), flush=True)
        return 0
    if MODE == "stopped":
        findings.update(stopped_before_commit(mesh))
        print(json.dumps(findings), flush=True)
        return 0
    if MODE == "late":
        findings.update(late_for_a_step(mesh))
        print(json.dumps(findings), flush=True)
        return 0
    if MODE == "diverge":
        findings.update(diverging_save(state, shardings))
        print(json.dumps(findings), flush=True)
        return 0
    if MODE == "unshared":
        findings.update(unshared(state, shardings))
        print(json.dumps(findings), flush=True)
        return 0
    if MODE == "refusals":
        findings.update(refusals(state, shardings))
        print(json.dumps(findings), flush=True)
        return 0
    if MODE == "run":
        ckpt = jax_cb_ckpt.Checkpointer(DIRECTORY, every=50, peer_timeout=TIMEOUT)
        # With a typed PRNG key, replicated over both processes' devices.
        shardings = {**shardings, "key": NamedSharding(mesh, P())}
        new_key = jax.jit(lambda: jax.random.key(0), out_shardings=shardings["key"])

        def with_key(s):
            return {**s, "key": new_key()}

        state = with_key(state)

        def step_fn(s, i):
            key, _ = jax.random.split(s["key"])
            s = {k: v for k, v in s.items() if k != "key"}
            for _ in range(20):  # slow enough that the signals land mid-run
                s = update(s, i)
            return {**s, "key": key}

        print("READY", flush=True)
        try:
            ckpt.run(step_fn, state, num_steps=10**6, check_every=10)
        except jax_cb_ckpt.Preempted as e:
            ckpt.close()
            findings["preempted_at"] = e.step
            findings["steps"] = ckpt.all_steps()
            # The step saved at the signal is the previous checkpoint carried on with
            # the same steps (recomputed here in a plain jitted loop).
            at = e.step
            before = max(s for s in findings["steps"] if s < at)
            replay = jax.jit(
                lambda s: jax.lax.fori_loop(before, at, lambda i, s: step_fn(s, i), s),
                out_shardings=shardings,
            )
            like = with_key(place(host_initial(), shardings))
            expected = replay(jax_cb_ckpt.restore(DIRECTORY, like, step=before))
            saved = jax_cb_ckpt.restore(DIRECTORY, like, step=at)
            findings["ints_exact"] = all(
                local_bytes(saved)[k] == local_bytes(expected)[k] for k in ("b", "n", "key")
            )
            findings["key_sharding"] = str(saved["key"].sharding.spec)
            findings["w_close"] = bool(
                np.allclose(
                    np.asarray(saved["w"].addressable_shards[0].data),
                    np.asarray(expected["w"].addressable_shards[0].data),
                    rtol=1e-6,
                )
            )
            print(json.dumps(findings), flush=True)
            return 0
        return 1

    if MODE == "remote_kill":  # the kill run, in a bucket (test_storage.py)
        ckpt = jax_cb_ckpt.Checkpointer(DIRECTORY, every=2, peer_timeout=TIMEOUT)
        final = jax.block_until_ready(train_fn(ckpt, shardings, 4)(state))
        ckpt.wait()
        killed_mid_run(ckpt, shardings, final, findings)
    if MODE == "remote":  # DIRECTORY is a gs:// or s3:// URL (test_storage.py)
        from jax_cb_ckpt._storage import _remote

        with jax_cb_ckpt.Checkpointer(DIRECTORY, every=2, peer_timeout=TIMEOUT) as ckpt:
            final = jax.block_until_ready(train_fn(ckpt, shardings, 4)(state))
            ckpt.wait()
            findings["steps"] = ckpt.all_steps()
            keys = _remote.list_keys(DIRECTORY + "/4/state")
            findings["shard_dirs"] = sorted(
                {k.split("/")[0] for k in keys if k.startswith("ocdbt.")}
            )
            restored = ckpt.restore(place(host_initial(), shardings), step=4)
            findings["exact"] = local_bytes(restored) == local_bytes(final)
        print(json.dumps(findings), flush=True)
        return 0

    ckpt = jax_cb_ckpt.Checkpointer(DIRECTORY, every=2, peer_timeout=TIMEOUT)
    start = time.perf_counter()
    # (extra=: called in every process; the primary's value is the one written)
    extra = lambda step: {"process": jax.process_index(), "step": step}  # noqa: E731
    final = jax.block_until_ready(train_fn(ckpt, shardings, 4, extra=extra)(state))
    ckpt.wait()
    findings["train_and_save_s"] = time.perf_counter() - start
    findings["steps"] = ckpt.all_steps()
    findings["extra"] = ckpt.restore_extra(4)
    if PID == 0:  # one process alone reads (no barrier with the others: they go on)
        findings["metadata_step"] = ckpt.metadata()["step"]
        alone = jax_cb_ckpt.restore(DIRECTORY, place(host_initial(), shardings), step=2)
        findings["restored_alone"] = alone["n"].addressable_shards[0].data.item()
    # What the run left in the coordination service (process 0 deletes each attempt's
    # keys once every process is past it).
    from jax._src import distributed

    keys = [k for k, _ in distributed.global_state.client.key_value_dir_get("jax_cb_ckpt/")]
    findings["kv_steps"] = sorted(
        {k.split("/")[2] for k in keys if k.split("/")[1] != "open" and "/alive/" not in k}
    )
    state_dir = os.path.join(DIRECTORY, "4", "state")
    findings["shard_dirs"] = sorted(d for d in os.listdir(state_dir) if d.startswith("ocdbt"))
    like = place(host_initial(), shardings)
    before = bytes_read()
    restored = ckpt.restore(like, step=4)
    findings["restore_read_mib"] = (bytes_read() - before) / 2**20  # its own slices only
    findings["exact"] = local_bytes(restored) == local_bytes(final)
    # Plain Orbax, every process reading its own slices of the same checkpoint.
    target = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), final
    )
    plain = ocp.StandardCheckpointer().restore(state_dir, target)
    findings["plain_orbax_exact"] = local_bytes(plain) == local_bytes(final)
    findings["plain_orbax_sharding"] = list(plain["w"].sharding.spec)
    findings["plain_orbax_outer_loop_s"] = plain_orbax_outer_loop(shardings)

    if MODE == "kill":
        killed_mid_run(ckpt, shardings, final, findings)

    ckpt.close()
    print(json.dumps(findings), flush=True)
    ok = findings["exact"] and findings["plain_orbax_exact"] and findings["steps"] == [2, 4]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
