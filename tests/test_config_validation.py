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
        (["--lr", "nan"], r"optim\.lr must be a finite number"),
        (["--lr", "inf"], r"optim\.lr must be a finite number"),
        (["--lr", "-1"], r"optim\.lr must be >= 0"),
        (["--rollout-temperature", "nan"], r"rollout\.rollout_temperature must be a finite number"),
        (["--episode-timeout", "-5"], r"rollout\.episode_timeout must be > 0"),
        (["--env-step-timeout", "0"], r"multiturn\.env_step_timeout must be > 0"),
        (["--env-hook-timeout", "-1"], r"multiturn\.env_hook_timeout must be > 0"),
        (["--engine-request-timeout", "-inf"], r"engine\.engine_request_timeout must be a finite number"),
        (["--adam-beta2", "1.0"], r"optim\.adam_beta2 must be in \[0, 1\)"),
        (["--kl-coef", "-0.1"], r"algo\.kl_coef must be >= 0"),
        (["--weight-decay", "-0.01"], r"optim\.weight_decay must be >= 0"),
        (["--max-tokens-per-device", "0"], r"batching\.max_tokens_per_device must be > 0"),
        (["--save-interval", "-1"], r"checkpoint\.save_interval must be >= 0"),
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
