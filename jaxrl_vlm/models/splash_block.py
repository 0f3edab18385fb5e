"""`pallas_tpu` under context parallelism: each device attends only its own queries, with jax's Splash kernel.

Why Splash: jax's TPU `flash_attention` puts the causal diagonal at query i = key i and takes one segment-id
array for queries and keys of equal length, so a device holding a block of a row's queries could only run it on
the whole gathered row, repeating the row's attention on every device of the group. Splash attention
(jax.experimental.pallas.ops.tpu.splash_attention) takes a mask object with a causal offset (`CausalMask(shape,
offset)`: query i attends key j when i + offset >= j), separate query and key segment ids, and skips the key
blocks its mask rules out entirely (the mask's block sparsity is computed when the program is traced).

The offset must be static, and a device's place in the context group is only known inside `shard_map`
(`axis_index`). So the queries go through the same zig-zag exchange as `pallas_gpu` (`block_flash.zigzag_exchange`:
device d attends chunks d and 2cp - 1 - d of the row's 2cp, so every device does equal causal work), and each chunk
is attended by a `lax.switch` over the group's devices whose branch d holds the kernel built for device d's chunk
offset (cp branches, each a Splash kernel with its own static mask). `chunk_attention` is the per-device step and
can be swapped (tests run the exchange with an XLA chunk on simulated devices, where the TPU interpreter cannot
run multi-device programs).

Splash takes no softmax scale: queries are scaled before the call. Heads must be expanded to one key/value head per
query head by the caller (as for the other kernels); the kernel attends one row of [heads, T, H] at a time.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

from jaxrl_vlm.models.block_flash import zigzag_delivered_chunks, zigzag_exchange

# A per-device chunk attention: (chunk queries [B, c, N, H], row keys and values [B, T, N, H], row segment ids
# [B, T], static offset of the chunk in the row) -> chunk outputs [B, c, N, H].
ChunkAttention = Callable[[jax.Array, jax.Array, jax.Array, jax.Array, int], jax.Array]


def splash_chunk_attention(q: jax.Array, k: jax.Array, v: jax.Array, kv_segment_ids: jax.Array, offset: int, *,
                           scale: float, block_q: int, block_k: int) -> jax.Array:
    """Queries q [B, c, N, H] at row positions [offset, offset + c) against the row's k/v [B, T, N, H], causal at
    those positions and within segments (`kv_segment_ids` [B, T]; the queries' are its slice). Splash kernel."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks

    c, n, t = q.shape[1], q.shape[2], k.shape[1]
    mask = masks.MultiHeadMask([masks.CausalMask((c, t), offset=offset)] * n)
    sizes = splash.BlockSizes(
        block_q=block_q, block_kv=block_k, block_kv_compute=block_k,
        block_q_dkv=block_q, block_kv_dkv=block_k, block_kv_dkv_compute=block_k,
        block_q_dq=block_q, block_kv_dq=block_k,
    )  # fmt: skip
    kernel = splash.make_splash_mha(mask, block_sizes=sizes, head_shards=1, q_seq_shards=1)
    segments = kv_segment_ids.astype(jnp.int32)
    q_segments = segments[:, offset:offset + c]

    def one_row(row):  # [N, T, H] arrays, as the kernel takes them
        q1, k1, v1, qs, ks = row
        return kernel(q1, k1, v1, segment_ids=splash.SegmentIds(qs, ks))

    heads_first = lambda x: jnp.swapaxes(x, 1, 2)  # noqa: E731 - [B, T, N, H] <-> [B, N, T, H]
    # Rows one after another (`lax.map`), not `vmap`: jax 0.10.2's TPU interpreter, which the tests run the kernel
    # in, fails on a batched Splash call; a device's micro-batch holds few rows, each a whole kernel's work.
    out = lax.map(one_row, (heads_first(q * jnp.asarray(scale, q.dtype)), heads_first(k), heads_first(v),
                            q_segments, segments))
    return heads_first(out)


def zigzag_static_offset_attention(q: jax.Array, k: jax.Array, v: jax.Array, kv_segment_ids: jax.Array, *,
                                   axis: str | tuple[str, ...], chunk_attention: ChunkAttention) -> jax.Array:
    """Inside `shard_map` over the context axis: this device's query block q [B, Tq, N, H] (block `axis_index` of a
    row of T = cp * Tq) against the row's k/v [B, T, N, H]; returns [B, Tq, N, H], causal at global positions.
    Each zig-zag chunk is attended by `chunk_attention` at the static offset of the device that holds it."""
    tq, t = q.shape[1], k.shape[1]
    cp = t // tq
    if cp * tq != t or tq % 2:
        raise ValueError(f"zig-zag attention needs the row's {t} keys to be cp x {tq} queries, an even block")
    c = tq // 2
    chunks = zigzag_delivered_chunks(cp)
    device = lax.axis_index(axis)

    def attend(chunk_q: jax.Array, which: int) -> jax.Array:
        branches = [
            (lambda offset: lambda x: chunk_attention(x, k, v, kv_segment_ids, offset))(chunks[d][which] * c)
            for d in range(cp)
        ]
        return lax.switch(device, branches, chunk_q)

    return zigzag_exchange(q, axis, cp, attend)
