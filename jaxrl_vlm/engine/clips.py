"""The clips of a prepared prompt, as the engine carries them from preparation to prefill and the prefix cache.

A clip's pads do not form one run: Qwen3-VL and Qwen3.5 write a timestamp and vision markers between its frame
groups. Everything here therefore counts a clip's pads, wherever they lie, as `video_grid_thw` says (t*h*w /
merge^2 per clip, in order), the way `build_vision_inputs` hands merged clip tokens to the video pads. The vision
tower encodes a clip as a whole, so a prefix that ends inside a clip's pads cannot be reused: the span of a clip
for the prefix cache runs from its first pad to its last.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from jaxrl_vlm.engine.prefix_cache import ImageSpan
from jaxrl_vlm.models.config import ModelConfig


@dataclass(frozen=True)
class ClipInputs:
    """Processor outputs of a prompt's clips: pixel_values_videos float32 [P, C*T*p*p], video_grid_thw int64 [V, 3]
    and, for Qwen2.5-VL, second_per_grid_ts float32 [V] (None otherwise)."""

    pixel_values_videos: np.ndarray
    video_grid_thw: np.ndarray
    second_per_grid_ts: np.ndarray | None = None

    def __len__(self) -> int:
        return int(self.video_grid_thw.shape[0])

    @property
    def patches(self) -> int:
        return int(self.pixel_values_videos.shape[0])


def _clip_tokens(grid: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    return grid.prod(-1) // cfg.vision.merge_unit


def clips_after(input_ids: np.ndarray, start: int, clips: ClipInputs | None, cfg: ModelConfig) -> ClipInputs | None:
    """The clips whose pads lie in input_ids[start:] (None when there are none). A clip whose pads `start` splits
    is an error: the tower encodes it whole."""
    if clips is None or len(clips) == 0:
        return None
    if start == 0:
        return clips
    grid = np.asarray(clips.video_grid_thw, np.int64).reshape(-1, 3)
    merged = np.cumsum(_clip_tokens(grid, cfg))
    before = int(np.count_nonzero(np.asarray(input_ids[:start]) == cfg.video_token_id))
    done = int(np.searchsorted(merged, before, side="right"))  # clips wholly before `start`
    if before != (merged[done - 1] if done else 0):
        raise ValueError(f"prefix of {start} tokens ends inside clip {done} (its pads are split)")
    if done == len(grid):
        return None
    first_patch = int(grid[:done].prod(-1).sum())
    seconds = None if clips.second_per_grid_ts is None else clips.second_per_grid_ts[done:]
    return ClipInputs(clips.pixel_values_videos[first_patch:], grid[done:], seconds)


def clip_spans(input_ids: np.ndarray, clips: ClipInputs | None, cfg: ModelConfig) -> tuple[ImageSpan, ...]:
    """The span (first pad to last pad) and identity (digest of grid, seconds and patches) of every clip of a
    prepared prompt, for the prefix cache: a cached prefix never ends inside one, and a different clip with the same
    token layout never passes as cached."""
    if clips is None or len(clips) == 0:
        return ()
    grid = np.asarray(clips.video_grid_thw, np.int64).reshape(-1, 3)
    patches = grid.prod(-1)
    merged = _clip_tokens(grid, cfg)
    pads = np.flatnonzero(np.asarray(input_ids) == cfg.video_token_id)
    pixels = clips.pixel_values_videos
    if pads.size != int(merged.sum()) or pixels.shape[0] != int(patches.sum()):
        raise ValueError(f"{pads.size} video-pad tokens and {pixels.shape[0]} patch rows do not match video_grid_thw "
                         f"{grid.tolist()}")
    spans = []
    tok = row = 0
    for i, (g, n_patches, n_tokens) in enumerate(zip(grid, patches, merged)):
        digest = hashlib.blake2b(b"clip", digest_size=16)
        digest.update(g.tobytes())
        if clips.second_per_grid_ts is not None:
            digest.update(np.float32(clips.second_per_grid_ts[i]).tobytes())
        digest.update(str(pixels.dtype).encode())
        digest.update(np.ascontiguousarray(pixels[row : row + n_patches]).tobytes())
        spans.append(ImageSpan(int(pads[tok]), int(pads[tok + n_tokens - 1]) + 1, digest.digest()))
        tok += int(n_tokens)
        row += int(n_patches)
    return tuple(spans)
