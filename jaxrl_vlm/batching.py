"""list[Sample] -> TrainBatch: fixed-shape, bucketed, optionally packed training arrays (host, numpy only).

The train step `lax.scan`s over a leading micro-batch axis K, so every array here is [K, ...] and its
shape comes from configured buckets: a run compiles one program per distinct `(K, R, T, P)`.

Layout and alignment (per micro-batch k, row r, slot t; T = padded row length in tokens):
- `tokens[k, r, t]` is an INPUT token; `targets[k, r, t]` is the next token of the same sequence (0 at a
  sequence's last slot and on padding). Everything the loss reads (`loss_mask`, `rollout_logprobs`,
  `advantages`, `token_weights`, `sequence_ids`) is aligned to targets: slot t holds the values of token
  t+1, so `logprobs[k, r, t] = log p(targets[k, r, t] | tokens[k, r, :t+1])` lines up with them directly.
- `segment_ids` (0 = padding, 1.. = sequences in the row, in slot order) drive segment-aware attention;
  `positions` are Qwen3-VL M-RoPE ids restarting at 0 in each segment (`get_rope_index_packed`).
- `sequence_ids` number the sequences of ONE micro-batch 0..n_k-1 (-1 on padding); `token_weights`
  come from `aggregation_weights` over the GLOBAL batch, so summing the per-micro-batch losses gives
  the full-batch loss whatever the split.
- Vision: each micro-batch concatenates its images' patches in row-major token order, then its clips'
  (`pixel_values_videos`, `video_grid_thw`, Qwen2.5-VL's `second_per_grid_ts`), padded to the patch bucket P;
  `image_token_index` points into that micro-batch's flat R*T slots (R*T = dropped). A clip counts its patches
  like a picture, is never cut by truncation, and its positions follow the family (`models.rope`).
- Vision reuse (`vision_reuse=True`, the trainer's default): an image is identified by a hash of its processed
  patches and grid; a micro-batch holds each DISTINCT image once (first-seen order, padded to P, which now bounds
  distinct patches) and `vision.token_image_rows [K, R, T]` maps every image-pad slot to its image's merged row,
  so the tower runs once per distinct image and the train step gathers (`models.vision.build_reused_vision_inputs`).
  Clips are identified the same way (a GRPO group's prompt clip is encoded once).
  Packing counts a micro-batch's patches as distinct patches and places rows where their images already are.

A sequence never spans rows or micro-batches. Packing is best-fit decreasing (tokens, with patch
capacity as a second constraint); rows go to micro-batches largest-patch-load first onto the least
loaded micro-batch, so the patch bucket (vision cost) stays small and stable. The row length T is the
feasible seq bucket that needs the fewest slots (ties: the shorter one); K follows
`micro_batch_bucket` unless explicit buckets are given.
"""

from __future__ import annotations

import hashlib
import math
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from jaxrl_vlm.models.config import ModelConfig, Qwen25VLConfig
from jaxrl_vlm.models.rope import get_rope_index_packed
from jaxrl_vlm.models.vision import build_reused_vision_inputs, build_vision_inputs
from jaxrl_vlm.rl.aggregation import aggregation_weights
from rollout.sample import Sample

OVERLONG_POLICIES = ("error", "truncate")


class BatchingError(ValueError):
    """A sample or a bucket configuration cannot be laid out; the message names the sample or option."""


# ----------------------------------------------------------------------------- containers


class TrainArrays(NamedTuple):
    """The device pytree. K micro-batches, R rows, T slots per row, P patches per micro-batch.

    tokens            int32   [K, R, T]     input token ids (0 on padding)
    targets           int32   [K, R, T]     next token of the same sequence; 0 at a sequence's last slot / padding
    positions         int32   [K, 3, R, T]  M-RoPE (t, h, w) ids, each segment from 0
    segment_ids       int32   [K, R, T]     0 = padding, 1.. = sequence within the row
    loss_mask         float32 [K, R, T]     1 where target is a model-generated token (aligned to targets)
    rollout_logprobs  float32 [K, R, T]     engine log-prob of the target token (nats; 0 where mask is 0)
    advantages        float32 [K, R, T]     the sample's advantage on every response target, else 0
    token_weights     float32 [K, R, T]     global aggregation weight; sums to 1 over the batch (mean modes)
    sequence_ids      int32   [K, R, T]     sequence index within the micro-batch, -1 on padding
    vision            VisionInputs (WindowedVisionInputs for Qwen2.5-VL) with leading K (P patches each), or None
                      when no sample has images
    routed_experts    int32   [K, R, T, L_sparse, k] MoE routing replay: the engine's top-k experts of INPUT token
                      t in each sparse layer (aligned to `tokens`, not targets); -1 where none was recorded (the
                      trainer routes that token itself) and on padding. None without --use-rollout-routing-replay.
    teacher_logprobs  float32 [K, R, T]     on-policy distillation: the teacher's log-prob of the target token
                      (aligned to targets, 0 where mask is 0). None without --use-opd.
    privileged_hidden float   [K, R, T, D]  --opd-type self: the privileged teacher's hidden state at the slot of its
                      own batch that predicts the same target (jaxrl_vlm/privileged.py); set by the trainer on the
                      device batch, None otherwise.
    privileged_valid  float32 [K, R, T]     --opd-type self: 1 where that slot exists for a loss-mask target.
    """

    tokens: np.ndarray
    targets: np.ndarray
    positions: np.ndarray
    segment_ids: np.ndarray
    loss_mask: np.ndarray
    rollout_logprobs: np.ndarray
    advantages: np.ndarray
    token_weights: np.ndarray
    sequence_ids: np.ndarray
    vision: Any  # the family's vision inputs (models/vision.py: VisionInputs, WindowedVisionInputs, ...) or None
    routed_experts: np.ndarray | None = None
    teacher_logprobs: np.ndarray | None = None
    privileged_hidden: Any = None
    privileged_valid: Any = None


class Placement(NamedTuple):
    """Where one input sample landed (host bookkeeping). `length` < `original_length` iff truncated."""

    sample_position: int  # index in the input list
    group_index: int
    index: int
    micro_batch: int
    row: int
    offset: int  # first slot of the sequence in its row
    length: int  # tokens placed
    original_length: int  # tokens in the sample
    segment_id: int  # 1.. within the row
    sequence_id: int  # 0.. within the micro-batch
    patch_offset: int  # first patch row of its images in the micro-batch's pixel_values (without vision reuse)
    num_patches: int  # patch rows placed (its own images, before deduplication)


@dataclass(frozen=True)
class BatchLayout:
    """Host-side facts about a TrainBatch (never sent to the device)."""

    placements: tuple[Placement, ...]  # in input order
    shape_key: tuple[int, int, int, int]  # (K, R, T, P); P = 0 without vision
    real_tokens: int
    slots: int  # K * R * T
    real_patches: int  # patches the tower encodes (distinct images per micro-batch with vision reuse)
    patch_slots: int  # K * P
    rows_used: int  # rows holding at least one sequence
    sequences_per_micro_batch: tuple[int, ...]  # [K]
    packing: bool
    images: int = 0  # image occurrences of the samples placed
    distinct_images: int = 0  # images the tower encodes: distinct per micro-batch with vision reuse, else = images
    clips: int = 0  # clip occurrences of the samples placed
    distinct_clips: int = 0  # clips the tower encodes (as distinct_images)

    @property
    def padding_efficiency(self) -> float:
        """Real tokens / token slots (1.0 = no padding)."""
        return self.real_tokens / self.slots if self.slots else 0.0

    @property
    def patch_efficiency(self) -> float:
        """Real patches / patch slots (1.0 when there is no vision input)."""
        return self.real_patches / self.patch_slots if self.patch_slots else 1.0

    @property
    def max_sequences_per_micro_batch(self) -> int:
        """Upper bound for `LossConfig.num_sequences` (gspo's segment sums) for this batch."""
        return max(self.sequences_per_micro_batch)

    @property
    def truncated(self) -> tuple[Placement, ...]:
        return tuple(p for p in self.placements if p.length < p.original_length)


@dataclass(frozen=True)
class TrainBatch:
    """`arrays` goes to the device (`jax.device_put(batch.arrays, ...)`); `layout` stays on the host."""

    arrays: TrainArrays
    layout: BatchLayout

    @property
    def shape_key(self) -> tuple[int, int, int, int]:
        return self.layout.shape_key


def describe_shapes(batches: Iterable[TrainBatch]) -> Counter[tuple[int, int, int, int]]:
    """How many batches had each (K, R, T, P) shape; len() of it is the number of compiled programs."""
    return Counter(b.shape_key for b in batches)


# ----------------------------------------------------------------------------- buckets


def micro_batch_bucket(n: int) -> int:
    """Default K bucket: the smallest m * 2**e >= n with m in 8..15 (exact up to 16).

    1..16, 18, 20, ..., 32, 36, 40, ...: eight sizes per octave, so padding micro-batches cost at
    most 1/9 of the slots (powers of two would cost up to 1/2), while a run whose token count per
    step drifts by a few percent still lands on one or two values of K.
    """
    if n < 1:
        raise BatchingError(f"need at least one micro-batch, got {n}")
    if n <= 16:
        return n
    step = 2 ** ((n - 1).bit_length() - 4)  # n in (8 * step, 16 * step]
    return math.ceil(n / step) * step


def _smallest_at_least(buckets: Sequence[int], n: int) -> int | None:
    for b in buckets:
        if b >= n:
            return int(b)
    return None


def _check_buckets(name: str, buckets: Sequence[int], minimum: int) -> list[int]:
    values = [int(b) for b in buckets]
    if not values or values != sorted(set(values)) or values[0] < minimum:
        raise BatchingError(f"{name} must be a non-empty strictly increasing list of ints >= {minimum}, got {list(buckets)}")
    return values


# ----------------------------------------------------------------------------- per-sample preparation


@dataclass
class _Seq:
    """One sample as flat numpy arrays (after truncation). Per-token arrays are NOT shifted: [L]."""

    position: int
    sample: Sample
    tokens: np.ndarray  # int32 [L]
    mask: np.ndarray  # float32 [L]: 0 on prompt, loss_mask on response
    logprobs: np.ndarray  # float32 [L]
    response: np.ndarray  # bool [L]: token belongs to the response
    grid: np.ndarray  # int64 [n_images, 3]
    pixels: np.ndarray | None  # [patches, patch_dim]
    original_length: int
    image_ids: tuple[int, ...] = ()  # vision reuse: distinct-image id of each of its images (batch-wide)
    clips: "_Clips" = field(default_factory=lambda: _Clips.none())

    @property
    def length(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def num_patches(self) -> int:
        """Patches of its pictures and clips: what the sample alone costs the tower."""
        return (0 if self.pixels is None else int(self.pixels.shape[0])) + self.clips.num_patches


@dataclass
class _Clips:
    """A sample's clips (video observations), in token order: `video_grid_thw` rows, `pixel_values_videos`, and
    Qwen2.5-VL's `second_per_grid_ts` (None for the families that write timestamps as text)."""

    grid: np.ndarray  # int64 [n_clips, 3]
    pixels: np.ndarray | None  # [patches, patch_dim]
    seconds: np.ndarray | None  # float32 [n_clips]
    ids: tuple[int, ...] = ()  # vision reuse: distinct-clip id of each clip (batch-wide, beside the image ids)

    @staticmethod
    def none() -> "_Clips":
        return _Clips(np.zeros((0, 3), np.int64), None, None)

    @property
    def num_patches(self) -> int:
        return 0 if self.pixels is None else int(self.pixels.shape[0])

    def take(self, n: int) -> "_Clips":
        """The first n clips (a truncated sample keeps the clips before its cut)."""
        kept = int(self.grid[:n].prod(-1).sum()) if n else 0
        return _Clips(self.grid[:n], self.pixels[:kept] if n and self.pixels is not None else None,
                      None if self.seconds is None else self.seconds[:n])

    def patches_of(self, j: int) -> np.ndarray:
        sizes = self.grid.prod(-1)
        start = int(sizes[:j].sum())
        return self.pixels[start : start + int(sizes[j])]


def _prepare(position: int, sample: Sample, cfg: ModelConfig, max_len: int, overlong_policy: str) -> _Seq:
    """Validate one sample (vectorized, O(L)) and cut it to `max_len` tokens if the policy allows."""
    where = f"{sample.name} (position {position} in the batch)"
    tokens = np.asarray(sample.tokens, dtype=np.int64).reshape(-1)
    n = tokens.shape[0]
    resp = int(sample.response_length)
    if n == 0:
        raise BatchingError(f"{where} has no tokens")
    if not 0 <= resp <= n:
        raise BatchingError(f"{where}: response_length {resp} outside [0, {n}]")
    if resp == n and resp > 0:
        raise BatchingError(f"{where} has no prompt token: its first response token has no context to be predicted from")
    if (tokens < 0).any() or (tokens >= cfg.text.vocab_size).any():
        bad = int(tokens[(tokens < 0) | (tokens >= cfg.text.vocab_size)][0])
        raise BatchingError(f"{where}: token id {bad} outside the vocabulary [0, {cfg.text.vocab_size})")
    loss_mask = np.asarray(sample.loss_mask, dtype=np.float64).reshape(-1)
    logprobs = np.asarray(sample.rollout_log_probs, dtype=np.float64).reshape(-1)
    if loss_mask.shape[0] != resp or logprobs.shape[0] != resp:
        raise BatchingError(
            f"{where}: loss_mask has {loss_mask.shape[0]} and rollout_log_probs {logprobs.shape[0]} entries, "
            f"response_length is {resp}"
        )
    if not np.isin(loss_mask, (0.0, 1.0)).all():
        raise BatchingError(f"{where}: loss_mask must be 0/1")
    if not np.isfinite(logprobs).all():
        raise BatchingError(f"{where}: rollout_log_probs has non-finite values")

    grid, pixels = _sample_images(sample, tokens, cfg, where)
    clips = _sample_clips(sample, tokens, cfg, where)

    mask = np.zeros(n, np.float32)
    # slime's remove_sample (a --rollout-sample-filter-path verdict): the sample trains no token.
    mask[n - resp :] = 0.0 if sample.remove_sample else loss_mask
    lp = np.zeros(n, np.float32)
    lp[n - resp :] = logprobs
    response = np.zeros(n, bool)
    response[n - resp :] = True

    if n > max_len:
        if overlong_policy == "error":
            raise BatchingError(
                f"{where} has {n} tokens (prompt {n - resp}, response {resp}), more than the largest seq bucket "
                f"{max_len}; add a larger bucket to seq_buckets or set overlong_policy='truncate'"
            )
        cut, n_images, n_clips = _truncation_cut(tokens, grid, clips.grid, max_len, cfg, where)
        tokens, mask, lp, response = tokens[:cut], mask[:cut], lp[:cut], response[:cut]
        grid = grid[:n_images]
        if pixels is not None:
            kept = int(grid.prod(-1).sum())
            pixels = pixels[:kept] if n_images else None
        clips = clips.take(n_clips)
    return _Seq(position, sample, tokens.astype(np.int32), mask, lp, response, grid, pixels, n, clips=clips)


def teacher_row(seq: _Seq) -> np.ndarray:
    """float32 [length]: the sample's `teacher_log_probs` on its (possibly truncated) response tokens, 0 elsewhere
    (not shifted, like `_Seq.logprobs`)."""
    sample = seq.sample
    where = f"{sample.name} (position {seq.position} in the batch)"
    if sample.teacher_log_probs is None:
        raise BatchingError(f"{where} has no teacher_log_probs: with --use-opd a teacher scores every episode "
                            "(rollout/teacher.py); saved rollouts replayed with --use-opd must have been saved with it")
    resp = int(sample.response_length)
    teacher = np.asarray(sample.teacher_log_probs, np.float64).reshape(-1)
    if teacher.shape[0] != resp or not np.isfinite(teacher).all():
        raise BatchingError(f"{where}: teacher_log_probs must be {resp} finite values (one per response token), got "
                            f"{teacher.shape[0]}" + ("" if np.isfinite(teacher).all() else " with non-finite ones"))
    full = np.zeros(seq.original_length, np.float32)
    full[seq.original_length - resp :] = teacher
    return full[: seq.length]


def replay_ids(seq: _Seq, cfg: ModelConfig) -> np.ndarray:
    """int32 [length, L_sparse, k]: the engine's expert ids of each (possibly truncated) input token of `seq` in
    the model's sparse layers, -1 past the recorded positions (the last token; an episode's trailing observation
    that no request forwarded). The sample's array is SGLang's ids, [positions, num_hidden_layers * k]."""
    t = cfg.text
    sparse = list(getattr(t, "sparse_layers", ()))
    where = f"{seq.sample.name} (position {seq.position} in the batch)"
    if not sparse:
        raise BatchingError(f"routing replay needs a mixture-of-experts model; {type(cfg).__name__} has no sparse layer")
    routed = seq.sample.rollout_routed_experts
    if routed is None:
        raise BatchingError(f"{where} has no rollout_routed_experts: with --use-rollout-routing-replay the engine must "
                            "return them (its request sends return_routed_experts)")
    routed = np.asarray(routed)
    expected = (t.num_hidden_layers, t.num_experts_per_tok)
    if routed.ndim != 2 or routed.shape[1] != expected[0] * expected[1]:
        raise BatchingError(f"{where}: rollout_routed_experts has shape {routed.shape}, expected [positions, "
                            f"{expected[0]} layers x {expected[1]} experts per token]")
    picked = routed[: seq.length].reshape(-1, *expected)[:, sparse].astype(np.int32)
    if picked.size and (picked.max() >= t.num_experts or picked.min() < 0):
        raise BatchingError(f"{where}: rollout_routed_experts holds an expert id outside [0, {t.num_experts}) in a "
                            "sparse layer")
    out = np.full((seq.length, len(sparse), expected[1]), -1, np.int32)
    out[: picked.shape[0]] = picked
    return out


def _checked_inputs(sample: Sample, tokens: np.ndarray, cfg: ModelConfig, where: str, pad: int, grid_key: str,
                    pixels_key: str, kind: str) -> tuple[np.ndarray, np.ndarray | None]:
    """(grid [N, 3], patches [P, patch_dim] or None) of the sample's pictures or clips (`kind`: "image" or "video",
    read from `multimodal_train_inputs[grid_key / pixels_key]`), checked against its `pad` tokens."""
    mm = sample.multimodal_train_inputs or {}
    n_pads = int((tokens == pad).sum())
    grid_raw, pixels = mm.get(grid_key), mm.get(pixels_key)
    if grid_raw is None and pixels is None:
        if n_pads:
            raise BatchingError(
                f"{where} has {n_pads} {kind}-pad tokens but no multimodal_train_inputs ({pixels_key}, {grid_key})"
            )
        return np.zeros((0, 3), np.int64), None
    if grid_raw is None or pixels is None:
        missing = grid_key if grid_raw is None else pixels_key
        raise BatchingError(f"{where}: multimodal_train_inputs has no {missing!r}")
    grid = np.asarray(grid_raw, dtype=np.int64)
    if grid.ndim != 2 or grid.shape[1] != 3 or (grid <= 0).any():
        raise BatchingError(f"{where}: {grid_key} must be [{kind}s, 3] of positive ints, got {grid.tolist()}")
    merge = cfg.vision.spatial_merge_size
    if (grid[:, 1] % merge).any() or (grid[:, 2] % merge).any():
        raise BatchingError(f"{where}: {grid_key} {grid.tolist()} has h or w not a multiple of spatial_merge_size={merge}")
    patches = int(grid.prod(-1).sum())
    if patches // cfg.vision.merge_unit != n_pads:
        raise BatchingError(
            f"{where}: {n_pads} {kind}-pad tokens (id {pad}) but {grid_key} {grid.tolist()} "
            f"gives {patches // cfg.vision.merge_unit} merged tokens"
        )
    pixels = np.asarray(pixels)
    if pixels.ndim != 2 or pixels.shape != (patches, cfg.vision.patch_dim):
        raise BatchingError(
            f"{where}: {pixels_key} shape {pixels.shape} != ({patches}, {cfg.vision.patch_dim}) "
            f"(patches of {grid_key}, C*T*p*p)"
        )
    if len(grid) == 0:
        return grid, None
    return grid, pixels


def _sample_images(sample: Sample, tokens: np.ndarray, cfg: ModelConfig, where: str) -> tuple[np.ndarray, np.ndarray | None]:
    """(image_grid_thw [N, 3], pixel_values [patches, patch_dim] or None), checked against the image pads."""
    return _checked_inputs(sample, tokens, cfg, where, cfg.image_token_id, "image_grid_thw", "pixel_values", "image")


def _sample_clips(sample: Sample, tokens: np.ndarray, cfg: ModelConfig, where: str) -> _Clips:
    """The sample's clips (`pixel_values_videos`, `video_grid_thw`, Qwen2.5-VL's `second_per_grid_ts`), checked
    against its video pads."""
    grid, pixels = _checked_inputs(sample, tokens, cfg, where, cfg.video_token_id, "video_grid_thw",
                                   "pixel_values_videos", "video")
    seconds = (sample.multimodal_train_inputs or {}).get("second_per_grid_ts")
    qwen25 = isinstance(cfg, Qwen25VLConfig)
    if seconds is not None:
        if not len(grid):
            raise BatchingError(f"{where}: multimodal_train_inputs has second_per_grid_ts but no clips")
        if not qwen25:
            raise BatchingError(f"{where}: second_per_grid_ts is Qwen2.5-VL's; {type(cfg).__name__} writes a clip's "
                                "timestamps as text")
        seconds = np.asarray(seconds, np.float32).reshape(-1)
        if seconds.shape != (len(grid),) or not (np.isfinite(seconds) & (seconds > 0)).all():
            raise BatchingError(f"{where}: second_per_grid_ts must be {len(grid)} positive numbers (one per clip), "
                                f"got {seconds.tolist()}")
    elif qwen25 and len(grid):
        seconds = np.ones(len(grid), np.float32)  # transformers' default when the processor gives none
    return _Clips(grid, pixels, seconds) if len(grid) else _Clips.none()


def _truncation_cut(tokens: np.ndarray, grid: np.ndarray, clip_grid: np.ndarray, max_len: int, cfg: ModelConfig,
                    where: str) -> tuple[int, int, int]:
    """(tokens kept, images kept, clips kept): cut at max_len, moved back before an image or a clip it would split
    (a clip of the families that write timestamps spans several runs of pads: all of it goes)."""
    cut = max_len
    for pad, g in ((cfg.image_token_id, grid), (cfg.video_token_id, clip_grid)):
        if len(g):
            bounds = np.concatenate([[0], np.cumsum(g.prod(-1) // cfg.vision.merge_unit)])  # item k: pads [b_k, b_k+1)
            pad_slots = np.flatnonzero(tokens == pad)
            pads_before = int(np.searchsorted(pad_slots, cut))
            k = int(np.searchsorted(bounds, pads_before, side="right")) - 1
            if bounds[k] < pads_before:  # the cut splits item k: drop all of it
                cut = int(pad_slots[bounds[k]])
    if cut < 1:
        raise BatchingError(f"{where}: truncating to {max_len} tokens would leave nothing before its first image or clip")

    def kept(pad: int, g: np.ndarray) -> int:
        if not len(g):
            return 0
        bounds = np.cumsum(g.prod(-1) // cfg.vision.merge_unit)
        return int(np.searchsorted(bounds, int((tokens[:cut] == pad).sum()), side="right"))

    return cut, kept(cfg.image_token_id, grid), kept(cfg.video_token_id, clip_grid)


# ----------------------------------------------------------------------------- packing


def new_patches(have: set[int], image_ids: Sequence[int], image_patches: np.ndarray) -> int:
    """Patches that the images `image_ids` add to a set `have` of distinct images (each image counted once)."""
    return int(sum(int(image_patches[g]) for g in set(image_ids) - have))


def pack_rows(
    lengths: np.ndarray,
    patches: np.ndarray,
    capacity: int,
    patch_capacity: int,
    item_images: Sequence[Sequence[int]] | None = None,
    image_patches: np.ndarray | None = None,
) -> list[list[int]]:
    """Best-fit decreasing: items (by length, longest first) into rows of `capacity` tokens.

    An item goes to the feasible row with the least free tokens (patches also within
    `patch_capacity`); a new row opens only when none fits. Returns item indices per row, in
    placement order. O(items * rows) in vectorized numpy, not per token.
    With `item_images` (distinct-image ids per item) and `image_patches` (patches per distinct image), a row's
    patches are those of its distinct images (vision reuse): an image already in the row costs nothing.
    """
    order = np.lexsort((np.arange(len(lengths)), -np.asarray(lengths)))
    if item_images is not None:
        assert image_patches is not None
        return _pack_rows_distinct(order, lengths, capacity, patch_capacity, item_images, image_patches)
    free_tok = np.empty(len(lengths), np.int64)
    free_patch = np.empty(len(lengths), np.int64)
    rows: list[list[int]] = []
    for i in order:
        length, p = int(lengths[i]), int(patches[i])
        n = len(rows)
        fits = np.flatnonzero((free_tok[:n] >= length) & (free_patch[:n] >= p))
        if fits.size:
            j = int(fits[np.argmin(free_tok[fits])])
        else:
            j = n
            rows.append([])
            free_tok[j], free_patch[j] = capacity, patch_capacity
        rows[j].append(int(i))
        free_tok[j] -= length
        free_patch[j] -= p
    return rows


def _pack_rows_distinct(
    order: np.ndarray, lengths: np.ndarray, capacity: int, patch_capacity: int,
    item_images: Sequence[Sequence[int]], image_patches: np.ndarray,
) -> list[list[int]]:
    """`pack_rows` counting each row's patches over its distinct images (same best-fit order and ties)."""
    free_tok = np.empty(len(lengths), np.int64)
    free_patch = np.empty(len(lengths), np.int64)
    have: list[set[int]] = []
    rows: list[list[int]] = []
    for i in order:
        length, ids = int(lengths[i]), item_images[i]
        n = len(rows)
        by_tok = np.flatnonzero(free_tok[:n] >= length)
        j, cost = n, new_patches(set(), ids, image_patches)
        for c in by_tok[np.lexsort((by_tok, free_tok[by_tok]))]:
            extra = new_patches(have[c], ids, image_patches)
            if extra <= free_patch[c]:
                j, cost = int(c), extra
                break
        if j == n:
            rows.append([])
            have.append(set())
            free_tok[j], free_patch[j] = capacity, patch_capacity
        rows[j].append(int(i))
        have[j].update(ids)
        free_tok[j] -= length
        free_patch[j] -= cost
    return rows


def assign_micro_batches(
    row_patches: np.ndarray,
    row_tokens: np.ndarray,
    k: int,
    rows_per_mb: int,
    patch_capacity: int,
    row_images: Sequence[Sequence[int]] | None = None,
    image_patches: np.ndarray | None = None,
) -> list[list[int]] | None:
    """Rows -> k micro-batches of at most `rows_per_mb` rows, patch load balanced (LPT).

    Rows are taken by decreasing patches (then tokens) and each goes to the micro-batch with the
    least patches (then tokens) that has a free row and room under `patch_capacity`.
    With `row_images` / `image_patches` (vision reuse) a micro-batch's load is its distinct images' patches: a row
    goes where the load after it is least, then where it adds the fewest patches (the micro-batch that already
    holds its pictures, e.g. its GRPO group's), then the fewest tokens.
    None if some row does not fit (the caller tries a larger k).
    """
    order = np.lexsort((np.arange(len(row_patches)), -np.asarray(row_tokens), -np.asarray(row_patches)))
    load_p = np.zeros(k, np.int64)
    load_t = np.zeros(k, np.int64)
    used = np.zeros(k, np.int64)
    out: list[list[int]] = [[] for _ in range(k)]
    if row_images is not None:
        assert image_patches is not None
        have: list[set[int]] = [set() for _ in range(k)]
        for r in order:
            extra = np.array([new_patches(have[m], row_images[r], image_patches) for m in range(k)], np.int64)
            ok = np.flatnonzero((used < rows_per_mb) & (load_p + extra <= patch_capacity))
            if not ok.size:
                return None
            best = int(ok[np.lexsort((ok, load_t[ok], extra[ok], load_p[ok] + extra[ok]))[0]])
            out[best].append(int(r))
            have[best].update(row_images[r])
            load_p[best] += extra[best]
            load_t[best] += row_tokens[r]
            used[best] += 1
        return out
    for r in order:
        ok = np.flatnonzero((used < rows_per_mb) & (load_p + row_patches[r] <= patch_capacity))
        if not ok.size:
            return None
        best = int(ok[np.lexsort((ok, load_t[ok], load_p[ok]))[0]])
        out[best].append(int(r))
        load_p[best] += row_patches[r]
        load_t[best] += row_tokens[r]
        used[best] += 1
    return out


@dataclass(frozen=True)
class _Plan:
    seq_len: int
    rows: list[list[int]]  # item indices per row
    micro_batches: list[list[int]]  # row indices per micro-batch
    rows_per_mb: int

    @property
    def slots(self) -> int:
        return len(self.micro_batches) * self.rows_per_mb * self.seq_len


def _plan(
    lengths: np.ndarray,
    patches: np.ndarray,
    seq_len: int,
    packing: bool,
    row_choices: list[int],
    fixed_rows: int | None,
    k_bucket: Callable[[int], int],
    patch_capacity: int,
    max_tokens: int | None = None,
    item_images: Sequence[Sequence[int]] | None = None,
    image_patches: np.ndarray | None = None,
) -> _Plan:
    """Rows for one row length, then (K, R) from the buckets, then rows onto micro-batches.

    `max_tokens` caps R x seq_len (a token budget per micro-batch); when even the smallest row bucket exceeds it,
    the smallest is used (one row per data shard, as slime's dynamic batching keeps one sample per micro-batch).
    """
    if max_tokens is not None:
        fitting = [r for r in row_choices if r * seq_len <= max_tokens]
        row_choices = fitting or row_choices[:1]
        if fixed_rows is not None:
            fixed_rows = min(fixed_rows, row_choices[-1])
    if packing:
        rows = pack_rows(lengths, patches, seq_len, patch_capacity, item_images, image_patches)
    else:
        rows = [[i] for i in range(len(lengths))]
    n_rows = len(rows)
    if fixed_rows is not None:
        r_mb, k = fixed_rows, k_bucket(math.ceil(n_rows / fixed_rows))
    elif n_rows <= row_choices[-1]:
        r_mb, k = _smallest_at_least(row_choices, n_rows), 1
    else:  # accumulation is unavoidable: the fewest row slots, then the fewest micro-batches
        options = [(k_bucket(math.ceil(n_rows / r)), r) for r in row_choices]
        k, r_mb = min(options, key=lambda kr: (kr[0] * kr[1], kr[0]))
    row_tokens = np.array([int(lengths[r].sum()) for r in map(np.asarray, rows)], np.int64)
    row_images = None
    if item_images is None:
        row_patches = np.array([int(patches[r].sum()) for r in map(np.asarray, rows)], np.int64)
    else:
        row_images = [sorted({g for i in row for g in item_images[i]}) for row in rows]
        row_patches = np.array([new_patches(set(), ids, image_patches) for ids in row_images], np.int64)
    while True:
        mbs = assign_micro_batches(row_patches, row_tokens, k, r_mb, patch_capacity, row_images, image_patches)
        if mbs is not None:
            return _Plan(seq_len, rows, mbs, r_mb)
        k = k_bucket(k + 1)  # patch capacity, not rows, was the limit: spread images over more micro-batches


# ----------------------------------------------------------------------------- main entry


def build_train_batch(
    samples: Sequence[Sample],
    advantages: np.ndarray,
    model_cfg: ModelConfig,
    *,
    seq_buckets: Sequence[int],
    row_buckets: Sequence[int],
    patch_buckets: Sequence[int],
    packing: bool,
    micro_batch_rows: int | None,
    row_multiple: int = 1,
    aggregation: str,
    aggregation_constant: float | None,
    overlong_policy: str,
    micro_batch_buckets: Sequence[int] | None = None,
    max_tokens_per_micro_batch: int | None = None,
    routing_replay: bool = False,
    vision_reuse: bool = False,
    teacher_logprobs: bool = False,
) -> TrainBatch:
    """Lay `samples` out as fixed-shape [K, R, T] arrays (see the module docstring for alignment).

    advantages: float [N], one per sample (broadcast to its response targets).
    seq_buckets: allowed T (tokens per row); row_buckets: allowed R (rows per micro-batch), used when
    `micro_batch_rows` is None: K = 1 if the rows fit in the largest usable bucket, else the (K, R)
    with the fewest row slots.
    micro_batch_rows: fixed R (gradient accumulation), K grows with the data.
    row_multiple: R is always a multiple of it (data-parallel shard count of the batch axis).
    patch_buckets: allowed P (patches per micro-batch), multiples of spatial_merge_size**2; the largest
    also caps the patches of one micro-batch.
    micro_batch_buckets: allowed K (default `micro_batch_bucket`, eight sizes per octave).
    max_tokens_per_micro_batch: a token budget R x T per micro-batch (slime's dynamic batch size: the caller
    passes --max-tokens-per-device x the batch-sharding devices); R comes from the row buckets under it.
    aggregation / aggregation_constant: as `rl.aggregation.aggregation_weights`, over the whole batch.
    overlong_policy: "error" or "truncate" (cut the tail to the largest seq bucket, never through an
    image; the mask follows; see `BatchLayout.truncated`).
    routing_replay: carry each sample's `rollout_routed_experts` (sparse layers only) as `routed_experts`.
    teacher_logprobs: carry each sample's `teacher_log_probs` (on-policy distillation) as `teacher_logprobs`.
    vision_reuse: encode each distinct image once per micro-batch and gather it into every sample showing it
    (`vision.token_image_rows`; the trainer passes --vision-reuse, on by default); False keeps one copy of each
    sample's images (per-sample encoding, the layout before vision reuse).
    """
    n = len(samples)
    if n == 0:
        raise BatchingError("build_train_batch needs at least one sample")
    if overlong_policy not in OVERLONG_POLICIES:
        raise BatchingError(f"overlong_policy must be one of {OVERLONG_POLICIES}, got {overlong_policy!r}")
    adv = np.asarray(advantages, dtype=np.float64)
    if adv.shape != (n,):
        raise BatchingError(f"advantages must have shape ({n},) (one per sample), got {adv.shape}")
    if not np.isfinite(adv).all():
        bad = int(np.flatnonzero(~np.isfinite(adv))[0])
        raise BatchingError(f"advantage of {samples[bad].name} (position {bad}) is {adv[bad]}")
    seq_choices = _check_buckets("seq_buckets", seq_buckets, 1)
    if row_multiple < 1:
        raise BatchingError(f"row_multiple must be >= 1, got {row_multiple}")
    row_choices = [r for r in _check_buckets("row_buckets", row_buckets, 1) if r % row_multiple == 0]
    fixed_rows = None
    if micro_batch_rows is not None:
        if micro_batch_rows < 1 or micro_batch_rows % row_multiple:
            raise BatchingError(
                f"micro_batch_rows={micro_batch_rows} must be a positive multiple of row_multiple={row_multiple} "
                "(the data-parallel shards of the batch axis)"
            )
        fixed_rows = int(micro_batch_rows)
    elif not row_choices:
        raise BatchingError(f"no row bucket in {list(row_buckets)} is a multiple of row_multiple={row_multiple}")
    patch_choices = _check_buckets("patch_buckets", patch_buckets, 0) if len(patch_buckets) else []
    for p in patch_choices:
        if p % model_cfg.vision.merge_unit:
            raise BatchingError(f"patch bucket {p} is not a multiple of spatial_merge_size**2={model_cfg.vision.merge_unit}")
    if micro_batch_buckets is None:
        k_bucket = micro_batch_bucket
    else:
        k_choices = _check_buckets("micro_batch_buckets", micro_batch_buckets, 1)

        def k_bucket(k: int) -> int:
            b = _smallest_at_least(k_choices, k)
            if b is None:
                raise BatchingError(f"{k} micro-batches needed, more than the largest of micro_batch_buckets {k_choices}")
            return b

    seqs = [_prepare(i, s, model_cfg, seq_choices[-1], overlong_policy) for i, s in enumerate(samples)]
    lengths = np.array([s.length for s in seqs], np.int64)
    item_images, image_patches = (_identify_images(seqs, model_cfg) if vision_reuse else (None, None))
    if item_images is None:
        patches = np.array([s.num_patches for s in seqs], np.int64)
    else:  # what one sample alone costs the tower (an image it shows twice is encoded once)
        patches = np.array([new_patches(set(), ids, image_patches) for ids in item_images], np.int64)
    has_vision = bool(patches.sum())
    patch_capacity = patch_choices[-1] if patch_choices else 0
    if has_vision and patches.max() > patch_capacity:
        i = int(np.argmax(patches))
        raise BatchingError(
            f"{seqs[i].sample.name} (position {i}) has {patches[i]} image patches, more than the largest patch bucket "
            f"{patch_capacity}; add a larger bucket to patch_buckets"
        )

    feasible = [t for t in seq_choices if t >= lengths.max()]
    candidates = feasible if packing else feasible[:1]
    if max_tokens_per_micro_batch is not None and max_tokens_per_micro_batch < 1:
        raise BatchingError(f"max_tokens_per_micro_batch must be >= 1, got {max_tokens_per_micro_batch}")
    plans = [
        _plan(lengths, patches, t, packing, row_choices, fixed_rows, k_bucket, patch_capacity, max_tokens_per_micro_batch,
              item_images, image_patches)
        for t in candidates
    ]
    plan = min(plans, key=lambda p: (p.slots, p.seq_len))
    return _materialize(seqs, adv, plan, model_cfg, patch_choices, has_vision, packing, aggregation, aggregation_constant,
                        routing_replay, vision_reuse, teacher_logprobs)


def image_key(grid_thw: np.ndarray, pixels: np.ndarray) -> bytes:
    """Content hash of one processed image: its grid (t, h, w), dtype and patch bytes. Equal keys mean the tower
    sees identical inputs, so one encoding serves every copy (a group's prompt picture, a re-sent earlier turn)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(np.asarray(grid_thw, np.int64).tobytes())
    h.update(str(pixels.dtype).encode())
    h.update(np.ascontiguousarray(pixels).tobytes())
    return h.digest()


def _identify_images(seqs: list[_Seq], cfg: ModelConfig) -> tuple[list[tuple[int, ...]], np.ndarray]:
    """Give every image and clip of the batch a distinct id (by `image_key`; one id space, a clip never equals an
    image); sets each `_Seq.image_ids` and `_Seq.clips.ids`.

    Returns the ids of each sample's images then clips (each in its token order) and the patches of each distinct
    image or clip."""
    ids: dict[bytes, int] = {}
    sizes: list[int] = []
    per_item: list[tuple[int, ...]] = []

    def identify(grid: np.ndarray, pixels: np.ndarray | None, kind: bytes) -> tuple[int, ...]:
        mine: list[int] = []
        start = 0
        for g in grid:
            n = int(np.prod(g))
            key = kind + image_key(g, pixels[start : start + n])
            start += n
            if key not in ids:
                ids[key] = len(sizes)
                sizes.append(n)
            mine.append(ids[key])
        return tuple(mine)

    for s in seqs:
        s.image_ids = identify(s.grid, s.pixels, b"image")
        s.clips.ids = identify(s.clips.grid, s.clips.pixels, b"clip")
        per_item.append(s.image_ids + s.clips.ids)
    return per_item, np.array(sizes, np.int64)


def _materialize(
    seqs: list[_Seq],
    adv: np.ndarray,
    plan: _Plan,
    cfg: ModelConfig,
    patch_choices: list[int],
    has_vision: bool,
    packing: bool,
    aggregation: str,
    aggregation_constant: float | None,
    routing_replay: bool = False,
    vision_reuse: bool = False,
    teacher_logprobs: bool = False,
) -> TrainBatch:
    """Scatter the sequences into the planned slots; every per-token array is filled in O(total tokens)."""
    k_n, r_n, t_n = len(plan.micro_batches), plan.rows_per_mb, plan.seq_len
    placements: list[Placement | None] = [None] * len(seqs)
    mb_items: list[list[int]] = []  # items per micro-batch in row-major order (images concatenate in this order)
    for k, row_ids in enumerate(plan.micro_batches):
        items: list[int] = []
        seq_id, patch_off = 0, 0
        for r, row in enumerate(row_ids):
            offset = 0
            for seg, i in enumerate(plan.rows[row], start=1):
                s = seqs[i]
                placements[i] = Placement(
                    s.position, s.sample.group_index, s.sample.index, k, r, offset, s.length,
                    s.original_length, seg, seq_id, patch_off, s.num_patches,
                )
                offset += s.length
                seq_id += 1
                patch_off += s.num_patches
                items.append(i)
        mb_items.append(items)
    assert all(p is not None for p in placements)
    places: list[Placement] = placements  # type: ignore[assignment]

    lengths = np.array([s.length for s in seqs], np.int64)
    total = int(lengths.sum())
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    base = np.array([(p.micro_batch * r_n + p.row) * t_n + p.offset for p in places], np.int64)
    dest = np.repeat(base - starts, lengths) + np.arange(total)  # flat slot of every real token
    is_last = np.zeros(total, bool)
    is_last[starts + lengths - 1] = True

    tok = np.concatenate([s.tokens for s in seqs])
    mask = np.concatenate([s.mask for s in seqs])
    lp = np.concatenate([s.logprobs for s in seqs])
    resp_adv = np.concatenate([np.where(s.response, np.float32(a), np.float32(0)) for s, a in zip(seqs, adv)])

    def shift(x: np.ndarray) -> np.ndarray:
        """Value of token j+1 of the same sequence at j; 0 at each sequence's last token."""
        out = np.zeros_like(x)
        out[:-1] = x[1:]
        out[is_last] = 0
        return out

    mask_t = shift(mask)
    owner = np.repeat(np.arange(len(seqs)), lengths)
    weights = aggregation_weights(mask_t, owner, aggregation, aggregation_constant, dtype=np.float64)

    shape = (k_n, r_n, t_n)
    size = k_n * r_n * t_n

    def scatter(values: np.ndarray, dtype, fill=0) -> np.ndarray:
        out = np.full(size, fill, dtype)
        out[dest] = values
        return out.reshape(shape)

    local_ids = np.repeat(np.array([p.sequence_id for p in places], np.int64), lengths)
    arrays_tokens = scatter(tok, np.int32)
    segment_ids = scatter(np.repeat(np.array([p.segment_id for p in places]), lengths), np.int32)
    targets = scatter(shift(tok), np.int32)
    loss_mask = scatter(mask_t, np.float32)
    rollout_lp = scatter(shift(lp), np.float32)
    advantages = scatter(shift(resp_adv), np.float32)
    token_weights = scatter(weights, np.float32)
    sequence_ids = scatter(local_ids, np.int32, fill=-1)

    # Images (and clips) of each micro-batch in row-major token order: the order of `mb_items`.
    def joined(part: Callable[[_Seq], np.ndarray], items: list[int]) -> np.ndarray:
        return np.concatenate([part(seqs[i]) for i in items]) if items else np.zeros((0, 3), np.int64)

    grids = [joined(lambda s: s.grid, items) for items in mb_items]
    clip_grids = [joined(lambda s: s.clips.grid, items) for items in mb_items]
    qwen25 = isinstance(cfg, Qwen25VLConfig)
    clip_seconds = [np.concatenate([seqs[i].clips.seconds for i in items if seqs[i].clips.seconds is not None]
                                   + [np.zeros(0, np.float32)]) if qwen25 else None for items in mb_items]
    positions = np.stack([
        get_rope_index_packed(arrays_tokens[k], segment_ids[k], grids[k], cfg, video_grid_thw=clip_grids[k],
                              second_per_grid_ts=clip_seconds[k])[0]
        for k in range(k_n)
    ])

    n_images = sum(len(s.grid) for s in seqs)
    n_clips = sum(len(s.clips.grid) for s in seqs)
    if vision_reuse:
        # Each micro-batch's distinct images (and clips), in first-seen (row-major token) order: (sample, its image
        # j) of the first copy, and the distinct index of every occurrence.
        def distinct(ids_of: Callable[[_Seq], tuple[int, ...]]) -> tuple[list[list[tuple[int, int]]], list[np.ndarray]]:
            firsts_per_mb, occurrence_per_mb = [], []
            for items in mb_items:
                where: dict[int, int] = {}
                firsts: list[tuple[int, int]] = []
                occ: list[int] = []
                for i in items:
                    for j, g in enumerate(ids_of(seqs[i])):
                        if g not in where:
                            where[g] = len(firsts)
                            firsts.append((i, j))
                        occ.append(where[g])
                firsts_per_mb.append(firsts)
                occurrence_per_mb.append(np.array(occ, np.int64))
            return firsts_per_mb, occurrence_per_mb

        mb_distinct, mb_occurrence = distinct(lambda s: s.image_ids)
        mb_clips, mb_clip_occurrence = distinct(lambda s: s.clips.ids)
        mb_patches = [sum(int(np.prod(seqs[i].grid[j])) for i, j in firsts)
                      + sum(int(np.prod(seqs[i].clips.grid[j])) for i, j in clips)
                      for firsts, clips in zip(mb_distinct, mb_clips)]
        n_distinct = sum(len(firsts) for firsts in mb_distinct)
        n_distinct_clips = sum(len(firsts) for firsts in mb_clips)
    else:
        mb_patches = [sum(seqs[i].num_patches for i in items) for items in mb_items]
        n_distinct, n_distinct_clips = n_images, n_clips
    vision = None
    p_n = 0
    if has_vision:
        p_n = _smallest_at_least(patch_choices, max(mb_patches))
        assert p_n is not None  # guaranteed by the planner's patch capacity
        dtype = np.result_type(*[x.dtype for s in seqs for x in (s.pixels, s.clips.pixels) if x is not None])

        def stacked(pix: list[np.ndarray]) -> np.ndarray:
            return np.concatenate(pix).astype(dtype, copy=False) if pix else np.zeros((0, cfg.vision.patch_dim), dtype)

        per_mb = []
        for k, items in enumerate(mb_items):
            valid = segment_ids[k] > 0
            if vision_reuse:
                pixels = stacked([_image_pixels(seqs[i], j) for i, j in mb_distinct[k]])
                grid_k = np.array([seqs[i].grid[j] for i, j in mb_distinct[k]], np.int64).reshape(-1, 3)
                clip_pixels = stacked([seqs[i].clips.patches_of(j) for i, j in mb_clips[k]])
                clip_grid_k = np.array([seqs[i].clips.grid[j] for i, j in mb_clips[k]], np.int64).reshape(-1, 3)
                v = build_reused_vision_inputs(pixels, grid_k, mb_occurrence[k], arrays_tokens[k], cfg, patch_bucket=p_n,
                                               token_valid=valid, pixel_values_videos=clip_pixels,
                                               video_grid_thw=clip_grid_k, clip_of_occurrence=mb_clip_occurrence[k])
            else:
                pixels = stacked([seqs[i].pixels for i in items if seqs[i].pixels is not None])
                clip_pixels = stacked([seqs[i].clips.pixels for i in items if seqs[i].clips.pixels is not None])
                v = build_vision_inputs(pixels, grids[k], arrays_tokens[k], cfg, patch_bucket=p_n, token_valid=valid,
                                        pixel_values_videos=clip_pixels, video_grid_thw=clip_grids[k])
            per_mb.append(v._replace(pixel_values=v.pixel_values.astype(dtype, copy=False)))
        vision = type(per_mb[0])(*(None if field[0] is None else np.stack(field) for field in zip(*per_mb)))

    routed = None
    if routing_replay:
        ids = np.concatenate([replay_ids(s, cfg) for s in seqs])  # [total, L_sparse, k], aligned to tokens
        routed = np.full((size, *ids.shape[1:]), -1, np.int32)
        routed[dest] = ids
        routed = routed.reshape(*shape, *ids.shape[1:])

    teacher = None
    if teacher_logprobs:  # aligned to targets like rollout_logprobs; 0 off the loss mask
        teacher = scatter(shift(np.concatenate([teacher_row(s) for s in seqs])), np.float32) * (loss_mask > 0)

    arrays = TrainArrays(
        arrays_tokens, targets, positions, segment_ids, loss_mask, rollout_lp, advantages, token_weights, sequence_ids, vision,
        routed, teacher,
    )
    layout = BatchLayout(
        placements=tuple(places),
        shape_key=(k_n, r_n, t_n, p_n),
        real_tokens=total,
        slots=size,
        real_patches=int(sum(mb_patches)),
        patch_slots=k_n * p_n,
        rows_used=len(plan.rows),
        sequences_per_micro_batch=tuple(len(items) for items in mb_items),
        packing=packing,
        images=n_images,
        distinct_images=n_distinct,
        clips=n_clips,
        distinct_clips=n_distinct_clips,
    )
    return TrainBatch(arrays, layout)


def _image_pixels(seq: _Seq, j: int) -> np.ndarray:
    """The patches [grid_t*grid_h*grid_w, patch_dim] of a sample's j-th image."""
    sizes = seq.grid.prod(-1)
    start = int(sizes[:j].sum())
    return seq.pixels[start : start + int(sizes[j])]
