"""The collector's heap frozen while an engine serves (`jaxrl_vlm.gc_heap`, the engine's `freeze_gc` option and
SGLang's `/freeze_gc`), and given back when it stops, so a stopped engine is collected; a train job's heap frozen
for its run and again after its first step (the run option `freeze_gc`), an RL job's and an SFT job's alike."""

from __future__ import annotations

import asyncio
import gc
import weakref
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from jaxrl_vlm import gc_heap
from jaxrl_vlm.config import load_config
from jaxrl_vlm.engine import EmbeddedEngine, EngineOptions
from jaxrl_vlm.job.run import MainJob
from jaxrl_vlm.job.sft import SFTJob
from rollout.sglang_wire import FREEZE_GC_OK

CONFIG = dict(max_batch=2, max_seq_len=64, min_prefill_bucket=32, min_kv_bucket=64)


@pytest.fixture(autouse=True)
def _unfrozen():
    assert gc_heap.holders() == 0 and gc.get_freeze_count() == 0, "a test before this one left the heap frozen"
    yield
    left = gc_heap.holders()
    while gc_heap.holders():  # a test that failed holding: the next tests start unfrozen all the same
        gc_heap.release("a test's leftover hold")
    assert left == 0 and gc.get_freeze_count() == 0


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
    # One holder is left: still frozen, so the dead cycle survives a collection. (Not the freeze count itself:
    # refcounting still frees frozen objects, which lowers it; a full suite once saw it drop by 5 here.)
    gc.collect()
    assert alive() is not None and gc.get_freeze_count() > 0, "one holder is left: still frozen"
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


class _StepLoop:
    """MainJob's run and step loop (`_run`, `steps`) over steps that each keep 5,000 new tracked objects alive, as a
    first step keeps its compiled programs; records (holders, frozen objects) as each step starts."""

    def __init__(self, freeze_gc: bool, steps: int = 3):
        self.cfg = SimpleNamespace(train=SimpleNamespace(freeze_gc=freeze_gc), rollout=SimpleNamespace(num_rollout=steps))
        self.start_step, self.stopping, self.kept, self.seen = 0, False, [], []

    def record(self) -> dict:
        self.seen.append((gc_heap.holders(), gc.get_freeze_count()))
        self.kept.append([[i] for i in range(5000)])
        return {}

    async def evaluate_unless_preempted(self, step: int) -> None:
        pass

    def stop_requested(self) -> bool:
        return False

    async def step(self, step: int) -> dict:
        return self.record()

    async def _run_held(self) -> dict:
        return await MainJob.steps(self)

    def run(self) -> None:
        asyncio.run(MainJob._run(self))


class _SftStepLoop(_StepLoop):
    """The same over SFTJob's run and step loop (`run`, `steps`)."""

    def evaluate(self, step: int) -> None:
        pass

    def step(self, step: int) -> dict:
        return self.record()

    def _run_held(self) -> dict:
        return SFTJob.steps(self)

    def run(self) -> None:
        SFTJob.run(self)


@pytest.mark.parametrize("loop", [_StepLoop, _SftStepLoop], ids=["rl", "sft"])
def test_a_train_job_holds_a_freeze_for_its_run_and_freezes_again_after_its_first_step_only(loop):
    job = loop(freeze_gc=True)
    job.run()
    (h0, f0), (h1, f1), (h2, f2) = job.seen
    assert h0 == h1 == h2 == 1 and f0 > 0
    assert f1 >= f0 + 5000  # the first step's objects were frozen after it
    assert f2 < f1 + 5000  # the second step's were not
    # (the fixture: released, unfrozen, after the run)


@pytest.mark.parametrize("loop", [_StepLoop, _SftStepLoop], ids=["rl", "sft"])
def test_with_freeze_gc_off_a_train_job_leaves_the_heap_alone(loop):
    job = loop(freeze_gc=False)
    job.run()
    assert job.seen == [(0, 0)] * 3


def test_freeze_gc_is_a_run_option_on_by_default():
    assert load_config(None, []).train.freeze_gc is True
    assert load_config(None, ["--freeze-gc", "false"]).train.freeze_gc is False
