"""`_save/_assembly.py`: a per-device save's blocks. `Assemblies.join` makes the first
device of a step the one that decides, every other device joins the same assembly; a
step completes (`finish` True, exactly once) only when every device has reported, and
stays open until then; a device reporting a step twice marks the old assembly stale
and starts a new one; failed assemblies are given back once; `reserve` gives a block
to one device; `release` gives back every device's buffers once."""

import threading

import numpy as np

from jax_cb_ckpt._handoff._items import Claim
from jax_cb_ckpt._save._assembly import Assemblies, Assembly

KEY = ("crossing", 5)


def test_the_step_completes_only_when_every_device_reported():
    assemblies = Assemblies()
    coords = [(0, 0), (0, 1), (1, 0), (1, 1)]
    first, is_first, stale = assemblies.join(KEY, 4, 2, coords[0])
    assert is_first and stale is None
    completed = [assemblies.finish(KEY, first, 0.1)]
    for c in coords[1:]:
        assembly, is_first, stale = assemblies.join(KEY, 4, 2, c)
        assert assembly is first and not is_first and stale is None
        completed.append(assemblies.finish(KEY, assembly, 0.3 if c == (1, 0) else 0.2))
    assert completed == [False, False, False, True]
    assert first.blocking_s == 0.3
    # Gone once complete: the next report of the step starts a new assembly.
    again, is_first, stale = assemblies.join(KEY, 4, 2, coords[0])
    assert again is not first and is_first and stale is None


def test_from_many_threads_exactly_one_device_completes_the_step():
    assemblies = Assemblies()
    devices, results, barrier = 8, [], threading.Barrier(8)

    def device(i):
        barrier.wait()
        assembly, first, _ = assemblies.join(KEY, devices, 1, (i,))
        if first:
            assembly.decide(Claim(5, ()))
        assembly.wait_decided()
        assembly.add([(0, ((i, i + 1),), np.full(1, i))], lambda: None)
        results.append((assembly, first, assemblies.finish(KEY, assembly, 0.0)))

    threads = [threading.Thread(target=device, args=(i,)) for i in range(devices)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len({id(a) for a, _, _ in results}) == 1
    assert sum(first for _, first, _ in results) == 1
    assert sum(done for _, _, done in results) == 1
    assembly = results[0][0]
    assert assembly.saving and assembly.claim == Claim(5, ())
    assert sorted(assembly.blocks[0]) == [((i, i + 1),) for i in range(devices)]


def test_a_device_reporting_a_step_twice_leaves_the_old_assembly_stale():
    assemblies = Assemblies()
    old, _, _ = assemblies.join(KEY, 2, 1, (0,))
    again, first, stale = assemblies.join(KEY, 2, 1, (0,))
    assert stale is old and old.failed and not old.saving
    assert first and again is not old
    assert assemblies.take_settled(old) and not assemblies.take_settled(old)


def test_failed_assemblies_are_given_back_once_and_stay_open():
    assemblies = Assemblies()
    a, _, _ = assemblies.join(KEY, 2, 1, (0,))
    b, _, _ = assemblies.join(("crossing", 6), 2, 1, (0,))
    a.failed = True
    assert assemblies.take_failed() == [a]
    assert assemblies.take_failed() == []
    same, first, _ = assemblies.join(KEY, 2, 1, (1,))  # a late report is still recognised
    assert same is a and not first
    assert not b.failed


def test_no_claim_saves_nothing():
    assembly = Assembly(2, 1)
    assembly.decide(None)
    assembly.wait_decided()
    assert not assembly.saving


def test_reserve_gives_a_block_to_one_device():
    assembly = Assembly(2, 2)
    block = ((0, 4),)
    assert assembly.reserve(0, block)
    assert not assembly.reserve(0, block)
    assert assembly.reserve(1, block)  # another leaf's block of the same index


def test_release_gives_back_every_devices_buffers_once():
    assembly = Assembly(2, 1)
    released = []
    assembly.add([(0, ((0, 1),), np.zeros(1))], lambda: released.append("a"))
    assembly.add([(0, ((1, 2),), np.ones(1))], lambda: released.append("b"))
    assembly.release()
    assembly.release()
    assert sorted(released) == ["a", "b"]
