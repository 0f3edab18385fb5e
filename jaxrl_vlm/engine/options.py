"""Embedded-engine options: running requests, KV pages, context length, shape buckets, dtypes; shared by `train` and `serve`.

Each option is declared once, here (`opt`: default, help, bounds, choices). `jaxrl-vlm serve` makes a flag of
every field; the run config holds each field that names a `key` under that name (its engine section, or an option
of another section such as `rollout_seed`), and `from_run_config` reads them back. This module imports no jax, so
the run config can compose it.

Every device program is compiled for a bucket, so the number of programs is bounded by the bucket
lists here: prefill per (prompt bucket, patch bucket or none), extend (a prefill after a cached
prefix) per (suffix bucket, kv-length bucket, patch bucket or none), decode per (batch bucket,
kv-length bucket, filtered), "filtered" being whether any row of the batch uses top-k / top-p / min-p.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from jaxrl_vlm.devices import parse_device_ids
from jaxrl_vlm.models.config import ATTENTION_IMPLS
from rollout.options import RolloutOptions, bound_error, opt, option_of
from rollout.processing import DEFAULT_MAX_IMAGE_BYTES, DEFAULT_MAX_IMAGE_PIXELS, ImageReadPolicy
from rollout.sglang_wire import DEFAULT_MAX_N

# The dtypes of a model's parameters and activations, one list for the trainer (whose `--param-dtype` and
# `--compute-dtype` are these fields, `jaxrl_vlm.config.ModelConfig`), its weight export and the engine, which in a
# run serves the trainer's weights in the trainer's dtypes. No float16: the trainer has no loss scaling for it, and
# it was never tested in the engine.
DTYPES = ("float32", "bfloat16")


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
    """The embedded engine's options. KV memory: a request holds ceil(tokens / page_size) pages of the
    max_total_tokens // page_size pages; how many requests run at once is bounded by these pages (requests wait
    for free pages; a request that cannot grow is retracted) and by max_batch. Bucket lists start at the
    `min_*_bucket` options and double up to the maximum."""

    max_batch: int = opt(
        32, "Most requests decoding at once (SGLang's max_running_requests): the width of the per-request sampling "
        "arrays and the largest decode batch.", ge=1, key="engine_max_batch")
    max_seq_len: int = opt(
        4096, "Most tokens of one request: prompt (image pads expanded) + output (SGLang's context_length).", ge=2,
        key="engine_max_seq_len")
    min_prefill_bucket: int = opt(64, "Smallest prompt bucket (then doubling up to max_seq_len).", ge=1)
    min_kv_bucket: int = opt(64, "Smallest attended-cache bucket (then doubling up to max_seq_len).", ge=1)
    min_patch_bucket: int = opt(64, "Smallest image-patch bucket, a multiple of 4 (2x2 patch merge).", ge=4)
    decode_batch_sizes: tuple[int, ...] | None = opt(
        None, "Batch buckets of decode, ending at max_batch (None: powers of two up to max_batch).")
    param_dtype: str = opt("float32", "Dtype of the engine's parameters (in a run: the trainer's --param-dtype).",
                           choices=DTYPES, key="param_dtype")
    compute_dtype: str = opt("float32", "Dtype of activations and of the KV cache (in a run: the trainer's "
                             "--compute-dtype).", choices=DTYPES, key="compute_dtype")
    attention_impl: str = opt(
        "xla", "Attention of the engine's model: xla (and ring) gather each request's KV pages into a dense array for "
        "decode; pallas_gpu / pallas_tpu decode with a paged kernel that reads the pages in place (Triton / Mosaic; "
        "Pallas' interpreter on a CPU backend; tp_size 1 only). In a run: the trainer's --attention-impl.",
        choices=ATTENTION_IMPLS, key="attention_impl")
    seed: int = option_of(RolloutOptions, "rollout_seed", "Draws the seed of requests that carry no sampling_seed.")
    max_prefills_per_step: int = opt(64, "Admissions between two decode steps.", ge=1)
    prefill_batch_tokens: int | None = opt(
        None, "Text prompts of a short prompt bucket prefill side by side in one forward, this many tokens at once "
        "(rows of a T-token bucket go this // T at a time, padded: a group's samples, a turn's observations). On an "
        "accelerator a forward of fewer tokens than about its flops per byte of memory bandwidth reads the weights "
        "more than it computes, so one forward of several short prompts costs about one of them, where a forward per "
        "prompt reads the weights once per prompt. 0: one prompt per forward. None: 256 on a GPU or TPU (about "
        "where their forwards turn compute-bound), 0 on a CPU (which computes every padding row). Families with "
        "recurrent state (Qwen3.5) always prefill one prompt at a time.", ge=0,
        key="engine_prefill_batch_tokens")
    page_size: int = opt(16, "Tokens per KV-cache page (SGLang's page_size); a shared prefix shares its whole pages "
                         "and copies its partly shared last page.", ge=1, key="engine_page_size")
    max_total_tokens: int | None = opt(
        None, "KV-cache memory in tokens, shared by all requests and the prefix cache (SGLang's max_total_tokens; "
        "None: max_batch x max_seq_len, rounded up to whole pages per request).", ge=1, key="engine_max_total_tokens")
    prefix_cache: bool = opt(
        True, "Keep prefilled and finished requests' KV pages in a radix tree, so a group's samples share their prompt "
        "and a later turn of the same conversation prefills only its new tokens (and new images); SGLang's radix "
        "cache.", key="engine_prefix_cache", flags=("--disable-radix-cache",))
    state_snapshots: int = opt(
        32, "Prefix-cache snapshots of recurrent state, for a family with linear-attention layers (Qwen3.5): each the "
        "size of one request's conv and delta-rule state, which a prefix's pages alone cannot restore. A group's "
        "samples continue from their prompt's snapshot and a later turn from its conversation's (least recently "
        "used dropped first); 0 turns prefix reuse off for such a family. Unused by full-attention families.", ge=0,
        key="engine_state_snapshots")
    overlap_schedule: bool = opt(
        True, "Dispatch decode step n + 1 (fed with step n's sampled ids on the device) before reading step n's "
        "results, so the host's bookkeeping runs while the device computes (SGLang's overlap scheduler). A step whose "
        "rows change (an admission, a finish, an abort), a family with recurrent state (Qwen3.5: a finished row's "
        "extra step would move the state it snapshots), or another user of the devices waiting (`device_lock`) runs "
        "one step at a time.", key="engine_overlap_schedule", flags=("--disable-overlap-schedule",))
    freeze_gc: bool = opt(
        True, "Freeze the interpreter's garbage-collector heap while the engine serves (gc.freeze, as vLLM does once "
        "its server has started; SGLang's /freeze_gc freezes again after warm-up): a full collection of the "
        "half-million objects a loaded process holds pauses every thread for 0.1-0.3 s, mid-decode. Unfrozen when "
        "the last engine of the process stops.", key="engine_freeze_gc")
    allowed_local_media_path: str | None = opt(
        None, "image_data may name local image files only under this directory (None: data URLs and base64 only).",
        key="engine_allowed_local_media_path")
    max_image_bytes: int = opt(DEFAULT_MAX_IMAGE_BYTES, "Most bytes of one image the engine reads or decodes from "
                               "base64.", ge=1, key="engine_max_image_bytes")
    max_image_pixels: int = opt(DEFAULT_MAX_IMAGE_PIXELS, "Most pixels of one image (checked from its header, before "
                                "decoding).", ge=1, key="engine_max_image_pixels")
    max_n: int = opt(DEFAULT_MAX_N, "Most generations one /generate request may start (sampling_params.n x prompts).",
                     ge=1, key="engine_max_n")
    max_request_bytes: int | None = opt(
        None, "The largest request body (None: REQUEST_BYTES_BASE 8 MiB + REQUEST_BYTES_PER_TOKEN 4 KiB per token of "
        "max_seq_len).", ge=1, key="engine_max_request_bytes")
    control_timeout_s: float = opt(
        60.0, "Seconds a control call (pause, continue, flush, loads, server info) waits for the scheduler before "
        "answering 503.", gt=0.0, key="engine_control_timeout", flags=("--control-timeout",))
    weight_update_timeout_s: float = opt(
        600.0, "Seconds /update_weights_from_disk waits for the scheduler (which waits for in-flight generations "
        "unless paused) before answering 503; an update that has not started by then is dropped.", gt=0.0,
        key="engine_weight_update_timeout", flags=("--weight-update-timeout",))
    tp_size: int = opt(1, "Tensor-parallel devices per engine replica (SGLang's --tp-size; a run also passes it to a "
                       "launched SGLang).", ge=1, key="tp_size")
    dp_size: int = opt(1, "Engine replicas behind one server (SGLang's --dp-size; a run also passes it to a launched "
                       "SGLang).", ge=1, key="dp_size")
    ep_size: int = opt(1, "Expert parallelism inside each replica (SGLang's --ep-size): the routed experts of an MoE "
                       "model split over this many of its tp_size devices (it must divide tp_size), each expert's "
                       "width over the rest; dense layers stay tp_size-way.", ge=1, key="ep_size")
    device_ids: tuple[int, ...] | str | None = opt(
        None, "Local devices of the engine, as ids or a list like '0-3' / '0,1,2,3' (exactly tp_size x dp_size of "
        "them; None: the first tp_size x dp_size).", key="rollout_devices", flags=("--devices",))

    def __post_init__(self) -> None:
        if isinstance(self.device_ids, str):  # a device list as written in a config or on the command line
            object.__setattr__(self, "device_ids", parse_device_ids(self.device_ids, "device_ids"))
        if isinstance(self.decode_batch_sizes, list):  # from a command line; options stay hashable
            object.__setattr__(self, "decode_batch_sizes", tuple(self.decode_batch_sizes))
        for f in dataclasses.fields(self):
            value, meta = getattr(self, f.name), f.metadata
            if meta["choices"] is not None and value not in meta["choices"]:
                raise ValueError(f"{f.name}={value!r}; choose one of {list(meta['choices'])}")
            if value is None or not any(meta[b] is not None for b in ("gt", "ge", "lt", "le")):
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{f.name} must be a finite number, got {value!r}")
            problem = bound_error(f.name, value, meta)
            if problem:
                raise ValueError(problem)
        if self.min_patch_bucket % 4:
            raise ValueError(f"min_patch_bucket={self.min_patch_bucket} must be a multiple of 4 (2x2 patch merge)")
        if self.decode_batch_sizes is not None:
            sizes = tuple(sorted(set(self.decode_batch_sizes)))
            if not sizes or sizes[0] < 1 or sizes[-1] != self.max_batch:
                raise ValueError(f"decode_batch_sizes={self.decode_batch_sizes} must be positive and end at max_batch={self.max_batch}")
        if self.num_pages < self.pages_per_request:
            raise ValueError(f"max_total_tokens={self.max_total_tokens} holds {self.num_pages} pages of {self.page_size} "
                             f"tokens; one request of max_seq_len={self.max_seq_len} tokens needs {self.pages_per_request}")
        if self.attention_impl in ("pallas_gpu", "pallas_tpu") and self.tp_size > 1:
            raise ValueError(f"attention_impl={self.attention_impl!r} with tp_size {self.tp_size}: the paged decode "
                             "kernel is not split over tensor-parallel devices yet; use attention_impl 'xla' or "
                             "tp_size 1 (dp_size scales out)")
        if self.tp_size % self.ep_size:
            raise ValueError(f"ep_size {self.ep_size} must divide tp_size {self.tp_size}: experts are split over ep "
                             "of a replica's tp devices")
        if self.device_ids is not None and len(self.device_ids) != self.tp_size * self.dp_size:
            raise ValueError(f"device_ids {list(self.device_ids)} must name tp_size {self.tp_size} x dp_size "
                             f"{self.dp_size} = {self.tp_size * self.dp_size} devices")

    @classmethod
    def from_run_config(cls, cfg: Any) -> EngineOptions:
        """The embedded engine of a run: every field with a run-config `key` takes that option of `cfg` (a
        `jaxrl_vlm.config.Config`, read through `cfg.option(key)`; this module cannot import it, the config
        composes these fields); the others keep their defaults."""
        return cls(**{f.name: cfg.option(f.metadata["key"]) for f in dataclasses.fields(cls) if f.metadata["key"]})

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
    def jnp_param_dtype(self) -> Any:
        import jax.numpy as jnp  # here: the run config imports this module without jax

        return getattr(jnp, self.param_dtype)  # jnp.float32, jnp.bfloat16, jnp.float16

    @property
    def jnp_compute_dtype(self) -> Any:
        import jax.numpy as jnp

        return getattr(jnp, self.compute_dtype)

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
