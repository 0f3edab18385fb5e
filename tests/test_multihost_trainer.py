"""The whole main job (`python -m jaxrl_vlm.cli train configs/geo3k_tiny.yaml`) as a 2-process x 4-device
CPU cluster (gloo over loopback) runs to the end and equals the same job run in one process on 8 devices.

What this covers beyond `test_multihost.py` (one train step): the real `Trainer.run` loop with the rollout
on process 0's embedded engine, `broadcast_samples` every step, the weight sync to that engine after every
update (a collective export, process 0 talks to the engine), orbax checkpoints written by both processes,
the final collective HF export, and logging by process 0 only.

The two runs (2 processes and the 1-process reference) start together and share the 2 cores; the test
process then restores both checkpoints on its own 8 devices (conftest) to compare the trained weights.
"""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest

from _launch import Launched, killed_on_exit, launch_job, single_process_env, start, wait_all
from _multihost_worker import flat_params
from jaxrl_vlm.job.run_log import read_metrics

CONFIG = "configs/geo3k_tiny.yaml"
NUM_PROCESSES, LOCAL_DEVICES = 2, 4
NUM_ROLLOUT = 2
TIMEOUT_S = 900  # both runs together: measured ~3 min on 2 cores shared with other work
PROGRESS = "] step "  # the progress line RunLog prints for every logged step

# CI's own step for long tests (.ci/run), not the README's test command: see pyproject.toml.
pytestmark = [pytest.mark.slow, pytest.mark.ci_step]


def _overrides(model_dir: Path, data_path: Path, out_dir: Path) -> list[str]:
    return [
        "--hf-checkpoint", str(model_dir), "--prompt-data", str(data_path), "--output-dir", str(out_dir),
        "--num-rollout", str(NUM_ROLLOUT), "--rollout-max-response-len", "64", "--save-interval", "1",
        "--mesh-config", "configs/mesh/fsdp.yaml",  # 8 devices: one FSDP axis across both processes
        # A random tiny model earns reward 0 on every sample, so every GRPO advantage is 0; the entropy bonus
        # gives each step a real gradient, and lr 1e-3 moves the weights far beyond the tolerances below.
        "--entropy-coef", "0.01", "--lr", "1e-3",
        # As in _multihost_worker.train_config: keeps Adam's first update a smooth function of tiny gradients,
        # whose value otherwise depends on the all-reduce order (gloo across processes vs in-process).
        "--adam-eps", "1e-4",
    ]


def _train_argv(model_dir: Path, data_path: Path, out_dir: Path) -> list[str]:
    return [sys.executable, "-m", "jaxrl_vlm.cli", "train", CONFIG, *_overrides(model_dir, data_path, out_dir)]


def _config(model_dir: Path, data_path: Path, out_dir: Path, *extra: str) -> Any:
    from jaxrl_vlm.config import load_config

    return load_config(CONFIG, [*_overrides(model_dir, data_path, out_dir), *extra])


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Builds the tiny model and dataset once (as the config's make_tiny / make_data would), then runs the job
    as 2 processes x 4 devices and as 1 process x 8 devices, concurrently."""
    from jaxrl_vlm.job.assets import prepare_assets

    tmp = tmp_path_factory.mktemp("multihost_trainer")
    model_dir, data_path = prepare_assets(_config(tmp / "tiny", tmp / "geo3k.parquet", tmp / "unused", "--synthetic-rows", "8"))
    multi, single = tmp / "multi", tmp / "single"
    t0 = time.monotonic()
    with killed_on_exit(launch_job(_train_argv(model_dir, data_path, multi), tmp, num_processes=NUM_PROCESSES,
                                   local_devices=LOCAL_DEVICES, name="process")) as procs:
        procs.append(start("single-process reference", _train_argv(model_dir, data_path, single),
                           single_process_env(NUM_PROCESSES * LOCAL_DEVICES), tmp / "single.log"))
        wait_all(procs, t0 + TIMEOUT_S)
    return {"model_dir": model_dir, "data_path": data_path, "multi": multi, "single": single, "procs": procs}


def _logs(procs: list[Launched]) -> dict[str, str]:
    return {p.name: p.log.read_text(errors="replace") for p in procs}


def test_both_processes_finish_and_only_process_0_logs(runs):
    logs = _logs(runs["procs"])
    for name, text in logs.items():
        assert "run finished" in text, name
    rollout_cfg = _config(runs["model_dir"], runs["data_path"], runs["multi"]).rollout
    records = read_metrics(runs["multi"] / "metrics.jsonl")
    # Exactly one record per step: process 1 (same output dir) appended nothing.
    assert [r["step"] for r in records] == list(range(NUM_ROLLOUT))
    assert [r["weight_version"] for r in records] == [1.0, 2.0]
    for r in records:
        assert r["rollout/samples"] == rollout_cfg.rollout_batch_size * rollout_cfg.n_samples_per_prompt
        assert r["train/optimizer_steps"] == 1.0
        assert math.isfinite(r["train/loss_total"]) and math.isfinite(r["train/grad_norm"]) and r["train/grad_norm"] > 0
        assert r["train/skipped_nonfinite"] == 0.0
    assert logs["process 0"].count(PROGRESS) == NUM_ROLLOUT
    assert PROGRESS not in logs["process 1"]  # process 1 has no RunLog
    plots = sorted(p.name for p in (runs["multi"] / "plots").glob("*.png"))
    assert plots and plots == sorted(p.name for p in (runs["single"] / "plots").glob("*.png"))


def test_engine_samples_with_the_weights_each_sync_pushed(runs):
    """The rollout log-probs of step 2 are the trained policy's: the engine on process 0 loaded version 1.

    train/train_rollout_logprob_abs_diff compares the trainer's log-probs of the sampled tokens (current
    weights) with the engine's. Measured on this job: ~5e-7 with the sync, 0.046 at step 2 with
    --disable-weight-sync (the engine still on the initial weights).
    """
    for r in read_metrics(runs["multi"] / "metrics.jsonl"):
        assert r["train/train_rollout_logprob_abs_diff"] < 1e-5, r["step"]
        assert r["sync/export_s"] > 0
    # Old versions are deleted only after the engine acknowledged the next one; the last one stays.
    assert [p.name for p in (runs["multi"] / "weights").iterdir()] == ["weights_v000002"]


def test_rollouts_and_updates_equal_the_single_process_run(runs):
    multi = read_metrics(runs["multi"] / "metrics.jsonl")
    single = read_metrics(runs["single"] / "metrics.jsonl")
    assert len(multi) == len(single) == NUM_ROLLOUT
    for m, s in zip(multi, single):
        rollout_keys = sorted(k for k in s if k.startswith("rollout/") and "/latency/" not in k)
        assert sorted(k for k in m if k.startswith("rollout/") and "/latency/" not in k) == rollout_keys
        # The same episodes: process 0's engine sampled what the single process's engine sampled.
        assert {k: m[k] for k in rollout_keys} == {k: s[k] for k in rollout_keys}, m["step"]
        for key in ("train/loss_total", "train/grad_norm", "train/entropy_loss", "train/pg_loss"):
            assert m[key] == pytest.approx(s[key], rel=1e-4, abs=1e-7), (m["step"], key)
        assert m["batch/real_tokens"] == s["batch/real_tokens"]


def _restore(runs: dict[str, Any], which: str, state_like: Any) -> tuple[int, dict[str, np.ndarray], dict[str, Any], Any]:
    from jaxrl_vlm.checkpoint import CheckpointStore, abstract_like

    store = CheckpointStore(runs[which] / "checkpoints", read_only=True)
    try:
        assert store.steps() == [1, 2]  # --save-interval 1 (keep 2)
        step, state, meta = store.restore(abstract_like(state_like))
    finally:
        store.close()
    return step, flat_params(state.params, np.asarray), meta, state


def _load_hf(path: Path) -> dict[str, np.ndarray]:
    from flax import nnx

    from jaxrl_vlm.models.hf_io import from_hf

    return flat_params(nnx.state(from_hf(str(path)), nnx.Param), np.asarray)


def test_checkpoint_and_final_model_hold_the_trained_weights(runs, tmp_path):
    """Both processes' orbax shards restore (here, on one process with 8 devices) to the single-process run's
    weights within 1e-5; final_model (bf16, written by process 0 from gathered tensors) is exactly that state."""
    from jaxrl_vlm.job.trainer import Trainer

    trainer = Trainer(_config(runs["model_dir"], runs["data_path"], tmp_path / "restore"))
    trainer.build_policy(runs["model_dir"])
    initial = flat_params(trainer.state.params, np.asarray)
    step, params, meta, state = _restore(runs, "multi", trainer.state)
    ref_step, ref_params, ref_meta, _ = _restore(runs, "single", trainer.state)
    assert step == ref_step == NUM_ROLLOUT and int(state.step) == NUM_ROLLOUT  # one optimizer step per rollout
    for key in ("weight_version", "driver_state", "prompt_iterator"):
        assert meta[key] == ref_meta[key], key
    assert meta["driver_state"]["next_group_index"] > 0
    assert meta["weight_version"] == NUM_ROLLOUT

    assert sorted(params) == sorted(ref_params) == sorted(initial)
    moved = 0.0
    for key, want in ref_params.items():
        np.testing.assert_allclose(params[key], want, rtol=0, atol=1e-5, err_msg=key)
        moved = max(moved, float(np.max(np.abs(want - initial[key]))))
    assert moved > 5e-4  # two Adam steps at lr 1e-3 moved the weights, so atol 1e-5 is a real check

    final, ref_final = _load_hf(runs["multi"] / "final_model"), _load_hf(runs["single"] / "final_model")
    assert sorted(final) == sorted(params)
    for key, value in params.items():
        np.testing.assert_array_equal(final[key], value.astype(ml_dtypes.bfloat16).astype(np.float32), err_msg=key)
        # Where the fp32 weights differ by <= 1e-5 their bf16 roundings may differ by one bf16 step.
        np.testing.assert_allclose(final[key], ref_final[key], rtol=2.0**-7, atol=1e-5, err_msg=key)
