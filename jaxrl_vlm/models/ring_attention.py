"""Ring attention for context parallelism in plain XLA: `attention_impl: ring`.

Why: the XLA attention under context parallelism (`layers.text_attention`) gathers the row's keys and values on
every device and materializes [Tq/cp, T] logits and a dense [B, T, T] mask, so a device's attention memory grows
with T^2 / cp. Here each device keeps its queries and the keys and values travel around the context group with
`lax.ppermute` (cp - 1 hops), so a device only ever holds one remote K/V block at a time in the forward pass, and
nothing of size T^2.

Layout: the model's activations hold contiguous blocks (device d: chunks 2d, 2d + 1 of the row's 2cp chunks). On
entry queries, keys, values and segment ids are moved to zig-zag order (device d: chunks d and 2cp - 1 - d, the
routes of `block_flash.zigzag_routes`), so that each device's causal work is equal; the outputs move back on exit.
At hop s device d holds the K/V chunks of device (d - s) mod cp. The causal mask uses global positions, so packing
segments may cross chunk and shard boundaries.

The math of one (queries, keys) pair (`block_attention`; `_attend` and `_attend_backward`): online softmax (fp32
running max and sum) over key blocks, a block pair wholly in the future skipped by `lax.cond` (no compute), and the
FlashAttention-2 backward recomputed in XLA (each tile visited once), so no [Tq, Tk] array is ever stored: O(Tq *
block) on top of the inputs. A pair returns its normalized output and log-sum-exp per query row, and the hops are
merged by their log-sum-exps. The ring has its own VJP (`_ring`): jax's autodiff through the hop loop would keep
every hop's K/V block and partial output for the backward, O(T) per device (measured: at 32k tokens the ring's
temporaries grew from cp 2 to cp 8); the custom backward keeps only this device's q, k, v, output and log-sum-exp
and sends K/V around the ring again with their dK/dV accumulators, so memory stays O(T / cp). The hops are a
`fori_loop`, not unrolled: XLA otherwise receives every hop's K/V up front. Without a context axis (cp 1, or no
mesh) `block_attention` runs on the whole row, at O(T * block) instead of the dense mask's O(T^2).
"""

from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec

from jaxrl_vlm.models import activation_sharding as act
from jaxrl_vlm.models.block_flash import MASK_VALUE, query_chunks, zigzag_routes

# Key/query block of `block_attention` (the largest divisor of a chunk up to this): [B, K, G, block, block] fp32
# logits per step.
DEFAULT_BLOCK = 512


# ----------------------------------------------------------------------------- one (queries, keys) pair
# Arrays are read block by block through free reshapes ([B, T, ...] -> [B, T / block, block, ...]) and written with
# in-place dynamic updates inside the loops, so no layout copies of the sequence are made.


def _at(x: jax.Array, i: jax.Array, axis: int) -> jax.Array:
    return lax.dynamic_index_in_dim(x, i, axis, keepdims=False)


def _put(x: jax.Array, value: jax.Array, i: jax.Array, axis: int) -> jax.Array:
    return lax.dynamic_update_index_in_dim(x, value.astype(x.dtype), i, axis)


def _in_blocks(x: jax.Array, block: int, axis: int) -> jax.Array:
    """[..., T, ...] -> [..., T / block, block, ...] (a reshape, no copy)."""
    return x.reshape(x.shape[:axis] + (x.shape[axis] // block, block) + x.shape[axis + 1:])


def _needed(q_pos: jax.Array, k_pos: jax.Array) -> jax.Array:
    """Whether a (query block, key block) pair has any causal pair: its earliest key is not after its last query."""
    return jnp.min(k_pos) <= jnp.max(q_pos)


def _masked_logits(q, k, q_pos, k_pos, q_seg, k_seg, scale):
    """q [B, bq, K, G, H], k [B, bk, K, H] -> (mask, logits) [B, K, G, bq, bk]: same segment and key position <=
    query position; logits fp32, MASK_VALUE where masked."""
    causal = q_pos[:, None] >= k_pos[None, :]
    mask = ((q_seg[:, :, None] == k_seg[:, None, :]) & causal[None])[:, None, None]
    s = jnp.einsum("bqkgh,bskh->bkgqs", q, k, preferred_element_type=jnp.float32) * scale
    return mask, jnp.where(mask, s, MASK_VALUE)


def _rows_last(x: jax.Array) -> jax.Array:
    """Per-row statistics [B, bq, K, G] -> [B, K, G, bq], the logits' layout."""
    return jnp.moveaxis(x, 1, 3)


def _attend(q, k, v, q_pos, k_pos, q_seg, k_seg, scale, block):
    """Forward of one pair. q [B, Tq, K, G, H] (heads grouped by kv head), k/v [B, Tk, K, H], positions [Tq] / [Tk],
    segment ids [B, Tq] / [B, Tk] -> (out [B, Tq, K, G, H] fp32, lse [B, Tq, K, G] fp32); a row with no allowed key:
    out 0, lse MASK_VALUE."""
    b, tq, kv, g, h = q.shape
    qv, qpv, qsv = _in_blocks(q, block, 1), _in_blocks(q_pos, block, 0), _in_blocks(q_seg, block, 1)
    kb, vb = _in_blocks(k, block, 1), _in_blocks(v, block, 1)
    kpv, ksv = _in_blocks(k_pos, block, 0), _in_blocks(k_seg, block, 1)

    def query_block(i, outs):
        qi, qpi, qsi = _at(qv, i, 1), _at(qpv, i, 0), _at(qsv, i, 1)

        def key_block(j, carry):
            def add(carry):
                acc, m, l = carry
                vj = _at(vb, j, 1)
                mask, s = _masked_logits(qi, _at(kb, j, 1), qpi, _at(kpv, j, 0), qsi, _at(ksv, j, 1), scale)
                m_new = jnp.maximum(m, jnp.max(s, axis=-1))
                p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
                alpha = jnp.exp(m - m_new)
                pv = jnp.einsum("bkgqs,bskh->bkgqh", p.astype(vj.dtype), vj, preferred_element_type=jnp.float32)
                return alpha[..., None] * acc + pv, m_new, alpha * l + jnp.sum(p, axis=-1)

            return lax.cond(_needed(qpi, _at(kpv, j, 0)), add, lambda c: c, carry)

        stats = (b, kv, g, block)
        init = (jnp.zeros(stats + (h,), jnp.float32), jnp.full(stats, MASK_VALUE, jnp.float32),
                jnp.zeros(stats, jnp.float32))
        acc, m, l = lax.fori_loop(0, kb.shape[1], key_block, init)
        seen = l > 0
        l = jnp.where(seen, l, 1.0)
        out_i = jnp.moveaxis(acc / l[..., None], 3, 1)  # [B, bq, K, G, H]
        lse_i = jnp.moveaxis(jnp.where(seen, m + jnp.log(l), MASK_VALUE), 3, 1)
        return _put(outs[0], out_i, i, 1), _put(outs[1], lse_i, i, 1)

    init = (jnp.zeros(qv.shape, jnp.float32), jnp.zeros(qv.shape[:-1], jnp.float32))
    out, lse = lax.fori_loop(0, qv.shape[1], query_block, init)
    return out.reshape(q.shape), lse.reshape(q.shape[:-1])


def _attend_backward(q, k, v, q_pos, k_pos, q_seg, k_seg, lse, delta, dout, dq, scale, block):
    """Backward of one pair (FlashAttention-2's, every tile visited once): q, k, v, positions and segments as
    `_attend`; lse, delta [B, Tq, K, G] fp32 with delta = rowsum(out * dout) - dlse, and lse over these keys or, for
    a hop of the ring, over the whole row; dout [B, Tq, K, G, H] fp32. Adds this pair's share into dq
    [B, Tq, K, G, H] fp32 and returns (dq, dk, dv), dk/dv [B, Tk, K, H] fp32."""
    qv, qpv, qsv = _in_blocks(q, block, 1), _in_blocks(q_pos, block, 0), _in_blocks(q_seg, block, 1)
    lsev, deltav, dov = _in_blocks(lse, block, 1), _in_blocks(delta, block, 1), _in_blocks(dout, block, 1)
    kb, vb = _in_blocks(k, block, 1), _in_blocks(v, block, 1)
    kpv, ksv = _in_blocks(k_pos, block, 0), _in_blocks(k_seg, block, 1)

    def key_block(j, outer):
        kj, vj, kpj, ksj = _at(kb, j, 1), _at(vb, j, 1), _at(kpv, j, 0), _at(ksv, j, 1)

        def query_block(i, carry):
            def add(carry):
                dq, dk, dv = carry
                qi, doi = _at(qv, i, 1), _at(dov, i, 1)
                mask, s = _masked_logits(qi, kj, _at(qpv, i, 0), kpj, _at(qsv, i, 1), ksj, scale)
                p = jnp.where(mask, jnp.exp(s - _rows_last(_at(lsev, i, 1))[..., None]), 0.0)
                dp = jnp.einsum("bqkgh,bskh->bkgqs", doi, vj, preferred_element_type=jnp.float32)
                ds = p * (dp - _rows_last(_at(deltav, i, 1))[..., None]) * scale
                dv = dv + jnp.einsum("bkgqs,bqkgh->bskh", p, doi, preferred_element_type=jnp.float32)
                dk = dk + jnp.einsum("bkgqs,bqkgh->bskh", ds, qi, preferred_element_type=jnp.float32)
                dq_i = jnp.einsum("bkgqs,bskh->bqkgh", ds, kj, preferred_element_type=jnp.float32)
                return _put(dq, _at(dq, i, 1) + dq_i, i, 1), dk, dv

            return lax.cond(_needed(_at(qpv, i, 0), kpj), add, lambda c: c, carry)

        dq, dk, dv = outer
        zeros = jnp.zeros(kj.shape, jnp.float32)
        dq, dk_j, dv_j = lax.fori_loop(0, qv.shape[1], query_block, (dq, zeros, zeros))
        return dq, _put(dk, dk_j, j, 1), _put(dv, dv_j, j, 1)

    zeros = jnp.zeros(kb.shape, jnp.float32)
    dq, dk, dv = lax.fori_loop(0, kb.shape[1], key_block, (_in_blocks(dq, block, 1), zeros, zeros))
    return dq.reshape(q.shape), dk.reshape(k.shape), dv.reshape(v.shape)


def _grouped(x: jax.Array, kv: int) -> jax.Array:
    """[B, T, N, ...] -> [B, T, K, N / K, ...] (query head n uses kv head n // G)."""
    return x.reshape(x.shape[:2] + (kv, x.shape[2] // kv) + x.shape[3:])


def _ungrouped(x: jax.Array) -> jax.Array:
    return x.reshape(x.shape[:2] + (x.shape[2] * x.shape[3],) + x.shape[4:])


@partial(jax.custom_vjp, nondiff_argnums=(7, 8))
def _block_attention(q, k, v, q_pos, k_pos, q_seg, k_seg, scale, block):
    out, lse = _attend(_grouped(q, k.shape[2]), k, v, q_pos, k_pos, q_seg, k_seg, scale, block)
    return _ungrouped(out), _ungrouped(lse)


def _block_attention_fwd(q, k, v, q_pos, k_pos, q_seg, k_seg, scale, block):
    out, lse = _block_attention(q, k, v, q_pos, k_pos, q_seg, k_seg, scale, block)
    return (out, lse), (q, k, v, q_pos, k_pos, q_seg, k_seg, out, lse)


def _block_attention_bwd(scale, block, res, cotangents):
    q, k, v, q_pos, k_pos, q_seg, k_seg, out, lse = res
    dout, dlse = cotangents
    kv = k.shape[2]
    delta = jnp.sum(out * dout, axis=-1) - dlse
    dq, dk, dv = _attend_backward(_grouped(q, kv), k, v, q_pos, k_pos, q_seg, k_seg, _grouped(lse, kv),
                                  _grouped(delta, kv), _grouped(dout.astype(jnp.float32), kv),
                                  jnp.zeros(_grouped(q, kv).shape, jnp.float32), scale, block)
    return _ungrouped(dq).astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None, None, None


_block_attention.defvjp(_block_attention_fwd, _block_attention_bwd)


def _block_size(length: int, most: int) -> int:
    """The largest divisor of `length` not above `most` (blocks tile the sequence exactly)."""
    return max(d for d in range(1, min(length, most) + 1) if length % d == 0)


def block_attention(q: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array, k_pos: jax.Array,
                    q_segment_ids: jax.Array, kv_segment_ids: jax.Array, *, scale: float,
                    block: int = DEFAULT_BLOCK) -> tuple[jax.Array, jax.Array]:
    """Causal, same-segment attention of queries q [B, Tq, N, H] at row positions q_pos [Tq] over keys k/v
    [B, Tk, K, H] at positions k_pos [Tk] (N = K * G: query head n uses kv head n // G); segment ids [B, Tq] and
    [B, Tk]. Positions need not be contiguous: a (query block, key block) pair is skipped when its earliest key
    follows its last query, so blocks should lie in increasing runs for the skip to bite.

    Returns (out [B, Tq, N, H] fp32, lse [B, Tq, N] fp32), the normalized output and log-sum-exp per query row, so
    that attention over several key sets merges exactly (`merge`); a row with no allowed key gives out 0 and lse
    MASK_VALUE. `block` is cut down to the largest divisor of both Tq and Tk not above it."""
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"{q.shape[2]} query heads are not a multiple of {k.shape[2]} key/value heads")
    block = _block_size(math.gcd(q.shape[1], k.shape[1]), block)
    return _block_attention(q, k, v, q_pos.astype(jnp.int32), k_pos.astype(jnp.int32),
                            q_segment_ids.astype(jnp.int32), kv_segment_ids.astype(jnp.int32), float(scale), block)


def merge(out_a: jax.Array, lse_a: jax.Array, out_b: jax.Array, lse_b: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Attention over the union of two disjoint key sets from each one's (out [B, T, N, H], lse [B, T, N])."""
    lse = jnp.logaddexp(lse_a, lse_b)
    return out_a * jnp.exp(lse_a - lse)[..., None] + out_b * jnp.exp(lse_b - lse)[..., None], lse


# ----------------------------------------------------------------------------- the ring


def _held_positions(device: jax.Array, cp: int, c: int) -> jax.Array:
    """Row positions [2c] of the zig-zag chunks device `device` (traced) holds: its (even, odd) chunk, the order in
    which `zigzag_routes` delivers them."""
    held = jnp.asarray([sorted(query_chunks(d, cp), key=lambda ch: ch % 2) for d in range(cp)], jnp.int32)
    return (held[device][:, None] * c + jnp.arange(c, dtype=jnp.int32)[None, :]).reshape(2 * c)


def _ring_forward(q, k, v, seg, axis, cp, scale, block):
    """Zig-zag-held q [B, 2c, K, G, H] (grouped), k/v [B, 2c, K, H], seg [B, 2c] -> (out fp32, lse) over the row."""
    c = q.shape[1] // 2
    me = lax.axis_index(axis)
    q_pos = _held_positions(me, cp, c)
    ring = [(i, (i + 1) % cp) for i in range(cp)]

    def hop(s, carry):  # hop s: the K/V of device (me - s) mod cp arrive
        k, v, k_seg, out, lse = carry
        k, v, k_seg = (lax.ppermute(x, axis, ring) for x in (k, v, k_seg))
        part = _attend(q, k, v, q_pos, _held_positions((me - s) % cp, cp, c), seg, k_seg, scale, block)
        return (k, v, k_seg, *merge(out, lse, *part))

    out, lse = _attend(q, k, v, q_pos, q_pos, seg, seg, scale, block)
    return lax.fori_loop(1, cp, hop, (k, v, seg, out, lse))[3:]


@partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def _ring(q, k, v, seg, axis, cp, scale, block):
    return _ring_forward(q, k, v, seg, axis, cp, scale, block)[0].astype(q.dtype)


def _ring_fwd(q, k, v, seg, axis, cp, scale, block):
    out, lse = _ring_forward(q, k, v, seg, axis, cp, scale, block)
    return out.astype(q.dtype), (q, k, v, seg, out, lse)


def _ring_bwd(axis, cp, scale, block, res, dout):
    """The reverse ring: K/V travel again with their dK/dV accumulators; each hop adds this device's queries'
    share (probabilities from the row-wide log-sum-exp), and a last hop brings the accumulators home. Only this
    device's blocks are kept from the forward, so memory stays O(T / cp)."""
    q, k, v, seg, out, lse = res
    dout = dout.astype(jnp.float32)
    c = q.shape[1] // 2
    me = lax.axis_index(axis)
    q_pos = _held_positions(me, cp, c)
    delta = jnp.sum(out * dout, axis=-1)
    ring = [(i, (i + 1) % cp) for i in range(cp)]
    attend_backward = lambda k, v, k_pos, k_seg, dq: _attend_backward(  # noqa: E731
        q, k, v, q_pos, k_pos, seg, k_seg, lse, delta, dout, dq, scale, block)

    def hop(s, carry):  # hop s: the K/V of device (me - s) mod cp, with their gradients so far
        k, v, k_seg, dq, dk, dv = carry
        k, v, k_seg, dk, dv = (lax.ppermute(x, axis, ring) for x in (k, v, k_seg, dk, dv))
        dq, dk_s, dv_s = attend_backward(k, v, _held_positions((me - s) % cp, cp, c), k_seg, dq)
        return k, v, k_seg, dq, dk + dk_s, dv + dv_s

    dq, dk, dv = attend_backward(k, v, q_pos, seg, jnp.zeros(q.shape, jnp.float32))
    dq, dk, dv = lax.fori_loop(1, cp, hop, (k, v, seg, dq, dk, dv))[3:]
    # After hop cp - 1 this device holds the K/V of device me + 1: one more hop along the ring returns them.
    dk, dv = (lax.ppermute(x, axis, ring) for x in (dk, dv))
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None


_ring.defvjp(_ring_fwd, _ring_bwd)


def _ring_block(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array, *, axis, cp: int, scale: float,
                block: int) -> jax.Array:
    """Inside shard_map over the context axis `axis` of size cp: this device's contiguous blocks q [B, Tl, N, H],
    k/v [B, Tl, K, H], segment_ids [B, Tl] (block `axis_index(axis)` of a row of T = cp * Tl) -> its outputs
    [B, Tl, N, H], attending to the whole row causally."""
    c = q.shape[1] // 2
    first, second = zigzag_routes(cp)
    back = [[(dst, src) for src, dst in route] for route in (first, second)]

    def to_zigzag(x: jax.Array) -> jax.Array:
        return jnp.concatenate([lax.ppermute(x[:, :c], axis, first), lax.ppermute(x[:, c:], axis, second)], axis=1)

    if q.shape[2] % k.shape[2]:
        raise ValueError(f"{q.shape[2]} query heads are not a multiple of {k.shape[2]} key/value heads")
    q, k, v, segment_ids = (to_zigzag(x) for x in (q, k, v, segment_ids.astype(jnp.int32)))
    out = _ungrouped(_ring(_grouped(q, k.shape[2]), k, v, segment_ids, axis, cp, float(scale), _block_size(c, block)))
    return jnp.concatenate([lax.ppermute(out[:, :c], axis, back[0]), lax.ppermute(out[:, c:], axis, back[1])], axis=1)


def _whole_row_block(q, k, v, segment_ids, *, scale: float, block: int) -> jax.Array:
    """One device holds whole rows: blockwise attention at positions 0..T-1."""
    pos = jnp.arange(q.shape[1], dtype=jnp.int32)
    return block_attention(q, k, v, pos, pos, segment_ids, segment_ids, scale=scale, block=block)[0].astype(q.dtype)


def _axis_size(mesh, axes) -> int:
    return math.prod(mesh.shape[a] for a in ((axes,) if isinstance(axes, str) else axes))


def ring_attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array, *, scale: float,
                   block: int = DEFAULT_BLOCK, q_names: tuple[str | None, ...] = act.ROWS_Q,
                   kv_names: tuple[str | None, ...] = act.ROWS_KV) -> jax.Array:
    """Causal, same-segment attention of q [B, T, N, H] over k/v [B, T, K, H] (segment_ids [B, T]) -> [B, T, N, H].

    Under an `activation_sharding` context it runs in `shard_map` with the activations' layout (`q_names`,
    `kv_names`: rows over the batch axes, heads over `tensor`, positions over the context axis); with the positions
    split over cp > 1 devices it is ring attention in zig-zag order, which needs T divisible by 2cp. Otherwise each
    device attends its whole rows blockwise."""
    spec = act.current()
    if spec is None:
        return _whole_row_block(q, k, v, segment_ids, scale=scale, block=block)
    q_spec = tuple(spec.sharding(q_names, q.shape).spec) + (None,) * 4
    kv_spec = tuple(spec.sharding(kv_names, k.shape).spec) + (None,) * 4
    rows, sequence_axes = q_spec[0], q_spec[1]
    heads, kv_heads = q_spec[2], kv_spec[2]
    if heads != kv_heads:
        # The kv heads cannot be split like the query heads (e.g. 2 kv heads on 4 tensor shards): keep every head
        # whole on each device rather than pair query heads with the wrong kv heads.
        heads = kv_heads = None
    if rows != kv_spec[0] or sequence_axes != kv_spec[1]:
        raise ValueError(f"ring attention needs queries and keys split alike over rows and positions, got q "
                         f"{q_spec[:2]} and k/v {kv_spec[:2]}")
    cp = 1 if sequence_axes is None else _axis_size(spec.mesh, sequence_axes)
    if cp > 1:
        t = q.shape[1]
        if t % (2 * cp):
            raise ValueError(
                f"attention_impl=ring cuts each row into 2 x {cp} zig-zag chunks (2 per device of the {cp}-device "
                f"context group), but rows have {t} tokens; use seq buckets that are multiples of {2 * cp}"
            )
        local = partial(_ring_block, axis=sequence_axes, cp=cp, scale=scale, block=block)
    else:
        local = partial(_whole_row_block, scale=scale, block=block)
    q_p = PartitionSpec(rows, sequence_axes, heads, None)
    kv_p = PartitionSpec(rows, sequence_axes, kv_heads, None)
    seg_p = PartitionSpec(rows, sequence_axes)
    return jax.shard_map(local, mesh=spec.mesh, in_specs=(q_p, kv_p, kv_p, seg_p), out_specs=q_p,
                         check_vma=False)(q, k, v, segment_ids)
