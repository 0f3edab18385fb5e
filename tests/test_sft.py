"""SFT warm start (`--loss-type sft_loss`, issue 16 item 3): the loss, the config, and the README's commands end to
end on the tiny model: an SFT run on color-reveal transcripts lowers the held-out NLL and starts no engine; its
`final_model/` export loads in transformers (logits within 1e-4 in fp32, and the same held-out NLL as the run
logged) and in our embedded engine (greedy replies equal transformers' `generate`); and an RL run starts from it,
by `--hf-checkpoint final_model` or by `--load` of the SFT checkpoints."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pyarrow.parquet as pq
import pytest
from flax import nnx
from _launch import xla_flags

from envs.color_reveal.answers import parse_answer
from jaxrl_vlm.config import ConfigError, load_config
from jaxrl_vlm.job.run_log import read_metrics
from jaxrl_vlm.rl.losses import LossConfig, LossInputs, accumulate_metrics, finalize_metrics, sft_loss

ROOT = Path(__file__).resolve().parents[1]
SFT_CONFIG = "configs/color_reveal_sft_tiny.yaml"
RL_CONFIG = "configs/color_reveal_tiny.yaml"
SFT_STEPS = 64  # the config's own run (2 epochs of 512 transcripts)
CHANCE = 0.419  # a random guesser's reward on color-reveal (envs/color_reveal/answers.py chance_reward)


# ----------------------------------------------------------------------------- the loss and the config
def test_sft_loss_is_the_weighted_nll_of_the_masked_tokens():
    rng = np.random.default_rng(0)
    logprobs = -rng.random((3, 8)).astype(np.float32) * 4
    mask = (rng.random((3, 8)) < 0.5).astype(np.float32)
    weights = mask / mask.sum()  # token_mean over the batch, as the trainer lays SFT batches out
    ids = np.where(mask > 0, np.arange(3)[:, None], -1).astype(np.int32)
    zeros = np.zeros_like(logprobs)
    inputs = LossInputs(logprobs=jnp.asarray(logprobs), old_logprobs=zeros, advantages=zeros, loss_mask=jnp.asarray(mask),
                        sequence_ids=jnp.asarray(ids), token_weights=jnp.asarray(weights))
    loss, metrics = sft_loss(inputs, LossConfig())
    expected = -(logprobs * mask).sum() / mask.sum()
    np.testing.assert_allclose(loss, expected, rtol=1e-6)
    final = finalize_metrics(accumulate_metrics(None, metrics))
    np.testing.assert_allclose(final["sft_loss"], expected, rtol=1e-6)
    assert float(final["sft_tokens"]) == mask.sum()
    grad = jax.grad(lambda lp: sft_loss(inputs.replace(logprobs=lp), LossConfig())[0])(jnp.asarray(logprobs))
    np.testing.assert_allclose(grad, -weights, rtol=1e-6)  # only masked tokens, each -1/N


def test_sft_config_rejects_rl_only_options_and_accepts_slimes_sft_run_line():
    cfg = load_config(SFT_CONFIG)
    assert cfg.algo.loss_type == "sft_loss"
    for extra in (["--use-kl-loss"], ["--kl-coef", "0.1"], ["--use-tis"], ["--engine-url", "http://127.0.0.1:1"]):
        with pytest.raises(ConfigError, match="--loss-type sft_loss trains on the conversations"):
            load_config(SFT_CONFIG, extra)
    slime_line = ["--rollout-function-path", "slime.rollout.sft_rollout.generate_rollout", "--input-key", "messages",
                  "--loss-type", "sft_loss", "--calculate-per-token-loss", "--disable-compute-advantages-and-returns",
                  "--debug-train-only", "--loss-mask-type", "qwen3", "--rollout-shuffle"]
    cfg = load_config(None, slime_line)
    assert cfg.data.input_key == "messages" and cfg.algo.loss_aggregation == "token_mean"
    assert any("slime's SFT data path" in n for n in cfg.notes)
    assert sum("slime flag" in n for n in cfg.notes) == 4
    with pytest.raises(ConfigError, match="add --loss-type sft_loss"):
        load_config(None, slime_line[:2])


# ----------------------------------------------------------------------------- end to end (the README's commands)
def _env() -> dict[str, str]:
    return {**os.environ, "XLA_FLAGS": xla_flags(1)}  # the CLI runs like a user's: one CPU device


def _cli(*args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-m", "jaxrl_vlm.cli", *args], cwd=ROOT, env=_env(), capture_output=True,
                          text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-4000:]
    return done


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """`jaxrl-vlm train configs/color_reveal_sft_tiny.yaml`: creates the tiny model and the transcripts."""
    tmp = tmp_path_factory.mktemp("sft")
    done = _cli("train", SFT_CONFIG, "--hf-checkpoint", str(tmp / "tiny"), "--prompt-data", str(tmp / "sft.parquet"),
                "--eval-prompt-data", "heldout", str(tmp / "heldout.parquet"), "--output-dir", str(tmp / "sft"),
                "--num-rollout", str(SFT_STEPS), "--eval-interval", "32", "--save-interval", "32", "--keep-checkpoints", "2")
    return tmp, done


def _eval_nll(records: list[dict[str, Any]]) -> dict[int, float]:
    return {r["step"]: r["eval/heldout/nll"] for r in records if "eval/heldout/nll" in r}


@pytest.mark.slow
def test_sft_lowers_the_heldout_nll_without_an_engine_and_writes_checkpoints_and_export(sft_run):
    tmp, done = sft_run
    out = tmp / "sft"
    records = read_metrics(out / "metrics.jsonl")
    nll = _eval_nll(records)
    assert sorted(nll) == [0, 32, SFT_STEPS]
    # Measured 7.85 -> 0.42 -> 0.30 (a right first guess costs ln 2 at best: the picture cannot tell card from decoy).
    assert nll[SFT_STEPS] < nll[0] - 5.0 and nll[SFT_STEPS] < nll[32] < 1.0, nll
    train = [r for r in records if "train/sft_loss" in r]
    assert [r["step"] for r in train] == list(range(SFT_STEPS))
    assert train[-1]["train/sft_loss"] < train[0]["train/sft_loss"] / 4
    assert all(r["train/sft_tokens"] > 0 and r["batch/padding_efficiency"] > 0.3 for r in train)
    assert "rollout/raw_reward" not in train[0] and "train/entropy_loss" not in train[0]
    # No engine: nothing served, no weight versions exported.
    assert "embedded engine" not in done.stderr and not (out / "weights").exists()
    assert sorted(p.name for p in (out / "plots").glob("*.png")) == ["sft_nll.png", "step_time.png"]
    assert sorted(int(p.name) for p in (out / "checkpoints").iterdir() if p.name.isdigit()) == [32, SFT_STEPS]
    final = out / "final_model"
    assert json.loads((final / "config.json").read_text())["model_type"] == "qwen3_vl"
    from safetensors import safe_open

    with safe_open(str(final / "model.safetensors"), framework="numpy") as f:  # the parameter dtype, not bf16
        assert {f.get_tensor(k).dtype for k in f.keys()} == {np.dtype(np.float32)}
    assert (final / "tokenizer.json").exists() and (final / "chat_template.jinja").exists()


@pytest.mark.slow
def test_an_sft_run_resumed_with_load_continues_like_the_uninterrupted_run(sft_run):
    tmp, _ = sft_run
    _cli("train", SFT_CONFIG, "--hf-checkpoint", str(tmp / "tiny"), "--prompt-data", str(tmp / "sft.parquet"),
         "--eval-prompt-data", "heldout", str(tmp / "heldout.parquet"), "--output-dir", str(tmp / "resumed"),
         "--num-rollout", str(SFT_STEPS), "--eval-interval", "32", "--save-interval", "32",
         "--load", str(tmp / "sft" / "checkpoints"), "--load-step", "32")
    whole = read_metrics(tmp / "sft" / "metrics.jsonl")
    resumed = read_metrics(tmp / "resumed" / "metrics.jsonl")
    assert [r["step"] for r in resumed] == list(range(32, SFT_STEPS + 1))
    for a, b in zip(whole[32:SFT_STEPS], resumed):  # the same batches (data cursor), weights and optimizer state
        assert a["step"] == b["step"] and a["sft/epoch"] == b["sft/epoch"]
        assert a["train/sft_loss"] == pytest.approx(b["train/sft_loss"], rel=1e-6)
    for k in (0, -1):  # the eval of the restored weights, and of the weights after the resumed steps
        assert resumed[k]["eval/heldout/nll"] == pytest.approx(whole[32:][k]["eval/heldout/nll"], rel=1e-6)


def _heldout(tmp: Path) -> Any:
    from jaxrl_vlm.data.sft import load_conversation_dataset
    from rollout.encoding import ChatEncoder
    from rollout.processing import load_image_processor, load_tokenizer

    final = tmp / "sft" / "final_model"
    encoder = ChatEncoder(load_tokenizer(final), load_image_processor(final))
    return encoder, load_conversation_dataset(str(tmp / "heldout.parquet"), encoder)


def _hf_logits(hf: Any, sample: Any, image_token: int) -> np.ndarray:
    import torch

    ids = torch.tensor([sample.tokens])
    mm = sample.multimodal_train_inputs
    kwargs = {} if mm is None else dict(pixel_values=torch.from_numpy(mm["pixel_values"]),
                                        image_grid_thw=torch.from_numpy(mm["image_grid_thw"]),
                                        mm_token_type_ids=(ids == image_token).long())
    with torch.no_grad():
        return hf(input_ids=ids, attention_mask=torch.ones_like(ids), **kwargs).logits[0].float().numpy()


@nnx.jit
def _our_logits(model, tokens, positions, segment_ids, vision):
    return model.logits(model(tokens, positions, segment_ids, vision))


def _ours(model: Any, sample: Any, length: int = 64, patches: int = 64) -> np.ndarray:
    from jaxrl_vlm.models import build_vision_inputs, get_rope_index

    cfg = model.cfg
    n = len(sample.tokens)
    tokens = np.zeros((1, length), np.int64)
    tokens[0, :n] = sample.tokens
    mask = np.zeros((1, length), np.int32)
    mask[0, :n] = 1
    grid = sample.multimodal_train_inputs["image_grid_thw"]
    positions, _ = get_rope_index(tokens, grid, mask, cfg)
    vision = build_vision_inputs(sample.multimodal_train_inputs["pixel_values"], grid, tokens, cfg,
                                 patch_bucket=patches, token_valid=mask)
    out = _our_logits(model, jnp.asarray(tokens, jnp.int32), jnp.asarray(positions), jnp.asarray(mask), vision)
    return np.asarray(out)[0, :n]


@pytest.mark.slow
def test_sft_export_loads_in_transformers_with_our_logits_and_the_runs_heldout_nll(sft_run):
    import torch
    from transformers import Qwen3VLForConditionalGeneration

    from jaxrl_vlm.models import from_hf

    tmp, _ = sft_run
    final = tmp / "sft" / "final_model"
    hf = Qwen3VLForConditionalGeneration.from_pretrained(str(final), dtype=torch.float32).eval()
    ours = from_hf(str(final))
    encoder, heldout = _heldout(tmp)
    pad = encoder.vision.image_pad
    two_turns = next(i for i in range(len(heldout)) if len(heldout[i].image_data) == 2)
    for i in (0, two_turns):
        sample = heldout[i]
        np.testing.assert_allclose(_ours(ours, sample), _hf_logits(hf, sample, pad), atol=1e-4, rtol=0)
    # transformers' NLL of the held-out assistant tokens (our masks) is the final eval the run logged.
    total, tokens = 0.0, 0
    for sample in heldout:
        logp = torch.log_softmax(torch.from_numpy(_hf_logits(hf, sample, pad)), dim=-1).numpy()
        start = sample.prompt_length
        for j, m in enumerate(sample.loss_mask):
            if m:
                total -= float(logp[start + j - 1, sample.tokens[start + j]])
                tokens += 1
    logged = _eval_nll(read_metrics(tmp / "sft" / "metrics.jsonl"))[SFT_STEPS]
    assert tokens == read_metrics(tmp / "sft" / "metrics.jsonl")[-1]["eval/heldout/tokens"]
    assert abs(total / tokens - logged) < 1e-4, (total / tokens, logged)


@pytest.mark.slow
def test_sft_export_serves_in_the_embedded_engine_like_transformers_generate(sft_run):
    import torch
    from transformers import Qwen3VLForConditionalGeneration

    from jaxrl_vlm.engine import EmbeddedEngine, EngineOptions
    from rollout.client import SGLangClient

    tmp, _ = sft_run
    final = tmp / "sft" / "final_model"
    hf = Qwen3VLForConditionalGeneration.from_pretrained(str(final), dtype=torch.float32).eval()
    encoder, heldout = _heldout(tmp)
    params = [json.loads(p) for p in pq.read_table(tmp / "heldout.parquet", columns=["params"]).column(0).to_pylist()]
    prompts = [encoder.encode_prompt(heldout[i].prompt[:1]) for i in range(8)]
    greedy = {"temperature": 0.0, "max_new_tokens": 6}

    async def generate(url: str) -> list[Any]:
        async with SGLangClient(url, timeout_s=120.0) as client:
            return await asyncio.gather(*(client.generate(p.wire_ids, image_data=p.image_data, sampling_params=greedy)
                                          for p in prompts))

    engine = EmbeddedEngine(str(final), config=EngineOptions(max_batch=8, max_seq_len=128, min_kv_bucket=128))
    engine.start()
    try:
        results = asyncio.run(generate(engine.url))
    finally:
        engine.stop()
    pad = encoder.vision.image_pad
    shown = 0
    for prompt, result, p in zip(prompts, results, params):
        x = torch.tensor([prompt.train_ids])
        mm = prompt.mm_inputs
        with torch.no_grad():
            expected = hf.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=6, do_sample=False,
                                   pixel_values=torch.from_numpy(mm["pixel_values"]),
                                   image_grid_thw=torch.from_numpy(mm["image_grid_thw"]),
                                   mm_token_type_ids=(x == pad).long())[0, x.shape[1]:].tolist()
        assert result.output_ids == expected
        reply = encoder.tokenizer.decode(result.output_ids, skip_special_tokens=True)
        shown += parse_answer(reply) in (p["card"], p["decoy"])
    assert shown >= 7, f"after SFT the first reply names a color of the picture: {shown}/8"


def _rl(tmp: Path, out: str, *start: str) -> tuple[list[dict[str, Any]], subprocess.CompletedProcess]:
    done = _cli("train", RL_CONFIG, *start, "--prompt-data", str(tmp / "rl.parquet"),
                "--eval-prompt-data", "heldout", f"{tmp / 'rl_heldout.parquet'}@[0:8]", "--n-samples-per-eval-prompt", "2",
                "--output-dir", str(tmp / out), "--num-rollout", "1", "--rollout-batch-size", "2",
                "--n-samples-per-prompt", "2", "--lr", "3e-4")
    assert (tmp / out / "final_model" / "model.safetensors").exists()
    return read_metrics(tmp / out / "metrics.jsonl"), done


@pytest.mark.slow
def test_rl_starts_from_the_sft_export_or_from_the_sft_checkpoints(sft_run):
    """`--hf-checkpoint <sft>/final_model`, or `--load <sft>/checkpoints` onto the base model (a warm start: step 0,
    a fresh optimizer): the engine serves the SFT weights from the first rollout, the trainer holds the same ones,
    and the two ways are the same start."""
    tmp, _ = sft_run
    exported, _ = _rl(tmp, "rl_from_export", "--hf-checkpoint", str(tmp / "sft" / "final_model"))
    loaded, done = _rl(tmp, "rl_from_load", "--hf-checkpoint", str(tmp / "tiny"), "--load", str(tmp / "sft" / "checkpoints"))
    assert "is a checkpoint of an SFT run: this RL run starts from its weights" in done.stderr
    for records in (exported, loaded):
        # Before any RL step, far above what the random model earns (measured 0.9 after the config's SFT).
        assert records[0]["eval/heldout/raw_reward"] > CHANCE + 0.25, records[0]
        assert records[0]["train/train_rollout_logprob_abs_diff"] < 1e-4  # the engine samples the trainer's weights
        assert records[0]["weight_version"] == 1 and records[-1]["step"] == 1  # counted from 0: a fresh run
    # The same weights (the export is in the parameter dtype): the same samples, rewards and update.
    for key in ("eval/heldout/raw_reward", "rollout/raw_reward", "train/loss", "train/grad_norm"):
        assert exported[0][key] == pytest.approx(loaded[0][key], rel=1e-5, abs=1e-9), key
