"""Host-side image inputs for the Flax Qwen-VL models: one fixed-shape pytree per batch.

The processor emits `pixel_values [P, C*T*p*p]` (patches of all images concatenated, each image in
merge-window order) and `image_grid_thw [N, 3]`. The device program must not depend on N or on the
grids, so this module turns them (numpy only, no JAX) into padded arrays of a fixed patch bucket:
per-patch image ids for block-diagonal attention, rotary (h, w) ids, bilinear position-table taps,
and the flat token slot each merged image token is written to.

Qwen3-VL gets `VisionInputs` (bilinear taps of its learned position table). Qwen2.5-VL gets
`WindowedVisionInputs`: its tower attends inside windows of `window_size` pixels in most blocks, so the
patches are handed over already permuted into window order (transformers' `window_index`, merge unit by
merge unit), with a window id per patch; the reverse permutation is folded into `image_token_index`,
so the device never permutes anything.

Vision reuse (`build_reused_vision_inputs`): the patches hold each DISTINCT image of a micro-batch once, and
`token_image_rows [B, T]` names the tower's merged row read at every image-pad slot, so one image shown by
several samples (a GRPO group's prompt picture, an earlier turn's picture sent again) is encoded once and
gathered into each of them; `image_token_index` then holds padding only.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from jaxrl_vlm.models.config import ModelConfig, Qwen25VLConfig
from jaxrl_vlm.models.rope import vision_pos_embed_interp, vision_rotary_positions


class VisionInputs(NamedTuple):
    """Fixed-shape vision inputs (a pytree). P = patch bucket, M = P / merge**2.

    pixel_values       float [P, C*T*p*p]  zero rows at padding
    patch_segment_ids  int32 [P]           image-frame index per patch (vision attention stays inside one), -1 = padding
    patch_rotary_pos   int32 [P, 2]        (h, w) patch index inside its image
    pos_interp_idx     int32 [P, 4]        rows of the learned position table to blend
    pos_interp_w       float32 [P, 4]      bilinear weights (0 at padding)
    image_token_index  int32 [M]           flat index into B*T of each merged token; padding = B*T (dropped)
    token_image_rows   int32 [B, T] | None merged row (of the tower's [M] output) read at each token slot, -1 where
                                           none; set by vision reuse instead of image_token_index (then all B*T)
    """

    pixel_values: np.ndarray
    patch_segment_ids: np.ndarray
    patch_rotary_pos: np.ndarray
    pos_interp_idx: np.ndarray
    pos_interp_w: np.ndarray
    image_token_index: np.ndarray
    token_image_rows: np.ndarray | None = None


class WindowedVisionInputs(NamedTuple):
    """Fixed-shape Qwen2.5-VL vision inputs, patches in WINDOW order (a pytree). P = patch bucket, M = P / merge**2.

    pixel_values       float [P, C*T*p*p]  zero rows at padding
    patch_segment_ids  int32 [P]           image-frame index per patch (full-attention blocks), -1 = padding
    patch_window_ids   int32 [P]           attention-window index per patch (window blocks), -1 = padding
    patch_rotary_pos   int32 [P, 2]        (h, w) patch index inside its image
    image_token_index  int32 [M]           flat index into B*T of each merged token (window order); padding = B*T
    token_image_rows   int32 [B, T] | None as VisionInputs' (rows in window order)
    """

    pixel_values: np.ndarray
    patch_segment_ids: np.ndarray
    patch_window_ids: np.ndarray
    patch_rotary_pos: np.ndarray
    image_token_index: np.ndarray
    token_image_rows: np.ndarray | None = None


def build_vision_inputs(
    pixel_values: np.ndarray,
    image_grid_thw: np.ndarray,
    tokens: np.ndarray,
    cfg: ModelConfig,
    *,
    patch_bucket: int | None = None,
    token_valid: np.ndarray | None = None,
    pixel_values_videos: np.ndarray | None = None,
    video_grid_thw: np.ndarray | None = None,
) -> VisionInputs | WindowedVisionInputs:
    """Pad processor outputs for the pictures (and clips) of a whole [B, T] token batch to `patch_bucket` patches,
    in the input type of `cfg`'s family.

    tokens [B, T]: image and video pads expanded; the i-th image-pad token in row-major order receives the
    i-th merged picture token, the i-th video-pad token the i-th merged clip token. token_valid [B, T]
    (optional, e.g. segment_ids > 0) excludes padding slots that happen to hold a pad id.

    The tower sees the pictures' patches, then the clips' (`pixel_values_videos` [P', C*T*p*p], one row of
    `video_grid_thw` per clip): it encodes every frame group on its own (attention stays inside a frame, as in
    transformers), so the order of the two does not change any output row.
    """
    v = cfg.vision
    pixels = np.asarray(pixel_values)
    grid = np.asarray(image_grid_thw, dtype=np.int64).reshape(-1, 3)
    tokens = np.asarray(tokens)
    if tokens.ndim != 2:
        raise ValueError(f"tokens must be [B, T], got shape {tokens.shape}")
    _check_pixels(pixels, grid, v.patch_dim, "pixel_values", "image_grid_thw")
    clip_grid = np.zeros((0, 3), np.int64)
    if video_grid_thw is not None or pixel_values_videos is not None:
        if video_grid_thw is None or pixel_values_videos is None:
            raise ValueError("pixel_values_videos and video_grid_thw come together")
        clip_pixels = np.asarray(pixel_values_videos)
        clip_grid = np.asarray(video_grid_thw, dtype=np.int64).reshape(-1, 3)
        _check_pixels(clip_pixels, clip_grid, v.patch_dim, "pixel_values_videos", "video_grid_thw")
        if len(clip_grid):
            pixels = np.concatenate([pixels.astype(clip_pixels.dtype, copy=False), clip_pixels])
            grid = np.concatenate([grid, clip_grid])
    n_patches = int(grid.prod(-1).sum()) if len(grid) else 0
    bucket = n_patches if patch_bucket is None else int(patch_bucket)
    if bucket < n_patches:
        raise ValueError(f"patch_bucket={bucket} is smaller than the {n_patches} patches of this batch")
    if bucket % v.merge_unit:
        raise ValueError(f"patch_bucket={bucket} must be a multiple of spatial_merge_size**2={v.merge_unit}")

    frame_sizes = np.repeat(grid[:, 1] * grid[:, 2], grid[:, 0]) if len(grid) else np.zeros((0,), np.int64)
    frames = np.repeat(np.arange(len(frame_sizes)), frame_sizes)
    rotary = vision_rotary_positions(grid, v.spatial_merge_size)

    valid = np.ones(tokens.shape, bool) if token_valid is None else np.asarray(token_valid).astype(bool)
    slots = np.flatnonzero(((tokens == cfg.image_token_id) & valid).reshape(-1))
    clip_slots = np.flatnonzero(((tokens == cfg.video_token_id) & valid).reshape(-1))
    n_clip = int(clip_grid.prod(-1).sum()) // v.merge_unit if len(clip_grid) else 0
    n_merged = n_patches // v.merge_unit
    if slots.size != n_merged - n_clip:
        raise ValueError(
            f"tokens hold {slots.size} image-pad tokens (id {cfg.image_token_id}) but the images give "
            f"{n_merged - n_clip} merged tokens"
        )
    if clip_slots.size != n_clip:
        raise ValueError(
            f"tokens hold {clip_slots.size} video-pad tokens (id {cfg.video_token_id}) but the clips give "
            f"{n_clip} merged tokens"
        )
    slots = np.concatenate([slots, clip_slots])
    token_index = np.full((bucket // v.merge_unit,), tokens.size, np.int32)

    def padded(values: np.ndarray, fill: int | float, dtype: np.dtype) -> np.ndarray:
        out = np.full((bucket,) + values.shape[1:], fill, dtype)
        out[:n_patches] = values
        return out

    pixel_dtype = pixels.dtype if pixels.size else np.float32
    if isinstance(cfg, Qwen25VLConfig):
        window_index, window_ids = vision_window_index(grid, v.spatial_merge_size, v.window_merged_side)
        patch_order = (window_index[:, None] * v.merge_unit + np.arange(v.merge_unit)).reshape(-1)
        token_index[:n_merged] = slots[window_index]  # merged token j (window order) belongs to pad window_index[j]
        return WindowedVisionInputs(
            padded(pixels[patch_order], 0, pixel_dtype),
            padded(frames[patch_order], -1, np.int32),
            padded(np.repeat(window_ids, v.merge_unit), -1, np.int32),
            padded(rotary[patch_order], 0, np.int32),
            token_index,
        )
    idx, w = vision_pos_embed_interp(grid, v.num_position_embeddings, v.spatial_merge_size)
    token_index[:n_merged] = slots
    return VisionInputs(
        padded(pixels, 0, pixel_dtype),
        padded(frames, -1, np.int32),
        padded(rotary, 0, np.int32),
        padded(idx, 0, np.int32),
        padded(w, 0, np.float32),
        token_index,
    )


def _check_pixels(pixels: np.ndarray, grid: np.ndarray, patch_dim: int, name: str, grid_name: str) -> None:
    if pixels.ndim != 2 or pixels.shape[1] != patch_dim:
        raise ValueError(f"{name} must be [P, {patch_dim}] (C*T*p*p), got shape {pixels.shape}")
    n_patches = int(grid.prod(-1).sum()) if len(grid) else 0
    if pixels.shape[0] != n_patches:
        raise ValueError(f"{name} has {pixels.shape[0]} patches but {grid_name} {grid.tolist()} needs {n_patches}")


def build_reused_vision_inputs(
    pixel_values: np.ndarray,
    image_grid_thw: np.ndarray,
    image_of_occurrence: np.ndarray,
    tokens: np.ndarray,
    cfg: ModelConfig,
    *,
    patch_bucket: int,
    token_valid: np.ndarray | None = None,
    pixel_values_videos: np.ndarray | None = None,
    video_grid_thw: np.ndarray | None = None,
    clip_of_occurrence: np.ndarray | None = None,
) -> VisionInputs | WindowedVisionInputs:
    """Vision inputs that encode each distinct image (and clip) once and gather it into every slot that shows it.

    pixel_values / image_grid_thw: the DISTINCT images (processor layout, as `build_vision_inputs`).
    image_of_occurrence int [n]: the distinct image of each image occurrence of `tokens` [B, T], in row-major
    token order (the i-th occurrence fills the next grid_t*grid_h*grid_w / merge**2 image pads).
    pixel_values_videos / video_grid_thw / clip_of_occurrence: the same for the DISTINCT clips and the video pads.
    Returns the family's inputs with `token_image_rows [B, T]` set (the tower row gathered at each slot, -1
    elsewhere) and `image_token_index` all padding. The tower sees only the distinct images and clips, each
    attending within its own frames (and windows), so every gathered row equals a per-sample encoding of it.
    """
    v = cfg.vision
    grid = np.asarray(image_grid_thw, dtype=np.int64).reshape(-1, 3)
    clip_grid = np.asarray(np.zeros((0, 3)) if video_grid_thw is None else video_grid_thw, np.int64).reshape(-1, 3)
    tokens = np.asarray(tokens)
    sizes = grid.prod(-1) // v.merge_unit if len(grid) else np.zeros((0,), np.int64)
    clip_sizes = clip_grid.prod(-1) // v.merge_unit if len(clip_grid) else np.zeros((0,), np.int64)
    n_img, n_clip = int(sizes.sum()), int(clip_sizes.sum())
    # The tower's output order for these images and clips alone: lay them out as one row of image pads, then video
    # pads, so that image_token_index[j] is the canonical merged index of tower row j (window order for Qwen2.5-VL).
    row = np.concatenate([np.full(n_img, cfg.image_token_id), np.full(n_clip, cfg.video_token_id)])[None]
    canonical = build_vision_inputs(pixel_values, grid, row, cfg, patch_bucket=patch_bucket,
                                    pixel_values_videos=pixel_values_videos if n_clip else None,
                                    video_grid_thw=clip_grid if n_clip else None)
    tower_row = np.empty(n_img + n_clip, np.int64)
    tower_row[canonical.image_token_index[: n_img + n_clip]] = np.arange(n_img + n_clip)
    valid = np.ones(tokens.shape, bool) if token_valid is None else np.asarray(token_valid).astype(bool)
    rows = np.full(tokens.size, -1, np.int32)
    for kind, pad, merged, occurrence, offset in (
        ("image", cfg.image_token_id, sizes, image_of_occurrence, 0),
        ("clip", cfg.video_token_id, clip_sizes, clip_of_occurrence, n_img),
    ):
        occurrence = np.zeros(0, np.int64) if occurrence is None else np.asarray(occurrence, np.int64).reshape(-1)
        if occurrence.size and (occurrence.min() < 0 or occurrence.max() >= len(merged)):
            raise ValueError(f"{kind}_of_occurrence {occurrence.tolist()} names {kind}s outside the {len(merged)} "
                             "distinct ones")
        first = np.cumsum(merged) - merged
        take = merged[occurrence]
        wanted = np.repeat(first[occurrence] - (np.cumsum(take) - take), take) + np.arange(int(take.sum()))
        slots = np.flatnonzero(((tokens == pad) & valid).reshape(-1))
        if slots.size != wanted.size:
            raise ValueError(
                f"tokens hold {slots.size} {'image' if kind == 'image' else 'video'}-pad tokens (id {pad}) but the "
                f"{kind} occurrences give {wanted.size} merged tokens"
            )
        rows[slots] = tower_row[offset + wanted]
    return canonical._replace(
        image_token_index=np.full_like(canonical.image_token_index, tokens.size),
        token_image_rows=rows.reshape(tokens.shape),
    )


def vision_window_index(grid_thw: np.ndarray, merge: int, window_side: int) -> tuple[np.ndarray, np.ndarray]:
    """Qwen2.5-VL's window order of the merged tokens of all images, and their window ids.

    Each frame's (h / merge) x (w / merge) merged grid is cut into windows of `window_side` x `window_side`
    merged tokens (the last row / column of windows may be partial); windows are taken frame by frame,
    row-major, and the tokens inside a window row-major. Returns window_index int64 [M] (window_index[j]
    = original merged index of the j-th token in window order, as transformers' `get_vision_window_index`;
    its argsort is the reverse permutation) and window_ids int32 [M] (consecutive ids, one per non-empty
    window, in window order).
    """
    grid = np.asarray(grid_thw, np.int64).reshape(-1, 3)
    if not len(grid):
        return np.zeros((0,), np.int64), np.zeros((0,), np.int32)
    lh, lw = grid[:, 1] // merge, grid[:, 2] // merge
    sizes = grid[:, 0] * lh * lw
    owner = np.repeat(np.arange(len(grid)), sizes)
    local = np.arange(int(sizes.sum())) - np.repeat(np.cumsum(sizes) - sizes, sizes)
    frame, rest = np.divmod(local, (lh * lw)[owner])
    row, col = np.divmod(rest, lw[owner])
    windows_w = -(-lw // window_side)  # ceil
    windows_per_frame = -(-lh // window_side) * windows_w
    first_window = np.cumsum(grid[:, 0] * windows_per_frame) - grid[:, 0] * windows_per_frame
    window = (first_window[owner] + frame * windows_per_frame[owner]
              + (row // window_side) * windows_w[owner] + col // window_side)
    window_index = np.lexsort((col, row, window))  # by window, then row-major inside it
    ordered = window[window_index]
    starts = np.ones(ordered.size, bool)
    starts[1:] = ordered[1:] != ordered[:-1]
    return window_index.astype(np.int64), (np.cumsum(starts) - 1).astype(np.int32)
