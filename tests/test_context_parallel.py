"""Context parallelism: one packed row's positions split over 2 or 4 devices (`mesh_context`) gives the same loss
and gradients as the unsplit row, for every shipped model family.

The rows are multi-turn episodes packed three to a row, with an image in the prompt and one in every observation,
laid out so that an image's tokens straddle a sequence-shard boundary at cp 2 and at cp 4 (slime #2037 is that
case: vision tokens landing in the wrong shard). The reference is the same loss on one device; the cp layouts
split the row over 2 or 4 of the 8 simulated devices. The loss is the RL loss with entropy and KL terms, so log-probs, entropy
(vocabulary chunks per shard) and every attention, vision and (Qwen3.5) linear-attention layer are in it.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import numpy as np
import pytest

from jaxrl_vlm.batching import build_train_batch
from jaxrl_vlm.config import load_config
from jaxrl_vlm.errors import ConfigError
from jaxrl_vlm.job.trainer import Trainer, sequences_bucket, step_config
from jaxrl_vlm.models.activation_sharding import activation_sharding
from jaxrl_vlm.models.hf_io import load_hf_config
from jaxrl_vlm.rl.train_step import _loss_inputs, _micro, policy_logprobs, step_loss
from rollout.encoding import ChatEncoder
from rollout.multiturn import merge_multimodal_chunks
from rollout.processing import image_to_data_url, load_image_processor, load_tokenizer
from rollout.sample import Sample, Status

ROW = 512
FAMILIES = ["qwen3_vl", "qwen2_5_vl", "qwen3_5", "qwen3_vl_moe", "qwen3_5_moe"]
# Relative gradient tolerance (global norm of the difference / norm), and 1e-5 on the loss, for every family.
# Qwen3.5's delta rule is split into a block map and a correction under context parallelism (another fp32
# summation order): its gradients sit ~5e-6 from the one-device ones, as far as one device's own gradients move
# when only the delta rule's chunk size changes (64 -> 32: 4.3e-6), i.e. the round-off floor of the tiny model.
GRAD_RTOL = 1e-5


@pytest.fixture(scope="module", params=FAMILIES)
def tiny_dir(request, tmp_path_factory):
    from jaxrl_vlm.tiny import make_tiny

    return make_tiny(tmp_path_factory.mktemp(f"cp_{request.param}") / "model", seed=5, arch=request.param)


def _episode(enc: ChatEncoder, make_image, index: int, filler: int, rng: np.random.Generator) -> Sample:
    """Prompt with an image, then 3 turns: model tokens, an observation with a new image; reward by index."""
    prompt = [{"role": "user", "content": [
        {"type": "image", "image": image_to_data_url(make_image(10 + index, (32, 48)))},
        {"type": "text", "text": "Where is the red square?" + " look" * filler},
    ]}]
    seg = enc.encode_prompt(prompt)
    s = Sample(group_index=0, index=index, prompt=prompt, label="1")
    s.set_prompt_tokens(seg.train_ids)
    images, chunks = list(seg.image_data), [seg.mm_inputs]
    for turn in range(3):
        n = 6 + 2 * turn + index
        s.append_model_tokens(rng.integers(10, 900, size=n).tolist(), (-rng.uniform(0.1, 2.0, size=n)).tolist())
        s.append_model_tokens([enc.vision.im_end], [-0.3])
        obs = enc.encode_observation([{"role": "user", "content": [
            {"type": "text", "text": f"turn {turn}:"},
            {"type": "image", "image": image_to_data_url(make_image(20 + 3 * index + turn, (32, 32)))},
        ]}])
        s.append_observation_tokens(obs.train_ids)
        images += obs.image_data
        chunks.append(obs.mm_inputs)
    s.append_model_tokens([17, 18, enc.vision.im_end], [-0.5, -0.4, -0.2])
    s.image_data = images
    s.multimodal_train_inputs = merge_multimodal_chunks(chunks, s.name)
    s.reward = float(index % 2)
    s.set_status(Status.COMPLETED)
    return s


def _trainer(model_dir: Path, overrides: list[str], devices) -> Trainer:
    cfg = load_config(None, [
        "--hf-checkpoint", str(model_dir), "--use-kl-loss", "--kl-loss-coef", "0.1", "--kl-loss-type", "low_var_kl",
        "--entropy-coef", "0.01", "--seq-buckets", str(ROW), "--row-buckets", "1", "--patch-buckets", "0,1024",
        "--logprob-chunk-size", "16", "--rollout-temperature", "0.8", *overrides,
    ])
    trainer = Trainer(cfg, devices=devices)
    trainer.build_policy(model_dir)
    return trainer


def _loss_and_grads(trainer: Trainer, samples: list[Sample]):
    """The train step's loss of the one micro-batch and its gradient (no update), under the trainer's layout. The KL
    term's reference log-probs are the engine's (the batch's rollout log-probs): any fixed values will do."""
    advantages, _ = trainer.advantages(samples)
    batch, device_batch = trainer._batch(samples, advantages)
    cfg = step_config(trainer.cfg, sequences_bucket(batch.layout.max_sequences_per_micro_batch),
                      old_from_current=True, activations=trainer._activations())
    loss_fn = step_loss(cfg)

    def loss(params, batch):
        with activation_sharding(cfg.activations):
            mb = _micro(batch, 0)
            lp, ent = policy_logprobs(trainer.graphdef, params, mb, chunk_size=cfg.logprob_chunk_size,
                                      need_entropy=True, temperature=cfg.temperature)
            value, _ = loss_fn(_loss_inputs(mb, lp, ent, jax.lax.stop_gradient(lp), mb.rollout_logprobs), cfg.loss)
        return value

    value, grads = jax.jit(jax.value_and_grad(loss))(trainer.state.params, device_batch)
    return batch, float(value), jax.tree.map(np.asarray, grads)


def _straddling(tokens: np.ndarray, image_token_id: int, cp: int) -> list[tuple[int, int]]:
    """Image-pad runs of a [T] row that cross a boundary between `cp` equal blocks."""
    runs, start = [], None
    for i, tok in enumerate(np.append(tokens, -1)):
        if tok == image_token_id and start is None:
            start = i
        elif tok != image_token_id and start is not None:
            runs.append((start, i))
            start = None
    block = len(tokens) // cp
    return [(a, b) for a, b in runs if a // block != (b - 1) // block]


def _packed_episodes(model_dir: Path, make_image) -> list[Sample]:
    """Three episodes packed into one row, with filler words in the first prompt chosen so that image tokens
    straddle a block boundary at cp 2 and at cp 4 (each family's template and image sizes differ)."""
    enc = ChatEncoder(load_tokenizer(model_dir), load_image_processor(model_dir))
    cfg = load_hf_config(str(model_dir))
    for filler in range(40):
        rng = np.random.default_rng(0)
        samples = [_episode(enc, make_image, i, filler if i == 0 else 2 * i, rng) for i in range(3)]
        batch = build_train_batch(samples, np.zeros(3, np.float32), cfg, seq_buckets=[ROW], row_buckets=[1],
                                  patch_buckets=[0, 1024], packing=True, micro_batch_rows=None, row_multiple=1,
                                  aggregation="token_mean", aggregation_constant=None, overlong_policy="error")
        row = np.asarray(batch.arrays.tokens)[0, 0]
        if all(_straddling(row, cfg.image_token_id, cp) for cp in (2, 4)):
            return samples
    raise AssertionError("no filler length puts an image across the cp 2 and cp 4 block boundaries")


@pytest.fixture(scope="module")
def reference(tiny_dir, make_test_image):
    samples = _packed_episodes(tiny_dir, make_test_image)
    trainer = _trainer(tiny_dir, ["--mesh-data", "1"], jax.devices()[:1])
    return samples, *_loss_and_grads(trainer, samples)


@pytest.mark.parametrize("cp", [2, 4])
def test_context_parallel_matches_one_device(tiny_dir, reference, cp):
    _assert_context_parallel_matches(tiny_dir, reference, cp, [])


@pytest.mark.parametrize("tiny_dir", ["qwen3_vl"], indirect=True)  # its one-device (XLA attention) reference is shared
def test_fused_attention_in_zigzag_order_matches_one_device(tiny_dir, reference):
    """`--attention-impl pallas_gpu` under cp 4 (Pallas' interpreter): each device attends its zig-zag query chunks
    of the 512-token row (64 tokens each, segment boundaries inside chunks) with the query-offset kernel, the vision
    tower runs jax's kernel; loss and gradient equal the XLA attention on one device."""
    seg = np.asarray(reference[1].arrays.segment_ids)[0, 0]
    assert any((np.flatnonzero(np.diff(seg)) + 1) % (ROW // 8))  # a packing boundary inside a chunk
    _assert_context_parallel_matches(tiny_dir, reference, 4, ["--attention-impl", "pallas_gpu"])


def _assert_context_parallel_matches(tiny_dir, reference, cp: int, overrides: list[str]) -> None:
    assert len(jax.devices()) == 8
    samples, batch, ref_value, ref_grads = reference
    tokens = np.asarray(batch.arrays.tokens)
    assert tokens.shape == (1, 1, ROW)  # all episodes packed into one row
    assert set(np.asarray(batch.arrays.segment_ids)[0, 0].tolist()) - {0} == {1, 2, 3}
    # Pure context parallelism on cp of the 8 devices: other axes add their own rounding (Qwen3.5's gradients move
    # by ~2e-5 relative under tp 2 alone: its per-head norms of 16-dim vectors magnify round-off); the shipped
    # fsdp x context layout is checked against one device over 3 steps in test_train_layouts.
    trainer = _trainer(tiny_dir, ["--mesh-data", "1", "--mesh-context", str(cp), *overrides], jax.devices()[:cp])
    assert dict(trainer.mesh.shape)["context"] == cp
    image_token = trainer.model_cfg.image_token_id
    assert _straddling(tokens[0, 0], image_token, cp), f"no image crosses a cp {cp} block boundary"
    _, value, grads = _loss_and_grads(trainer, samples)
    assert value == pytest.approx(ref_value, rel=1e-5, abs=1e-7)
    diff = np.sqrt(sum(float(np.sum((a - b) ** 2)) for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads))))
    norm = np.sqrt(sum(float(np.sum(b**2)) for b in jax.tree.leaves(ref_grads)))
    assert norm > 0 and diff <= GRAD_RTOL * norm, (diff / norm, cp)


@pytest.fixture(scope="module")
def qwen3_vl_dir(tmp_path_factory):
    from jaxrl_vlm.tiny import make_tiny

    return make_tiny(tmp_path_factory.mktemp("cp_checks") / "m", seed=0)


def test_context_parallel_needs_divisible_rows_and_activation_constraints(qwen3_vl_dir):
    base = ["--hf-checkpoint", str(qwen3_vl_dir), "--mesh-data", "1", "--mesh-context", "4", "--mesh-fsdp", "2"]
    cfg = load_config(None, [*base, "--seq-buckets", "250,256"])
    with pytest.raises(ConfigError, match=r"seq_buckets \[250\] are not multiples of the 4 sequence shards"):
        Trainer(cfg, devices=jax.devices()).build_policy(qwen3_vl_dir)
    cfg = load_config(None, [*base, "--seq-buckets", "256", "--activation-constraints", "false"])
    with pytest.raises(ConfigError, match=r"context parallelism \(4 sequence shards\) works through the activation "
                                          r"constraints; set mesh.activation_constraints: true"):
        Trainer(cfg, devices=jax.devices()).build_policy(qwen3_vl_dir)


def test_token_budget_per_device_plans_rows_per_context_group(qwen3_vl_dir, make_test_image):
    """--max-tokens-per-device under cp 2: a row's tokens are spread over its 2 devices, so a micro-batch of one
    batch shard holds budget x 2 tokens (two 512-token rows at a 512-token budget, not one row per micro-batch)."""
    enc = ChatEncoder(load_tokenizer(qwen3_vl_dir), load_image_processor(qwen3_vl_dir))
    rng = np.random.default_rng(0)
    first = [_episode(enc, make_test_image, i, 2 * i, rng) for i in range(3)]  # one 512-token row, packed
    second = [dataclasses.replace(s, group_index=1) for s in first]
    trainer = _trainer(qwen3_vl_dir, ["--mesh-data", "1", "--mesh-context", "2", "--row-buckets", "1,2",
                                      "--max-tokens-per-device", str(ROW)], jax.devices()[:2])
    batch, _ = trainer._batch(first + second, np.zeros(6, np.float32))
    assert np.asarray(batch.arrays.tokens).shape == (1, 2, ROW)
