"""Unit tests of per-device saves' bookkeeping, without a save: which shardings a save goes
by (`chosen`), which block of a leaf each device holds (`Layout`, checked against JAX's
own index map) and the assembly of a step's blocks from every device (`Assemblies`).
Fast: no compile, no disk."""

import threading

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_cb_ckpt._base._errors import InvalidStateError
from jax_cb_ckpt._handoff import _shards
from jax_cb_ckpt._handoff._shards import block_key, layout_of
from jax_cb_ckpt._save._assembly import Assemblies

SHAPE = (8, 12, 3)


def _mesh():
    return jax.make_mesh((2, 2), ("a", "b"), axis_types=(jax.sharding.AxisType.Auto,) * 2)


def _coords(mesh, device):
    (position,) = np.argwhere(mesh.devices == device)
    return [int(c) for c in position]


@pytest.mark.parametrize(
    "spec", [P("a", "b"), P("b", "a"), P(("a", "b")), P(("b", "a")), P("a"), P(None, "b"), P()]
)
def test_each_device_holds_the_block_jax_gives_it_and_one_replica_is_written(spec):
    """Layout.index agrees with NamedSharding.devices_indices_map for every device; of
    the devices holding the same block (a mesh axis the leaf is not split over), only
    the one at coordinate 0 along that axis writes it, and every block is written once."""
    mesh = _mesh()
    sharding = NamedSharding(mesh, spec)
    layout, _ = layout_of([sharding], [np.zeros(SHAPE)], ["x"])
    block = sharding.shard_shape(SHAPE)
    assert layout.global_shape(0, block) == SHAPE
    expected = sharding.devices_indices_map(SHAPE)
    written = []
    for device, index in expected.items():
        coords = _coords(mesh, device)
        ours = layout.index(0, coords, block, replicas=True)
        assert block_key(ours, SHAPE) == block_key(index, SHAPE), (device, coords)
        kept = layout.index(0, coords, block)
        if kept is not None:
            assert kept == ours
            written.append(block_key(kept, SHAPE))
    assert sorted(written) == sorted({block_key(i, SHAPE) for i in expected.values()})


def test_block_keys_name_every_dimension_and_cover_the_leaf_once():
    assert block_key((slice(4, 8), slice(0, 12)), (8, 12)) == ((4, 8), (0, 12))
    assert block_key((slice(None), slice(0, 6)), (8, 12)) == ((0, 8), (0, 6))
    mesh = _mesh()
    sharding = NamedSharding(mesh, P("a", "b"))
    layout, _ = layout_of([sharding], [np.zeros((8, 12))], ["x"])
    covered = np.zeros((8, 12), int)
    for device in mesh.devices.flat:
        index = layout.index(0, _coords(mesh, device), (4, 6))
        covered[index] += 1
    assert (covered == 1).all()


def test_a_layout_refuses_what_the_shard_map_could_not_split_naming_the_leaf():
    mesh = _mesh()
    with pytest.raises(InvalidStateError, match=r"leaf w has 7 elements along dimension 0"):
        layout_of([NamedSharding(mesh, P("a"))], [np.zeros((7,))], ["w"])
    with pytest.raises(InvalidStateError, match=r"leaf w has shape \(8,\) but its sharding"):
        layout_of([NamedSharding(mesh, P("a", "b"))], [np.zeros((8,))], ["w"])
    other = jax.make_mesh((4,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
    shardings = [NamedSharding(mesh, P("a")), NamedSharding(other, P("d"))]
    with pytest.raises(InvalidStateError, match=r"leaf v is on mesh"):
        layout_of(shardings, [np.zeros(8), np.zeros(8)], ["w", "v"])


def test_a_layout_gives_each_leaf_its_partition_spec():
    mesh = _mesh()
    specs = [P(("a", "b")), P(None, "b"), P("b", "a"), P()]
    shardings = [NamedSharding(mesh, spec) for spec in specs]
    layout, _ = layout_of(shardings, [np.zeros((4, 2))] * 4, ["w", "v", "u", "t"])
    assert layout.partition_specs == tuple(specs)


def test_the_chosen_shardings_are_the_given_ones_and_metrics_go_along_replicated():
    """`shardings=` of the state's crossing leaves (constants do not cross), then one
    replicated sharding per metric on the same mesh; no mesh to put them on: gathered."""
    mesh = _mesh()
    given = [NamedSharding(mesh, P("a")), NamedSharding(mesh, P("b")), NamedSharding(mesh, P())]
    leaves = [np.zeros(4), np.zeros(4), np.zeros(4), 1.0]
    # Leaf 1 is a constant (not crossing); leaf 3 (after the state's 3) a metric.
    chosen = _shards.chosen(given, leaves, [0, 2, 3], 3)
    assert chosen == [given[0], given[2], NamedSharding(mesh, P())]
    assert _shards.chosen(given, leaves, [0, 2], 3) == [given[0], given[2]]
    assert _shards.chosen(given, leaves, [3], 3) is None  # only a metric crosses
    positional = [jax.sharding.SingleDeviceSharding(jax.devices()[0])] * 3
    assert _shards.chosen(positional, leaves, [0, 3], 3) is None  # no mesh for the metric
    # Not given: the trace's own shardings, only on a mesh with explicit axes (none here).
    assert _shards.chosen(None, [np.zeros(4)], [0], 1) is None


def test_the_last_device_to_report_completes_the_step_once():
    assemblies = Assemblies()
    key = (object(), 5)
    first, is_first, stale = assemblies.join(key, 3, 1, (0,))
    assert is_first and stale is None
    for coords in [(1,), (2,)]:
        again, is_first, stale = assemblies.join(key, 3, 1, coords)
        assert again is first and not is_first and stale is None
    assert [assemblies.finish(key, first, s) for s in (0.1, 0.3, 0.2)] == [False, False, True]
    assert first.blocking_s == 0.3  # the longest any device waited
    fresh, is_first, _ = assemblies.join(key, 3, 1, (0,))  # a later run's save of it
    assert is_first and fresh is not first


def test_a_device_reporting_again_drops_the_run_left_unfinished():
    """A run that ended before every device reported leaves its assembly open; the same
    device reporting the step again starts a new one and hands the old one back to be
    settled, so a new run's blocks never mix with it."""
    assemblies = Assemblies()
    key = (object(), 2)
    old, _, _ = assemblies.join(key, 2, 1, (0,))
    new, is_first, stale = assemblies.join(key, 2, 1, (0,))
    assert stale is old and old.failed and is_first and new is not old
    assert assemblies.take_settled(old) and not assemblies.take_settled(old)


def test_failed_assemblies_are_given_back_once_and_in_progress_ones_are_left():
    assemblies = Assemblies()
    failed, _, _ = assemblies.join((object(), 1), 2, 1, (0,))
    busy, _, _ = assemblies.join((object(), 2), 2, 1, (0,))
    failed.failed = True
    assert assemblies.take_failed() == [failed]
    assert assemblies.take_failed() == []
    assert not assemblies.take_settled(failed)  # already given back
    assert not busy.settled


def test_the_other_devices_wait_for_the_first_ones_decision_and_blocks_are_kept_once():
    assemblies = Assemblies()
    key = (object(), 9)
    first, _, _ = assemblies.join(key, 2, 2, (0,))
    second, _, _ = assemblies.join(key, 2, 2, (1,))
    seen = []
    waiter = threading.Thread(target=lambda: (second.wait_decided(), seen.append(second.saving)))
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive()  # no decision yet
    first.decide("a plan")
    waiter.join(10)
    assert seen == [True]
    assert first.reserve(0, ((0, 4),)) and not second.reserve(0, ((0, 4),))
    released = []
    first.add([(0, ((0, 4),), np.ones(4))], lambda: released.append(0))
    second.add([(1, ((4, 8),), np.zeros(4))], lambda: released.append(1))
    assert list(first.blocks[0]) == [((0, 4),)] and list(first.blocks[1]) == [((4, 8),)]
    first.release()
    first.release()  # given back once
    assert sorted(released) == [0, 1]
