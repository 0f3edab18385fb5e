"""XLA's CPU threads on some cores, the interpreter's threads on all (`jaxrl-vlm serve --xla-cpu-cores`).

Why: on a small CPU host each decode step passes from the engine's Python (scheduler, HTTP) to XLA's compute threads
and back; a small model's programs run faster on fewer cores than split over all of them, and the Python keeps a
core that XLA's threads never take. vLLM's CPU server keeps its compute on its own cores and leaves one to its API
server; this is the same split for the embedded engine. XLA places its CPU client's thread pools when the backend
starts, on the starting thread's cores (a Linux thread inherits its creator's affinity), so the backend is started
with this thread confined to `cores`, and the confinement is then lifted for this thread, and for every thread it
starts later, only. XLA compiles on that pool too, so compilations (the engine's warm-up, its side thread) get only
`cores` as well and take longer, and a side-thread compilation shares those cores with the programs serving requests.
On a GPU or TPU host the flag is refused: jax starts every backend it finds at once, so the accelerator client's
host threads would be confined too (before the start where JAX_PLATFORMS names an accelerator; else after it, and
the process must end).
"""

from __future__ import annotations

import os

AUTO = "auto"


def allowed_cores() -> frozenset[int]:
    """The cores this process may run on (Linux's affinity mask)."""
    if not hasattr(os, "sched_getaffinity"):
        raise RuntimeError("placing XLA's CPU threads needs Linux's sched_setaffinity, which this platform lacks")
    return frozenset(os.sched_getaffinity(0))


def parse_cpu_list(text: str, allowed: frozenset[int]) -> frozenset[int]:
    """Cores from a Linux CPU list ("1", "0-3,6", as `taskset -c` takes), or "auto": every allowed core but the
    lowest, which the interpreter keeps (all of them on a one-core host). Refuses cores outside `allowed`."""
    text = text.strip()
    if text == AUTO:
        return allowed - {min(allowed)} if len(allowed) > 1 else allowed
    cores: set[int] = set()
    for part in text.split(","):
        lo, sep, hi = part.strip().partition("-")
        try:
            first, last = int(lo), int(hi if sep else lo)
        except ValueError:
            raise ValueError(f"--xla-cpu-cores {text!r}: {part.strip()!r} is not a core or a range of cores "
                             f"(e.g. 1 or 0-3,6, or {AUTO})") from None
        if first < 0 or last < first:
            raise ValueError(f"--xla-cpu-cores {text!r}: {part.strip()!r} is not an ascending range of cores")
        cores.update(range(first, last + 1))
    outside = cores - allowed
    if outside:
        raise ValueError(f"--xla-cpu-cores {text!r}: cores {sorted(outside)} are not among this process's "
                         f"{sorted(allowed)}")
    return frozenset(cores)


def confine_xla_threads(cores_text: str) -> None:
    """Start jax's backends with XLA's CPU threads on the cores `cores_text` names (`parse_cpu_list`); this thread
    keeps the cores it had. Must run before anything in the process starts a jax backend: threads that already
    exist cannot be moved by it."""
    import jax
    from jax._src import xla_bridge  # no public way to ask whether the backends have started

    before = allowed_cores()
    cores = parse_cpu_list(cores_text, before)  # a malformed list is named first, whatever else is wrong
    platforms = jax.config.jax_platforms  # None: jax starts every backend it finds
    if any(p.strip() not in ("", "cpu") for p in (platforms or "").split(",")):
        raise RuntimeError(f"--xla-cpu-cores is for an engine on a CPU host; this process is to run on "
                           f"{platforms!r} (JAX_PLATFORMS), whose client's host threads it would confine as well")
    if xla_bridge.backends_are_initialized():
        raise RuntimeError("--xla-cpu-cores: jax's backends have already started in this process, so XLA's threads "
                           "exist and would not move; it must be applied before the first jax computation")
    os.sched_setaffinity(0, cores)
    try:
        jax.devices()  # creates the clients and their thread pools, which inherit this thread's cores
    finally:
        os.sched_setaffinity(0, before)
    backend = jax.default_backend()
    if backend != "cpu":  # the process must end: the accelerator client's threads cannot be moved back
        raise RuntimeError(f"--xla-cpu-cores is for an engine on a CPU host, but jax found {backend} devices and "
                           f"started their client with its host threads on cores {sorted(cores)}; serve without "
                           "the flag, or with JAX_PLATFORMS=cpu")
