"""Decode attention that reads the paged K/V cache in place: the engine's decode under `attention_impl:
pallas_gpu | pallas_tpu` (`paged_kv.decode_attention` picks it; `xla` and `ring` keep the gather).

Why not the gather: the XLA decode copies every page of each request's table into a dense [B, P * page_size,
K, H] array per layer before attending, so each step reads the attended cache twice and writes it once. A paged
kernel walks each request's page table and reads its pages from the pool where they lie.

Why our own kernels and not jax's (`jax.experimental.pallas.ops.tpu.paged_attention`,
`...ops.tpu.ragged_paged_attention`, `...ops.gpu.paged_attention`): all three take one layer's pool in their own
layout, [K, pages, page_size, H] (paged) or K and V interleaved on one heads axis [pages, page_size, 2K, H]
(ragged). The engine's cache is every layer's pool stacked, [L, pages, page_size, K, H] (`paged_kv.KVCache`, and
the full-attention layers of the hybrid caches), so calling them would first copy or transpose a layer's whole
pool each step: more memory traffic than the gather, whenever the pool is larger than the running batch's
context. The kernels here take the stacked cache and a static layer index, and address pages of that layer
directly (GPU: a block pointer into the stacked array; TPU: scalar-prefetched page tables driving the block
DMAs), with the same online-softmax (flash) recurrence as jax's kernels and fp32 accumulation.

Contract of both: one query per request (decode), at sequence position lengths_b; it attends to positions
[0, lengths_b] of its table (lengths_b + 1 keys, the new token's K/V already written). Grouped-query heads:
query head n uses kv head n // (N / K). Table entries past a row's length are never read; padding entries
(`num_pages`) inside it are clamped to the last page (a padding row's output is garbage and discarded, as the
gather path's is).

The interpreter: on a CPU backend the kernels run in Pallas' interpreter (`interpret=None` -> the backend is
cpu; the GPU kernel with `interpret=True`, the TPU kernel with `pltpu.InterpretParams()`), which is how the
tests check them against the gather path. The CPU engine's default (`xla`) never gets here.

Checked in the interpreter and lowered (Pallas -> Mosaic, Pallas -> Triton) without a device, never yet compiled
or run on one. The hardware constraints in `kernel_constraint_error` are Triton's (power-of-two tiles, dots of at
least 16) and Mosaic's (sublane-aligned pages); a cache that breaks one is refused with a message naming it,
never silently sent to the gather. The cache must be whole on the device (no kv heads split over `tensor`): the
kernel is not wrapped in `shard_map`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pltriton

IMPLS = ("pallas_gpu", "pallas_tpu")
# A finite "minus infinity": an all-masked page then gives exp(-huge) = 0, never inf - inf.
_MASK = -0.7 * float(jnp.finfo(jnp.float32).max)
# Triton's `dot` needs every dimension of at least 16: query heads of a kv head are padded to this.
_GPU_MIN_DOT = 16


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def kernel_constraint_error(impl: str, *, page_size: int, head_dim: int, num_heads: int, kv_heads: int,
                            interpret: bool) -> str | None:
    """Why the paged kernel of `impl` cannot run this cache, in words a user can act on; None when it can.
    The interpreter has none of the hardware's tiling limits, so with `interpret` only the shape contract holds."""
    if impl not in IMPLS:
        return f"attention_impl={impl!r} has no paged decode kernel; choose one of {IMPLS}"
    if num_heads % kv_heads:
        return f"num_attention_heads={num_heads} is not a multiple of num_key_value_heads={kv_heads}"
    if interpret:
        return None
    if impl == "pallas_gpu":
        if not (_pow2(page_size) and page_size >= _GPU_MIN_DOT):
            return (f"attention_impl=pallas_gpu: the paged decode kernel needs a power-of-two page_size of at least "
                    f"{_GPU_MIN_DOT} (Triton tiles), got page_size={page_size}")
        if not (_pow2(head_dim) and head_dim >= _GPU_MIN_DOT):
            return (f"attention_impl=pallas_gpu: the paged decode kernel needs a power-of-two head_dim of at least "
                    f"{_GPU_MIN_DOT} (Triton tiles), got head_dim={head_dim}")
    if impl == "pallas_tpu" and page_size % 8:
        return (f"attention_impl=pallas_tpu: the paged decode kernel needs page_size a multiple of 8 (Mosaic "
                f"sublanes), got page_size={page_size}")
    return None


def paged_decode_attention(q_bnh: jax.Array, k_all: jax.Array, v_all: jax.Array, layer: int, tables_bp: jax.Array,
                           lengths_b: jax.Array, *, scale: float, impl: str,
                           interpret: bool | None = None) -> jax.Array:
    """Decode attention of layer `layer` straight from the paged cache.

    q_bnh [B, N, H]: each row's one query; k_all / v_all [L, num_pages, page_size, K, H]: the stacked cache with
    this step's K/V already written; tables_bp int32 [B, P] (padded with num_pages); lengths_b int32 [B]: the
    query's sequence position (it attends to [0, lengths_b]). Returns [B, N, H] in q's dtype (softmax and
    accumulation in fp32). `interpret`: None runs Pallas' interpreter on a CPU backend. Raises ValueError naming the
    constraint when `impl` cannot run these shapes (`kernel_constraint_error`)."""
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    _, num_pages, page_size, kv_heads, head_dim = k_all.shape
    problem = kernel_constraint_error(impl, page_size=page_size, head_dim=head_dim, num_heads=q_bnh.shape[1],
                                      kv_heads=kv_heads, interpret=interpret)
    if problem:
        raise ValueError(f"{problem} (or use attention_impl: xla, the gather path)")
    tables_bp = tables_bp.astype(jnp.int32)
    lengths_b = lengths_b.astype(jnp.int32)
    if impl == "pallas_gpu":
        return _gpu(q_bnh, k_all, v_all, layer, tables_bp, lengths_b, float(scale), interpret)
    return _tpu(q_bnh, k_all, v_all, layer, tables_bp, lengths_b, float(scale), interpret)


def _online_softmax_step(q, k, v, valid, m, l, acc, scale):
    """One page of the flash recurrence: q [G, H], k/v [S, H], valid bool [S]; m, l [G, 1], acc [G, H] fp32."""
    s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32) * scale  # [G, S]
    s = jnp.where(valid[None, :], s, _MASK)
    m_new = jnp.maximum(m, s.max(axis=-1, keepdims=True))
    p = jnp.exp(s - m_new)
    alpha = jnp.exp(m - m_new)
    l_new = alpha * l + p.sum(axis=-1, keepdims=True)
    acc_new = alpha * acc + lax.dot_general(p, v, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
    return m_new, l_new, acc_new


# ------------------------------------------------------------------------------------------------- GPU (Triton)
def _gpu_kernel(tables_ref, length_ref, q_ref, k_ref, v_ref, o_ref, *, scale: float, num_pages: int,
                page_size: int):
    """Grid (row b, kv head g). q_ref [Gp, H] (the kv head's query heads, padded), k_ref / v_ref [pages,
    page_size, H] (layer `layer`, kv head g: a view of the stacked cache), tables_ref [P], length_ref [1]."""
    length = length_ref[0]
    q = q_ref[...].astype(jnp.float32)
    gp, h = q.shape

    def body(j, carry):
        m, l, acc = carry
        page = jnp.minimum(tables_ref[j], num_pages - 1)
        k = k_ref[page].astype(jnp.float32)  # [S, H]
        v = v_ref[page].astype(jnp.float32)
        valid = j * page_size + jnp.arange(page_size) <= length
        return _online_softmax_step(q, k, v, valid, m, l, acc, scale)

    init = (jnp.full((gp, 1), _MASK, jnp.float32), jnp.zeros((gp, 1), jnp.float32), jnp.zeros((gp, h), jnp.float32))
    pages = jnp.minimum(length // page_size + 1, tables_ref.shape[0])  # the table bounds what is attended
    m, l, acc = lax.fori_loop(0, pages, body, init)
    o_ref[...] = (acc / l).astype(o_ref.dtype)


def _gpu(q_bnh, k_all, v_all, layer, tables_bp, lengths_b, scale, interpret):
    b, n, h = q_bnh.shape
    _, num_pages, page_size, kv_heads, _ = k_all.shape
    g = n // kv_heads
    gp = max(_GPU_MIN_DOT, 1 << (g - 1).bit_length())
    q = q_bnh.reshape(b, kv_heads, g, h)
    if gp != g:
        q = jnp.pad(q, ((0, 0), (0, 0), (0, gp - g), (0, 0)))
    pages_spec = pl.BlockSpec((None, num_pages, page_size, None, h), lambda i, kv: (layer, 0, 0, kv, 0))
    out = pl.pallas_call(
        functools.partial(_gpu_kernel, scale=scale, num_pages=num_pages, page_size=page_size),
        grid=(b, kv_heads),
        in_specs=[
            pl.BlockSpec((None, tables_bp.shape[1]), lambda i, kv: (i, 0)),
            pl.BlockSpec((1,), lambda i, kv: (i,)),
            pl.BlockSpec((None, None, gp, h), lambda i, kv: (i, kv, 0, 0)),
            pages_spec,
            pages_spec,
        ],
        out_specs=pl.BlockSpec((None, None, gp, h), lambda i, kv: (i, kv, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((b, kv_heads, gp, h), q_bnh.dtype),
        interpret=interpret,
        # Triton's params: without them jax 0.10 lowers a GPU kernel with Mosaic GPU, which this kernel is not.
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=2),
        name="paged_decode_attention_gpu",
    )(tables_bp, lengths_b, q, k_all, v_all)
    return out[:, :, :g].reshape(b, n, h)


# ------------------------------------------------------------------------------------------------- TPU (Mosaic)
def _tpu_kernel(tables_ref, lengths_ref, q_ref, k_ref, v_ref, o_ref, m_ref, l_ref, acc_ref, *, scale: float,
                page_size: int, kv_heads: int):
    """Grid (row b, table column j), j innermost. tables_ref [B, P], lengths_ref [B] (scalar prefetch, SMEM);
    q_ref / o_ref [N, H] (row b); k_ref / v_ref [page_size, K, H]: page tables[b, j] of layer `layer`, DMA'd by
    the pipeline (a column past the row's length maps to the last needed page again, so it is not fetched)."""
    b, j = pl.program_id(0), pl.program_id(1)
    length = lengths_ref[b]

    @pl.when(j == 0)
    def _():
        m_ref[...] = jnp.full(m_ref.shape, _MASK, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    @pl.when(j * page_size <= length)
    def _():
        q = q_ref[...].astype(jnp.float32)
        n = q.shape[0]
        g = n // kv_heads
        valid = j * page_size + lax.broadcasted_iota(jnp.int32, (page_size,), 0) <= length
        for kv in range(kv_heads):  # static: each kv head with its query heads
            rows = slice(kv * g, (kv + 1) * g)
            k = k_ref[:, kv, :].astype(jnp.float32)
            v = v_ref[:, kv, :].astype(jnp.float32)
            m, l, acc = _online_softmax_step(q[rows], k, v, valid, m_ref[rows], l_ref[rows], acc_ref[rows], scale)
            m_ref[rows], l_ref[rows], acc_ref[rows] = m, l, acc

    @pl.when(j == pl.num_programs(1) - 1)
    def _():
        o_ref[...] = (acc_ref[...] / l_ref[...]).astype(o_ref.dtype)


def _tpu(q_bnh, k_all, v_all, layer, tables_bp, lengths_b, scale, interpret):
    b, n, h = q_bnh.shape
    _, num_pages, page_size, kv_heads, _ = k_all.shape
    p = tables_bp.shape[1]

    def page_block(i, j, tables, lengths):
        last = jnp.minimum(lengths[i] // page_size, p - 1)  # the page holding the query's own position
        page = jnp.minimum(tables[i, jnp.minimum(j, last)], num_pages - 1)
        return layer, page, 0, 0, 0

    pages_spec = pl.BlockSpec((None, None, page_size, kv_heads, h), page_block)
    row_spec = pl.BlockSpec((None, n, h), lambda i, j, tables, lengths: (i, 0, 0))
    return pl.pallas_call(
        functools.partial(_tpu_kernel, scale=scale, page_size=page_size, kv_heads=kv_heads),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(b, p),
            in_specs=[row_spec, pages_spec, pages_spec],
            out_specs=row_spec,
            scratch_shapes=[pltpu.VMEM((n, 1), jnp.float32), pltpu.VMEM((n, 1), jnp.float32),
                            pltpu.VMEM((n, h), jnp.float32)],
        ),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        out_shape=jax.ShapeDtypeStruct((b, n, h), q_bnh.dtype),
        interpret=pltpu.InterpretParams() if interpret else False,
        name="paged_decode_attention_tpu",
    )(tables_bp, lengths_b, q_bnh, k_all, v_all)
