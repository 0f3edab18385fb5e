"""The main job stops a run whose every episode FAILS for --max-all-failed-steps consecutive steps, naming the
top causes, instead of training on nothing forever."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from jaxrl_vlm.config import load_config
from jaxrl_vlm.job.run import train
from jaxrl_vlm.job.run_log import read_metrics
from rollout.failures import AllFailedStepsError

ENV = str(Path(__file__).with_name("_raising_env.py"))


@pytest.mark.slow
def test_a_run_where_every_episode_fails_stops_with_the_causes(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"problem": f"Q{i}", "answer": "x", "images": []}) + "\n" for i in range(8)))
    cfg = load_config(None, [
        "--hf-checkpoint", str(tmp_path / "tiny"), "--make-tiny", "--prompt-data", str(prompts), "--prompt-style", "plain",
        "--rollout-interaction-env-path", ENV, "--max-turns", "2", "--max-env-retries-per-turn", "0",
        "--num-rollout", "6", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--rollout-max-response-len", "8",
        "--seq-buckets", "64,128", "--row-buckets", "4,8", "--patch-buckets", "0", "--engine-max-batch", "8",
        "--engine-max-seq-len", "256", "--max-all-failed-steps", "2", "--output-dir", str(tmp_path / "run"),
    ])
    with pytest.raises(AllFailedStepsError, match=r"2 consecutive steps.*simulator crashed|2 consecutive steps.*env"):
        train(cfg)
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert len(records) == 1, "the first all-FAILED step is logged, the second stops the run"
    assert records[0]["rollout/failed_share"] == 1.0 and records[0]["weight_version"] == 0
