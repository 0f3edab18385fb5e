"""The seed's long multi-turn experiment at the suite's scale (configs/geo3k_multiturn_long_tiny.yaml, as shipped:
20 turns each answered with a new picture by envs.picture_stream, a 32,000-token response budget, context
parallelism 2 on 8 simulated devices): one step runs end to end, every episode takes its 20 turns with 20
observation pictures, no sample fails from memory or length, and the step logs slime's rollout/train time split and
its peak memory. Turns are capped shorter here (`--max-tokens-per-turn`) so the rows fit one 2,048-token bucket; the
full-size run is README "Context parallelism"'s command."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from jaxrl_vlm.config import load_config
from jaxrl_vlm.job.run import train
from jaxrl_vlm.job.run_log import read_metrics

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "geo3k_multiturn_long_tiny.yaml"
TURNS = 20
SAMPLES = 2


@pytest.fixture(scope="module")
def long_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("long_multiturn")
    cfg = load_config(str(CONFIG), [
        "--hf-checkpoint", str(root / "tiny"), "--prompt-data", str(root / "geo3k.parquet"),
        "--output-dir", str(root / "out"), "--num-rollout", "1", "--n-samples-per-prompt", str(SAMPLES),
        "--max-tokens-per-turn", "8", "--seq-buckets", "2048", "--row-buckets", "4", "--patch-buckets", "0,1024",
    ])
    train(cfg)
    return cfg


def test_the_shipped_config_is_the_seeds_long_experiment():
    raw = yaml.safe_load(CONFIG.read_text())
    assert raw["multiturn"]["max_turns"] == TURNS and raw["rollout"]["rollout_max_response_len"] == 32000
    assert raw["mesh"]["mesh_context"] == 2 and raw["rollout"]["rollout_interaction_env_path"] == "envs.picture_stream"


@pytest.mark.slow
def test_twenty_turns_with_a_picture_each_train_under_context_parallelism(long_run):
    cfg = long_run
    assert cfg.mesh.mesh_context == 2 and cfg.multiturn.max_turns == TURNS
    (record,) = read_metrics(Path(cfg.train.output_dir) / "metrics.jsonl")
    assert record["rollout/samples"] == SAMPLES and record["rollout/failed_samples"] == 0
    assert record[f"rollout/turns/count_{TURNS}"] == SAMPLES and record["rollout/truncated_ratio"] == 0.0
    assert record["perf/rollout_time"] > 0 and record["perf/train_time"] > 0 and record["perf/host_peak_rss_gib"] > 0
    assert record["train/grad_norm"] > 0 and record["weight_version"] == 1
