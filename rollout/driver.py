"""One rollout step: groups of n episodes per prompt, concurrency, filtering, stragglers, partial rollout.

`generate_rollout(args, rollout_id, data_source)` is the default `--rollout-function-path`. It

* takes prompts from `data_source.next_batch()` and runs `n_samples_per_prompt` episodes per prompt (one
  group, sharing `group_index`) with the per-sample function of `--custom-generate-function-path`;
* bounds concurrent `/generate` requests with the context's semaphore (env time holds no slot);
* drops FAILED episodes from their group (counted), and whole groups by the dynamic filter (`zero_std`:
  every reward equal, so GRPO advantages are all zero), over-sampling prompts to still fill the batch, up to a
  bounded number of extra groups;
* once enough groups are kept, aborts the stragglers: with `--partial-rollout` their episodes are suspended
  and resumed first in the next step (their old tokens optionally masked), otherwise they are dropped and
  counted;
* stamps `rollout_id` into each sample's metadata.

Prompts fetched from the source but not used in a step stay buffered (in the context's driver state) for the
next step, so over-sampling never silently skips data.
"""

from __future__ import annotations

import asyncio
import copy
import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

from rollout.loading import load_function
from rollout.multiturn import get_context
from rollout.sample import Sample, Status

logger = logging.getLogger(__name__)

# Over-sampling stops after this many times the target number of groups, so a task where every group has
# equal rewards cannot spin forever; the shortfall is reported.
MAX_GROUPS_FACTOR = 4


class PromptSource(Protocol):
    def next_batch(self) -> list[Sample]: ...


@dataclass
class RolloutResult:
    """The groups kept for training and the accounting of everything that was not."""

    groups: list[list[Sample]]
    dropped: Counter = field(default_factory=Counter)
    failed: list[Sample] = field(default_factory=list)
    groups_submitted: int = 0

    @property
    def samples(self) -> list[Sample]:
        return [s for g in self.groups for s in g]


@dataclass
class _Group:
    samples: list[Sample]
    task: asyncio.Task | None = None
    resumed: bool = False


class _Prompts:
    """Hands out one prompt at a time from a batch-wise source, numbering groups globally."""

    def __init__(self, source: PromptSource, first_group_index: int, buffer: list[Sample]):
        self.source = source
        # Shared with the context's driver state: prompts fetched but not used stay for the next step.
        self.buffer = buffer
        self.next_group_index = first_group_index

    def take(self) -> tuple[int, Sample]:
        if not self.buffer:
            batch = list(self.source.next_batch())
            if not batch:
                raise RuntimeError(f"the prompt source {type(self.source).__name__}.next_batch() returned an empty batch")
            self.buffer.extend(batch)
        group_index = self.next_group_index
        self.next_group_index += 1
        return group_index, self.buffer.pop(0)


def make_group(prompt: Sample, group_index: int, n: int) -> list[Sample]:
    """n independent copies of a prompt sample, sharing `group_index`, with `index` 0..n-1."""
    group = []
    for i in range(n):
        s = copy.deepcopy(prompt)
        s.group_index = group_index
        s.index = i
        s.metadata["prompt_index"] = prompt.index
        group.append(s)
    return group


def _keep_group(group: list[Sample], dynamic_filter: str | None, result: RolloutResult) -> list[Sample] | None:
    """Apply the failure policy and the dynamic filter; count every drop by reason."""
    kept = []
    for s in group:
        if s.status is Status.FAILED:
            result.failed.append(s)
            result.dropped["failed_sample"] += 1
        elif s.status is Status.ABORTED:
            result.dropped["aborted_sample"] += 1
        elif s.reward is None:
            result.dropped["no_reward_sample"] += 1
        else:
            kept.append(s)
    if not kept:
        result.dropped["empty_group"] += 1
        return None
    if dynamic_filter == "zero_std" and len({float(s.reward) for s in kept}) == 1:
        result.dropped["zero_std_group"] += 1
        return None
    return kept


# A resumed group may hold episodes that already finished in an earlier step: they pass through unchanged.
_RUNNABLE = (Status.PENDING, Status.ABORTED)


async def _run_episode(generate_fn: Callable, args: Any, sample: Sample) -> Sample:
    """One episode through the loaded function; a function that raises fails its sample, not the rollout."""
    if sample.status not in _RUNNABLE:
        return sample
    params = None  # the episode function derives sampling params from args
    try:
        out = await generate_fn(args, sample, params)
    except Exception as e:  # user code: record on the sample (the default loop never raises)
        name = getattr(generate_fn, "__qualname__", repr(generate_fn))
        logger.warning("%s: generate function %s raised %s: %s", sample.name, name, type(e).__name__, e)
        # Set directly: the transition table has no ABORTED -> FAILED edge, but a resumed episode can fail too.
        sample.status = Status.FAILED
        sample.metadata["error"] = f"generate function {name} raised {type(e).__name__}: {e}"
        sample.metadata["termination"] = "generate_exception"
        return sample
    if not isinstance(out, Sample):
        raise TypeError(
            f"--custom-generate-function-path {getattr(generate_fn, '__qualname__', generate_fn)!r} returned "
            f"{type(out).__name__} for {sample.name}; it must return the Sample"
        )
    return out


async def _run_group(generate_fn: Callable, args: Any, group: list[Sample]) -> list[Sample]:
    return list(await asyncio.gather(*(_run_episode(generate_fn, args, s) for s in group)))


async def generate_rollout(args: Any, rollout_id: int, data_source: PromptSource) -> RolloutResult:
    """Produce `rollout_batch_size` groups for one training step (fewer only if over-sampling is exhausted)."""
    ctx = get_context(args)
    generate_fn = load_function(args.custom_generate_function_path, "--custom-generate-function-path")
    target = int(args.rollout_batch_size)
    n = int(args.n_samples_per_prompt)
    dynamic_filter = getattr(args, "dynamic_filter", None)
    partial = bool(getattr(args, "partial_rollout", False))
    submit_batch = int(getattr(args, "over_sampling_batch_size", None) or target)
    result = RolloutResult(groups=[])
    ctx_state = ctx.driver_state
    prompts = _Prompts(data_source, getattr(args, "_next_group_index", 0), ctx_state.setdefault("prompt_buffer", []))

    pending: list[_Group] = []
    # Groups suspended by the previous step go first, so partially generated work is not lost.
    for samples in ctx_state.get("partial_groups", []):
        if getattr(args, "mask_offpolicy_in_partial_rollout", False):
            for s in samples:
                if s.status is Status.ABORTED:  # only episodes that continue; finished ones pass through
                    _mask_existing_response(s)
        pending.append(_Group(samples=samples, resumed=True))
    ctx_state["partial_groups"] = []

    running: list[_Group] = []

    def submit(group: _Group) -> None:
        group.task = asyncio.ensure_future(_run_group(generate_fn, args, group.samples))
        running.append(group)
        result.groups_submitted += 1

    ctx.aborting = False
    try:
        for group in pending:
            submit(group)
        while len(running) < submit_batch:
            group_index, prompt = prompts.take()
            submit(_Group(samples=make_group(prompt, group_index, n)))

        max_groups = MAX_GROUPS_FACTOR * max(target, submit_batch) + len(pending)
        while running and len(result.groups) < target:
            done, _ = await asyncio.wait([g.task for g in running], return_when=asyncio.FIRST_COMPLETED)
            for group in [g for g in running if g.task in done]:
                running.remove(group)
                samples = group.task.result()
                for s in samples:
                    s.metadata["rollout_id"] = rollout_id
                if len(result.groups) >= target:
                    # Finished in the same wake-up as the group that filled the batch: keep it for the next
                    # step under partial rollout, else it is surplus (counted, never silently lost).
                    if partial:
                        ctx_state["partial_groups"].append(samples)
                        result.dropped["partial_group_carried"] += 1
                    else:
                        result.dropped["surplus_group"] += 1
                        await _discard_aborted(ctx, samples)
                    continue
                kept = _keep_group(samples, dynamic_filter, result)
                # An episode aborted by the engine inside a finished group is not resumed: release its env.
                await _discard_aborted(ctx, samples)
                if kept is not None:
                    result.groups.append(kept)
            missing = target - len(result.groups) - len(running)
            while missing > 0 and result.groups_submitted < max_groups:
                group_index, prompt = prompts.take()
                submit(_Group(samples=make_group(prompt, group_index, n)))
                missing -= 1
    except BaseException:
        # A bug (or cancellation) must not leave episodes running in the background.
        for group in running:
            group.task.cancel()
        await asyncio.gather(*(g.task for g in running), return_exceptions=True)
        raise

    if running:
        await _abort_stragglers(ctx, running, partial, result, ctx_state)
    if len(result.groups) < target:
        logger.warning(
            "rollout %d: only %d of %d groups kept after %d submitted (dropped: %s)",
            rollout_id, len(result.groups), target, result.groups_submitted, dict(result.dropped),
        )
    args._next_group_index = prompts.next_group_index
    return result


async def _abort_stragglers(ctx: Any, running: list[_Group], partial: bool, result: RolloutResult, state: dict) -> None:
    """Stop unfinished groups: episodes see `ctx.aborting`, in-flight requests are aborted by the engine."""
    ctx.aborting = True
    try:
        await ctx.client.abort_all(timeout_s=60.0, retry_interval_s=0.5)
    except Exception as e:  # the engine may already be idle or gone; the episodes will still finish
        logger.warning("abort of straggling requests failed: %s", e)
    outcomes = await asyncio.gather(*(g.task for g in running), return_exceptions=True)
    ctx.aborting = False
    for group, outcome in zip(running, outcomes):
        if isinstance(outcome, BaseException):
            result.dropped["straggler_group_error"] += 1
            logger.warning("straggling group raised %s: %s", type(outcome).__name__, outcome)
            continue
        if partial:
            # Aborted episodes resume next step; episodes that finished while aborting pass through then.
            state["partial_groups"].append(outcome)
            result.dropped["partial_group_carried"] += 1
        else:
            result.dropped["straggler_group"] += 1
            await _discard_aborted(ctx, outcome)


async def _discard_aborted(ctx: Any, samples: list[Sample]) -> None:
    """Close the env of every suspended ABORTED episode of `samples` that will not be resumed."""
    for sample in samples:
        if sample.status is not Status.ABORTED:
            continue
        state = ctx.suspended.pop((sample.group_index, sample.index), None)
        if state is None:
            continue
        try:
            closing = state.env.close()
            if asyncio.iscoroutine(closing):
                await closing
        except Exception as e:  # best effort, but said
            logger.warning("%s: env.close() raised %s: %s", sample.name, type(e).__name__, e)


def _mask_existing_response(sample: Sample) -> None:
    """Zero the loss mask of tokens sampled by older weights (they are off-policy after the update).

    The positions of the model tokens masked here are kept in `metadata["offpolicy_masked_runs"]`
    (`[[start, length], ...]` into the response, accumulated over resumptions), so debug dumps and metrics can
    still tell model turns from observations.
    """
    n = sample.response_length
    runs = [list(r) for r in sample.metadata.get("offpolicy_masked_runs", [])]
    start = None
    for i, m in enumerate(sample.loss_mask[:n] + [0]):
        if m == 1 and start is None:
            start = i
        elif m != 1 and start is not None:
            runs.append([start, i - start])
            start = None
    sample.metadata["offpolicy_masked_runs"] = sorted(runs)
    sample.loss_mask[:n] = [0] * n
    sample.rollout_log_probs[:n] = [0.0] * n
    sample.metadata["offpolicy_masked_tokens"] = n


async def close_suspended(args: Any) -> None:
    """Close the environments of every suspended episode (end of a run)."""
    ctx = get_context(args)
    for key in list(ctx.suspended):
        state = ctx.suspended.pop(key)
        try:
            result = state.env.close()
            if asyncio.iscoroutine(result):
                await result
        except Exception as e:  # best effort, but said
            logger.warning("closing suspended episode %s raised %s", key, e)
