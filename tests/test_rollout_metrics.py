"""Turn-level rollout metrics (`rollout.metrics`) and debug dumps (`rollout.dump`).

Pure functions are checked against closed forms on hand-built samples; a real rollout step (driver + episode loop
+ fake SGLang server + scripted env with images, a failing env and an engine truncation) is checked against
independent sources: the server's request log, the loop's turn records, the tokenizer and the encoder.
"""

from __future__ import annotations

import asyncio
import json
import random
import string
import types
from collections import Counter
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest

from envs.base import BaseInteractionEnv
from rollout.client import RetryPolicy, SGLangClient
from rollout.driver import RolloutResult, _mask_existing_response, generate_rollout
from rollout.dump import DumpError, dump_samples, mask_runs, split_turns, validate_dump
from rollout.encoding import ChatEncoder
from rollout.fake_engine import FakeSGLangServer, RecordedRequest, Tokens
from rollout.metrics import (
    compression_ratio,
    env_error_type,
    has_repetition,
    latency_summary,
    num_model_turns,
    observation_tokens,
    rollout_metrics,
    zero_std_metrics,
)
from rollout.multiturn import RolloutContext
from rollout.sample import Sample, Status, TurnRecord


# ----------------------------------------------------------------------------- a real rollout step
class ScriptEnv(BaseInteractionEnv):
    """Prompt 0: 3 turns with an image per observation, reward 1 - index. Prompt 1: index 0 raises, then hangs
    (FAILED after a retry); index 1 has 2 turns. Prompt 2: index 0 is cut by the engine (length), index 1 is done
    after one turn."""

    def __init__(self, sample: Sample, make_image: Callable):
        self.prompt, self.idx = int(sample.label), sample.index
        self.make_image = make_image
        self.steps = 0

    def reset(self) -> None:
        pass

    async def step(self, text: str):
        self.steps += 1
        if (self.prompt, self.idx) == (1, 0):
            if self.steps == 1:
                raise RuntimeError("flaky tool")
            await asyncio.sleep(3600)
        turns = {0: 3, 1: 2, 2: 1}[self.prompt]
        if self.prompt == 0:
            await asyncio.sleep(0.05)
        if self.steps >= turns:
            return {"obs_str": ""}, True, {}
        obs: dict[str, Any] = {"obs_str": f"observation {self.steps}"}
        if self.prompt == 0:
            obs["multi_modal_data"] = {"image": [self.make_image(self.steps, 64)]}
        return obs, False, {}

    def verdict(self) -> float:
        return float(1 - self.idx) if self.prompt in (0, 2) else 1.0


class Prompts:
    def __init__(self):
        self.k = 0

    def next_batch(self) -> list[Sample]:
        out = [Sample(prompt=[{"role": "user", "content": f"Problem {self.k + j}"}], label=str(self.k + j), index=self.k + j)
               for j in range(3)]
        self.k += 3
        return out


@pytest.fixture(scope="module")
def encoder(tiny_tokenizer, tiny_image_processor) -> ChatEncoder:
    return ChatEncoder(tiny_tokenizer, tiny_image_processor)


@pytest.fixture(scope="module")
def rollout_step(encoder, make_test_image) -> tuple[RolloutResult, list[RecordedRequest], list[int]]:
    reply = encoder.tokenize("the answer") + [encoder.vision.im_end]
    no_stop = encoder.tokenize("rambling on and on")

    def generate_fn(body: dict) -> Tokens:
        ids = no_stop if str(body["rid"]).startswith("g2-s0-") else reply
        return Tokens(output_ids=tuple(ids), log_probs=tuple(-0.5 for _ in ids))

    async def go():
        server = FakeSGLangServer(generate_fn=generate_fn, eos_token_id=encoder.vision.im_end,
                                  image_token_id=encoder.vision.image_pad, latency_s=0.01, weight_version="v1")
        async with server:
            async with SGLangClient(server.url, timeout_s=10.0, retry=RetryPolicy(max_retries=0)) as client:
                module = types.ModuleType("script_env")
                module.build_env = lambda sample, args: ScriptEnv(sample, make_test_image)
                ctx = RolloutContext(client=client, encoder=encoder, env_module=module,
                                     generate_slots=asyncio.Semaphore(8))
                args = types.SimpleNamespace(
                    rollout_batch_size=3, n_samples_per_prompt=2, over_sampling_batch_size=None, dynamic_filter=None,
                    partial_rollout=False, custom_generate_function_path="rollout.multiturn.generate",
                    rollout_max_response_len=2000, rollout_max_context_len=None, max_turns=5,
                    max_env_retries_per_turn=1, env_step_timeout=0.3, episode_timeout=30.0, delta_check="strict",
                    rollout_temperature=1.0, rollout_top_p=1.0, rollout_top_k=-1, rollout_stop_token_ids=[],
                    rollout_context=ctx,
                )
                result = await generate_rollout(args, 7, Prompts())
            return result, server.requests_to("/generate")

    result, requests = asyncio.run(go())
    return result, requests, reply


def _by_key(result: RolloutResult) -> dict[tuple[int, int], Sample]:
    return {(s.group_index, s.index): s for s in [*result.samples, *result.failed]}


def test_rollout_step_has_the_scripted_outcomes(rollout_step):
    result, _, _ = rollout_step
    s = _by_key(result)
    assert len(result.samples) == 5 and [f.index for f in result.failed] == [0]
    assert s[(1, 0)].status is Status.FAILED and s[(2, 0)].status is Status.TRUNCATED
    assert all(s[k].status is Status.COMPLETED for k in [(0, 0), (0, 1), (1, 1), (2, 1)])


def test_metrics_of_a_real_rollout_step(rollout_step):
    result, requests, _ = rollout_step
    m = rollout_metrics(result.samples, result)
    episodes = [*result.samples, *result.failed]
    assert all(k.startswith("rollout/") and isinstance(v, float) for k, v in m.items())
    assert m["rollout/samples"] == 5 and m["rollout/episodes"] == 6

    # Turns per episode, from the server's log: one /generate per model turn ("g<group>-s<index>-t<turn>-...").
    per_episode = Counter(str(r.body["rid"]).split("-t")[0] for r in requests)
    assert len(per_episode) == 6
    hist = Counter(per_episode.values())
    assert {k: m[f"rollout/turns/count_{k}"] for k in hist} == {k: float(v) for k, v in hist.items()}
    assert m["rollout/turns/max"] == 3 and m["rollout/turns/mean"] == pytest.approx(np.mean(list(per_episode.values())))

    assert m["rollout/termination/env_done"] == pytest.approx(4 / 6)
    assert m["rollout/termination/truncated/length"] == pytest.approx(1 / 6)
    assert m["rollout/termination/env_error"] == pytest.approx(1 / 6)
    assert m["rollout/failed/total"] == 1 and m["rollout/failed/env_error"] == 1
    assert m["rollout/truncated_ratio"] == pytest.approx(1 / 5)

    # The failing env raised once, was retried once and then timed out.
    assert m["rollout/env/errors/RuntimeError"] == 1 and m["rollout/env/errors/timeout"] == 1
    assert m["rollout/env/retries"] == 1 and m["rollout/env/turns_with_retry"] == 1

    # Observation share: against the loop's own per-turn observation counts.
    obs = sum(r.observation_tokens for e in episodes for r in e.turns)
    total = sum(e.response_length for e in episodes)
    assert m["rollout/obs_tokens"] == obs and m["rollout/obs_token_frac"] == pytest.approx(obs / total)

    lengths = np.array([sum(x.loss_mask) for x in result.samples], dtype=float)
    assert m["rollout/response_len/mean"] == pytest.approx(lengths.mean())
    assert m["rollout/response_len/median"] == pytest.approx(np.median(lengths))
    assert (m["rollout/response_len/min"], m["rollout/response_len/max"]) == (lengths.min(), lengths.max())
    assert m["rollout/response_len_with_obs/max"] == max(x.response_length for x in result.samples)

    rewards = np.array([x.reward for x in result.samples])
    assert m["rollout/raw_reward"] == pytest.approx(rewards.mean())
    assert m["rollout/raw_reward_std"] == pytest.approx(rewards.std())
    # Group 1 keeps one sample after its failure: a zero-std group of reward 1.
    assert m["rollout/zero_std/count_1.0"] == 1 and m["rollout/zero_std/groups"] == 1
    assert m["rollout/repetition_frac"] == 0.0

    assert m["rollout/dynamic_filter/drop_failed_sample"] == 1
    assert m["rollout/groups_kept"] == 3 and m["rollout/failed_samples"] == 1

    # The engine answered after its 10 ms latency; prompt 0's env slept 50 ms per step.
    assert m["rollout/latency/engine_s/p50"] >= 0.01
    assert m["rollout/latency/env_s/p90"] >= 0.05


# ----------------------------------------------------------------------------- metric functions
def test_num_model_turns_counts_a_resumed_turn_once():
    s = Sample(turns=[TurnRecord(0, generated_tokens=5), TurnRecord(1, generated_tokens=3),
                      TurnRecord(1, generated_tokens=2), TurnRecord(2, generated_tokens=0)])
    assert num_model_turns(s) == 2


def test_env_error_types_are_parsed_from_the_loop_messages():
    assert env_error_type("attempt 1: RuntimeError: boom: with colons") == "RuntimeError"
    assert env_error_type("attempt 3: env.step timed out after 0.2 s") == "timeout"
    assert env_error_type("attempt 2: aiohttp.ClientError: x") == "ClientError"
    assert env_error_type("env.reset failed: OSError: gone") == "reset_failed"
    assert env_error_type("something else") == "other"


def test_repetition_follows_slimes_definition():
    rng = random.Random(0)
    noise = "".join(rng.choice(string.ascii_letters + string.digits) for _ in range(12_000))
    loop = "the same sentence again. " * 480  # 12,000 chars
    assert len(loop) == 12_000 and compression_ratio(loop[-10_000:]) > 10
    assert compression_ratio(noise[-10_000:]) < 2
    assert has_repetition(loop) and not has_repetition(noise)
    assert not has_repetition(loop[:10_000])  # not longer than 10,000 chars
    assert not has_repetition(loop + noise)  # only the last 10,000 chars count
    assert has_repetition(noise + loop)
    samples = [Sample(response=t) for t in (loop, noise, noise + loop, "short")]
    assert rollout_metrics(samples)["rollout/repetition_frac"] == 0.5


def test_latency_percentiles_match_closed_forms():
    out = latency_summary([float(v) for v in range(1, 11)], "x")
    assert out == {"x/mean": 5.5, "x/p50": 5.5, "x/p90": pytest.approx(9.1)}
    assert latency_summary([], "x") == {}


def test_zero_std_groups_by_group_index_and_rounded_reward():
    def s(g: int, r: float | None) -> Sample:
        return Sample(group_index=g, reward=r)

    samples = [s(0, 0.66), s(0, 0.66), s(1, 0.0), s(1, 1.0), s(2, 1.0), s(2, None), s(3, 0.0)]
    out = zero_std_metrics(samples)
    assert out == {"zero_std/count_0.7": 1.0, "zero_std/count_1.0": 1.0, "zero_std/count_0.0": 1.0,
                   "zero_std/groups": 3.0}


def test_empty_rollout_gives_counts_not_errors():
    result = RolloutResult(groups=[], groups_submitted=8)
    result.dropped["zero_std_group"] = 8
    m = rollout_metrics([], result)
    assert m["rollout/samples"] == 0 and m["rollout/dynamic_filter/drop_zero_std_group"] == 8
    assert m["rollout/groups_submitted"] == 8 and "rollout/response_len/mean" not in m


# ----------------------------------------------------------------------------- dumps of a real rollout step
def test_dump_of_a_real_rollout_step_validates_and_splits_turns(rollout_step, tmp_path, encoder, tiny_tokenizer):
    result, _, reply = rollout_step
    episodes = [*result.samples, *result.failed]
    path = tmp_path / "dump.jsonl"
    assert dump_samples(episodes, path, tiny_tokenizer) == 6
    records = {(r["group_index"], r["index"]): r for r in validate_dump(path)}
    samples = _by_key(result)
    reply_text = tiny_tokenizer.decode(reply, skip_special_tokens=False)

    for key, rec in records.items():
        s = samples[key]
        assert rec["status"] == s.status.value and rec["rollout_id"] == 7 and rec["label"] == s.label
        assert rec["prompt_tokens"] + rec["response_length"] == len(s.tokens)
        assert rec["weight_versions"] == ["v1"]
        # Nothing is lost by the split: prompt + turns is the whole (compacted) token stream, decoded.
        whole = tiny_tokenizer.decode(encoder.compact_image_pads(s.tokens), skip_special_tokens=False)
        assert rec["prompt_text"] + "".join(t["model_text"] + t["observation_text"] for t in rec["turns"]) == whole
        if s.status is not Status.FAILED:
            assert rec["records_aligned"]
            # Per-turn observation counts agree with the loop's records; model text with the loop's own decode.
            assert [t["observation_tokens"] for t in rec["turns"]] == [r.observation_tokens for r in s.turns]
            texts = [t["model_text"].removesuffix("<|im_end|>") for t in rec["turns"]]
            assert texts[: len(s.metadata["model_text"])] == s.metadata["model_text"]

    three = records[(0, 0)]
    assert [t["model_text"] for t in three["turns"]] == [reply_text] * 3
    assert [t["observation_text"].count("<|image_pad|>") for t in three["turns"]] == [1, 1, 0]
    assert "observation 1" in three["turns"][0]["observation_text"] and three["turns"][2]["observation_tokens"] == 0
    assert three["num_images"] == 2 and three["turns"][0]["weight_version"] == "v1"
    assert [v for v, _ in three["mask_runs"]] == [1, 0, 1, 0, 1]
    assert records[(2, 0)]["termination"] == "truncated:length" and records[(2, 0)]["turns"][0]["finish_reason"] == "length"
    failed = records[(1, 0)]
    assert failed["status"] == "failed" and "timed out" in failed["error"]
    assert any("RuntimeError: flaky tool" in e for e in failed["errors"])


class Raw(str):
    """A replacement line written as is (the other mutations edit the parsed record)."""


def _mutate(path: Path, line: int, change: Callable[[dict], Any]) -> None:
    lines = path.read_text().splitlines()
    rec = json.loads(lines[line])
    out = change(rec)
    lines[line] = out if isinstance(out, Raw) else json.dumps(rec)
    path.write_text("\n".join(lines) + "\n")


def _first_turn(rec: dict) -> None:
    rec["turns"][0]["observation_tokens"] += 1


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (lambda r: Raw("{not json"), r"dump\.jsonl:2: not valid JSON"),
        (lambda r: r.pop("status"), r"dump\.jsonl:2: missing key 'status'"),
        (lambda r: r.update(status="done"), "unknown value 'done'"),
        (lambda r: r["mask_runs"].append([r["mask_runs"][-1][0] ^ 1, 1]), "mask_runs cover"),
        (_first_turn, "token counts rebuild the mask runs"),
        (lambda r: r.update(trained_tokens=r["trained_tokens"] + 1), "key 'trained_tokens'"),
        (lambda r: r.update(reward=float("nan")), "key 'reward'"),
        (lambda r: r.update(group_index=0, index=0), "already on line 1"),
        (lambda r: r.update(records_aligned=False), "records_aligned"),
        (lambda r: r["turns"][0].update(weight_version="v9"), "weight_version 'v9'"),
        (lambda r: r.update(status="failed", error=None, errors=[]), "status failed but keys 'error' and 'errors'"),
        (lambda r: r.update(status="truncated"), "status truncated but termination is 'env_done'"),
        (lambda r: r.update(termination="truncated:tired"), "key 'termination': unknown termination 'truncated:tired'"),
    ],
)
def test_validate_dump_rejects_broken_invariants(rollout_step, tmp_path, tiny_tokenizer, change, expected):
    result, _, _ = rollout_step
    path = tmp_path / "dump.jsonl"
    ordered = sorted([*result.samples, *result.failed], key=lambda s: (s.group_index, s.index))
    dump_samples(ordered, path, tiny_tokenizer)
    validate_dump(path)
    _mutate(path, 1, change)  # line 2: sample (0, 1), completed
    with pytest.raises(DumpError, match=expected):
        validate_dump(path)


# ----------------------------------------------------------------------------- partial rollout masking
def test_offpolicy_masked_turns_are_still_split_from_tokens(tmp_path, tiny_tokenizer):
    """A resumed episode whose earlier tokens the driver masked: the dump and the metrics still see model turns."""
    s = Sample(group_index=4, index=1)
    s.set_prompt_tokens([10, 11])
    s.append_model_tokens([20, 21, 22], [-0.1] * 3)
    s.append_observation_tokens([30, 31])
    s.append_model_tokens([40, 41], [-0.2] * 2)  # aborted mid-turn
    _mask_existing_response(s)  # what the driver does before resuming with --mask-offpolicy-in-partial-rollout
    s.append_model_tokens([42, 43], [-0.3] * 2)  # the resumed turn continues
    s.append_observation_tokens([32])
    s.append_model_tokens([50], [-0.4])
    s.status, s.reward, s.weight_versions = Status.COMPLETED, 1.0, ["v1", "v2"]
    s.validate()

    spans = split_turns(s)
    assert [(x.obs_start - x.model_start, x.masked, x.end - x.obs_start) for x in spans] == [(3, 3, 2), (4, 2, 1), (1, 0, 0)]
    assert mask_runs(s.loss_mask) == [[0, 7], [1, 2], [0, 1], [1, 1]]
    assert observation_tokens(s) == 3
    m = rollout_metrics([s])
    assert m["rollout/offpolicy_masked_tokens"] == 5 and m["rollout/obs_tokens"] == 3

    path = tmp_path / "masked.jsonl"
    dump_samples([s], path, tiny_tokenizer)
    (rec,) = validate_dump(path)
    assert [(t["model_tokens"], t["offpolicy_masked_tokens"], t["observation_tokens"]) for t in rec["turns"]] == [
        (3, 3, 2), (4, 2, 1), (1, 0, 0)]
    assert rec["turns"][1]["model_text"] == tiny_tokenizer.decode([40, 41, 42, 43], skip_special_tokens=False)
    assert rec["trained_tokens"] == 3 and rec["offpolicy_masked_tokens"] == 5
