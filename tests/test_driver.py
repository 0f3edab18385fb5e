"""The rollout driver (`rollout.driver.generate_rollout`) against a real scripted SGLang-speaking server.

Episodes run the default multi-turn loop with the tiny tokenizer and scripted environments; the fake server
records every request, so concurrency, aborts and weight versions are checked from the server's side.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import types
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

from envs.base import BaseInteractionEnv
from rollout.client import RetryPolicy, SGLangClient
from rollout.driver import MAX_GROUPS_FACTOR, RolloutResult, close_suspended, generate_rollout
from rollout.dump import dump_samples, validate_dump
from rollout.encoding import ChatEncoder
from rollout.fake_engine import FakeSGLangServer, Hang, RecordedRequest, Tokens
from rollout.loading import LoadError
from rollout.multiturn import RolloutContext
from rollout.sample import Sample, Status


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

    def all(self) -> list[PlannedEnv]:
        return [e for envs in self.envs.values() for e in envs]


def env_module(plan: Callable[[Sample], EnvSpec], log: EnvLog) -> types.ModuleType:
    def build_env(sample: Sample, args: Any) -> PlannedEnv:
        env = PlannedEnv(sample, plan(sample), log)
        log.envs.setdefault(env.key, []).append(env)
        return env

    module = types.ModuleType("planned_env")
    module.build_env = build_env
    return module


class PromptSource:
    """Batches of `batch` text prompts numbered 0, 1, 2, ... (label = the number as text)."""

    def __init__(self, batch: int = 4):
        self.batch = batch
        self.served = 0
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
        assert env.sample.status is Status.ABORTED and env.sample.metadata["termination"] == "abort"
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
        carried = h.ctx.driver_state["partial_groups"][0]
        done_before, aborted_before = carried
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
        assert s.metadata["termination"] == "generate_exception"
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
