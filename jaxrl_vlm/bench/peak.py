"""Device facts a benchmark divides by: matmul peak (measured in the same run, and the datasheet value for
known accelerators) and per-device memory.

The measured peak is the best of several timed jitted chains of square matmuls on one device, in the
step's compute dtype: an achievable ceiling for XLA on this machine, so MFU against it says how much of
the reachable throughput the train step gets. On simulated CPU devices all "devices" share the host's
cores, so per-device MFU there is a correctness smoke number, not a performance claim.
"""

from __future__ import annotations

import os
import time
from typing import Any

import jax
import jax.numpy as jnp

# Dense (no sparsity) bf16 tensor-core peak per chip, vendor datasheets. Matched against
# `device.device_kind` in order: the first substring that matches wins.
KNOWN_BF16_PEAK_FLOPS: tuple[tuple[str, float], ...] = (
    ("H100 PCIe", 756e12),
    ("H100", 989e12),
    ("H200", 989e12),
    ("H800", 989e12),
    ("GH200", 989e12),
    ("B200", 2250e12),
    ("A100", 312e12),
    ("L40S", 362e12),
    ("TPU v4", 275e12),
    ("TPU v5 lite", 197e12),
    ("TPU v5e", 197e12),
    ("TPU v5p", 459e12),
    ("TPU v6", 918e12),
)


def known_peak_flops(device: Any, compute_dtype: Any) -> float | None:
    """Datasheet dense bf16 peak of `device` (None for other dtypes or unknown devices)."""
    if jnp.dtype(compute_dtype) != jnp.bfloat16:
        return None
    kind = str(getattr(device, "device_kind", ""))
    for key, flops in KNOWN_BF16_PEAK_FLOPS:
        if key.lower() in kind.lower():
            return flops
    return None


def default_matmul_size(device: Any) -> tuple[int, int]:
    """(n, chained matmuls) big enough to saturate the device, small enough to take well under a second."""
    return (8192, 16) if device.platform in ("gpu", "tpu") else (512, 4)


def measure_matmul_peak(device: Any, dtype: Any, n: int | None = None, chain: int | None = None, reps: int = 5) -> float:
    """Best FLOP/s of `chain` dependent n x n @ n x n matmuls in `dtype` on `device` (fp32 accumulation)."""
    dn, dc = default_matmul_size(device)
    n, chain = n or dn, chain or dc
    dtype = jnp.dtype(dtype)
    key_a, key_b = jax.random.split(jax.random.key(0))
    a = jax.device_put(jax.random.normal(key_a, (n, n), jnp.float32).astype(dtype), device)
    # Scaled so repeated products keep unit variance (no overflow to inf in bf16).
    b = jax.device_put((jax.random.normal(key_b, (n, n), jnp.float32) / n**0.5).astype(dtype), device)

    @jax.jit
    def chained(x, w):
        def body(_, acc):
            return jnp.dot(acc, w, preferred_element_type=jnp.float32).astype(dtype)

        return jax.lax.fori_loop(0, chain, body, x)

    chained(a, b).block_until_ready()  # compile + warm-up
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        chained(a, b).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    return 2.0 * n**3 * chain / best


def device_memory_bytes(device: Any) -> tuple[int, str]:
    """(bytes one device may use, where the number came from).

    Accelerators report `bytes_limit` in `memory_stats()`. CPU devices report nothing; simulated CPU
    devices share the host's RAM, so each gets an equal share of it.
    """
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if stats and stats.get("bytes_limit"):
        return int(stats["bytes_limit"]), "memory_stats.bytes_limit"
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    local = max(1, len([d for d in jax.local_devices() if d.platform == device.platform]))
    return int(total // local), f"host RAM / {local} local {device.platform} devices"


def peak_bytes_in_use(device: Any) -> int | None:
    """Allocator high-water mark of `device` so far in this process (None where not reported, e.g. CPU)."""
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if not stats or "peak_bytes_in_use" not in stats:
        return None
    return int(stats["peak_bytes_in_use"])
