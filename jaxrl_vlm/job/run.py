"""The main job: rollout -> advantages -> batching -> train step -> weight sync -> metrics, for --num-rollout steps.

Synchronous by default (`--max-staleness 0`, like slime's `train.py`): rollout k+1 starts after the weights of
step k reached the engine, so every sample is on-policy: before the first rollout the engine is made to hold the
trainer's weights and every engine's version is confirmed (`MainJob.attach`), and every sample's recorded
`weight_versions` must be that confirmed version (`job/staleness.py`), else the run stops. The engine is the
embedded JAX engine unless `--engine-url` points at SGLang (or a router) or `--launch-sglang` starts one.

Asynchronous with `--max-staleness K >= 1` (`MainJob.run_async`): a `rollout.streaming.GroupStream` task keeps
generating groups into a bounded buffer on the event loop while the compiled train step runs in a worker thread
(`asyncio.to_thread`; only that thread touches the train state until the step returns). At each step boundary the
new weights are exported in a worker thread too (generation goes on), then the engine stops only for
pause -> flush -> update -> continue (the client's weight-update gate holds new requests back meanwhile), and
episodes in flight continue or rerun by `--inflight-update-policy`. Groups are admitted against the trainer's
version (`staleness.too_stale`), and every batch is checked and accounted before it trains
(`staleness.check_bounded_staleness`: no sample whose oldest token lags the trainer by more than K). Single
process only.

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
place of a rollout, and the job has no engine session, no weight sync and no evaluation (it needs an engine; the
run says so once). The trainer sees the same samples in the same order and computes everything else (advantages
from the saved rewards, batches, old and reference log-probs) as the saving run did, so the same config gives the
same per-step losses bit for bit (tests/test_replay.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from jaxrl_vlm.config import Config, external_engine, is_sft
from jaxrl_vlm.errors import ConfigError
from jaxrl_vlm.data.geo3k import PromptIterator
from jaxrl_vlm.distributed import barrier, broadcast_samples, broadcast_stop, export_hf, is_main_process
from jaxrl_vlm.job.assets import load_dataset, load_eval_sets, prepare_assets, prepare_model
from jaxrl_vlm.job.checkpointing import CheckpointCadence, ResumePoint, restore
from jaxrl_vlm.job.eval import Evaluator, eval_due, passrate_metrics
from jaxrl_vlm.job.preemption import Preemption, StepAborted, StepTimes
from jaxrl_vlm.job.replay import RolloutReplay, RolloutSaver
from jaxrl_vlm.job.run_log import RunLog, plot_run
from jaxrl_vlm.job.session import rollout_session
from jaxrl_vlm.job.sft import SFTJob
from jaxrl_vlm.job.staleness import check_bounded_staleness, check_sample_versions, too_stale, unreported_versions
from jaxrl_vlm.job.tracking import open_sinks
from jaxrl_vlm.job.trainer import Trainer
from jaxrl_vlm.weight_sync import SyncReport, WeightSyncer
from rollout.client import EngineError, EngineUnavailable
from rollout.driver import RolloutResult, driver_checkpoint_state, restore_driver_state
from rollout.engine_link import EngineLost, LinkState
from rollout.failures import AllFailedStepsError, all_failed_streak, failure_report
from rollout.dump import dump_samples
from rollout.loading import load_function
from rollout.metrics import multi_turn_metrics, rollout_metrics
from rollout.sample import Sample, TruncationCause
from rollout.streaming import GroupStream, StepBatch

# /flush_cache poll of a weight update in asynchronous mode: the requests the pause aborted are answering.
ASYNC_FLUSH_POLL_S = 0.02
# Bound of the engine abort after a preempted step, whatever is left of the grace period: the checkpoint comes after.
PREEMPTION_ABORT_TIMEOUT_S = 10.0

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


@dataclass(frozen=True)
class RunState:
    """What a checkpoint holds beside the train state, read in one instant: the data cursor (None: a replay reads
    no prompts) and the rollout driver's state (None on processes other than 0, and in a replay)."""

    prompt_iterator: dict[str, Any] | None
    driver_state: dict[str, Any] | None


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
        # Saved rollouts: replayed in place of rollouts (no engine at all), or saved as they are made (process 0).
        self.replay = RolloutReplay(cfg) if cfg.debug.load_debug_rollout_data else None
        self.saver = RolloutSaver(cfg) if cfg.debug.save_debug_rollout_data and self.main else None
        self.stream: GroupStream | None = None  # the asynchronous rollout (--max-staleness >= 1)
        self.next_train_version = 0  # asynchronous mode: the trainer version the next batch taken trains at
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
        """Assets (created once, by process 0; a shared filesystem is assumed), prompts, policy, resume point."""
        cfg = self.cfg
        for note in cfg.notes:
            logger.info("%s", note)
        if cfg.rollout.max_staleness > 0 and jax.process_count() > 1:
            raise ConfigError(f"--max-staleness {cfg.rollout.max_staleness} runs in one process only; this job has "
                              f"{jax.process_count()} (use --max-staleness 0)")
        # A replay reads no prompts: only the model is needed.
        prepare = prepare_model if self.replay is not None else prepare_assets
        if self.main:
            prepare(cfg)
        barrier("jaxrl_vlm.assets")
        if self.replay is not None:
            self.model_dir, self.prompts = prepare_model(cfg), None
        else:
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
            self.completed = self.start_step
            self.trainer.state = self.resume.state
            if self.prompts is not None:
                if self.resume.prompt_iterator is None:  # a replay's checkpoint: it read no prompts
                    logger.warning("the checkpoint of step %d comes from a replay (no data cursor): prompts start "
                                   "from the beginning", self.start_step)
                else:
                    self.prompts.load_state_dict(self.resume.prompt_iterator)
        sync_dtype = cfg.engine.weight_sync_dtype or ("bfloat16" if cfg.engine.engine_url else cfg.model.param_dtype)
        self.syncer = WeightSyncer(None, weight_sync_root(cfg, self.out_dir), copy_from=str(self.model_dir),
                                   dtype=jnp.dtype(sync_dtype), mode=cfg.engine.weight_sync_mode,
                                   untie_embeddings=cfg.engine.launch_vllm)
        self.evaluator = None
        if self.replay is not None:
            self.rollout_fn = None
            if self.main:
                self._announce_replay()
                self.replay.check_available(self.start_step, cfg.rollout.num_rollout)
        else:
            self.rollout_fn = load_function(cfg.rollout.rollout_function_path, "--rollout-function-path")
            # Evaluation runs on process 0 only (it talks to the engine; no other process takes part).
            self.evaluator = Evaluator(cfg, load_eval_sets(cfg), self.rollout_fn) if self.main else None
        self.checkpoints = CheckpointCadence(cfg, self.out_dir)
        self.log = None
        if self.main:
            sinks = open_sinks(cfg.tracking, self.out_dir, cfg.to_dict())
            self.log = RunLog(self.out_dir, total_steps=cfg.rollout.num_rollout, sinks=sinks,
                              resumed_at=self.start_step if self.resume is not None else None)

    def _announce_replay(self) -> None:
        """Say once what a replay does not do."""
        cfg = self.cfg
        logger.info("replaying the rollouts saved at %s (steps %d..%d): no engine is started or contacted, no "
                    "weights are synced", cfg.debug.load_debug_rollout_data, self.start_step, cfg.rollout.num_rollout - 1)
        if cfg.eval.eval_prompt_data:
            logger.warning("evaluation needs an engine and a replay has none: --eval-prompt-data is skipped (evaluate "
                           "the replay's checkpoints afterwards with `jaxrl-vlm eval CONFIG --load DIR`, or use "
                           "`jaxrl-vlm compare-losses`, which does)")
        if external_engine(cfg):
            logger.info("%s is not used by a replay", external_engine(cfg))

    async def serve_dir(self) -> Path:
        """The weights an engine this job starts (embedded or launched) starts from: a resumed or warm-started
        run's own weights, exported here (not yet loaded anywhere), or the original checkpoint on a fresh start."""
        if self.replay is not None:  # no engine to serve
            return self.model_dir
        # A launched vLLM always starts from our export: its in-place reload needs the untied head (WeightSyncer).
        exported_start = self.start_step > 0 or self.warm_started or self.cfg.engine.launch_vllm
        if exported_start and not self.cfg.engine.engine_url:
            self.resumed_export = await self.syncer.push(self.trainer.policy_model(), self.version)
            return self.resumed_export.path
        return self.model_dir

    def session(self, serve_dir: Path) -> contextlib.AbstractAsyncContextManager[Any]:
        if not self.main or self.replay is not None:
            return contextlib.nullcontext()
        return rollout_session(self.cfg, self.model_dir, serve_dir, self.args, str(self.version))

    async def attach(self, client: Any) -> None:
        """Connect the syncer, and make sure the engine holds exactly the trainer's weights before any rollout.

        The embedded engine started from them (labelled with the version): confirmed. An external or launched
        SGLang holds whatever it was started with: the trainer's weights are pushed (a resumed run's export is
        reused) and their version confirmed on every worker. A replay has no engine: nothing to attach.
        """
        if self.replay is not None:
            self.engine_version = self.version
            return
        self.syncer.client = client
        if self.main and hasattr(client, "check_reloadable_head"):
            await client.check_reloadable_head()
        if self.main:
            if external_engine(self.cfg):
                if self.resumed_export is not None:
                    await self.syncer.load(self.resumed_export)
                else:
                    await self.syncer.push(self.trainer.policy_model(), self.version)
            else:
                await self.syncer.confirm(self.version)
        self.engine_version = self.version
        if self.main and client.link is not None:
            # From now on an engine that dies and comes back gets these weights again before any new request.
            client.link.arm(self.syncer.restore)
        if self.main and self.resume is not None:
            restore_driver_state(self.args, self.resume.driver_state, next_group_index=self.resume.next_group_index)

    async def rollout(self, step: int) -> tuple[RolloutResult | None, list[Any], dict[str, Any]]:
        """Process 0 rolls out (or reads step `step`'s saved rollout), and saves it when asked; every process
        receives the samples."""
        t0 = time.perf_counter()
        result: RolloutResult | None = None
        if self.main:
            if self.replay is not None:
                result = self.replay.load(step)
            else:
                result = await self.rollout_fn(self.args, step, self.prompts)
            if self.saver is not None:  # before any check: a step that stops the run is saved too
                self.saver.save(step, result, weight_version=self.engine_version)
        stop: str | None = None
        lost: EngineLost | None = None
        if self.main:
            try:  # a lost engine ends the run here: the episodes it cut FAILED engine_lost, none train
                self.engine_link_failed()
            except EngineLost as e:
                lost, stop = e, str(e)
        if self.main and stop is None:  # stop a run that only fails (--max-all-failed-steps), naming the causes
            try:
                self.all_failed_steps = all_failed_streak(self.all_failed_steps, failure_report(result), step=step,
                                                          limit=self.cfg.rollout.max_all_failed_steps)
            except AllFailedStepsError as e:
                stop = str(e)
        stop = broadcast_stop(stop)  # every process stops together, none waits in the next collective
        if stop is not None:
            raise lost if lost is not None else AllFailedStepsError(stop)
        if self.main:  # synchronous mode trains on-policy only: every sample from the confirmed version
            # (a replay's samples were checked when they were made, against the engine of the run that saved them)
            versions = (unreported_versions(result.samples) if self.replay is not None
                        else check_sample_versions(result.samples, str(self.engine_version), step=step))
        samples = broadcast_samples(result.samples if self.main else None)
        metrics: dict[str, Any] = {}
        if self.main:
            metrics["rollout/samples_without_weight_version"] = versions.unreported
            metrics.update(self._rollout_metrics(result))
        metrics["perf/rollout_time"] = time.perf_counter() - t0
        return result, samples, metrics

    @property
    def client(self) -> Any:
        return self.syncer.client

    def engine_link_failed(self) -> None:
        """Stop the run when the engine did not come back (`EngineLost`, naming its URL and the wait): the step's
        rollout was crippled by the outage and must not train."""
        if self.client is not None and self.client.link is not None:
            self.client.link.raise_if_failed()

    async def ensure_engine(self) -> None:
        """Before a rollout: every engine holds the confirmed version. One that does not (it restarted between two
        calls, unseen) or cannot be reached is handled as a lost engine: wait for it, restore, confirm."""
        link = self.client.link if self.main and self.client is not None else None
        if link is None or not link.armed:
            return
        if link.state is LinkState.UP:
            try:
                reported = await self.client.get_weight_versions()
            except EngineUnavailable:
                if link.state is LinkState.UP:  # not a lost engine (a timeout, 5xx): as before, it stops the run
                    raise
            else:
                if all(v == str(self.engine_version) for v in reported.values()):
                    return
                link.lost(f"engines report weight version(s) {reported}, expected {self.engine_version} (restarted)")
        await link.wait_up()

    def engine_metrics(self) -> dict[str, float]:
        """Run totals of engine outages (rollout/engine_link.py) and lost router workers (--allow-worker-loss)."""
        client = self.client
        if client is None or not self.main:
            return {}
        metrics = client.link.metrics() if client.link is not None else {}
        if client.is_router:
            metrics["engine/workers_lost"] = float(len(client.lost_workers))
            metrics["engine/workers"] = float(len(client.worker_urls))
        return metrics

    def _rollout_metrics(self, result: RolloutResult) -> dict[str, Any]:
        metrics = rollout_metrics(result.samples, result)
        if not result.skip_default_log:  # a --custom-rollout-log-function-path hook that returned True
            metrics.update(multi_turn_metrics(result.samples, self.cfg.rollout.rollout_max_response_len))
        if self.cfg.eval.log_passrate and not result.skip_default_log:  # slime's passrate/pass@k, training groups
            passrate = passrate_metrics(result.samples, self.cfg.rollout.n_samples_per_prompt)
            metrics.update({f"passrate/{k}": v for k, v in passrate.items()})
        return metrics

    def train(self, samples: list[Any], metrics: dict[str, Any]) -> None:
        t1 = time.perf_counter()
        metrics.update(self.trainer.train_on(samples))
        metrics["perf/train_time"] = time.perf_counter() - t1
        self.version += 1

    @property
    def colocated(self) -> bool:
        """--colocate with an engine this process talks to: it frees its memory while the trainer runs."""
        return self.cfg.engine.colocate and self.main and self.replay is None and self.syncer.client is not None

    async def release_engine(self, metrics: dict[str, Any]) -> None:
        """--colocate: the rollout is over; the engine flushes and frees its weights and KV cache for training."""
        if self.colocated:
            t0 = time.perf_counter()
            await self.syncer.client.release_memory_occupation()
            metrics["perf/release_memory_time"] = time.perf_counter() - t0

    async def sync(self, metrics: dict[str, Any]) -> None:
        """Push the new weights to the engine (pause, flush, update, continue), unless sync is off (ablations).
        Colocated: the engine takes back its weights' memory first and its KV cache's after (slime's order)."""
        if self.replay is not None:  # no engine
            return
        t2 = time.perf_counter()
        if self.colocated:
            await self.syncer.client.resume_memory_occupation(["weights"])
        if not self.cfg.engine.disable_weight_sync:
            report = await self.syncer.push(self.trainer.policy_model(), self.version)
            self.engine_version = self.version
            metrics["sync/export_s"] = report.export_s
            metrics["sync/gbytes"] = report.bytes_written / 1e9
            metrics["sync/in_memory"] = float(report.in_memory)
        if self.colocated:
            await self.syncer.client.resume_memory_occupation(["kv_cache"])
        metrics["perf/update_weights_time"] = time.perf_counter() - t2

    def run_state(self) -> RunState:
        """The data cursor and the driver state of this instant (no await between them). Asynchronous mode: the
        stream's buffered and in-flight groups."""
        if self.stream is not None:
            driver = self.stream.checkpoint_state()
        else:
            driver = driver_checkpoint_state(self.args) if self.main and self.replay is None else None
        return RunState(self.prompts.state_dict() if self.prompts is not None else None, driver)

    def checkpoint(self, done: int) -> None:
        if self.checkpoints.due(done):
            self.save_checkpoint(done, self.run_state())

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
            if self.stream is None:  # the stream aborts its own requests when it closes
                await self.abort_engine()
        run_state = self.step_start if self.step_start is not None else self.run_state()
        directory = self.checkpoints.directory
        if self.checkpoints.has(done):
            logger.info("the checkpoint of step %d is already written", done)
        else:
            self.save_checkpoint(done, run_state)
        self.preempted = PreemptedRun(self.preemption.describe(), done, directory, self.aborted)
        logger.warning("preempted by %s after %d completed steps (%.1f s after the signal): checkpoint of step %d in "
                       "%s; resume with --load %s", self.preemption.describe(), done, self.preemption.since_signal_s(),
                       done, directory, directory)

    async def abort_engine(self) -> None:
        """Abort every request on the engine (a cut rollout's or evaluation's episodes), bounded by what is left of
        the grace period; the episodes still running see `aborting` and end."""
        if not self.main or self.replay is not None or self.syncer.client is None:
            return
        ctx = self.args.rollout_context
        ctx.aborting = True
        left = self.preemption.grace_s - self.preemption.since_signal_s()
        timeout = max(1.0, min(PREEMPTION_ABORT_TIMEOUT_S, left / 2))
        try:
            await self.syncer.client.abort_all(timeout_s=timeout, retry_interval_s=0.5)
        except EngineError as e:  # the checkpoint matters more than an idle engine: said, then on
            logger.warning("preemption: aborting the engine's requests failed within %.1f s: %s", timeout, e)

    async def step(self, step: int) -> dict[str, Any]:
        """One synchronous step. A preemption may abort its rollout (StepAborted; the run state of its start is kept
        for the checkpoint); once training starts, the step completes, without its weight sync when a signal came."""
        t0 = time.perf_counter()
        start = self.run_state() if self.abortable else None
        try:
            if self.replay is None:  # an engine that was lost and came back gets the current weights first
                await self.preemptible(self.ensure_engine())
            result, samples, metrics = await self.preemptible(self.rollout(step))
        except StepAborted:
            self.step_start = start  # the rollout took prompts and carried groups: the checkpoint saves these
            raise
        wait_s = time.perf_counter() - t0
        if samples:
            await self.release_engine(metrics)
            self.train(samples, metrics)
            if not self.skip_sync(step):
                await self.sync(metrics)
        elif self.main:
            logger.warning("step %d: no trainable samples (dropped %s); no update", step, dict(result.dropped))
        metrics["perf/step_time"] = time.perf_counter() - t0
        metrics["weight_version"] = self.version
        metrics.update(self.engine_metrics())
        if self.log is not None:
            self.log.log(step, metrics)
        self.completed = step + 1
        self.times = dataclasses.replace(self.times, wait_s=wait_s, train_s=time.perf_counter() - t0 - wait_s)
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
        metrics: dict[str, Any] = await self.evaluator.run(self.args, done, dump_dir=self.out_dir / "eval",
                                                           flush_engine=self.stream is None)
        metrics["perf/eval_time"] = time.perf_counter() - t0
        metrics["weight_version"] = self.version
        if self.log is not None:
            self.log.log_eval(done, metrics)
        return metrics

    def finish(self) -> None:
        export_hf(self.trainer.policy_model(), self.out_dir / "final_model", copy_from=str(self.model_dir))
        if self.log is not None:
            plot_run(self.log.path, self.out_dir / "plots")

    # -------------------------------------------------------------------------- asynchronous mode
    def too_stale(self, samples: list[Sample]) -> bool:
        """The stream's admission verdict: `samples` would lag the version the next batch trains at by more than K."""
        return too_stale(samples, self.next_train_version, self.cfg.rollout.max_staleness)

    async def run_async(self) -> dict[str, Any]:
        """The steps of `--max-staleness K >= 1` (module docstring); returns the last step's metrics."""
        self.syncer.flush_poll_s = ASYNC_FLUSH_POLL_S
        self.next_train_version = self.version
        self.stream = GroupStream(self.args, self.prompts, engine_version=self.engine_version,
                                  batches_taken=self.version, too_stale=self.too_stale)
        self.stream.start()
        try:
            last = await self.steps(self.async_step)
            if self.stopping:  # before the stream closes: its running groups are saved to restart
                await self.stop_for_preemption()
        finally:
            await self.stream.close()
        return last

    async def async_step(self, step: int) -> dict[str, Any]:
        """Take a batch from the stream, check and account its staleness, train in a worker thread (generation goes
        on), then export and load the new weights."""
        stream, k = self.stream, self.cfg.rollout.max_staleness
        t0 = time.perf_counter()
        busy0 = stream.busy_seconds()
        batch = await self.preemptible(stream.take(self.cfg.rollout.rollout_batch_size, step))
        self.engine_link_failed()
        result, samples = batch.result, batch.result.samples
        self.all_failed_steps = all_failed_streak(self.all_failed_steps, failure_report(result), step=step,
                                                  limit=self.cfg.rollout.max_all_failed_steps)
        report = check_bounded_staleness(samples, trainer_version=self.version, engine_version=self.engine_version,
                                         max_staleness=k, step=step)
        if samples:  # groups finishing from now on train at the next version
            self.next_train_version = self.version + 1
        metrics: dict[str, Any] = self._rollout_metrics(result)
        metrics.update(report.metrics(k))
        metrics.update(_stream_metrics(batch, samples))
        metrics["perf/rollout_time"] = batch.waited_s  # slime's name; here the wait for the batch
        paused = 0.0
        if samples:
            t1 = time.perf_counter()
            busy1 = stream.busy_seconds()
            metrics.update(await asyncio.to_thread(self.trainer.train_on, samples))
            train_s = time.perf_counter() - t1
            metrics["perf/train_time"] = train_s
            metrics["async/overlap_fraction"] = (stream.busy_seconds() - busy1) / train_s if train_s > 0 else 0.0
            self.version += 1
            if not self.skip_sync(step):
                paused = await self.sync_async(metrics)
        else:
            logger.warning("step %d: no trainable samples (dropped %s); no update", step, dict(result.dropped))
        step_s = time.perf_counter() - t0
        metrics["perf/step_time"] = step_s
        # The engine idles while no group generates, and while the update pauses it (groups wait at the gate).
        metrics["async/engine_idle_s"] = max(0.0, step_s - (stream.busy_seconds() - busy0)) + paused
        metrics["async/engine_paused_s"] = paused
        metrics["async/buffered_groups"] = float(len(stream.buffer))
        metrics["async/running_groups"] = float(len(stream.running))
        metrics["weight_version"] = self.version
        metrics.update(self.engine_metrics())
        if self.log is not None:
            self.log.log(step, metrics)
        self.completed = step + 1
        self.times = dataclasses.replace(self.times, wait_s=batch.waited_s, train_s=step_s - batch.waited_s)
        self.checkpoint(step + 1)
        return metrics

    async def sync_async(self, metrics: dict[str, Any]) -> float:
        """Export in a worker thread while generation goes on, then load (the engine stops only for this part);
        returns the seconds the engine was stopped (pause -> flush -> update -> continue, and the confirmation)."""
        t2 = time.perf_counter()
        report = await asyncio.to_thread(self.syncer.export, self.trainer.policy_model(), self.version)
        t3 = time.perf_counter()
        await self.syncer.load(report)
        paused = time.perf_counter() - t3
        self.engine_version = self.version
        self.stream.engine_updated(self.version)
        metrics["sync/export_s"] = report.export_s
        metrics["sync/gbytes"] = report.bytes_written / 1e9
        metrics["sync/in_memory"] = float(report.in_memory)
        metrics["perf/update_weights_time"] = time.perf_counter() - t2
        return paused

    # -------------------------------------------------------------------------- the whole run
    async def run(self) -> dict[str, Any]:
        """The whole job; returns the last step's metrics (the final eval is in metrics.jsonl). A preempted run
        (`self.preempted`) returns after its checkpoint, without the final export."""
        with self.preemption.installed():
            return await self._run()

    async def _run(self) -> dict[str, Any]:
        self.prepare()
        last: dict[str, Any] = {}
        try:
            async with self.session(await self.serve_dir()) as client:
                await self.attach(client)
                if self.cfg.rollout.max_staleness > 0:
                    last = await self.run_async()
                else:
                    last = await self.run_sync()
            if self.preempted is None:
                self.finish()
            return last
        finally:
            if self.log is not None:
                self.log.close()
            self.checkpoints.close()

    async def run_sync(self) -> dict[str, Any]:
        """The steps of `--max-staleness 0`; returns the last step's metrics. Eval of the weights after `step` steps
        runs before rollout `step` (after the previous step's sync), and once more after the last step."""
        last = await self.steps(self.step)
        if self.stopping:
            await self.stop_for_preemption()
        return last

    async def steps(self, step_fn: Any) -> dict[str, Any]:
        """The step loop of both modes: eval of the weights after `step` steps, then step `step` by `step_fn`,
        until the last step or a preemption (`stopping`); returns the last step's metrics."""
        last: dict[str, Any] = {}
        for step in range(self.start_step, self.cfg.rollout.num_rollout + 1):
            await self.evaluate_unless_preempted(step)
            if self.stop_requested():
                break
            if step < self.cfg.rollout.num_rollout:
                try:
                    last = await step_fn(step)
                except StepAborted as e:
                    self.aborted, self.stopping = f"step {step}: {e}", True
                    break
        return last


def _stream_metrics(batch: StepBatch, samples: list[Sample]) -> dict[str, float]:
    """What the stream did for this batch: the trainer's wait, stale groups by policy, in-flight episodes that a
    weight update made continue (requests re-sent) or rerun."""
    continued = sum(1 for s in samples for r in s.turns if r.truncation_cause is TruncationCause.WEIGHT_UPDATE)
    return {
        "async/trainer_idle_s": batch.waited_s,
        "async/stale_groups": float(batch.result.dropped.get("stale_group", 0)),
        "async/stale_groups_regenerated": float(batch.counters.stale_groups_regenerated),
        "async/stale_groups_dropped": float(batch.counters.stale_groups_dropped),
        "async/stale_samples": float(batch.counters.stale_samples),
        "async/continued_requests": float(continued),
        "async/rerun_episodes": float(sum(int(s.metadata.get("weight_update_reruns", 0)) for s in samples)),
    }


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
        result = await rollout_fn(args, 0, prompts)
        if dump_path:
            dump_samples([*result.samples, *result.failed], dump_path, args.rollout_context.encoder.tokenizer)
    return result
