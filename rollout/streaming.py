"""Asynchronous rollout (`--max-staleness K >= 1`): groups stream into a bounded buffer while the trainer trains.

The synchronous driver (`driver.generate_rollout`) generates one step's groups, aborts its stragglers and returns:
the engine then waits for the trainer, and every step waits for its slowest episode. `GroupStream` keeps one
producer task generating groups instead, with the driver's own pieces (episodes through `run_group`, slime's hooks,
the failure policy and dynamic filter of `keep_group`, the global group numbering of `PromptTaker`), and buffers
every kept group; the main job takes `rollout_batch_size` groups per training step (`take`). A long episode holds up
its own group, never a step.

**How far ahead it generates** (AReaL's admission rule). With the engine at weight version e and `taken` batches
handed to the trainer, at most (e + K + 1 - taken) * B groups (B = `rollout_batch_size`) are generating or
buffered (`generation_allowance`). In completion order a group started at version e is then at most K batches from
the front of the line, so it trains at a trainer version <= e + K. With K = 0 this is the synchronous loop's one
batch per version (which keeps its own code path).

**Too stale.** Groups that finish out of order can still fall behind. The job's `too_stale(samples)` judges each
group as it finishes (against the version the next batch will train at) and the whole buffer again when a batch is
taken; `--stale-group-policy` then runs the group's prompt again as a new group (`regenerate`) or drops it (`drop`),
counted as `dropped["stale_group"]` and in `StreamCounters`. A running group whose tokens are already too stale no
longer counts as live (its replacement starts at once) and is counted as dropped at once; it still runs to its end.
The groups dropped whole since the last batch are listed by index, so a checkpoint of that moment carries them
(`DriverState.dropped_groups`, with the FAILED samples and per-sample counts in `unreported`) and the resumed run
counts them with its first batch.

**Weight updates** happen at step boundaries and close the client's `WeightUpdateGate`; episodes in flight continue
or rerun by `--inflight-update-policy` (rollout/multiturn.py, `driver.run_group`).

**Accounting.** What was dropped since the last batch (FAILED episodes, filtered and stale groups, skipped long
prompts) is in the `RolloutResult` handed out with the next batch, so the driver's metrics, hooks and failure streak
apply unchanged; `groups_submitted` there counts submissions since the previous batch. A step's submissions are
bounded like the driver's over-sampling (MAX_GROUPS_FACTOR): past the bound a batch is handed out short once the
groups in flight are done, rather than spinning on a task whose every group is filtered.

**Checkpoint and resume.** `checkpoint_state()` is the driver-state dict with the buffered groups as carried groups
whose samples are all finished, and the running ones as carried groups whose episodes all restart (their live envs
cannot be saved); prompts queued for regeneration go back to the front of the prompt buffer. A stream built on the
restored state buffers the former as they were (same samples, same weight versions) and runs the latter first.

Never imports jax.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from rollout.driver import (
    RUNNABLE,
    MAX_GROUPS_FACTOR,
    CarriedGroup,
    DriverState,
    PromptSource,
    PromptTaker,
    RolloutResult,
    StepHooks,
    count_restored_drops,
    drop_group,
    end_of_step_hooks,
    keep_group,
    log_step_problems,
    make_group,
    prompt_train_length,
    run_group,
)
from rollout.loading import load_function
from rollout.multiturn import default_sampling_params
from rollout.run import RolloutRun, Unreported
from rollout.sample import Sample

logger = logging.getLogger(__name__)


def generation_allowance(*, engine_version: int, max_staleness: int, groups_per_step: int, batches_taken: int,
                         live_groups: int) -> int:
    """Groups that may start now: (e + K + 1 - taken) * B minus the live ones (generating or buffered), >= 0."""
    return max(0, (engine_version + max_staleness + 1 - batches_taken) * groups_per_step - live_groups)


@dataclass
class BufferedGroup:
    """A finished, kept group waiting for the trainer; `samples` are the kept ones, `prompt` the pristine prompt."""

    group_index: int
    prompt: Sample
    samples: list[Sample]
    finished_at: float


@dataclass
class StreamCounters:
    """What the stream did since the previous batch, beyond the `RolloutResult` accounting."""

    stale_groups_regenerated: int = 0
    stale_groups_dropped: int = 0
    stale_samples: int = 0  # samples of those groups (or of the kept part of them)


@dataclass
class StepBatch:
    """One training step's groups and the accounting since the previous batch (`result.groups` are the samples)."""

    groups: list[BufferedGroup]
    result: RolloutResult
    counters: StreamCounters
    waited_s: float  # how long `take` waited for the groups (the trainer's idle time)


@dataclass(eq=False)
class _Running:
    group_index: int
    prompt: Sample
    samples: list[Sample]
    task: asyncio.Task | None = None
    superseded: bool = False  # already too stale while running: no longer live, its prompt handled once


class GroupStream:
    """The producer of `--max-staleness` >= 1 (module docstring). `start()`, then `take(n, step)` per training
    step, `engine_updated(version)` after each weight update, `close()` at the end.

    `engine_version` / `batches_taken`: the engine's confirmed weight version and the batches trained so far (equal
    at a start or resume). `too_stale(samples)` is the job's verdict on a group (its samples with tokens).
    """

    def __init__(self, run: RolloutRun | Any, data_source: PromptSource, *, engine_version: int, batches_taken: int,
                 too_stale: Callable[[Sequence[Sample]], bool]):
        # A slime namespace (the job's `args`) is read once into its run.
        self.run = run if isinstance(run, RolloutRun) else RolloutRun.from_args(run)
        self.args = self.run.args  # for user code only (slime's hooks)
        self.ctx = self.run.context
        self.opts = self.run.options
        if self.opts.max_staleness < 1:
            raise ValueError(f"GroupStream needs --max-staleness >= 1, got {self.opts.max_staleness}")
        self.source = data_source
        self.state = self.run.state
        self.generate_fn = load_function(self.opts.custom_generate_function_path, "--custom-generate-function-path")
        self.hooks = StepHooks.load(self.opts)
        vision = self.ctx.encoder.vision
        self.sampling_params = default_sampling_params(self.opts, vision.banned_ids, vision.eos_ids)
        self.groups_per_step = self.opts.rollout_batch_size
        self.engine_version = engine_version
        self.batches_taken = batches_taken
        self.too_stale = too_stale
        self.result = RolloutResult(groups=[])
        self.counters = StreamCounters()
        self.prompts = PromptTaker(data_source, self.state, self.result, self.opts.rollout_max_prompt_len,
                                   lambda prompt: prompt_train_length(self.ctx, prompt))
        self.running: list[_Running] = []
        self.buffer: list[BufferedGroup] = []
        self._finished: list[list[Sample]] = []  # every group finished since the last batch (all-samples hook)
        self._to_start: list[_Running] = []  # restored in-flight groups, started first
        self._regenerate: list[Sample] = []  # prompts of stale groups, run again as new groups
        count_restored_drops(self.state, self.result)
        self._submitted_since_take = 0
        self._wake = asyncio.Event()
        self._changed = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._closing = False
        self._busy_s = 0.0
        self._busy_since: float | None = None
        self._restore(self.state.partial_groups)
        self.state.partial_groups = []

    # -------------------------------------------------------------------------- lifecycle
    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.ensure_future(self._produce())

    async def close(self) -> None:
        """Stop generating: the producer exits, groups in flight are aborted (their envs closed) and discarded."""
        self._closing = True
        self._wake.set()
        if self._task is not None:
            await asyncio.gather(self._task, return_exceptions=True)
        if not self.running:
            return
        self.ctx.aborting = True
        try:
            await self.ctx.client.abort_all(timeout_s=60.0, retry_interval_s=0.5)
        except Exception as e:  # the engine may already be idle or gone; the episodes still end
            logger.warning("abort of the stream's requests at close failed: %s", e)
        await asyncio.gather(*(g.task for g in self.running), return_exceptions=True)
        self.ctx.aborting = False
        self.running.clear()
        self._account_busy()

    # -------------------------------------------------------------------------- the job's side
    def engine_updated(self, version: int) -> None:
        """The engine confirmed `version`: the allowance grows."""
        self.engine_version = version
        self._wake.set()

    def busy_seconds(self) -> float:
        """Seconds so far during which at least one group was generating (up to now)."""
        now = time.monotonic()
        return self._busy_s + (now - self._busy_since if self._busy_since is not None else 0.0)

    async def take(self, n: int, rollout_id: int) -> StepBatch:
        """Wait for `n` buffered groups fit to train (oldest first) and hand them out with the accounting since the
        previous batch; short (possibly empty) only when this step's submission bound is spent and nothing that
        could still fill it is running. Runs slime's end-of-step hooks, as the driver does at the end of a step."""
        t0 = time.monotonic()
        while True:
            self._raise_if_failed()
            self._drop_stale_buffered()
            if len(self.buffer) >= n or self._spent():
                break
            self._changed.clear()
            waiters = [asyncio.ensure_future(self._changed.wait())]
            if self._task is not None:
                waiters.append(self._task)
            done, _ = await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
            waiters[0].cancel()
        waited = time.monotonic() - t0
        taken, self.buffer = self.buffer[:n], self.buffer[n:]
        result, counters, finished = self.result, self.counters, self._finished
        self.result, self.counters, self._finished = RolloutResult(groups=[]), StreamCounters(), []
        self.prompts.result = self.result
        result.groups = [g.samples for g in taken]
        for s in result.samples:
            s.metadata["rollout_id"] = rollout_id
        result.filtered_long_prompts_total = self.state.filtered_long_prompts
        if taken:
            self.batches_taken += 1
        self._submitted_since_take = 0
        self._wake.set()
        end_of_step_hooks(self.hooks, self.args, rollout_id, result, finished, self.source, waited)
        log_step_problems(rollout_id, result, n, self.opts)
        return StepBatch(taken, result, counters, waited)

    def checkpoint_state(self) -> dict[str, Any]:
        """The driver-state dict of this moment (module docstring); it only reads."""
        # The buffer in its own order (the order batches take it), then the groups to restart.
        carried = [CarriedGroup(g.group_index, g.prompt, list(g.samples)) for g in self.buffer]
        for group in sorted([*self._to_start, *self.running], key=lambda g: g.group_index):
            if not group.superseded:  # its replacement is already queued or running
                carried.append(CarriedGroup(group.group_index, group.prompt, make_group(
                    group.prompt, group.group_index, len(group.samples))))
        state = DriverState(next_group_index=self.state.next_group_index,
                            prompt_buffer=[*self._regenerate, *self.state.prompt_buffer],
                            partial_groups=carried,
                            filtered_long_prompts=self.state.filtered_long_prompts,
                            dropped_groups=list(self.result.dropped_groups),
                            unreported=Unreported(
                                failed=list(self.result.failed), episodes=self.result.episodes,
                                sample_drops={k: v for k, v in self.result.dropped.items() if k.endswith("_sample")}))
        return state.to_dict()

    # -------------------------------------------------------------------------- the producer
    async def _produce(self) -> None:
        while not self._closing:
            self._fill()
            wake = asyncio.ensure_future(self._wake.wait())
            try:
                await asyncio.wait([wake, *(g.task for g in self.running)], return_when=asyncio.FIRST_COMPLETED)
            finally:
                wake.cancel()
            self._wake.clear()
            for group in [g for g in self.running if g.task.done()]:
                self.running.remove(group)
                self._account_busy()
                self._finish(group, group.task.result())  # a bug in an episode function stops the stream
            self._changed.set()

    def _fill(self) -> None:
        """Start groups while the allowance lasts: restored ones first, then stale prompts again, then new ones."""
        self._supersede_stale_running()
        bound = self._submission_bound()
        while self._submitted_since_take < bound and not self._closing:
            live = len(self.buffer) + sum(not g.superseded for g in self.running)
            if generation_allowance(engine_version=self.engine_version, max_staleness=self.opts.max_staleness,
                                    groups_per_step=self.groups_per_step, batches_taken=self.batches_taken,
                                    live_groups=live) <= 0:
                return
            if self._to_start:
                group = self._to_start.pop(0)
            else:
                if self._regenerate:
                    prompt = self._regenerate.pop(0)
                    group_index = self.state.next_group_index
                    self.state.next_group_index += 1
                else:
                    group_index, prompt = self.prompts.take()
                group = _Running(group_index, prompt, make_group(prompt, group_index, self.opts.n_samples_per_prompt))
            group.task = asyncio.ensure_future(run_group(self.run, self.generate_fn, group.samples,
                                                         self.sampling_params, self.hooks, prompt=group.prompt))
            self.running.append(group)
            self._account_busy()
            self._submitted_since_take += 1
            self.result.groups_submitted += 1

    def _finish(self, group: _Running, samples: list[Sample]) -> None:
        self._finished.append(samples)
        if group.superseded:  # already counted as a dropped group: only its samples' fates are counted now
            self._count_samples_only(samples)
            return
        kept = keep_group(samples, self.opts.dynamic_filter, self.result, self.hooks.dynamic_filter, self.args)
        if kept is None:
            return
        if self.too_stale(kept):
            self._stale(group, kept)
            return
        self.buffer.append(BufferedGroup(group.group_index, group.prompt, kept, time.monotonic()))

    def _count_samples_only(self, samples: list[Sample]) -> None:
        """A superseded group's end: its FAILED, aborted and unrewarded samples are counted (and FAILED ones
        dumped) as for any group, the group itself was counted as stale when it was superseded."""
        scratch = RolloutResult(groups=[])
        keep_group(samples, None, scratch)
        self.result.failed.extend(scratch.failed)
        self.result.episodes += scratch.episodes
        self.result.dropped.update({k: v for k, v in scratch.dropped.items() if k.endswith("_sample")})
        self.counters.stale_samples += len(samples)

    def _stale(self, group: _Running | BufferedGroup, samples: list[Sample]) -> None:
        """Count a too-stale group and apply --stale-group-policy."""
        self.counters.stale_samples += len(samples)
        drop_group(self.result, group.group_index, "stale_group")
        self._handle_stale_prompt(group.prompt)

    def _handle_stale_prompt(self, prompt: Sample) -> None:
        if self.opts.stale_group_policy == "regenerate":
            self._regenerate.append(prompt)
            self.counters.stale_groups_regenerated += 1
        else:
            self.counters.stale_groups_dropped += 1

    def _supersede_stale_running(self) -> None:
        for group in self.running:
            if group.superseded:
                continue
            with_tokens = [s for s in group.samples if s.weight_versions]
            if with_tokens and self.too_stale(with_tokens):
                group.superseded = True
                drop_group(self.result, group.group_index, "stale_group")
                self._handle_stale_prompt(group.prompt)

    def _drop_stale_buffered(self) -> None:
        fresh = []
        for group in self.buffer:
            if self.too_stale(group.samples):
                self._stale(group, group.samples)
            else:
                fresh.append(group)
        if len(fresh) != len(self.buffer):
            self.buffer = fresh
            self._wake.set()  # freed allowance

    def _submission_bound(self) -> int:
        return (MAX_GROUPS_FACTOR + self.opts.max_staleness + 1) * self.groups_per_step

    def _spent(self) -> bool:
        """This step's submissions are bounded and nothing that could still fill the batch is running."""
        return (self._submitted_since_take >= self._submission_bound()
                and not any(not g.superseded for g in self.running) and not self._to_start)

    def _raise_if_failed(self) -> None:
        if self._task is not None and self._task.done():
            if self._task.cancelled():
                raise RuntimeError("the rollout stream was cancelled")
            error = self._task.exception()
            if error is not None:
                raise error
            if not self._closing:
                raise RuntimeError("the rollout stream stopped unexpectedly")

    def _account_busy(self) -> None:
        now = time.monotonic()
        if self._busy_since is not None:
            self._busy_s += now - self._busy_since
        self._busy_since = now if self.running else None

    # -------------------------------------------------------------------------- resume
    def _restore(self, carried: list[CarriedGroup]) -> None:
        """Carried groups of a checkpoint: finished ones (every sample done) straight into the buffer, the others
        started first. (A synchronous run's partial groups resume here too: their finished episodes pass through.)"""
        for group in carried:
            if all(s.status not in RUNNABLE for s in group.samples):
                self.buffer.append(BufferedGroup(group.group_index, group.prompt, list(group.samples),
                                                 time.monotonic()))
            else:
                self._to_start.append(_Running(group.group_index, group.prompt, list(group.samples)))

