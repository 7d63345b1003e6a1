"""Which way a save goes (`_route.plan`: its argument checks, one description of the state
and metrics, `Skip` where nothing saves), the step as it crosses and `is_tracing`
(`_values`), the checks made while tracing (`_traced`) and
the options a save runs under (`_options.checked`), each on its own: no
Checkpointer, no callback, no disk.
The whole save is the end-to-end tests'; these pin the rules a stage owns."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import checked_options
from jax.sharding import PartitionSpec as P

from jax_cb_ckpt import ConfigError, InvalidStateError
from jax_cb_ckpt._base._errors import calling
from jax_cb_ckpt._layout import _describe
from jax_cb_ckpt._save import _route, _values


def plan(state, step, known=None, condition=None, *, axis_name=None, gather="stack", **kw):
    request = _route.Request(
        state,
        step,
        known,
        condition,
        axis_name,
        gather,
        kw.pop("shardings", None),
        kw.pop("metrics", None),
    )
    with calling("maybe_save"):
        return _route.plan(request, **kw)


# -- _route.plan


def test_outside_a_trace_a_save_is_eager_with_every_leaf_on_the_host():
    state = {"w": jnp.arange(4.0), "n": np.int64(2**40), "f": 0.5}
    route = plan(state, 7, 7, processes=1)
    assert isinstance(route, _route.Eager) and route.step == 7
    by_name = {s.name: h for s, h in zip(route.signature.specs, route.hosts, strict=True)}
    # Python's and numpy's values as numpy with their exact dtype (JAX would narrow an
    # int64 with x64 off); a jax.Array as it is (the host side takes it without a copy).
    assert isinstance(by_name[("n",)], np.ndarray) and by_name[("n",)].dtype == np.int64
    assert by_name[("n",)] == 2**40 and by_name[("f",)].dtype == np.float64
    assert by_name[("w",)] is state["w"]


def test_an_eager_save_whose_predicate_is_false_goes_nowhere():
    assert plan({"w": np.ones(3)}, 7, 7, False, processes=1) == _route.Skip()
    assert isinstance(plan({"w": np.ones(3)}, 7, 7, True, processes=1), _route.Eager)


def test_a_step_that_does_not_save_is_checked_all_the_same():
    """Not wanted (`maybe_save` at a step that does not save): nothing crosses, but the
    arguments, the state and the metrics are refused as at a step that saves, so a
    mistake shows at the first call, not at the first save; the metrics' names come
    back for keep_best's check."""

    def skip(state, **kw):
        request = _route.Request(state, 7, 7, None, kw.pop("axis_name", None), **kw)
        with calling("maybe_save"):
            return _route.plan(request, processes=1, wanted=False)

    assert skip({"w": np.ones(3)}, metrics={"loss": 1.0}) == _route.Skip(("loss",))
    with pytest.raises(InvalidStateError, match=r"state\['w'\].*str"):
        skip({"w": "text"})
    with pytest.raises(InvalidStateError, match="a metric is one real number"):
        skip({"w": np.ones(3)}, metrics={"loss": np.ones((2, 2))})
    with pytest.raises(ConfigError, match="gather must be one of"):
        skip({"w": np.ones(3)}, gather="sum")
    mesh = jax.make_mesh((1,), ("x",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    with pytest.raises(InvalidStateError, match="shardings' pytree is not a prefix"):
        skip({"a": np.ones(2), "b": np.ones(2)}, shardings=[sharding] * 3)


def test_the_state_and_its_metrics_are_described_in_one_pass_state_first():
    described = _describe.describe_save({"w": np.ones(3), "n": 2}, {"eval": {"return": 1.5}})
    assert described.state_leaves == 2 and described.metrics == ("eval/return",)
    assert [s.path for s in described.specs] == [
        "state['n']",
        "state['w']",
        "metrics['eval']['return']",
    ]
    assert described.leaves[2] == 1.5
    route = plan({"w": np.ones(3)}, 7, 7, processes=1, metrics={"loss": np.float32(2)})
    assert isinstance(route, _route.Eager) and route.metrics == ("loss",)
    assert route.signature.state_leaves == 1 and route.hosts[1] == np.float32(2)


def test_inside_a_trace_constants_stay_home_and_the_rest_crosses():
    routes = []

    def program(w):
        state = {"w": w, "c": np.arange(3, dtype=np.int64), "empty": jnp.zeros((0, 2))}
        routes.append(plan(state, jnp.int32(3), processes=1))
        return w

    jax.make_jaxpr(program)(jnp.ones(4))
    (route,) = routes
    assert isinstance(route, _route.Traced) and route.layout is None  # gathered
    assert len(route.payload) == 1  # only `w` crosses
    constants = dict(route.signature.constants)
    names = [s.name for s in route.signature.specs]
    assert constants[names.index(("c",))].dtype == np.int64  # never narrowed by JAX
    assert constants[names.index(("empty",))].shape == (0, 2)  # a shape, nothing to cross


def test_a_multi_process_run_refuses_what_it_cannot_save():
    with pytest.raises(InvalidStateError, match="outside jit in a multi-process run"):
        plan({"w": np.ones(3)}, 1, 1, processes=2)
    refused = []

    def program(w):
        try:
            plan({"w": w}, jnp.int32(1), processes=2)
        except ConfigError as e:
            refused.append(str(e))
        return w

    jax.make_jaxpr(program)(jnp.ones(4))
    assert refused and "a traced save needs shardings=" in refused[0]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"gather": "sum"}, "gather must be one of"),
        ({"gather": "concat"}, "needs axis_name="),
    ],
)
def test_bad_arguments_are_refused_before_anything_is_described(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        plan({"w": np.ones(3)}, 1, 1, processes=1, **kwargs)


def test_shardings_that_do_not_fit_the_state_are_refused():
    mesh = jax.make_mesh((1,), ("x",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    state = {"a": np.ones(2), "b": np.ones(2)}
    with pytest.raises(InvalidStateError, match="the shardings' pytree is not a prefix"):
        plan(state, 1, 1, processes=1, shardings=[sharding])
    with pytest.raises(ConfigError, match="Pass one of the two"):
        plan(state, 1, 1, processes=1, shardings=sharding, axis_name="i")


# -- _options.checked


def test_options_are_checked_once_and_frozen(tmp_path):
    made = checked_options(str(tmp_path / "d"), every=100, max_to_keep=3, peer_timeout=5)
    assert (made.when.every, made.keep.max_to_keep, made.failures.peer_timeout) == (100, 3, 5.0)
    assert made.where.directory == str(tmp_path / "d")
    with pytest.raises(AttributeError):
        made.when.every = 1  # frozen: what the host side and the writer read never changes
    assert checked_options(str(tmp_path), on_full="newest").queue.slots == 3  # one more in flight
    assert checked_options(str(tmp_path), on_full="block").queue.slots == 2


@pytest.mark.parametrize(
    "change, match",
    [
        ({"every": 0}, "every"),
        ({"max_to_keep": -1}, "max_to_keep"),
        ({"queue_size": None}, "queue_size"),
        ({"on_full": "drop"}, "on_full must be one of"),
        ({"on_error": "ignore"}, "on_error must be one of"),
        ({"on_existing": "overwrite"}, "on_existing must be one of"),
        ({"crossing": "fast"}, "crossing must be one of"),
        ({"peer_timeout": True}, "peer_timeout must be a positive number"),
        ({"peer_timeout": 0}, "peer_timeout must be a positive number"),
    ],
)
def test_each_bad_option_is_named_with_what_it_accepts(tmp_path, change, match):
    with pytest.raises(ConfigError, match=match) as caught:
        checked_options(str(tmp_path), **change)
    assert f"{next(iter(change))}=" in str(caught.value)  # names the argument


def test_a_file_where_the_directory_should_be_is_refused(tmp_path):
    (tmp_path / "f").write_text("not a directory")
    with pytest.raises(ConfigError, match="is an existing file, not a directory"):
        checked_options(str(tmp_path / "f"))


# -- _traced: the checks made while tracing


def test_a_known_step_is_checked_and_a_traced_one_left_to_run_time():
    from jax_cb_ckpt._save import _traced

    assert _traced.check_step(7) == 7
    assert _traced.check_step(np.int64(2**40)) == 2**40
    for bad, match in [
        (1.0, r"pass int\(step\)"),
        (True, "integer scalar"),
        (np.arange(2), "integer scalar"),
        (-1, "out of range"),
    ]:
        with pytest.raises(InvalidStateError, match=match):
            _traced.check_step(bad)
    seen = []
    jax.make_jaxpr(lambda s: seen.append(_traced.check_step(s)) or s)(jnp.int32(3))
    assert seen == [None]  # a tracer: its value is known at run time


def test_a_step_too_large_for_jax_integers_is_refused_rather_than_wrapped():
    assert not jax.config.jax_enable_x64  # (the suite's setting: int32 steps in JAX)
    with pytest.raises(InvalidStateError, match=r"step 2147483648 does not fit int32.*x64"):
        _values.traced_step(2**31, 2**31)
    with pytest.raises(InvalidStateError, match="does not fit int32"):
        _values.traced_step(2**32 + 5, 2**32 + 5)
    out = _values.traced_step(2**31 - 1, 2**31 - 1)
    assert out.dtype == jnp.int32 and int(out) == 2**31 - 1
    assert _values.traced_step(np.uint8(9), 9).dtype == jnp.uint8


def test_tracing_is_told_apart_from_running_eagerly():
    assert not _values.is_tracing(np.ones(2), jnp.ones(2))
    assert not _values.is_tracing({"a": 1})
    inside = []
    jax.jit(lambda: inside.append(_values.is_tracing()) or 0)()  # constants only: traced
    jax.jit(lambda x: inside.append(_values.is_tracing(x)) or x)(jnp.zeros(()))
    jax.vmap(lambda x: inside.append(_values.is_tracing(x)) or x)(jnp.zeros(2))
    assert inside == [True, True, True]
    assert jax.default_backend() != "cpu" or _route.buffer_by_default()  # CPU: buffer


def _in_shard_map(check):
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("d",))

    def body(x):
        check()
        return x

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("d"), out_specs=P("d"))).trace(
        jnp.zeros(4)
    )


def test_inside_shard_map_an_axis_name_is_required():
    with pytest.raises(
        InvalidStateError,
        match=r"inside pmap/shard_map over axes \('d',\).*"
        r"axis_name='d'",
    ):
        _in_shard_map(lambda: _route.check_axis_name(None))


def test_inside_shard_map_the_axis_name_must_be_mapped():
    with pytest.raises(InvalidStateError, match=r"axis_name='e' is not a pmap/shard_map axis"):
        _in_shard_map(lambda: _route.check_axis_name("e"))
    _in_shard_map(lambda: _route.check_axis_name("d"))
    _route.check_axis_name(None)  # outside any map: nothing to require


def test_an_axis_name_no_transformation_binds_is_refused_by_name():
    """Outside pmap/shard_map an `axis_name` must still name a bound axis (a named vmap's
    is one); else the save would end in JAX's bare "unbound axis name"."""
    with (
        calling("save"),
        pytest.raises(InvalidStateError, match=r"^save\(axis_name='i'\): no axis 'i'"),
    ):
        _route.check_axis_name("i")
    seen = []
    jax.vmap(lambda x: seen.append(_route.check_axis_name("i")) or x, axis_name="i")(jnp.ones(2))
    assert seen == [None]
