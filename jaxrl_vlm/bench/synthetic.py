"""Synthetic multi-turn, multimodal `Sample`s with realistic shapes, for benchmarks (no tokenizer, no engine).

A Geometry3K-style tool-use episode, in token ids drawn for the model config:
  prompt   system + user text with one image (vision_start, t*h*w/merge^2 pads, vision_end)
  turn i   model tokens (loss 1, log-probs < 0), then an observation (loss 0): tool feedback text,
           with an image with probability `observation_image_prob`
The episodes of a group share the prompt (GRPO), differ in their responses and get 0/1 rewards that
are never all equal within a group, so advantages are non-zero. Lengths are drawn per episode; the
generator stops at whole groups once `token_budget` tokens are used, so the caller controls how full
the fixed-shape batch is. Image patches are random normals of the processor's patch size.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from jaxrl_vlm.models.config import ModelConfig
from rollout.sample import Sample, Status


@dataclass(frozen=True)
class EpisodeShape:
    """Length ranges (tokens, inclusive) of the synthetic episodes; image sides in patches."""

    group_size: int = 4
    prompt_text: tuple[int, int] = (40, 160)
    turns: tuple[int, int] = (1, 3)
    model_turn: tuple[int, int] = (24, 256)
    observation: tuple[int, int] = (12, 64)
    image_grid: tuple[int, int] = (8, 8)  # (h, w) patches of each image; multiples of spatial_merge_size
    observation_image_prob: float = 0.5
    max_length: int = 1024  # an episode is cut (at a turn boundary) to at most this many tokens


def episode_shape_for(seq_len: int, cfg: ModelConfig) -> EpisodeShape:
    """Lengths that fit rows of `seq_len` tokens: images ~1/8 of a row, turns ~1/6 (geo3k-like mix)."""
    merge = cfg.vision.spatial_merge_size
    pads_target = max(4, seq_len // 8)  # merged image tokens per image
    side = max(merge, int(np.sqrt(pads_target * cfg.vision.merge_unit)) // merge * merge)
    turn = max(16, seq_len // 6)
    return EpisodeShape(
        prompt_text=(max(8, seq_len // 32), max(16, seq_len // 10)),
        model_turn=(max(8, turn // 4), turn),
        observation=(max(4, seq_len // 64), max(8, seq_len // 20)),
        image_grid=(side, side),
        max_length=seq_len,
    )


def _text_ids(rng: np.random.Generator, n: int, cfg: ModelConfig) -> list[int]:
    """`n` ordinary token ids (never an image/video/vision-boundary id)."""
    special = {cfg.image_token_id, cfg.video_token_id, cfg.vision_start_token_id, cfg.vision_end_token_id}
    ids = rng.integers(1, cfg.text.vocab_size, size=n)
    for s in special:
        ids[ids == s] = 1  # id 1 is an ordinary token in every vocabulary we build
    return ids.tolist()


def _image(rng: np.random.Generator, cfg: ModelConfig, grid: tuple[int, int]) -> tuple[list[int], np.ndarray, np.ndarray]:
    """(tokens: vision_start, pads, vision_end; grid_thw [1, 3]; pixel_values [h*w, patch_dim])."""
    h, w = grid
    merge = cfg.vision.spatial_merge_size
    if h % merge or w % merge:
        raise ValueError(f"image grid {grid} must be multiples of spatial_merge_size={merge}")
    pads = h * w // cfg.vision.merge_unit
    tokens = [cfg.vision_start_token_id, *([cfg.image_token_id] * pads), cfg.vision_end_token_id]
    pixels = rng.standard_normal((h * w, cfg.vision.patch_dim)).astype(np.float32)
    return tokens, np.array([[1, h, w]], np.int64), pixels


def synthetic_samples(
    cfg: ModelConfig, token_budget: int, *, shape: EpisodeShape, seed: int = 0, max_samples: int | None = None
) -> list[Sample]:
    """Whole groups of synthetic episodes totalling at most `token_budget` tokens (at least one group).

    max_samples: also stop before exceeding this many episodes (e.g. one per row without packing).
    """
    if shape.group_size < 2:
        raise ValueError("group_size must be >= 2 (a group of one has no advantage signal)")
    rng = np.random.default_rng(seed)
    samples: list[Sample] = []
    used = 0
    group = 0
    while True:
        batch = _group(rng, cfg, shape, group)
        size = sum(len(s.tokens) for s in batch)
        too_many = max_samples is not None and len(samples) + len(batch) > max_samples
        if samples and (used + size > token_budget or too_many):
            return samples
        if not samples and (too_many or size > token_budget):
            raise ValueError(
                f"one group of {len(batch)} episodes ({size} tokens) exceeds the budget of {token_budget} tokens"
                + (f" / {max_samples} samples" if max_samples is not None else "")
                + "; use larger rows or a longer seq_len"
            )
        samples.extend(batch)
        used += size
        group += 1


def _group(rng: np.random.Generator, cfg: ModelConfig, shape: EpisodeShape, group: int) -> list[Sample]:
    img_tokens, grid, pixels = _image(rng, cfg, shape.image_grid)
    prompt = _text_ids(rng, int(rng.integers(*shape.prompt_text, endpoint=True)), cfg)
    cut = len(prompt) // 2
    prompt_ids = prompt[:cut] + img_tokens + prompt[cut:]
    if len(prompt_ids) + 1 > shape.max_length:
        raise ValueError(f"prompt of {len(prompt_ids)} tokens leaves no room for a response in {shape.max_length}")
    rewards = rng.integers(0, 2, size=shape.group_size).astype(float)
    if rewards.min() == rewards.max():
        rewards[0] = 1.0 - rewards[0]
    out = []
    for i in range(shape.group_size):
        s = Sample(group_index=group, index=i, prompt=f"synthetic prompt {group}", label="1")
        s.set_prompt_tokens(prompt_ids)
        grids, pix = [grid], [pixels]
        turns = int(rng.integers(*shape.turns, endpoint=True))
        for turn in range(turns):
            room = shape.max_length - len(s.tokens)
            n = min(int(rng.integers(*shape.model_turn, endpoint=True)), room)
            if n <= 0:
                break
            s.append_model_tokens(_text_ids(rng, n, cfg), (-rng.uniform(0.01, 3.0, size=n)).tolist())
            if turn == turns - 1:
                break
            obs = _text_ids(rng, int(rng.integers(*shape.observation, endpoint=True)), cfg)
            if rng.random() < shape.observation_image_prob:
                o_tokens, o_grid, o_pix = _image(rng, cfg, shape.image_grid)
                obs = obs[:2] + o_tokens + obs[2:]
                if len(s.tokens) + len(obs) + 1 > shape.max_length:
                    break
                grids.append(o_grid)
                pix.append(o_pix)
            elif len(s.tokens) + len(obs) + 1 > shape.max_length:
                break
            s.append_observation_tokens(obs)
        s.multimodal_train_inputs = {"image_grid_thw": np.concatenate(grids), "pixel_values": np.concatenate(pix)}
        s.image_data = [f"synthetic://image/{group}/{k}" for k in range(len(grids))]
        s.reward = float(rewards[i])
        s.set_status(Status.COMPLETED)
        out.append(s)
    return out
