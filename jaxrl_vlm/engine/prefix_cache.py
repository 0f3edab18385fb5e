"""Host-side bookkeeping of the prefix cache: which free slots still hold reusable K/V, and how much.

In multi-turn RL every turn's request is the previous turn's prompt + the model's output + an
observation, so the slot that served the previous turn already holds the K/V of almost the whole new
prompt. A finished request therefore leaves its slot *warm*: the slot is free, and `PrefixCache`
remembers the token ids whose K/V it holds (prompt + output except the last token, which was sampled
but never fed) and an identity of every image among them. Image-pad ids are the same for every image,
so token ids alone would let a different picture of the same size pass as cached: each image is
identified by a digest of its pixel values and grid.

A new prompt may reuse the longest common prefix of ids with a warm slot, cut back to the start of
the first image that differs or does not lie wholly inside the prefix, and to at most the prompt
length - 1 (the last prompt token must be computed to get the next token's logits).

A request that continues a warm slot's whole content (the next turn of its conversation) takes that
slot. One that shares only part of it (a common system prompt and image, a sibling sample of the
same prompt) gets the shared rows *copied* into another slot, so the warm slot still serves its own
conversation's next turn: copying K/V costs memory bandwidth, recomputing it costs the model.
No JAX here.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import NamedTuple, Sequence

import numpy as np

from jaxrl_vlm.engine.options import bucket_for


@dataclass(frozen=True)
class ImageSpan:
    """One image inside an expanded token sequence: its pad tokens are ids[start:end]."""

    start: int
    end: int
    key: bytes  # digest of the image's grid and pixel values


def image_spans(
    input_ids: np.ndarray,
    pixel_values: np.ndarray | None,
    image_grid_thw: np.ndarray | None,
    image_token_id: int,
    merge_size: int,
) -> tuple[ImageSpan, ...]:
    """The span and identity of every image of a prepared prompt (pads expanded), in order.

    The i-th image owns the next t*h*w / merge^2 image-pad tokens and the next t*h*w patch rows of
    `pixel_values`, as in `build_vision_inputs`.
    """
    if pixel_values is None or image_grid_thw is None or len(image_grid_thw) == 0:
        return ()
    grid = np.asarray(image_grid_thw, np.int64).reshape(-1, 3)
    patches = grid.prod(-1)
    merged = patches // (merge_size * merge_size)
    pads = np.flatnonzero(np.asarray(input_ids) == image_token_id)
    if pads.size != int(merged.sum()) or pixel_values.shape[0] != int(patches.sum()):
        raise ValueError(
            f"{pads.size} image-pad tokens and {pixel_values.shape[0]} patch rows do not match image_grid_thw {grid.tolist()}"
        )
    spans = []
    tok = row = 0
    for g, n_patches, n_tokens in zip(grid, patches, merged):
        digest = hashlib.blake2b(digest_size=16)
        digest.update(g.tobytes())
        digest.update(str(pixel_values.dtype).encode())
        digest.update(np.ascontiguousarray(pixel_values[row : row + n_patches]).tobytes())
        spans.append(ImageSpan(int(pads[tok]), int(pads[tok + n_tokens - 1]) + 1, digest.digest()))
        tok += int(n_tokens)
        row += int(n_patches)
    return tuple(spans)


def cut_before_images(prefix: int, images: Sequence[ImageSpan], cached: Sequence[ImageSpan] = ()) -> int:
    """`prefix` cut back to the start of the first image of `images` that it does not cover whole,
    or (when `cached` is given) that is not the identical image at the same place in `cached`."""
    known = {(s.start, s.end): s.key for s in cached}
    for span in images:
        if span.start >= prefix:
            break
        if span.end > prefix or known.get((span.start, span.end)) != span.key:
            return span.start
    return prefix


def reusable_prefix(
    cached_ids: np.ndarray,
    cached_images: Sequence[ImageSpan],
    ids: np.ndarray,
    images: Sequence[ImageSpan],
) -> int:
    """How many leading tokens of `ids` (with `images`) a slot holding `cached_ids` can serve."""
    n = min(cached_ids.shape[0], ids.shape[0] - 1)
    if n <= 0:
        return 0
    differ = np.flatnonzero(cached_ids[:n] != ids[:n])
    prefix = int(differ[0]) if differ.size else n
    return cut_before_images(prefix, images, cached_images)


def fit_start(start: int, length: int, images: Sequence[ImageSpan], buckets: Sequence[int], max_len: int) -> int:
    """The largest reuse <= `start` whose padded suffix still fits the slot.

    The suffix [start, length) is padded to a prefill bucket T and written at rows [start, start + T);
    near the end of the slot that would run past `max_len`. Reusing less (start = max_len - T, cut
    back to an image start) lengthens the suffix, which may need a larger bucket; repeat until it
    fits (start only decreases, so this ends, at worst at 0: a plain prefill).
    """
    while start > 0:
        t = bucket_for(length - start, tuple(buckets), "prompt tokens")
        if start + t <= max_len:
            return start
        start = cut_before_images(max_len - t, images)
    return 0


class Match(NamedTuple):
    """A warm slot that can serve `reuse` leading tokens of a prompt; taking it in place would
    lose `lost` other cached tokens (0 or 1 for the next turn of the slot's own conversation)."""

    slot: int
    reuse: int
    lost: int


@dataclass
class _Warm:
    ids: np.ndarray
    images: tuple[ImageSpan, ...]
    last_used: int


class PrefixCache:
    """Warm slots: free slots whose K/V rows [0, len(ids)) hold `ids` (with `images`).

    The scheduler owns the empty ("cold") slots; this holds the warm ones, picks the best one for a
    prompt and the least recently used one to evict. Not thread-safe (the scheduler thread's).
    """

    def __init__(self) -> None:
        self._warm: dict[int, _Warm] = {}
        self._tick = 0

    def __len__(self) -> int:
        return len(self._warm)

    def __contains__(self, slot: int) -> bool:
        return slot in self._warm

    def slots(self) -> list[int]:
        return sorted(self._warm)

    def cached_ids(self, slot: int) -> np.ndarray:
        return self._warm[slot].ids

    def put(self, slot: int, ids: np.ndarray, images: Sequence[ImageSpan]) -> None:
        """Slot `slot` is free and its rows [0, len(ids)) hold the K/V of `ids`."""
        self._tick += 1
        inside = tuple(s for s in images if s.end <= ids.shape[0])
        self._warm[slot] = _Warm(np.asarray(ids, np.int32), inside, self._tick)

    def best(self, ids: np.ndarray, images: Sequence[ImageSpan]) -> Match | None:
        """The warm slot serving the longest prefix of `ids`; ties go to the slot that would lose the
        fewest other cached tokens, then the least recently used. None when no slot shares a token."""
        best: tuple[tuple[int, int, int], Match] | None = None
        for slot, warm in self._warm.items():
            n = reusable_prefix(warm.ids, warm.images, ids, images)
            if n == 0:
                continue
            lost = warm.ids.shape[0] - n
            rank = (n, -lost, -warm.last_used)
            if best is None or rank > best[0]:
                best = (rank, Match(slot, n, lost))
        return None if best is None else best[1]

    def touch(self, slot: int) -> None:
        """The slot's prefix was just copied for a request: it is in use, evict it last."""
        self._tick += 1
        self._warm[slot].last_used = self._tick

    def take(self, slot: int) -> None:
        """The slot is handed to a request (its content will be overwritten past the reused prefix)."""
        del self._warm[slot]

    def lru(self) -> int | None:
        """The least recently used warm slot (None when there is none)."""
        return min(self._warm, key=lambda s: self._warm[s].last_used) if self._warm else None

    def clear(self) -> list[int]:
        """Forget every warm slot (new weights, flush, uncertain cache); returns them."""
        slots = sorted(self._warm)
        self._warm.clear()
        return slots
