"""Saved rollouts in the main job: `--save-debug-rollout-data` writes each step's rollout result, and
`--load-debug-rollout-data` hands step k's saved result to the trainer in place of a rollout (no engine).

The file format is `rollout/rollout_data.py`'s. This module adds what only the job knows: the run's settings
recorded beside the samples, and the checks that the run reading them can train on them as they were made.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from jaxrl_vlm.config import Config, ConfigError
from rollout.driver import RolloutResult
from rollout.rollout_data import RolloutDataError, read_rollout_data, step_path, write_rollout_data

logger = logging.getLogger(__name__)


def recorded_settings(cfg: Config, weight_version: int) -> dict[str, Any]:
    """What the saving run notes beside each step's samples: the settings that decided how they were sampled and
    scored (checked or reported when they are replayed), and the weight version the engine held."""
    r = cfg.rollout
    return {
        "hf_checkpoint": cfg.model.hf_checkpoint,
        "rollout_temperature": r.rollout_temperature,
        "rollout_top_p": r.rollout_top_p,
        "rollout_top_k": r.rollout_top_k,
        "rollout_batch_size": r.rollout_batch_size,
        "n_samples_per_prompt": r.n_samples_per_prompt,
        "rollout_max_response_len": r.rollout_max_response_len,
        "rollout_seed": r.rollout_seed,
        "seed": cfg.train.seed,
        "weight_version": int(weight_version),
    }


class RolloutSaver:
    """`--save-debug-rollout-data`: each training step's rollout result, to its own file."""

    def __init__(self, cfg: Config):
        assert cfg.debug.save_debug_rollout_data is not None
        self.cfg = cfg
        self.template = cfg.debug.save_debug_rollout_data

    def save(self, step: int, result: RolloutResult, *, weight_version: int) -> Path:
        path = write_rollout_data(step_path(self.template, step), step, result,
                                  settings=recorded_settings(self.cfg, weight_version))
        logger.info("step %d: rollout saved to %s", step, path)
        return path


class RolloutReplay:
    """`--load-debug-rollout-data`: step k's saved rollout result, checked against this run's settings."""

    def __init__(self, cfg: Config):
        assert cfg.debug.load_debug_rollout_data is not None
        self.cfg = cfg
        self.template = cfg.debug.load_debug_rollout_data
        self._warned_model = False

    def check_available(self, start: int, stop: int) -> None:
        """Every step in [start, stop) has its file, before any training (a replay that would stop half-way
        fails now, naming the first missing step and what there is)."""
        missing = [k for k in range(start, stop) if not step_path(self.template, k).is_file()]
        if missing:
            have = [k for k in range(0, stop) if step_path(self.template, k).is_file()]
            raise ConfigError(
                f"--load-debug-rollout-data {self.template}: no saved rollout for step {missing[0]} "
                f"({step_path(self.template, missing[0])}); {len(missing)} of steps {start}..{stop - 1} are missing, "
                f"saved steps found: {_ranges(have) or 'none'} (lower --num-rollout, or save more steps)")

    def load(self, step: int) -> RolloutResult:
        path = step_path(self.template, step)
        try:
            saved = read_rollout_data(path, rollout_id=step)
        except RolloutDataError as e:
            raise ConfigError(f"--load-debug-rollout-data: {e}") from e
        self.check_settings(saved.settings, path)
        return saved.result

    def check_settings(self, settings: dict[str, Any], path: Path) -> None:
        """The trainer scores samples at the rollout temperature (the distribution that sampled them): another
        temperature would compare different policies in every ratio and TIS weight, so it is an error. Another
        model is allowed (e.g. a different start), said once."""
        saved_t = settings.get("rollout_temperature")
        if saved_t is not None and float(saved_t) != self.cfg.rollout.rollout_temperature:
            raise ConfigError(
                f"--load-debug-rollout-data {path}: sampled at --rollout-temperature {saved_t}, this run has "
                f"{self.cfg.rollout.rollout_temperature}; the trainer scores the samples at the temperature that "
                "sampled them, set the same")
        saved_model = settings.get("hf_checkpoint")
        if not self._warned_model and saved_model not in (None, self.cfg.model.hf_checkpoint):
            self._warned_model = True
            logger.warning("--load-debug-rollout-data: the rollouts were sampled from %s, this run trains %s",
                           saved_model, self.cfg.model.hf_checkpoint)


def _ranges(steps: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2, 5'."""
    out: list[str] = []
    for k in steps:
        if out and out[-1].split("-")[-1] == str(k - 1):
            out[-1] = f"{out[-1].split('-')[0]}-{k}"
        else:
            out.append(str(k))
    return ", ".join(out)
