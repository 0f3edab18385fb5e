"""Tiny random transformers Qwen3-VL and Qwen2.5-VL checkpoints and HF-style inputs for the model tests.

Built the HF way: `transformers.Qwen3VLConfig` / `Qwen3VLForConditionalGeneration` (or the Qwen2_5_VL
classes for the `Q25*` configs; PyTorch, fp32, `torch.manual_seed`), `Qwen2VLImageProcessorPil` for
pixel_values / image_grid_thw (the family's patch size and mean/std), image pads expanded to
t*h*w/merge^2 tokens between vision_start/vision_end, and `mm_token_type_ids`.
Weights are re-drawn with larger spread than HF's init (std 0.02) so that a wrong layout or a
missed op changes logits far beyond the 1e-4 tolerance.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from jaxrl_vlm.tiny_assets import CLIP_IMAGE_MEAN, CLIP_IMAGE_STD

VOCAB_SPECIALS = dict(vision_start_token_id=250, vision_end_token_id=251, image_token_id=252, video_token_id=253)

# Two deliberately different shapes: head_dim 16 / mrope [4,2,2] / tied / GQA 2,
# head_dim 32 / mrope [8,4,4] / untied / GQA 4 / deeper vision with 3 heads.
TINY_CONFIGS: dict[str, dict] = {
    "A": dict(
        text_config=dict(
            vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 2, 2], "mrope_interleaved": True},
        ),
        vision_config=dict(
            depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=16, temporal_patch_size=2,
            spatial_merge_size=2, out_hidden_size=64, num_position_embeddings=64, deepstack_visual_indexes=[0, 1],
        ),
        tie_word_embeddings=True,
        **VOCAB_SPECIALS,
    ),
    "B": dict(
        text_config=dict(
            vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=1, head_dim=32, rms_norm_eps=1e-5,
            rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0, "mrope_section": [8, 4, 4], "mrope_interleaved": True},
        ),
        vision_config=dict(
            depth=3, hidden_size=48, intermediate_size=80, num_heads=3, patch_size=16, temporal_patch_size=2,
            spatial_merge_size=2, out_hidden_size=64, num_position_embeddings=36, deepstack_visual_indexes=[2, 0],
        ),
        tie_word_embeddings=False,
        **VOCAB_SPECIALS,
    ),
}


# Qwen2.5-VL: contiguous M-RoPE, q/k/v bias, windowed ViT (patch 14). Q25A: window 56 px = 2x2 merged
# tokens, full attention in block 1 of 3, tied, GQA 2; Q25B: window 84 px = 3x3 (partial edge windows),
# full attention in block 0 of 2, untied, GQA 4, 3 vision heads, head_dim 32.
TINY_QWEN25_CONFIGS: dict[str, dict] = {
    "Q25A": dict(
        text_config=dict(
            vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
        ),
        vision_config=dict(
            depth=3, hidden_size=32, intermediate_size=48, num_heads=2, patch_size=14, temporal_patch_size=2,
            spatial_merge_size=2, out_hidden_size=64, window_size=56, fullatt_block_indexes=[1],
        ),
        tie_word_embeddings=True,
        **VOCAB_SPECIALS,
    ),
    "Q25B": dict(
        text_config=dict(
            vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=2,
            num_key_value_heads=1, rms_norm_eps=1e-5,
            rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0, "mrope_section": [4, 6, 6]},
        ),
        vision_config=dict(
            depth=2, hidden_size=48, intermediate_size=80, num_heads=3, patch_size=14, temporal_patch_size=2,
            spatial_merge_size=2, out_hidden_size=64, window_size=84, fullatt_block_indexes=[0],
        ),
        tie_word_embeddings=False,
        **VOCAB_SPECIALS,
    ),
}


def is_qwen25(name: str) -> bool:
    return name in TINY_QWEN25_CONFIGS


def build_hf_model(name: str, seed: int = 0):
    """A random fp32 `Qwen3VLForConditionalGeneration` (or `Qwen2_5_VLForConditionalGeneration` for a
    `TINY_QWEN25_CONFIGS` name) for config `name`, in eval mode."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen3VLConfig, Qwen3VLForConditionalGeneration

    if is_qwen25(name):
        config_cls, model_cls, kwargs = Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, TINY_QWEN25_CONFIGS[name]
    else:
        config_cls, model_cls, kwargs = Qwen3VLConfig, Qwen3VLForConditionalGeneration, TINY_CONFIGS[name]
    torch.manual_seed(seed)
    model = model_cls(config_cls(**kwargs)).eval().float()
    spread_weights(model, seed + 1)
    return model


def save_hf_model(model, path: Path) -> Path:
    model.save_pretrained(path)
    return path


def image_processor(qwen25: bool = False):
    """The Qwen3-VL image preprocessing (patch 16, merge 2, temporal 2, mean/std 0.5), tiny pixel bounds; with
    `qwen25`, Qwen2.5-VL's (patch 14, CLIP mean/std) with room for images of several attention windows."""
    from transformers import Qwen2VLImageProcessorPil

    if qwen25:
        return Qwen2VLImageProcessorPil(
            patch_size=14, temporal_patch_size=2, merge_size=2, image_mean=list(CLIP_IMAGE_MEAN),
            image_std=list(CLIP_IMAGE_STD), size={"shortest_edge": 28 * 28, "longest_edge": 196 * 196},
        )
    return Qwen2VLImageProcessorPil(
        patch_size=16,
        temporal_patch_size=2,
        merge_size=2,
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
        size={"shortest_edge": 32 * 32, "longest_edge": 128 * 128},
    )


def random_image(height: int, width: int, seed: int) -> Image.Image:
    rng = np.random.RandomState(seed)
    return Image.fromarray((rng.rand(height, width, 3) * 255).astype(np.uint8))


@dataclass
class HFBatch:
    """One batch as transformers consumes it (right padding)."""

    input_ids: np.ndarray  # [B, T] int64
    attention_mask: np.ndarray  # [B, T] int64
    mm_token_type_ids: np.ndarray  # [B, T] int64
    pixel_values: np.ndarray | None  # [P, C*T*p*p] float32
    image_grid_thw: np.ndarray | None  # [N, 3] int64

    def torch_kwargs(self) -> dict:
        kw = dict(
            input_ids=torch.from_numpy(self.input_ids),
            attention_mask=torch.from_numpy(self.attention_mask),
            mm_token_type_ids=torch.from_numpy(self.mm_token_type_ids),
        )
        if self.pixel_values is not None:
            kw["pixel_values"] = torch.from_numpy(self.pixel_values)
            kw["image_grid_thw"] = torch.from_numpy(self.image_grid_thw)
        return kw


def make_batch(rows: list[list], images: list[Image.Image], seed: int = 0, vocab: int = 240, qwen25: bool = False) -> HFBatch:
    """rows: per sequence a list of items, an int n = n random text tokens or "img" = next image.

    Images are processed together by the HF image processor (Qwen2.5-VL's with `qwen25`), pads expanded
    to grid t*h*w/4.
    """
    rng = np.random.RandomState(seed)
    proc = image_processor(qwen25)
    pixel_values = grid = None
    if images:
        out = proc(images=images, return_tensors="np")
        pixel_values = out["pixel_values"].astype(np.float32)
        grid = out["image_grid_thw"].astype(np.int64)
    seqs, img_i = [], 0
    for row in rows:
        ids: list[int] = []
        for item in row:
            if item == "img":
                n = int(np.prod(grid[img_i])) // 4
                ids += [VOCAB_SPECIALS["vision_start_token_id"]] + [VOCAB_SPECIALS["image_token_id"]] * n
                ids += [VOCAB_SPECIALS["vision_end_token_id"]]
                img_i += 1
            else:
                ids += rng.randint(0, vocab, size=int(item)).tolist()
        seqs.append(ids)
    if img_i != len(images):
        raise ValueError("rows use a different number of images than given")
    t = max(len(s) for s in seqs)
    input_ids = np.zeros((len(seqs), t), np.int64)
    mask = np.zeros((len(seqs), t), np.int64)
    for b, s in enumerate(seqs):
        input_ids[b, : len(s)] = s
        mask[b, : len(s)] = 1
    mm = (input_ids == VOCAB_SPECIALS["image_token_id"]).astype(np.int64) * mask
    return HFBatch(input_ids, mask, mm, pixel_values, grid)


@dataclass
class PackedRows:
    """Single-sequence batches packed into fixed rows: tokens / segment ids [B, T] (0 = padding), each sequence's
    (row, start, length) in `spans`, and the images' grid and pixels concatenated in row-major order."""

    tokens: np.ndarray
    segment_ids: np.ndarray
    spans: list[tuple[int, int, int]]
    grid: np.ndarray
    pixels: np.ndarray


def pack_batches(batches: list[HFBatch], layout: list[tuple[int, int]], shape: tuple[int, int]) -> PackedRows:
    """Pack `batches` (one sequence each) at `layout`'s (row, segment id), in row-major order, into rows of `shape`."""
    tokens = np.zeros(shape, np.int64)
    seg = np.zeros(shape, np.int32)
    spans, fill = [], [0] * shape[0]
    for (row, k), batch in zip(layout, batches):
        n = batch.input_ids.shape[1]
        tokens[row, fill[row] : fill[row] + n], seg[row, fill[row] : fill[row] + n] = batch.input_ids[0], k
        spans.append((row, fill[row], n))
        fill[row] += n
    with_images = [b for b in batches if b.pixel_values is not None]
    grid = np.concatenate([b.image_grid_thw for b in with_images])
    pixels = np.concatenate([b.pixel_values for b in with_images])
    return PackedRows(tokens, seg, spans, grid, pixels)


def hf_logits(model, batch: HFBatch) -> np.ndarray:
    with torch.no_grad():
        return model(**batch.torch_kwargs()).logits.float().numpy()


def spread_weights(model, seed: int, embed_std: float = 0.5) -> None:
    """Redraw weights with O(1) activations (variance 1/fan-in kernels, norms near 1, small biases): HF's
    0.02-std init gives near-uniform logits, against which a 1e-4 parity check would mean little."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for key, p in model.named_parameters():
            if key.endswith("norm.weight") or "norm1.weight" in key or "norm2.weight" in key or "layernorm.weight" in key:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            elif key.endswith(".bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
            elif "embed_tokens" in key or "pos_embed" in key:
                p.copy_(embed_std * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / np.sqrt(int(np.prod(p.shape[1:]))))
