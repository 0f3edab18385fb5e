"""Fused, segment-aware (flash) attention for the training forward: `attention_impl: pallas_gpu | pallas_tpu`.

Why: the XLA attention materializes fp32 logits [B, heads, T, T] per layer (for the 2B config at 8 x 4096
tokens that is ~8.6 GB, read and written several times with remat), and the vision tower's [heads, P, P]
over all patches of a micro-batch is worse. A flash kernel keeps O(T) memory and runs at matmul speed.

The kernels are jax's Pallas ones: `pallas_gpu` is the Triton `mha` (jax.experimental.pallas.ops.gpu.attention),
`pallas_tpu` the Mosaic `flash_attention` (jax.experimental.pallas.ops.tpu.flash_attention). Both take causal
or not, with segment ids (a token attends only within its segment — packing for text, one image per
segment for vision), forward and backward. Grouped-query heads are expanded to one key/value head per
query head before the call. On a CPU backend `pallas_gpu` runs in Pallas' interpreter by itself (slow;
used by the tests to check it against the XLA attention); `pallas_tpu` does when the caller holds
`jax.experimental.pallas.tpu.force_tpu_interpret_mode()` around compilation (the tests do).

Pallas calls cannot be split by XLA's sharding propagation, so under a mesh (`activation_sharding`
context) the call is wrapped in `shard_map`: rows split over the batch axes and heads over `tensor`,
the same layout the activation constraints give q/k/v, so no data moves. Under context parallelism (the
positions split over the `context` axis) each device keeps its contiguous block of queries and receives the
row's keys and values whole (one all-gather, as the XLA attention's `KV_WHOLE`): the causal text attention
runs on query chunks only, skipping key blocks after them, in zig-zag order (device d attends
chunks d and 2cp - 1 - d of the row's 2cp, the queries and outputs exchanged by `ppermute` inside the shard_map)
so the causal work is equal: `pallas_gpu` with our query-offset kernel (`block_flash.block_causal_attention`),
`pallas_tpu` with jax's Splash kernel built for each chunk's static offset (`splash_block`). Bidirectional
attention gathers the whole row for the call. Vision patches are attended whole (keys of one image may sit in
another batch shard): inside the vision tower rows are gathered for the attention call and split again after it.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from jaxrl_vlm.models import activation_sharding as act
from jaxrl_vlm.models.block_flash import zigzag_block_attention
from jaxrl_vlm.models.splash_block import splash_chunk_attention, zigzag_static_offset_attention

IMPLS = ("pallas_gpu", "pallas_tpu")
# Sequence tiles each kernel accepts, largest first (the kernels tile the sequence exactly; Mosaic's
# TPU tiles are multiples of 128 lanes).
BLOCK_CANDIDATES = {"pallas_gpu": (128, 64, 32, 16), "pallas_tpu": (512, 256, 128)}


def block_size(length: int, impl: str = "pallas_gpu") -> int:
    """The largest kernel block of `impl` that divides `length`."""
    for b in BLOCK_CANDIDATES[impl]:
        if length % b == 0:
            return b
    raise ValueError(
        f"attention_impl={impl} needs sequence lengths divisible by {BLOCK_CANDIDATES[impl][-1]}, got {length}; "
        "use seq/patch buckets that are multiples of 128 (or attention_impl: xla)"
    )


def _kernel(
    q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array, impl: str, scale: float, causal: bool
) -> jax.Array:
    """q [B, T, N, H], k/v [B, T, K, H], segment_ids [B, T] -> [B, T, N, H] on one device's block."""
    k, v = _expand_kv_heads(q, k, v)
    block = block_size(q.shape[1], impl)
    segment_ids = segment_ids.astype(jnp.int32)
    if impl == "pallas_tpu":
        # Backend kernels are imported only when selected (each pulls in its own Pallas backend).
        from jax.experimental.pallas.ops.tpu import flash_attention as tpu_attention

        sizes = tpu_attention.BlockSizes(
            block_q=block, block_k_major=block, block_k=block, block_b=1,
            block_q_major_dkv=block, block_k_major_dkv=block, block_k_dkv=block, block_q_dkv=block,
            block_k_major_dq=block, block_k_dq=block, block_q_dq=block,
        )  # fmt: skip
        heads_first = lambda x: jnp.swapaxes(x, 1, 2)  # noqa: E731 - the TPU kernel takes [B, N, T, H]
        out = tpu_attention.flash_attention(
            heads_first(q), heads_first(k), heads_first(v),
            segment_ids=tpu_attention.SegmentIds(segment_ids, segment_ids),
            causal=causal, sm_scale=scale, block_sizes=sizes,
        )  # fmt: skip
        return heads_first(out)
    from jax.experimental.pallas.ops.gpu import attention as gpu_attention

    sizes = gpu_attention.BlockSizes(
        block_q=block, block_k=block, block_q_dkv=block, block_kv_dkv=block, block_q_dq=block, block_kv_dq=block
    )
    return gpu_attention.mha(
        q, k, v, segment_ids, sm_scale=scale, causal=causal, block_sizes=sizes,
        interpret=jax.default_backend() == "cpu",
    )


def _expand_kv_heads(q: jax.Array, k: jax.Array, v: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Grouped-query attention for kernels with one kv head per query head: query head i uses kv head i // g."""
    n, kv = q.shape[2], k.shape[2]
    if n == kv:
        return k, v
    return jnp.repeat(k, n // kv, axis=2), jnp.repeat(v, n // kv, axis=2)


def _local_block(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array, *, impl: str, scale: float,
                 sequence_axes: str | tuple[str, ...]) -> jax.Array:
    """Inside shard_map: this device's query block q [B, Tq, N, H] (block `axis_index(sequence_axes)` of the row)
    against the row's k/v [B, T, K, H] and segment ids [B, T], causal at global positions. The queries are
    attended in zig-zag chunk order, so every device does equal work: our query-offset kernel
    (`block_flash.zigzag_block_attention`, pallas_gpu) or jax's Splash kernel at each chunk's static offset
    (`splash_block`, pallas_tpu)."""
    tile = BLOCK_CANDIDATES[impl][-1]
    if q.shape[1] % (2 * tile):
        raise ValueError(
            f"attention_impl={impl} under context parallelism splits each device's {q.shape[1]} queries into two "
            f"chunks of a multiple of {tile} tokens: rows of {k.shape[1]} tokens over {k.shape[1] // q.shape[1]} "
            f"devices need a multiple of {2 * tile * (k.shape[1] // q.shape[1])} (use larger seq buckets)"
        )
    k, v = _expand_kv_heads(q, k, v)
    block_q, block_k = block_size(q.shape[1] // 2, impl), block_size(k.shape[1], impl)
    if impl == "pallas_tpu":
        chunk = partial(splash_chunk_attention, scale=scale, block_q=block_q, block_k=block_k)
        return zigzag_static_offset_attention(q, k, v, segment_ids, axis=sequence_axes, chunk_attention=chunk)
    return zigzag_block_attention(q, k, v, segment_ids, axis=sequence_axes, scale=scale, block_q=block_q,
                                  block_k=block_k)


def _whole_rows(spec: PartitionSpec) -> tuple:
    """The 4 entries of a [B, T, heads, H] spec with the positions (T) unsplit."""
    entries = tuple(spec) + (None,) * (4 - len(spec))
    return (entries[0], None, *entries[2:])


def flash_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    segment_ids: jax.Array,
    *,
    impl: str = "pallas_gpu",
    scale: float,
    causal: bool,
    q_names: tuple[str | None, ...] = act.ROWS_Q,
    kv_names: tuple[str | None, ...] = act.ROWS_KV,
) -> jax.Array:
    """Softmax attention of q [B, T, N, H] over k/v [B, T, K, H] within segments (and causal if asked).

    `q_names` / `kv_names`: logical names of q and k/v (rows, -, heads, -) that give the shard_map layout
    under an `activation_sharding` context; outside one the kernel is called directly.
    """
    if impl not in IMPLS:
        raise ValueError(f"unknown fused attention {impl!r}; choose one of {IMPLS}")
    fn = partial(_kernel, impl=impl, scale=scale, causal=causal)
    spec = act.current()
    if spec is None:
        return fn(q, k, v, segment_ids)
    q_spec = spec.sharding(q_names, q.shape).spec
    kv_spec = spec.sharding(kv_names, k.shape).spec
    # Keys whole per device: a kernel call needs every key of its queries' row. The queries stay split over the
    # positions for causal attention (each device attends its own, in zig-zag chunks); bidirectional attention
    # (vision patches) gets whole rows.
    sequence_axes = (tuple(q_spec) + (None,) * 2)[1]
    per_shard = sequence_axes is not None and causal
    q_entries, kv_entries = _whole_rows(q_spec), _whole_rows(kv_spec)
    if q_entries[2] != kv_entries[2]:
        # The kv heads cannot be split like the query heads (e.g. 2 kv heads on 4 tensor shards): keep
        # every head whole on each device rather than pair query heads with the wrong kv heads.
        q_entries = q_entries[:2] + (None, None)
        kv_entries = kv_entries[:2] + (None, None)
    if q_entries[0] != kv_entries[0]:
        q_entries = (None,) + q_entries[1:]
        kv_entries = (None,) + kv_entries[1:]
    seg_spec = PartitionSpec(q_entries[0], None)
    kv_p = PartitionSpec(*kv_entries)
    if per_shard:
        q_p = PartitionSpec(q_entries[0], sequence_axes, *q_entries[2:])
        local = partial(_local_block, impl=impl, scale=scale, sequence_axes=sequence_axes)
        return jax.shard_map(
            local, mesh=spec.mesh, in_specs=(q_p, kv_p, kv_p, seg_spec), out_specs=q_p, check_vma=False
        )(q, k, v, segment_ids)
    q_p = PartitionSpec(*q_entries)
    return jax.shard_map(
        fn, mesh=spec.mesh, in_specs=(q_p, kv_p, kv_p, seg_spec), out_specs=q_p, check_vma=False
    )(q, k, v, segment_ids)
