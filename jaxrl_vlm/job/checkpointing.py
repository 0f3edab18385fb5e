"""Checkpoint cadence of the main job: what a checkpoint holds beside the train state, when one is written,
and how a run resumes from one."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jaxrl_vlm.checkpoint import CheckpointError, CheckpointStore, abstract_like
from jaxrl_vlm.config import SFT_LOSS, Config, is_sft

logger = logging.getLogger(__name__)

# A run longer than this with --save-interval 0 is warned about: it has nothing to resume from until its end.
UNSAVED_STEPS_WARNING = 20


# Settings that decide the shapes of the train state (parameters, optimizer moments): a difference is named when
# a resume does not fit.
STATE_SHAPING_KEYS = (("model", "hf_checkpoint"), ("model", "param_dtype"), ("optim", "optimizer"), ("optim", "clip_grad"))


def config_changes(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """`section.key: saved -> now` for the state-shaping settings that differ between a checkpoint and this run."""
    out = []
    for section, key in STATE_SHAPING_KEYS:
        before, after = saved.get(section, {}).get(key), now.get(section, {}).get(key)
        if section in saved and before != after:
            out.append(f"{section}.{key}: {before!r} -> {after!r}")
    return out


@dataclass
class ResumePoint:
    """Where an interrupted run continues: its train state and the run state saved beside it.

    `warm_start`: the checkpoint is another kind of run's (an SFT run's for an RL run, or the reverse): this run
    starts from its parameters only, at step 0 with a fresh optimizer and its own data (`state` holds the
    restored parameters; the other fields are this run's starting values)."""

    step: int
    state: Any
    weight_version: int
    prompt_iterator: dict[str, Any] | None  # None: a replay's checkpoint (it reads no prompts)
    driver_state: dict[str, Any] | None
    next_group_index: int | None  # only checkpoints older than the driver state's version 2 keep it beside
    warm_start: bool = False


def _is_sft_config(config: dict[str, Any]) -> bool:
    return config.get("algo", {}).get("loss_type") == SFT_LOSS


def restore(cfg: Config, like_state: Any) -> ResumePoint | None:
    """The checkpoint named by `--load` (latest complete step), or None for a fresh run.

    A checkpoint of the other kind of run (SFT for RL, RL for SFT) is a warm start (`ResumePoint.warm_start`): its
    whole train state is read (so its optimizer settings must still fit this run's: `config_changes` names them),
    and only its parameters are kept.
    """
    if not cfg.checkpoint.load:
        return None
    store = CheckpointStore(cfg.checkpoint.load, keep=cfg.checkpoint.keep_checkpoints, read_only=True)
    try:
        step = cfg.checkpoint.load_step if cfg.checkpoint.load_step is not None else store.latest_step()
        saved = {} if step is None else store.meta(step).get("config", {})
        changed = config_changes(saved, cfg.to_dict())
        if changed:
            logger.warning("resuming %s step %d with changed settings: %s", cfg.checkpoint.load, step, "; ".join(changed))
        try:
            step, state, meta = store.restore(abstract_like(like_state), step=step)
        except CheckpointError as e:
            raise CheckpointError(f"{e}" + (f" (settings changed since the checkpoint: {'; '.join(changed)})"
                                            if changed else "")) from e
    finally:
        store.close()
    if "algo" in saved and _is_sft_config(saved) != is_sft(cfg):
        source, this = ("SFT", "RL") if _is_sft_config(saved) else ("RL", "SFT")
        logger.info("--load %s step %d is a checkpoint of an %s run: this %s run starts from its weights (step 0, a "
                    "fresh optimizer, its own data)", cfg.checkpoint.load, step, source, this)
        return ResumePoint(step=0, state=state, weight_version=0, prompt_iterator=None, driver_state=None,
                           next_group_index=None, warm_start=True)
    point = ResumePoint(step=step, state=state, weight_version=int(meta["weight_version"]),
                        prompt_iterator=meta["prompt_iterator"], driver_state=meta.get("driver_state"),
                        next_group_index=meta.get("next_group_index"))
    logger.info("resumed from %s at step %d (weight version %d)", cfg.checkpoint.load, step, point.weight_version)
    return point


class CheckpointCadence:
    """Writes a checkpoint every `--save-interval` steps and at the last step (orbax, atomic, `keep` newest); the
    main job also writes one when it is preempted (job/preemption.py), whatever the interval."""

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

    def save(self, done: int, state: Any, *, weight_version: int, prompt_iterator: dict[str, Any] | None,
             driver_state: dict[str, Any] | None) -> None:
        self.store.save(done, state, {
            "prompt_iterator": prompt_iterator, "weight_version": weight_version, "config": self.cfg.to_dict(),
            "driver_state": driver_state,
        })

    def has(self, done: int) -> bool:
        """Whether the checkpoint of step `done` is already written (complete)."""
        return done in self.store.steps()

    @property
    def directory(self) -> Path:
        return self.store.directory

    def close(self) -> None:
        self.store.close()
