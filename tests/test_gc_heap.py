"""The collector's heap frozen while an engine serves (`jaxrl_vlm.gc_heap`, the engine's `freeze_gc` option and
SGLang's `/freeze_gc`), and given back when it stops, so a stopped engine is collected."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import httpx
import pytest

from jaxrl_vlm import gc_heap
from jaxrl_vlm.engine import EmbeddedEngine, EngineOptions
from rollout.sglang_wire import FREEZE_GC_OK

CONFIG = dict(max_batch=2, max_seq_len=64, min_prefill_bucket=32, min_kv_bucket=64)


@pytest.fixture(autouse=True)
def _unfrozen():
    assert gc_heap.holders() == 0 and gc.get_freeze_count() == 0, "a test before this one left the heap frozen"
    yield
    assert gc_heap.holders() == 0 and gc.get_freeze_count() == 0


class _Cycle:
    def __init__(self) -> None:
        self.me = self


def test_holds_nest_and_the_last_release_lets_the_collector_free_what_died_while_frozen():
    cycle = _Cycle()
    alive = weakref.ref(cycle)
    gc_heap.hold("a")
    gc_heap.hold("b")
    frozen = gc.get_freeze_count()
    assert frozen > 0
    del cycle
    gc.collect()
    assert alive() is not None, "a frozen cycle is not collected"
    gc_heap.release("b")
    assert gc.get_freeze_count() == frozen, "one holder is left: still frozen"
    late = [_Cycle()]
    assert gc_heap.freeze_more("a") > frozen
    gc_heap.release("a")
    assert gc.get_freeze_count() == 0
    del late
    gc.collect()
    assert alive() is None


def test_freezing_without_a_hold_and_releasing_twice_are_refused():
    with pytest.raises(RuntimeError, match="needs a hold"):
        gc_heap.freeze_more("x")
    with pytest.raises(RuntimeError, match="without a hold"):
        gc_heap.release("x")


def test_gc_pauses_counts_a_full_collection():
    with gc_heap.GcPauses() as pauses:
        gc.collect()
    assert pauses.count.get(2, 0) >= 1 and pauses.total_s >= pauses.longest_s > 0.0
    assert pauses._on_gc not in gc.callbacks


def test_the_engine_freezes_while_it_serves_and_is_collected_once_stopped(tiny_hf_checkpoint: Path):
    engine = EmbeddedEngine(str(tiny_hf_checkpoint), config=EngineOptions(**CONFIG))
    engine.start()
    try:
        assert gc_heap.holders() == 1 and gc.get_freeze_count() > 100_000  # jax, transformers and the model
        reply = httpx.post(engine.url + "/freeze_gc")
        assert (reply.status_code, reply.text) == (200, FREEZE_GC_OK)
        assert gc_heap.holders() == 1, "/freeze_gc under the engine's own hold takes no second one"
        core = weakref.ref(engine.engine)
    finally:
        engine.stop()
    assert gc_heap.holders() == 0 and gc.get_freeze_count() == 0
    engine.engine = None
    gc.collect()
    assert core() is None, "a stopped engine's model and KV cache must not outlive it"


def test_with_the_option_off_only_freeze_gc_freezes_until_stop(tiny_hf_checkpoint: Path):
    with EmbeddedEngine(str(tiny_hf_checkpoint), config=EngineOptions(**CONFIG, freeze_gc=False)) as engine:
        assert gc.get_freeze_count() == 0
        assert httpx.get(engine.url + "/freeze_gc").status_code == 200
        assert gc_heap.holders() == 1 and gc.get_freeze_count() > 0
