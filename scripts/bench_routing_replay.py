"""Trainer vs engine log-prob difference on the same MoE rollouts, with and without routing replay.

    python scripts/bench_routing_replay.py [--engine-dtype bfloat16] [--samples 16] [--model-dir DIR]

A tiny random Qwen3-VL-MoE (make-tiny, or --model-dir) is served by the embedded engine in --engine-dtype (bf16
by default: the engine's routing then differs from the fp32 trainer's on near-tied router scores, as a bf16
SGLang's does from a Megatron trainer's). Each episode is two turns over SGLang's wire (`/generate` with
return_logprob and return_routed_experts): a picture prompt, a sampled answer (T = 1), an observation, a second
answer, so the second request reuses the first turn's cached prefix and its recorded routing. The trainer (fp32)
then scores every sampled token of the same samples twice: with its own routing and replaying the engine's
(`--use-rollout-routing-replay`). Printed: mean and max |trainer - engine| log-prob over the sampled tokens, and
the share of (token, sparse layer) pairs whose expert set the trainer's router chooses differently.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
from pathlib import Path

import numpy as np
from PIL import Image

import jax
import jax.numpy as jnp
from flax import nnx
from jaxrl_vlm.batching import build_train_batch
from jaxrl_vlm.engine import EmbeddedEngine, EngineOptions
from jaxrl_vlm.models import from_hf
from jaxrl_vlm.rl.train_step import policy_logprobs
from jaxrl_vlm.tiny import make_tiny
from rollout.client import SGLangClient
from rollout.encoding import ChatEncoder
from rollout.processing import image_to_data_url
from rollout.sample import Sample, Status
from rollout.sglang_wire import decode_routed_experts


def _picture(seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, size=(64, 64, 3), dtype=np.uint8))


async def rollouts(engine: EmbeddedEngine, encoder: ChatEncoder, n: int, max_new: int) -> list[Sample]:
    """n two-turn episodes, as rollout/multiturn.py builds them, with the engine's routed experts."""
    samples = []
    async with SGLangClient(engine.url, timeout_s=300.0) as client:
        for i in range(n):
            content = [{"type": "image", "image": image_to_data_url(_picture(i % 4))},
                       {"type": "text", "text": f"What color is card {i % 4}?"}]
            seg = encoder.encode_prompt([{"role": "user", "content": content}])
            params = {"temperature": 1.0, "max_new_tokens": max_new, "ignore_eos": True, "sampling_seed": 1000 + i}
            s = Sample(group_index=i // 4, index=i % 4)
            s.set_prompt_tokens(seg.train_ids)
            s.image_data = list(seg.image_data)
            s.multimodal_train_inputs = dict(seg.mm_inputs)
            first = await client.generate(seg.wire_ids, image_data=s.image_data, sampling_params=params,
                                          return_routed_experts=True)
            s.append_model_tokens(first.output_ids, first.output_log_probs)
            obs = encoder.encode_observation([{"role": "user", "content": "Look again."}], model_ended_turn=False)
            s.append_observation_tokens(obs.train_ids)
            wire = seg.wire_ids + first.output_ids + obs.wire_ids
            second = await client.generate(wire, image_data=s.image_data, sampling_params={**params, "sampling_seed": 2000 + i},
                                           return_routed_experts=True)
            s.append_model_tokens(second.output_ids, second.output_log_probs)
            s.rollout_routed_experts = decode_routed_experts(second.meta_info)
            assert s.rollout_routed_experts.shape[0] == len(s.tokens) - 1, "routing must cover every fed position"
            s.reward = 0.0
            s.set_status(Status.COMPLETED)
            s.validate()
            samples.append(s)
    return samples


def trainer_logprobs(model, samples: list[Sample], replay: bool):
    """(|trainer - engine| over sampled tokens, share of sparse-layer expert sets the trainer's router picks
    differently from the engine's) on one fp32 forward of the samples."""
    cfg = model.cfg
    batch = build_train_batch(samples, np.zeros(len(samples), np.float32), cfg, seq_buckets=[256], row_buckets=[4, 8, 16, 32],
                              patch_buckets=[1024], packing=True, micro_batch_rows=None, aggregation="token_mean",
                              aggregation_constant=None, overlong_policy="error", routing_replay=True)
    a = batch.arrays
    graphdef, params = nnx.split(model, nnx.Param)
    fn = jax.jit(lambda p, mb: policy_logprobs(graphdef, p, mb, chunk_size=64, need_entropy=False, with_routing=True))
    diffs, differ, pairs = [], 0, 0
    for k in range(a.tokens.shape[0]):
        mb = jax.tree.map(lambda x: None if x is None else jnp.asarray(x[k]), a)
        engine_ids = np.asarray(a.routed_experts[k])  # [R, T, L_sparse, k]
        lp, _, routing = fn(params, mb if replay else mb._replace(routed_experts=None))
        mask = np.asarray(a.loss_mask[k]) > 0
        diffs.append(np.abs(np.asarray(lp) - np.asarray(a.rollout_logprobs[k]))[mask])
        own = np.sort(np.moveaxis(np.asarray(routing.topk_ids), 0, 2), axis=-1)  # [R, T, L_sparse, k]
        recorded = engine_ids[..., 0] >= 0
        differ += int((own != np.sort(engine_ids, axis=-1)).any(-1)[recorded].sum())
        pairs += int(recorded.sum())
    return np.concatenate(diffs), differ / max(pairs, 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-dir", default=None, help="An MoE checkpoint (default: a fresh make-tiny qwen3_vl_moe).")
    ap.add_argument("--engine-dtype", default="bfloat16", choices=("float32", "bfloat16"))
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=24)
    args = ap.parse_args()
    model_dir = Path(args.model_dir or tempfile.mkdtemp(prefix="moe_replay_"))
    if not (model_dir / "config.json").exists():
        make_tiny(model_dir, arch="qwen3_vl_moe")
    options = EngineOptions(max_batch=8, max_seq_len=256, param_dtype=args.engine_dtype,
                            compute_dtype=args.engine_dtype)
    with EmbeddedEngine(str(model_dir), config=options) as engine:
        encoder = ChatEncoder(engine.engine.tokenizer, engine.engine.image_processor)
        samples = asyncio.run(rollouts(engine, encoder, args.samples, args.max_new_tokens))
    model = from_hf(model_dir)  # the trainer: fp32
    tokens = sum(int(np.sum(s.loss_mask)) for s in samples)
    print(f"{len(samples)} two-turn samples, {tokens} sampled tokens; engine {args.engine_dtype}, trainer float32")
    for replay in (False, True):
        d, share = trainer_logprobs(model, samples, replay)
        name = "with routing replay   " if replay else "without routing replay"
        print(f"{name}: |dlogprob| mean {d.mean():.3e} max {d.max():.3e}; trainer routing differs from the "
              f"engine's on {100 * share:.2f}% of (token, sparse layer) pairs")


if __name__ == "__main__":
    main()
