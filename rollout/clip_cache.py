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

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

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
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.cfg = cfg
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._entries)

    def _get(self, key: str | None) -> _Entry | None:
        if key is None or self.max_bytes == 0:
            return None
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
                self.hits += 1
            return entry

    def _put(self, key: str, entry: _Entry) -> None:
        size = entry.patches.nbytes
        if size > self.max_bytes:
            return
        for array in (entry.patches, entry.grid, entry.frame_indices):
            array.setflags(write=False)
        with self._lock:
            if key in self._entries:
                return
            self._entries[key] = entry
            self._bytes += size
            while self._bytes > self.max_bytes:
                _, old = self._entries.popitem(last=False)
                self._bytes -= old.patches.nbytes

    def process(self, keys: Sequence[str | None], load: Callable[[int], Clip]) -> ProcessedClips:
        """Process the clips `load(0..n-1)`, whose keys are `keys` (None: not cacheable); only the clips not in the
        cache are loaded, and processed together. Errors of `load` and of the processor propagate unchanged."""
        found = [self._get(key) for key in keys]
        missing = [i for i, entry in enumerate(found) if entry is None]
        if missing:
            with self._lock:
                self.misses += len(missing)
            fresh = process_clips([load(i) for i in missing], self.cfg)
            bounds = np.concatenate([[0], np.cumsum(fresh.video_grid_thw.prod(axis=1))])
            for j, i in enumerate(missing):
                entry = _Entry(np.array(fresh.pixel_values_videos[bounds[j]:bounds[j + 1]]),
                               np.array(fresh.video_grid_thw[j]), np.array(fresh.frame_indices[j]),
                               list(fresh.timestamps[j]), float(fresh.second_per_grid_ts[j]))
                found[i] = entry
                if keys[i] is not None and self.max_bytes:
                    self._put(keys[i], entry)
        dim = 3 * self.cfg.temporal_patch_size * self.cfg.patch_size**2
        return ProcessedClips(
            np.concatenate([e.patches for e in found]) if found else np.zeros((0, dim), np.float32),
            np.asarray([e.grid for e in found], np.int64).reshape(-1, 3), [e.frame_indices for e in found],
            [e.timestamps for e in found], np.asarray([e.second_per_grid_ts for e in found], np.float32))
