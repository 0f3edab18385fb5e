"""The embedded engine over real loopback HTTP, against transformers and our own teacher-forced model.

One engine (tiny Qwen3-VL, fp32, 16 slots) serves the whole module so the number of compiled
programs stays small. Its weights are the `tiny_hf_checkpoint` architecture re-drawn with a wider
spread (like `_hf_tiny`): HF's 0.02-std init gives nearly uniform logits, whose greedy argmax would
hinge on float rounding and mostly repeat one token.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from _hf_tiny import spread_weights
from flax import nnx
from _launch import xla_flags

from jaxrl_vlm.device_lock import run_exclusive
from jaxrl_vlm.engine import EmbeddedEngine, EngineOptions
from jaxrl_vlm.models import build_vision_inputs, from_hf, get_rope_index, to_hf, token_logprobs
from jaxrl_vlm.xla_cpu_cores import allowed_cores, parse_cpu_list
from rollout.client import RetryPolicy, SGLangClient, WeightSyncError
from rollout.encoding import ChatEncoder
from rollout.multiturn import merge_multimodal_chunks
from rollout.processing import image_to_data_url
from rollout.video import Clip, load_video_processor_config

MAX_SEQ = 256
REF_T = 256  # teacher-forced reference: one padded shape for every check (a single compile)
REF_PATCHES = 64
FAST = RetryPolicy(max_retries=1, backoff_base_s=0.001, backoff_max_s=0.01)
GREEDY = {"temperature": 0.0, "max_new_tokens": 24}
VIDEO_PAD = "<|video_pad|>"  # in a malformed body's input_ids: the tiny tokenizer's id, substituted in the test


def _spread_weights(model: torch.nn.Module, seed: int) -> None:
    # Small tied embeddings: large ones make the model copy its last input token forever.
    spread_weights(model, seed, embed_std=0.1)


@pytest.fixture(scope="module")
def checkpoint(tiny_hf_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    """(model dir, transformers model) with spread-out random weights and the tiny processing files."""
    from transformers import Qwen3VLForConditionalGeneration

    hf = Qwen3VLForConditionalGeneration.from_pretrained(str(tiny_hf_checkpoint), dtype=torch.float32).eval()
    _spread_weights(hf, seed=1)
    out = tmp_path_factory.mktemp("engine_ckpt")
    hf.save_pretrained(str(out))
    for item in tiny_hf_checkpoint.iterdir():
        if item.suffix != ".safetensors" and item.name not in ("config.json", "generation_config.json"):
            shutil.copy2(item, out / item.name)
    return out, hf


@pytest.fixture(scope="module")
def engine(checkpoint: tuple[Path, Any]) -> EmbeddedEngine:
    config = EngineOptions(max_batch=16, max_seq_len=MAX_SEQ, min_prefill_bucket=64, min_kv_bucket=MAX_SEQ,
                          decode_batch_sizes=(4, 16), min_patch_bucket=REF_PATCHES)
    eng = EmbeddedEngine(str(checkpoint[0]), config=config)
    eng.start()
    yield eng
    eng.stop()


@pytest.fixture(scope="module")
def encoder(engine: EmbeddedEngine) -> ChatEncoder:
    return ChatEncoder(engine.engine.tokenizer, engine.engine.image_processor)


def client(engine: EmbeddedEngine) -> SGLangClient:
    return SGLangClient(engine.url, retry=FAST, timeout_s=120.0)


def text_prompt(encoder: ChatEncoder, words: str) -> list[int]:
    return encoder.encode_prompt([{"role": "user", "content": words}]).wire_ids


async def post(engine: EmbeddedEngine, path: str, body: Any = None, method: str = "POST") -> tuple[int, Any]:
    async with aiohttp.ClientSession() as s:
        async with s.request(method, engine.url + path, json=body) as r:
            text = await r.text()
            try:
                return r.status, await r.json(content_type=None) if text.strip() else None
            except ValueError:
                return r.status, text


async def wait_running(engine: EmbeddedEngine, n: int, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        _, loads = await post(engine, "/v1/loads", method="GET")
        if loads["loads"][0]["num_running_reqs"] >= n:
            return
        assert time.monotonic() < deadline, f"never saw {n} running request(s): {loads}"
        await asyncio.sleep(0.002)


# ---------------------------------------------------------------------------- references


def _hf_mm_kwargs(hf: Any, x: torch.Tensor, mm: dict[str, np.ndarray] | None, image_token: int) -> dict[str, Any]:
    """transformers' multimodal inputs of token batch `x`: pictures and/or clips, with `mm_token_type_ids`."""
    if mm is None:
        return {}
    kwargs: dict[str, Any] = {"mm_token_type_ids": (x == image_token).long() + 2 * (x == hf.config.video_token_id).long()}
    for key in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw", "second_per_grid_ts"):
        if key in mm:
            kwargs[key] = torch.from_numpy(mm[key])
    return kwargs


def hf_generate(hf: Any, ids: list[int], max_new: int, mm: dict[str, np.ndarray] | None = None, image_token: int = -1) -> list[int]:
    """transformers' greedy `generate` (its generation_config stops at <|im_end|> and <|endoftext|>)."""
    x = torch.tensor([ids])
    with torch.no_grad():
        out = hf.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=max_new, do_sample=False,
                          **_hf_mm_kwargs(hf, x, mm, image_token))
    return out[0, len(ids):].tolist()


def hf_logprobs(hf: Any, ids: list[int], outputs: list[int], mm: dict[str, np.ndarray] | None, image_token: int) -> np.ndarray:
    """log_softmax of transformers' logits at each output token (teacher-forced)."""
    x = torch.tensor([ids + outputs])
    with torch.no_grad():
        logits = hf(input_ids=x, attention_mask=torch.ones_like(x), **_hf_mm_kwargs(hf, x, mm, image_token)).logits[0].float()
    lp = torch.log_softmax(logits, dim=-1).numpy()
    return np.array([lp[len(ids) - 1 + i, t] for i, t in enumerate(outputs)])


@nnx.jit
def _teacher_forced(model, tokens, positions, segment_ids, vision, targets):
    return token_logprobs(model, model(tokens, positions, segment_ids, vision), targets)[0]


@nnx.jit
def _tempered(model, tokens, positions, segment_ids, vision, temperature):
    return jax.nn.log_softmax(model.logits(model(tokens, positions, segment_ids, vision)) / temperature, axis=-1)


def our_logits_logprobs(engine: EmbeddedEngine, ids: list[int], outputs: list[int], mm: dict[str, np.ndarray] | None,
                        temperature: float = 1.0) -> np.ndarray:
    """Our serving model's full (non-cached) forward over prompt + outputs: log_softmax(logits / T)
    at the output positions."""
    model = engine.engine.runner.model()
    cfg = model.cfg
    seq = np.asarray(ids + outputs, np.int64)
    tokens = np.zeros((1, REF_T), np.int64)
    tokens[0, : seq.size] = seq
    mask = np.zeros((1, REF_T), np.int32)
    mask[0, : seq.size] = 1
    grid = None if mm is None else mm["image_grid_thw"]
    positions, _ = get_rope_index(tokens, grid, mask, cfg)
    pixels = np.zeros((0, cfg.vision.patch_dim), np.float32) if mm is None else mm["pixel_values"]
    vis = build_vision_inputs(pixels, np.zeros((0, 3), np.int64) if grid is None else grid, tokens, cfg,
                              patch_bucket=REF_PATCHES, token_valid=mask)
    if temperature == 1.0:
        targets = np.zeros((1, REF_T), np.int32)
        targets[0, : seq.size - 1] = seq[1:]
        lp = np.asarray(_teacher_forced(model, jnp.asarray(tokens, jnp.int32), jnp.asarray(positions), jnp.asarray(mask), vis,
                                        jnp.asarray(targets)))
        return lp[0, len(ids) - 1 : len(ids) - 1 + len(outputs)]
    lp = np.asarray(_tempered(model, jnp.asarray(tokens, jnp.int32), jnp.asarray(positions), jnp.asarray(mask), vis,
                              jnp.float32(temperature)))[0]
    return np.array([lp[len(ids) - 1 + i, t] for i, t in enumerate(outputs)])


# ---------------------------------------------------------------------------- generation


@pytest.mark.slow
async def test_greedy_text_equals_transformers_generate_and_logprobs_are_teacher_forced(engine, checkpoint, encoder):
    _, hf = checkpoint
    ids = text_prompt(encoder, "Find the area of the triangle with base 6 and height 4.")
    async with client(engine) as c:
        result = await c.generate(ids, sampling_params=GREEDY)
    expected = hf_generate(hf, ids, GREEDY["max_new_tokens"])
    assert result.output_ids == expected
    assert len(set(expected)) > 3, "degenerate reference: the test would not see a wrong token"
    eos = set(engine.engine.eos_ids)
    if expected[-1] in eos:
        assert (result.finish_reason, result.finish_matched) == ("stop", expected[-1])
    else:
        assert (result.finish_reason, result.meta_info["finish_reason"]["length"]) == ("length", GREEDY["max_new_tokens"])
    assert result.prompt_tokens == len(ids)
    ours = our_logits_logprobs(engine, ids, result.output_ids, None)
    np.testing.assert_allclose(result.output_log_probs, ours, atol=1e-4, rtol=0)
    np.testing.assert_allclose(result.output_log_probs, hf_logprobs(hf, ids, result.output_ids, None, -1), atol=1e-4, rtol=0)


async def test_greedy_image_prompt_equals_transformers_generate(engine, checkpoint, encoder, make_test_image):
    _, hf = checkpoint
    image = make_test_image(5, (96, 80))
    seg = encoder.encode_prompt([{"role": "user", "content": [{"type": "image", "image": image},
                                                               {"type": "text", "text": "What is x?"}]}])
    assert seg.wire_ids.count(encoder.vision.image_pad) == 1  # compact on the wire
    async with client(engine) as c:
        result = await c.generate(seg.wire_ids, image_data=seg.image_data, sampling_params=GREEDY)
    pad = encoder.vision.image_pad
    expected = hf_generate(hf, seg.train_ids, GREEDY["max_new_tokens"], seg.mm_inputs, pad)
    assert result.output_ids == expected
    assert result.prompt_tokens == len(seg.train_ids) > len(seg.wire_ids)
    ours = our_logits_logprobs(engine, seg.train_ids, result.output_ids, seg.mm_inputs)
    np.testing.assert_allclose(result.output_log_probs, ours, atol=1e-4, rtol=0)
    np.testing.assert_allclose(result.output_log_probs, hf_logprobs(hf, seg.train_ids, result.output_ids, seg.mm_inputs, pad),
                               atol=1e-4, rtol=0)
    # The image changes the answer: the same text with a different picture does not give the same tokens.
    other = encoder.encode_prompt([{"role": "user", "content": [{"type": "image", "image": make_test_image(9, (96, 80))},
                                                                 {"type": "text", "text": "What is x?"}]}])
    async with client(engine) as c:
        second = await c.generate(other.wire_ids, image_data=other.image_data, sampling_params=GREEDY)
    assert second.output_ids == hf_generate(hf, other.train_ids, GREEDY["max_new_tokens"], other.mm_inputs, pad)
    assert second.output_ids != result.output_ids


async def test_a_two_turn_clip_episode_equals_transformers_generate_and_reuses_the_first_turn(engine, checkpoint):
    """Clips on the wire (`video_data`, one compact pad each): a clip in the prompt, then an observation with a
    second clip after the model's turn. Each turn's greedy tokens and log-probs equal transformers' on the training
    view, and the second turn is served from the first turn's pages (its cached tokens counted)."""
    _, hf = checkpoint
    encoder = ChatEncoder(engine.engine.tokenizer, engine.engine.image_processor,
                          video_config=load_video_processor_config(checkpoint[0]))
    rng = np.random.default_rng(7)
    first = Clip.of(rng.integers(0, 256, (9, 40, 56, 3), dtype=np.uint8), 4.0)
    second = Clip.of(rng.integers(0, 256, (5, 48, 48, 3), dtype=np.uint8), 2.5)
    prompt = encoder.encode_prompt([{"role": "user", "content": [{"type": "video", "video": first},
                                                                 {"type": "text", "text": "Which way did it go?"}]}])
    pad = encoder.vision.image_pad
    async with client(engine) as c:
        one = await c.generate(prompt.wire_ids, video_data=prompt.video_data, sampling_params=GREEDY)
        assert one.output_ids == hf_generate(hf, prompt.train_ids, GREEDY["max_new_tokens"], prompt.mm_inputs, pad)
        assert one.prompt_tokens == len(prompt.train_ids) and one.cached_tokens == 0
        obs = encoder.encode_observation(
            [{"role": "user", "content": [{"type": "video", "video": second}, {"type": "text", "text": "Again:"}]}],
            model_ended_turn=one.output_ids[-1] == encoder.vision.im_end)
        engine_clips = engine.engine.preparer.encoder.clips
        hits = engine_clips.hits
        two = await c.generate(prompt.wire_ids + one.output_ids + obs.wire_ids,
                               video_data=prompt.video_data + obs.video_data, sampling_params=GREEDY)
    train = prompt.train_ids + one.output_ids + obs.train_ids
    mm = merge_multimodal_chunks([prompt.mm_inputs, obs.mm_inputs], "episode")
    assert mm["video_grid_thw"].shape == (2, 3)
    assert two.output_ids == hf_generate(hf, train, GREEDY["max_new_tokens"], mm, pad)
    assert len(set(one.output_ids + two.output_ids)) > 3, "degenerate reference: the test would not see a wrong token"
    np.testing.assert_allclose(two.output_log_probs, hf_logprobs(hf, train, two.output_ids, mm, pad), atol=1e-4, rtol=0)
    assert two.prompt_tokens == len(train)
    assert two.cached_tokens == one.prompt_tokens + len(one.output_ids) - 1  # all but the last sampled token
    assert engine_clips.hits == hits + 1  # the re-sent first clip was neither decoded nor processed again


async def test_prompt_logprobs_of_a_trajectory_with_its_picture_equal_the_trainer_forward(engine, encoder,
                                                                                            make_test_image):
    """On-policy distillation's teacher scoring (SGLang's `logprob_start_len: 0`, `max_new_tokens: 0`): every
    position's log-prob of a prompt + response with an image, as the trainer's forward computes them."""
    seg = encoder.encode_prompt([{"role": "user", "content": [{"type": "image", "image": make_test_image(3, (96, 80))},
                                                               {"type": "text", "text": "Which colour?"}]}])
    async with client(engine) as c:
        answer = await c.generate(seg.wire_ids, image_data=seg.image_data, sampling_params=GREEDY)
        wire = seg.wire_ids + answer.output_ids
        scored = await c.prompt_logprobs(wire, image_data=seg.image_data)
        _, raw = await post(engine, "/generate", {"input_ids": wire, "image_data": seg.image_data,
                                                  "sampling_params": {"max_new_tokens": 0}, "return_logprob": True,
                                                  "logprob_start_len": 3})
    train = seg.train_ids + answer.output_ids
    assert len(scored) == len(train) - 1
    ours = our_logits_logprobs(engine, train[:1], train[1:], seg.mm_inputs)
    np.testing.assert_allclose(scored, ours, atol=1e-5, rtol=0)
    # SGLang's shape: [logprob, id, null] from position 3 on, nothing generated.
    meta = raw["meta_info"]
    assert [e[1] for e in meta["input_token_logprobs"]] == train[3:]
    assert [e[0] for e in meta["input_token_logprobs"]] == pytest.approx(scored[2:], abs=1e-6)
    assert meta["output_token_logprobs"] == [] and raw["output_ids"] == [] and meta["prompt_tokens"] == len(train)


@pytest.mark.slow
async def test_16_concurrent_requests_equal_their_solo_results_and_share_decode_steps(engine, encoder):
    prompts = [text_prompt(encoder, " ".join(["side angle circle radius"] * (1 + i % 8)) + f" case {i}") for i in range(16)]
    budgets = [8 + (5 * i) % 17 for i in range(16)]
    assert len({len(p) for p in prompts}) >= 8
    params = [{"temperature": 0.0, "max_new_tokens": n, "ignore_eos": True} for n in budgets]
    async with client(engine) as c:
        solo = [await c.generate(p, sampling_params=sp) for p, sp in zip(prompts, params)]
        before = engine.stats.decode_steps, engine.stats.generated_tokens, engine.engine.runner.program_calls.copy()
        overlapped = engine.stats.overlapped_steps
        together = await asyncio.gather(*(c.generate(p, sampling_params=sp) for p, sp in zip(prompts, params)))
        steps = engine.stats.decode_steps - before[0]
        overlapped = engine.stats.overlapped_steps - overlapped
        tokens = engine.stats.generated_tokens - before[1]
        # More requests than the 16 slots: the rest wait for a free slot and still come out right.
        overflow = await asyncio.gather(*(c.generate(prompts[i % 16], sampling_params=params[i % 16]) for i in range(22)))
    assert [r.output_ids for r in overflow] == [solo[i % 16].output_ids for i in range(22)]
    for i, (a, b) in enumerate(zip(solo, together)):
        assert b.output_ids == a.output_ids, f"request {i} differs when batched"
        np.testing.assert_allclose(b.output_log_probs, a.output_log_probs, atol=1e-5)
        assert len(b.output_ids) == budgets[i] and b.finish_reason == "length"
    assert tokens == sum(budgets)
    # The batch's steps ran overlapped (each dispatched before the one before it was read), as the solo ones did.
    assert overlapped >= max(budgets) // 2
    # Sequential decoding would need one step per token after each prefill (sum(budgets) - 16).
    assert steps <= max(budgets) + 16 < (sum(budgets) - 16) / 4
    assert engine.stats.max_decode_rows >= 8
    new_calls = engine.engine.runner.program_calls - before[2]
    assert any(key[0] == "decode" and key[1] == 16 for key in new_calls)
    assert engine.engine.runner.num_programs <= 12  # a bounded set of buckets, not one program per request


async def test_overlapped_decode_lets_another_user_of_the_devices_in_between_steps(engine, encoder):
    """While the engine decodes overlapped it holds its devices from one step to the next; a thread waiting for them
    (the trainer in the same process) must get them at the next step, not when the request ends."""
    devices = engine.engine.runner.placement.devices
    got_in: list[int] = []

    def other_user() -> None:
        run_exclusive(devices, lambda: None)
        got_in.append(engine.stats.generated_tokens)

    async with client(engine) as c:
        before = engine.stats.generated_tokens
        pending = asyncio.ensure_future(c.generate(text_prompt(encoder, "long answer"), sampling_params={
            "temperature": 0.0, "max_new_tokens": 160, "ignore_eos": True}))
        while engine.stats.generated_tokens - before < 10:
            await asyncio.sleep(0.002)
        user = threading.Thread(target=other_user)
        user.start()
        result = await pending
        user.join(30)
    assert len(result.output_ids) == 160
    assert got_in and got_in[0] - before < 160 - 10, "the other user waited for the whole request"


async def test_seeded_sampling_is_reproducible_batch_independent_and_reports_tempered_logprobs(engine, encoder):
    ids = text_prompt(encoder, "Compute the perimeter of the square.")
    base = {"temperature": 0.7, "top_p": 0.9, "top_k": 50, "max_new_tokens": 12, "ignore_eos": True}
    async with client(engine) as c:
        a = await c.generate(ids, sampling_params={**base, "sampling_seed": 11})
        batch = await asyncio.gather(*(c.generate(ids, sampling_params={**base, "sampling_seed": s}) for s in (11, 12, 13, 14)))
        plain = await c.generate(ids, sampling_params={"temperature": 1.0, "max_new_tokens": 12, "ignore_eos": True,
                                                       "sampling_seed": 5})
    assert batch[0].output_ids == a.output_ids
    assert len({tuple(r.output_ids) for r in batch}) == 4
    # SGLang's default: log-probs after temperature, before top-k / top-p.
    np.testing.assert_allclose(a.output_log_probs, our_logits_logprobs(engine, ids, a.output_ids, None, temperature=0.7),
                               atol=1e-4, rtol=0)
    np.testing.assert_allclose(plain.output_log_probs, our_logits_logprobs(engine, ids, plain.output_ids, None), atol=1e-4, rtol=0)


async def test_stop_token_ids_stop_strings_eos_and_logit_bias(engine, encoder):
    tok = engine.engine.tokenizer
    ids = text_prompt(encoder, "Explain the answer briefly.")
    async with client(engine) as c:
        free = await c.generate(ids, sampling_params={**GREEDY, "ignore_eos": True})
        out = free.output_ids
        stop_id = out[5]
        first = out.index(stop_id)
        by_id = await c.generate(ids, sampling_params={**GREEDY, "stop_token_ids": [stop_id]})
        assert by_id.output_ids == out[: first + 1]
        assert (by_id.finish_reason, by_id.finish_matched) == ("stop", stop_id)
        assert by_id.text == tok.decode(out[:first], skip_special_tokens=True)  # the matched id is trimmed from text

        full_text = tok.decode(out, skip_special_tokens=False)
        stop_str = full_text[len(full_text) // 2 : len(full_text) // 2 + 3]
        trimmed = await c.generate(ids, sampling_params={**GREEDY, "ignore_eos": True, "stop": [stop_str],
                                                         "skip_special_tokens": False})
        kept = await c.generate(ids, sampling_params={**GREEDY, "ignore_eos": True, "stop": stop_str,
                                                      "skip_special_tokens": False, "no_stop_trim": True})
        assert (trimmed.finish_reason, trimmed.finish_matched) == ("stop", stop_str)
        assert trimmed.output_ids == kept.output_ids and out[: len(kept.output_ids)] == kept.output_ids
        assert len(kept.output_ids) < len(out)
        assert stop_str in tok.decode(kept.output_ids) and stop_str not in tok.decode(kept.output_ids[:-1])
        assert kept.text == tok.decode(kept.output_ids, skip_special_tokens=False)
        assert trimmed.text == kept.text[: kept.text.index(stop_str)]

        eos = engine.engine.eos_ids[0]
        forced = await c.generate(ids, sampling_params={**GREEDY, "logit_bias": {str(eos): 100.0}})
        assert forced.output_ids == [eos] and (forced.finish_reason, forced.finish_matched) == ("stop", eos)
        ignored = await c.generate(ids, sampling_params={**GREEDY, "max_new_tokens": 3, "logit_bias": {str(eos): 100.0},
                                                         "ignore_eos": True})
        assert ignored.output_ids == [eos] * 3 and ignored.finish_reason == "length"
        # The vision special tokens can never be sampled, whatever the bias says.
        banned = engine.engine.runner.banned_ids
        assert len(banned) == 4
        pushed = await c.generate(ids, sampling_params={"temperature": 1.0, "max_new_tokens": 16, "ignore_eos": True,
                                                        "logit_bias": {str(t): 100.0 for t in banned}})
        assert not set(pushed.output_ids) & set(banned) and len(pushed.output_ids) == 16
        zero = await c.generate(ids, sampling_params={"max_new_tokens": 0})
        assert zero.output_ids == [] and zero.finish_reason == "length" and zero.prompt_tokens == len(ids)


async def test_text_input_batches_and_native_response_shape(engine, encoder):
    tok = engine.engine.tokenizer
    text = tok.decode(text_prompt(encoder, "Name the shape."), skip_special_tokens=False)
    status, single = await post(engine, "/generate", {"text": text, "sampling_params": GREEDY, "return_logprob": True,
                                                      "return_text_in_logprobs": True, "rid": "my-rid"})
    assert status == 200
    meta = single["meta_info"]
    assert meta["prompt_tokens"] == len(text_prompt(encoder, "Name the shape."))  # the same ids as the template's
    assert meta["id"] == "my-rid" and meta["weight_version"] == "default" and meta["cached_tokens"] == 0
    assert meta["completion_tokens"] == len(single["output_ids"]) == meta["output_token_logprobs_length"]
    assert [e[1] for e in meta["output_token_logprobs"]] == single["output_ids"]
    assert [e[2] for e in meta["output_token_logprobs"]] == [tok.decode([t]) for t in single["output_ids"]]
    assert meta["e2e_latency"] > 0 and meta["input_token_logprobs"] == []
    status, batch = await post(engine, "/generate", {"text": [text, text + " ok"], "sampling_params": GREEDY})
    assert status == 200 and isinstance(batch, list) and len(batch) == 2
    assert batch[0]["output_ids"] == single["output_ids"]
    assert "output_token_logprobs" not in batch[0]["meta_info"]


@pytest.mark.parametrize(
    "body, needle",
    [
        ("not json", "not valid JSON"),
        ([1, 2], "JSON object"),
        ({"sampling_params": {}}, "exactly one"),
        ({"input_ids": [1, 2], "text": "x"}, "exactly one"),
        ({"input_ids": []}, "non-empty"),
        ({"input_ids": [1, "a"]}, "integer"),
        ({"input_ids": [10**6]}, "outside the vocabulary"),
        ({"input_ids": [1], "sampling_params": {"temprature": 1.0}}, "temprature"),
        ({"input_ids": [1], "sampling_params": {"top_p": 0.0}}, "top_p"),
        ({"input_ids": [1], "sampling_params": {"top_k": 0}}, "top_k"),
        ({"input_ids": [1], "sampling_params": {"max_new_tokens": -1}}, "max_new_tokens"),
        ({"input_ids": [1], "sampling_params": {"temperature": -0.5}}, "temperature"),
        ({"input_ids": [1], "sampling_params": {"logit_bias": {"x": 1}}}, "logit_bias"),
        ({"input_ids": [1], "sampling_params": {"repetition_penalty": 1.3}}, "repetition_penalty"),
        ({"input_ids": [1], "stream": True}, "stream"),
        ({"input_ids": [1], "bogus_field": 1}, "bogus_field"),
        ({"input_ids": [1], "image_data": ["data:image/png;base64,AAAA"]}, "image count mismatch"),
        ({"input_ids": [1], "image_data": [{"format": "processor_output"}]}, "processor_output"),
        ({"input_ids": [1, VIDEO_PAD]}, "clip count mismatch: 1 video placeholder"),
        ({"input_ids": [1, VIDEO_PAD, VIDEO_PAD], "video_data": ["x.mp4"]}, "already-expanded video pads"),
        ({"input_ids": [1, VIDEO_PAD], "video_data": ["data:video/mp4;base64,AAAA"]},
         "video_data[0]: data URL 'data:video/mp4;base64,AAAA' (26 chars): cannot decode video"),
        ({"input_ids": [1, VIDEO_PAD], "video_data": ["/tmp/clip.mp4"]}, "does not read"),
        ({"input_ids": [1], "video_data": [{"format": "processor_output"}]}, "takes videos as data URLs"),
        ({"input_ids": [5] * MAX_SEQ}, "context length"),
    ],
)
async def test_malformed_generate_is_400_with_an_error_object(engine, encoder, body, needle):
    if isinstance(body, dict) and VIDEO_PAD in body.get("input_ids", ()):
        body = {**body, "input_ids": [encoder.vision.video_pad if t == VIDEO_PAD else t for t in body["input_ids"]]}
    async with aiohttp.ClientSession() as s:
        data = body if isinstance(body, str) else None
        async with s.post(engine.url + "/generate", data=data, json=None if data else body) as r:
            status, answer = r.status, await r.json(content_type=None)
    assert status == 400
    # SGLang's body for the kind of refusal (sglang_wire.refusal_body): request-model validation (not a JSON object)
    # is its OpenAI-style error object, a mistyped sampling parameter the schema gate's string, a refused value
    # {"error": {"message"}}.
    if not isinstance(body, dict):  # not JSON, or not an object: SGLang's request model refuses it
        assert answer["object"] == "error" and answer["code"] == 400
    message = answer["message"] if answer.get("object") == "error" else answer["error"]
    message = message["message"] if isinstance(message, dict) else message
    assert needle in message


async def test_bad_image_is_400_and_the_server_keeps_serving(engine, encoder, make_test_image):
    seg = encoder.encode_prompt([{"role": "user", "content": [{"type": "image", "image": make_test_image(1)},
                                                               {"type": "text", "text": "hi"}]}])
    status, answer = await post(engine, "/generate", {"input_ids": seg.wire_ids, "image_data": ["data:image/png;base64,AAAA"]})
    assert status == 400 and "image_data[0]" in answer["error"]["message"]
    # Without --allowed-local-media-path the server reads no local file (tests/test_engine_faults.py covers the rest).
    status, answer = await post(engine, "/generate", {"input_ids": seg.wire_ids, "image_data": ["/no/such/file.png"]})
    assert status == 400 and "--allowed-local-media-path" in answer["error"]["message"]
    sliver = image_to_data_url(make_test_image(2, (400, 1)))  # aspect ratio 400: the HF processor refuses it
    status, answer = await post(engine, "/generate", {"input_ids": seg.wire_ids, "image_data": [sliver]})
    assert status == 400 and "aspect ratio" in answer["error"]["message"]
    status, answer = await post(engine, "/generate", {"input_ids": seg.wire_ids, "image_data": [image_to_data_url(make_test_image(1))],
                                                      "sampling_params": {"max_new_tokens": 2}})
    assert status == 200 and len(answer["output_ids"]) == 2


# ---------------------------------------------------------------------------- control


async def test_abort_pause_modes_and_flush(engine, encoder):
    ids = text_prompt(encoder, "Write a long proof.")
    long = {"temperature": 0.0, "max_new_tokens": 200, "ignore_eos": True}
    async with client(engine) as c:
        # in_place: the request stays in its slot, flush refuses, abort by rid returns its partial output.
        task = asyncio.ensure_future(c.generate(ids, sampling_params=long, rid="frozen"))
        await wait_running(engine, 1)
        await c.pause_generation("in_place")
        assert not await c.flush_cache()
        await asyncio.sleep(0.05)
        assert not task.done()
        await c.abort_request(rid="frozen")
        aborted = await task
        assert aborted.finish_reason == "abort" and 1 <= len(aborted.output_ids) < 200
        assert aborted.output_log_probs is not None and len(aborted.output_log_probs) == len(aborted.output_ids)
        assert await c.flush_cache()
        await c.continue_generation()

        # abort mode: in-flight requests return at once; requests sent while paused wait (and do not
        # block flush) until continue.
        running = asyncio.ensure_future(c.generate(ids, sampling_params=long))
        await wait_running(engine, 1)
        await c.pause_generation("abort")
        assert (await running).finish_reason == "abort"
        late = asyncio.ensure_future(c.generate(ids, sampling_params={**GREEDY, "max_new_tokens": 4}))
        await asyncio.sleep(0.1)
        assert not late.done()
        assert await c.flush_cache()
        await c.continue_generation()
        assert (await late).finish_reason == "length"

        # retract: the request leaves its slot and resumes after continue with the same greedy tokens.
        reference = await c.generate(ids, sampling_params={**long, "max_new_tokens": 120})
        resumed = asyncio.ensure_future(c.generate(ids, sampling_params={**long, "max_new_tokens": 120}))
        await wait_running(engine, 1)
        await c.pause_generation("retract")
        loads = await c.get_loads()
        assert loads["loads"][0]["num_running_reqs"] == 0 and loads["loads"][0]["num_waiting_reqs"] == 1
        assert await c.flush_cache()
        await c.continue_generation()
        out = await resumed
        assert out.meta_info["num_retractions"] == 1
        assert out.output_ids == reference.output_ids
        np.testing.assert_allclose(out.output_log_probs, reference.output_log_probs, atol=1e-4)

        # abort_all through the client's fleet helper; flush refuses while a request runs.
        busy = asyncio.ensure_future(c.generate(ids, sampling_params=long))
        await wait_running(engine, 1)
        assert not await c.flush_cache()
        await c.abort_all(timeout_s=30, retry_interval_s=0.05)
        assert (await busy).finish_reason == "abort"


async def test_info_health_and_client_helpers(engine):
    async with client(engine) as c:
        await c.wait_healthy(timeout_s=60)
        assert await c.health()
        info = await c.get_model_info()
        assert info["model_path"] == engine.model_dir and info["has_image_understanding"] is True
        assert info["architectures"] == ["Qwen3VLForConditionalGeneration"]
        server = await c.get_server_info()
        assert server["max_running_requests"] == 16 and server["context_length"] == MAX_SEQ
        assert server["internal_states"][0]["max_req_input_len"] == MAX_SEQ - 1
        # Idle: no request holds a KV page (the prefix cache may keep some); the soak test reads these.
        pages = server["internal_states"][0]["kv_pages"]
        assert pages["held_by_requests"] == 0 and pages["free"] + pages["cached"] == pages["total"] > 0
        assert server["internal_states"][0]["engine_stats"]["aborted"] >= 0
        # Each compiled program by key and where it compiled (the soak names the programs compiled after warm-up).
        listed = server["internal_states"][0]["compiled_programs"]
        runner = engine.engine.runner
        assert len(listed) == server["internal_states"][0]["num_compiled_programs"] > 0
        assert {tuple(p["key"]) for p in listed} <= runner.programs
        assert all(p["side_thread"] == (tuple(p["key"]) in runner.side_programs) for p in listed)
        assert await c.get_weight_version() == engine.engine.scheduler.weight_version
    for path in ("/get_model_info", "/get_server_info", "/health_generate", "/health"):
        status, _ = await post(engine, path, method="GET")
        assert status == 200, path
    # Request-model refusals carry SGLang's OpenAI-style error object (tests/sglang_conformance compares it).
    status, answer = await post(engine, "/pause_generation", {"mode": "sideways"})
    assert status == 400 and answer["object"] == "error" and "mode" in answer["message"]
    status, answer = await post(engine, "/abort_request", {"nothing": 1})
    assert status == 200  # SGLang 0.5.23: neither rid nor abort_all is a no-op (tests/sglang_conformance)
    status, answer = await post(engine, "/update_weights_from_disk", {})
    assert status == 400 and answer["object"] == "error" and "model_path" in answer["message"]


async def test_update_weights_from_disk_changes_outputs_and_bad_paths_keep_old_weights(engine, checkpoint, encoder, tmp_path):
    model_dir, _ = checkpoint
    ids = text_prompt(encoder, "Find x.")
    new_model = from_hf(model_dir)
    new_model.embed_vd[...] = new_model.embed_vd[...] * -1.0  # a different policy, same architecture
    new_dir = to_hf(new_model, tmp_path / "weights_v000002", dtype=jnp.float32, copy_from=model_dir)
    broken = tmp_path / "broken"
    shutil.copytree(new_dir, broken)
    (broken / "model.safetensors").unlink()
    async with client(engine) as c:
        before = await c.generate(ids, sampling_params=GREEDY)
        answers = await c.sync_weights_from_disk(str(new_dir), "2")
        assert answers[engine.url]["success"] is True
        assert await c.get_weight_version() == "2"
        after = await c.generate(ids, sampling_params=GREEDY)
        assert after.weight_version == "2" and after.output_ids != before.output_ids
        np.testing.assert_allclose(after.output_log_probs, our_logits_logprobs(engine, ids, after.output_ids, None), atol=1e-4)

        for bad in (tmp_path / "does_not_exist", broken):
            reply = await c.update_weights_from_disk(str(bad), "3")
            assert reply["success"] is False and str(bad) in reply["message"]
        with pytest.raises(WeightSyncError, match="success=false"):
            await c.sync_weights_from_disk(str(broken), "3")
        assert await c.get_weight_version() == "2"
        still = await c.generate(ids, sampling_params=GREEDY)
        assert still.output_ids == after.output_ids and still.weight_version == "2"

        # Back to the original weights: the original answer returns.
        assert (await c.update_weights_from_disk(str(model_dir), "1"))["success"] is True
        restored = await c.generate(ids, sampling_params=GREEDY)
        assert restored.output_ids == before.output_ids and restored.weight_version == "1"
    assert engine.stats.weight_updates >= 2


def _threads(pid: int) -> dict[int, tuple[frozenset[int], int]]:
    """Each thread of process `pid`: the cores it may run on, and its nanoseconds on a CPU so far (Linux's /proc)."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(FileNotFoundError):  # a thread that ended meanwhile
            status = Path(f"/proc/{pid}/task/{tid}/status").read_text()
            ran_ns = int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[0])
            cores = next(line.split()[1] for line in status.splitlines() if line.startswith("Cpus_allowed_list"))
            out[int(tid)] = (parse_cpu_list(cores, allowed_cores()), ran_ns)
    return out


@pytest.mark.slow
def test_cli_serve_process_answers_generate_and_exits_on_sigterm(checkpoint, tmp_path):
    """`jaxrl-vlm serve` in its own process: healthy, one /generate, clean exit on SIGTERM. Served with XLA's threads
    on one core (`--xla-cpu-cores`): they run the programs there, and the interpreter keeps every core."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    allowed = allowed_cores()
    xla_core = max(allowed)
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": xla_flags(1)}
    log = open(tmp_path / "serve.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "jaxrl_vlm.cli", "serve", "--model", str(checkpoint[0]), "--port", str(port),
                             "--max-batch", "2", "--max-seq-len", "128", "--disable-radix-cache",
                             "--xla-cpu-cores", str(xla_core)], stdout=log, stderr=subprocess.STDOUT, env=env,
                            cwd=Path(__file__).resolve().parents[1])
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, "server never became healthy"
            time.sleep(0.2)
        before = _threads(proc.pid)
        req = urllib.request.Request(url + "/generate", data=b'{"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 3}}',
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            answer = json.loads(r.read())
        assert len(answer["output_ids"]) <= 3 and answer["meta_info"]["prompt_tokens"] == 3
        threads = _threads(proc.pid)
        assert threads[proc.pid][0] == allowed  # the interpreter's main thread keeps every core
        assert {cores for cores, _ in threads.values()} == {allowed, frozenset({xla_core})}
        # XLA's pool, confined since the engine started, ran the prefill and decode programs of the request.
        assert sum(ran - before[tid][1] for tid, (cores, ran) in threads.items()
                   if cores == {xla_core} and tid in before) > 0
        with urllib.request.urlopen(url + "/get_server_info", timeout=10) as r:
            assert json.loads(r.read())["disable_radix_cache"] is True  # the flag reached the engine
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
