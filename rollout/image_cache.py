"""Preprocessed images, remembered by content: decode and the HF image processor run once per distinct image.

A rollout sends the same pictures again and again: the n samples of a group share their prompt's images, and
every turn re-sends every image of the conversation so far (`image_data` lists them all). Both sides of the wire
preprocess each of them (the engine for its vision tower, the client for the training view), and on a small
model that host work costs more than the model itself. SGLang keeps a multimodal cache for the same reason.

Keys are data URLs, which name their content exactly (PNG is lossless, and the URL is the bytes), so a hit is the
tensor the processor would compute again. Local file paths are never cached (a file may change). The cache is
bounded in bytes of `pixel_values` (least recently used out first), thread-safe, and hands out read-only
arrays: a cached tensor is shared by every request that uses the image.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from PIL import Image

from rollout.byte_lru import ByteBoundedLRU
from rollout.processing import process_images

# 256 MiB of fp32 patches: ~2,700 tiny 64x64 pictures, or ~40 full-HD ones for Qwen3-VL.
DEFAULT_CACHE_BYTES = 256 << 20


def cache_key(item: Any) -> str | None:
    """The key of an `image_data` item: the item itself for a data URL, None (never cached) otherwise."""
    return item if isinstance(item, str) and item.startswith("data:") else None


class ProcessedImageCache:
    """`process(keys, load)` = `process_images(processor, [load(i) ...])`, reusing the rows of images seen before.

    `max_bytes`: the most `pixel_values` bytes kept (0 turns caching off: every image is processed).
    """

    def __init__(self, image_processor: Any, max_bytes: int = DEFAULT_CACHE_BYTES):
        self.image_processor = image_processor
        self._lru: ByteBoundedLRU[tuple[np.ndarray, np.ndarray]] = ByteBoundedLRU(max_bytes, lambda e: e[0].nbytes)

    def __len__(self) -> int:
        return len(self._lru)

    @property
    def max_bytes(self) -> int:
        return self._lru.max_bytes

    @property
    def nbytes(self) -> int:
        return self._lru.nbytes

    @property
    def hits(self) -> int:
        return self._lru.hits

    @property
    def misses(self) -> int:
        return self._lru.misses

    def process(self, keys: Sequence[str | None], load: Callable[[int], Image.Image]) -> dict[str, np.ndarray]:
        """Preprocess the images `load(0..n-1)`, whose keys are `keys` (None: not cacheable). Only the images
        not in the cache are loaded, and they are processed together in one processor call. Errors of `load`
        and of the processor propagate unchanged."""
        found = [self._lru.get(key) for key in keys]
        missing = [i for i, entry in enumerate(found) if entry is None]
        if missing:
            self._lru.missed(len(missing))
            fresh = process_images(self.image_processor, [load(i) for i in missing])
            bounds = np.concatenate([[0], np.cumsum(fresh["image_grid_thw"].prod(axis=1))])
            for j, i in enumerate(missing):
                rows = np.array(fresh["pixel_values"][bounds[j]:bounds[j + 1]])
                grid = np.array(fresh["image_grid_thw"][j : j + 1])
                found[i] = (rows, grid)
                if keys[i] is not None:
                    self._lru.put(keys[i], (rows, grid), (rows, grid))
        if not found:
            return process_images(self.image_processor, [])
        return {"pixel_values": np.concatenate([rows for rows, _ in found]),
                "image_grid_thw": np.concatenate([grid for _, grid in found])}
