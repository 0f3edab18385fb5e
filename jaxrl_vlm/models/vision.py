"""Host-side image inputs for the Flax Qwen3-VL: one fixed-shape pytree per batch.

The processor emits `pixel_values [P, C*T*p*p]` (patches of all images concatenated, each image in
merge-window order) and `image_grid_thw [N, 3]`. The device program must not depend on N or on the
grids, so this module turns them (numpy only, no JAX) into padded arrays of a fixed patch bucket:
per-patch image ids for block-diagonal attention, rotary (h, w) ids, bilinear position-table taps,
and the flat token slot each merged image token is written to.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from jaxrl_vlm.models.config import Qwen3VLConfig
from jaxrl_vlm.models.rope import vision_pos_embed_interp, vision_rotary_positions


class VisionInputs(NamedTuple):
    """Fixed-shape vision inputs (a pytree). P = patch bucket, M = P / merge**2.

    pixel_values       float [P, C*T*p*p]  zero rows at padding
    patch_segment_ids  int32 [P]           image-frame index per patch (vision attention stays inside one), -1 = padding
    patch_rotary_pos   int32 [P, 2]        (h, w) patch index inside its image
    pos_interp_idx     int32 [P, 4]        rows of the learned position table to blend
    pos_interp_w       float32 [P, 4]      bilinear weights (0 at padding)
    image_token_index  int32 [M]           flat index into B*T of each merged token; padding = B*T (dropped)
    """

    pixel_values: np.ndarray
    patch_segment_ids: np.ndarray
    patch_rotary_pos: np.ndarray
    pos_interp_idx: np.ndarray
    pos_interp_w: np.ndarray
    image_token_index: np.ndarray


def build_vision_inputs(
    pixel_values: np.ndarray,
    image_grid_thw: np.ndarray,
    tokens: np.ndarray,
    cfg: Qwen3VLConfig,
    *,
    patch_bucket: int | None = None,
    token_valid: np.ndarray | None = None,
) -> VisionInputs:
    """Pad processor outputs for images of a whole [B, T] token batch to `patch_bucket` patches.

    tokens [B, T]: image pads expanded; the i-th image-pad token in row-major order receives the
    i-th merged image token. token_valid [B, T] (optional, e.g. segment_ids > 0) excludes padding
    slots that happen to hold the image-pad id.
    """
    v = cfg.vision
    pixels = np.asarray(pixel_values)
    grid = np.asarray(image_grid_thw, dtype=np.int64).reshape(-1, 3)
    tokens = np.asarray(tokens)
    if tokens.ndim != 2:
        raise ValueError(f"tokens must be [B, T], got shape {tokens.shape}")
    if pixels.ndim != 2 or pixels.shape[1] != v.patch_dim:
        raise ValueError(f"pixel_values must be [P, {v.patch_dim}] (C*T*p*p), got shape {pixels.shape}")
    n_patches = int(grid.prod(-1).sum()) if len(grid) else 0
    if pixels.shape[0] != n_patches:
        raise ValueError(f"pixel_values has {pixels.shape[0]} patches but image_grid_thw {grid.tolist()} needs {n_patches}")
    bucket = n_patches if patch_bucket is None else int(patch_bucket)
    if bucket < n_patches:
        raise ValueError(f"patch_bucket={bucket} is smaller than the {n_patches} patches of this batch")
    if bucket % v.merge_unit:
        raise ValueError(f"patch_bucket={bucket} must be a multiple of spatial_merge_size**2={v.merge_unit}")

    frame_sizes = np.repeat(grid[:, 1] * grid[:, 2], grid[:, 0]) if len(grid) else np.zeros((0,), np.int64)
    seg = np.full((bucket,), -1, np.int32)
    seg[:n_patches] = np.repeat(np.arange(len(frame_sizes)), frame_sizes)

    padded_pixels = np.zeros((bucket, v.patch_dim), pixels.dtype if pixels.size else np.float32)
    padded_pixels[:n_patches] = pixels
    rot = np.zeros((bucket, 2), np.int32)
    rot[:n_patches] = vision_rotary_positions(grid, v.spatial_merge_size)
    idx = np.zeros((bucket, 4), np.int32)
    w = np.zeros((bucket, 4), np.float32)
    idx[:n_patches], w[:n_patches] = vision_pos_embed_interp(grid, v.num_position_embeddings, v.spatial_merge_size)

    is_image = tokens == cfg.image_token_id
    if token_valid is not None:
        is_image &= np.asarray(token_valid).astype(bool)
    slots = np.flatnonzero(is_image.reshape(-1))
    n_merged = n_patches // v.merge_unit
    if slots.size != n_merged:
        raise ValueError(
            f"tokens hold {slots.size} image-pad tokens (id {cfg.image_token_id}) but the images give {n_merged} merged tokens"
        )
    token_index = np.full((bucket // v.merge_unit,), tokens.size, np.int32)
    token_index[:n_merged] = slots
    return VisionInputs(padded_pixels, seg, rot, idx, w, token_index)
