"""The device-set lock (jaxrl_vlm/device_lock.py): programs on overlapping device sets take turns, programs on
disjoint device sets run at the same time, and many users with random overlapping sets never deadlock."""

from __future__ import annotations

import random
import threading
import time

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxrl_vlm.device_lock import awaited, devices_of, exclusive, held_by_others, run_exclusive


def _hold_together(a, b, timeout_s: float = 2.0) -> bool:
    """Whether two threads, one holding `a` and one `b`, are ever inside their blocks at the same time (each waits
    at a barrier inside its block: it only passes if the other is inside too)."""
    barrier = threading.Barrier(2)
    met = []

    def user(devices):
        with exclusive(devices):
            try:
                barrier.wait(timeout_s)
                met.append(True)
            except threading.BrokenBarrierError:
                pass

    threads = [threading.Thread(target=user, args=(d,)) for d in (a, b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads)
    return len(met) == 2


def test_overlapping_device_sets_take_turns_and_disjoint_ones_overlap():
    devices = jax.devices()
    assert len(devices) == 8  # conftest's simulated devices
    assert not _hold_together(devices[:4], devices[3:])      # share device 3: one waits for the other
    assert not _hold_together(devices, devices[:1])           # the trainer's 8 and an engine on device 0
    assert _hold_together(devices[:4], devices[4:])           # disjoint: both inside at once
    assert _hold_together(devices[:1], devices[1:2])


def test_the_lock_is_reentrant_and_held_only_inside_the_block():
    devices = jax.devices()[:2]
    seen = []
    with exclusive(devices):
        with exclusive(devices[:1]):  # a user that holds its devices runs another program on them
            seen.append(True)
        other = threading.Thread(target=lambda: seen.append(held_by_others(devices)))
        other.start()
        other.join()
    assert seen == [True, True]
    assert not held_by_others(devices)


def test_many_users_with_random_overlapping_sets_never_deadlock():
    devices = jax.devices()
    rng = random.Random(0)
    sets = [rng.sample(devices, rng.randint(1, len(devices))) for _ in range(16)]
    inside: dict[int, int] = {d.id: 0 for d in devices}
    guard = threading.Lock()
    errors = []

    def user(devs):
        for _ in range(50):
            with exclusive(reversed(devs)):  # any order in, the same order taken
                with guard:
                    for d in devs:
                        inside[d.id] += 1
                        if inside[d.id] > 1:
                            errors.append(d.id)
                time.sleep(0.0005)
                with guard:
                    for d in devs:
                        inside[d.id] -= 1

    threads = [threading.Thread(target=user, args=(s,)) for s in sets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "deadlock"
    assert not errors, f"two users inside on devices {sorted(set(errors))}"


def test_run_exclusive_returns_ready_outputs_and_devices_of_reads_shardings():
    devices = jax.devices()
    mesh = Mesh(np.array(devices), ("data",))
    x = jax.device_put(np.arange(16.0), NamedSharding(mesh, P("data")))
    total = run_exclusive(devices_of(x), jax.jit(lambda v: v.sum()), x)
    assert float(total) == pytest.approx(120.0)
    assert devices_of({"x": x, "n": 3, "a": np.zeros(2)}) == frozenset(devices)


def test_awaited_says_whether_another_thread_waits_for_the_devices():
    devices = jax.devices()
    entered = threading.Event()
    with exclusive(devices[:2]):
        assert not awaited(devices[:2])
        waiter = threading.Thread(target=lambda: (exclusive_block(devices[1:3]), entered.set()))
        waiter.start()
        deadline = time.monotonic() + 10
        while not awaited(devices[:1] + devices[1:2]) and time.monotonic() < deadline:
            time.sleep(0.001)
        assert awaited(devices[1:2]) and not awaited(devices[:1]) and not entered.is_set()
    waiter.join(10)
    assert entered.is_set() and not awaited(devices)


def exclusive_block(devices) -> None:
    with exclusive(devices):
        pass
