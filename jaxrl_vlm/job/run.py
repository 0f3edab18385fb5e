"""The main job: rollout -> advantages -> batching -> train step -> weight sync -> metrics, for --num-rollout steps.

Synchronous on purpose (like slime's `train.py`): rollout k+1 starts after the weights of step k reached the
engine, so every sample is on-policy: before the first rollout the engine is made to hold the trainer's weights
and every engine's version is confirmed (`MainJob.attach`), and every sample's recorded `weight_versions` must be
that confirmed version (`job/staleness.py`), else the run stops. The engine is the embedded JAX engine unless
`--engine-url` points at SGLang (or a router) or `--launch-sglang` starts one.

With several processes, process 0 runs the rollout (and logs, plots, talks to the engine); every process
trains on the broadcast samples, checkpoints its shards and joins the exports.

Evaluation (`job/eval.py`, `--eval-prompt-data`) runs on process 0 before rollout k when it is due, on the weights
after k steps (synced at the end of step k - 1), and once more after the last step; it never touches the training
rollout's state.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
from pathlib import Path
from typing import Any

import jax.numpy as jnp

from jaxrl_vlm.config import Config, is_sft
from jaxrl_vlm.data.geo3k import PromptIterator
from jaxrl_vlm.distributed import barrier, broadcast_samples, broadcast_stop, export_hf, is_main_process
from jaxrl_vlm.job.assets import load_dataset, load_eval_sets, prepare_assets
from jaxrl_vlm.job.checkpointing import CheckpointCadence, ResumePoint, restore
from jaxrl_vlm.job.eval import Evaluator, eval_due, passrate_metrics
from jaxrl_vlm.job.run_log import RunLog, plot_run
from jaxrl_vlm.job.session import rollout_session
from jaxrl_vlm.job.sft import SFTJob
from jaxrl_vlm.job.staleness import check_sample_versions
from jaxrl_vlm.job.tracking import open_sinks
from jaxrl_vlm.job.trainer import Trainer
from jaxrl_vlm.weight_sync import SyncReport, WeightSyncer
from rollout.driver import RolloutResult, driver_checkpoint_state, restore_driver_state
from rollout.failures import AllFailedStepsError, all_failed_streak, failure_report
from rollout.dump import dump_samples
from rollout.loading import load_function
from rollout.metrics import multi_turn_metrics, rollout_metrics

logger = logging.getLogger(__name__)


def weight_sync_root(cfg: Config, out_dir: Path) -> Path:
    """Where this run's weight versions go. A configured `--weight-sync-dir` (e.g. /dev/shm/...) may be shared by
    several runs, so each run writes, and deletes, only under its own subdirectory, named after its output
    directory (the same on every process of a multi-host run, and again when the run resumes)."""
    if not cfg.engine.weight_sync_dir:
        return out_dir / "weights"
    out = out_dir.resolve()
    return Path(cfg.engine.weight_sync_dir) / f"{out.name}-{hashlib.sha1(str(out).encode()).hexdigest()[:10]}"


def _prompt_iterator(cfg: Config, data_path: Path) -> PromptIterator:
    return PromptIterator(load_dataset(cfg, data_path), cfg.rollout.rollout_batch_size,
                          shuffle=cfg.data.rollout_shuffle, seed=cfg.train.seed)


class MainJob:
    """One training run, in named phases: prepare, (resume), open the engine session, steps, finish."""

    def __init__(self, cfg: Config, *, devices: list[Any] | None = None):
        self.cfg = cfg
        self.trainer = Trainer(cfg, devices=devices)
        self.out_dir = self.trainer.out_dir
        self.main = is_main_process()
        self.version = 0
        self.start_step = 0
        self.resume: ResumePoint | None = None
        self.all_failed_steps = 0  # consecutive steps in which every finished episode FAILED
        self.resumed_export: SyncReport | None = None  # a resumed run's weights, exported before the engine starts
        self.engine_version = 0  # the weight version every engine was last confirmed to hold
        self.warm_started = False  # --load named an SFT run's checkpoint: the policy starts from its weights

    # -------------------------------------------------------------------------- phases
    def prepare(self) -> None:
        """Assets (created once, by process 0; a shared filesystem is assumed), prompts, policy, resume point."""
        cfg = self.cfg
        for note in cfg.notes:
            logger.info("%s", note)
        if self.main:
            prepare_assets(cfg)
        barrier("jaxrl_vlm.assets")
        self.model_dir, data_path = prepare_assets(cfg)
        self.prompts = _prompt_iterator(cfg, data_path)
        self.trainer.build_policy(self.model_dir)
        self.args = cfg.to_namespace()
        self.resume = restore(cfg, self.trainer.state)
        if self.resume is not None and self.resume.warm_start:  # an SFT run's checkpoint: its weights, our step 0
            self.trainer.start_from(self.resume.state.params)
            self.warm_started, self.resume = True, None
        if self.resume is not None:
            self.start_step, self.version = self.resume.step, self.resume.weight_version
            self.trainer.state = self.resume.state
            self.prompts.load_state_dict(self.resume.prompt_iterator)
        sync_dtype = cfg.engine.weight_sync_dtype or ("bfloat16" if cfg.engine.engine_url else cfg.model.param_dtype)
        self.syncer = WeightSyncer(None, weight_sync_root(cfg, self.out_dir),
                                   copy_from=str(self.model_dir), dtype=jnp.dtype(sync_dtype))
        self.rollout_fn = load_function(cfg.rollout.rollout_function_path, "--rollout-function-path")
        # Evaluation runs on process 0 only (it talks to the engine; no other process takes part).
        self.evaluator = Evaluator(cfg, load_eval_sets(cfg), self.rollout_fn) if self.main else None
        self.checkpoints = CheckpointCadence(cfg, self.out_dir)
        self.log = None
        if self.main:
            sinks = open_sinks(cfg.tracking, self.out_dir, cfg.to_dict())
            self.log = RunLog(self.out_dir, total_steps=cfg.rollout.num_rollout, sinks=sinks,
                              resumed_at=self.start_step if self.resume is not None else None)

    async def serve_dir(self) -> Path:
        """The weights an engine this job starts (embedded or launched) starts from: a resumed or warm-started
        run's own weights, exported here (not yet loaded anywhere), or the original checkpoint on a fresh start."""
        if (self.start_step > 0 or self.warm_started) and not self.cfg.engine.engine_url:
            self.resumed_export = await self.syncer.push(self.trainer.policy_model(), self.version)
            return self.resumed_export.path
        return self.model_dir

    def session(self, serve_dir: Path) -> contextlib.AbstractAsyncContextManager[Any]:
        if not self.main:
            return contextlib.nullcontext()
        return rollout_session(self.cfg, self.model_dir, serve_dir, self.args, str(self.version))

    async def attach(self, client: Any) -> None:
        """Connect the syncer, and make sure the engine holds exactly the trainer's weights before any rollout.

        The embedded engine started from them (labelled with the version): confirmed. An external or launched
        SGLang holds whatever it was started with: the trainer's weights are pushed (a resumed run's export is
        reused) and their version confirmed on every worker.
        """
        self.syncer.client = client
        if self.main:
            if self.cfg.engine.engine_url or self.cfg.engine.launch_sglang:
                if self.resumed_export is not None:
                    await self.syncer.load(self.resumed_export)
                else:
                    await self.syncer.push(self.trainer.policy_model(), self.version)
            else:
                await self.syncer.confirm(self.version)
        self.engine_version = self.version
        if self.main and self.resume is not None:
            restore_driver_state(self.args, self.resume.driver_state, next_group_index=self.resume.next_group_index)

    async def rollout(self, step: int) -> tuple[RolloutResult | None, list[Any], dict[str, Any]]:
        """Process 0 rolls out; every process receives the samples."""
        t0 = time.perf_counter()
        result = await self.rollout_fn(self.args, step, self.prompts) if self.main else None
        stop: str | None = None
        if self.main:  # stop a run that only fails (--max-all-failed-steps), naming the causes
            try:
                self.all_failed_steps = all_failed_streak(self.all_failed_steps, failure_report(result), step=step,
                                                          limit=self.cfg.rollout.max_all_failed_steps)
            except AllFailedStepsError as e:
                stop = str(e)
        stop = broadcast_stop(stop)  # every process stops together, none waits in the next collective
        if stop is not None:
            raise AllFailedStepsError(stop)
        if self.main:  # synchronous mode trains on-policy only: every sample from the confirmed version
            versions = check_sample_versions(result.samples, str(self.engine_version), step=step)
        samples = broadcast_samples(result.samples if self.main else None)
        metrics: dict[str, Any] = {}
        if self.main:
            metrics["rollout/samples_without_weight_version"] = versions.unreported
            metrics.update(rollout_metrics(result.samples, result))
            if not result.skip_default_log:  # a --custom-rollout-log-function-path hook that returned True
                metrics.update(multi_turn_metrics(result.samples, self.cfg.rollout.rollout_max_response_len))
            if self.cfg.eval.log_passrate and not result.skip_default_log:  # slime's passrate/pass@k, training groups
                passrate = passrate_metrics(result.samples, self.cfg.rollout.n_samples_per_prompt)
                metrics.update({f"passrate/{k}": v for k, v in passrate.items()})
        metrics["perf/rollout_time"] = time.perf_counter() - t0
        return result, samples, metrics

    def train(self, samples: list[Any], metrics: dict[str, Any]) -> None:
        t1 = time.perf_counter()
        metrics.update(self.trainer.train_on(samples))
        metrics["perf/train_time"] = time.perf_counter() - t1
        self.version += 1

    async def sync(self, metrics: dict[str, Any]) -> None:
        """Push the new weights to the engine (pause, flush, update, continue), unless sync is off (ablations)."""
        t2 = time.perf_counter()
        if not self.cfg.engine.disable_weight_sync:
            report = await self.syncer.push(self.trainer.policy_model(), self.version)
            self.engine_version = self.version
            metrics["sync/export_s"] = report.export_s
            metrics["sync/gbytes"] = report.bytes_written / 1e9
        metrics["perf/update_weights_time"] = time.perf_counter() - t2

    def checkpoint(self, done: int) -> None:
        if not self.checkpoints.due(done):
            return
        self.checkpoints.save(
            done, self.trainer.state, weight_version=self.version, prompt_iterator=self.prompts.state_dict(),
            driver_state=driver_checkpoint_state(self.args) if self.main else None,
        )

    async def step(self, step: int) -> dict[str, Any]:
        t0 = time.perf_counter()
        result, samples, metrics = await self.rollout(step)
        if samples:
            self.train(samples, metrics)
            await self.sync(metrics)
        elif self.main:
            logger.warning("step %d: no trainable samples (dropped %s); no update", step, dict(result.dropped))
        metrics["perf/step_time"] = time.perf_counter() - t0
        metrics["weight_version"] = self.version
        if self.log is not None:
            self.log.log(step, metrics)
        self.checkpoint(step + 1)
        return metrics

    async def evaluate(self, done: int) -> dict[str, Any] | None:
        """Evaluate the engine's current weights (after `done` training steps, synced) when the schedule says so
        (`eval_due`); logged as the eval record of step `done`, samples dumped under <output_dir>/eval/."""
        if self.evaluator is None or not self.evaluator.sets or not eval_due(self.cfg, done):
            return None
        t0 = time.perf_counter()
        metrics: dict[str, Any] = await self.evaluator.run(self.args, done, dump_dir=self.out_dir / "eval")
        metrics["perf/eval_time"] = time.perf_counter() - t0
        metrics["weight_version"] = self.version
        if self.log is not None:
            self.log.log_eval(done, metrics)
        return metrics

    def finish(self) -> None:
        export_hf(self.trainer.policy_model(), self.out_dir / "final_model", copy_from=str(self.model_dir))
        if self.log is not None:
            plot_run(self.log.path, self.out_dir / "plots")

    # -------------------------------------------------------------------------- the whole run
    async def run(self) -> dict[str, Any]:
        """The whole job; returns the last step's metrics (the final eval is in metrics.jsonl)."""
        self.prepare()
        last: dict[str, Any] = {}
        try:
            async with self.session(await self.serve_dir()) as client:
                await self.attach(client)
                # Eval of the weights after `step` steps runs before rollout `step` (after the previous step's
                # sync), and once more after the last step.
                for step in range(self.start_step, self.cfg.rollout.num_rollout + 1):
                    await self.evaluate(step)
                    if step < self.cfg.rollout.num_rollout:
                        last = await self.step(step)
            self.finish()
            return last
        finally:
            if self.log is not None:
                self.log.close()
            self.checkpoints.close()


def train(cfg: Config) -> dict[str, Any]:
    """Run the main job to the end (an SFT job for `--loss-type sft_loss`); returns the last step's metrics."""
    if is_sft(cfg):
        return SFTJob(cfg).run()
    return asyncio.run(MainJob(cfg).run())


async def run_one_rollout(cfg: Config, dump_path: str | None = None) -> RolloutResult:
    """`jaxrl-vlm rollout`: one rollout step with the checkpoint's weights, optionally dumped for debugging."""
    model_dir, data_path = prepare_assets(cfg)
    prompts = _prompt_iterator(cfg, data_path)
    args = cfg.to_namespace()
    async with rollout_session(cfg, model_dir, model_dir, args):
        rollout_fn = load_function(cfg.rollout.rollout_function_path, "--rollout-function-path")
        result = await rollout_fn(args, 0, prompts)
        if dump_path:
            dump_samples([*result.samples, *result.failed], dump_path, args.rollout_context.encoder.tokenizer)
    return result
