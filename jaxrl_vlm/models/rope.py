"""Host-side (numpy) position arithmetic for the Qwen-VL families.

Everything whose shape depends on the images (M-RoPE ids, vision rotary ids, bilinear
position-embedding taps) is computed here, so the device program only sees fixed-shape
integer/float arrays and gathers. The on-device rotation itself lives in `qwen3_vl.py`.

For images, Qwen2.5-VL's `get_rope_index` gives the same ids as Qwen3-VL's (each image starts at the text
position, text resumes max(h, w) // merge later). For clips they differ: Qwen3-VL and Qwen3.5 write a text
timestamp before every frame group, so each group is placed like a picture (`split_video_grids`); Qwen2.5-VL keeps
a clip whole and spaces its temporal index by tokens_per_second x seconds per grid (`VisualGrids`).

Reference semantics: transformers `Qwen3VLModel.get_rope_index` and `transformers.vision_utils`
(`get_vision_position_ids`, `get_vision_interpolation_indices_and_weights`, bilinear,
align_corners=True, patches in spatial-merge-window order).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from jaxrl_vlm.models.config import ModelConfig, Qwen25VLConfig


def _as_grid(image_grid_thw: np.ndarray | None, what: str = "image_grid_thw") -> np.ndarray:
    if image_grid_thw is None:
        return np.zeros((0, 3), np.int64)
    grid = np.asarray(image_grid_thw, dtype=np.int64).reshape(-1, 3)
    if (grid <= 0).any():
        raise ValueError(f"{what} entries must be positive, got {grid.tolist()}")
    return grid


@dataclass(frozen=True)
class VisualGrids:
    """The grids of one sequence's (or batch's) pictures and clips, each list in token order, as the text model
    sees them: `videos` [N, 3] of a family that writes timestamps between frame groups (Qwen3-VL, Qwen3.5) is
    already split into one (1, h, w) row per frame group (`split_video_grids`), and `video_time` [N] is the
    temporal position step of each row (Qwen2.5-VL's tokens_per_second x seconds per grid; 1 elsewhere)."""

    images: np.ndarray
    videos: np.ndarray
    video_time: np.ndarray

    @staticmethod
    def of(cfg: ModelConfig, image_grid_thw: np.ndarray | None, video_grid_thw: np.ndarray | None = None,
           second_per_grid_ts: np.ndarray | None = None) -> "VisualGrids":
        images = _as_grid(image_grid_thw)
        videos = _as_grid(video_grid_thw, "video_grid_thw")
        if second_per_grid_ts is not None and len(np.asarray(second_per_grid_ts).reshape(-1)) != len(videos):
            raise ValueError(f"second_per_grid_ts has {np.asarray(second_per_grid_ts).size} entries for "
                             f"{len(videos)} videos")
        if isinstance(cfg, Qwen25VLConfig):
            # transformers multiplies in float32 (tokens_per_second x the seconds tensor) and truncates per index.
            seconds = (np.ones(len(videos), np.float32) if second_per_grid_ts is None
                       else np.asarray(second_per_grid_ts, np.float32).reshape(-1))
            return VisualGrids(images, videos, np.float32(cfg.vision.tokens_per_second) * seconds)
        if second_per_grid_ts is not None:
            raise ValueError(f"second_per_grid_ts is Qwen2.5-VL's; {type(cfg).__name__} writes timestamps as text")
        videos = split_video_grids(videos)
        return VisualGrids(images, videos, np.ones(len(videos), np.float32))

    def rows(self, image_rows: slice, video_rows: slice) -> "VisualGrids":
        return VisualGrids(self.images[image_rows], self.videos[video_rows], self.video_time[video_rows])


def split_video_grids(video_grid_thw: np.ndarray) -> np.ndarray:
    """One (1, h, w) row per frame group of every clip: Qwen3-VL and Qwen3.5 write a timestamp before each frame
    group, so each is its own run of video tokens with its own positions (transformers' `get_rope_index`)."""
    grid = _as_grid(video_grid_thw, "video_grid_thw")
    out = np.repeat(grid, grid[:, 0], axis=0)
    out[:, 0] = 1
    return out


def _fit(tokens_at: np.ndarray, grid: np.ndarray, merge: int, kind: str, where: str) -> np.ndarray:
    """Index into `tokens_at` (the sequence's pad tokens of one kind) of each item's first token.

    Item k takes the next t * (h // merge) * (w // merge) pad tokens, so adjacent items may share one run of pads,
    but an item may not cross the end of a run; every pad must belong to an item."""
    m = tokens_at.size
    counts = grid[:, 0] * (grid[:, 1] // merge) * (grid[:, 2] // merge)
    ends = np.cumsum(counts)
    first = ends - counts
    run_ends = np.append(np.flatnonzero(tokens_at[1:] - tokens_at[:-1] != 1) + 1, m)
    room = run_ends[np.minimum(np.searchsorted(run_ends, first, side="right"), run_ends.size - 1)] - first
    bad = (first >= m) | (counts > room)
    if bad.any():
        k = int(np.argmax(bad))
        if first[k] >= m:
            raise ValueError(f"{where}: {len(grid)} {kind} grids given but only {k} {kind}s found in the tokens")
        t, h, w = grid[k].tolist()
        raise ValueError(
            f"{where}: {kind} {k} with grid (t={t}, h={h}, w={w}) needs {int(counts[k])} consecutive {kind} tokens, "
            f"found {int(room[k])} at token {int(tokens_at[first[k]])}"
        )
    if (ends[-1] if len(grid) else 0) < m:
        raise ValueError(f"{where}: more {kind}-token runs than {kind}_grid_thw rows ({len(grid)})")
    return first


def _sequence_positions(ids: np.ndarray, grids: VisualGrids | np.ndarray, cfg: ModelConfig, where: str) -> np.ndarray:
    """M-RoPE ids [3, L] for one unpadded sequence `ids` [L] whose pictures and clips use `grids` in order (an
    array: pictures only).

    Vectorized (the trainer runs this for every sample of every step). Each picture or clip (a frame group, for the
    families that split clips) starts at the text position; text continues at its start + max(h, w) // merge, as
    in transformers' `get_rope_index`; a clip's temporal index i sits at start + trunc(i x its time step).
    """
    if not isinstance(grids, VisualGrids):
        grids = VisualGrids(_as_grid(grids), np.zeros((0, 3), np.int64), np.zeros((0,), np.float32))
    merge = cfg.vision.spatial_merge_size
    is_image, is_video = ids == cfg.image_token_id, ids == cfg.video_token_id
    img, vid = np.flatnonzero(is_image), np.flatnonzero(is_video)
    first_img = img[_fit(img, grids.images, merge, "image", where)]
    first_vid = vid[_fit(vid, grids.videos, merge, "video", where)]
    n = ids.shape[0]
    vis = np.flatnonzero(is_image | is_video)  # token index of every picture or clip token
    m = vis.size
    if m == 0:
        return np.repeat(np.arange(n)[None], 3, axis=0)
    # Every item in token order (its tokens lie inside one run of its own kind, so they are consecutive in `vis`).
    grid = np.concatenate([grids.images, grids.videos])
    step = np.concatenate([np.ones(len(grids.images), np.float32), grids.video_time.astype(np.float32)])
    order = np.argsort(np.concatenate([first_img, first_vid]), kind="stable")
    grid, step = grid[order], step[order]
    lh, lw = grid[:, 1] // merge, grid[:, 2] // merge
    plane = lh * lw
    counts = grid[:, 0] * plane
    ends = np.cumsum(counts)
    first = ends - counts  # item k's first token, as an index into `vis`
    run_ends = np.append(np.flatnonzero(vis[1:] - vis[:-1] != 1) + 1, m)
    advance = np.maximum(grid[:, 1], grid[:, 2]) // merge
    advanced = np.concatenate([[0], np.cumsum(advance)])  # position shift after the first k items
    # Text token j sits at j - (vision tokens before j) + (advance of the items started before j). Both
    # terms are constant between the ends of vision runs: one np.repeat over the runs gives every token
    # its text position; vision tokens are overwritten below.
    shift = np.concatenate([[0], advanced[np.searchsorted(first, run_ends)] - run_ends])
    out = np.empty((3, n), np.int64)
    stretch = np.concatenate([[0], vis[run_ends - 1] + 1, [n]])  # text stretch r ends after vision run r
    out[:] = np.arange(n) + np.repeat(shift, stretch[1:] - stretch[:-1])
    origin = vis[first] - first + advanced[:-1]  # position of each item's (0, 0, 0) token
    owner = np.searchsorted(ends, np.arange(m), side="right")  # item of each vision token (skips empty grids)
    local = np.arange(m) - first[owner]
    base = origin[owner]
    frame = local // plane[owner]
    out[0, vis] = base + (frame.astype(np.float32) * step[owner]).astype(np.int64)
    out[1, vis] = base + local // lw[owner] % lh[owner]
    out[2, vis] = base + local % lw[owner]
    return out


def _split_grids(need: np.ndarray, grid: np.ndarray, cfg: ModelConfig, kind: str = "image") -> np.ndarray:
    """Grid-row bounds [S + 1]: sequence i (holding `need[i]` pad tokens of `kind`) uses rows bounds[i]:bounds[i + 1].

    Rows are taken in order until they hold the sequence's pad tokens (t*h*w / merge^2 each).
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
    what = f"{kind}_grid_thw"
    if bad.any():
        i = int(np.argmax(bad))
        if out_of_rows[i]:
            raise ValueError(
                f"sequence {i} has {int(need[i])} {kind} tokens but {what} ran out after {len(grid)} rows"
            )
        raise ValueError(
            f"sequence {i}: {int(need[i])} {kind} tokens do not match its grids' "
            f"{int(reached[i] - want[i] + need[i])} merged tokens"
        )
    bounds = np.concatenate([[0], np.maximum.accumulate(np.where(need > 0, last + 1, 0))]).astype(np.int64)
    if bounds[-1] != len(grid):
        raise ValueError(f"{what} has {len(grid)} rows but the tokens only use {int(bounds[-1])}")
    return bounds


def _split_visual(image_need: np.ndarray, video_need: np.ndarray, grids: VisualGrids,
                  cfg: ModelConfig) -> list[VisualGrids]:
    """Each sequence's own `VisualGrids`, from its counts of picture and clip tokens."""
    ib = _split_grids(image_need, grids.images, cfg, "image")
    vb = _split_grids(video_need, grids.videos, cfg, "video")
    return [grids.rows(slice(ib[i], ib[i + 1]), slice(vb[i], vb[i + 1])) for i in range(len(image_need))]


def get_rope_index(
    input_ids: np.ndarray,
    image_grid_thw: np.ndarray | None,
    attention_mask: np.ndarray | None,
    cfg: ModelConfig,
    *,
    video_grid_thw: np.ndarray | None = None,
    second_per_grid_ts: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """M-RoPE position ids, equal to transformers' `get_rope_index` of `cfg`'s family, pictures and clips.

    input_ids [B, T] int (image and video pads expanded); image_grid_thw [N, 3] / video_grid_thw [V, 3] for all
    pictures / clips of the batch in row-major order (as the processor gives them: one row per clip);
    second_per_grid_ts [V] (Qwen2.5-VL only); attention_mask [B, T] (1 = real token; any padding side).
    Returns positions_3bt int32 [3, B, T] (0 at padding) and rope_deltas int32 [B]
    (= max position + 1 - number of real tokens; decode positions continue at len + delta).
    """
    ids = np.asarray(input_ids)
    if ids.ndim != 2:
        raise ValueError(f"input_ids must be [B, T], got shape {ids.shape}")
    mask = np.ones_like(ids, dtype=bool) if attention_mask is None else np.asarray(attention_mask).astype(bool)
    if mask.shape != ids.shape:
        raise ValueError(f"attention_mask shape {mask.shape} != input_ids shape {ids.shape}")
    grids = VisualGrids.of(cfg, image_grid_thw, video_grid_thw, second_per_grid_ts)
    per_row = _split_visual(((ids == cfg.image_token_id) & mask).sum(1), ((ids == cfg.video_token_id) & mask).sum(1),
                            grids, cfg)
    positions = np.zeros((3,) + ids.shape, np.int32)
    deltas = np.zeros((ids.shape[0],), np.int32)
    for b in range(ids.shape[0]):
        row = ids[b][mask[b]]
        if row.size == 0:
            continue
        pos = _sequence_positions(row, per_row[b], cfg, where=f"batch row {b}")
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
    *,
    video_grid_thw: np.ndarray | None = None,
    second_per_grid_ts: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """M-RoPE ids for PACKED rows: each segment (k > 0) of a row is its own sequence starting at 0.

    tokens, segment_ids [B, T] (0 = padding; a segment's tokens need not be contiguous but are read in
    order); image_grid_thw [N, 3] / video_grid_thw [V, 3] (and second_per_grid_ts [V], Qwen2.5-VL) for the
    pictures / clips in row-major token order, as `get_rope_index` takes them.
    Returns positions_3bt int32 [3, B, T] (0 at padding) and rope_deltas int32 [B, S] per segment
    (S = max segment id; 0 for absent segments).
    """
    tokens = np.asarray(tokens)
    seg = np.asarray(segment_ids)
    if tokens.shape != seg.shape or tokens.ndim != 2:
        raise ValueError(f"tokens {tokens.shape} and segment_ids {seg.shape} must both be [B, T]")
    if (seg < 0).any():
        raise ValueError("segment_ids must be >= 0 (0 = padding)")
    grids = VisualGrids.of(cfg, image_grid_thw, video_grid_thw, second_per_grid_ts)
    n_seg = int(seg.max()) if seg.size else 0
    # Segments are read in order of first appearance, which is the token (row-major) order of their images.
    gather, bounds, rows, ks = _segment_gather(seg)
    stream = tokens.reshape(-1)[gather]
    images_before = np.concatenate([[0], np.cumsum(stream == cfg.image_token_id)])
    videos_before = np.concatenate([[0], np.cumsum(stream == cfg.video_token_id)])
    per_segment = _split_visual(images_before[bounds[1:]] - images_before[bounds[:-1]],
                                videos_before[bounds[1:]] - videos_before[bounds[:-1]], grids, cfg)
    stream_pos = np.empty((3, stream.size), np.int32)
    for i, (b, k) in enumerate(zip(rows.tolist(), ks.tolist())):
        lo, hi = bounds[i], bounds[i + 1]
        stream_pos[:, lo:hi] = _sequence_positions(stream[lo:hi], per_segment[i], cfg, where=f"row {b} segment {k}")
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
