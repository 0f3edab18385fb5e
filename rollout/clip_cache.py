"""Processed clips, remembered by content: decoding and the video processor run once per distinct clip.

Every turn of an episode re-sends every clip of the conversation so far (`video_data` lists them all), and the n
samples of a group share their prompt's clip; the engine decodes and processes each one for its vision tower, the
rollout's encoder for the training view. A clip is dozens of frames, so this host work grows with the episode
unless it is remembered, as `image_cache.ProcessedImageCache` does for pictures.

Keys are the clips' data URLs: a lossless MP4 written bit-exactly (`video_io.clip_to_data_url`) names its frames and
rate exactly, so a hit is the tensor the processor would compute again. Anything else (a local path, a Clip object)
is never cached. Bounded in bytes of `pixel_values_videos` (least recently used out first), thread-safe, and its
arrays are read-only: a cached clip is shared by every request that shows it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from rollout.byte_lru import ByteBoundedLRU
from rollout.video import Clip, ProcessedClips, VideoProcessorConfig, process_clips

DEFAULT_CLIP_CACHE_BYTES = 256 << 20


@dataclass(frozen=True)
class _Entry:
    patches: np.ndarray  # [t*h*w, patch_dim]
    grid: np.ndarray  # int64 [3]
    frame_indices: np.ndarray
    timestamps: list[float]
    second_per_grid_ts: float


def cache_key(item: object) -> str | None:
    """The key of a `video_data` item: the item itself for a data URL, None (never cached) otherwise."""
    return item if isinstance(item, str) and item.startswith("data:") else None


class ProcessedClipCache:
    """`process(keys, load)` = `process_clips([load(i) ...], cfg)`, reusing the clips seen before.

    `max_bytes`: the most `pixel_values_videos` bytes kept (0 turns caching off).
    """

    def __init__(self, cfg: VideoProcessorConfig, max_bytes: int = DEFAULT_CLIP_CACHE_BYTES):
        self.cfg = cfg
        self._lru: ByteBoundedLRU[_Entry] = ByteBoundedLRU(max_bytes, lambda e: e.patches.nbytes)

    def __len__(self) -> int:
        return len(self._lru)

    @property
    def hits(self) -> int:
        return self._lru.hits

    @property
    def misses(self) -> int:
        return self._lru.misses

    def process(self, keys: Sequence[str | None], load: Callable[[int], Clip]) -> ProcessedClips:
        """Process the clips `load(0..n-1)`, whose keys are `keys` (None: not cacheable); only the clips not in the
        cache are loaded, and processed together. Errors of `load` and of the processor propagate unchanged."""
        found = [self._lru.get(key) for key in keys]
        missing = [i for i, entry in enumerate(found) if entry is None]
        if missing:
            self._lru.missed(len(missing))
            fresh = process_clips([load(i) for i in missing], self.cfg)
            bounds = np.concatenate([[0], np.cumsum(fresh.video_grid_thw.prod(axis=1))])
            for j, i in enumerate(missing):
                entry = _Entry(np.array(fresh.pixel_values_videos[bounds[j]:bounds[j + 1]]),
                               np.array(fresh.video_grid_thw[j]), np.array(fresh.frame_indices[j]),
                               list(fresh.timestamps[j]), float(fresh.second_per_grid_ts[j]))
                found[i] = entry
                if keys[i] is not None:
                    self._lru.put(keys[i], entry, (entry.patches, entry.grid, entry.frame_indices))
        dim = 3 * self.cfg.temporal_patch_size * self.cfg.patch_size**2
        return ProcessedClips(
            np.concatenate([e.patches for e in found]) if found else np.zeros((0, dim), np.float32),
            np.asarray([e.grid for e in found], np.int64).reshape(-1, 3), [e.frame_indices for e in found],
            [e.timestamps for e in found], np.asarray([e.second_per_grid_ts for e in found], np.float32))
