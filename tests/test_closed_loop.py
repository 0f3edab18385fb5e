"""Closed-loop learning on CPU: embedded engine -> rollout -> batching -> train step -> weight update -> rollout.

The toy task (`envs.letter_game`) rewards answers whose letters come from a-m. A random tiny model starts near
0.5; the reward can only rise if each update really reaches the engine, so the same run with weight sync off
must not improve. Trainer and engine log-probs of the sampled tokens must agree (fp32) at the rollout temperature
0.8: the trainer scores softmax(logits / T), the distribution the engine sampled.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from jaxrl_vlm.config import load_config
from jaxrl_vlm.job.run import train
from jaxrl_vlm.job.run_log import read_metrics

STEPS = 20
TEMPERATURE = 0.8
MARGIN = 0.15  # mean reward of the last 3 steps minus the first 3


@pytest.fixture(scope="module")
def letter_task(tmp_path_factory):
    root = tmp_path_factory.mktemp("letter_game")
    prompts = root / "prompts.jsonl"
    with prompts.open("w") as f:
        for i in range(16):
            f.write(json.dumps({"problem": f"Say something about number {i}.", "answer": "x", "images": []}) + "\n")
    return root, prompts


def _run(root, prompts, name: str, *extra: str, arch: str = "qwen3_vl") -> list[dict]:
    out = root / f"{name}_{arch}"
    cfg = load_config(None, [
        "--hf-checkpoint", str(root / f"tiny_{arch}"), "--make-tiny", "--make-tiny-arch", arch,
        "--prompt-data", str(prompts), "--prompt-style", "plain", "--system-prompt", "Answer briefly.",
        "--rollout-interaction-env-path", "envs.letter_game", "--max-turns", "1",
        "--num-rollout", str(STEPS), "--rollout-batch-size", "4", "--n-samples-per-prompt", "8",
        "--rollout-max-response-len", "12", "--lr", "5e-3", "--weight-decay", "0",
        "--seq-buckets", "64,128", "--row-buckets", "8,16,32", "--patch-buckets", "0",
        "--engine-max-batch", "32", "--engine-max-seq-len", "512", "--logprob-chunk-size", "64",
        "--output-dir", str(out), "--seed", "1234", "--rollout-seed", "7", "--rollout-temperature", str(TEMPERATURE),
        *extra,
    ])
    train(cfg)
    return read_metrics(out / "metrics.jsonl")


def _reward_gain(records: list[dict]) -> float:
    rewards = [r["rollout/raw_reward"] for r in records]
    assert len(rewards) == STEPS
    return float(np.mean(rewards[-3:]) - np.mean(rewards[:3]))


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen3_vl", "qwen2_5_vl"])
def test_reward_rises_only_when_weights_reach_the_engine(letter_task, arch):
    root, prompts = letter_task
    synced = _run(root, prompts, "synced", arch=arch)
    assert json.loads((root / f"tiny_{arch}" / "config.json").read_text())["model_type"] == arch
    gain = _reward_gain(synced)
    assert gain >= MARGIN, f"reward rose by only {gain:.3f} in {STEPS} steps: {[round(r['rollout/raw_reward'], 3) for r in synced]}"
    # Every step went through /update_weights_from_disk (in memory: the engine is in-process): the engine's
    # version follows the trainer's.
    assert [r["weight_version"] for r in synced] == list(range(1, STEPS + 1))
    # Trainer and engine agree on the log-probs of the sampled tokens at every step (fp32, temperature 0.8).
    diffs = [r["train/train_rollout_logprob_abs_diff"] for r in synced]
    assert max(diffs) < 1e-4, diffs

    stale = _run(root, prompts, "no_sync", "--disable-weight-sync", arch=arch)
    stale_gain = _reward_gain(stale)
    assert stale_gain < MARGIN / 2, f"reward rose by {stale_gain:.3f} without weight sync"
    # With stale engine weights the trainer's log-probs drift away from the engine's: the metric sees it.
    assert max(r["train/train_rollout_logprob_abs_diff"] for r in stale[3:]) > 1e-3


@pytest.mark.slow
def test_reward_rises_by_the_same_margin_with_bounded_staleness(letter_task):
    """--max-staleness 1 (asynchronous: the next batch generates while one trains, with TIS as recommended)
    learns the task by the synchronous test's margin, and no sample trains more than one version behind."""
    root, prompts = letter_task
    records = _run(root, prompts, "async_k1", "--max-staleness", "1", "--use-tis")
    gain = _reward_gain(records)
    assert gain >= MARGIN, f"reward rose by only {gain:.3f} in {STEPS} steps: {[round(r['rollout/raw_reward'], 3) for r in records]}"
    assert [r["weight_version"] for r in records] == list(range(1, STEPS + 1))
    for r in records:  # every trained sample is at staleness 0 or 1
        assert r["async/staleness_0"] + r["async/staleness_1"] == r["rollout/samples"]
    assert sum(r["async/staleness_1"] for r in records) > 0  # generation did overlap training
