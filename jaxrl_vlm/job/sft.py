"""The SFT job (`--loss-type sft_loss`, slime's SFT mode): supervised fine-tuning on conversations with images, as
a warm start for RL. No engine is started and no rollout runs.

Each step takes the next `--rollout-batch-size` conversations of `--prompt-data` (`data/sft.py`; shuffled per
epoch by `--seed`, like prompts), lays them out as the RL batches are laid out (`batching.py`: fixed shapes,
packing), with loss mask 1 exactly on the assistant turns' tokens, and trains the mean NLL of those tokens at
temperature 1 (`rl/losses.py sft_loss`; `--global-batch-size` splits a step into several optimizer steps as in RL).
It logs `train/sft_loss` per step. With `--eval-prompt-data NAME PATH ...` (conversation files, slices as for RL),
each eval round logs the held-out NLL per assistant token `eval/<name>/nll` (and `eval/<name>/tokens`,
`eval/<name>/conversations`), without generating, on the schedule of RL evaluation (`eval_due`). Checkpoints
(`--save-interval`, `--load` resumes an SFT run) and the `final_model/` HF export are written as an RL run writes
them, the export in the parameter dtype (`--param-dtype`; an RL run's is bf16), so that it is exactly the weights
the next run starts from.

RL starts from the result with `--hf-checkpoint <output_dir>/final_model`, or with `--load
<output_dir>/checkpoints` (a warm start from the parameters, `job/checkpointing.py`).
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any

import jax.numpy as jnp

from jaxrl_vlm import gc_heap
from jaxrl_vlm.config import Config
from jaxrl_vlm.data.geo3k import PromptIterator
from jaxrl_vlm.distributed import barrier, export_hf, is_main_process
from jaxrl_vlm.job.assets import EvalSet, load_conversations, load_eval_sets, prepare_assets, transcript_encoder
from jaxrl_vlm.job.checkpointing import CheckpointCadence, restore
from jaxrl_vlm.job.eval import eval_due
from jaxrl_vlm.job.run_log import RunLog, plot_run
from jaxrl_vlm.job.tracking import open_sinks
from jaxrl_vlm.job.trainer import Trainer

logger = logging.getLogger(__name__)


class SFTJob:
    """One SFT run, in named phases: prepare, (resume), steps with eval rounds, finish."""

    def __init__(self, cfg: Config, *, devices: list[Any] | None = None):
        self.cfg = cfg
        self.trainer = Trainer(cfg, devices=devices)
        self.out_dir = self.trainer.out_dir
        self.main = is_main_process()
        self.start_step = 0
        self.log: RunLog | None = None

    # -------------------------------------------------------------------------- phases
    def prepare(self) -> None:
        """Assets (created once, by process 0), conversations, eval sets, policy, resume point, logs.

        Every process loads the same conversations and walks them in the same order, so each builds the same
        batch and uploads only its own rows (no broadcast is needed)."""
        cfg = self.cfg
        for note in cfg.notes:
            logger.info("%s", note)
        if self.main:
            prepare_assets(cfg)
        barrier("jaxrl_vlm.assets")
        self.model_dir, data_path = prepare_assets(cfg)
        encoder = transcript_encoder(cfg, self.model_dir)
        dataset = load_conversations(cfg, data_path, encoder)
        logger.info("SFT data: %d conversations from %s", len(dataset), data_path)
        self.data = PromptIterator(dataset, cfg.rollout.rollout_batch_size, shuffle=cfg.data.rollout_shuffle,
                                   seed=cfg.train.seed)
        # Read before the policy is built, like the training data: a bad eval file stops the run at once.
        self.eval_sets: list[EvalSet] = load_eval_sets(cfg, lambda c, path: load_conversations(c, path, encoder))
        self.trainer.build_policy(self.model_dir)
        resume = restore(cfg, self.trainer.state)
        if resume is not None and resume.warm_start:  # an RL run's checkpoint: its weights, our step 0
            self.trainer.start_from(resume.state.params)
        elif resume is not None:
            self.start_step = resume.step
            self.trainer.state = resume.state
            self.data.load_state_dict(resume.prompt_iterator)
        self.checkpoints = CheckpointCadence(cfg, self.out_dir)
        if self.main:
            sinks = open_sinks(cfg.tracking, self.out_dir, cfg.to_dict())
            resumed = self.start_step if resume is not None and not resume.warm_start else None
            self.log = RunLog(self.out_dir, total_steps=cfg.rollout.num_rollout, sinks=sinks, resumed_at=resumed)

    def evaluate(self, done: int) -> dict[str, Any] | None:
        """The held-out NLL per assistant token of every eval set with the weights after `done` steps, when the
        schedule says so; logged as the eval record of step `done`. Every process takes part (it is a forward
        pass on the mesh)."""
        if not self.eval_sets or not eval_due(self.cfg, done):
            return None
        t0 = time.perf_counter()
        metrics: dict[str, Any] = {}
        for s in self.eval_sets:
            total, tokens = self.trainer.nll(s.prompts(), self.cfg.rollout.rollout_batch_size)
            metrics[f"eval/{s.name}/nll"] = total / tokens
            metrics[f"eval/{s.name}/tokens"] = tokens
            metrics[f"eval/{s.name}/conversations"] = len(s)
        metrics["perf/eval_time"] = time.perf_counter() - t0
        metrics["weight_version"] = done
        if self.log is not None:
            self.log.log_eval(done, metrics)
        return metrics

    def step(self, step: int) -> dict[str, Any]:
        """Train on the next batch of conversations; log and checkpoint."""
        t0 = time.perf_counter()
        batch = self.data.next_batch()
        metrics: dict[str, Any] = self.trainer.train_on(batch)
        metrics["perf/train_time"] = time.perf_counter() - t0
        metrics["sft/conversations"] = len(batch)
        metrics["sft/epoch"] = self.data.epoch + self.data.position / len(self.data.dataset)
        metrics["perf/step_time"] = time.perf_counter() - t0
        metrics["weight_version"] = step + 1
        if self.log is not None:
            self.log.log(step, metrics)
        if self.checkpoints.due(step + 1):
            self.checkpoints.save(step + 1, self.trainer.state, weight_version=step + 1,
                                  prompt_iterator=self.data.state_dict(), driver_state=None)
        return metrics

    def finish(self) -> None:
        # In the parameter dtype, not bf16 like an RL run's final_model: this export is the start of the next run,
        # and an RL run from `--hf-checkpoint final_model` should start from exactly the weights `--load` gives.
        export_hf(self.trainer.policy_model(), self.out_dir / "final_model", copy_from=str(self.model_dir),
                  dtype=jnp.dtype(self.cfg.model.param_dtype))
        if self.log is not None:
            plot_run(self.log.path, self.out_dir / "plots")

    # -------------------------------------------------------------------------- the whole run
    def run(self) -> dict[str, Any]:
        """The whole job; returns the last step's metrics (the eval rounds are in metrics.jsonl). The heap is frozen
        for the run as an RL run's is (`--freeze-gc`, job/run.py)."""
        with gc_heap.held("SFT job") if self.cfg.train.freeze_gc else contextlib.nullcontext():
            return self._run_held()

    def _run_held(self) -> dict[str, Any]:
        self.prepare()
        try:
            last = self.steps()
            self.finish()
            return last
        finally:
            if self.log is not None:
                self.log.close()
            self.checkpoints.close()

    def steps(self) -> dict[str, Any]:
        """Eval of the weights after `step` steps, then step `step`, to the last step; the last step's metrics."""
        last: dict[str, Any] = {}
        for step in range(self.start_step, self.cfg.rollout.num_rollout + 1):
            self.evaluate(step)
            if step < self.cfg.rollout.num_rollout:
                last = self.step(step)
                if step == self.start_step and self.cfg.train.freeze_gc:  # its compiled step lives as long as the run
                    gc_heap.freeze_more("SFT job, after its first step")
        return last
