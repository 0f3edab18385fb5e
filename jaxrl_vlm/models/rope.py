"""Host-side (numpy) position arithmetic for the Qwen-VL families.

Everything whose shape depends on the images (M-RoPE ids, vision rotary ids, bilinear
position-embedding taps) is computed here, so the device program only sees fixed-shape
integer/float arrays and gathers. The on-device rotation itself lives in `qwen3_vl.py`.

For images, Qwen2.5-VL's `get_rope_index` gives the same ids as Qwen3-VL's (each image starts at the text
position, text resumes max(h, w) // merge later); the families differ only for video, which is refused.

Reference semantics: transformers `Qwen3VLModel.get_rope_index` and `transformers.vision_utils`
(`get_vision_position_ids`, `get_vision_interpolation_indices_and_weights`, bilinear,
align_corners=True, patches in spatial-merge-window order).
"""

from __future__ import annotations

import numpy as np

from jaxrl_vlm.models.config import ModelConfig


def _as_grid(image_grid_thw: np.ndarray | None) -> np.ndarray:
    if image_grid_thw is None:
        return np.zeros((0, 3), np.int64)
    grid = np.asarray(image_grid_thw, dtype=np.int64).reshape(-1, 3)
    if (grid <= 0).any():
        raise ValueError(f"image_grid_thw entries must be positive, got {grid.tolist()}")
    return grid


def _sequence_positions(ids: np.ndarray, grid: np.ndarray, cfg: ModelConfig, where: str) -> np.ndarray:
    """M-RoPE ids [3, L] for one unpadded sequence `ids` [L] whose images use the rows of `grid` [N, 3] in order.

    Vectorized (the trainer runs this for every sample of every step): image k takes the next
    t * (h // merge) * (w // merge) image tokens, so adjacent images may share one run of image tokens,
    but an image may not cross the end of a run. Text continues at the previous image's start
    position + max(h, w) // merge, as in transformers' `get_rope_index`.
    """
    if (ids == cfg.video_token_id).any():
        raise ValueError(f"{where}: video tokens (id {cfg.video_token_id}) are not supported")
    merge = cfg.vision.spatial_merge_size
    is_image = ids == cfg.image_token_id
    img = np.flatnonzero(is_image)  # token index of every image token
    m = img.size
    lh, lw = grid[:, 1] // merge, grid[:, 2] // merge
    plane = lh * lw
    counts = grid[:, 0] * plane
    ends = np.cumsum(counts)
    first = ends - counts  # image k's first token, as an index into `img`
    # Images are laid out in order: image k fits iff its tokens stay inside the run holding its first one.
    run_ends = np.append(np.flatnonzero(img[1:] - img[:-1] != 1) + 1, m)
    room = run_ends[np.minimum(np.searchsorted(run_ends, first, side="right"), run_ends.size - 1)] - first
    bad = (first >= m) | (counts > room)
    if bad.any():
        k = int(np.argmax(bad))
        if first[k] >= m:
            raise ValueError(f"{where}: {len(grid)} image grids given but only {k} images found in the tokens")
        t, h, w = grid[k].tolist()
        raise ValueError(
            f"{where}: image {k} with grid (t={t}, h={h}, w={w}) needs {int(counts[k])} consecutive image tokens, "
            f"found {int(room[k])} at token {int(img[first[k]])}"
        )
    if (ends[-1] if len(grid) else 0) < m:
        raise ValueError(f"{where}: more image-token runs than image_grid_thw rows ({len(grid)})")

    n = ids.shape[0]
    if m == 0:
        return np.repeat(np.arange(n)[None], 3, axis=0)
    advance = np.maximum(grid[:, 1], grid[:, 2]) // merge
    advanced = np.concatenate([[0], np.cumsum(advance)])  # position shift after the first k images
    # Text token j sits at j - (image tokens before j) + (advance of the images started before j). Both
    # terms are constant between the ends of image runs: one np.repeat over the runs gives every token
    # its text position; image tokens are overwritten below.
    shift = np.concatenate([[0], advanced[np.searchsorted(first, run_ends)] - run_ends])
    out = np.empty((3, n), np.int64)
    stretch = np.concatenate([[0], img[run_ends - 1] + 1, [n]])  # text stretch r ends after image run r
    out[:] = np.arange(n) + np.repeat(shift, stretch[1:] - stretch[:-1])
    origin = img[first] - first + advanced[:-1]  # position of each image's (0, 0, 0) token
    owner = np.searchsorted(ends, np.arange(m), side="right")  # image of each image token (skips empty grids)
    local = np.arange(m) - first[owner]
    base = origin[owner]
    out[0, img] = base + local // plane[owner]
    out[1, img] = base + local // lw[owner] % lh[owner]
    out[2, img] = base + local % lw[owner]
    return out


def _split_grids(need: np.ndarray, grid: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    """Grid-row bounds [S + 1]: sequence i (holding `need[i]` image tokens) uses rows bounds[i]:bounds[i + 1].

    Rows are taken in order until they hold the sequence's image tokens (t*h*w / merge^2 each).
    Vectorized with running totals: while every earlier sequence matched exactly, sequence i's last
    row is the first whose running total reaches sum(need[:i + 1]).
    """
    sizes = grid.prod(-1) // cfg.vision.merge_unit if len(grid) else np.zeros((0,), np.int64)
    have = np.cumsum(sizes)
    want = np.cumsum(need)
    last = np.searchsorted(have, want, side="left")
    reached = np.append(have, -1)[last]
    out_of_rows = (need > 0) & (last >= len(grid))
    bad = (need > 0) & (out_of_rows | (reached != want))
    if bad.any():
        i = int(np.argmax(bad))
        if out_of_rows[i]:
            raise ValueError(
                f"sequence {i} has {int(need[i])} image tokens but image_grid_thw ran out after {len(grid)} rows"
            )
        raise ValueError(
            f"sequence {i}: {int(need[i])} image tokens do not match its grids' "
            f"{int(reached[i] - want[i] + need[i])} merged tokens"
        )
    bounds = np.concatenate([[0], np.maximum.accumulate(np.where(need > 0, last + 1, 0))]).astype(np.int64)
    if bounds[-1] != len(grid):
        raise ValueError(f"image_grid_thw has {len(grid)} rows but the tokens only use {int(bounds[-1])}")
    return bounds


def get_rope_index(
    input_ids: np.ndarray,
    image_grid_thw: np.ndarray | None,
    attention_mask: np.ndarray | None,
    cfg: ModelConfig,
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
    bounds = _split_grids(((ids == cfg.image_token_id) & mask).sum(1), grid, cfg)
    positions = np.zeros((3,) + ids.shape, np.int32)
    deltas = np.zeros((ids.shape[0],), np.int32)
    for b in range(ids.shape[0]):
        row = ids[b][mask[b]]
        if row.size == 0:
            continue
        pos = _sequence_positions(row, grid[bounds[b] : bounds[b + 1]], cfg, where=f"batch row {b}")
        positions[:, b, mask[b]] = pos
        deltas[b] = int(pos.max()) + 1 - row.size
    return positions, deltas


def _segment_gather(seg: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Read order of the segments of a packed [B, T] batch, from its runs of equal segment id.

    Returns `gather` [N] (flat token indices: each (row, segment) in order of first appearance, its
    tokens in order), `bounds` [S + 1] (segment i is gather[bounds[i]:bounds[i + 1]]) and the row and
    id [S] of each segment. Python work is O(1); numpy work is O(B * T) plus a sort of the runs.
    """
    flat = seg.reshape(-1)
    empty = np.zeros((0,), np.int64)
    if flat.size == 0:
        return empty, np.zeros((1,), np.int64), empty, empty
    cut = np.ones(flat.size, bool)
    cut[1:] = flat[1:] != flat[:-1]
    cut[:: seg.shape[1]] = True  # a run never continues into the next row
    starts = np.flatnonzero(cut)
    stops = np.append(starts[1:], flat.size)
    real = flat[starts] > 0
    starts, stops = starts[real], stops[real]
    width = int(flat.max()) + 1
    key = starts // seg.shape[1] * width + flat[starts]
    keys, first_run, run_key = np.unique(key, return_index=True, return_inverse=True)
    by_first = np.argsort(first_run)  # runs are in row-major order, so this is first-appearance order
    rank = np.empty_like(by_first)
    rank[by_first] = np.arange(by_first.size)
    run_rank = rank[run_key.reshape(-1)]
    order = np.argsort(run_rank, kind="stable")
    lengths = (stops - starts)[order]
    done = np.concatenate([[0], np.cumsum(lengths)])
    gather = np.repeat(starts[order] - done[:-1], lengths) + np.arange(done[-1])
    bounds = done[np.append(np.searchsorted(run_rank[order], np.arange(keys.size)), order.size)]
    return gather, bounds, keys[by_first] // width, keys[by_first] % width


def get_rope_index_packed(
    tokens: np.ndarray,
    segment_ids: np.ndarray,
    image_grid_thw: np.ndarray | None,
    cfg: ModelConfig,
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
    # Segments are read in order of first appearance, which is the token (row-major) order of their images.
    gather, bounds, rows, ks = _segment_gather(seg)
    stream = tokens.reshape(-1)[gather]
    images_before = np.concatenate([[0], np.cumsum(stream == cfg.image_token_id)])
    grid_bounds = _split_grids(images_before[bounds[1:]] - images_before[bounds[:-1]], grid, cfg)
    stream_pos = np.empty((3, stream.size), np.int32)
    for i, (b, k) in enumerate(zip(rows.tolist(), ks.tolist())):
        lo, hi = bounds[i], bounds[i + 1]
        stream_pos[:, lo:hi] = _sequence_positions(
            stream[lo:hi], grid[grid_bounds[i] : grid_bounds[i + 1]], cfg, where=f"row {b} segment {k}"
        )
    positions = np.zeros((3,) + tokens.shape, np.int32)
    for axis in range(3):  # one 1-D scatter per axis: numpy's fast path, unlike a [:, gather] scatter
        positions[axis].reshape(-1)[gather] = stream_pos[axis]
    deltas = np.zeros((tokens.shape[0], n_seg), np.int32)
    if rows.size:
        deltas[rows, ks - 1] = np.maximum.reduceat(stream_pos.max(0), bounds[:-1]) + 1 - np.diff(bounds)
    return positions, deltas


def _merge_order_rows_cols(grid_thw: np.ndarray, merge: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(row, col, image_index) per patch [P], patches in the processor's merge-window order.

    Vectorized over all patches of all images (no per-image loop): within a frame, patch q lies in
    merge window q // merge^2 (windows row-major, w // merge per row) at offset q % merge^2 (row-major).
    """
    grid = _as_grid(grid_thw)
    h, w = grid[:, 1], grid[:, 2]
    uneven = (h % merge != 0) | (w % merge != 0)
    if uneven.any():
        n = int(np.argmax(uneven))
        raise ValueError(f"image {n}: grid h={h[n]}, w={w[n]} must be multiples of spatial_merge_size={merge}")
    frame = h * w
    sizes = grid[:, 0] * frame
    owner = np.repeat(np.arange(len(grid)), sizes)
    local = np.arange(int(sizes.sum())) - np.repeat(np.cumsum(sizes) - sizes, sizes)
    window, offset = np.divmod(local % frame[owner], merge * merge)
    window_row, window_col = np.divmod(window, (w // merge)[owner])
    offset_row, offset_col = np.divmod(offset, merge)
    return window_row * merge + offset_row, window_col * merge + offset_col, owner


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


def mrope_frequency_axis(cfg: ModelConfig) -> np.ndarray:
    """Which of (t, h, w) drives each rotary frequency, int32 [head_dim // 2].

    Interleaved (Qwen3-VL): frequency i uses h if i % 3 == 1 and i < 3 * sec_h, w if i % 3 == 2 and
    i < 3 * sec_w, else t. Contiguous (Qwen2.5-VL): the first sec_t frequencies use t, the next sec_h h,
    the last sec_w w.
    """
    sec = cfg.text.mrope_section
    half = cfg.text.head_dim // 2
    if not cfg.text.mrope_interleaved:
        return np.repeat(np.arange(3, dtype=np.int32), sec)
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
