"""The project's client against SGLang 0.5.23's own HTTP layer (`_sglang_stub_server.py`), call by call, and the
embedded engine's answers against SGLang's, key by key.

Every call that training, eval, weight sync, colocate release/resume, abort and recovery make goes through
SGLang's real routes, request models, schema gate and answer builders; a refusal or a shape the client cannot read
fails here. The three breaks found against 0.5.23 (reference/sglang_conformance.md) each have a test:
`test_a_queued_abort_is_an_abort_*`, `test_recovery_resumes_a_paused_sglang`, `test_every_launcher_flag_*`.
"""

from __future__ import annotations

import asyncio
import json
from types import ModuleType, SimpleNamespace
from typing import Any

import aiohttp
import numpy as np
import pytest
from PIL import Image

from conftest import SGLANG_VERSION, run_in_sglang
from envs.base import BaseInteractionEnv
from rollout.client import SGLangClient
from rollout.encoding import ChatEncoder
from rollout.multiturn import RolloutContext, generate
from rollout.processing import image_to_data_url
from rollout.sample import Sample, Status
from rollout.sglang_wire import FinishType, WeightVersionSpan
from rollout.video import Clip
from rollout.video_io import clip_to_data_url, load_clip

pytestmark = pytest.mark.sglang_conformance

PARAMS = {"max_new_tokens": 4, "temperature": 1.0, "top_p": 1.0, "top_k": -1, "stop_token_ids": [151645],
          "skip_special_tokens": False, "no_stop_trim": True, "spaces_between_special_tokens": False}


def client_for(url: str, **kw: Any) -> SGLangClient:
    return SGLangClient(url, **{"connect_timeout_s": 5.0, "control_timeout_s": 30.0, "health_timeout_s": 30.0, **kw})


async def _hold(url: str, hold: bool) -> None:
    async with aiohttp.ClientSession() as http:
        async with http.post(url + "/stub/hold", json={"hold": hold}) as reply:
            assert reply.status == 200


def shape(value: Any) -> Any:
    """Keys and JSON types of an answer, recursively (lists by their first item): what a client can rely on."""
    if isinstance(value, dict):
        return {k: shape(v) for k, v in sorted(value.items())}
    if isinstance(value, list):
        return [shape(value[0])] if value else []
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, (int, float)):
        return "number"
    return type(value).__name__


# ---------------------------------------------------------------------------------------------- the calls


async def test_generate_with_every_sampling_param_the_client_sends(sglang_server):
    async with client_for(sglang_server.url) as client:
        params = {**PARAMS, "stop": ["\n\n"], "logit_bias": {"151655": -100.0}, "sampling_seed": 7}
        result = await client.generate([151644, 872, 198, 3838], sampling_params=params, rid="ep1-t0")
        greedy = await client.generate([5, 6], sampling_params={"max_new_tokens": 2, "temperature": 0.0})
    assert result.finish_reason is FinishType.LENGTH and result.output_ids == [3839, 3840, 3841, 3842]
    assert result.prompt_tokens == 4 and result.rid == "ep1-t0" and result.output_log_probs == [-0.25] * 4
    assert result.weight_version == "default"
    assert result.weight_version_spans == (WeightVersionSpan("default", 0, 4),)
    assert greedy.finish_reason is FinishType.LENGTH and len(greedy.output_ids) == 2


async def test_a_clip_request_passes_sglangs_request_model_with_its_video_data(sglang_server):
    """A turn with a picture and two clips (one compact pad each): SGLang's GenerateReqInput takes the body and keeps
    the clips' data URLs as they were sent, in order, beside the picture."""
    rng = np.random.default_rng(0)
    clips = [clip_to_data_url(Clip.of(rng.integers(0, 256, (n, 24, 32, 3), dtype=np.uint8), 2.0)) for n in (3, 5)]
    picture = image_to_data_url(Image.new("RGB", (32, 32), (200, 10, 10)))
    async with client_for(sglang_server.url) as client:
        result = await client.generate([151644, 151652, 151656, 151653, 151652, 151655, 151653, 151652, 151656, 151653],
                                       image_data=[picture], video_data=clips, sampling_params=PARAMS, rid="clips")
        async with aiohttp.ClientSession() as http:
            async with http.get(sglang_server.url + "/stub/seen/clips") as reply:
                seen = await reply.json()
    assert result.finish_reason is FinishType.LENGTH
    assert seen["video_data"] == clips and seen["image_data"] == [picture]
    assert load_clip(seen["video_data"][1]).frames.shape == (5, 24, 32, 3)


async def test_info_loads_flush_and_colocate_calls(sglang_server):
    async with client_for(sglang_server.url) as client:
        info = await client.get_model_info()
        server_info = await client.get_server_info()
        loads = await client.get_loads()
        assert await client.flush_cache()
        await client.freeze_gc()
        await client.release_memory_occupation()
        await client.resume_memory_occupation(["weights"])
        await client.resume_memory_occupation(["kv_cache"])
        assert await client.get_weight_version() == "default"
    assert info["weight_version"] == "default" and info["model_type"] == "qwen3_vl"
    assert server_info["version"] == SGLANG_VERSION and "internal_states" in server_info
    assert isinstance(loads["timestamp"], str) and loads["loads"][0]["num_running_reqs"] == 0


async def test_sglang_has_no_get_weight_version_route(sglang_server):
    async with aiohttp.ClientSession() as http:
        async with http.get(sglang_server.url + "/get_weight_version") as reply:
            assert reply.status == 404


async def test_weight_sync_sequence_sets_the_version(sglang_server, tmp_path):
    async with client_for(sglang_server.url) as client:
        answers = await client.sync_weights_from_disk(str(tmp_path), "v1", flush_poll_s=0.05)
        assert await client.get_weight_version() == "v1"
        after = await client.generate([9], sampling_params=PARAMS)
        await client.sync_weights_from_disk(str(tmp_path), "default", flush_poll_s=0.05)
    assert answers[sglang_server.url]["success"] is True
    assert after.weight_version == "v1" and after.token_weight_versions == ["v1"]


# ---------------------------------------------------------------------------------------------- break 1


async def test_a_queued_abort_is_an_abort_not_a_malformed_answer(sglang_server):
    """Break 1: SGLang answers a request aborted in its waiting queue without prompt_tokens / cached_tokens."""
    async with client_for(sglang_server.url) as client:
        await _hold(sglang_server.url, True)
        try:
            pending = asyncio.ensure_future(client.generate([11, 12], sampling_params=PARAMS, rid="queued-1"))
            await asyncio.sleep(0.3)
            await client.abort_all(timeout_s=10, retry_interval_s=0.2)
            result = await pending
        finally:
            await _hold(sglang_server.url, False)
    assert "prompt_tokens" not in result.meta_info and "cached_tokens" not in result.meta_info
    assert result.finish_reason is FinishType.ABORT and result.finish_message == "Abort in waiting queue"
    assert result.prompt_tokens is None and result.output_ids == []


class _EndlessEnv(BaseInteractionEnv):
    def reset(self) -> None:
        pass

    async def step(self, response_text: str):
        return {"obs_str": "go on"}, False, {}

    def close(self) -> None:
        pass


def _episode_args(ctx: RolloutContext) -> SimpleNamespace:
    return SimpleNamespace(
        rollout_max_response_len=64, rollout_max_context_len=None, max_turns=3, max_env_retries_per_turn=1,
        env_step_timeout=5.0, episode_timeout=30.0, delta_check="off", rollout_temperature=1.0, rollout_top_p=1.0,
        rollout_top_k=-1, rollout_stop_token_ids=[], partial_rollout=True, rollout_context=ctx)


async def test_a_straggler_abort_of_a_queued_request_is_carried_over_by_partial_rollout(sglang_server, tiny_tokenizer,
                                                                                        tiny_image_processor):
    """The driver's straggler abort (`ctx.aborting`, then `abort_all`) meets an episode whose request still waits
    in SGLang's queue: with partial rollout the sample is ABORTED (carried over), not FAILED for the answer's shape."""
    module = ModuleType("endless_env")
    module.build_env = lambda sample, args: _EndlessEnv()
    async with client_for(sglang_server.url) as client:
        ctx = RolloutContext(client=client, encoder=ChatEncoder(tiny_tokenizer, tiny_image_processor),
                             env_module=module, generate_slots=asyncio.Semaphore(4))
        sample = Sample(prompt=[{"role": "user", "content": [{"type": "text", "text": "Find x."}]}], label="7")
        await _hold(sglang_server.url, True)
        try:
            episode = asyncio.ensure_future(generate(_episode_args(ctx), sample))
            await asyncio.sleep(0.5)
            ctx.aborting = True  # what rollout.driver does to its stragglers
            await client.abort_all(timeout_s=10.0, retry_interval_s=0.2)
            out = await asyncio.wait_for(episode, 20.0)
        finally:
            await _hold(sglang_server.url, False)
    assert out.status is Status.ABORTED, (out.status, out.metadata)
    assert out.turns and out.turns[-1].finish_reason is FinishType.ABORT


# ---------------------------------------------------------------------------------------------- break 2


async def test_health_blocks_while_paused_and_recovery_resumes_a_paused_sglang(sglang_server):
    """Break 2: a paused SGLang's /health waits on the pause and answers 503 (after SGLANG_HEALTH_CHECK_TIMEOUT,
    3 s here); recovery must resume it without waiting for health first."""
    async with client_for(sglang_server.url, health_timeout_s=10.0) as client:
        await client.pause_generation("abort")
        assert not await client.health()
        await client.resume_and_wait_healthy(timeout_s=15.0, poll_interval_s=0.2)
        assert await client.health()
        result = await client.generate([3], sampling_params=PARAMS)
    assert result.finish_reason is FinishType.LENGTH


async def test_pause_modes_and_continue(sglang_server):
    async with client_for(sglang_server.url) as client:
        for mode in ("abort", "retract", "in_place"):
            assert (await client.pause_generation(mode))["status"] == "ok"
            assert (await client.continue_generation())["status"] == "ok"


# ---------------------------------------------------------------------------------------------- spans


async def test_weights_changed_under_a_retracted_request_give_per_token_versions(sglang_server, tmp_path):
    async with client_for(sglang_server.url) as client:
        params = {**PARAMS, "max_new_tokens": 40}
        pending = asyncio.ensure_future(client.generate([20], sampling_params=params))
        await asyncio.sleep(0.3)  # a few tokens at "default"
        await client.sync_weights_from_disk(str(tmp_path), "v2", pause_mode="retract", flush_poll_s=0.05)
        result = await pending
        await client.sync_weights_from_disk(str(tmp_path), "default", flush_poll_s=0.05)
    spans = result.weight_version_spans
    assert [s.version for s in spans] == ["default", "v2"] and spans[0].end == spans[1].start
    assert 0 < spans[0].end < 40 and spans[-1].end == 40 and result.token_weight_versions == ["default", "v2"]


# ---------------------------------------------------------------------------------------------- break 3


def test_every_launcher_flag_parses_in_sglangs_server_args():
    """Break 3: every flag our launcher and slime's `--sglang-*` forwarding produce, through 0.5.23's argparse."""
    from _slime_geo3k_args import argv

    from jaxrl_vlm.config import load_config
    from jaxrl_vlm.sglang_launcher import SGLangProcess

    cfg = load_config(None, argv("fsdp"))
    proc = SGLangProcess("python", "/models/m", port=30000,
                         extra_args=[*cfg.engine.sglang_args, "--tp-size", "2", "--dp-size", "2", "--api-key", "k",
                                     "--enable-memory-saver"], log_path="/dev/null")
    args = proc.command[3:]  # after `python -m sglang.launch_server`
    out = run_in_sglang(
        "import argparse, json\nfrom sglang.srt.server_args import ServerArgs\n"
        "p = argparse.ArgumentParser(exit_on_error=False)\nServerArgs.add_cli_args(p)\n"
        f"ns = p.parse_args({json.dumps(args)})\n"
        "print(json.dumps({'bs': ns.cuda_graph_bs_decode, 'mem': ns.mem_fraction_static, 'tp': ns.tp_size}))\n")
    parsed = json.loads(out.strip().splitlines()[-1])
    assert parsed["bs"][:5] == [1, 2, 4, 8, 16] and parsed["tp"] == 2


# ---------------------------------------------------------------------------------------------- shapes


async def _answers(url: str, prompt_ids: list[int]) -> dict[str, dict[str, Any]]:
    """The raw JSON answers of one engine for the compared cases."""
    out: dict[str, dict[str, Any]] = {}
    async with aiohttp.ClientSession() as http:
        async def post(path: str, body: Any) -> Any:
            async with http.post(url + path, json=body) as reply:
                return reply.status, await reply.json(content_type=None)

        status, out["generate"] = await post("/generate", {"input_ids": prompt_ids, "return_logprob": True,
                                                          "sampling_params": {**PARAMS, "ignore_eos": True}})
        assert status == 200, out["generate"]
        out["pause"] = (await post("/pause_generation", {"mode": "abort"}))[1]
        out["continue"] = (await post("/continue_generation", {}))[1]
        status, out["abort_empty"] = await post("/abort_request", {})
        assert status == 200
        out["int_weight_version_status"] = {"status": (await post("/update_weights_from_disk",
                                                                  {"model_path": "/x", "weight_version": 3}))[0]}
        out["pause_no_body_status"] = {"status": (await post("/pause_generation", None))[0]}
        async with http.get(url + "/model_info") as reply:
            info = await reply.json()
            out["model_info_version"] = {"weight_version": info["weight_version"]}
            out["model_info"] = info
        async with http.get(url + "/v1/loads", params={"include": "core"}) as reply:
            assert reply.status == 200
            out["loads"] = await reply.json(content_type=None)
        async with http.post(url + "/flush_cache") as reply:  # idle: flushed (a plain-text answer)
            out["flush_idle_status"] = {"status": reply.status, "text": await reply.text()}
        async with http.post(url + "/freeze_gc") as reply:  # a plain-text answer too
            out["freeze_gc_status"] = {"status": reply.status, "text": await reply.text()}
        # Refusals, one of each kind: request-model validation, the schema gate, a refused value.
        for case, path, kw in ERROR_CASES:
            async with http.post(url + path, **kw) as reply:
                out[case] = {"status": reply.status, "body": await reply.json(content_type=None)}
    return out


ERROR_CASES = [
    ("error_body_not_json", "/generate", {"data": "not json"}),
    ("error_update_without_model_path", "/update_weights_from_disk", {"json": {}}),
    ("error_unknown_pause_mode", "/pause_generation", {"json": {"mode": "bogus"}}),
    ("error_abort_all_not_a_bool", "/abort_request", {"json": {"abort_all": "maybe"}}),
    ("error_sampling_param_of_the_wrong_type", "/generate",
     {"json": {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": "x"}}}),
    ("error_temperature_of_the_wrong_type", "/generate",
     {"json": {"input_ids": [5, 6], "sampling_params": {"temperature": "hot"}}}),
    ("error_negative_temperature", "/generate",
     {"json": {"input_ids": [5, 6], "sampling_params": {"temperature": -1, "max_new_tokens": 2}}}),
    ("error_no_prompt", "/generate", {"json": {"sampling_params": {"max_new_tokens": 2}}}),
]


@pytest.mark.parametrize("case", ["generate", "pause", "continue", "int_weight_version_status", "pause_no_body_status",
                                  "model_info_version", "model_info", "loads", "flush_idle_status", "freeze_gc_status",
                                  *(case for case, _, _ in ERROR_CASES)])
async def test_the_embedded_engine_answers_with_sglangs_shapes(sglang_server, embedded_engine_url, case):
    ours = (await _answers(embedded_engine_url, [5, 6, 7]))[case]
    theirs = (await _answers(sglang_server.url, [5, 6, 7]))[case]
    if case.endswith("_status"):
        assert ours == theirs
    elif case.startswith("error_"):
        assert ours["status"] == theirs["status"] and shape(ours["body"]) == shape(theirs["body"]), (ours, theirs)
    else:
        assert shape(ours) == shape(theirs)


async def test_the_embedded_queued_abort_has_sglangs_shape(sglang_server, embedded_engine_url):
    """The same queued abort on both engines: SGLang's stub held in its queue, ours paused (requests wait)."""
    async def queued_abort(url: str, hold: Any) -> dict[str, Any]:
        async with client_for(url) as client:
            await hold(True)
            try:
                pending = asyncio.ensure_future(client.generate([30, 31], sampling_params=PARAMS))
                await asyncio.sleep(0.5)
                await client.abort_request(abort_all=True)
                return (await pending).meta_info
            finally:
                await hold(False)

    theirs = await queued_abort(sglang_server.url, lambda on: _hold(sglang_server.url, on))

    async def pause_ours(on: bool) -> None:
        async with client_for(embedded_engine_url) as c:
            await (c.pause_generation("in_place") if on else c.continue_generation())

    ours = await queued_abort(embedded_engine_url, pause_ours)
    assert shape(ours) == shape(theirs) and ours["finish_reason"] == theirs["finish_reason"]
