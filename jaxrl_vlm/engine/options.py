"""Embedded-engine options: running requests, KV pages, context length, shape buckets, dtypes; shared by `train` and `serve`.

Every device program is compiled for a bucket, so the number of programs is bounded by the bucket
lists here: prefill per (prompt bucket, patch bucket or none), extend (a prefill after a cached
prefix) per (suffix bucket, kv-length bucket, patch bucket or none), decode per (batch bucket,
kv-length bucket, filtered), "filtered" being whether any row of the batch uses top-k / top-p / min-p.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax.numpy as jnp

from jaxrl_vlm.config import Config
from rollout.processing import DEFAULT_MAX_IMAGE_BYTES, DEFAULT_MAX_IMAGE_PIXELS, ImageReadPolicy
from rollout.sglang_wire import DEFAULT_MAX_N

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def powers_of_two(lo: int, hi: int) -> tuple[int, ...]:
    """lo, 2*lo, 4*lo, ... below hi, then hi itself (hi is always the last bucket)."""
    out = []
    b = max(1, lo)
    while b < hi:
        out.append(b)
        b *= 2
    out.append(hi)
    return tuple(out)


# `max_request_bytes` when not set: a fixed allowance (JSON framing, sampling params, ids) plus, per token of
# context, the base64 of one 32x32 RGB patch (3 KiB raw -> 4 KiB), which is what an image token stands for.
REQUEST_BYTES_BASE = 8 << 20
REQUEST_BYTES_PER_TOKEN = 4 << 10


def bucket_for(n: int, buckets: tuple[int, ...], what: str) -> int:
    """Smallest bucket >= n."""
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"{what}={n} exceeds the largest bucket {buckets[-1]}")


@dataclass(frozen=True)
class EngineOptions:
    """max_batch: most requests decoding at once (SGLang's max_running_requests): the width of the
    per-request sampling arrays and the largest decode batch. max_seq_len: most tokens of one request,
    prompt (pads expanded) plus output (SGLang's context_length).
    page_size: tokens per KV page (SGLang's page_size); a request holds ceil(tokens / page_size)
    pages; a shared prefix shares its whole pages and copies its partly shared last page.
    max_total_tokens: the KV memory, in tokens, of all requests and the prefix cache together
    (SGLang's max_total_tokens; None: max_batch x max_seq_len rounded up to whole pages per request,
    the memory of one max_seq_len row per running request); it is split into max_total_tokens //
    page_size pages. How many requests run at once is bounded by these pages (requests wait for free
    pages; a request that cannot grow is retracted) and by max_batch.
    min_prefill_bucket / min_kv_bucket / min_patch_bucket: smallest prompt, attended-cache and
    image-patch buckets (then doubling up to the maximum). decode_batch_sizes: batch buckets for
    decode (default: powers of two up to max_batch). param_dtype / compute_dtype: "float32" or
    "bfloat16"; the cache uses compute_dtype. seed: draws the seed of requests without
    `sampling_seed`. max_prefills_per_step: admissions between two decode steps.
    prefix_cache: keep the K/V pages of prefilled and finished requests in a radix tree and let a
    new request whose prompt starts with the same tokens and images reuse them, prefilling only the
    rest (the next turn of a multi-turn episode re-sends the whole conversation; the n samples of a
    group share their prompt). SGLang's radix cache (`--disable-radix-cache` turns it off).

    What the server accepts (`rollout.sglang_wire`, `rollout.processing`):
    allowed_local_media_path: `image_data` may name local image files only under this directory (None: data
    URLs and base64 only). max_image_bytes / max_image_pixels: caps of one image, checked before it is read
    or decoded. max_n: the most generations one `/generate` body may start (n x prompts). max_request_bytes:
    the largest request body (None: REQUEST_BYTES_BASE + REQUEST_BYTES_PER_TOKEN x max_seq_len, see
    `request_bytes_cap`). control_timeout_s: how long a control call (pause, continue, flush, loads, server
    info) waits for the scheduler before answering 503. weight_update_timeout_s: the same for
    `/update_weights_from_disk` (which waits for in-flight generations unless paused); an update that has
    not started by then is dropped.

    Placement (`placement.py`): tp_size devices per replica (tensor parallel, SGLang's --tp-size), dp_size
    replicas (SGLang's --dp-size), on the local devices `device_ids` (exactly tp_size x dp_size of them; None:
    the first tp_size x dp_size).
    """

    max_batch: int = 32
    max_seq_len: int = 4096
    min_prefill_bucket: int = 64
    min_kv_bucket: int = 256
    min_patch_bucket: int = 64
    decode_batch_sizes: tuple[int, ...] | None = None
    param_dtype: str = "float32"
    compute_dtype: str = "float32"
    seed: int = 0
    max_prefills_per_step: int = 64
    page_size: int = 16
    max_total_tokens: int | None = None
    prefix_cache: bool = True
    allowed_local_media_path: str | None = None
    max_image_bytes: int = DEFAULT_MAX_IMAGE_BYTES
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    max_n: int = DEFAULT_MAX_N
    max_request_bytes: int | None = None
    control_timeout_s: float = 60.0
    weight_update_timeout_s: float = 600.0
    tp_size: int = 1
    dp_size: int = 1
    device_ids: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {self.max_batch}")
        if self.max_seq_len < 2:
            raise ValueError(f"max_seq_len must be >= 2, got {self.max_seq_len}")
        for name in ("param_dtype", "compute_dtype"):
            if getattr(self, name) not in _DTYPES:
                raise ValueError(f"{name}={getattr(self, name)!r}; choose one of {sorted(_DTYPES)}")
        if self.min_patch_bucket % 4:
            raise ValueError(f"min_patch_bucket={self.min_patch_bucket} must be a multiple of 4 (2x2 patch merge)")
        if self.decode_batch_sizes is not None:
            sizes = tuple(sorted(set(self.decode_batch_sizes)))
            if not sizes or sizes[0] < 1 or sizes[-1] != self.max_batch:
                raise ValueError(f"decode_batch_sizes={self.decode_batch_sizes} must be positive and end at max_batch={self.max_batch}")
        if self.max_prefills_per_step < 1:
            raise ValueError(f"max_prefills_per_step must be >= 1, got {self.max_prefills_per_step}")
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")
        if self.num_pages < self.pages_per_request:
            raise ValueError(f"max_total_tokens={self.max_total_tokens} holds {self.num_pages} pages of {self.page_size} "
                             f"tokens; one request of max_seq_len={self.max_seq_len} tokens needs {self.pages_per_request}")
        for name in ("max_image_bytes", "max_image_pixels", "max_n", "max_request_bytes"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.tp_size < 1 or self.dp_size < 1:
            raise ValueError(f"tp_size and dp_size must be >= 1, got tp_size={self.tp_size}, dp_size={self.dp_size}")
        if self.device_ids is not None and len(self.device_ids) != self.tp_size * self.dp_size:
            raise ValueError(f"device_ids {list(self.device_ids)} must name tp_size {self.tp_size} x dp_size "
                             f"{self.dp_size} = {self.tp_size * self.dp_size} devices")
        for name in ("control_timeout_s", "weight_update_timeout_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not 0 < value < float("inf"):
                raise ValueError(f"{name} must be a positive finite number of seconds, got {value!r}")

    @classmethod
    def from_run_config(cls, cfg: Config) -> EngineOptions:
        """The embedded engine of a run: its `engine` section (slots, context, prefix cache), the model's
        dtypes and the rollout seed. `serve` builds the same run config from its flags."""
        return cls(
            max_batch=cfg.engine.engine_max_batch,
            max_seq_len=cfg.engine.engine_max_seq_len,
            param_dtype=cfg.model.param_dtype,
            compute_dtype=cfg.model.compute_dtype,
            seed=cfg.rollout.rollout_seed,
            page_size=cfg.engine.engine_page_size,
            max_total_tokens=cfg.engine.engine_max_total_tokens,
            prefix_cache=cfg.engine.engine_prefix_cache,
            allowed_local_media_path=cfg.engine.engine_allowed_local_media_path,
            max_image_bytes=cfg.engine.engine_max_image_bytes,
            max_image_pixels=cfg.engine.engine_max_image_pixels,
            max_n=cfg.engine.engine_max_n,
            max_request_bytes=cfg.engine.engine_max_request_bytes,
            control_timeout_s=cfg.engine.engine_control_timeout,
            weight_update_timeout_s=cfg.engine.engine_weight_update_timeout,
            tp_size=cfg.engine.tp_size,
            dp_size=cfg.engine.dp_size,
            device_ids=cfg.engine.rollout_device_ids,
        )

    @property
    def num_pages(self) -> int:
        """Pages of the KV cache (by default, max_seq_len tokens' worth for each of max_batch requests)."""
        if self.max_total_tokens is None:
            return self.max_batch * self.pages_per_request
        return self.max_total_tokens // self.page_size

    @property
    def pages_per_request(self) -> int:
        """Most pages one request can hold (max_seq_len tokens): the width of a full page table."""
        return -(-self.max_seq_len // self.page_size)

    @property
    def request_bytes_cap(self) -> int:
        """The largest request body the server reads (`max_request_bytes`, or derived from max_seq_len)."""
        if self.max_request_bytes is not None:
            return self.max_request_bytes
        return REQUEST_BYTES_BASE + REQUEST_BYTES_PER_TOKEN * self.max_seq_len

    @property
    def image_policy(self) -> ImageReadPolicy:
        """How the server reads `image_data` items (see `ImageReadPolicy.for_server`)."""
        return ImageReadPolicy.for_server(self.allowed_local_media_path, max_bytes=self.max_image_bytes,
                                          max_pixels=self.max_image_pixels)

    @property
    def jnp_param_dtype(self) -> jnp.dtype:
        return _DTYPES[self.param_dtype]

    @property
    def jnp_compute_dtype(self) -> jnp.dtype:
        return _DTYPES[self.compute_dtype]

    @property
    def prefill_buckets(self) -> tuple[int, ...]:
        return powers_of_two(min(self.min_prefill_bucket, self.max_seq_len), self.max_seq_len)

    @property
    def kv_buckets(self) -> tuple[int, ...]:
        return powers_of_two(min(self.min_kv_bucket, self.max_seq_len), self.max_seq_len)

    @property
    def batch_buckets(self) -> tuple[int, ...]:
        if self.decode_batch_sizes is not None:
            return tuple(sorted(set(self.decode_batch_sizes)))
        return powers_of_two(1, self.max_batch)

    def patch_bucket(self, n_patches: int) -> int:
        b = self.min_patch_bucket
        while b < n_patches:
            b *= 2
        return b
