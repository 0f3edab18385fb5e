"""Host-side bookkeeping of the paged KV cache: who holds each page, and which prefixes pages cache.

The device cache is `num_pages` pages of `page_size` tokens (the family's `DecodeCache`, models/families.py). A request holds the
pages of its page table; `PageCache` counts holders per page (requests and the tree) and hands out
free pages. The pages of finished (and freshly prefilled) requests are kept in a *radix tree of
pages*: each node is one page, its key the page's token ids plus the identity of every image whose
pads fall in it, so a path from the root spells a cached prefix; a request's partly filled last page
hangs at the end of its path as a *tail*, keyed by the tokens it holds so far. Image-pad ids are the same for
every image, so token ids alone would let a different picture of the same size pass as cached: each
image is identified by a digest of its pixel values and grid (`image_spans`).

A new prompt reuses the longest cached path that matches it (and the longest tail after it), at
most up to prompt length - 1 (the last prompt token must be computed to get the next token's
logits), cut back to the start of an image that the reuse would split (prefill cannot start inside
an image). Its whole pages are shared; the page holding the rest of the reused prefix (a tail, or a
full page that the reuse ends inside) is copied into a page of the request's own (copy-on-write),
since the request writes its next positions there. The n samples of a GRPO group therefore prefill
their prompt once (the first one's pages enter the tree right after its prefill; the others compute
only the last prompt token) and the next turn of an episode re-reads its conversation's pages.
Shared pages are only read: a request writes positions past its reused prefix, in its own pages.

Pages that only the tree holds are evicted least recently used first, leaves before their parents,
when a request needs pages and none are free. `clear` forgets the tree (new weights, flush, a failed
program): pages still held by running requests stay theirs until they finish. No JAX here.
"""

from __future__ import annotations

import hashlib
import heapq
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np


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
    *,
    labels: Sequence[bytes] | None = None,
) -> tuple[ImageSpan, ...]:
    """The span and identity of every image of a prepared prompt (pads expanded), in order.

    The i-th image owns the next t*h*w / merge^2 image-pad tokens and the next t*h*w patch rows of
    `pixel_values`, as in `build_vision_inputs`: its span runs from its first pad to its last, wherever they lie
    (a clip's pads are several runs). `labels`: per item, bytes mixed into its digest (a clip's kind and seconds),
    so an item of another kind or timing never passes as cached. `image_token_id` is the item's pad id.
    """
    if pixel_values is None or image_grid_thw is None or len(image_grid_thw) == 0:
        return ()
    grid = np.asarray(image_grid_thw, np.int64).reshape(-1, 3)
    patches = grid.prod(-1)
    merged = patches // (merge_size * merge_size)
    pads = np.flatnonzero(np.asarray(input_ids) == image_token_id)
    if pads.size != int(merged.sum()) or pixel_values.shape[0] != int(patches.sum()):
        raise ValueError(
            f"{pads.size} pad tokens (id {image_token_id}) and {pixel_values.shape[0]} patch rows do not match the grid "
            f"{grid.tolist()}"
        )
    spans = []
    tok = row = 0
    for i, (g, n_patches, n_tokens) in enumerate(zip(grid, patches, merged)):
        digest = hashlib.blake2b(labels[i] if labels is not None else b"", digest_size=16)
        digest.update(g.tobytes())
        digest.update(str(pixel_values.dtype).encode())
        digest.update(np.ascontiguousarray(pixel_values[row : row + n_patches]).tobytes())
        spans.append(ImageSpan(int(pads[tok]), int(pads[tok + n_tokens - 1]) + 1, digest.digest()))
        tok += int(n_tokens)
        row += int(n_patches)
    return tuple(spans)


def items_wholly_before(input_ids: np.ndarray, start: int, grid: np.ndarray, pad_id: int, merge_unit: int,
                        noun: str) -> int:
    """How many of the items (pictures or clips, `grid` rows in order, t*h*w / merge_unit pads each) lie wholly in
    input_ids[:start]; ValueError when `start` splits one (the tower encodes an item whole)."""
    merged = np.cumsum(grid.prod(-1) // merge_unit)
    before = int(np.count_nonzero(np.asarray(input_ids[:start]) == pad_id))
    done = int(np.searchsorted(merged, before, side="right"))
    if before != (merged[done - 1] if done else 0):
        raise ValueError(f"prefix of {start} tokens ends inside {noun} {done} (its pads are split)")
    return done


def cut_before_images(prefix: int, images: Sequence[ImageSpan]) -> int:
    """`prefix` cut back to the start of the first image of `images` that it covers only in part."""
    for span in images:
        if span.start >= prefix:
            break
        if span.end > prefix:
            return span.start
    return prefix


def page_keys(ids: np.ndarray, images: Sequence[ImageSpan], page_size: int, pages: int) -> list[bytes]:
    """The tree key of each of the first `pages` full pages of `ids`: its token ids and, for every
    image with pads in it, where they lie in the page and the image's digest."""
    keys = []
    for j in range(pages):
        lo, hi = j * page_size, (j + 1) * page_size
        key = bytearray(np.ascontiguousarray(ids[lo:hi], np.int32).tobytes())
        for span in images:
            if span.start < hi and span.end > lo:
                key += np.array([span.start - lo, span.end - lo], np.int64).tobytes() + span.key
        keys.append(bytes(key))
    return keys


def tail_key(ids: np.ndarray, images: Sequence[ImageSpan], page_size: int, page: int, n: int) -> bytes:
    """The tree key of the first `n` tokens of page `page` of `ids` (a partly filled page). Only images that start
    inside those tokens count: a picture that a later turn puts after them in the same page must not hide them."""
    end = page * page_size + n
    return page_keys(ids[:end], [s for s in images if s.start < end], page_size, page + 1)[page] if n else b""


def reusable_tokens(matched: int, length: int, images: Sequence[ImageSpan]) -> int:
    """Tokens of a prompt of `length` (with `images`) served by `matched` cached leading tokens: at
    most length - 1 (the last prompt token is computed for its logits), never ending inside an image."""
    return cut_before_images(min(matched, length - 1), images)


@dataclass(eq=False)
class _Node:
    page: int
    key: bytes
    parent: "_Node | None"
    size: int = 0  # tokens it holds: page_size, or fewer for a partly filled page (always a leaf)
    children: dict[bytes, "_Node"] = field(default_factory=dict)  # full pages that follow
    tails: dict[bytes, "_Node"] = field(default_factory=dict)  # partly filled pages that follow
    last_used: int = 0


class PageCache:
    """The page pool (holders per page, free pages) and the radix tree of cached pages.

    A page is free when nobody holds it. `allocate` gives pages held once by the caller; `hold` adds
    a holder (a request reusing tree pages); `release` drops one per page. The tree holds each page
    of its nodes once. Full pages are shared as they are; a partly filled last page (a *tail*: its
    owner may still be writing past it) is only ever copied by a request that reuses it, which then
    writes its own rows into the copy (copy-on-write). Not thread-safe (the scheduler thread's).
    """

    def __init__(self, num_pages: int, page_size: int) -> None:
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"num_pages={num_pages} and page_size={page_size} must be >= 1")
        self.num_pages = num_pages
        self.page_size = page_size
        self._refs = np.zeros((num_pages,), np.int64)
        self._free = list(range(num_pages - 1, -1, -1))  # a stack: low pages first
        self._root = _Node(-1, b"", None)
        self._nodes: dict[int, _Node] = {}  # page -> its tree node
        self._evictable = 0  # tree pages that only the tree holds (kept up to date: admission asks often)
        self._tick = 0
        self.evictions = 0  # pages taken out of the tree to make room

    # ------------------------------------------------------------------ pool

    @property
    def free_pages(self) -> int:
        return len(self._free)

    @property
    def cached_pages(self) -> int:
        """Pages in the tree."""
        return len(self._nodes)

    def evictable_pages(self) -> int:
        """Tree pages that no request holds (all of them can be evicted, leaves first)."""
        return self._evictable

    def request_held_pages(self) -> int:
        """Pages some request holds (alone or with the tree): 0 once every request has finished, whatever the
        tree caches. The soak test's page-leak check (`scripts/soak_engine.py`) reads it."""
        return self.num_pages - len(self._free) - self._evictable

    def available(self) -> int:
        """Pages `allocate` could hand out now."""
        return len(self._free) + self.evictable_pages()

    def refs(self, page: int) -> int:
        return int(self._refs[page])

    def allocate(self, n: int) -> list[int] | None:
        """`n` pages held once by the caller, evicting least recently used tree pages if needed; None
        (and nothing changed) when even eviction cannot free enough."""
        if n > len(self._free) and n > self.available():
            return None
        if n > len(self._free):
            self._evict(n - len(self._free))
        pages = [self._free.pop() for _ in range(n)]
        self._refs[pages] += 1
        return pages

    def hold(self, pages: Sequence[int]) -> None:
        for p in pages:
            if self._refs[p] < 1:
                raise ValueError(f"page {p} is free: only a held page can gain a holder")
            self._refs[p] += 1
            if self._refs[p] == 2 and p in self._nodes:
                self._evictable -= 1

    def release(self, pages: Sequence[int]) -> None:
        """Drop one holder of each page; pages nobody holds any more become free."""
        for p in pages:
            if self._refs[p] < 1:
                raise ValueError(f"page {p} released more often than held")
            self._refs[p] -= 1
            if self._refs[p] == 1 and p in self._nodes:
                self._evictable += 1
            elif self._refs[p] == 0:
                self._free.append(p)

    # ------------------------------------------------------------------ tree

    def match(
        self, keys: Sequence[bytes], tail: Callable[[int, int], bytes] | None = None
    ) -> tuple[list[int], tuple[int, int] | None]:
        """Pages of the longest cached path spelling keys[0], keys[1], ... (marked as just used), and
        the longest cached partly filled page after it as (page, tokens) or None; `tail(j, n)` is the
        key the prompt's page j would have with its first n tokens."""
        self._tick += 1
        node, pages = self._root, []
        for key in keys:
            child = node.children.get(key)
            if child is None:
                break
            node = child
            node.last_used = self._tick
            pages.append(node.page)
        best = None
        if tail is not None:
            for candidate in node.tails.values():
                if (best is None or candidate.size > best.size) and tail(len(pages), candidate.size) == candidate.key:
                    best = candidate
        if best is None:
            return pages, None
        best.last_used = self._tick
        return pages, (best.page, best.size)

    def insert(self, keys: Sequence[bytes], pages: Sequence[int], tail: tuple[bytes, int, int] | None = None) -> int:
        """Cache `pages` (held by the caller, whose K/V spell `keys`) along their path, up to the first
        key cached already with another page (that copy stays, and the caller's pages past it are not
        cached), then `tail` = (key, page, tokens), the caller's partly filled next page. Returns how
        many pages the tree took.

        Stopping there keeps an invariant that eviction relies on: the tree pages a request holds form
        a path from the root, so a node that only the tree holds has only such nodes below it."""
        self._tick += 1
        node, taken = self._root, 0
        for key, page in zip(keys, pages):
            child = node.children.get(key)
            if child is None:
                if not self._can_take(page):
                    return taken
                child = self._add(node, node.children, key, page, self.page_size)
                taken += 1
            elif child.page != page:
                return taken
            child.last_used = self._tick
            node = child
        if tail is not None and tail[0] not in node.tails and self._can_take(tail[1]):
            self._add(node, node.tails, tail[0], tail[1], tail[2]).last_used = self._tick
            taken += 1
        return taken

    def _can_take(self, page: int) -> bool:
        """Whether the caller's `page` may enter the tree now. A page cached as a tail of the same
        request (it was partly filled then) is taken out first: it has grown since."""
        if self._refs[page] < 1:
            raise ValueError(f"page {page} is free: only a held page can enter the tree")
        node = self._nodes.get(page)
        if node is None:
            return True
        if node.size == self.page_size:  # one page cannot sit at two places of the tree
            return False
        del node.parent.tails[node.key]
        del self._nodes[page]
        self.release([page])  # the caller still holds it: never freed here
        return True

    def _add(self, parent: _Node, where: dict[bytes, _Node], key: bytes, page: int, size: int) -> _Node:
        child = _Node(page, key, parent, size)
        where[key] = child
        self._nodes[page] = child
        self._refs[page] += 1  # the caller holds it too: never evictable yet
        return child

    def clear(self) -> int:
        """Forget every cached prefix (the K/V no longer matches the weights); returns the pages dropped."""
        pages = list(self._nodes)
        self._nodes.clear()
        self._evictable = 0
        self._root = _Node(-1, b"", None)
        self.release(pages)
        return len(pages)

    def _evict(self, n: int) -> None:
        """Free `n` tree pages that no request holds, least recently used leaves first."""
        leaves = [(node.last_used, node.page) for node in self._nodes.values()
                  if not node.children and not node.tails and self._refs[node.page] == 1]
        heapq.heapify(leaves)
        while n > 0:
            if not leaves:
                raise RuntimeError("page eviction ran out of candidates (accounting bug)")
            _, page = heapq.heappop(leaves)
            node = self._nodes.pop(page)
            self._evictable -= 1
            parent = node.parent
            del (parent.children if node.size == self.page_size else parent.tails)[node.key]
            self.release([page])
            self.evictions += 1
            n -= 1
            if parent is not self._root and not parent.children and not parent.tails and self._refs[parent.page] == 1:
                heapq.heappush(leaves, (parent.last_used, parent.page))


def prefix_key(ids: np.ndarray, images: Sequence[ImageSpan], n: int) -> bytes:
    """The identity of the first `n` tokens of `ids`: their ids and the digest of every image inside them."""
    digest = hashlib.blake2b(np.ascontiguousarray(ids[:n], np.int32).tobytes(), digest_size=16)
    for span in images:
        if span.start < n:
            digest.update(np.array([span.start, span.end], np.int64).tobytes() + span.key)
    return digest.digest()


class StateSnapshots:
    """Which snapshot row holds the recurrent state after which prefix (families with linear attention).

    Pages restore the K/V of full-attention layers at any position, but a linear-attention layer's state exists
    only where a request stopped: after its prompt but the last token (the scheduler prefills the last token
    separately to keep it), and after everything a finished request fed. A new request may continue from a
    snapshot of length n only if its first n tokens are that prefix and the pages of [0, n) are reused with it.
    Rows are `first_row`, `first_row + 1`, ...; the least recently used snapshot is dropped when all are taken.
    `clear` forgets them all (new weights). No JAX here; the scheduler copies the rows on the device.
    """

    def __init__(self, rows: int, first_row: int) -> None:
        self._free = list(range(first_row + rows - 1, first_row - 1, -1))
        self._rows: dict[bytes, tuple[int, int]] = {}  # prefix key -> (row, length)
        self._lengths: dict[int, set[bytes]] = {}  # length -> keys of that length
        self._used: dict[bytes, int] = {}
        self._tick = 0

    def __len__(self) -> int:
        return len(self._rows)

    def match(self, ids: np.ndarray, images: Sequence[ImageSpan], limit: int) -> tuple[int, int] | None:
        """(row, n) of the longest snapshot of a prefix of `ids` with n <= `limit`, or None."""
        for n in sorted((n for n in self._lengths if 0 < n <= limit), reverse=True):
            key = prefix_key(ids, images, n)
            if key in self._rows:
                self._tick += 1
                self._used[key] = self._tick
                return self._rows[key]
        return None

    def reserve(self, ids: np.ndarray, images: Sequence[ImageSpan], n: int) -> int | None:
        """The row to save the state after `ids[:n]` into, or None when that prefix has a snapshot already. Takes
        a free row, else the least recently used snapshot's."""
        key = prefix_key(ids, images, n)
        self._tick += 1
        if key in self._rows:
            self._used[key] = self._tick
            return None
        if not self._free:
            if not self._rows:
                return None  # no rows at all (state_snapshots 0)
            oldest = min(self._used, key=self._used.__getitem__)
            self._free.append(self._drop(oldest))
        row = self._free.pop()
        self._rows[key] = (row, n)
        self._lengths.setdefault(n, set()).add(key)
        self._used[key] = self._tick
        return row

    def _drop(self, key: bytes) -> int:
        row, n = self._rows.pop(key)
        del self._used[key]
        self._lengths[n].discard(key)
        if not self._lengths[n]:
            del self._lengths[n]
        return row

    def clear(self) -> int:
        """Forget every snapshot (the states no longer match the weights); returns how many."""
        dropped = len(self._rows)
        for key in list(self._rows):
            self._free.append(self._drop(key))
        return dropped
