"""The main job: rollout -> advantages -> batching -> train step -> weight sync -> metrics, for --num-rollout steps.

Synchronous by default (`--max-staleness 0`, like slime's `train.py`): rollout k+1 starts after the weights of
step k reached the engine, so every sample is on-policy: before the first rollout the engine is made to hold the
trainer's weights and every engine's version is confirmed (`EngineSource.attach`), and every sample's recorded
`weight_versions` must be that confirmed version (`LiveRollout`, `job/staleness.py`), else the run stops. The engine is the
embedded JAX engine unless `--engine-url` points at SGLang (or a router) or `--launch-sglang` starts one.

Asynchronous with `--max-staleness K >= 1` (`StreamingSource`): a `rollout.streaming.GroupStream` task keeps
generating groups into a bounded buffer on the event loop while the compiled train step runs in a worker thread
(`asyncio.to_thread`; only that thread touches the train state until the step returns). At each step boundary the
new weights are exported in a worker thread too (generation goes on), then the engine stops only for
pause -> flush -> update -> continue (the client's weight-update gate holds new requests back meanwhile), and
episodes in flight continue or rerun by `--inflight-update-policy`. Groups are admitted against the trainer's
version (`staleness.too_stale`), and every batch is checked and accounted before it trains
(`staleness.check_bounded_staleness`: no sample whose oldest token lags the trainer by more than K). Single
process only.

Both modes, and the replay below, run the same step loop (`MainJob.steps`, `MainJob.step`) over a sample source
(`job/sources.py`): the source hands over each step's samples, says where the train step runs, and publishes the
new weights (a `Publication` that carries its own `sync/*` metrics).

With several processes, process 0 runs the rollout (and logs, plots, talks to the engine); every process
trains on the broadcast samples, checkpoints its shards and joins the exports.

Evaluation (`job/eval.py`, `--eval-prompt-data`) runs on process 0 before rollout k when it is due, on the weights
after k steps (synced at the end of step k - 1), and once more after the last step; it never touches the training
rollout's state.

Preemption (`job/preemption.py`): SIGTERM or SIGINT stops the run at a safe point by `--preemption-policy` within
`--preemption-grace-seconds`: the step in progress finishes or is aborted, a checkpoint is written (in asynchronous
mode with the stream's buffered groups, as periodic checkpoints are), and the run exits 0 without its final export;
`--load` of that checkpoint resumes exactly.

Saved rollouts (`job/replay.py`, slime's flags): `--save-debug-rollout-data` writes each step's rollout result
before it is trained on. `--load-debug-rollout-data` replays them: step k trains on the saved result of step k in
place of a rollout (`ReplaySource`), and the job has no engine session, no weight sync and no evaluation (it needs an engine; the
run says so once). The trainer sees the same samples in the same order and computes everything else (advantages
from the saved rewards, batches, old and reference log-probs) as the saving run did, so the same config gives the
same per-step losses bit for bit (tests/test_replay.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import hashlib
import logging
import resource
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from jaxrl_vlm import gc_heap
from jaxrl_vlm.config import Config, is_sft
from jaxrl_vlm.errors import ConfigError
from jaxrl_vlm.data.geo3k import PromptIterator
from jaxrl_vlm.distributed import barrier, broadcast_stop, export_hf, is_main_process
from jaxrl_vlm.job.assets import load_dataset, load_eval_sets, prepare_assets, prepare_model
from jaxrl_vlm.job.checkpointing import CheckpointCadence, ResumePoint, restore
from jaxrl_vlm.job.eval import Evaluator, eval_due
from jaxrl_vlm.job.preemption import Preemption, StepAborted, StepTimes
from jaxrl_vlm.job.replay import RolloutSaver
from jaxrl_vlm.job.run_log import RunLog, plot_run
from jaxrl_vlm.job.session import check_external_engine, rollout_run, rollout_session
from jaxrl_vlm.job.sft import SFTJob
from jaxrl_vlm.job.sources import LiveRollout, ReplaySource, RunState, SampleSource, StreamingSource
from jaxrl_vlm.job.tracking import open_sinks
from jaxrl_vlm.job.trainer import Trainer
from jaxrl_vlm.lora.export import save_peft_adapter
from jaxrl_vlm.weight_sync import WeightSyncer
from rollout.driver import RolloutResult, call_rollout_function
from rollout.dump import dump_samples
from rollout.loading import load_function
from rollout.streaming import GroupStream

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


def memory_metrics(devices: Any) -> dict[str, float]:
    """Peak memory so far, per step: the largest allocator high-water mark over this process's devices of the
    trainer (GPU/TPU report it; CPU does not) and the process's peak resident set (on CPU, where the devices'
    buffers live)."""
    out = {"perf/host_peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 2**30}
    stats = [d.memory_stats() if hasattr(d, "memory_stats") else None for d in devices]
    peaks = [int(st["peak_bytes_in_use"]) for st in stats if st and "peak_bytes_in_use" in st]
    if peaks:
        out["perf/device_peak_gib"] = max(peaks) / 2**30
    return out


@dataclass(frozen=True)
class PreemptedRun:
    """A run stopped by a signal: the signals, the steps it completed (its checkpoint is that step, under
    `directory`), and what it gave up (None when it stopped at a step boundary or finished the step in progress)."""

    signals: str
    completed_steps: int
    directory: Path
    aborted: str | None


@dataclass
class RunOutcome:
    """What `run_training` returns: the last step's metrics, and how the run was preempted (None: it ran to its
    end)."""

    metrics: dict[str, Any]
    preempted: PreemptedRun | None = None


class MainJob:
    """One training run, in named phases: prepare, (resume), open the engine session, steps, finish. Where each
    step's samples come from, and what an engine needs, is the sample source's (`job/sources.py`)."""

    def __init__(self, cfg: Config, *, devices: list[Any] | None = None):
        self.cfg = cfg
        self.trainer = Trainer(cfg, devices=devices)
        self.out_dir = self.trainer.out_dir
        self.main = is_main_process()
        self.version = 0
        self.start_step = 0
        self.resume: ResumePoint | None = None
        self.source: SampleSource | None = None  # built by `prepare`
        self.warm_started = False  # --load named an SFT run's checkpoint: the policy starts from its weights
        self.preemption = Preemption.from_config(cfg.checkpoint)
        self.times = StepTimes()  # the last completed step's phases, for the grace-period verdict
        self.completed = 0  # steps completed (the resume point's, then each finished step)
        self.step_start: RunState | None = None  # the run state when an aborted step began (synchronous mode)
        self.aborted: str | None = None  # why a preemption gave up the step in progress
        self.stopping = False  # every process agreed to stop for a preemption
        self.preempted: PreemptedRun | None = None

    # -------------------------------------------------------------------------- phases
    def prepare(self) -> None:
        """Assets (created once, by process 0; a shared filesystem is assumed), prompts, policy, resume point, and
        the sample source."""
        cfg = self.cfg
        for note in cfg.notes:
            logger.info("%s", note)
        if cfg.rollout.max_staleness > 0 and jax.process_count() > 1:
            raise ConfigError(f"--max-staleness {cfg.rollout.max_staleness} runs in one process only; this job has "
                              f"{jax.process_count()} (use --max-staleness 0)")
        replaying = bool(cfg.debug.load_debug_rollout_data)
        # A replay reads no prompts: only the model is needed.
        prepare = prepare_model if replaying else prepare_assets
        if self.main:
            prepare(cfg)
        barrier("jaxrl_vlm.assets")
        if replaying:
            self.model_dir, prompts = prepare_model(cfg), None
        else:
            self.model_dir, data_path = prepare_assets(cfg)
            prompts = _prompt_iterator(cfg, data_path)
        # What the user named (eval sets, the rollout function) is read before the policy is built: bad input
        # stops the run at once, not after minutes of loading weights. Evaluation runs on process 0 only (it talks
        # to the engine; no other process takes part).
        rollout_fn = None if replaying else load_function(cfg.rollout.rollout_function_path, "--rollout-function-path")
        eval_sets = load_eval_sets(cfg) if self.main and not replaying else None
        self.trainer.build_policy(self.model_dir)
        self.args = cfg.to_namespace()
        self.resume = restore(cfg, self.trainer.state)
        if self.resume is not None and self.resume.warm_start:  # an SFT run's checkpoint: its weights, our step 0
            self.trainer.start_from(self.resume.state.params)
            self.warm_started, self.resume = True, None
        if self.resume is not None:
            self.start_step, self.version = self.resume.step, self.resume.weight_version
            self.completed = self.start_step
            self.trainer.state = self.resume.state
            if prompts is not None:
                if self.resume.prompt_iterator is None:  # a replay's checkpoint: it read no prompts
                    logger.warning("the checkpoint of step %d comes from a replay (no data cursor): prompts start "
                                   "from the beginning", self.start_step)
                else:
                    prompts.load_state_dict(self.resume.prompt_iterator)
        sync_dtype = cfg.engine.weight_sync_dtype or ("bfloat16" if cfg.engine.engine_url else cfg.model.param_dtype)
        syncer = WeightSyncer(None, weight_sync_root(cfg, self.out_dir), copy_from=str(self.model_dir),
                              dtype=jnp.dtype(sync_dtype), mode=cfg.engine.weight_sync_mode,
                              untie_embeddings=cfg.engine.launch_vllm, lora_sync=cfg.lora.lora_sync,
                              frozen=self.trainer.frozen_parts)
        parts = dict(args=self.args, main=self.main, model_dir=self.model_dir, prompts=prompts, syncer=syncer,
                     trainer=self.trainer,
                     saver=RolloutSaver(cfg) if cfg.debug.save_debug_rollout_data and self.main else None)
        self.evaluator = None
        if replaying:
            self.source = ReplaySource(cfg, start_step=self.start_step, **parts)
        else:
            kind = StreamingSource if cfg.rollout.max_staleness > 0 else LiveRollout
            self.source = kind(cfg, rollout_fn=rollout_fn, **parts)
            self.evaluator = Evaluator(cfg, eval_sets, rollout_fn) if self.main else None
        self.checkpoints = CheckpointCadence(cfg, self.out_dir)
        self.log = None
        if self.main:
            sinks = open_sinks(cfg.tracking, self.out_dir, cfg.to_dict())
            self.log = RunLog(self.out_dir, total_steps=cfg.rollout.num_rollout, sinks=sinks,
                              resumed_at=self.start_step if self.resume is not None else None)

    @property
    def syncer(self) -> WeightSyncer:
        return self.source.syncer

    @property
    def stream(self) -> GroupStream | None:
        """The asynchronous rollout (--max-staleness >= 1) while it runs."""
        return self.source.stream

    async def open_engine(self) -> contextlib.AbstractAsyncContextManager[Any]:
        """The source's engine session (none for a replay), started from the trainer's own weights when they are
        not the original checkpoint's (resumed, warm-started, or a launched vLLM, whose in-place reload needs the
        untied head of our export)."""
        exported_start = self.start_step > 0 or self.warm_started or self.cfg.engine.launch_vllm
        serve_dir = await self.source.serve_dir(self.version, exported_start)
        return self.source.session(serve_dir, self.version)

    def train(self, samples: list[Any], metrics: dict[str, Any]) -> None:
        t1 = time.perf_counter()
        metrics.update(self.trainer.train_on(samples))
        metrics["perf/train_time"] = time.perf_counter() - t1
        metrics.update(memory_metrics(self.trainer.mesh.local_devices))
        self.version += 1

    async def step(self, step: int) -> dict[str, Any]:
        """One step: the source's samples, train (the source decides where: asynchronous mode trains in a worker
        thread while generation goes on), publish the new weights, log, checkpoint. A preemption may abort the
        wait for samples (StepAborted; for a live rollout the run state of the step's start is kept for the
        checkpoint); once training starts, the step completes, without its weight sync when a signal came."""
        source = self.source
        t0 = time.perf_counter()
        start = source.run_state() if self.abortable and source.restarts_aborted_steps else None
        try:
            taken = await source.take(step, self.version, self.preemptible)
        except StepAborted:
            self.step_start = start  # the rollout took prompts and carried groups: the checkpoint saves these
            raise
        metrics = taken.metrics
        interval, live = self.cfg.debug.dump_rollout_interval, isinstance(self.source, (LiveRollout, StreamingSource))
        if self.main and live and interval and step % interval == 0 and taken.result is not None:  # for `view`
            dump_samples([*taken.result.failed, *taken.result.samples], self.out_dir / "rollout" / f"step_{step}.jsonl",
                         self.source.run.context.encoder.tokenizer, max_samples=self.cfg.debug.dump_rollout_max_samples)
        if taken.samples:
            await source.train(functools.partial(self.train, taken.samples, metrics), metrics)
            if not self.skip_sync(step):
                publication = await source.publish(self.version)
                if publication is not None:
                    metrics.update(publication.metrics())
        elif self.main:
            logger.warning("step %d: no trainable samples (dropped %s); no update", step, dict(taken.result.dropped))
        step_s = time.perf_counter() - t0
        metrics["perf/step_time"] = step_s
        metrics.update(source.step_metrics(step_s))
        metrics["weight_version"] = self.version
        metrics.update(source.engine_metrics())
        if self.log is not None:
            self.log.log(step, metrics)
        self.completed = step + 1
        self.times = dataclasses.replace(self.times, wait_s=taken.wait_s, train_s=step_s - taken.wait_s)
        self.checkpoint(step + 1)
        return metrics

    async def evaluate_unless_preempted(self, done: int) -> None:
        """`evaluate`, never waited for after a signal: cut short, or not started."""
        if self.preemption.requested:
            return
        try:
            await self.preemptible(self.evaluate(done), evaluation=True)
        except StepAborted as e:
            self.aborted = f"evaluation of step {done}: {e}"

    async def evaluate(self, done: int) -> dict[str, Any] | None:
        """Evaluate the engine's current weights (after `done` training steps, synced) when the schedule says so
        (`eval_due`); logged as the eval record of step `done`, samples dumped under <output_dir>/eval/."""
        if self.evaluator is None or not self.evaluator.sets or not eval_due(self.cfg, done):
            return None
        t0 = time.perf_counter()
        metrics: dict[str, Any] = await self.evaluator.run(self.source.run, done, dump_dir=self.out_dir / "eval",
                                                           flush_engine=self.stream is None)
        metrics["perf/eval_time"] = time.perf_counter() - t0
        metrics["weight_version"] = self.version
        if self.log is not None:
            self.log.log_eval(done, metrics)
        return metrics

    def finish(self) -> None:
        export_hf(self.trainer.policy_model(), self.out_dir / "final_model", copy_from=str(self.model_dir))
        if self.trainer.lora is not None:  # LoRA: the adapters too, as a PEFT directory on the base checkpoint
            save_peft_adapter(self.trainer.lora, self.trainer.state.params, self.out_dir / "final_adapter",
                              base_model=str(self.model_dir))
        if self.log is not None:
            plot_run(self.log.path, self.out_dir / "plots")

    # -------------------------------------------------------------------------- checkpoints and preemption
    def checkpoint(self, done: int) -> None:
        if self.checkpoints.due(done):
            self.save_checkpoint(done, self.source.run_state())

    def save_checkpoint(self, done: int, run_state: RunState) -> None:
        t0 = time.perf_counter()
        self.checkpoints.save(done, self.trainer.state, weight_version=self.version,
                              prompt_iterator=run_state.prompt_iterator, driver_state=run_state.driver_state)
        self.times = dataclasses.replace(self.times, checkpoint_s=time.perf_counter() - t0)

    @property
    def abortable(self) -> bool:
        """A step in progress may be aborted for a preemption: one process only (module docstring of
        job/preemption.py)."""
        return jax.process_count() == 1

    async def preemptible(self, awaitable: Any, *, evaluation: bool = False) -> Any:
        """Await the wait for samples (or an evaluation), cut short by a preemption when the policy says so."""
        if not self.abortable:
            return await awaitable
        return await self.preemption.run_abortable(awaitable, self.times, always_abort=evaluation)

    def stop_requested(self) -> bool:
        """At a step boundary: process 0's signal flag, agreed by every process (a collective); sets `stopping`."""
        if broadcast_stop("preempted" if self.main and self.preemption.requested else None) is not None:
            self.stopping = True
        return self.stopping

    def skip_sync(self, step: int) -> bool:
        """A signal came while step `step` trained: its weight sync is skipped (the resumed run pushes the weights).
        One process only: with several, the export is a collective that every process joins."""
        if self.abortable and self.preemption.requested:
            logger.warning("step %d trained; its weight sync is skipped for the preemption (%s)", step,
                           self.preemption.describe())
            return True
        return False

    async def stop_for_preemption(self) -> None:
        """After a signal, at a safe point: abort the engine's generation if a wait was cut short, then write the
        checkpoint of the last completed step (its run state as the step began, when the step was aborted) unless
        the store has that step already (a periodic checkpoint of the same state), and say where it is."""
        done = self.completed
        if self.aborted is not None:
            logger.warning("preemption (%s): gave up the step in progress (%s)", self.preemption.describe(),
                           self.aborted)
            await self.source.abort_requests(self.preemption.grace_s - self.preemption.since_signal_s())
        run_state = self.step_start if self.step_start is not None else self.source.run_state()
        directory = self.checkpoints.directory
        if self.checkpoints.has(done):
            logger.info("the checkpoint of step %d is already written", done)
        else:
            self.save_checkpoint(done, run_state)
        self.preempted = PreemptedRun(self.preemption.describe(), done, directory, self.aborted)
        logger.warning("preempted by %s after %d completed steps (%.1f s after the signal): checkpoint of step %d in "
                       "%s; resume with --load %s", self.preemption.describe(), done, self.preemption.since_signal_s(),
                       done, directory, directory)

    # -------------------------------------------------------------------------- the whole run
    async def run(self) -> dict[str, Any]:
        """The whole job; returns the last step's metrics (the final eval is in metrics.jsonl). A preempted run
        (`self.preempted`) returns after its checkpoint, without the final export."""
        with self.preemption.installed():
            return await self._run()

    async def _run(self) -> dict[str, Any]:
        with gc_heap.held("train job") if self.cfg.train.freeze_gc else contextlib.nullcontext():
            return await self._run_held()

    async def _run_held(self) -> dict[str, Any]:
        if self.main:
            await check_external_engine(self.cfg)
        self.prepare()
        last: dict[str, Any] = {}
        try:
            async with await self.open_engine() as client:
                await self.source.attach(client, self.version, self.resume)
                async with self.source.running(self.version):
                    last = await self.steps()
                    if self.stopping:  # inside `running`: a stream's running groups are saved to restart
                        await self.stop_for_preemption()
            if self.preempted is None:
                self.finish()
            return last
        finally:
            if self.log is not None:
                self.log.close()
            self.checkpoints.close()

    async def steps(self) -> dict[str, Any]:
        """The step loop: eval of the weights after `step` steps (synced at the end of step `step` - 1), then step
        `step`, until the last step (and its eval) or a preemption (`stopping`); returns the last step's metrics."""
        last: dict[str, Any] = {}
        for step in range(self.start_step, self.cfg.rollout.num_rollout + 1):
            await self.evaluate_unless_preempted(step)
            if self.stop_requested():
                break
            if step < self.cfg.rollout.num_rollout:
                try:
                    last = await self.step(step)
                except StepAborted as e:
                    self.aborted, self.stopping = f"step {step}: {e}", True
                    break
                if step == self.start_step and self.cfg.train.freeze_gc:
                    # What the first step built lives as long as the run: the compiled programs and their caches.
                    logger.debug("froze the heap after the first step: %d objects",
                                gc_heap.freeze_more("train job, after its first step"))
        return last


def run_training(cfg: Config, *, devices: list[Any] | None = None) -> RunOutcome:
    """Run the main job to its end or to a preemption (on `devices`, default all; an SFT job for `--loss-type
    sft_loss`, which does not handle preemption)."""
    if is_sft(cfg):
        return RunOutcome(SFTJob(cfg).run())
    job = MainJob(cfg, devices=devices)
    metrics = asyncio.run(job.run())
    return RunOutcome(metrics, job.preempted)


def train(cfg: Config, *, devices: list[Any] | None = None) -> dict[str, Any]:
    """`run_training`'s last step's metrics."""
    return run_training(cfg, devices=devices).metrics


async def run_one_rollout(cfg: Config, dump_path: str | None = None) -> RolloutResult:
    """`jaxrl-vlm rollout`: one rollout step with the checkpoint's weights, optionally dumped for debugging."""
    model_dir, data_path = prepare_assets(cfg)
    prompts = _prompt_iterator(cfg, data_path)
    args = cfg.to_namespace()
    async with rollout_session(cfg, model_dir, model_dir, args):
        rollout_fn = load_function(cfg.rollout.rollout_function_path, "--rollout-function-path")
        run = rollout_run(cfg, args)
        result = await call_rollout_function(rollout_fn, run, 0, prompts)
        if dump_path:
            dump_samples([*result.samples, *result.failed], dump_path, run.context.encoder.tokenizer)
    return result
