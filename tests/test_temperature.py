"""The trainer scores the policy the engine samples: log-probs and entropy of softmax(logits / T).

SGLang (and our embedded engine) report log-probs of the tempered distribution they sample from. The trainer
must compute current, old and reference log-probs at the same temperature, or the PPO ratio, clipping and TIS
belong to a policy that never sampled. Checked per token against the engine on multi-turn episodes with images
in the prompt and in observations, in packed rows, at T in {0.6, 1.0, 1.3}.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from PIL import Image

from jaxrl_vlm.config import load_config
from jaxrl_vlm.job.assets import load_dataset, prepare_assets
from jaxrl_vlm.job.session import rollout_session
from jaxrl_vlm.job.trainer import Trainer
from jaxrl_vlm.data.geo3k import PromptIterator
from jaxrl_vlm.models import from_hf, token_logprobs
from jaxrl_vlm.tiny import make_tiny
from jaxrl_vlm.weight_sync import WeightSyncer
from rollout.loading import load_function
from rollout.sglang_wire import logprob_temperature

ENV = str(Path(__file__).with_name("_image_obs_env.py"))
TEMPERATURES = (0.6, 1.0, 1.3)


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("tiny") / "model", seed=3)


# ------------------------------------------------------------------------------- the chunked kernel
@pytest.mark.slow
@pytest.mark.parametrize("temperature", [0.6, 1.3])
def test_token_logprobs_and_entropy_are_those_of_tempered_logits(tiny_model_dir, temperature):
    model = from_hf(str(tiny_model_dir))
    rng = np.random.default_rng(0)
    b, t = 2, 11
    hidden = jnp.asarray(rng.normal(size=(b, t, model.cfg.text.hidden_size)), jnp.float32)
    targets = jnp.asarray(rng.integers(0, model.cfg.text.vocab_size, size=(b, t)), jnp.int32)
    logits = np.asarray(model.logits(hidden), np.float64) / temperature
    ref_lse = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    ref_lp = np.take_along_axis(logits, np.asarray(targets)[..., None], -1)[..., 0] - ref_lse
    probs = np.exp(logits - ref_lse[..., None])
    ref_ent = -(probs * (logits - ref_lse[..., None])).sum(-1)
    # chunk 4 does not divide 11: the padded tail must not leak into the values.
    lp, ent = token_logprobs(model, hidden, targets, chunk_size=4, return_entropy=True, temperature=temperature)
    np.testing.assert_allclose(np.asarray(lp), ref_lp, atol=2e-5, rtol=0)
    np.testing.assert_allclose(np.asarray(ent), ref_ent, atol=2e-5, rtol=0)
    plain, _ = token_logprobs(model, hidden, targets, chunk_size=4)
    assert float(np.abs(np.asarray(plain) - ref_lp).max()) > 1e-2, "the test cannot tell tempered from raw log-probs"


def test_greedy_requests_are_scored_untempered():
    # SGLang reports log_softmax(logits) for a greedy request (temperature below 1e-6).
    assert logprob_temperature(0.0) == 1.0
    assert logprob_temperature(1e-7) == 1.0
    assert logprob_temperature(0.7) == 0.7


# ------------------------------------------------------------------------------- engine vs trainer
@pytest.fixture(scope="module")
def image_task(tmp_path_factory):
    root = tmp_path_factory.mktemp("temperature")
    rows = []
    for i in range(4):
        rng = np.random.default_rng(100 + i)
        path = root / f"img{i}.png"
        Image.fromarray(rng.integers(0, 256, size=(48, 64, 3), dtype=np.uint8)).save(path)
        rows.append({"problem": f"<image> What is in picture {i}?", "answer": "x", "images": [path.name]})
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root, prompts


def _config(root: Path, prompts: Path, temperature: float):
    return load_config(None, [
        "--hf-checkpoint", str(root / "tiny"), "--make-tiny", "--prompt-data", str(prompts), "--prompt-style", "plain",
        "--rollout-interaction-env-path", ENV, "--max-turns", "3", "--rollout-batch-size", "2",
        "--n-samples-per-prompt", "3", "--rollout-max-response-len", "128", "--rollout-temperature", str(temperature),
        # A random tiny model almost never emits <|im_end|>: 150 extra stop ids end its turns after a few tokens,
        # so episodes run several turns and receive image observations.
        "--rollout-stop-token-ids", ",".join(str(i) for i in range(300, 450)),
        "--seq-buckets", "256,512", "--row-buckets", "1,2,4,8", "--patch-buckets", "0,64,128,256",
        "--packing", "true", "--engine-max-batch", "8", "--engine-max-seq-len", "512", "--logprob-chunk-size", "64",
        "--use-kl-loss", "--kl-loss-coef", "0.01", "--lr", "1e-3", "--mesh-data", "1", "--output-dir", str(root / "out"),
    ])


async def _rollout_and_score(root: Path, prompts: Path) -> list[tuple[float, np.ndarray, np.ndarray, dict, int, int]]:
    """One engine session; for each temperature: a rollout, then the trainer's log-probs of the same batch."""
    cfg = _config(root, prompts, TEMPERATURES[0])
    trainer = Trainer(cfg, devices=jax.devices()[:1])
    model_dir, data_path = prepare_assets(cfg)
    trainer.build_policy(model_dir)
    args = cfg.to_namespace()
    rollout_fn = load_function(cfg.rollout.rollout_function_path, "--rollout-function-path")
    out = []
    async with rollout_session(cfg, model_dir, model_dir, args) as client:
        syncer = WeightSyncer(client, root / "weights", copy_from=str(model_dir), dtype=jnp.float32)
        for step, temperature in enumerate(TEMPERATURES):
            args.rollout_temperature = temperature
            trainer.cfg.rollout.rollout_temperature = temperature
            prompt_iter = PromptIterator(load_dataset(cfg, data_path), 2, shuffle=False, seed=0)
            result = await rollout_fn(args, step, prompt_iter)
            samples = result.samples
            assert samples and not result.failed, result.failed
            obs_images = sum(int(s.multimodal_train_inputs["image_grid_thw"].shape[0]) - 1 for s in samples)
            adv = np.linspace(-1, 1, len(samples)).astype(np.float32)
            batch, device_batch = trainer._batch(samples, adv)
            lp = np.asarray(trainer._logprobs(trainer.state.params, device_batch))
            rows_with_two = int(((batch.arrays.sequence_ids.max(axis=-1)) >= 1).sum())
            metrics = trainer.train_on(samples)
            out.append((temperature, lp, batch.arrays, metrics, obs_images, rows_with_two))
            # The update changed the weights: the engine must sample the next temperature's rollout with them.
            await syncer.push(trainer.policy_model(), step + 1)
    return out


@pytest.mark.slow
def test_engine_and_trainer_logprobs_agree_per_token_at_every_temperature(image_task):
    root, prompts = image_task
    for temperature, lp, arrays, metrics, obs_images, packed_rows in asyncio.run(_rollout_and_score(root, prompts)):
        mask = arrays.loss_mask > 0
        assert mask.sum() > 20, "too few model tokens to compare"
        assert obs_images > 0, "no observation images: the test would not cover them"
        assert packed_rows > 0, "no packed row: the test would not cover packing"
        diff = np.abs(lp - arrays.rollout_logprobs)[mask]
        assert diff.max() < 1e-4, f"T={temperature}: max |trainer - engine| = {diff.max():.2e}"
        # The train step's own current log-probs (old = current here) agree too, and so do the reference's.
        assert metrics["train/train_rollout_logprob_abs_diff"] < 1e-5, (temperature, metrics)
        assert np.isfinite(metrics["train/kl_loss"]), metrics
