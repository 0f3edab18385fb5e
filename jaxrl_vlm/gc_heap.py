"""The interpreter's cyclic garbage collector, kept off a long run's hot path.

A process that has loaded jax, transformers and a model holds hundreds of thousands of objects the collector
tracks, and a full collection walks every one of them (0.1-0.3 s on the 2-core machine). It comes whenever enough
new objects have outlived the young generations: in the middle of a decode round, where it stops every thread that
needs the interpreter (issue 48 found one in a 1-second block of 32-request rounds, which then ran at three quarters
of its speed). vLLM freezes its heap once its server has started (`vllm.utils.gc_utils.freeze_gc_heap`) and SGLang
serves `/freeze_gc`, for the same reason: frozen objects are never walked again.

A frozen object that later dies in a reference cycle stays until the heap is unfrozen, so freezing is held, not
set: each holder (an engine while it serves) calls `hold` and `release`, the last release unfreezes, and the next
full collection frees what died meanwhile (an engine that stopped must not keep its KV cache and weights alive in
a process that goes on, such as a test worker or a trainer that restarts its engine). Freezing itself is cheap
(the collector's lists are spliced, nothing is walked), so a holder freezes again whenever warm-up has created
more long-lived objects (`/freeze_gc`). A train job holds a freeze for its run and freezes again after its first
step (the run option `freeze_gc`): in the README's demo run (engine and trainer in one process) the median full
collection after the first step fell from 98-116 ms to 7-16 ms (scripts/bench_gc_pauses.py, docs/benchmarks.md).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

_lock = threading.Lock()
_holders = 0


def hold(context: str) -> None:
    """Freeze every object the collector tracks now, until the matching `release` (and every other holder's)."""
    global _holders
    with _lock:
        _holders += 1
        gc.freeze()
        logger.debug("%s froze the heap: %d objects frozen, %d holders", context, gc.get_freeze_count(), _holders)


def freeze_more(context: str) -> int:
    """Freeze the objects created since the last freeze (under a hold: warm-up made them, they live as long as the
    holder). Returns how many objects are frozen now."""
    with _lock:
        if _holders == 0:
            raise RuntimeError(f"{context}: freezing the heap needs a hold (gc_heap.hold), or nothing would unfreeze it")
        gc.freeze()
        return gc.get_freeze_count()


def release(context: str) -> None:
    """Drop one hold; the last one unfreezes the heap, so what died while frozen is collected again."""
    global _holders
    with _lock:
        if _holders == 0:
            raise RuntimeError(f"{context}: gc_heap.release without a hold")
        _holders -= 1
        if _holders == 0:
            gc.unfreeze()
            logger.debug("%s unfroze the heap", context)


def holders() -> int:
    return _holders


@contextlib.contextmanager
def held(context: str) -> Iterator[None]:
    """`hold` for the block, then `release` (however the block ends)."""
    hold(context)
    try:
        yield
    finally:
        release(context)


@dataclass
class GcPauses:
    """The collector's pauses in this process while recording (`gc.callbacks`): how many, their total and the
    longest, per generation; for a benchmark's record of what stalled its rounds."""

    count: dict[int, int] = field(default_factory=dict)
    seconds: dict[int, float] = field(default_factory=dict)
    longest_s: float = 0.0
    _started: float | None = None

    def __enter__(self) -> GcPauses:
        gc.callbacks.append(self._on_gc)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        elif self._started is not None:
            pause = time.perf_counter() - self._started
            generation = int(info["generation"])
            self.count[generation] = self.count.get(generation, 0) + 1
            self.seconds[generation] = self.seconds.get(generation, 0.0) + pause
            self.longest_s = max(self.longest_s, pause)
            self._started = None

    @property
    def total_s(self) -> float:
        return sum(self.seconds.values())
