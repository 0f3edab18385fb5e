"""JAX's persistent compilation cache across processes for the trainer's step on 8 simulated devices (issue 49).

A train step that donates its state, read back from the cache by a later XLA:CPU process, could deadlock in a
collective and abort it (SIGABRT at the 40 s rendezvous timeout; scripts/repro_compile_cache_abort.py, case
`dp-unfenced`). The product compiles that step outside the cache (`jaxrl_vlm.compile_cache.fenced_from_persistent_cache`);
everything else still comes from it. Here one process writes a fresh cache and a second one loads it and trains:
it must exit 0 with the same losses, say that the step was fenced, and find every other program in the cache.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _repro():
    spec = importlib.util.spec_from_file_location("repro_compile_cache_abort",
                                                  ROOT / "scripts" / "repro_compile_cache_abort.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
@pytest.mark.ci_step
def test_cached_programs_of_the_8_device_train_step_load_and_run_in_a_second_process(tmp_path):
    from jaxrl_vlm.tiny import make_tiny

    repro = _repro()
    model_dir = make_tiny(tmp_path / "model", seed=3, arch="qwen3_vl")
    # XLA's default optimisation level and collective timeouts, where the abort showed (the suite's level 0 and
    # 900 s timeouts would turn it into a 15-minute hang).
    opts = dict(repro.CASES["dp-fenced"], steps=2)
    cache = tmp_path / "cache"
    runs = {}
    for phase in ("write", "load"):
        rc, result, stderr = repro.run_once(opts, cache, model_dir, tmp_path / "out", timeout=300)
        assert rc == 0, (phase, rc, stderr)
        runs[phase] = (result, stderr, sorted(p.name for p in cache.iterdir()))
    (wrote, err_w, entries_w), (loaded, err_l, entries_l) = runs["write"], runs["load"]
    assert loaded["devices"] == 8
    assert loaded["losses"] == wrote["losses"]  # the same programs on the same inputs: bit for bit
    for err in (err_w, err_l):
        assert "compiled outside JAX's persistent compilation cache" in err
    # The step never enters the cache; every other program the second process ran came back from it.
    assert not [name for name in entries_w if name.startswith("jit_train_step")]
    assert any(name.startswith("jit_compute_logprobs") for name in entries_w)
    assert entries_l == entries_w
