"""Host-side (numpy) position arithmetic for Qwen3-VL.

Everything whose shape depends on the images (M-RoPE ids, vision rotary ids, bilinear
position-embedding taps) is computed here, so the device program only sees fixed-shape
integer/float arrays and gathers. The on-device rotation itself lives in `qwen3_vl.py`.

Reference semantics: transformers `Qwen3VLModel.get_rope_index` and `transformers.vision_utils`
(`get_vision_position_ids`, `get_vision_interpolation_indices_and_weights`, bilinear,
align_corners=True, patches in spatial-merge-window order).
"""

from __future__ import annotations

import numpy as np

from jaxrl_vlm.models.config import Qwen3VLConfig


def _as_grid(image_grid_thw: np.ndarray | None) -> np.ndarray:
    if image_grid_thw is None:
        return np.zeros((0, 3), np.int64)
    grid = np.asarray(image_grid_thw, dtype=np.int64).reshape(-1, 3)
    if (grid <= 0).any():
        raise ValueError(f"image_grid_thw entries must be positive, got {grid.tolist()}")
    return grid


def _sequence_positions(ids: np.ndarray, grids: list[np.ndarray], cfg: Qwen3VLConfig, where: str) -> np.ndarray:
    """M-RoPE ids [3, L] for one unpadded sequence `ids` [L] whose images use `grids` (in order)."""
    merge = cfg.vision.spatial_merge_size
    is_image = ids == cfg.image_token_id
    if (ids == cfg.video_token_id).any():
        raise ValueError(f"{where}: video tokens (id {cfg.video_token_id}) are not supported")
    out = np.empty((3, ids.shape[0]), np.int64)
    pos = 0  # next position id
    i = 0
    g = 0
    n = ids.shape[0]
    while i < n:
        if not is_image[i]:
            j = i
            while j < n and not is_image[j]:
                j += 1
            out[:, i:j] = np.arange(pos, pos + j - i)[None, :]
            pos += j - i
            i = j
            continue
        if g >= len(grids):
            raise ValueError(f"{where}: more image-token runs than image_grid_thw rows ({len(grids)})")
        t, h, w = (int(x) for x in grids[g])
        lh, lw = h // merge, w // merge
        count = t * lh * lw
        if i + count > n or not is_image[i : i + count].all():
            run = int(np.argmin(np.append(is_image[i:], False)))
            raise ValueError(
                f"{where}: image {g} with grid (t={t}, h={h}, w={w}) needs {count} consecutive image tokens, "
                f"found {run} at token {i}"
            )
        tt, hh, ww = np.meshgrid(np.arange(t), np.arange(lh), np.arange(lw), indexing="ij")
        out[0, i : i + count] = tt.reshape(-1) + pos
        out[1, i : i + count] = hh.reshape(-1) + pos
        out[2, i : i + count] = ww.reshape(-1) + pos
        pos += max(h, w) // merge
        i += count
        g += 1
    if g != len(grids):
        raise ValueError(f"{where}: {len(grids)} image grids given but only {g} images found in the tokens")
    return out


def _split_grids(tokens_in_order: list[np.ndarray], grid: np.ndarray, cfg: Qwen3VLConfig) -> list[list[np.ndarray]]:
    """Assign consecutive grid rows to each sequence by the number of image tokens it holds."""
    merge2 = cfg.vision.merge_unit
    sizes = grid.prod(-1) // merge2 if len(grid) else np.zeros((0,), np.int64)
    out: list[list[np.ndarray]] = []
    g = 0
    for seq_idx, ids in enumerate(tokens_in_order):
        need = int((ids == cfg.image_token_id).sum())
        mine: list[np.ndarray] = []
        have = 0
        while have < need:
            if g >= len(grid):
                raise ValueError(
                    f"sequence {seq_idx} has {need} image tokens but image_grid_thw ran out after {len(grid)} rows"
                )
            mine.append(grid[g])
            have += int(sizes[g])
            g += 1
        if have != need:
            raise ValueError(f"sequence {seq_idx}: {need} image tokens do not match its grids' {have} merged tokens")
        out.append(mine)
    if g != len(grid):
        raise ValueError(f"image_grid_thw has {len(grid)} rows but the tokens only use {g}")
    return out


def get_rope_index(
    input_ids: np.ndarray,
    image_grid_thw: np.ndarray | None,
    attention_mask: np.ndarray | None,
    cfg: Qwen3VLConfig,
) -> tuple[np.ndarray, np.ndarray]:
    """M-RoPE position ids, equal to transformers' `Qwen3VLModel.get_rope_index` for images.

    input_ids [B, T] int (image pads expanded); image_grid_thw [N, 3] for all images of the batch in
    row-major order; attention_mask [B, T] (1 = real token; any padding side).
    Returns positions_3bt int32 [3, B, T] (0 at padding) and rope_deltas int32 [B]
    (= max position + 1 - number of real tokens; decode positions continue at len + delta).
    """
    ids = np.asarray(input_ids)
    if ids.ndim != 2:
        raise ValueError(f"input_ids must be [B, T], got shape {ids.shape}")
    mask = np.ones_like(ids, dtype=bool) if attention_mask is None else np.asarray(attention_mask).astype(bool)
    if mask.shape != ids.shape:
        raise ValueError(f"attention_mask shape {mask.shape} != input_ids shape {ids.shape}")
    grid = _as_grid(image_grid_thw)
    rows = [ids[b][mask[b]] for b in range(ids.shape[0])]
    grids = _split_grids(rows, grid, cfg)
    positions = np.zeros((3,) + ids.shape, np.int32)
    deltas = np.zeros((ids.shape[0],), np.int32)
    for b, row in enumerate(rows):
        if row.size == 0:
            continue
        pos = _sequence_positions(row, grids[b], cfg, where=f"batch row {b}")
        positions[:, b, mask[b]] = pos
        deltas[b] = int(pos.max()) + 1 - row.size
    return positions, deltas


def get_rope_index_packed(
    tokens: np.ndarray,
    segment_ids: np.ndarray,
    image_grid_thw: np.ndarray | None,
    cfg: Qwen3VLConfig,
) -> tuple[np.ndarray, np.ndarray]:
    """M-RoPE ids for PACKED rows: each segment (k > 0) of a row is its own sequence starting at 0.

    tokens, segment_ids [B, T] (0 = padding; a segment's tokens need not be contiguous but are read in
    order); image_grid_thw [N, 3] for the images in row-major token order.
    Returns positions_3bt int32 [3, B, T] (0 at padding) and rope_deltas int32 [B, S] per segment
    (S = max segment id; 0 for absent segments).
    """
    tokens = np.asarray(tokens)
    seg = np.asarray(segment_ids)
    if tokens.shape != seg.shape or tokens.ndim != 2:
        raise ValueError(f"tokens {tokens.shape} and segment_ids {seg.shape} must both be [B, T]")
    if (seg < 0).any():
        raise ValueError("segment_ids must be >= 0 (0 = padding)")
    grid = _as_grid(image_grid_thw)
    n_seg = int(seg.max()) if seg.size else 0
    order: list[tuple[int, int]] = []
    seqs: list[np.ndarray] = []
    for b in range(tokens.shape[0]):
        # Segments are visited in order of first appearance, which is the token (row-major) order of their images.
        firsts = sorted((int(np.argmax(seg[b] == k)), k) for k in np.unique(seg[b]) if k > 0)
        for _, k in firsts:
            order.append((b, int(k)))
            seqs.append(tokens[b][seg[b] == k])
    grids = _split_grids(seqs, grid, cfg)
    positions = np.zeros((3,) + tokens.shape, np.int32)
    deltas = np.zeros((tokens.shape[0], n_seg), np.int32)
    for (b, k), ids, gr in zip(order, seqs, grids):
        pos = _sequence_positions(ids, gr, cfg, where=f"row {b} segment {k}")
        positions[:, b, seg[b] == k] = pos
        deltas[b, k - 1] = int(pos.max()) + 1 - ids.size
    return positions, deltas


def _merge_order_rows_cols(grid_thw: np.ndarray, merge: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(row, col, image_index) per patch [P], patches in the processor's merge-window order."""
    grid = _as_grid(grid_thw)
    rows, cols, owner = [], [], []
    for n, (t, h, w) in enumerate(grid.tolist()):
        if h % merge or w % merge:
            raise ValueError(f"image {n}: grid h={h}, w={w} must be multiples of spatial_merge_size={merge}")
        hh, ww = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
        block = (h // merge, merge, w // merge, merge)
        r = hh.reshape(block).transpose(0, 2, 1, 3).reshape(-1)
        c = ww.reshape(block).transpose(0, 2, 1, 3).reshape(-1)
        rows.append(np.tile(r, t))
        cols.append(np.tile(c, t))
        owner.append(np.full(t * h * w, n))
    if not rows:
        z = np.zeros((0,), np.int64)
        return z, z, z
    return np.concatenate(rows), np.concatenate(cols), np.concatenate(owner)


def vision_rotary_positions(grid_thw: np.ndarray, spatial_merge_size: int) -> np.ndarray:
    """(h, w) index of every patch, int32 [P, 2], in merge-window order, repeated for each of t frames."""
    r, c, _ = _merge_order_rows_cols(grid_thw, spatial_merge_size)
    return np.stack([r, c], axis=-1).astype(np.int32)


def _axis_taps(index: np.ndarray, size: np.ndarray, side: int) -> tuple[np.ndarray, np.ndarray]:
    """Bilinear, align_corners=True taps [P, 2] and weights [P, 2] (float32 like torch) on one axis."""
    src = index.astype(np.float32) * np.float32(side - 1) / np.maximum(size - 1, 1).astype(np.float32)
    floor = np.floor(src)
    offsets = np.arange(2)
    taps = np.clip(floor.astype(np.int64)[:, None] + offsets, 0, side - 1)
    distance = np.abs(src[:, None] - floor[:, None] - offsets.astype(np.float32))
    weights = np.clip(np.float32(1) - distance, 0, None).astype(np.float32)
    return taps, weights


def vision_pos_embed_interp(
    grid_thw: np.ndarray, num_position_embeddings: int, spatial_merge_size: int
) -> tuple[np.ndarray, np.ndarray]:
    """Bilinear resampling of the learned side x side position table to each image's grid.

    Returns idx int32 [P, 4] (flat rows of `pos_embed`) and weights float32 [P, 4]; the device
    computes sum_j w[p, j] * pos_embed[idx[p, j]]. Patch order = merge-window order.
    """
    side = int(round(num_position_embeddings**0.5))
    grid = _as_grid(grid_thw)
    r, c, owner = _merge_order_rows_cols(grid, spatial_merge_size)
    if r.size == 0:
        return np.zeros((0, 4), np.int32), np.zeros((0, 4), np.float32)
    heights = grid[owner, 1]
    widths = grid[owner, 2]
    ht, hw = _axis_taps(r, heights, side)
    wt, ww = _axis_taps(c, widths, side)
    idx = (ht[:, :, None] * side + wt[:, None, :]).reshape(-1, 4)
    weights = (hw[:, :, None] * ww[:, None, :]).reshape(-1, 4)
    return idx.astype(np.int32), weights.astype(np.float32)


def mrope_frequency_axis(cfg: Qwen3VLConfig) -> np.ndarray:
    """Which of (t, h, w) drives each rotary frequency, int32 [head_dim // 2] (interleaved layout).

    Frequency i uses h if i % 3 == 1 and i < 3 * sec_h, w if i % 3 == 2 and i < 3 * sec_w, else t.
    """
    sec = cfg.text.mrope_section
    half = cfg.text.head_dim // 2
    axis = np.zeros((half,), np.int32)
    i = np.arange(half)
    axis[(i % 3 == 1) & (i < 3 * sec[1])] = 1
    axis[(i % 3 == 2) & (i < 3 * sec[2])] = 2
    return axis


def rope_inv_freq(dim: int, theta: float) -> np.ndarray:
    """Standard RoPE inverse frequencies float32 [dim // 2], computed in float32 like transformers."""
    return (np.float32(1.0) / (np.float32(theta) ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)))).astype(
        np.float32
    )
