"""One process, two device users: programs on overlapping device sets never run at the same time.

Why: the embedded engine (its scheduler thread) and the trainer (the job's thread) can share a process and its
devices. Each launches multi-device programs whose collectives need every participant: XLA:CPU runs a program's
participants on its client's thread pool, each blocking in the collective's rendezvous until all have arrived, and
a GPU stream runs its collectives in the order they were enqueued. Two such programs in flight at once from two
threads, on devices they share, can each hold part of what the other needs (pool threads; the order of kernels on a
stream), and both wait forever. A test training on 8 simulated devices beside the embedded engine once stalled
with all 8 participant threads in an all-reduce rendezvous. jaxlib 0.10.2's CPU client orders collective launches
itself, and `scripts/repro_collective_stall.py` found no stall with two threads (its docstring has the findings and
the likelier causes); the lock makes the guarantee the product's own, on every backend and jaxlib.

So the programs with collectives run under `exclusive(devices)`, held from dispatch until their outputs are ready:
the trainer's updates and log-probs (`Trainer.train_on`, `Trainer.nll`), the engine's prefill, decode and score
(`ModelRunner`), and the in-memory weight staging across both device sets (`engine.core`'s `stage_weights`).
The engine's overlapped decode holds its devices from step to step (each step is dispatched before the one
before it is read); it lets go at its next step once another thread waits for them (`awaited`).
Overlapping device sets take turns, while disjoint ones (engine
and trainer placed apart with `--rollout-devices` / `--train-devices`) never contend and keep their overlap. One
lock per device, taken in device-id order, so two users never wait on each other in a cycle; reentrant, so a user
that holds its devices can run another program on them.

Cost: a program's host-side dispatch can no longer run ahead of its completion while another user waits for the
same devices, and a first call's compilation happens inside (the other user waits meanwhile); engine and trainer
on the same devices could not compute at once anyway. `JAXRL_DEVICE_LOCK=off` disables it (diagnostics only).
"""

from __future__ import annotations

import collections
import contextlib
import os
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

import jax

T = TypeVar("T")

# JAXRL_DEVICE_LOCK=off turns the lock into a no-op: only for scripts/repro_collective_stall.py and its test, which
# show what happens without it.
ENABLED = os.environ.get("JAXRL_DEVICE_LOCK", "on").lower() not in ("off", "0", "false")

_registry_lock = threading.Lock()
_device_locks: dict[tuple[int, int], threading.RLock] = {}  # (process index, device id) -> its lock
_waiting: collections.Counter[tuple[int, int]] = collections.Counter()  # threads blocked on each device's lock


def _key(device: Any) -> tuple[int, int]:
    return int(getattr(device, "process_index", 0)), int(device.id)


def _lock_of(key: tuple[int, int]) -> threading.RLock:
    with _registry_lock:
        lock = _device_locks.get(key)
        if lock is None:
            lock = _device_locks[key] = threading.RLock()
        return lock


def devices_of(tree: Any) -> frozenset[Any]:
    """The devices of every jax.Array leaf of `tree` (numpy leaves and scalars have none)."""
    found: set[Any] = set()
    for leaf in jax.tree.leaves(tree):
        sharding = getattr(leaf, "sharding", None)
        if sharding is not None:
            found.update(sharding.device_set)
    return frozenset(found)


@contextlib.contextmanager
def exclusive(devices: Iterable[Any]) -> Iterator[None]:
    """Hold every device of `devices` (jax Devices) until the block ends; blocks while another thread holds any of
    them. Locks are taken in (process, id) order: any two callers agree on the order, so no cycle of waits."""
    keys = sorted({_key(d) for d in devices}) if ENABLED else []
    held: list[threading.RLock] = []
    try:
        for key in keys:
            lock = _lock_of(key)
            if not lock.acquire(blocking=False):
                with _registry_lock:
                    _waiting[key] += 1
                try:
                    lock.acquire()
                finally:
                    with _registry_lock:
                        _waiting[key] -= 1
            held.append(lock)
        yield
    finally:
        for lock in reversed(held):
            lock.release()


def run_exclusive(devices: Iterable[Any], fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """`fn(*args, **kwargs)` (a jitted program) with `devices` held from its dispatch until its outputs are ready."""
    with exclusive(devices):
        out = fn(*args, **kwargs)
        jax.block_until_ready(out)
    return out


def awaited(devices: Iterable[Any]) -> bool:
    """Whether another thread is blocked waiting for some device of `devices`: a user that could keep its devices
    busy back to back (the engine's overlapped decode) lets go at its next step instead."""
    if not ENABLED:
        return False
    keys = {_key(d) for d in devices}
    with _registry_lock:
        return any(_waiting[key] > 0 for key in keys)


def held_by_others(devices: Iterable[Any]) -> bool:
    """Whether some device of `devices` is held now (by any thread; for tests and diagnostics)."""
    for key in sorted({_key(d) for d in devices}):
        lock = _lock_of(key)
        if not lock.acquire(blocking=False):
            return True
        lock.release()
    return False
