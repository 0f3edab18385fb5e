"""JAX's persistent compilation cache, and the programs kept out of it (issue 49).

A train step that donates its state on several XLA:CPU devices, read back from the cache by a later process, can
deadlock in a collective and abort (scripts/repro_compile_cache_abort.py); `compile_train_step` compiles such a step
outside the cache. jax 0.10.2 has no per-compile switch, so the fence sets jax's module cache aside for one compile.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator
from typing import Any

import jax

logger = logging.getLogger(__name__)

_FENCE_LOCK = threading.Lock()
_fence_logged = False


def persistent_cache_enabled() -> bool:
    """JAX's persistent compilation cache is on (a directory set, e.g. by JAX_COMPILATION_CACHE_DIR, and enabled)."""
    return bool(jax.config.jax_compilation_cache_dir) and bool(jax.config.jax_enable_compilation_cache)


def fenced_from_persistent_cache(devices: Any) -> bool:
    """Whether the train step on `devices` is compiled outside JAX's persistent compilation cache.

    An XLA:CPU train step that donates its state, on 8 devices, read back from the cache by a later process
    deadlocked in a collective in about half the loads: the devices of one run waited in different all-reduces, or
    half of them never arrived, and XLA aborted the process at its rendezvous timeout (SIGABRT; 40 s by default,
    `Termination timeout` on stderr). The same step compiled in the process never did, nor one cached without
    donation (scripts/repro_compile_cache_abort.py; issue 49). So on CPU a multi-device step is compiled in every
    process; its other programs (log-probs, optimizer init, ...) still come from the cache.
    """
    devices = list(devices)
    return (persistent_cache_enabled() and len(devices) > 1
            and all(getattr(d, "platform", None) == "cpu" for d in devices))


@contextlib.contextmanager
def _outside_persistent_cache() -> Iterator[None]:
    """Compilations in this block neither read nor write JAX's persistent compilation cache.

    jax 0.10.2 has no per-compile switch (`jax_enable_compilation_cache` is read once per process), so the
    module's cache is set aside for the block. Another thread compiling meanwhile only misses the cache."""
    from jax._src import compilation_cache as cc

    if not all(hasattr(cc, name) for name in ("_cache", "_cache_initialized", "_cache_initialized_mutex")):
        logger.warning("compilation cache: this jax (%s) moved the internals the fence sets aside; the train step "
                       "goes through the persistent cache", jax.__version__)
        yield
        return
    with _FENCE_LOCK:
        with cc._cache_initialized_mutex:
            saved = cc._cache, cc._cache_initialized
            cc._cache, cc._cache_initialized = None, True
        try:
            yield
        finally:
            with cc._cache_initialized_mutex:
                cc._cache, cc._cache_initialized = saved


def compile_outside_persistent_cache(jitted: Any, *args: Any, what: str = "the train step") -> Any:
    """`jitted` lowered for `args` and compiled without JAX's persistent compilation cache (a `jax.stages.Compiled`
    to call with arguments like `args`); says so once per process."""
    global _fence_logged
    lowered = jitted.lower(*args)
    with _outside_persistent_cache():
        compiled = lowered.compile()
    if not _fence_logged:
        _fence_logged = True
        logger.warning("compilation cache: %s is compiled outside JAX's persistent compilation cache (XLA:CPU, "
                       "donated state on several devices: read back by a later process it can deadlock in a "
                       "collective and abort; issue 49); other programs still use the cache", what)
    return compiled
