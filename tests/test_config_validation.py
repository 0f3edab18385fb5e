"""Numbers with no meaning are rejected at config time, naming the key (issue 17 row 10), and every shipped run
config saves checkpoints periodically (row 6)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from jaxrl_vlm.config import ConfigError, load_config
from jaxrl_vlm.job.checkpointing import UNSAVED_STEPS_WARNING, CheckpointCadence

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--lr", "nan"], r"optim\.lr \(--lr\) must be a finite number"),
        (["--lr", "inf"], r"optim\.lr \(--lr\) must be a finite number"),
        (["--lr", "-1"], r"optim\.lr \(--lr\) must be >= 0, got -1"),
        (["--rollout-temperature", "nan"], r"rollout\.rollout_temperature \(--rollout-temperature\) must be a finite"),
        (["--episode-timeout", "-5"], r"rollout\.episode_timeout \(--episode-timeout\) must be > 0, got -5"),
        (["--env-step-timeout", "0"], r"multiturn\.env_step_timeout \(--env-step-timeout\) must be > 0"),
        (["--env-hook-timeout", "-1"], r"multiturn\.env_hook_timeout \(--env-hook-timeout\) must be > 0"),
        (["--engine-request-timeout", "-inf"], r"engine\.engine_request_timeout \(--engine-request-timeout\) must be a finite"),
        (["--adam-beta2", "1.0"], r"optim\.adam_beta2 \(--adam-beta2\) must be < 1, got 1\.0"),
        (["--kl-coef", "-0.1"], r"algo\.kl_coef \(--kl-coef\) must be >= 0"),
        (["--weight-decay", "-0.01"], r"optim\.weight_decay \(--weight-decay\) must be >= 0"),
        (["--max-tokens-per-device", "0"], r"batching\.max_tokens_per_device \(--max-tokens-per-device\) must be > 0"),
        (["--save-interval", "-1"], r"checkpoint\.save_interval \(--save-interval\) must be >= 0"),
        (["--num-rollout", "0"], r"rollout\.num_rollout \(--num-rollout\) must be >= 1, got 0"),
        (["--rollout-top-p", "1.5"], r"rollout\.rollout_top_p \(--rollout-top-p\) must be <= 1, got 1\.5"),
        (["--max-env-retries-per-turn", "-1"], r"multiturn\.max_env_retries_per_turn \(--max-env-retries-per-turn\) must be >= 0"),
        # Bounds declared by the loss options (rl/options.py) and the engine options (engine/options.py).
        (["--eps-clip-c", "1.0"], r"algo\.eps_clip_c \(--eps-clip-c\) must be > 1, got 1\.0"),
        (["--tis-clip", "0"], r"algo\.rollout_correction_high \(--rollout-correction-high\) must be > 0"),
        (["--rollout-correction-low", "-0.1"], r"algo\.rollout_correction_low \(--rollout-correction-low\) must be >= 0"),
        (["--engine-max-batch", "0"], r"engine\.engine_max_batch \(--engine-max-batch\) must be >= 1, got 0"),
        (["--tp-size", "0"], r"engine\.tp_size \(--tp-size\) must be >= 1, got 0"),
        (["--engine-control-timeout", "0"], r"engine\.engine_control_timeout \(--engine-control-timeout\) must be > 0"),
    ],
)
def test_meaningless_numbers_are_rejected_naming_the_key(argv, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, argv)


def test_shipped_run_configs_are_valid_and_save_periodically():
    for name in ("geo3k_tiny.yaml", "geo3k_qwen3vl_2b.yaml", "geo3k_qwen3vl_2b_long.yaml", "geo3k_qwen25vl_3b.yaml"):
        cfg = load_config(str(ROOT / "configs" / name), [])
        assert cfg.checkpoint.save_interval > 0, name
        assert cfg.checkpoint.save_interval < cfg.rollout.num_rollout or cfg.rollout.num_rollout <= 10, name


def test_a_long_run_without_periodic_saves_is_warned_about(tmp_path, caplog):
    long = load_config(None, ["--num-rollout", str(UNSAVED_STEPS_WARNING + 1), "--save-interval", "0"])
    with caplog.at_level(logging.WARNING, logger="jaxrl_vlm.job.checkpointing"):
        CheckpointCadence(long, tmp_path / "a").close()
    assert "saves a checkpoint only at its end" in caplog.text
    caplog.clear()
    short = load_config(None, ["--num-rollout", "5", "--save-interval", "0"])
    with caplog.at_level(logging.WARNING, logger="jaxrl_vlm.job.checkpointing"):
        CheckpointCadence(short, tmp_path / "b").close()
    assert caplog.text == ""
