"""The clips of a prepared prompt, as the engine carries them from preparation to prefill and the prefix cache.

A clip's pads do not form one run: Qwen3-VL and Qwen3.5 write a timestamp and vision markers between its frame
groups. Everything here therefore counts a clip's pads, wherever they lie, as `video_grid_thw` says (t*h*w /
merge^2 per clip, in order), the way `build_vision_inputs` hands merged clip tokens to the video pads. The vision
tower encodes a clip as a whole, so a prefix that ends inside a clip's pads cannot be reused: the span of a clip
for the prefix cache runs from its first pad to its last.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from jaxrl_vlm.engine.prefix_cache import ImageSpan, image_spans, items_wholly_before
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


def clips_after(input_ids: np.ndarray, start: int, clips: ClipInputs | None, cfg: ModelConfig) -> ClipInputs | None:
    """The clips whose pads lie in input_ids[start:] (None when there are none). A clip whose pads `start` splits
    is an error: the tower encodes it whole."""
    if clips is None or len(clips) == 0:
        return None
    if start == 0:
        return clips
    grid = np.asarray(clips.video_grid_thw, np.int64).reshape(-1, 3)
    done = items_wholly_before(input_ids, start, grid, cfg.video_token_id, cfg.vision.merge_unit, "clip")
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
    seconds = clips.second_per_grid_ts
    labels = [b"clip" + (b"" if seconds is None else np.float32(seconds[i]).tobytes()) for i in range(len(clips))]
    return image_spans(input_ids, clips.pixel_values_videos, clips.video_grid_thw, cfg.video_token_id,
                       cfg.vision.spatial_merge_size, labels=labels)
