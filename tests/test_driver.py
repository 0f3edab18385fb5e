"""The rollout driver (`rollout.driver.generate_rollout`) against a real scripted SGLang-speaking server.

Episodes run the default multi-turn loop with the tiny tokenizer and scripted environments; the fake server
records every request, so concurrency, aborts and weight versions are checked from the server's side.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import types
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

from envs.base import BaseInteractionEnv
from rollout.client import RetryPolicy, SGLangClient
from rollout.driver import (
    DRIVER_STATE_VERSION,
    MAX_GROUPS_FACTOR,
    CarriedGroup,
    DriverState,
    DriverStateError,
    RolloutResult,
    close_suspended,
    driver_checkpoint_state,
    generate_rollout,
    restore_driver_state,
)
from rollout.dump import dump_samples, validate_dump
from rollout.encoding import ChatEncoder
from rollout.fake_engine import FakeSGLangServer, Hang, RecordedRequest, Tokens
from rollout.loading import LoadError
from rollout.multiturn import RolloutContext, turn_seed
from rollout.sample import Sample, Status, TurnRecord


# ----------------------------------------------------------------------------- scripted pieces
@dataclass
class EnvSpec:
    """How the env of one episode behaves: `turns` model turns until done, its verdict, a sleep per step."""

    turns: int = 2
    reward: float = 1.0
    step_sleep_s: float = 0.0
    raise_msg: str | None = None


class PlannedEnv(BaseInteractionEnv):
    """Answers `spec.turns - 1` observations then done; logs its step intervals and closes."""

    def __init__(self, sample: Sample, spec: EnvSpec, log: "EnvLog"):
        self.key = (sample.group_index, sample.index)
        self.sample = sample  # the live Sample the episode loop mutates
        self.spec = spec
        self.log = log
        self.steps = 0
        self.closed = 0

    def reset(self) -> None:
        pass

    async def step(self, response_text: str):
        start = time.perf_counter()
        if self.spec.step_sleep_s:
            await asyncio.sleep(self.spec.step_sleep_s)
        self.log.intervals.append((start, time.perf_counter()))
        if self.spec.raise_msg:
            raise RuntimeError(self.spec.raise_msg)
        self.steps += 1
        if self.steps >= self.spec.turns:
            return {"obs_str": ""}, True, {}
        return {"obs_str": f"observation {self.steps} for {self.key}"}, False, {}

    def verdict(self) -> float:
        return self.spec.reward

    def close(self) -> None:
        self.closed += 1


@dataclass
class EnvLog:
    envs: dict[tuple[int, int], list[PlannedEnv]] = field(default_factory=dict)
    intervals: list[tuple[float, float]] = field(default_factory=list)
    created: list[PlannedEnv] = field(default_factory=list)  # in build order

    def all(self) -> list[PlannedEnv]:
        return [e for envs in self.envs.values() for e in envs]


def env_module(plan: Callable[[Sample], EnvSpec], log: EnvLog) -> types.ModuleType:
    def build_env(sample: Sample, args: Any) -> PlannedEnv:
        env = PlannedEnv(sample, plan(sample), log)
        log.envs.setdefault(env.key, []).append(env)
        log.created.append(env)
        return env

    module = types.ModuleType("planned_env")
    module.build_env = build_env
    return module


class PromptSource:
    """Batches of `batch` text prompts numbered 0, 1, 2, ... (label = the number as text)."""

    def __init__(self, batch: int = 4, start: int = 0):
        self.batch = batch
        self.served = start  # the data cursor a checkpoint saves: a resumed source starts here
        self.calls = 0

    def next_batch(self) -> list[Sample]:
        self.calls += 1
        out = []
        for _ in range(self.batch):
            k = self.served
            out.append(Sample(prompt=[{"role": "user", "content": f"Question number {k}?"}], label=str(k), index=k))
            self.served += 1
        return out


def prompt_number(sample: Sample) -> int:
    return int(sample.label)


def max_overlap(intervals: list[tuple[float, float]]) -> int:
    events = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals])
    best = cur = 0
    for _, delta in events:
        cur += delta
        best = max(best, cur)
    return best


@pytest.fixture(scope="module")
def encoder(tiny_tokenizer, tiny_image_processor) -> ChatEncoder:
    return ChatEncoder(tiny_tokenizer, tiny_image_processor)


@dataclass
class Harness:
    args: types.SimpleNamespace
    server: FakeSGLangServer
    ctx: RolloutContext
    log: EnvLog
    peak_in_flight: list[int]


@contextlib.asynccontextmanager
async def harness(
    encoder: ChatEncoder,
    plan: Callable[[Sample], EnvSpec],
    *,
    concurrency: int = 16,
    select: Callable[[RecordedRequest], Any] | None = None,
    latency_s: float = 0.0,
    **overrides: Any,
) -> AsyncIterator[Harness]:
    """A fake engine, a client, a rollout context and driver args; `select` scripts /generate requests."""
    reply = encoder.tokenize("the answer") + [encoder.vision.im_end]
    peak: list[int] = []
    server: FakeSGLangServer | None = None

    def selector(record: RecordedRequest) -> Any:
        # Consulted as a request arrives, before the server counts it in flight.
        peak.append(server.num_in_flight + 1)
        return select(record) if select is not None else None

    server = FakeSGLangServer(
        script=selector,
        generate_fn=lambda body: Tokens(output_ids=tuple(reply), log_probs=tuple(-0.25 for _ in reply)),
        eos_token_id=encoder.vision.im_end,
        image_token_id=encoder.vision.image_pad,
        latency_s=latency_s,
        weight_version="v1",
    )
    log = EnvLog()
    async with server:
        client = SGLangClient(server.url, timeout_s=10.0, retry=RetryPolicy(max_retries=0))
        async with client:
            ctx = RolloutContext(client=client, encoder=encoder, env_module=env_module(plan, log),
                                 generate_slots=asyncio.Semaphore(concurrency))
            base = dict(
                rollout_batch_size=2, n_samples_per_prompt=2, over_sampling_batch_size=None, dynamic_filter=None,
                partial_rollout=False, mask_offpolicy_in_partial_rollout=False,
                custom_generate_function_path="rollout.multiturn.generate",
                rollout_max_response_len=400, rollout_max_context_len=None, max_turns=4, max_env_retries_per_turn=0,
                env_step_timeout=10.0, episode_timeout=30.0, delta_check="strict", rollout_temperature=1.0,
                rollout_top_p=1.0, rollout_top_k=-1, rollout_stop_token_ids=[], rollout_context=ctx,
            )
            base.update(overrides)
            yield Harness(types.SimpleNamespace(**base), server, ctx, log, peak)


def rid_of(record: RecordedRequest) -> str:
    return str(record.body.get("rid", ""))


def check_accounting(result: RolloutResult) -> None:
    """Every submitted group is kept or counted under exactly one group-level reason."""
    group_reasons = ("zero_std_group", "empty_group", "straggler_group", "partial_group_carried", "surplus_group",
                     "straggler_group_error")
    assert result.groups_submitted == len(result.groups) + sum(result.dropped[r] for r in group_reasons)


async def run(h: Harness, rollout_id: int, source: PromptSource, timeout_s: float = 30.0) -> RolloutResult:
    return await asyncio.wait_for(generate_rollout(h.args, rollout_id, source), timeout_s)


# ----------------------------------------------------------------------------- groups and numbering
async def test_groups_share_index_and_are_numbered_across_steps(encoder):
    source = PromptSource(batch=4)
    async with harness(encoder, lambda s: EnvSpec(turns=2, reward=float(s.index)), n_samples_per_prompt=3) as h:
        first = await run(h, 0, source)
        h.server.weight_version = "v2"
        second = await run(h, 1, source)

    for result, rollout_id, version in ((first, 0, "v1"), (second, 1, "v2")):
        assert len(result.groups) == 2 and not result.failed
        check_accounting(result)
        for group in result.groups:
            assert [s.index for s in group] == [0, 1, 2]
            assert len({s.group_index for s in group}) == 1
            assert len({s.label for s in group}) == 1  # one prompt per group
            for s in group:
                s.validate(image_token_id=encoder.vision.image_pad, vision_start_token_id=encoder.vision.vision_start)
                assert s.status is Status.COMPLETED and s.metadata["rollout_id"] == rollout_id
                assert s.weight_versions == [version]
                assert s.reward == float(s.index)
                assert s.metadata["prompt_index"] == prompt_number(s)
    # Groups are numbered globally: the second step continues where the first stopped.
    assert sorted(g[0].group_index for g in first.groups) == [0, 1]
    assert sorted(g[0].group_index for g in second.groups) == [2, 3]
    # Prompts fetched in one batch but unused by step 0 are used by step 1, not skipped.
    used = sorted(prompt_number(g[0]) for r in (first, second) for g in r.groups)
    assert used == [0, 1, 2, 3] and source.calls == 1
    assert all(e.closed == 1 for e in h.log.all()) and len(h.log.all()) == 12


# ----------------------------------------------------------------------------- concurrency
async def test_concurrency_limit_bounds_in_flight_generate_requests(encoder):
    async with harness(encoder, lambda s: EnvSpec(turns=2), concurrency=3, latency_s=0.03,
                       rollout_batch_size=4, n_samples_per_prompt=2) as h:
        result = await run(h, 0, PromptSource(batch=4))
    assert len(result.samples) == 8 and len(h.server.requests_to("/generate")) == 16
    # The limit binds (it is reached) and is never exceeded, as seen by the server.
    assert max(h.peak_in_flight) == 3


async def test_env_time_holds_no_generate_slot(encoder):
    sleep = 0.25
    async with harness(encoder, lambda s: EnvSpec(turns=2, step_sleep_s=sleep), concurrency=1,
                       rollout_batch_size=2, n_samples_per_prompt=2) as h:
        t0 = time.perf_counter()
        result = await run(h, 0, PromptSource(batch=2))
        wall = time.perf_counter() - t0
    assert len(result.samples) == 4 and max(h.peak_in_flight) == 1
    # With one generation slot, several episodes were inside env.step at the same time...
    assert max_overlap(h.log.intervals) >= 3
    # ...so the rollout took far less than running the 8 env steps one after another.
    assert wall < 0.6 * 8 * sleep


# ----------------------------------------------------------------------------- dynamic filter
async def test_zero_std_filter_oversamples_to_fill_the_batch(encoder):
    # Even prompts: both samples get reward 1 (zero std); odd prompts: rewards 0 and 1.
    def plan(s: Sample) -> EnvSpec:
        return EnvSpec(turns=1, reward=1.0 if prompt_number(s) % 2 == 0 else float(s.index))

    async with harness(encoder, plan, dynamic_filter="zero_std", rollout_batch_size=2) as h:
        result = await run(h, 0, PromptSource(batch=2))
    assert len(result.groups) == 2
    for group in result.groups:
        assert prompt_number(group[0]) % 2 == 1 and sorted(s.reward for s in group) == [0.0, 1.0]
    assert result.dropped["zero_std_group"] >= 2
    assert result.groups_submitted > 2  # over-sampled
    check_accounting(result)


async def test_oversampling_is_bounded_when_every_group_has_equal_rewards(encoder, caplog):
    async with harness(encoder, lambda s: EnvSpec(turns=1, reward=0.5), dynamic_filter="zero_std",
                       rollout_batch_size=2) as h:
        with caplog.at_level(logging.WARNING, logger="rollout.driver"):
            result = await run(h, 0, PromptSource(batch=3))
    assert result.groups == []
    assert result.groups_submitted == MAX_GROUPS_FACTOR * 2
    assert result.dropped["zero_std_group"] == MAX_GROUPS_FACTOR * 2
    assert any("only 0 of 2 groups kept" in r.getMessage() for r in caplog.records)
    check_accounting(result)


# ----------------------------------------------------------------------------- stragglers and partial rollout
async def test_stragglers_are_aborted_once_the_batch_is_full(encoder):
    # Groups 1 and 2 hang on their first request until the driver aborts them.
    def select(record: RecordedRequest):
        return Hang() if rid_of(record).startswith(("g1-", "g2-")) else None

    async with harness(encoder, lambda s: EnvSpec(turns=2), select=select, rollout_batch_size=1,
                       over_sampling_batch_size=3) as h:
        result = await run(h, 0, PromptSource(batch=3))
        paths = h.server.paths
    assert [g[0].group_index for g in result.groups] == [0]
    assert result.dropped["straggler_group"] == 2
    assert "/abort_request" in paths
    stragglers = [e for key, envs in h.log.envs.items() if key[0] in (1, 2) for e in envs]
    assert len(stragglers) == 4 and all(e.closed == 1 for e in stragglers)
    for env in stragglers:
        assert env.sample.status is Status.ABORTED and str(env.sample.termination) == "abort"
        assert env.sample.turns[-1].finish_reason == "abort"
    assert h.ctx.suspended == {} and h.ctx.aborting is False
    check_accounting(result)


@pytest.mark.parametrize("mask_offpolicy", [False, True])
async def test_partial_rollout_resumes_aborted_episodes_first(encoder, mask_offpolicy, tmp_path):
    hang_enabled = True

    def select(record: RecordedRequest):
        # Episode (group 1, index 1) hangs in its second turn while step 0 runs.
        return Hang() if hang_enabled and rid_of(record).startswith("g1-s1-t1-") else None

    def plan(s: Sample) -> EnvSpec:
        slow = s.group_index != 1  # group 1 must finish its resumed work before any new group
        return EnvSpec(turns=2, reward=float(s.index), step_sleep_s=0.3 if slow else 0.0)

    source = PromptSource(batch=2)
    async with harness(encoder, plan, select=select, rollout_batch_size=1, over_sampling_batch_size=2,
                       partial_rollout=True, mask_offpolicy_in_partial_rollout=mask_offpolicy) as h:
        first = await run(h, 0, source)
        assert [g[0].group_index for g in first.groups] == [0]
        assert first.dropped["partial_group_carried"] == 1
        assert set(h.ctx.suspended) == {(1, 1)}
        carried = h.args.driver_state.partial_groups[0]
        done_before, aborted_before = carried.samples
        assert done_before.status is Status.COMPLETED and aborted_before.status is Status.ABORTED
        old_done_tokens = list(done_before.tokens)
        old_tokens, old_mask = list(aborted_before.tokens), list(aborted_before.loss_mask)
        old_response = aborted_before.response_length
        assert h.log.envs[(1, 1)][0].closed == 0  # suspended, not closed

        hang_enabled = False
        h.server.weight_version = "v2"
        second = await run(h, 1, source)
        # The group carried from step 0 ran first and filled the batch; the new group is carried on.
        assert [g[0].group_index for g in second.groups] == [1]
        done, resumed = second.groups[0]
        await close_suspended(h.args)

    assert resumed.status is Status.COMPLETED and resumed.tokens[: len(old_tokens)] == old_tokens
    assert resumed.weight_versions == ["v1", "v2"]
    resumed.validate(image_token_id=encoder.vision.image_pad, vision_start_token_id=encoder.vision.vision_start)
    new_mask = resumed.loss_mask[old_response:]
    assert 1 in new_mask  # the tokens generated after resuming are trained on
    if mask_offpolicy:
        assert resumed.loss_mask[:old_response] == [0] * old_response
        assert set(resumed.rollout_log_probs[:old_response]) == {0.0}
        runs = resumed.metadata["offpolicy_masked_runs"]
        assert sum(n for _, n in runs) == sum(old_mask) and all(old_mask[a] == 1 for a, _ in runs)
    else:
        assert resumed.loss_mask[:old_response] == old_mask
    # The episode that had finished in step 0 passes through unchanged (never re-run, never masked).
    assert done.status is Status.COMPLETED and done.tokens == old_done_tokens
    assert done.weight_versions == ["v1"] and "errors" not in done.metadata and 0 not in done.loss_mask[:1]
    assert h.log.envs[(1, 1)][0].closed == 1 and len(h.log.envs[(1, 1)]) == 1  # resumed in the same env
    assert all(e.closed == 1 for e in h.log.all())
    check_accounting(first)
    check_accounting(second)
    # The debug dump still splits the resumed episode into its model turns, masked or not.
    dump_samples([done, resumed], tmp_path / "d.jsonl", encoder.tokenizer)
    _, rec = validate_dump(tmp_path / "d.jsonl")
    assert rec["records_aligned"] and [t["model_tokens"] > 0 for t in rec["turns"]] == [True, True]
    assert rec["turns"][0]["weight_version"] == "v1" and rec["turns"][1]["weight_version"] == "v2"
    masked_first = rec["turns"][0]["offpolicy_masked_tokens"]
    assert masked_first == (rec["turns"][0]["model_tokens"] if mask_offpolicy else 0)


# ----------------------------------------------------------------------------- checkpoint and resume
def checkpoint(h: Harness) -> dict[str, Any]:
    """What the trainer saves between steps: the driver state after the JSON trip the checkpoint meta makes."""
    return json.loads(json.dumps(driver_checkpoint_state(h.args)))


def built_since(log: EnvLog, start: int) -> list[tuple[tuple[int, int], int]]:
    """(group, index) and prompt number of every env built after the first `start`: the episodes a step ran."""
    return sorted((env.key, prompt_number(env.sample)) for env in log.created[start:])


def kept_groups(result: RolloutResult) -> list[tuple[int, int]]:
    return sorted((g[0].group_index, prompt_number(g[0])) for g in result.groups)


def first_seeds(server: FakeSGLangServer) -> dict[tuple[int, int, int], int]:
    """Sampling seed of the first /generate request of each (group, index, turn), parsed from the request id."""
    seeds: dict[tuple[int, int, int], int] = {}
    for record in server.requests_to("/generate"):
        g, s, t = (int(part[1:]) for part in rid_of(record).split("-")[:3])
        seeds.setdefault((g, s, t), record.body["sampling_params"]["sampling_seed"])
    return seeds


async def test_buffered_prompts_survive_checkpoint_and_resume(encoder):
    # Prompts 0 and 3 give zero-std groups: step 0 drops group 0 and over-samples prompt 2, leaving prompts 3
    # and 4 of the first batch buffered; step 1 starts with them, drops 3 and over-samples from the next batch.
    def plan(s: Sample) -> EnvSpec:
        return EnvSpec(turns=1, reward=1.0 if prompt_number(s) in (0, 3) else float(s.index))

    options = dict(dynamic_filter="zero_std", rollout_batch_size=2)
    source = PromptSource(batch=5)
    async with harness(encoder, plan, **options) as h:
        first = await run(h, 0, source)
        state, next_index, cursor = checkpoint(h), h.args.driver_state.next_group_index, source.served
        start = len(h.log.created)
        uninterrupted = await run(h, 1, source)
        want_built, want_state = built_since(h.log, start), checkpoint(h)
    assert kept_groups(first) == [(1, 1), (2, 2)] and first.dropped["zero_std_group"] == 1
    assert [int(d["label"]) for d in state["prompt_buffer"]] == [3, 4] and (next_index, cursor) == (3, 5)

    async with harness(encoder, plan, **options) as fresh:  # a new process: fresh args, context and source
        restore_driver_state(fresh.args, state)
        assert fresh.args.driver_state.next_group_index == next_index
        assert checkpoint(fresh) == state  # restored exactly
        resumed = await run(fresh, 1, PromptSource(batch=5, start=cursor))
        got_built, got_state = built_since(fresh.log, 0), checkpoint(fresh)

    # The resumed step runs exactly the uninterrupted step's prompts under the same group indices (without the
    # restore it would have skipped prompts 3 and 4 and numbered prompts 5 and 6 as groups 3 and 4).
    assert want_built == [((g, i), g) for g in (3, 4, 5) for i in (0, 1)]
    assert got_built == want_built
    assert kept_groups(resumed) == kept_groups(uninterrupted) == [(4, 4), (5, 5)]
    assert [s.tokens for s in resumed.samples] == [s.tokens for s in uninterrupted.samples]
    assert fresh.args.driver_state.next_group_index == h.args.driver_state.next_group_index == 6
    assert got_state == want_state and [int(d["label"]) for d in got_state["prompt_buffer"]] == [6, 7, 8, 9]
    check_accounting(resumed)


async def test_carried_partial_groups_restart_on_resume_with_their_group_index(encoder):
    hang_enabled = True

    def select(record: RecordedRequest):
        # Episode (group 1, index 1) hangs in its second turn while step 0 runs, so group 1 is carried.
        return Hang() if hang_enabled and rid_of(record).startswith("g1-s1-t1-") else None

    def plan(s: Sample) -> EnvSpec:
        # Group 1 is fast, so in step 1 it fills the batch and the new group 2 is carried on.
        return EnvSpec(turns=2, reward=float(s.index), step_sleep_s=0.0 if s.group_index == 1 else 0.4)

    options = dict(select=select, rollout_batch_size=1, over_sampling_batch_size=2, partial_rollout=True,
                   rollout_seed=7)
    source = PromptSource(batch=2)
    async with harness(encoder, plan, **options) as h:
        await run(h, 0, source)
        state, next_index, cursor = checkpoint(h), h.args.driver_state.next_group_index, source.served
        step0_seeds = first_seeds(h.server)
        done_before = h.args.driver_state.partial_groups[0].samples[0].to_dict()  # step 1 stamps its rollout_id
        hang_enabled = False
        h.server.weight_version = "v2"
        uninterrupted = await run(h, 1, source)
        want_state = checkpoint(h)
        await close_suspended(h.args)
    [carried] = state["partial_groups"]
    assert (carried["group_index"], carried["restart"], carried["prompt"]["label"]) == (1, [1], "1")
    assert [(d["index"], d["status"]) for d in carried["finished"]] == [(0, "completed")]
    assert carried["finished"][0] == done_before

    async with harness(encoder, plan, **options) as fresh:
        fresh.server.weight_version = "v2"
        restore_driver_state(fresh.args, state)
        assert fresh.args.driver_state.next_group_index == next_index
        [restored] = fresh.args.driver_state.partial_groups
        assert restored.group_index == 1 and [s.status for s in restored.samples] == [Status.COMPLETED, Status.PENDING]
        resumed = await run(fresh, 1, PromptSource(batch=2, start=cursor))
        got_state = checkpoint(fresh)
        restart_seeds = first_seeds(fresh.server)
        await close_suspended(fresh.args)

    # Same groups kept and carried as the uninterrupted run; the carried group 2 checkpoints identically.
    assert [g[0].group_index for g in resumed.groups] == [g[0].group_index for g in uninterrupted.groups] == [1]
    assert fresh.args.driver_state.next_group_index == h.args.driver_state.next_group_index == 3
    assert got_state == want_state and [g["group_index"] for g in got_state["partial_groups"]] == [2]
    assert got_state["partial_groups"][0]["restart"] == [0, 1]
    # The finished episode is kept exactly as the uninterrupted run kept it, and never touched an env again.
    done, restarted = resumed.groups[0]
    assert done.to_dict() == uninterrupted.groups[0][0].to_dict() and (1, 0) not in fresh.log.envs
    # The unfinished episode restarted from the prompt in a new env, with a fresh episode's sampling seeds.
    assert restarted.status is Status.COMPLETED and restarted.metadata["restarted_on_resume"] is True
    assert restarted.weight_versions == ["v2"] and [t.turn for t in restarted.turns] == [0, 1]
    restarted.validate(image_token_id=encoder.vision.image_pad, vision_start_token_id=encoder.vision.vision_start)
    assert restarted.metadata["prompt_index"] == 1 and restarted.label == "1"
    assert len(fresh.log.envs[(1, 1)]) == 1 and fresh.log.envs[(1, 1)][0].closed == 1
    fresh_episode = Sample(group_index=1, index=1)
    want_seeds = {(1, 1, t): turn_seed(7, fresh_episode, t, t) for t in (0, 1)}
    assert {k: v for k, v in restart_seeds.items() if k[:2] == (1, 1)} == want_seeds
    assert {k: v for k, v in step0_seeds.items() if k[:2] == (1, 1)} == want_seeds
    check_accounting(resumed)


def offline_args(**extra: Any) -> types.SimpleNamespace:
    """Args with a rollout context that is never used to run episodes (no engine, no env)."""
    ctx = RolloutContext(client=None, encoder=None, env_module=None, generate_slots=asyncio.Semaphore(1))
    return types.SimpleNamespace(rollout_context=ctx, **extra)


def rich_driver_state() -> tuple[types.SimpleNamespace, Sample, Sample, Sample]:
    """A context holding a buffered prompt and a carried group (one finished episode with image tensors, one
    aborted); returns the args, the prompt, the finished and the aborted sample."""
    from rollout.driver import make_group

    url = "data:image/png;base64,iVBORw0KGgo="
    prompt = Sample(prompt=[{"role": "user", "content": [{"type": "image", "image": url}, {"type": "text", "text": "?"}]}],
                    label="42", index=9, metadata={"tools": [{"name": "calc"}], "weights": np.arange(3, dtype=np.int16)})
    finished, aborted = make_group(prompt, 5, 2)
    finished.set_prompt_tokens([1, 2, 3])
    finished.append_model_tokens([4, 5], [-0.5, -0.125])
    finished.append_observation_tokens([6])
    finished.multimodal_train_inputs = {"pixel_values": np.linspace(0, 1, 24, dtype=np.float32).reshape(4, 6),
                                        "image_grid_thw": np.array([[1, 2, 2]], dtype=np.int64)}
    finished.turns = [TurnRecord(turn=0, generated_tokens=2, finish_reason="stop", weight_version="v1")]
    finished.weight_versions, finished.reward = ["v1"], 0.5
    finished.set_status(Status.COMPLETED)
    aborted.set_prompt_tokens([1, 2, 3])
    aborted.append_model_tokens([7], [-1.0])
    aborted.set_status(Status.ABORTED)
    args = offline_args(driver_state=DriverState(next_group_index=6, prompt_buffer=[prompt],
                                                 partial_groups=[CarriedGroup(5, prompt, [finished, aborted])]))
    return args, prompt, finished, aborted


def test_driver_state_json_round_trip_keeps_every_field():
    args, prompt, finished, aborted = rich_driver_state()
    text = json.dumps(driver_checkpoint_state(args))
    state = json.loads(text)
    assert state["version"] == DRIVER_STATE_VERSION and state["next_group_index"] == 6
    # Only the restart index of the aborted episode is saved, not its partial tokens.
    assert state["partial_groups"][0]["restart"] == [1] and len(state["partial_groups"][0]["finished"]) == 1
    assert aborted.tokens == [1, 2, 3, 7]  # checkpointing only reads: the live run keeps its episode

    fresh = offline_args()
    restore_driver_state(fresh, state)
    assert json.dumps(driver_checkpoint_state(fresh)) == text
    driver = fresh.driver_state
    assert driver.next_group_index == 6
    [buffered] = driver.prompt_buffer
    [carried] = driver.partial_groups
    assert buffered.to_dict() == prompt.to_dict() and carried.prompt.to_dict() == prompt.to_dict()
    assert buffered.metadata["weights"].dtype == np.int16 and buffered.metadata["weights"].tolist() == [0, 1, 2]
    got_finished, restarted = carried.samples
    assert got_finished.to_dict() == finished.to_dict() and got_finished.turns == finished.turns
    for key, value in finished.multimodal_train_inputs.items():
        got = got_finished.multimodal_train_inputs[key]
        assert got.dtype == value.dtype and np.array_equal(got, value)
    assert (restarted.group_index, restarted.index, restarted.status) == (5, 1, Status.PENDING)
    assert restarted.tokens == [] and restarted.response_length == 0 and restarted.turns == []
    assert restarted.metadata["prompt_index"] == 9 and restarted.prompt == prompt.prompt


def _set(path: tuple, value: Any) -> Callable[[dict], Any]:
    def mutate(state: dict) -> dict:
        target = state
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value
        return state
    return mutate


def _delete(key: str) -> Callable[[dict], Any]:
    return lambda state: {k: v for k, v in state.items() if k != key}


@pytest.mark.parametrize(
    ("mutate", "expected"),
    [
        (lambda state: [state], "driver state must be a dict, got list"),
        (_delete("version"), "driver state has no 'version'"),
        (_set(("version",), 5), "driver state version 5 is not supported (this driver reads versions 1, 2, 3, 4)"),
        (_delete("dropped_groups"), "driver state: missing keys ['dropped_groups'], unknown keys []"),
        (_set(("dropped_groups",), [{"group_index": 1}]), "dropped_groups[0]: missing keys ['reason']"),
        (_set(("dropped_groups",), [{"group_index": 1, "reason": ""}]), "dropped_groups[0].reason must be a non-empty"),
        (_delete("unreported"), "driver state: missing keys ['unreported'], unknown keys []"),
        (_set(("unreported", "episodes"), -1), "unreported.episodes must be a non-negative int, got -1"),
        (_set(("unreported", "sample_drops"), {"failed_sample": "2"}),
         "unreported.sample_drops['failed_sample'] must be a non-negative int, got '2'"),
        (_set(("unreported", "failed"), [{"bogus": 1}]), "unreported.failed[0] is not a valid Sample dict"),
        (_set(("dropped_groups",), [{"group_index": 9, "reason": "stale_group"}]),
         "carries groups [9] but its next_group_index is 6"),
        (_delete("filtered_long_prompts"), "driver state: missing keys ['filtered_long_prompts'], unknown keys []"),
        (_delete("next_group_index"), "driver state: missing keys ['next_group_index'], unknown keys []"),
        (_set(("next_group_index",), "6"), "driver state.next_group_index must be a non-negative int, got '6'"),
        (_set(("next_group_index",), 5), "carries groups [5] but its next_group_index is 5"),
        (_delete("partial_groups"), "driver state: missing keys ['partial_groups'], unknown keys []"),
        (_set(("extra",), 1), "unknown keys ['extra']"),
        (_set(("prompt_buffer",), {}), "driver state.prompt_buffer must be a list, got dict"),
        (_set(("prompt_buffer", 0, "bogus"), 1),
         "prompt_buffer[0] is not a valid Sample dict: SampleError: Sample.from_dict: unknown keys ['bogus']"),
        (_set(("prompt_buffer", 0, "loss_mask"), [1]), "prompt_buffer[0] is not a valid Sample dict: SampleError"),
        (_set(("prompt_buffer", 0, "status"), "resting"), "prompt_buffer[0] is not a valid Sample dict: ValueError"),
        (_set(("partial_groups", 0, "group_index"), -1), "partial_groups[0].group_index must be a non-negative int, got -1"),
        (_set(("partial_groups", 0, "restart"), [0, 1]), "(group 5): sample indices [0] appear more than once"),
        (_set(("partial_groups", 0, "restart"), ["1"]), "(group 5).restart[0] must be a non-negative int, got '1'"),
        (_set(("partial_groups", 0, "finished", 0, "status"), "aborted"), "finished sample(group=5, index=0) has status aborted"),
        (_set(("partial_groups", 0, "finished", 0, "group_index"), 4), "finished sample(group=4, index=0) belongs to group 4"),
        (lambda state: {**state, "partial_groups": state["partial_groups"] * 2}, "carries group indices [5] more than once"),
        (_set(("partial_groups", 0, "prompt"), "?"), "partial_groups[0] (group 5).prompt must be a Sample dict, got str"),
    ],
)
def test_malformed_driver_state_is_refused_with_what_is_wrong(mutate, expected):
    args, *_ = rich_driver_state()
    state = mutate(json.loads(json.dumps(driver_checkpoint_state(args))))
    fresh = offline_args()
    with pytest.raises(DriverStateError) as info:
        restore_driver_state(fresh, state)
    assert expected in str(info.value)
    assert fresh.driver_state == DriverState()  # nothing half-restored


def test_driver_state_restore_refuses_a_foreign_counter_or_used_args():
    args, *_ = rich_driver_state()
    state = driver_checkpoint_state(args)
    with pytest.raises(DriverStateError, match=r"has next_group_index 6 but 5 was passed beside it"):
        restore_driver_state(offline_args(), state, next_group_index=5)
    with pytest.raises(DriverStateError, match="already hold driver state .'next_group_index': 6, 'partial_groups': 1, "
                                               "'prompt_buffer': 1"):
        restore_driver_state(args, state)
    suspended = offline_args()
    suspended.rollout_context.suspended[(5, 1)] = object()
    with pytest.raises(DriverStateError, match="already hold driver state {} and 1 suspended episodes"):
        restore_driver_state(suspended, state)


def test_older_checkpoints_restore_with_the_counter_saved_beside_them(caplog):
    args, *_ = rich_driver_state()
    v1 = {k: v for k, v in driver_checkpoint_state(args).items()
          if k not in ("next_group_index", "filtered_long_prompts", "dropped_groups", "unreported")} | {"version": 1}
    with pytest.raises(DriverStateError, match="version 1 driver state has no next_group_index"):
        restore_driver_state(offline_args(), v1)
    fresh = offline_args()
    restore_driver_state(fresh, v1, next_group_index=6)
    assert driver_checkpoint_state(fresh) == driver_checkpoint_state(args)
    # A checkpoint with no driver state at all: the counter only, and a warning that the rest is lost.
    bare = offline_args()
    with caplog.at_level(logging.WARNING, logger="rollout.driver"):
        restore_driver_state(bare, None, next_group_index=4)
    assert bare.driver_state == DriverState(next_group_index=4)
    assert any("no rollout driver state" in r.getMessage() for r in caplog.records)


def test_unserializable_prompt_is_named_at_checkpoint_time():
    args = offline_args()
    args.driver_state = DriverState(prompt_buffer=[Sample(prompt=[{"role": "user", "content": object()}], index=3)])
    with pytest.raises(TypeError, match=r"prompt_buffer\[0\] \(sample\(group=0, index=3\)\) is not JSON-serializable"):
        driver_checkpoint_state(args)



# ----------------------------------------------------------------------------- failures
async def test_failed_episodes_are_dropped_from_their_group_and_listed(encoder):
    def plan(s: Sample) -> EnvSpec:
        return EnvSpec(turns=2, reward=float(s.index), raise_msg="env exploded" if s.index == 1 else None)

    async with harness(encoder, plan, n_samples_per_prompt=3) as h:
        result = await run(h, 0, PromptSource(batch=2))
    assert len(result.groups) == 2
    for group in result.groups:
        assert [s.index for s in group] == [0, 2]
    assert len(result.failed) == 2 and result.dropped["failed_sample"] == 2
    for s in result.failed:
        assert s.index == 1 and s.status is Status.FAILED and "env exploded" in s.metadata["error"]
    assert all(e.closed == 1 for e in h.log.all())


# ----------------------------------------------------------------------------- loading user functions
CUSTOM_GENERATE = '''
from rollout.sample import Status

async def generate(args, sample, sampling_params):
    sample.set_prompt_tokens([1, 2, 3])
    sample.append_model_tokens([4, 5], [-0.1, -0.2])
    sample.reward = float(sample.index)
    sample.set_status(Status.COMPLETED)
    sample.metadata["made_by"] = __name__
    return sample

async def explode(args, sample, sampling_params):
    if sample.index == 0:
        raise ValueError("custom function bug")
    return await generate(args, sample, sampling_params)
'''


@pytest.mark.parametrize("style", ["dotted", "file"])
async def test_custom_generate_function_is_loaded_by_path(encoder, tmp_path, monkeypatch, style):
    (tmp_path / "my_custom_gen.py").write_text(CUSTOM_GENERATE)
    if style == "dotted":
        monkeypatch.syspath_prepend(str(tmp_path))
        path = "my_custom_gen.generate"
    else:
        path = f"{tmp_path / 'my_custom_gen.py'}:generate"
    async with harness(encoder, lambda s: EnvSpec(), custom_generate_function_path=path) as h:
        result = await run(h, 0, PromptSource(batch=2))
        generate_requests = h.server.requests_to("/generate")
    assert len(result.samples) == 4 and generate_requests == []
    for s in result.samples:
        assert s.tokens == [1, 2, 3, 4, 5] and s.reward == float(s.index)
        assert (s.metadata["made_by"] == "my_custom_gen") == (style == "dotted")


async def test_custom_generate_that_raises_fails_only_its_sample(encoder, tmp_path):
    (tmp_path / "gen.py").write_text(CUSTOM_GENERATE)
    async with harness(encoder, lambda s: EnvSpec(), custom_generate_function_path=f"{tmp_path / 'gen.py'}:explode") as h:
        result = await run(h, 0, PromptSource(batch=2))
    assert len(result.groups) == 2 and all([s.index for s in g] == [1] for g in result.groups)
    assert len(result.failed) == 2
    for s in result.failed:
        assert str(s.termination) == "generate_exception"
        assert "explode raised ValueError: custom function bug" in s.metadata["error"]


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        ("no_such_package_xyz.generate", "cannot import 'no_such_package_xyz'"),
        ("rollout.multiturn.no_such_function", "has no attribute 'no_such_function'"),
        ("rollout.driver.MAX_GROUPS_FACTOR", "is a int, not a function"),
        ("/nonexistent/dir/gen.py:generate", "file /nonexistent/dir/gen.py does not exist"),
        ("generate", "is not of the form"),
        ("BROKEN:generate", "ModuleNotFoundError"),
    ],
)
async def test_bad_generate_function_paths_say_what_failed(encoder, tmp_path, path, expected):
    broken = tmp_path / "broken_gen.py"
    broken.write_text("import a_module_that_is_not_installed_xyz\n")
    path = path.replace("BROKEN", str(broken))
    async with harness(encoder, lambda s: EnvSpec(), custom_generate_function_path=path) as h:
        with pytest.raises(LoadError) as info:
            await run(h, 0, PromptSource(batch=2))
    message = str(info.value)
    assert "--custom-generate-function-path" in message and expected in message
    if path.startswith(str(broken)):
        assert "a_module_that_is_not_installed_xyz" in message
