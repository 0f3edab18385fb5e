"""Compile a program on a side thread while the running requests go on with one already compiled.

A compilation on the scheduler's thread stalls every running request: a second or more on a CPU, tens of seconds on
a TPU. The runner's decode steps can borrow a larger compiled program (padding rows dropped, keys masked), so a
bucket the workload turns out to need is compiled here, one at a time, and adopted once ready. jax's jit caches the
executable that `lower(...).compile()` builds, so the runner's next call of those shapes runs it without tracing or
compiling again.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Hashable
from typing import Any

logger = logging.getLogger(__name__)

# Compile events on this thread stall no request (`scripts/bench_engine.py` counts them apart).
THREAD_NAME = "jaxrl-vlm-background-compile"


class BackgroundCompiler:
    """At most one compilation in flight, on a side thread that is not a daemon: a process that exits meanwhile waits
    for it (seconds), because XLA's compiler cannot be interrupted and a daemon thread still inside it when the
    interpreter finalizes aborts the process (SIGABRT, "exception not rethrown"). Driven by one thread (the
    scheduler's): `start` a key, later `take_ready` the keys whose programs are compiled. A key whose compilation
    failed is logged and never started again: the caller keeps running the program it borrows."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._ready: list[Hashable] = []
        self._started: set[Hashable] = set()
        self.failed: dict[Hashable, str] = {}  # key -> "ExceptionType: message"
        self.compiled = 0  # programs compiled here so far

    @property
    def busy(self) -> bool:
        """A compilation is in flight."""
        return self._thread is not None and self._thread.is_alive()

    def can_start(self, key: Hashable) -> bool:
        """`key` was never started and nothing is in flight (else the caller asks again on a later step)."""
        return key not in self._started and not self.busy

    def start(self, key: Hashable, compile_program: Callable[[], Any]) -> None:
        """Run `compile_program` (e.g. `jitted.lower(*specs).compile`) on the side thread; see `can_start`."""
        if not self.can_start(key):
            raise RuntimeError(f"cannot start compiling {key}: started before, or another compilation is in flight")
        self._started.add(key)
        self._thread = threading.Thread(target=self._compile, args=(key, compile_program), name=THREAD_NAME,
                                        daemon=False)
        self._thread.start()

    def take_ready(self) -> list[Hashable]:
        """The keys compiled since the last call (each once)."""
        with self._lock:
            ready, self._ready = self._ready, []
        return ready

    def wait(self, timeout_s: float | None = None) -> None:
        """Until the compilation in flight (if any) ends: for tests and tools, never the serving path."""
        if self._thread is not None:
            self._thread.join(timeout_s)

    def _compile(self, key: Hashable, compile_program: Callable[[], Any]) -> None:
        try:
            compile_program()
        except Exception as exc:  # noqa: BLE001 - the borrowed program keeps serving; the cause is logged
            logger.exception("compiling %s in the background failed; its steps keep borrowing a larger program", key)
            with self._lock:
                self.failed[key] = f"{type(exc).__name__}: {exc}"
            return
        with self._lock:
            self._ready.append(key)
            self.compiled += 1
