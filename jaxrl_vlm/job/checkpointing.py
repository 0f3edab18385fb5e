"""Checkpoint cadence of the main job: what a checkpoint holds beside the train state, when one is written,
and how a run resumes from one."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jaxrl_vlm.checkpoint import CheckpointStore, abstract_like
from jaxrl_vlm.config import Config

logger = logging.getLogger(__name__)

# A run longer than this with --save-interval 0 is warned about: it has nothing to resume from until its end.
UNSAVED_STEPS_WARNING = 20


@dataclass
class ResumePoint:
    """Where an interrupted run continues: its train state and the run state saved beside it."""

    step: int
    state: Any
    weight_version: int
    prompt_iterator: dict[str, Any]
    driver_state: dict[str, Any] | None
    next_group_index: int | None  # only checkpoints older than the driver state's version 2 keep it beside


def restore(cfg: Config, like_state: Any) -> ResumePoint | None:
    """The checkpoint named by `--load` (latest complete step), or None for a fresh run."""
    if not cfg.checkpoint.load:
        return None
    store = CheckpointStore(cfg.checkpoint.load, keep=cfg.checkpoint.keep_checkpoints, read_only=True)
    try:
        step, state, meta = store.restore(abstract_like(like_state))
    finally:
        store.close()
    point = ResumePoint(step=step, state=state, weight_version=int(meta["weight_version"]),
                        prompt_iterator=meta["prompt_iterator"], driver_state=meta.get("driver_state"),
                        next_group_index=meta.get("next_group_index"))
    logger.info("resumed from %s at step %d (weight version %d)", cfg.checkpoint.load, step, point.weight_version)
    return point


class CheckpointCadence:
    """Writes a checkpoint every `--save-interval` steps and at the last step (orbax, atomic, `keep` newest)."""

    def __init__(self, cfg: Config, out_dir: Path):
        self.cfg = cfg
        self.store = CheckpointStore(cfg.checkpoint.save or out_dir / "checkpoints", keep=cfg.checkpoint.keep_checkpoints)
        steps = cfg.rollout.num_rollout
        if cfg.checkpoint.save_interval == 0 and steps > UNSAVED_STEPS_WARNING:
            logger.warning("--save-interval 0: this %d-step run saves a checkpoint only at its end; a crash loses "
                           "everything (set --save-interval)", steps)

    def due(self, done: int) -> bool:
        interval = self.cfg.checkpoint.save_interval
        return done == self.cfg.rollout.num_rollout or bool(interval and done % interval == 0)

    def save(self, done: int, state: Any, *, weight_version: int, prompt_iterator: dict[str, Any],
             driver_state: dict[str, Any] | None) -> None:
        self.store.save(done, state, {
            "prompt_iterator": prompt_iterator, "weight_version": weight_version, "config": self.cfg.to_dict(),
            "driver_state": driver_state,
        })

    def close(self) -> None:
        self.store.close()
