"""A least-recently-used map bounded in bytes, for the processed pictures and clips (`image_cache`, `clip_cache`).

Thread-safe (the engine prepares requests on several threads), with hit and miss counts, and it marks the arrays of
an entry read-only when it keeps them: a cached tensor is shared by every request that uses it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

import numpy as np

V = TypeVar("V")


class ByteBoundedLRU(Generic[V]):
    """`get(key)` / `put(key, value, arrays)`; entries leave least recently used first once their sizes
    (`size_of(value)`) sum past `max_bytes`. `max_bytes` 0 keeps nothing; a value larger than it is not kept."""

    def __init__(self, max_bytes: int, size_of: Callable[[V], int]):
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self._size_of = size_of
        self._entries: OrderedDict[str, V] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        return self._bytes

    def get(self, key: str | None) -> V | None:
        """The value of `key` (None: never cached), counted as a hit; None when absent (not counted: see `missed`)."""
        if key is None or self.max_bytes == 0:
            return None
        with self._lock:
            value = self._entries.get(key)
            if value is not None:
                self._entries.move_to_end(key)
                self.hits += 1
            return value

    def missed(self, n: int) -> None:
        with self._lock:
            self.misses += n

    def put(self, key: str, value: V, arrays: Sequence[np.ndarray]) -> None:
        """Keep `value` under `key` (its `arrays` made read-only), unless it alone is over the bound."""
        size = self._size_of(value)
        if size > self.max_bytes:
            return
        for array in arrays:
            array.setflags(write=False)
        with self._lock:
            if key in self._entries:
                return
            self._entries[key] = value
            self._bytes += size
            while self._bytes > self.max_bytes:
                _, old = self._entries.popitem(last=False)
                self._bytes -= self._size_of(old)
