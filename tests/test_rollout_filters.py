"""slime's rollout-step conventions in the driver: `--rollout-max-prompt-len` (training-view length, image tokens
counted), `sampling_params` handed to generate functions, concurrency per engine, mapping rewards of custom
functions, and what a step full of FAILED episodes does (a warning with the causes; N such steps stop the run).
"""

from __future__ import annotations

import copy
import json
import logging
import types
from typing import Any

import pytest
from test_driver import EnvSpec, check_accounting, harness, run

from jaxrl_vlm.config import Config
from jaxrl_vlm.job.sources import LiveRollout
from jaxrl_vlm.weight_sync import WeightSyncer
from rollout import driver as driver_module
from rollout.driver import (
    DriverState,
    RolloutResult,
    count_restored_drops,
    driver_checkpoint_state,
    restore_driver_state,
)
from rollout.encoding import ChatEncoder
from rollout.failures import AllFailedStepsError, FailureReport, all_failed_streak, failure_report
from rollout.loading import load_module
from rollout.metrics import rollout_metrics
from rollout.multiturn import BANNED_TOKEN_BIAS
from rollout.options import RolloutOptions, total_generate_concurrency
from rollout.processing import image_to_data_url
from rollout.run import RolloutRun, Unreported
from rollout.sample import Sample, Status, Termination, TerminationKind


@pytest.fixture(scope="module")
def encoder(tiny_tokenizer, tiny_image_processor) -> ChatEncoder:
    return ChatEncoder(tiny_tokenizer, tiny_image_processor)


class ListSource:
    """Serves the given prompts in order, `batch` at a time, cycling (like an epoch-based iterator)."""

    def __init__(self, prompts: list[Sample], batch: int):
        self.prompts, self.batch, self.cursor = prompts, batch, 0

    def next_batch(self) -> list[Sample]:
        out = []
        for _ in range(self.batch):
            out.append(copy.deepcopy(self.prompts[self.cursor % len(self.prompts)]))
            self.cursor += 1
        return out


def text_prompt(k: int, words: int = 1) -> Sample:
    return Sample(prompt=[{"role": "user", "content": " ".join(["word"] * words) + f" {k}?"}], label=str(k), index=k)


def image_prompt(k: int, image: Any) -> Sample:
    content = [{"type": "image", "image": image_to_data_url(image)}, {"type": "text", "text": f"{k}?"}]
    return Sample(prompt=[{"role": "user", "content": content}], label=str(k), index=k)


def lengths(encoder: ChatEncoder, prompt: Sample) -> tuple[int, int]:
    seg = encoder.encode_prompt(prompt.prompt)
    return len(seg.wire_ids), len(seg.train_ids)


# ----------------------------------------------------------------------------- --rollout-max-prompt-len
async def test_long_prompts_are_skipped_counted_and_the_step_still_filled(encoder, make_test_image):
    prompts = [text_prompt(0), text_prompt(1, words=200), text_prompt(2), image_prompt(3, make_test_image(3, 128)),
               text_prompt(4), text_prompt(5)]
    short = max(lengths(encoder, prompts[k])[1] for k in (0, 2, 4, 5))
    image_wire, image_train = lengths(encoder, prompts[3])
    assert image_train > image_wire  # the expanded image pads are what makes it long
    limit = max(short, image_wire)
    assert limit < image_train and limit < lengths(encoder, prompts[1])[1]

    source = ListSource(prompts, batch=6)
    async with harness(encoder, lambda s: EnvSpec(turns=1), rollout_batch_size=2, rollout_max_prompt_len=limit) as h:
        first = await run(h, 0, source)
        second = await run(h, 1, source)
        state = driver_checkpoint_state(h.args)

    for result in (first, second):
        assert len(result.groups) == 2 and all(len(g) == 2 for g in result.groups)
        check_accounting(result)
    assert [int(g[0].label) for g in first.groups] == [0, 2] and [int(g[0].label) for g in second.groups] == [4, 5]
    # Only kept prompts are numbered: skipping leaves no gap in the group indices (and the seeds).
    assert [g[0].group_index for r in (first, second) for g in r.groups] == [0, 1, 2, 3]
    assert (first.filtered_long_prompts, first.filtered_long_prompts_total) == (1, 1)
    assert (second.filtered_long_prompts, second.filtered_long_prompts_total) == (1, 2)
    metrics = rollout_metrics(second.samples, second)
    assert metrics["rollout/filtered_long_prompts"] == 1.0 and metrics["rollout/filtered_long_prompts_total"] == 2.0

    # The run's count survives a checkpoint.
    assert state["filtered_long_prompts"] == 2
    fresh = types.SimpleNamespace()
    restore_driver_state(fresh, state)
    assert fresh.driver_state.filtered_long_prompts == 2


async def test_without_a_limit_nothing_is_filtered(encoder):
    source = ListSource([text_prompt(0, words=300), text_prompt(1)], batch=2)
    async with harness(encoder, lambda s: EnvSpec(turns=1), rollout_batch_size=2) as h:
        result = await run(h, 0, source)
    assert [int(g[0].label) for g in result.groups] == [0, 1] and result.filtered_long_prompts == 0
    assert rollout_metrics(result.samples, result)["rollout/filtered_long_prompts"] == 0.0


async def test_a_limit_below_every_prompt_is_an_error_not_a_hang(encoder, monkeypatch):
    monkeypatch.setattr(driver_module, "MAX_CONSECUTIVE_LONG_PROMPTS", 7)
    source = ListSource([text_prompt(0), text_prompt(1)], batch=2)
    async with harness(encoder, lambda s: EnvSpec(turns=1), rollout_max_prompt_len=3) as h:
        with pytest.raises(RuntimeError, match="7 consecutive prompts are longer than --rollout-max-prompt-len 3"):
            await run(h, 0, source)


def test_older_driver_states_read_with_no_filtered_prompts():
    failed = Sample(prompt="Q3", label="3", group_index=3, index=1, status=Status.FAILED)
    unreported = Unreported(failed=[failed], sample_drops={"failed_sample": 1, "aborted_sample": 2}, episodes=6)
    state = DriverState(next_group_index=4, filtered_long_prompts=9, dropped_groups=[(3, "stale_group")],
                        unreported=unreported).to_dict()
    assert state["version"] == 4
    v3 = {k: v for k, v in state.items() if k not in ("dropped_groups", "unreported")} | {"version": 3}
    assert DriverState.from_dict(v3) == DriverState(next_group_index=4, filtered_long_prompts=9)
    v2 = {k: v for k, v in v3.items() if k != "filtered_long_prompts"} | {"version": 2}
    assert DriverState.from_dict(v2) == DriverState(next_group_index=4)
    restored = DriverState.from_dict(json.loads(json.dumps(state)))
    assert restored.dropped_groups == [(3, "stale_group")]
    assert [s.to_dict() for s in restored.unreported.failed] == [failed.to_dict()]
    # The resumed run reports all of it with its first batch, once.
    result = RolloutResult(groups=[])
    count_restored_drops(restored, result)
    assert result.dropped_groups == [(3, "stale_group")]
    assert result.dropped == {"stale_group": 1, "failed_sample": 1, "aborted_sample": 2} and result.episodes == 6
    assert [s.name for s in result.failed] == [failed.name] and restored.held() == {"next_group_index": 4,
                                                                                       "filtered_long_prompts": 9}


# ----------------------------------------------------------------------------- sampling_params
RECORDING_GENERATE = '''
import copy
from rollout.multiturn import generate as default_generate
from rollout.sample import Status

RECEIVED = []


async def record(args, sample, sampling_params):
    RECEIVED.append(copy.deepcopy(sampling_params))
    sampling_params["temperature"] = -1.0  # a function may change its copy; no other episode sees it
    sample.set_prompt_tokens([1, 2, 3])
    sample.append_model_tokens([4], [-0.5])
    sample.reward = REWARDS.get(sample.index, 1.0)
    sample.set_status(Status.COMPLETED)
    return sample


async def tweak_then_default(args, sample, sampling_params):
    RECEIVED.append(copy.deepcopy(sampling_params))
    sampling_params = dict(sampling_params, temperature=0.25, max_new_tokens=3, logit_bias={})
    return await default_generate(args, sample, sampling_params)


REWARDS = {}
'''


def _load(tmp_path, name: str = "recording_gen") -> tuple[str, Any]:
    path = tmp_path / f"{name}.py"
    path.write_text(RECORDING_GENERATE)
    return str(path), load_module(str(path), "test")


async def test_custom_generate_receives_slimes_sampling_params(encoder, tmp_path):
    path, module = _load(tmp_path)
    overrides = dict(rollout_temperature=0.7, rollout_top_p=0.9, rollout_top_k=20, rollout_max_response_len=321,
                     rollout_stop=["</answer>"], rollout_stop_token_ids=[5])
    async with harness(encoder, lambda s: EnvSpec(), custom_generate_function_path=f"{path}:record",
                       **overrides) as h:
        result = await run(h, 0, driver_module_source())
    assert len(result.samples) == 4 and len(module.RECEIVED) == 4
    vision = encoder.vision
    expected = {
        "temperature": 0.7, "top_p": 0.9, "top_k": 20, "max_new_tokens": 321, "stop": ["</answer>"],
        "stop_token_ids": [*dict.fromkeys([*vision.eos_ids, 5])], "skip_special_tokens": False,
        "no_stop_trim": True, "spaces_between_special_tokens": False,
        "logit_bias": {str(t): BANNED_TOKEN_BIAS for t in vision.banned_ids},
    }
    for params in module.RECEIVED:
        assert params == expected  # never None; each episode its own copy (the mutation above is not seen)


async def test_the_default_generate_uses_the_params_it_receives(encoder, tmp_path):
    path, module = _load(tmp_path, "tweak_gen")
    async with harness(encoder, lambda s: EnvSpec(turns=1), custom_generate_function_path=f"{path}:tweak_then_default",
                       rollout_batch_size=1) as h:
        result = await run(h, 0, driver_module_source())
        requests = h.server.requests_to("/generate")
    assert len(result.samples) == 2 and len(module.RECEIVED) == 2 and len(requests) == 2
    for record in requests:
        sent = record.body["sampling_params"]
        assert sent["temperature"] == 0.25 and sent["max_new_tokens"] <= 3
        assert "sampling_seed" in sent  # the per-request seed is the episode's own
        # Whoever built the dict, the vision tokens stay banned and the EOS ids stop the turn.
        assert {int(k) for k in sent["logit_bias"]} >= set(encoder.vision.banned_ids)
        assert set(sent["stop_token_ids"]) >= set(encoder.vision.eos_ids)


@pytest.mark.parametrize(("key", "expected"), [("acc", None), (None, "set --reward-key"),
                                                 ("score", "--reward-key 'score' is not in the reward mapping")])
async def test_a_mapping_reward_from_a_custom_function_needs_its_key(encoder, tmp_path, key, expected):
    path, module = _load(tmp_path, f"dict_gen_{key}")
    module.REWARDS.update({0: {"acc": 0.0, "fmt": 1.0}, 1: {"acc": 1.0, "fmt": 1.0}})
    async with harness(encoder, lambda s: EnvSpec(), custom_generate_function_path=f"{path}:record",
                       reward_key=key) as h:
        result = await run(h, 0, driver_module_source())
    if expected is None:
        assert sorted(s.reward for s in result.samples) == [0.0, 0.0, 1.0, 1.0] and not result.failed
        assert all(s.metadata["reward_components"]["fmt"] == 1.0 for s in result.samples)
    else:
        assert result.samples == [] and len(result.failed) == 2 * result.groups_submitted  # over-sampled, in vain
        for s in result.failed:
            assert str(s.termination) == "reward_error" and expected in s.metadata["error"]
            assert "['acc', 'fmt']" in s.metadata["error"] and "record" in s.metadata["error"]


def driver_module_source() -> ListSource:
    return ListSource([text_prompt(k) for k in range(4)], batch=4)


# ----------------------------------------------------------------------------- concurrency per engine
def test_concurrency_is_per_engine_as_in_slime():
    assert RolloutOptions().sglang_server_concurrency == 512
    assert total_generate_concurrency(512) == 512  # one engine (embedded, launched or a single URL)
    assert total_generate_concurrency(512, ["http://a:1", "http://b:2", "http://c:3"]) == 1536
    assert total_generate_concurrency(8, ["http://a:1"]) == 8
    with pytest.raises(ValueError, match="sglang_server_concurrency must be >= 1, got 0"):
        total_generate_concurrency(0, [])


def test_n_samples_per_prompt_defaults_to_slimes_one():
    assert RolloutOptions().n_samples_per_prompt == 1


# ----------------------------------------------------------------------------- FAILED steps
def _failed(kind: TerminationKind, error: str) -> Sample:
    return Sample(status=Status.FAILED, termination=Termination(kind), metadata={"error": error})


def _result(failed: list[Sample], kept: int = 0) -> driver_module.RolloutResult:
    groups = [[Sample(reward=1.0, status=Status.COMPLETED)] for _ in range(kept)]
    return driver_module.RolloutResult(groups=groups, failed=failed, episodes=len(failed) + kept)


def test_failure_report_counts_causes_most_frequent_first():
    report = failure_report(_result([_failed(TerminationKind.ENV_ERROR, "env: boom")] * 2
                                    + [_failed(TerminationKind.ENGINE_ERROR, "engine: refused")] * 3, kept=5))
    assert (report.failed, report.episodes, report.share, report.all_failed) == (5, 10, 0.5, False)
    assert [(c.name, c.count) for c in report.causes] == [("engine_error", 3), ("env_error", 2)]
    assert report.describe() == "engine_error x 3 (e.g. 'engine: refused'), env_error x 2 (e.g. 'env: boom')"
    assert failure_report(_result([], kept=0)) == FailureReport(0, 0, ())  # nothing finished: not all FAILED


def test_all_failed_streak_counts_consecutive_steps_and_stops_at_the_limit():
    bad = failure_report(_result([_failed(TerminationKind.ENGINE_ERROR, "engine: connection refused")] * 4))
    good = failure_report(_result([_failed(TerminationKind.ENGINE_ERROR, "x")], kept=3))
    assert bad.all_failed and not good.all_failed
    streak = all_failed_streak(0, bad, limit=3, step=0)
    streak = all_failed_streak(streak, bad, limit=3, step=1)
    assert streak == 2 and all_failed_streak(streak, good, limit=3, step=2) == 0  # a good step resets it
    with pytest.raises(AllFailedStepsError) as info:
        all_failed_streak(streak, bad, limit=3, step=2)
    message = str(info.value)
    assert "every episode FAILED in 3 consecutive steps (--max-all-failed-steps 3)" in message
    assert "4 of 4 FAILED" in message and "engine_error x 4 (e.g. 'engine: connection refused')" in message
    assert all_failed_streak(99, bad, limit=0, step=5) == 100  # 0: never stops


async def test_a_step_where_most_episodes_fail_warns_with_the_causes(encoder, caplog):
    def plan(s: Sample) -> EnvSpec:
        return EnvSpec(turns=2, raise_msg="env server is down" if s.index == 0 or s.group_index == 0 else None)

    async with harness(encoder, plan, rollout_batch_size=2, max_env_retries_per_turn=0) as h:
        with caplog.at_level(logging.WARNING, logger="rollout.driver"):
            result = await run(h, 0, driver_module_source())
    report = failure_report(result)
    assert report.failed >= 3 and report.episodes >= 4 and report.share > 0.5
    warnings = [r.getMessage() for r in caplog.records if "FAILED" in r.getMessage()]
    assert len(warnings) == 1 and "--failed-share-warning 0.5" in warnings[0]
    assert f"env_error x {report.failed}" in warnings[0] and "env server is down" in warnings[0]
    assert rollout_metrics(result.samples, result)["rollout/failed_share"] == pytest.approx(report.share)


async def test_a_step_with_few_failures_does_not_warn(encoder, caplog):
    def plan(s: Sample) -> EnvSpec:
        return EnvSpec(turns=1, raise_msg="flaky" if (s.group_index, s.index) == (0, 0) else None)

    async with harness(encoder, plan, rollout_batch_size=2, n_samples_per_prompt=3, max_env_retries_per_turn=0) as h:
        with caplog.at_level(logging.WARNING, logger="rollout.driver"):
            result = await run(h, 0, driver_module_source())
    assert failure_report(result).share == pytest.approx(1 / 6)
    assert not [r for r in caplog.records if "FAILED" in r.getMessage()]


async def test_the_main_job_stops_after_consecutive_all_failed_steps(tmp_path, encoder):
    results = iter([_result([_failed(TerminationKind.ENGINE_ERROR, "engine: refused")] * 2)] * 2)
    seen_args = []

    async def rollout_fn(args, step, prompts):
        seen_args.append(args)
        return next(results)

    cfg = Config()
    cfg.rollout.max_all_failed_steps = 2
    async with harness(encoder, lambda s: EnvSpec(turns=1)) as h:
        # Only the rollout phase: no trainer; no engine client, so no engine link to check.
        source = LiveRollout(cfg, rollout_fn=rollout_fn, args=h.args, main=True, model_dir=None, prompts=None,
                             syncer=WeightSyncer(None, tmp_path / "weights"), trainer=None)
        source.run = RolloutRun.from_args(h.args)
        _, samples, metrics = await source.rollout(0)
    assert seen_args == [h.args]  # a user rollout function gets slime's namespace
    assert samples == [] and source.all_failed_steps == 1 and metrics["rollout/failed_share"] == 1.0
    with pytest.raises(AllFailedStepsError, match=r"engine_error x 2 \(e.g. 'engine: refused'\)"):
        await source.rollout(1)
