"""One scan body with maybe_save, run under every transformation: the exact set of saved
steps, the saved contents, and one host crossing per saving step (none otherwise)."""

import shutil

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from helpers import (
    HERE,
    assert_same_state,
    kill_group,
    start_script,
    toy_reference,
    toy_state,
    toy_update,
    wait_for_step,
)
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_cb_ckpt

N_STEPS, EVERY = 12, 4
SAVED = [0, 4, 8]
N_DEV = 4


def member_state(m):
    """Member m of a batch: a different starting point per member."""
    state = toy_state()
    return {**state, "x": state["x"] + m, "key": jax.random.key(m)}


def member_reference(m):
    return toy_reference(N_STEPS, state=member_state(m))


def stack(states):
    return jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *states)


def make_train(ckpt, *, remat=False, unroll=1, **save_kwargs):
    def body(state, step):
        state = toy_update(state, step)
        if ckpt is not None:
            ckpt.maybe_save(state, step, **save_kwargs)
        return state, None

    if remat:
        body = jax.checkpoint(body)

    def train(state):
        return jax.lax.scan(body, state, jnp.arange(N_STEPS), unroll=unroll)[0]

    return train


def float_loss(train):
    """A scalar loss of the float leaf, for differentiation."""

    def loss(x):
        state = {**toy_state(), "x": x}
        return jnp.sum(train(state)["x"] ** 2)

    return loss


def elementwise_state():
    return {"x": jnp.arange(8, dtype=jnp.float32), "count": jnp.zeros(4, jnp.int32)}


def elementwise_update(state, step):
    return {"x": state["x"] * 0.5 + step.astype(jnp.float32), "count": state["count"] + step}


def check_elementwise(ckpt, final):
    state, refs = elementwise_state(), {}
    for step in range(N_STEPS):
        state = elementwise_update(state, jnp.asarray(step, jnp.int32))
        refs[step] = state
    assert_same_state(jax.device_get(final), jax.device_get(refs[N_STEPS - 1]))
    for step in SAVED:
        restored = ckpt.restore(elementwise_state(), step=step)
        assert_same_state(restored, refs[step])
        assert "members" not in ckpt.metadata(step)


def check_single(ckpt, final):
    reference = toy_reference(N_STEPS)
    if final is not None:
        assert_same_state(final, reference[N_STEPS - 1])
    for step in SAVED:
        assert_same_state(ckpt.restore(toy_state(), step=step), reference[step])


def check_batch(ckpt, members, final):
    refs = [member_reference(m) for m in range(members)]
    if final is not None:
        assert_same_state(final, stack([r[N_STEPS - 1] for r in refs]))
    like = stack([member_state(m) for m in range(members)])
    for step in SAVED:
        assert_same_state(ckpt.restore(like, step=step), stack([r[step] for r in refs]))
        meta = ckpt.metadata(step)
        assert meta["batch_shape"] == [members] and meta["members"] == [True] * members


def run_case(case, ckpt):
    """Run the scan under one transformation; return what to check."""
    if case == "plain":
        return "single", make_train(ckpt)(toy_state())
    if case == "jit":
        return "single", jax.jit(make_train(ckpt))(toy_state())
    if case == "unroll":
        return "single", jax.jit(make_train(ckpt, unroll=5))(toy_state())
    if case == "donation":
        state = toy_state()
        out = jax.jit(make_train(ckpt), donate_argnums=0)(state)
        return "single", out
    if case in ("grad", "remat"):
        loss = float_loss(make_train(ckpt, remat=case == "remat"))
        g = jax.jit(jax.grad(loss))(toy_state()["x"])
        clean = jax.grad(float_loss(make_train(None)))(toy_state()["x"])
        assert np.asarray(g).tobytes() == np.asarray(clean).tobytes()  # gradient unchanged
        return "single", None
    if case in ("value_and_grad", "linearize"):
        x = toy_state()["x"]
        loss, clean = float_loss(make_train(ckpt)), float_loss(make_train(None))
        if case == "value_and_grad":
            got, want = jax.jit(jax.value_and_grad(loss))(x), jax.value_and_grad(clean)(x)
        else:
            (y, f), (y0, f0) = jax.linearize(loss, x), jax.linearize(clean, x)
            got, want = (y, f(jnp.ones_like(x))), (y0, f0(jnp.ones_like(x)))
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            assert np.asarray(a).tobytes() == np.asarray(b).tobytes()  # unchanged
        return "single", None
    if case in ("jvp", "vjp"):
        x = toy_state()["x"]
        loss = float_loss(make_train(ckpt))
        clean = float_loss(make_train(None))
        if case == "jvp":
            got, want = (
                jax.jvp(loss, (x,), (jnp.ones_like(x),)),
                jax.jvp(clean, (x,), (jnp.ones_like(x),)),
            )
        else:
            got, want = jax.vjp(loss, x)[1](1.0), jax.vjp(clean, x)[1](1.0)
        for a, b in zip(
            jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True
        ):
            assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
        return "single", None
    if case in ("vmap", "jit_vmap"):
        fn = jax.vmap(make_train(ckpt))
        fn = jax.jit(fn) if case == "jit_vmap" else fn
        return ("batch", 3), fn(stack([member_state(m) for m in range(3)]))
    if case == "vmap_vmap":
        states = stack([stack([member_state(2 * s + h) for h in range(2)]) for s in range(3)])
        return ("grid", (3, 2)), jax.jit(jax.vmap(jax.vmap(make_train(ckpt))))(states)
    if case == "pmap":
        train = make_train(ckpt, axis_name="dev")
        out = jax.pmap(train, axis_name="dev")(stack([member_state(m) for m in range(N_DEV)]))
        return ("batch", N_DEV), out
    if case == "pmap_replicated":
        train = make_train(ckpt, axis_name="dev", gather="replicated")
        out = jax.pmap(train, axis_name="dev")(stack([toy_state()] * N_DEV))
        return "single", jax.tree_util.tree_map(lambda x: x[0], out)
    if case == "shard_map":
        # Each device holds a block of the leading axis; the tiled gather stores the
        # global arrays. (Elementwise body: no per-member PRNG keys to split.)
        mesh = Mesh(np.array(jax.devices()[:N_DEV]), ("d",))
        state = jax.device_put(elementwise_state(), NamedSharding(mesh, P("d")))

        def train(state):
            def body(state, step):
                state = elementwise_update(state, step)
                ckpt.maybe_save(state, step, axis_name="d", gather="concat")
                return state, None

            return jax.lax.scan(body, state, jnp.arange(N_STEPS))[0]

        out = jax.jit(jax.shard_map(train, mesh=mesh, in_specs=P("d"), out_specs=P("d")))(state)
        return "elementwise", out
    raise AssertionError(case)


CASES = [
    "plain",
    "jit",
    "unroll",
    "donation",
    "grad",
    "value_and_grad",
    "linearize",
    "jvp",
    "vjp",
    "remat",
    "vmap",
    "jit_vmap",
    "vmap_vmap",
    "pmap",
    "pmap_replicated",
    "shard_map",
]


@pytest.mark.parametrize("crossing", ["buffer", "callback"])
@pytest.mark.parametrize("case", CASES)
def test_transformation(make_ckpt, case, crossing):
    """Both crossings: the copy-once buffer_callback (the default on CPU) and the
    debug.callback fallback (the default elsewhere)."""
    ckpt = make_ckpt(every=EVERY, crossing=crossing)
    kind, final = run_case(case, ckpt)
    ckpt.wait()
    stats = ckpt.stats
    assert ckpt.all_steps() == SAVED
    assert stats.saves == len(SAVED) and stats.failed == 0 and stats.skipped == 0
    # One crossing per saving step for the whole batch / all devices. Remat may
    # recompute a saving step in the backward pass (debug.callback does): recognised
    # and dropped.
    assert stats.crossings == len(SAVED) + stats.duplicates
    if case != "remat" or crossing == "buffer":
        assert stats.duplicates == 0
    if kind == "single":
        check_single(ckpt, final)
    elif kind == "elementwise":
        check_elementwise(ckpt, final)
    elif kind[0] == "batch":
        check_batch(ckpt, kind[1], final)
    elif kind[0] == "grid":
        s, h = kind[1]
        refs = [[member_reference(2 * i + j) for j in range(h)] for i in range(s)]
        like = stack([stack([member_state(2 * i + j) for j in range(h)]) for i in range(s)])
        for step in SAVED:
            want = stack([stack([refs[i][j][step] for j in range(h)]) for i in range(s)])
            assert_same_state(ckpt.restore(like, step=step), want)
            assert ckpt.metadata(step)["batch_shape"] == [s, h]
        assert_same_state(
            final, stack([stack([refs[i][j][N_STEPS - 1] for j in range(h)]) for i in range(s)])
        )
    else:
        raise AssertionError(kind)


def test_members_that_differ_are_recorded(make_ckpt):
    """A per-member predicate: one crossing when any member asks, all members' data
    (each member's true state at that step), and the mask of who asked."""
    ckpt = make_ckpt()

    def train(state, every):
        def body(state, step):
            state = toy_update(state, step)
            ckpt.maybe_save(state, step, when=(step % every == 0))
            return state, None

        return jax.lax.scan(body, state, jnp.arange(N_STEPS))[0]

    everies = jnp.array([4, 6])  # member 0 saves at 0,4,8; member 1 at 0,6
    states = stack([member_state(0), member_state(1)])
    jax.jit(jax.vmap(train))(states, everies)
    ckpt.wait()
    assert ckpt.all_steps() == [0, 4, 6, 8]
    assert ckpt.stats.crossings == 4
    masks = {s: ckpt.metadata(s)["members"] for s in ckpt.all_steps()}
    assert masks == {0: [True, True], 4: [True, False], 6: [False, True], 8: [True, False]}
    refs = [member_reference(0), member_reference(1)]
    for step in ckpt.all_steps():
        assert_same_state(ckpt.restore(states, step=step), stack([refs[0][step], refs[1][step]]))


def test_batched_steps_must_agree(make_ckpt):
    ckpt = make_ckpt()

    def save(state, step):
        ckpt.save(state, step)
        return state

    with pytest.raises(Exception, match="members that save at once have different steps"):
        out = jax.jit(jax.vmap(save))(stack([toy_state(), toy_state()]), jnp.array([3, 4]))
        jax.block_until_ready(out)
        jax.effects_barrier()
    # JAX re-wraps the callback's exception; the library's own type reaches the user too.
    with pytest.raises(jax_cb_ckpt.InvalidStateError, match="different steps"):
        ckpt.close()


def test_batched_step_equal_across_members(make_ckpt):
    """TrainState.step style: each member carries the same step."""
    ckpt = make_ckpt(every=2)

    def body(state, _):
        state = {**toy_update(state, state["count"]), "count": state["count"] + 1}
        ckpt.maybe_save(state, state["count"])
        return state, None

    states = stack([member_state(0), member_state(1)])
    jax.jit(jax.vmap(lambda s: jax.lax.scan(body, s, None, length=5)[0]))(states)
    ckpt.wait()
    assert ckpt.all_steps() == [2, 4]
    assert ckpt.stats.crossings == 2


def test_gather_needs_axis_name_and_a_known_value(make_ckpt):
    ckpt = make_ckpt(every=1)
    with pytest.raises(jax_cb_ckpt.ConfigError, match="needs axis_name="):
        ckpt.maybe_save({"x": jnp.zeros(2)}, 0, gather="replicated")
    with pytest.raises(jax_cb_ckpt.ConfigError, match=r"gather must be one of \('stack', "):
        ckpt.maybe_save({"x": jnp.zeros(2)}, 0, axis_name="d", gather="tiled")


def test_pmap_without_axis_name_is_refused(make_ckpt):
    ckpt = make_ckpt(every=1)
    with pytest.raises(
        jax_cb_ckpt.InvalidStateError,
        match=r"inside pmap/shard_map over axes \('dev',\).*axis_name='dev'",
    ):
        jax.pmap(lambda x: ckpt.save({"x": x}, 0), axis_name="dev")(jnp.zeros((N_DEV, 2)))
    with pytest.raises(
        jax_cb_ckpt.InvalidStateError, match=r"axis_name='nope' is not a pmap/shard_map axis"
    ):
        jax.pmap(lambda x: ckpt.save({"x": x}, 0, axis_name="nope"), axis_name="dev")(
            jnp.zeros((N_DEV, 2))
        )
    assert ckpt.stats.crossings == 0


@pytest.mark.parametrize("gather", ["stack", "concat"])
def test_vmap_inside_pmap_saves_as_the_gather_path_does(make_ckpt, ckpt_dir, gather):
    """pmap(vmap(train)) with axis_name=: the per-device crossing leaves a vmapped save
    to the gather path; both crossings give the same checkpoints, and every member's
    state is in them."""
    states = stack([stack([member_state(2 * d + m) for m in range(2)]) for d in range(N_DEV)])
    saved = {}
    for crossing in ("buffer", "callback"):
        ckpt = make_ckpt(ckpt_dir / crossing, every=EVERY, crossing=crossing)

        def body(state, step, ckpt=ckpt):
            state = toy_update(state, step)
            ckpt.maybe_save({"x": state["x"]}, step, axis_name="dev", gather=gather)
            return state, None

        def train(state, body=body):
            return jax.lax.scan(body, state, jnp.arange(N_STEPS))[0]

        jax.pmap(jax.vmap(train), axis_name="dev")(states)
        ckpt.wait()
        assert ckpt.all_steps() == SAVED
        saved[crossing] = {
            s: np.asarray(
                ocp.PyTreeCheckpointer().restore(ckpt_dir / crossing / str(s) / "state")["x"]
            )
            for s in SAVED
        }
    for s in SAVED:
        assert saved["buffer"][s].tobytes() == saved["callback"][s].tobytes()
    refs = [[member_reference(2 * d + m) for m in range(2)] for d in range(N_DEV)]
    last = saved["buffer"][SAVED[-1]]
    values = {
        np.asarray(refs[d][m][SAVED[-1]]["x"]).tobytes() for d in range(N_DEV) for m in range(2)
    }
    assert last.size == 2 * N_DEV * toy_state()["x"].size
    assert len(values) == 2 * N_DEV  # every member's own state is in there


# -- a pmap run restarted (issue 53) --------------------------------------------------------

PMAP_DEV = 2  # as the Brax run of issue 53


def pmap_init(seed):
    """A Brax-like state with a leading device axis: the env keys and counters made on
    the host (uncommitted arrays), the parameters by a pmap (committed, per device, the
    same on every device)."""
    params = jax.pmap(lambda _: jax.random.normal(jax.random.key(seed), (3,)))(
        jnp.arange(PMAP_DEV)
    )  # the same on every device, as a pmean update keeps them
    return {
        "params": params,
        "env_keys": jax.random.split(jax.random.PRNGKey(seed), PMAP_DEV * 8).reshape(
            PMAP_DEV, 8, 2
        ),
        "key": jax.random.split(jax.random.key(seed + 1), PMAP_DEV),
        "epoch": jnp.zeros(PMAP_DEV, jnp.int32),
    }


def pmap_epoch(ckpt):
    """One pmapped training epoch that saves every device's state (`axis_name=`)."""

    def epoch(state):
        key, sub = jax.random.split(state["key"])
        grad = jax.lax.pmean(jax.random.normal(sub, (3,)) * state["params"], "i")
        env_keys = jax.vmap(lambda k: jax.random.split(k)[0])(state["env_keys"])
        state = {
            "params": state["params"] - 0.1 * grad,
            "env_keys": env_keys,
            "key": key,
            "epoch": state["epoch"] + 1,
        }
        ckpt.maybe_save(state, state["epoch"], axis_name="i")
        return state

    return jax.pmap(epoch, axis_name="i")


def pmap_run(directory, epochs, like=None):
    """Epochs up to `epochs` from what `directory` holds (a restart), as a loop of one's
    own: restore_or_init, then the pmapped epoch."""
    with jax_cb_ckpt.Checkpointer(directory, every=2) as ckpt:
        made = like(pmap_init(0)) if like is not None else None
        state, start = ckpt.restore_or_init(pmap_init, 0, like=made)
        if start and made is not None:  # placed as like: committed only where like is
            where = lambda x: (x.sharding, getattr(x, "committed", True))  # noqa: E731
            assert jax.tree.map(where, state) == jax.tree.map(where, made)
        epoch = pmap_epoch(ckpt)
        for _ in range(int(start), epochs):
            state = epoch(state)
    return state


def abstract_per_device(state):
    """What worked before issue 53: ShapeDtypeStructs split over the devices by hand."""
    mesh = Mesh(np.array(jax.devices()[:PMAP_DEV]), ("i",))
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, P("i"))),
        state,
    )


@pytest.fixture(scope="module")
def pmap_runs(tmp_path_factory):
    """An uninterrupted run of 4 epochs, and a run stopped after 3 (step 2 on disk)."""
    root = tmp_path_factory.mktemp("pmap")
    pmap_run(root / "cut", 3)
    return pmap_run(root / "whole", 4), root / "cut"


@pytest.mark.parametrize(
    "like",
    [
        pytest.param(lambda state: state, id="concrete"),
        pytest.param(None, id="default"),
        pytest.param(abstract_per_device, id="abstract_per_device"),
    ],
)
def test_a_pmap_run_restarts_onto_its_devices(tmp_path, pmap_runs, like):
    """A pmapped epoch saving with axis_name= resumes bit for bit from each kind of `like`:
    the state it took fresh (host-made leaves come back uncommitted, the pmap's own per
    device: before issue 53 they came back committed to device 0 and the epoch refused
    them), the default (jax.eval_shape of init: uncommitted) and one split by hand."""
    uninterrupted, cut = pmap_runs
    shutil.copytree(cut, tmp_path / "cut")
    resumed = pmap_run(tmp_path / "cut", 4, like)
    assert jax_cb_ckpt.same_bits(resumed, uninterrupted)


def test_a_leaf_the_same_on_every_device_is_stored_per_device(pmap_runs):
    """`params` after a pmean update holds the same numbers on every device; with
    gather="stack" it is stored as the program has it, one copy per device: plain Orbax
    reads the (devices, 3) array (transforms.md says why it is not stored once)."""
    _, cut = pmap_runs
    stored = ocp.PyTreeCheckpointer().restore(cut / "2" / "state")
    params = np.asarray(stored["params"])
    assert params.shape == (PMAP_DEV, 3)
    assert all(row.tobytes() == params[0].tobytes() for row in params)
    assert jax_cb_ckpt.metadata(cut, step=2)["batch_shape"] == [PMAP_DEV]


def test_a_like_of_one_device_is_told_the_checkpoint_is_per_device(pmap_runs):
    """A like without the device axis (an init_fn that returns the state before it is
    replicated) is told the checkpoint holds one state per device, naming the axis, not
    that it was "saved under vmap"."""
    _, cut = pmap_runs
    one = jax.tree.map(lambda x: x[0], pmap_init(0))
    with pytest.raises(
        jax_cb_ckpt.StructureMismatchError,
        match=r"one state per device, saved inside pmap/shard_map with axis_name= \(axis "
        r"'i', 2 devices.*Fix: pass a like with the device axis",
    ):
        jax_cb_ckpt.restore(cut, one)


@pytest.mark.slow
def test_a_killed_pmap_run_resumes_onto_its_devices(tmp_path):
    """The run of issue 53, SIGKILLed: a child runs the pmapped epoch with a concrete
    like until it is killed after step 4; the restart (restore_or_init with the same
    like) takes the pmap and ends bit for bit as an uninterrupted run."""
    directory = tmp_path / "run"
    child = start_script(
        tmp_path,
        f"""
        import sys
        sys.path.insert(0, {HERE!r})
        from test_transforms import pmap_run
        pmap_run(sys.argv[1], 10**6, like=lambda state: state)
        """,
        directory,
    )
    try:
        wait_for_step(directory, 4, child, timeout=240)
    finally:
        kill_group(child)
    epochs = jax_cb_ckpt.latest_step(directory) + 3  # (some epochs after the last save)
    resumed = pmap_run(directory, epochs, lambda state: state)
    assert jax_cb_ckpt.same_bits(resumed, pmap_run(tmp_path / "whole", epochs))
