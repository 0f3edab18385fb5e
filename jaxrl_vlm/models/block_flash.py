"""Causal, segment-aware flash attention of ONE BLOCK of a row's queries against the whole row's keys: the fused
kernel each device of a context-parallel group runs on its queries (`flash_attention`, `pallas_gpu`).

Why a kernel of our own: jax's Pallas kernels take one segment-id array for queries and keys of equal length and
put the causal diagonal at query i = key i, so a device holding queries [s, s + Tq) of a T-token row could only call
them on the whole gathered row, repeating the row's attention on every device of the group. Here the queries carry
their global offset `s` (a traced scalar), their own segment ids, and the keys the whole row's; query s + i attends
to key j when j <= s + i and the segments match. Key blocks wholly after a query block are never visited (forward
and dq loop over key blocks [0, last needed); dk/dv over query blocks from the first that can see the key block).

Load balance (`zigzag_block_attention`): with contiguous blocks device d of cp would do (2d + 1) / cp^2 of the
row's causal work, the last device 2 - 1/cp times the mean. So each device's block is cut in two chunks (2cp
chunks of the row in order), the chunks are exchanged inside the context group so that device d computes chunks d
and 2cp - 1 - d (one early, one late), one kernel call per chunk, and the outputs go back to their owners. Only
queries and outputs move; everything outside attention keeps the contiguous layout. The work is then exactly equal
when the query block divides the key block (the model's blocks are powers of two): m query blocks per chunk and
nk key blocks give every device m (nk + 1) tiles. `device_tiles` counts each device's work from the kernels' own
loop bounds (the same formulas, run on ints); tests/test_flash_attention.py checks both claims.

Written in Pallas' GPU (Triton) dialect: `interpret=True` on a CPU backend (the tests), compiled on GPUs.
Softmax in fp32 (natural log), forward saves the log-sum-exp per query row; backward is the FlashAttention-2
recomputation: delta = rowsum(o * do) in XLA, then one kernel for dq (grid over query blocks) and one for dk, dv
(grid over key blocks). Heads must be expanded to one key/value head per query head by the caller.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from functools import partial
from types import SimpleNamespace

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

# Masked logits: finite (an all-masked tile keeps exp() finite), far below any real logit.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def _mask(q_seg: jax.Array, kv_seg: jax.Array, q_start: jax.Array, k_start: jax.Array) -> jax.Array:
    """[bq, bk] bool: same segment and key position <= query position (global positions of the tile's rows)."""
    q_pos = q_start + lax.broadcasted_iota(jnp.int32, (q_seg.shape[0], kv_seg.shape[0]), 0)
    k_pos = k_start + lax.broadcasted_iota(jnp.int32, (q_seg.shape[0], kv_seg.shape[0]), 1)
    return (q_seg[:, None] == kv_seg[None, :]) & (q_pos >= k_pos)


# The arithmetic of the kernels' loop bounds: traced inside the kernels, on Python ints in `tiles_visited`.
_TRACED = SimpleNamespace(div=lax.div, minimum=jnp.minimum, maximum=jnp.maximum)
_INTS = SimpleNamespace(div=operator.floordiv, minimum=min, maximum=max)


def _key_blocks(offset, q_block, bq: int, bk: int, nk: int, ops=_TRACED):
    """Key blocks [0, n) that queries of block `q_block` (global start offset + q_block * bq) may attend to."""
    last = offset + (q_block + 1) * bq - 1
    return ops.minimum(nk, ops.div(last, bk) + 1)


def _first_query_block(offset, k_block, bq: int, bk: int, nq: int, ops=_TRACED):
    """The first query block whose last position reaches key block `k_block` (dk/dv loop over [first, nq))."""
    return ops.minimum(nq, ops.div(ops.maximum(k_block * bk - offset, 0), bq))


def _forward_kernel(off_ref, q_ref, k_ref, v_ref, qs_ref, ks_ref, o_ref, lse_ref, *, scale, bq, bk):
    i = pl.program_id(0)
    offset = off_ref[0]
    q = q_ref[...]
    q_seg = qs_ref[...]
    q_start = offset + i * bq

    def body(j, carry):
        acc, m, l = carry
        ks = pl.ds(j * bk, bk)
        k, v = k_ref[ks, :], v_ref[ks, :]
        s = jnp.dot(q, k.T, preferred_element_type=jnp.float32) * scale
        s = jnp.where(_mask(q_seg, ks_ref[ks], q_start, j * bk), s, MASK_VALUE)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        p = jnp.exp(s - m_new[:, None])
        alpha = jnp.exp(m - m_new)
        acc = alpha[:, None] * acc + jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)
        return acc, m_new, alpha * l + jnp.sum(p, axis=1)

    init = (jnp.zeros(q.shape, jnp.float32), jnp.full((bq,), MASK_VALUE, jnp.float32), jnp.zeros((bq,), jnp.float32))
    acc, m, l = lax.fori_loop(0, _key_blocks(offset, i, bq, bk, k_ref.shape[0] // bk), body, init)
    o_ref[...] = (acc / l[:, None]).astype(o_ref.dtype)
    lse_ref[...] = m + jnp.log(l)


def _dq_kernel(off_ref, q_ref, k_ref, v_ref, qs_ref, ks_ref, do_ref, lse_ref, delta_ref, dq_ref, *, scale, bq, bk):
    i = pl.program_id(0)
    offset = off_ref[0]
    q, do = q_ref[...], do_ref[...]
    q_seg, lse, delta = qs_ref[...], lse_ref[...], delta_ref[...]
    q_start = offset + i * bq

    def body(j, dq):
        ks = pl.ds(j * bk, bk)
        k, v = k_ref[ks, :], v_ref[ks, :]
        s = jnp.dot(q, k.T, preferred_element_type=jnp.float32) * scale
        p = jnp.where(_mask(q_seg, ks_ref[ks], q_start, j * bk), jnp.exp(s - lse[:, None]), 0.0)
        dp = jnp.dot(do, v.T, preferred_element_type=jnp.float32)
        ds = p * (dp - delta[:, None])
        return dq + jnp.dot(ds.astype(k.dtype), k, preferred_element_type=jnp.float32)

    dq = lax.fori_loop(0, _key_blocks(offset, i, bq, bk, k_ref.shape[0] // bk), body,
                       jnp.zeros(q.shape, jnp.float32))
    dq_ref[...] = (dq * scale).astype(dq_ref.dtype)


def _dkdv_kernel(off_ref, q_ref, k_ref, v_ref, qs_ref, ks_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref, *, scale,
                 bq, bk):
    j = pl.program_id(0)
    offset = off_ref[0]
    k, v, k_seg = k_ref[...], v_ref[...], ks_ref[...]
    k_start = j * bk
    nq = q_ref.shape[0] // bq
    first = _first_query_block(offset, j, bq, bk, nq)

    def body(i, carry):
        dk, dv = carry
        qs = pl.ds(i * bq, bq)
        q, do = q_ref[qs, :], do_ref[qs, :]
        lse, delta = lse_ref[qs], delta_ref[qs]
        s = jnp.dot(q, k.T, preferred_element_type=jnp.float32) * scale
        p = jnp.where(_mask(qs_ref[qs], k_seg, offset + i * bq, k_start), jnp.exp(s - lse[:, None]), 0.0)
        dv = dv + jnp.dot(p.T.astype(do.dtype), do, preferred_element_type=jnp.float32)
        dp = jnp.dot(do, v.T, preferred_element_type=jnp.float32)
        ds = p * (dp - delta[:, None])
        return dk + jnp.dot(ds.T.astype(q.dtype), q, preferred_element_type=jnp.float32), dv

    zeros = jnp.zeros(k.shape, jnp.float32)
    dk, dv = lax.fori_loop(first, nq, body, (zeros, zeros))
    dk_ref[...] = (dk * scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _specs(b_q: int, tq: int, tk: int, h: int, over_queries: bool) -> list:
    """BlockSpecs of (offset, q, k, v, q segments, kv segments) for a grid (blocks, B, N): the gridded operand is
    tiled in `b_q` rows (queries when `over_queries`, else keys), the other whole."""
    def rows(t: int, tiled: bool):
        if tiled:
            return pl.BlockSpec((None, b_q, None, h), lambda g, b, n: (b, g, n, 0))
        return pl.BlockSpec((None, t, None, h), lambda g, b, n: (b, 0, n, 0))

    def segs(t: int, tiled: bool):
        if tiled:
            return pl.BlockSpec((None, b_q), lambda g, b, n: (b, g))
        return pl.BlockSpec((None, t), lambda g, b, n: (b, 0))

    return [
        pl.BlockSpec((1,), lambda g, b, n: (0,)),
        rows(tq, over_queries), rows(tk, not over_queries), rows(tk, not over_queries),
        segs(tq, over_queries), segs(tk, not over_queries),
    ]


def _forward(q, k, v, q_seg, kv_seg, offset, scale, bq, bk, interpret):
    b, tq, n, h = q.shape
    tk = k.shape[1]
    return pl.pallas_call(
        partial(_forward_kernel, scale=scale, bq=bq, bk=bk),
        grid=(tq // bq, b, n),
        in_specs=_specs(bq, tq, tk, h, True),
        out_specs=[pl.BlockSpec((None, bq, None, h), lambda g, b, n: (b, g, n, 0)),
                   pl.BlockSpec((None, None, bq), lambda g, b, n: (b, n, g))],
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((b, n, tq), jnp.float32)],
        interpret=interpret,
        name="block_flash_forward",
    )(offset, q, k, v, q_seg, kv_seg)


@partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9))
def _block_attention(q, k, v, q_seg, kv_seg, offset, scale, bq, bk, interpret):
    return _forward(q, k, v, q_seg, kv_seg, offset, scale, bq, bk, interpret)[0]


def _block_attention_fwd(q, k, v, q_seg, kv_seg, offset, scale, bq, bk, interpret):
    o, lse = _forward(q, k, v, q_seg, kv_seg, offset, scale, bq, bk, interpret)
    return o, (q, k, v, q_seg, kv_seg, offset, o, lse)


def _block_attention_bwd(scale, bq, bk, interpret, res, do):
    q, k, v, q_seg, kv_seg, offset, o, lse = res
    b, tq, n, h = q.shape
    tk = k.shape[1]
    delta = jnp.einsum("bqnh,bqnh->bnq", o.astype(jnp.float32), do.astype(jnp.float32))
    per_row = [pl.BlockSpec((None, None, bq), lambda g, b, n: (b, n, g))] * 2  # lse, delta of the query block
    dq = pl.pallas_call(
        partial(_dq_kernel, scale=scale, bq=bq, bk=bk),
        grid=(tq // bq, b, n),
        in_specs=_specs(bq, tq, tk, h, True) + [pl.BlockSpec((None, bq, None, h), lambda g, b, n: (b, g, n, 0))]
        + per_row,
        out_specs=pl.BlockSpec((None, bq, None, h), lambda g, b, n: (b, g, n, 0)),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        interpret=interpret,
        name="block_flash_dq",
    )(offset, q, k, v, q_seg, kv_seg, do, lse, delta)
    whole_row = [pl.BlockSpec((None, None, tq), lambda g, b, n: (b, n, 0))] * 2
    dk, dv = pl.pallas_call(
        partial(_dkdv_kernel, scale=scale, bq=bq, bk=bk),
        grid=(tk // bk, b, n),
        in_specs=_specs(bk, tq, tk, h, False) + [pl.BlockSpec((None, tq, None, h), lambda g, b, n: (b, 0, n, 0))]
        + whole_row,
        out_specs=[pl.BlockSpec((None, bk, None, h), lambda g, b, n: (b, g, n, 0))] * 2,
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        interpret=interpret,
        name="block_flash_dkdv",
    )(offset, q, k, v, q_seg, kv_seg, do, lse, delta)
    return dq, dk, dv, None, None, None


_block_attention.defvjp(_block_attention_fwd, _block_attention_bwd)


def block_causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, q_segment_ids: jax.Array,
                           kv_segment_ids: jax.Array, offset: jax.Array, *, scale: float, block_q: int, block_k: int,
                           interpret: bool | None = None) -> jax.Array:
    """Causal, same-segment attention of queries q [B, Tq, N, H] at row positions [offset, offset + Tq) over the
    row's keys k/v [B, Tk, N, H] at positions [0, Tk); q_segment_ids [B, Tq], kv_segment_ids [B, Tk]; `offset` an
    int32 scalar (traced is fine). Returns [B, Tq, N, H]. Tq must divide by `block_q`, Tk by `block_k`.
    `interpret`: None runs Pallas' interpreter on a CPU backend."""
    tq, tk = q.shape[1], k.shape[1]
    if tq % block_q or tk % block_k:
        raise ValueError(f"block attention needs {tq} queries / {tk} keys divisible by blocks {block_q} / {block_k}")
    if k.shape[2] != q.shape[2]:
        raise ValueError(f"expand key/value heads to the {q.shape[2]} query heads first, got {k.shape[2]}")
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    offset = jnp.reshape(jnp.asarray(offset, jnp.int32), (1,))
    return _block_attention(q, k, v, q_segment_ids.astype(jnp.int32), kv_segment_ids.astype(jnp.int32), offset,
                            float(scale), block_q, block_k, interpret)


def tiles_visited(offset: int, tq: int, tk: int, block_q: int, block_k: int) -> tuple[int, int]:
    """(query block, key block) tiles one call of the kernel visits per row and head, for queries
    [offset, offset + tq) over tk keys: (forward = dq tiles, dk/dv tiles), each counted from its kernel's loop
    bounds. Both cover the same causal tiles, so they are equal."""
    nq, nk = tq // block_q, tk // block_k
    forward = sum(_key_blocks(offset, i, block_q, block_k, nk, _INTS) for i in range(nq))
    dkdv = sum(nq - _first_query_block(offset, j, block_q, block_k, nq, _INTS) for j in range(nk))
    return forward, dkdv


def query_chunks(device: int, cp: int, zigzag: bool = True) -> tuple[int, int]:
    """The chunks (of the row's 2cp equal chunks, in order) whose queries device `device` of cp attends:
    d and 2cp - 1 - d (zig-zag), or its own contiguous block 2d, 2d + 1."""
    return (device, 2 * cp - 1 - device) if zigzag else (2 * device, 2 * device + 1)


def device_tiles(t: int, cp: int, block_q: int, block_k: int, zigzag: bool = True) -> list[int]:
    """Forward tiles per device of a cp context group on a t-token row (the backward's are the same): kernel calls
    on chunks of t / (2cp) queries (zig-zag), or one call on the contiguous block of t / cp. `block_q`: the query
    block of those calls."""
    if zigzag:
        c = t // (2 * cp)
        return [sum(tiles_visited(ch * c, c, t, block_q, block_k)[0] for ch in query_chunks(d, cp)) for d in range(cp)]
    return [tiles_visited(d * t // cp, t // cp, t, block_q, block_k)[0] for d in range(cp)]


def zigzag_routes(cp: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """`ppermute` pairs (owner, attending device) that move every device's first half (chunk 2e) and second half
    (chunk 2e + 1) to the device that attends it (`query_chunks`); the inverse pairs bring the outputs back."""
    home = {chunk: d for d in range(cp) for chunk in query_chunks(d, cp)}
    return [(e, home[2 * e]) for e in range(cp)], [(e, home[2 * e + 1]) for e in range(cp)]


def zigzag_delivered_chunks(cp: int) -> list[tuple[int, int]]:
    """Per device, the chunks the two `zigzag_routes` deliver to it, in route order: (its even one, its odd one)."""
    return [tuple(sorted(query_chunks(d, cp), key=lambda ch: ch % 2)) for d in range(cp)]


def zigzag_exchange(q: jax.Array, axis: str | tuple[str, ...], cp: int,
                    attend: Callable[[jax.Array, int], jax.Array]) -> jax.Array:
    """Inside `shard_map` over the context axis `axis` (cp devices): this device's contiguous query block
    q [B, Tq, ...] (block `axis_index(axis)` of a row of cp * Tq positions) in zig-zag order and back.

    The block's halves are chunks 2e and 2e + 1 of the row. Two `ppermute`s (`zigzag_routes`) send every device's
    halves to the devices that attend them; device d then holds its chunks d and 2cp - 1 - d (one even, one odd:
    their sum is odd). `attend(chunk_queries, which)` computes the outputs of the chunk delivered by route `which`
    (0: this device's even chunk, 1: its odd one; `zigzag_delivered_chunks`), and the inverse permutations bring
    the outputs home. Returns [B, Tq, ...] outputs in q's layout."""
    c = q.shape[1] // 2
    outs = []
    for which, (half, route) in enumerate(zip((q[:, :c], q[:, c:]), zigzag_routes(cp))):
        o = attend(lax.ppermute(half, axis, route), which)
        outs.append(lax.ppermute(o, axis, [(dst, src) for src, dst in route]))
    return jnp.concatenate(outs, axis=1)


def zigzag_block_attention(q: jax.Array, k: jax.Array, v: jax.Array, kv_segment_ids: jax.Array, *,
                           axis: str | tuple[str, ...], scale: float, block_q: int, block_k: int,
                           interpret: bool | None = None) -> jax.Array:
    """Inside `shard_map` over the context axis `axis`: this device's contiguous query block q [B, Tq, N, H]
    (block `axis_index(axis)` of a row of T = cp * Tq) against the row's k/v [B, T, N, H] and segment ids
    kv_segment_ids [B, T]; returns this block's outputs [B, Tq, N, H], causal at global positions.

    The queries go through `zigzag_exchange`; each chunk runs the kernel at its own offset, read from this device's
    place in the group (query segment ids are sliced from the row's, so only q moves). `block_q` tiles a chunk."""
    tq, t = q.shape[1], k.shape[1]
    cp = t // tq
    if cp * tq != t or tq % 2:
        raise ValueError(f"zig-zag attention needs the row's {t} keys to be cp x {tq} queries, an even block")
    c = tq // 2
    mine = jnp.asarray(zigzag_delivered_chunks(cp), jnp.int32)[lax.axis_index(axis)]

    def attend(chunk_q: jax.Array, which: int) -> jax.Array:
        start = mine[which] * c
        q_seg = lax.dynamic_slice_in_dim(kv_segment_ids, start, c, axis=1)
        return block_causal_attention(chunk_q, k, v, q_seg, kv_segment_ids, start, scale=scale, block_q=block_q,
                                      block_k=block_k, interpret=interpret)

    return zigzag_exchange(q, axis, cp, attend)
