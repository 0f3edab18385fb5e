"""Embedded-engine options: slot count, context length, shape buckets, dtypes; shared by `train` and `serve`.

Every device program is compiled for a bucket, so the number of programs is bounded by the bucket
lists here: prefill per (prompt bucket, patch bucket or none), extend (a prefill after a cached
prefix) per (suffix bucket, kv-length bucket, patch bucket or none), decode per (batch bucket,
kv-length bucket, filtered), "filtered" being whether any row of the batch uses top-k / top-p / min-p.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax.numpy as jnp

from jaxrl_vlm.config import Config

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


def bucket_for(n: int, buckets: tuple[int, ...], what: str) -> int:
    """Smallest bucket >= n."""
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"{what}={n} exceeds the largest bucket {buckets[-1]}")


@dataclass(frozen=True)
class EngineOptions:
    """max_batch: KV-cache slots = most requests decoding at once (SGLang's max_running_requests).
    max_seq_len: tokens per slot, prompt (pads expanded) plus output (SGLang's context_length).
    min_prefill_bucket / min_kv_bucket / min_patch_bucket: smallest prompt, attended-cache and
    image-patch buckets (then doubling up to the maximum). decode_batch_sizes: batch buckets for
    decode (default: powers of two up to max_batch). param_dtype / compute_dtype: "float32" or
    "bfloat16"; the cache uses compute_dtype. seed: draws the seed of requests without
    `sampling_seed`. max_prefills_per_step: admissions between two decode steps.
    prefix_cache: keep the K/V of finished requests in their (now free) slots and let a new request
    whose prompt starts with the same tokens and images reuse it, prefilling only the rest (the next
    turn of a multi-turn episode re-sends the whole conversation). prefix_cache_min_tokens: the
    shortest prefix worth reusing: a shorter match (a chat-template header) rarely shrinks the
    padded prefill bucket, so it is not worth taking a warm slot or copying its rows.
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
    prefix_cache: bool = True
    prefix_cache_min_tokens: int = 32

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
        if self.prefix_cache_min_tokens < 1:
            raise ValueError(f"prefix_cache_min_tokens must be >= 1, got {self.prefix_cache_min_tokens}")

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
            prefix_cache=cfg.engine.engine_prefix_cache,
        )

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
