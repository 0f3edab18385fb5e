"""Asynchronous training with bounded staleness (`--max-staleness K`, issue 15).

The pure parts first (how many groups may be generating, which samples may train, what is counted), then the
pieces against a scripted SGLang server: the client's weight-update gate, episodes that a weight update cuts
(`--inflight-update-policy continue | rerun`), the group stream (admission, stale groups, checkpoint), and the main
job end to end with the real trainer on a tiny model: no sample ever trains past the bound.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import types
from collections.abc import Iterator
from pathlib import Path

import pytest
from _launch import xla_flags

from jaxrl_vlm.config import load_config
from jaxrl_vlm.errors import ConfigError
from jaxrl_vlm.job.staleness import (
    OffPolicySampleError,
    check_bounded_staleness,
    offpolicy_tokens,
    oldest_version,
    too_stale,
)
from rollout.client import RetryPolicy, SGLangClient
from rollout.driver import DriverState, restore_driver_state
from rollout.fake_engine import Delay, FakeSGLangServer, Hang, RecordedRequest
from rollout.multiturn import generate
from rollout.sample import Sample, Status, TerminationKind, TruncationCause, TurnRecord
from rollout.sglang_wire import FinishType
from rollout.streaming import GroupStream, generation_allowance
from test_driver import EnvSpec, PromptSource, harness, rid_of

REPO = Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------- pure parts
def test_generation_allowance_is_k_plus_one_batches_ahead_of_the_engine():
    # Fresh start, K = 1, B = 4: two batches may generate before any weight update.
    assert generation_allowance(engine_version=0, max_staleness=1, groups_per_step=4, batches_taken=0,
                                live_groups=0) == 8
    # The trainer took batch 0 (4 groups left the line) but the engine still holds version 0: nothing more.
    assert generation_allowance(engine_version=0, max_staleness=1, groups_per_step=4, batches_taken=1,
                                live_groups=4) == 0
    # Version 1 reached the engine: one more batch.
    assert generation_allowance(engine_version=1, max_staleness=1, groups_per_step=4, batches_taken=1,
                                live_groups=4) == 4
    # K = 0 is the synchronous loop's one batch per version; never negative.
    assert generation_allowance(engine_version=3, max_staleness=0, groups_per_step=4, batches_taken=3,
                                live_groups=0) == 4
    assert generation_allowance(engine_version=3, max_staleness=0, groups_per_step=4, batches_taken=4,
                                live_groups=2) == 0


def _sample(name: str, versions: list[str], tokens_per_version: list[int] | None = None) -> types.SimpleNamespace:
    tokens = tokens_per_version or [3] * len(versions)
    turns = [TurnRecord(turn=i, generated_tokens=n, weight_version=v) for i, (v, n) in enumerate(zip(versions, tokens))]
    return types.SimpleNamespace(name=name, weight_versions=versions, turns=turns)


def test_staleness_is_the_trainer_version_minus_the_oldest_token_version():
    fresh, mixed = _sample("a", ["5"]), _sample("b", ["4", "5"])
    assert oldest_version([fresh, mixed]) == 4 and oldest_version([_sample("c", [])]) is None
    assert not too_stale([fresh, mixed], trainer_version=5, max_staleness=1)
    assert too_stale([fresh, mixed], trainer_version=6, max_staleness=1)  # "4" lags by 2
    assert not too_stale([_sample("c", [])], trainer_version=9, max_staleness=1)  # nothing generated yet
    # Off-policy tokens: those made by versions older than the trainer's.
    assert offpolicy_tokens(_sample("d", ["4", "5"], [7, 2]), trainer_version=5) == (7, 9)


def test_check_bounded_staleness_counts_a_histogram_and_rejects_what_may_not_train():
    samples = [_sample("a", ["3"]), _sample("b", ["2", "3"], [4, 1]), _sample("c", ["2"], [5])]
    report = check_bounded_staleness(samples, trainer_version=3, engine_version=3, max_staleness=1, step=7)
    assert report.histogram == {0: 1, 1: 2}
    assert (report.offpolicy_tokens, report.model_tokens) == (9, 13)
    metrics = report.metrics(max_staleness=2)
    assert metrics["async/staleness_0"] == 1 and metrics["async/staleness_1"] == 2 and metrics["async/staleness_2"] == 0
    assert metrics["async/staleness_mean"] == pytest.approx(2 / 3)
    assert metrics["async/offpolicy_token_frac"] == pytest.approx(9 / 13)
    with pytest.raises(OffPolicySampleError, match=r"step 7: 1 of 2 .*c made by weight version\(s\) \[1\]"):
        check_bounded_staleness([_sample("a", ["3"]), _sample("c", ["1"])], trainer_version=3, engine_version=3,
                                max_staleness=1, step=7)
    with pytest.raises(OffPolicySampleError, match=r"\[4\]"):  # a version the engine never confirmed
        check_bounded_staleness([_sample("a", ["4"])], trainer_version=3, engine_version=3, max_staleness=1, step=7)
    with pytest.raises(OffPolicySampleError, match="reports no weight version"):
        check_bounded_staleness([_sample("a", [])], trainer_version=3, engine_version=3, max_staleness=1, step=7)
    with pytest.raises(OffPolicySampleError, match="'v7', which is not one of this run's"):
        check_bounded_staleness([_sample("a", ["v7"])], trainer_version=3, engine_version=3, max_staleness=1, step=7)


def test_config_keeps_sync_only_options_out_of_async_mode():
    base = ["--max-staleness", "1"]
    assert load_config(None, base).rollout.max_staleness == 1
    assert load_config(None, []).rollout.max_staleness == 0  # synchronous by default
    for extra, match in ((["--partial-rollout"], "partial-rollout does not apply"),
                         (["--over-sampling-batch-size", "8"], "over-sampling-batch-size does not apply"),
                         (["--disable-weight-sync"], "never reach a newer version"),
                         (["--rollout-function-path", "rollout.driver.generate_rollout_x"], "produces whole steps")):
        with pytest.raises(ConfigError, match=match):
            load_config(None, [*base, *extra])
    with pytest.raises(ConfigError, match="max_staleness must be >= 0"):
        load_config(None, ["--max-staleness", "-1"])
    with pytest.raises(ConfigError, match="not one of"):
        load_config(None, [*base, "--inflight-update-policy", "pause"])


# ----------------------------------------------------------------------------- the client's weight-update gate
async def _until(predicate, timeout_s: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not predicate():
        assert loop.time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.005)


async def test_a_weight_update_aborts_requests_in_flight_and_holds_new_ones_until_it_is_done(tmp_path):
    async with FakeSGLangServer(script=[Hang()], weight_version="0") as server:
        async with SGLangClient(server.url, retry=RetryPolicy(max_retries=0)) as client:
            params = {"max_new_tokens": 4}
            cut = asyncio.ensure_future(client.generate([1, 2, 3], sampling_params=params))
            await _until(lambda: server.num_in_flight == 1)
            update = asyncio.ensure_future(client.sync_weights_from_disk(str(tmp_path), "1", flush_poll_s=0.01))
            await asyncio.sleep(0)  # the update closes the gate as it starts
            assert not client.update_gate.is_open
            held = asyncio.ensure_future(client.generate([4, 5, 6], sampling_params=params))
            await update
            first, second = await cut, await held
    assert first.finish_reason is FinishType.ABORT and first.aborted_by_weight_update
    assert second.finish_reason is FinishType.STOP and second.weight_version == "1"
    assert not second.aborted_by_weight_update
    generates = [i for i, p in enumerate(server.paths) if p == "/generate"]
    assert generates[1] > server.paths.index("/continue_generation")  # sent only after the update


async def test_an_abort_that_is_not_a_weight_update_is_not_flagged():
    async with FakeSGLangServer(script=[Hang()]) as server:
        async with SGLangClient(server.url, retry=RetryPolicy(max_retries=0)) as client:
            cut = asyncio.ensure_future(client.generate([1, 2], sampling_params={"max_new_tokens": 4}))
            await _until(lambda: server.num_in_flight == 1)
            await client.abort_request(abort_all=True)
            result = await cut
    assert result.finish_reason is FinishType.ABORT and not result.aborted_by_weight_update


# ----------------------------------------------------------------------------- episodes cut by a weight update
@pytest.fixture(scope="module")
def encoder(tiny_tokenizer, tiny_image_processor):
    from rollout.encoding import ChatEncoder

    return ChatEncoder(tiny_tokenizer, tiny_image_processor)


async def _episode_across_an_update(encoder, tmp_path, policy: str) -> tuple[Sample, list[RecordedRequest]]:
    """A two-turn episode whose first request hangs until a weight update (v1 -> v2) cuts it."""
    def select(record: RecordedRequest):
        return Hang() if rid_of(record).startswith("g0-s0-t0-") and len(h.server.requests_to("/generate")) == 1 else None

    async with harness(encoder, lambda s: EnvSpec(turns=2), select=select, max_staleness=1,
                       inflight_update_policy=policy) as h:
        sample = Sample(prompt=[{"role": "user", "content": "Question?"}], label="x")
        episode = asyncio.ensure_future(generate(h.args, sample))
        await _until(lambda: h.server.num_in_flight == 1)
        h.server.weight_version = "v1"  # the cut request answers with the weights that were running
        await h.ctx.client.sync_weights_from_disk(str(tmp_path), "v2", flush_poll_s=0.01)
        out = await episode
        return out, h.server.requests_to("/generate")


async def test_continue_policy_resends_the_cut_turn_and_keeps_each_tokens_version(encoder, tmp_path):
    sample, requests = await _episode_across_an_update(encoder, tmp_path, "continue")
    assert sample.status is Status.COMPLETED and sample.reward == 1.0
    # The cut request made no tokens, so only v2 made this episode; the cut is recorded on its own turn record.
    assert sample.weight_versions == ["v2"]
    assert [(r.turn, r.truncation_cause) for r in sample.turns] == [(0, TruncationCause.WEIGHT_UPDATE), (0, None),
                                                                   (1, None)]
    assert len(requests) == 3 and requests[1].body["input_ids"] == requests[0].body["input_ids"]
    sample.validate(image_token_id=encoder.vision.image_pad, vision_start_token_id=encoder.vision.vision_start)


async def test_rerun_policy_restarts_an_episode_whose_versions_would_mix(encoder, tmp_path):
    async def across(h) -> Sample:
        sample = Sample(prompt=[{"role": "user", "content": "Question?"}], label="x")
        episode = asyncio.ensure_future(generate(h.args, sample))
        await _until(lambda: h.server.num_in_flight == 1)
        # The first turn was made by v1; the update lands while the second turn is in flight.
        await h.ctx.client.sync_weights_from_disk(str(tmp_path), "v2", flush_poll_s=0.01)
        return await episode

    def select(record: RecordedRequest):
        return Hang() if rid_of(record).startswith("g0-s0-t1-") else None

    async with harness(encoder, lambda s: EnvSpec(turns=2), select=select, max_staleness=1,
                       inflight_update_policy="rerun") as h:
        ended = await across(h)
    assert ended.status is Status.ABORTED and ended.termination.kind is TerminationKind.WEIGHT_UPDATE_RERUN
    assert ended.weight_versions == ["v1"] and ended.turns[-1].truncation_cause is TruncationCause.WEIGHT_UPDATE
    assert h.log.envs[(0, 0)][0].closed == 1  # the discarded episode's env is closed


async def test_a_stream_group_reruns_an_episode_cut_by_an_update_from_its_prompt(encoder, tmp_path):
    state = {"cut": False}

    def select(record: RecordedRequest):
        if rid_of(record).startswith("g0-s0-t1-") and not state["cut"]:
            state["cut"] = True
            return Hang()
        return None

    async with harness(encoder, lambda s: EnvSpec(turns=2), select=select, max_staleness=1,
                       inflight_update_policy="rerun", rollout_batch_size=1, n_samples_per_prompt=2) as h:
        stream = GroupStream(h.args, PromptSource(batch=1), engine_version=0, batches_taken=0,
                             too_stale=lambda samples: False)
        stream.start()
        try:
            await _until(lambda: h.server.num_in_flight >= 1 and state["cut"])
            h.server.weight_version = "v1"
            await h.ctx.client.sync_weights_from_disk(str(tmp_path), "v2", flush_poll_s=0.01)
            batch = await asyncio.wait_for(stream.take(2, rollout_id=0), 10)
        finally:
            await stream.close()
    rerun = next(s for s in batch.result.samples if (s.group_index, s.index) == (0, 0))
    assert rerun.metadata["weight_update_reruns"] == 1 and rerun.weight_versions == ["v2"]
    assert rerun.status is Status.COMPLETED and [t.turn for t in rerun.turns] == [0, 1]


# ----------------------------------------------------------------------------- the group stream
async def test_stream_generates_at_most_k_plus_one_batches_ahead_and_more_after_each_update(encoder):
    async with harness(encoder, lambda s: EnvSpec(turns=1, reward=float(s.index)), max_staleness=1,
                       rollout_batch_size=2, n_samples_per_prompt=2) as h:
        stream = GroupStream(h.args, PromptSource(batch=2), engine_version=0, batches_taken=0,
                             too_stale=lambda samples: False)
        stream.start()
        try:
            await _until(lambda: len(stream.buffer) == 4)
            await asyncio.sleep(0.05)
            assert len(h.server.requests_to("/generate")) == 8  # (K + 1) * B groups of 2, nothing more
            first = await stream.take(2, rollout_id=0)
            await asyncio.sleep(0.05)
            assert len(stream.buffer) == 2 and not stream.running  # the engine still holds version 0
            stream.engine_updated(1)
            await _until(lambda: len(stream.buffer) == 4)
            second = await stream.take(2, rollout_id=1)
        finally:
            await stream.close()
    assert [g.group_index for g in first.groups] == [0, 1] and [g.group_index for g in second.groups] == [2, 3]
    assert all(s.metadata["rollout_id"] == 0 for s in first.result.samples)
    assert first.result.groups_submitted == 4 and second.result.groups_submitted == 2


@pytest.mark.parametrize("policy", ["regenerate", "drop"])
async def test_stale_groups_are_regenerated_or_dropped_and_counted(encoder, policy):
    # Group 1 is slow and made by version 0; once batch 0 is taken the trainer is at version 2 (version-0 tokens lag
    # by 2 > K), and the engine serves version 2 to every group started after that.
    trainer = {"version": 0}
    server: list[FakeSGLangServer] = []

    def select(record: RecordedRequest):
        if rid_of(record).startswith("g1-"):
            return Delay(0.3)
        if not rid_of(record).startswith("g0-"):
            server[0].weight_version = "2"
        return None

    async with harness(encoder, lambda s: EnvSpec(turns=1, reward=float(s.index)), select=select, max_staleness=1,
                       rollout_batch_size=1, n_samples_per_prompt=2, stale_group_policy=policy) as h:
        server.append(h.server)
        h.server.weight_version = "0"
        stream = GroupStream(h.args, PromptSource(batch=1), engine_version=0, batches_taken=0,
                             too_stale=lambda samples: too_stale(samples, trainer["version"], 1))
        stream.start()
        try:
            batch0 = await stream.take(1, rollout_id=0)
            trainer["version"] = 2
            batch1 = await asyncio.wait_for(stream.take(1, rollout_id=1), 10)
        finally:
            await stream.close()
    assert [g.group_index for g in batch0.groups] == [0]
    assert batch1.result.dropped["stale_group"] == 1 and batch1.counters.stale_samples == 2
    taken = batch1.groups[0]
    assert taken.group_index == 2 and all(s.weight_versions == ["2"] for s in taken.samples)
    if policy == "regenerate":
        assert batch1.counters.stale_groups_regenerated == 1
        assert taken.prompt.label == "1"  # group 1's prompt, run again as a new group
    else:
        assert batch1.counters.stale_groups_dropped == 1 and taken.prompt.label == "2"


async def test_a_checkpoint_between_batches_carries_the_groups_dropped_since_and_the_resumed_run_counts_them(encoder):
    # Group 1 finishes too stale after batch 0 was taken; the checkpoint comes before batch 1, which would have
    # counted it. The resumed run counts it with its first batch, and the checkpoint names it.
    trainer = {"version": 0}
    server: list[FakeSGLangServer] = []
    hold = {"on": True}  # later groups wait until the checkpoint: one that finished first would be in it too

    def select(record: RecordedRequest):
        if rid_of(record).startswith("g1-"):
            return Delay(0.3)
        if not rid_of(record).startswith("g0-"):
            if hold["on"]:
                return Hang()
            server[0].weight_version = "2"  # later groups are fresh: group 1 is the only stale one
        return None

    async with harness(encoder, lambda s: EnvSpec(turns=1, reward=float(s.index)), select=select, max_staleness=1,
                       rollout_batch_size=1, n_samples_per_prompt=2, stale_group_policy="drop") as h:
        server.append(h.server)
        h.server.weight_version = "0"
        stream = GroupStream(h.args, PromptSource(batch=1), engine_version=0, batches_taken=0,
                             too_stale=lambda samples: too_stale(samples, trainer["version"], 1))
        stream.start()
        try:
            await stream.take(1, rollout_id=0)
            trainer["version"] = 2
            await _until(lambda: stream.result.dropped["stale_group"] == 1)
            saved = json.loads(json.dumps(stream.checkpoint_state()))
        finally:
            await stream.close()
        hold["on"] = False
        assert saved["dropped_groups"] == [{"group_index": 1, "reason": "stale_group"}]
        assert saved["unreported"]["episodes"] == 2  # group 1's, finished after batch 0
        args = types.SimpleNamespace(**{**vars(h.args), "driver_state": None})
        args.rollout_context = h.ctx
        restore_driver_state(args, saved)
        assert args.driver_state.dropped_groups == [(1, "stale_group")]
        resumed = GroupStream(args, PromptSource(batch=1, start=9), engine_version=2, batches_taken=1,
                              too_stale=lambda samples: False)
        assert resumed.checkpoint_state()["dropped_groups"] == saved["dropped_groups"]  # still pending
        resumed.start()
        try:
            first = await asyncio.wait_for(resumed.take(1, rollout_id=1), 10)
        finally:
            await resumed.close()
    assert first.result.dropped["stale_group"] == 1 and resumed.checkpoint_state()["dropped_groups"] == []
    assert first.result.episodes >= saved["unreported"]["episodes"] + 2  # the carried ones and the batch's own


async def test_stream_checkpoint_restores_buffered_samples_exactly_and_restarts_running_groups(encoder):
    hold = {"on": True}

    def select(record: RecordedRequest):
        return Hang() if hold["on"] and rid_of(record).startswith("g3-") else None

    async with harness(encoder, lambda s: EnvSpec(turns=1, reward=float(s.index)), select=select, max_staleness=1,
                       rollout_batch_size=2, n_samples_per_prompt=2) as h:
        stream = GroupStream(h.args, PromptSource(batch=2), engine_version=0, batches_taken=0,
                             too_stale=lambda samples: False)
        stream.start()
        try:
            await _until(lambda: len(stream.buffer) == 3)
            saved = json.loads(json.dumps(stream.checkpoint_state()))
            buffered = {g.group_index: [s.to_dict() for s in g.samples] for g in stream.buffer}
        finally:
            await stream.close()
        hold["on"] = False
        assert sorted(buffered) == [0, 1, 2]
        args = types.SimpleNamespace(**{**vars(h.args), "driver_state": None})
        args.rollout_context = h.ctx
        restore_driver_state(args, saved)
        assert isinstance(args.driver_state, DriverState)
        resumed = GroupStream(args, PromptSource(batch=2, start=4), engine_version=0, batches_taken=0,
                              too_stale=lambda samples: False)
        assert {g.group_index: [s.to_dict() for s in g.samples] for g in resumed.buffer} == buffered
        resumed.start()
        try:
            first = await resumed.take(2, rollout_id=0)
            second = await asyncio.wait_for(resumed.take(2, rollout_id=1), 10)
        finally:
            await resumed.close()
    assert [g.group_index for g in first.groups] == [0, 1]
    # Group 3 (in flight at the checkpoint) restarts first, before any new prompt.
    assert [g.group_index for g in second.groups] == [2, 3]
    restarted = second.groups[1].samples
    assert all(s.metadata.get("restarted_on_resume") for s in restarted)


# ----------------------------------------------------------------------------- the main job, end to end
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from jaxrl_vlm.tiny import make_tiny

    return make_tiny(tmp_path_factory.mktemp("tiny") / "model", seed=3)


def _job_config(tiny: Path, tmp: Path, url: str, *extra: str):
    prompts = tmp / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"problem": f"Q{i}", "answer": "x", "images": []}) + "\n" for i in range(8)))
    return load_config(None, [
        "--hf-checkpoint", str(tiny), "--prompt-data", str(prompts), "--prompt-style", "plain",
        "--rollout-interaction-env-path", "envs.letter_game", "--max-turns", "1", "--engine-url", url,
        "--num-rollout", "4", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
        "--rollout-max-response-len", "8", "--seq-buckets", "64", "--row-buckets", "8", "--patch-buckets", "0",
        "--output-dir", str(tmp / "run"), "--use-tis", "--max-staleness", "1", *extra,
    ])


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["continue", "rerun"])
async def test_main_job_trains_asynchronously_and_no_sample_exceeds_the_bound(tiny, tmp_path, policy):
    from jaxrl_vlm.job.run import MainJob
    from jaxrl_vlm.job.run_log import read_metrics

    # Heavy-tailed requests: every third one is slow, so updates land while episodes are in flight.
    counter = {"n": 0}

    def select(record: RecordedRequest):
        counter["n"] += 1
        return Delay(0.4) if counter["n"] % 3 == 0 else Delay(0.02)

    trained: list[tuple[int, list[list[int]]]] = []  # (trainer version, each sample's token versions)

    async with FakeSGLangServer(script=select, eos_token_id=151645) as server:
        heldout = tmp_path / "heldout.jsonl"
        heldout.write_text("".join(json.dumps({"problem": f"E{i}", "answer": "x", "images": []}) + "\n"
                                   for i in range(3)))
        job = MainJob(_job_config(tiny, tmp_path, server.url, "--inflight-update-policy", policy,
                                  "--eval-prompt-data", "heldout", str(heldout), "--eval-interval", "2",
                                  "--n-samples-per-eval-prompt", "2"))
        train_on = job.trainer.train_on

        def recording_train_on(samples):  # runs in the worker thread; the job's version moves after it returns
            trained.append((job.version, [[int(v) for v in s.weight_versions] for s in samples]))
            return train_on(samples)

        job.trainer.train_on = recording_train_on
        await job.run()
        versions = [r.body["weight_version"] for r in server.requests_to("/update_weights_from_disk")]
    # The bound itself, on what reached the trainer: no sample's oldest token lags the trainer by more than K = 1.
    assert [v for v, _ in trained] == [0, 1, 2, 3]
    assert all(v - min(s) <= 1 for v, samples in trained for s in samples)
    assert any(v - min(s) == 1 for v, samples in trained for s in samples)  # it did overlap
    if policy == "rerun":  # every sample comes from one version
        assert all(len(set(s)) == 1 for _, samples in trained for s in samples)
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    # Evaluation ran at the step boundaries (0, 2 and after the last step) while the stream kept generating.
    assert [r["step"] for r in records] == [0, 1, 2, 3, 4]
    assert [("eval/heldout/raw_reward" in r) for r in records] == [True, False, True, False, True]
    assert records[4]["eval/heldout/samples"] == 6
    records = records[:4]
    assert [r["weight_version"] for r in records] == [1, 2, 3, 4]
    assert versions == ["0", "1", "2", "3", "4"]  # attach, then one update per step
    for r in records:
        trained = r["rollout/samples"]
        # Every trained sample is in the histogram, and only at staleness 0 or 1.
        assert r["async/staleness_0"] + r["async/staleness_1"] == trained == 4
        assert "async/staleness_2" not in r
        for key in ("async/overlap_fraction", "async/trainer_idle_s", "async/engine_idle_s", "train/tis",
                    "async/offpolicy_token_frac", "perf/train_time", "perf/update_weights_time"):
            assert key in r, key


# ----------------------------------------------------------------------------- SIGKILL and resume
def _read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _checkpoint_with_buffered_groups(directory: Path, at_least: int) -> tuple[int, list[dict]] | None:
    """The latest finished checkpoint whose driver state carries at least `at_least` buffered (not restarting)
    groups, as (step, partial groups); None while there is none. Orbax writes a step under a temporary name and
    renames it when done, so only digit-named directories are complete; a metadata file is read whole or not yet."""
    if not directory.is_dir():
        return None
    for step in sorted((int(p.name) for p in directory.iterdir() if p.name.isdigit()), reverse=True):
        try:
            meta = json.loads((directory / str(step) / "meta" / "metadata").read_text())
        except (OSError, ValueError):
            continue
        carried = meta["driver_state"]["partial_groups"]
        if sum(not g["restart"] for g in carried) >= at_least:
            return step, carried
    return None


@contextlib.contextmanager
def _fake_engine_process() -> Iterator[str]:
    """`python -m rollout.fake_engine` on a free port (20 ms per answer), for CLI runs; yields its URL."""
    engine = subprocess.Popen([sys.executable, "-m", "rollout.fake_engine", "--port", "0", "--latency-s", "0.02"],
                              cwd=REPO, env=_cli_env(), stdout=subprocess.PIPE, text=True)
    try:
        url = engine.stdout.readline().strip().rsplit(" ", 1)[-1]
        assert url.startswith("http://"), url
        yield url
    finally:
        engine.terminate()
        engine.wait(10)


def _cli_env() -> dict[str, str]:
    return {**os.environ, "XLA_FLAGS": xla_flags(1)}  # the CLI runs like a user's: one CPU device


def _async_train_cmd(tiny: Path, tmp: Path, url: str, *extra: str) -> list[str]:
    """`jaxrl-vlm train` of 7 asynchronous steps (K = 1) against the fake engine at `url`, logging what each step
    trained to <output_dir>/trained.jsonl."""
    prompts = tmp / "prompts.jsonl"
    if not prompts.exists():
        prompts.write_text("".join(json.dumps({"problem": f"Q{i}", "answer": "x", "images": []}) + "\n"
                                   for i in range(16)))
    return [sys.executable, "-m", "jaxrl_vlm.cli", "train", "--hf-checkpoint", str(tiny),
            "--prompt-data", str(prompts), "--prompt-style", "plain",
            "--rollout-interaction-env-path", "envs.letter_game", "--max-turns", "1", "--engine-url", url,
            "--num-rollout", "7", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
            "--rollout-max-response-len", "8", "--seq-buckets", "64", "--row-buckets", "8",
            "--patch-buckets", "0", "--use-tis", "--max-staleness", "1", "--custom-rollout-log-function-path",
            str(REPO / "tests" / "_trained_log.py") + ":log_trained", "--output-dir", str(tmp / "run"), *extra]


def _check_resume_trains_the_buffer_first(killed: list[dict], after: list[dict], checkpoint: int,
                                          buffered: list[dict]) -> None:
    """The resumed run's first batch starts with exactly the checkpoint's first two buffered groups (same samples,
    tokens and weight versions; the whole batch when two were buffered); no group is trained twice, and none is
    skipped."""
    expected = [[s["group_index"], s["index"], s["tokens"], s["weight_versions"]]
                for g in buffered[:2] for s in g["finished"]]  # the buffer's order is the order it trains
    assert [r["rollout_id"] for r in after] == list(range(checkpoint, 7))
    assert after[0]["samples"][:len(expected)] == expected  # the buffered samples, exactly
    same_step = [r for r in killed if r["rollout_id"] == checkpoint]
    if same_step:  # the interrupted run took that step's batch before it stopped: the very same samples
        assert same_step[0]["samples"][:len(expected)] == expected
    trained_before = {(s[0], s[1]) for r in killed if r["rollout_id"] < checkpoint for s in r["samples"]}
    trained_after = [(s[0], s[1]) for r in after for s in r["samples"]]
    assert not trained_before & set(trained_after) and len(trained_after) == len(set(trained_after))


@pytest.mark.slow
def test_sigkill_then_load_trains_the_buffered_samples_of_the_checkpoint(tiny, tmp_path):
    """An asynchronous run killed with SIGKILL resumes with `--load` and first trains exactly the groups that were
    buffered at its checkpoint (same samples, same tokens, same weight versions); the groups in flight restart."""
    from jaxrl_vlm.job.run_log import read_metrics

    out = tmp_path / "run"
    with _fake_engine_process() as url:
        def cmd(*extra: str) -> list[str]:
            return _async_train_cmd(tiny, tmp_path, url, "--save-interval", "1", "--keep-checkpoints", "10", *extra)

        proc = subprocess.Popen(cmd(), cwd=REPO, env=_cli_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 600
        try:  # kill as soon as a finished checkpoint really holds two buffered groups (not assumed from a step count)
            while time.monotonic() < deadline:
                found = _checkpoint_with_buffered_groups(out / "checkpoints", at_least=2)
                if found is not None:
                    break
                assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
                time.sleep(0.05)
            else:
                pytest.fail("no checkpoint with two buffered groups was written in time")
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        checkpoint, carried = found
        # A later checkpoint may have been finished between the look and the kill: resume from the one looked at,
        # as if the kill had come right after it.
        for later in (p for p in (out / "checkpoints").iterdir() if p.name.isdigit() and int(p.name) > checkpoint):
            shutil.rmtree(later)
        killed = _read_jsonl(out / "trained.jsonl")
        assert len(killed) < 7, "the run finished before it could be killed"
        buffered = [g for g in carried if not g["restart"]]
        assert len(buffered) >= 2, carried  # the run generated one batch ahead

        (out / "trained.jsonl").rename(out / "trained_killed.jsonl")
        resumed = subprocess.run(cmd("--load", str(out / "checkpoints")), cwd=REPO, env=_cli_env(),
                                 capture_output=True, text=True, timeout=600)
        assert resumed.returncode == 0, resumed.stderr[-3000:]
    _check_resume_trains_the_buffer_first(killed, _read_jsonl(out / "trained.jsonl"), checkpoint, buffered)
    records = {r["step"]: r for r in read_metrics(out / "metrics.jsonl")}
    assert sorted(records) == list(range(7)) and records[6]["weight_version"] == 7


@pytest.mark.slow
def test_sigterm_mid_step_checkpoints_the_stream_buffer_exits_0_and_resumes_from_it(tiny, tmp_path):
    """SIGTERM while an asynchronous step trains (its batch taken, the stream generating the next one): the step
    finishes without its weight sync, the checkpoint after it holds the stream's groups as a periodic one would
    (buffered ones whole, running ones to restart), the run exits 0, and `--load` first trains exactly those
    groups: the buffered ones as they were, then the restarted ones.

    How many of the stream's groups are buffered rather than running at the signal depends on how fast the tiny
    model trains against the fake engine's latency; either kind must come back."""
    from jaxrl_vlm.job.run_log import read_metrics

    out = tmp_path / "run"
    with _fake_engine_process() as url:
        # --save-interval 0: the only checkpoint before the end is the preemption's.
        log = tmp_path / "preempted.log"  # a file, not a pipe: nobody reads a pipe while the test polls
        with open(log, "w") as sink:
            proc = subprocess.Popen(_async_train_cmd(tiny, tmp_path, url, "--save-interval", "0"), cwd=REPO,
                                    env=_cli_env(), stdout=sink, stderr=subprocess.STDOUT)
        trained = out / "trained.jsonl"
        deadline = time.monotonic() + 600
        try:  # the hook writes a step's line when its batch is taken, just before it trains
            while not (trained.exists() and trained.read_text().count("\n") >= 2):  # whole lines only
                assert proc.poll() is None, log.read_text()[-3000:]
                assert time.monotonic() < deadline, "step 1 did not start training in time"
                time.sleep(0.05)
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=300)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        output = log.read_text()
        assert proc.returncode == 0, output[-3000:]
        steps = sorted(int(p.name) for p in (out / "checkpoints").iterdir() if p.name.isdigit())
        assert len(steps) == 1 and steps[0] >= 2, steps  # step 1 (at least) completed
        checkpoint = steps[0]
        assert f"preempted by SIGTERM after {checkpoint} completed steps" in output, output[-3000:]
        assert not (out / "final_model").exists()
        carried = json.loads((out / "checkpoints" / str(checkpoint) / "meta" / "metadata").read_text())[
            "driver_state"]["partial_groups"]
        # The stream generates one batch ahead (K = 1): its groups are in the checkpoint, buffered or to restart.
        assert len(carried) >= 2, carried
        buffered = [g for g in carried if not g["restart"]]
        assert all(len(g["finished"]) == 2 for g in buffered) and all(g["restart"] == [0, 1] for g in carried
                                                                         if g not in buffered), carried
        killed = _read_jsonl(trained)
        assert len(killed) < 7, "the run finished before it could be preempted"
        assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == list(range(checkpoint))

        trained.rename(out / "trained_preempted.jsonl")
        resumed = subprocess.run(_async_train_cmd(tiny, tmp_path, url, "--load", str(out / "checkpoints")),
                                 cwd=REPO, env=_cli_env(), capture_output=True, text=True, timeout=600)
        assert resumed.returncode == 0, resumed.stderr[-3000:]
    after = _read_jsonl(trained)
    _check_resume_trains_the_buffer_first(killed, after, checkpoint, buffered)
    # The first batch is made of the checkpoint's groups only (the restarted ones in the order they finish).
    first = [s[0] for s in after[0]["samples"]]
    assert len(first) == 4 and set(first) <= {g["group_index"] for g in carried}, (first, carried)
    records = {r["step"]: r for r in read_metrics(out / "metrics.jsonl")}
    assert sorted(records) == list(range(7)) and records[6]["weight_version"] == 7


@pytest.mark.slow
async def test_sigterm_while_a_step_trains_checkpoints_the_groups_buffered_meanwhile(tiny, tmp_path):
    """The buffered case made certain: step 1's training (in its worker thread) waits until the stream has buffered
    the next batch, then the process signals itself. The step finishes, and the preemption checkpoint of step 2
    holds those groups whole (same samples, tokens and weight versions); a job resumed from it trains them first."""
    from jaxrl_vlm.job.run import MainJob

    def recording(job: MainJob, trained: list[list[list]], preempt_at: int | None = None) -> None:
        train_on = job.trainer.train_on

        def train_on_then(samples):  # the worker thread; the job's version is the step's until it returns
            trained.append([[s.group_index, s.index, list(s.tokens), list(s.weight_versions)] for s in samples])
            if job.version == preempt_at:
                deadline = time.monotonic() + 60
                while len(job.stream.buffer) < 2:  # the producer runs on the event loop meanwhile
                    assert time.monotonic() < deadline, "the stream buffered no batch while step 1 trained"
                    time.sleep(0.01)
                buffered.extend([s.group_index, s.index, list(s.tokens), list(s.weight_versions)]
                                for g in job.stream.buffer[:2] for s in g.samples)
                os.kill(os.getpid(), signal.SIGTERM)
            return train_on(samples)

        job.trainer.train_on = train_on_then

    buffered: list[list] = []
    before: list[list[list]] = []
    after: list[list[list]] = []
    async with FakeSGLangServer(script=lambda record: Delay(0.02), eos_token_id=151645) as server:
        # --save-interval 2: the periodic checkpoint of step 2 is written just before the job sees the signal, and the
        # preemption keeps it (the subprocess tests above cover the checkpoint the preemption writes itself).
        job = MainJob(_job_config(tiny, tmp_path, server.url, "--save-interval", "2"))
        recording(job, before, preempt_at=1)
        await job.run()
        assert job.preempted is not None and job.preempted.completed_steps == 2, job.preempted
        assert job.preempted.signals == "SIGTERM" and job.preempted.aborted is None  # step 1 was finished
        checkpoints = tmp_path / "run" / "checkpoints"
        meta = json.loads((checkpoints / "2" / "meta" / "metadata").read_text())
        saved = [[s["group_index"], s["index"], s["tokens"], s["weight_versions"]]
                 for g in meta["driver_state"]["partial_groups"] if not g["restart"] for s in g["finished"]]
        assert len(buffered) == 4 and saved[:4] == buffered  # the stream's buffer at the signal, whole
        assert not (tmp_path / "run" / "final_model").exists()

        assert sorted(int(p.name) for p in checkpoints.iterdir() if p.name.isdigit()) == [2]
        resumed = MainJob(_job_config(tiny, tmp_path, server.url, "--load", str(checkpoints)))
        recording(resumed, after)
        await resumed.run()
    assert resumed.preempted is None and len(before) == 2 and len(after) == 2  # steps 0-1, then 2-3
    assert after[0] == buffered
