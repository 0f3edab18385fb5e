"""The zoom and GUI configs' real episodes (issue 53, item 8): from the SFT warm start on the task's own transcripts
(configs/<task>_sft_tiny.yaml as shipped), one rollout step of the shipped RL config (configs/<task>_tiny.yaml: the
embedded engine sampling at temperature 1, `max_tokens_per_turn` on) gives multi-turn episodes whose observations
hold the picture the model's own action brought: the crop its `zoom` call named, the screenshot after its click.
No scripted engine: every action is the model's sampled text, read by the env.

From the random tiny model the zoom config gave 27 one-turn episodes of 32 and no picture in any observation. Measured
from the shipped warm starts on the busy 2-core machine (docs/benchmarks.md): 10 of 32 zoom episodes made a valid
zoom call and got the crop; the bound here is 3 of 32. CI's long-test step: the two SFT runs are 160 steps each.
"""

from __future__ import annotations

import asyncio
import importlib

import pytest

from jaxrl_vlm.config import load_config

MIN_EPISODES_WITH_PICTURES = 3  # of the shipped step's 4 prompts x 8 samples


def _brought_a_picture(task: str, turn: dict) -> bool:
    """Whether the episode's first model turn was a valid action answered with the picture it asked for."""
    if not turn["images"]:
        return False
    if task == "zoom":  # the crop of the region the model's own call named, in a tool message
        return '"name": "zoom"' in turn["model_text"] and "Region [" in turn["observation_text"]
    return "Clicked (" in turn["observation_text"]  # the screenshot after the model's own click


@pytest.mark.ci_step
@pytest.mark.parametrize("task", ["zoom", "gui"])
def test_the_shipped_config_from_its_warm_start_makes_multi_turn_episodes_with_pictures(task, tmp_path):
    from jaxrl_vlm.job.run import run_one_rollout, train
    from rollout.dump import validate_dump

    synthetic = importlib.import_module(f"envs.{task}.synthetic")
    synthetic.make_sft_dataset(str(tmp_path / "sft_heldout.parquet"), 4, seed=7)
    sft = load_config(f"configs/{task}_sft_tiny.yaml", [
        "--hf-checkpoint", str(tmp_path / "tiny_qwen3_vl"), "--prompt-data", str(tmp_path / "sft.parquet"),
        "--eval-prompt-data", "heldout", str(tmp_path / "sft_heldout.parquet"), "--skip-eval-before-train", "true",
        "--eval-interval", "1000", "--save-interval", "1000", "--output-dir", str(tmp_path / "sft")])
    train(sft)

    dump = tmp_path / "rollout.jsonl"
    cfg = load_config(f"configs/{task}_tiny.yaml", [
        "--hf-checkpoint", str(tmp_path / "sft" / "final_model"), "--prompt-data", str(tmp_path / "prompts.parquet"),
        "--eval-prompt-data", "heldout", str(tmp_path / "heldout.parquet"), "--output-dir", str(tmp_path / "rl")])
    assert cfg.multiturn.max_tokens_per_turn is not None and cfg.rollout.rollout_temperature == 1.0
    result = asyncio.run(run_one_rollout(cfg, str(dump)))
    records = validate_dump(dump)
    assert len(records) == cfg.rollout.rollout_batch_size * cfg.rollout.n_samples_per_prompt and not result.failed

    with_pictures = [r for r in records if len(r["turns"]) > 1 and _brought_a_picture(task, r["turns"][0])]
    print(f"{task}: {len(with_pictures)} of {len(records)} episodes multi-turn with the picture their first action "
          f"brought; turns {[len(r['turns']) for r in records]}")
    assert len(with_pictures) >= MIN_EPISODES_WITH_PICTURES, [r["turns"][0]["model_text"] for r in records]
    for rec in with_pictures:
        assert all((dump.parent / image["file"]).is_file() for image in rec["turns"][0]["images"])
