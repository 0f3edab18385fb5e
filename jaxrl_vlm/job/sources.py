"""Where each training step's samples come from: the one thing the main job's step loop (`MainJob.step`) asks.

- `LiveRollout` (`--max-staleness 0`, like slime's `train.py`): process 0 runs one rollout step on the weights the
  engine was last confirmed to hold, and every sample must be of exactly that version (`staleness.
  check_sample_versions`), else the run stops. Rollout k+1 starts after the weights of step k reached the engine.
- `StreamingSource` (`--max-staleness K >= 1`): a `rollout.streaming.GroupStream` keeps generating groups into a
  bounded buffer while the trainer trains in a worker thread; it owns all the staleness bookkeeping of that mode
  (the admission verdict, the per-batch check and its accounting, the version the next batch trains at).
- `ReplaySource` (`--load-debug-rollout-data`): step k's saved rollout result, and no engine at all: its session,
  attach and publish are the no-ops of `SampleSource`.

Every source answers the same calls in the same order: `serve_dir` -> `session` -> `attach` -> `running` (the loop
runs inside) -> per step `take` -> `train` -> `publish` (unless a preemption skips it) -> `step_metrics`. A
source's `publish` returns a `Publication` that carries its own metrics (`sync/*`, `perf/update_weights_time`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jaxrl_vlm.config import Config, external_engine
from jaxrl_vlm.distributed import broadcast_samples, broadcast_stop
from jaxrl_vlm.job.checkpointing import ResumePoint
from jaxrl_vlm.job.eval import passrate_metrics
from jaxrl_vlm.job.replay import RolloutReplay, RolloutSaver
from jaxrl_vlm.job.session import rollout_run, rollout_session
from jaxrl_vlm.lora.adapters import adapters_of
from jaxrl_vlm.job.staleness import VersionReport, check_bounded_staleness, check_sample_versions, too_stale, \
    unreported_versions
from jaxrl_vlm.weight_sync import SyncReport, WeightSyncer
from rollout.client import EngineError, EngineUnavailable
from rollout.driver import RolloutResult, call_rollout_function
from rollout.engine_link import EngineLost, LinkState
from rollout.failures import AllFailedStepsError, all_failed_streak, failure_report
from rollout.metrics import multi_turn_metrics, rollout_metrics
from rollout.run import DriverState, RolloutRun
from rollout.sample import Sample, TruncationCause
from rollout.streaming import GroupStream, StepBatch

# /flush_cache poll of a weight update in asynchronous mode: the requests the pause aborted are answering.
ASYNC_FLUSH_POLL_S = 0.02
# Bound of the engine abort after a preempted step, whatever is left of the grace period: the checkpoint comes after.
PREEMPTION_ABORT_TIMEOUT_S = 10.0

logger = logging.getLogger(__name__)

# How the job lets a source wait: cut short by a preemption when its policy says so (`MainJob.preemptible`).
Preemptible = Callable[[Awaitable[Any]], Awaitable[Any]]


@dataclass(frozen=True)
class RunState:
    """What a checkpoint holds beside the train state, read in one instant: the data cursor (None: a replay reads
    no prompts) and the rollout driver's state (None on processes other than 0, and in a replay)."""

    prompt_iterator: dict[str, Any] | None
    driver_state: dict[str, Any] | None


@dataclass
class StepSamples:
    """One step's samples as `take` hands them over: the rollout result (process 0; None elsewhere), the samples
    every process trains on, the step's metrics so far, and the seconds the trainer waited for them."""

    result: RolloutResult | None
    samples: list[Any]
    metrics: dict[str, Any]
    wait_s: float


@dataclass(frozen=True)
class Publication:
    """What publishing one weight version did: the export and load (None: `--disable-weight-sync`), the seconds
    the whole publication took (colocated memory moves included) and those the engine was stopped for it."""

    sync: SyncReport | None
    update_s: float
    paused_s: float = 0.0

    def metrics(self) -> dict[str, float]:
        out = self.sync.metrics() if self.sync is not None else {}
        out["perf/update_weights_time"] = self.update_s
        return out


def rollout_step_metrics(cfg: Config, result: RolloutResult) -> dict[str, Any]:
    """The metrics of one training rollout result (`rollout/*`, multi-turn, and slime's `passrate/*`)."""
    metrics = rollout_metrics(result.samples, result)
    if not result.skip_default_log:  # a --custom-rollout-log-function-path hook that returned True
        metrics.update(multi_turn_metrics(result.samples, cfg.rollout.rollout_max_response_len))
    if cfg.eval.log_passrate and not result.skip_default_log:  # slime's passrate/pass@k, training groups
        passrate = passrate_metrics(result.samples, cfg.rollout.n_samples_per_prompt)
        metrics.update({f"passrate/{k}": v for k, v in passrate.items()})
    return metrics


class SampleSource:
    """The protocol, with the answers of a source without an engine: no session, nothing to attach or publish,
    nothing streamed. `take` is each source's own."""

    stream: GroupStream | None = None
    # A preemption that aborts `take` restarts the step from its start's run state (the prompts it took are given
    # back); a stream's groups are instead saved as they are when the run stops.
    restarts_aborted_steps = True

    def __init__(self, cfg: Config, *, args: Any, main: bool, model_dir: Path | None, prompts: Any,
                 syncer: WeightSyncer, trainer: Any, saver: RolloutSaver | None = None):
        self.cfg, self.args, self.main, self.model_dir, self.prompts = cfg, args, main, model_dir, prompts
        self.syncer, self.trainer, self.saver = syncer, trainer, saver
        self.engine_version = 0  # the weight version every engine was last confirmed to hold
        self.all_failed_steps = 0  # consecutive steps in which every finished episode FAILED

    async def serve_dir(self, version: int, exported_start: bool) -> Path | None:
        return self.model_dir

    def session(self, serve_dir: Path | None, version: int) -> contextlib.AbstractAsyncContextManager[Any]:
        return contextlib.nullcontext()

    async def attach(self, client: Any, version: int, resume: ResumePoint | None) -> None:
        self.engine_version = version

    @contextlib.asynccontextmanager
    async def running(self, version: int) -> AsyncIterator[None]:
        yield

    async def take(self, step: int, version: int, preemptible: Preemptible) -> StepSamples:
        raise NotImplementedError

    async def train(self, train: Callable[[], None], metrics: dict[str, Any]) -> None:
        """Run the job's train step (`train` adds its metrics to `metrics` and advances the trainer's version)."""
        train()

    async def publish(self, version: int) -> Publication | None:
        return None

    def step_metrics(self, step_s: float) -> dict[str, float]:
        return {}

    def engine_metrics(self) -> dict[str, float]:
        return {}

    def run_state(self) -> RunState:
        return RunState(self.prompts.state_dict() if self.prompts is not None else None, None)

    async def abort_requests(self, grace_left_s: float) -> None:
        """After a preempted step: abort the engine's requests, within what is left of the grace period."""

    def engine_link_failed(self) -> None:
        """Stop the run when the engine did not come back (an engine source)."""

    # ---------------------------------------------------------------------------- one synchronous rollout step
    async def produce(self, step: int) -> RolloutResult:
        raise NotImplementedError

    def check_versions(self, samples: list[Any], step: int) -> VersionReport:
        return unreported_versions(samples)

    async def rollout(self, step: int) -> tuple[RolloutResult | None, list[Any], dict[str, Any]]:
        """Process 0 produces step `step`'s rollout result (rolls out, or reads the saved one), and saves it when
        asked; every process receives the samples."""
        t0 = time.perf_counter()
        result: RolloutResult | None = None
        if self.main:
            result = await self.produce(step)
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
        if self.main:
            versions = self.check_versions(result.samples, step)
        samples = broadcast_samples(result.samples if self.main else None)
        metrics: dict[str, Any] = {}
        if self.main:
            metrics["rollout/samples_without_weight_version"] = versions.unreported
            metrics.update(rollout_step_metrics(self.cfg, result))
        metrics["perf/rollout_time"] = time.perf_counter() - t0
        return result, samples, metrics


class ReplaySource(SampleSource):
    """`--load-debug-rollout-data`: step k trains on the saved result of step k; no engine, no weight sync."""

    def __init__(self, cfg: Config, *, start_step: int, **kw: Any):
        super().__init__(cfg, **kw)
        self.replay = RolloutReplay(cfg)
        if self.main:
            self._announce(start_step)
            self.replay.check_available(start_step, cfg.rollout.num_rollout)

    def _announce(self, start_step: int) -> None:
        """Say once what a replay does not do."""
        cfg = self.cfg
        logger.info("replaying the rollouts saved at %s (steps %d..%d): no engine is started or contacted, no "
                    "weights are synced", cfg.debug.load_debug_rollout_data, start_step, cfg.rollout.num_rollout - 1)
        if cfg.eval.eval_prompt_data:
            logger.warning("evaluation needs an engine and a replay has none: --eval-prompt-data is skipped (evaluate "
                           "the replay's checkpoints afterwards with `jaxrl-vlm eval CONFIG --load DIR`, or use "
                           "`jaxrl-vlm compare-losses`, which does)")
        if external_engine(cfg):
            logger.info("%s is not used by a replay", external_engine(cfg))

    async def produce(self, step: int) -> RolloutResult:
        return self.replay.load(step)

    # A replay's samples were checked when they were made, against the engine of the run that saved them: the
    # inherited `check_versions` only counts those without a version.

    async def take(self, step: int, version: int, preemptible: Preemptible) -> StepSamples:
        t0 = time.perf_counter()
        result, samples, metrics = await preemptible(self.rollout(step))
        return StepSamples(result, samples, metrics, wait_s=time.perf_counter() - t0)


class EngineSource(SampleSource):
    """What the sources with an engine share: the session, attaching the weight syncer (the engine holds the
    trainer's weights before any rollout), the engine link's checks and metrics, and `--colocate`."""

    def __init__(self, cfg: Config, *, rollout_fn: Any, **kw: Any):
        super().__init__(cfg, **kw)
        self.rollout_fn = rollout_fn
        self.run: RolloutRun | None = None  # the typed rollout run (process 0), built once its session is open
        self.resumed_export: SyncReport | None = None  # a resumed run's weights, exported before the engine starts

    @property
    def client(self) -> Any:
        return self.syncer.client

    async def serve_dir(self, version: int, exported_start: bool) -> Path | None:
        """The weights an engine this job starts (embedded or launched) starts from: the trainer's own weights,
        exported here (not yet loaded anywhere) when `exported_start`, or the original checkpoint."""
        if exported_start and not self.cfg.engine.engine_url:
            model = self.trainer.policy_model()
            launched_http = self.cfg.engine.launch_sglang or self.cfg.engine.launch_vllm
            if launched_http and self.syncer.http_adapters(adapters_of(model)):
                # LoRA served by SGLang / vLLM: the engine starts from the base (vLLM: its untied export), and
                # `attach` loads the trainer's adapters on it.
                if not self.cfg.engine.launch_vllm:
                    return self.model_dir
                return self.syncer.export(self.trainer.base_model(), version).path
            self.resumed_export = await self.syncer.push(model, version)
            return self.resumed_export.path
        return self.model_dir

    def session(self, serve_dir: Path | None, version: int) -> contextlib.AbstractAsyncContextManager[Any]:
        if not self.main:
            return contextlib.nullcontext()
        return rollout_session(self.cfg, self.model_dir, serve_dir, self.args, str(version))

    async def attach(self, client: Any, version: int, resume: ResumePoint | None) -> None:
        """Connect the syncer, and make sure the engine holds exactly the trainer's weights (`version`) before any
        rollout.

        The embedded engine started from them (labelled with the version): confirmed. An external or launched
        SGLang holds whatever it was started with: the trainer's weights are pushed (a resumed run's export is
        reused) and their version confirmed on every worker.
        """
        self.syncer.client = client
        if (self.main and self.trainer.lora is None and not self.cfg.engine.disable_weight_sync
                and self.syncer.can_share(self.trainer.policy_params())):
            # The embedded engine on the trainer's devices, in its dtypes: it serves the trainer's arrays, uncopied.
            self.trainer.share_params()
            self.syncer.share_trainer_arrays = True
            logger.info("weight sync in memory: the embedded engine serves the trainer's parameter arrays, uncopied "
                        "(the train step keeps them instead of donating them)")
        if self.main:
            self.run = rollout_run(self.cfg, self.args)
        if self.main and hasattr(client, "check_reloadable_head"):
            await client.check_reloadable_head()
        if self.main:
            if external_engine(self.cfg):
                if self.resumed_export is not None:
                    await self.syncer.load(self.resumed_export)
                else:
                    await self.syncer.push(self.trainer.policy_model(), version)
            else:
                await self.syncer.confirm(version)
        self.engine_version = version
        if self.main and client.link is not None:
            # From now on an engine that dies and comes back gets these weights again before any new request.
            client.link.arm(self.syncer.restore)
        if self.main and resume is not None:
            self.run.restore_state(resume.driver_state, next_group_index=resume.next_group_index)

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

    def run_state(self) -> RunState:
        """The data cursor and the driver state of this instant (no await between them)."""
        if not self.main:
            return RunState(self.prompts.state_dict() if self.prompts is not None else None, None)
        # Before the session opened (no run yet) the driver has carried nothing: a fresh state says so.
        state = self.run.state if self.run is not None else DriverState()
        return RunState(self.prompts.state_dict() if self.prompts is not None else None, state.to_dict())

    async def abort_requests(self, grace_left_s: float) -> None:
        """Abort every request on the engine (a cut rollout's or evaluation's episodes), bounded by what is left of
        the grace period; the episodes still running see `aborting` and end."""
        if not self.main or self.client is None:
            return
        ctx = self.run.context
        ctx.aborting = True
        timeout = max(1.0, min(PREEMPTION_ABORT_TIMEOUT_S, grace_left_s / 2))
        try:
            await self.client.abort_all(timeout_s=timeout, retry_interval_s=0.5)
        except EngineError as e:  # the checkpoint matters more than an idle engine: said, then on
            logger.warning("preemption: aborting the engine's requests failed within %.1f s: %s", timeout, e)

    async def produce(self, step: int) -> RolloutResult:
        return await call_rollout_function(self.rollout_fn, self.run, step, self.prompts)


class LiveRollout(EngineSource):
    """`--max-staleness 0`: one rollout step per training step, on-policy only."""

    def check_versions(self, samples: list[Any], step: int) -> VersionReport:
        """Synchronous mode trains on-policy only: every sample from the confirmed version."""
        return check_sample_versions(samples, str(self.engine_version), step=step)

    async def take(self, step: int, version: int, preemptible: Preemptible) -> StepSamples:
        t0 = time.perf_counter()
        await preemptible(self.ensure_engine())  # an engine that was lost and came back gets the weights first
        result, samples, metrics = await preemptible(self.rollout(step))
        return StepSamples(result, samples, metrics, wait_s=time.perf_counter() - t0)

    @property
    def colocated(self) -> bool:
        """--colocate with an engine this process talks to: it frees its memory while the trainer runs."""
        return self.cfg.engine.colocate and self.main and self.client is not None

    async def train(self, train: Callable[[], None], metrics: dict[str, Any]) -> None:
        """--colocate: the rollout is over; the engine flushes and frees its weights and KV cache first."""
        if self.colocated:
            t0 = time.perf_counter()
            await self.client.release_memory_occupation()
            metrics["perf/release_memory_time"] = time.perf_counter() - t0
        train()

    async def publish(self, version: int) -> Publication:
        """Push the new weights to the engine (pause, flush, update, continue), unless sync is off (ablations).
        Colocated: the engine takes back its weights' memory first and its KV cache's after (slime's order)."""
        t0 = time.perf_counter()
        if self.colocated:
            await self.client.resume_memory_occupation(["weights"])
        report = None
        if not self.cfg.engine.disable_weight_sync:
            report = await self.syncer.push(self.trainer.policy_model(), version)
            self.engine_version = version
        if self.colocated:
            await self.client.resume_memory_occupation(["kv_cache"])
        return Publication(report, update_s=time.perf_counter() - t0)


class StreamingSource(EngineSource):
    """`--max-staleness K >= 1` (one process): batches taken from a `GroupStream` that generates meanwhile, and all
    the staleness bookkeeping of that mode. Groups are admitted against the version the next batch trains at
    (`too_stale`), and every batch is checked and accounted before it trains (`check_bounded_staleness`: no sample
    whose oldest token lags the trainer by more than K). Weights are exported in a worker thread while generation
    goes on; the engine stops only for pause -> flush -> update -> continue."""

    restarts_aborted_steps = False

    def __init__(self, cfg: Config, **kw: Any):
        super().__init__(cfg, **kw)
        self.max_staleness = cfg.rollout.max_staleness
        self.next_train_version = 0  # the trainer version the next batch taken trains at
        self._busy0 = 0.0  # the stream's busy seconds when the step began
        self._paused_s = 0.0  # the seconds the step's weight update stopped the engine

    def too_stale(self, samples: list[Sample]) -> bool:
        """The stream's admission verdict: `samples` would lag the version the next batch trains at by more than K."""
        return too_stale(samples, self.next_train_version, self.max_staleness)

    @contextlib.asynccontextmanager
    async def running(self, version: int) -> AsyncIterator[None]:
        """The stream generates while the steps run inside; closed (its requests aborted) on the way out."""
        self.syncer.flush_poll_s = ASYNC_FLUSH_POLL_S
        self.next_train_version = version
        self.stream = GroupStream(self.run, self.prompts, engine_version=self.engine_version,
                                  batches_taken=version, too_stale=self.too_stale)
        self.stream.start()
        try:
            yield
        finally:
            await self.stream.close()

    async def take(self, step: int, version: int, preemptible: Preemptible) -> StepSamples:
        """Take a batch from the stream, then check and account its staleness against trainer version `version`."""
        stream, k = self.stream, self.max_staleness
        self._busy0, self._paused_s = stream.busy_seconds(), 0.0
        batch = await preemptible(stream.take(self.cfg.rollout.rollout_batch_size, step))
        self.engine_link_failed()
        result, samples = batch.result, batch.result.samples
        self.all_failed_steps = all_failed_streak(self.all_failed_steps, failure_report(result), step=step,
                                                  limit=self.cfg.rollout.max_all_failed_steps)
        report = check_bounded_staleness(samples, trainer_version=version, engine_version=self.engine_version,
                                         max_staleness=k, step=step)
        if samples:  # groups finishing from now on train at the next version
            self.next_train_version = version + 1
        metrics: dict[str, Any] = rollout_step_metrics(self.cfg, result)
        metrics.update(report.metrics(k))
        metrics.update(_stream_metrics(batch, samples))
        metrics["perf/rollout_time"] = batch.waited_s  # slime's name; here the wait for the batch
        return StepSamples(result, samples, metrics, wait_s=batch.waited_s)

    async def train(self, train: Callable[[], None], metrics: dict[str, Any]) -> None:
        """In a worker thread (only it touches the train state until it returns): generation goes on."""
        t0 = time.perf_counter()
        busy = self.stream.busy_seconds()
        await asyncio.to_thread(train)
        train_s = time.perf_counter() - t0
        metrics["async/overlap_fraction"] = (self.stream.busy_seconds() - busy) / train_s if train_s > 0 else 0.0

    async def publish(self, version: int) -> Publication:
        """Export in a worker thread while generation goes on, then load (the engine stops only for this part:
        pause -> flush -> update -> continue, and the confirmation)."""
        t0 = time.perf_counter()
        report = await asyncio.to_thread(self.syncer.export, self.trainer.policy_model(), version)
        t1 = time.perf_counter()
        await self.syncer.load(report)
        self._paused_s = time.perf_counter() - t1
        self.engine_version = version
        self.stream.engine_updated(version)
        return Publication(report, update_s=time.perf_counter() - t0, paused_s=self._paused_s)

    def step_metrics(self, step_s: float) -> dict[str, float]:
        stream, paused = self.stream, self._paused_s
        # The engine idles while no group generates, and while the update pauses it (groups wait at the gate).
        return {
            "async/engine_idle_s": max(0.0, step_s - (stream.busy_seconds() - self._busy0)) + paused,
            "async/engine_paused_s": paused,
            "async/buffered_groups": float(len(stream.buffer)),
            "async/running_groups": float(len(stream.running)),
        }

    def run_state(self) -> RunState:
        """The data cursor and the stream's buffered and in-flight groups."""
        if self.stream is None:
            return super().run_state()
        return RunState(self.prompts.state_dict() if self.prompts is not None else None,
                        self.stream.checkpoint_state())

    async def abort_requests(self, grace_left_s: float) -> None:
        """Nothing here: the stream aborts its own requests when it closes."""


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
