"""A tiny model learns a visual agent task above chance (issue 32): the one-push Sokoban levels
(`envs/sokoban/synthetic.py make_push_dataset`: a 5x5 board, the box in the middle, the player on one side, the
target on the other; the moves balanced, so the picture alone says which move solves).

The tiny random Qwen3-VL is fine-tuned on the solver's transcripts (`make_push_sft_dataset`, the tiny SFT preset
configs/color_reveal_sft_tiny.yaml with these data; 64 steps of 16), then evaluated by the sokoban env through the
real rollout (configs/sokoban_tiny.yaml, one move, held-out levels of another seed, temperature 1). Reward: 1 - 0.05
for the solving move, -0.05 for another, -0.1 for a reply that names no move. Chance (a uniformly random move) is
0.25 - 0.05 = 0.20, and so is the best blind policy (the four moves are equally frequent): exact, by enumeration
over the held-out levels (`envs.sokoban.grading`). RL alone from the random model did not rise in 60 steps
(measured: eval 0.18 -> 0.17), so the warm start is the demonstration; the measured eval reward after it is 0.753.
One process: 35 s on the quiet 2-core machine, 70 s with other jobs on it.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from envs.sokoban import SokobanOptions
from envs.sokoban.grading import best_blind_reward, chance_reward
from envs.sokoban.synthetic import make_push_dataset, make_push_sft_dataset, push_level
from jaxrl_vlm.config import load_config

MARGIN = 0.15  # over chance and best blind (0.20): an accuracy of at least 40% where blind play gets 25%
EVAL_ROWS = 32


@pytest.mark.slow
def test_a_tiny_model_learns_one_push_sokoban_above_chance(tmp_path):
    from jaxrl_vlm.job.eval import evaluate_weights
    from jaxrl_vlm.job.run import train

    t0 = time.perf_counter()
    make_push_sft_dataset(str(tmp_path / "sft.parquet"), 640, seed=1)
    make_push_sft_dataset(str(tmp_path / "sft_heldout.parquet"), 16, seed=3)
    make_push_dataset(str(tmp_path / "heldout.parquet"), EVAL_ROWS, seed=2)
    tiny = str(tmp_path / "tiny_qwen3_vl")
    sft = load_config("configs/color_reveal_sft_tiny.yaml", [
        "--hf-checkpoint", tiny, "--prompt-data", str(tmp_path / "sft.parquet"), "--make-data", "false",
        "--eval-prompt-data", "heldout", str(tmp_path / "sft_heldout.parquet"), "--skip-eval-before-train", "true",
        "--num-rollout", "64", "--output-dir", str(tmp_path / "sft"), "--save-interval", "1000",
        "--seq-buckets", "128"])
    train(sft)
    cfg = load_config("configs/sokoban_tiny.yaml", [
        "--hf-checkpoint", tiny, "--eval-prompt-data", "heldout", str(tmp_path / "heldout.parquet"), "--max-turns", "1",
        "--rollout-max-response-len", "32", "--n-samples-per-eval-prompt", "2", "--engine-max-seq-len", "128",
        "--seq-buckets", "128", "--output-dir", str(tmp_path / "eval")])
    report = asyncio.run(evaluate_weights(cfg, str(tmp_path / "sft" / "final_model")))
    learned = report.metrics["eval/heldout/raw_reward"]
    wall = time.perf_counter() - t0

    levels = [push_level(i, 2)[0] for i in range(EVAL_ROWS)]
    options = SokobanOptions.from_args(cfg.to_namespace())
    chance = chance_reward(levels, 1, options)
    best_blind, _ = best_blind_reward(levels, 1, options)
    print(f"sokoban one-push: chance {chance:.3f}, best blind {best_blind:.3f}, learned {learned:.3f} ({wall:.0f} s)")
    assert chance == pytest.approx(0.20) and best_blind == pytest.approx(0.20)
    assert learned >= max(chance, best_blind) + MARGIN, (learned, chance, best_blind)
