"""Context parallelism for the Gated DeltaNet (linear-attention) layers: a row's positions split over devices.

Under context parallelism a row's T positions are split into contiguous equal blocks over the mesh axes of the
`sequence` logical name (device j of a context group holds [j T/cp, (j+1) T/cp)). The two parts of a linear layer
that mix positions are sequential, so XLA's partitioner left alone would gather the whole row on every device;
here they run inside `jax.shard_map` on their own block and exchange only what crosses a block boundary:

- the causal depthwise conv needs the previous block's last K-1 inputs (a halo, one `ppermute`);
- the gated delta rule is linear in its state: per value column, S_t = M_t S_(t-1) + beta_t k_t v_t^T with
  M_t = exp(g_t) (I - beta_t k_t k_t^T). Over a block, S_out = A S_in + B and o_t = o0_t + S_in^T (A_<=t^T q_t),
  where B and o0 come from a zero entering state and A (the product of the M_t, 0 after a segment reset) from
  the identity with v = 0. The value columns never mix, so ONE chunked pass with values [v | 0] and state [0 | I]
  gives both (`chunk_gated_delta_rule` unchanged, value width Dv + Dk), and each block adds the correction
  S_in^T (A_<=t^T q_t) once its entering state is known. Measured on a CPU (blocks of 1024 and 2048 steps,
  4 heads, Dk = Dv = 128, noisy shared cores): forward and backward cost 1.5-1.8x the plain pass, where a pass
  for the map followed by re-running the rule from the entering state cost 1.9-2.9x (forward alone both ~2x).
- the maps (A, B) of all blocks are `all_gather`ed and combined locally (cp steps of a [Dk, Dk] @ [Dk, Dv]
  product): one collective round, whose transpose is one reduce-scatter, where handing the state down a chain
  of cp-1 `ppermute`s would put cp-1 dependent transfers on the critical path, forward and backward. The price
  is bytes: a device receives (cp-1) H (Dk + Dv) Dk fp32 values per row (32 heads of 128: 4 MiB per block, 28 MiB
  at cp 8, the size of a [4096, 4096] bf16 activation) against one state per hop for the chain; beyond cp 8 a
  log-depth scan of the maps over `ppermute` would move less.

Packed rows: run ids (`segment_runs` of the WHOLE row, computed before the split) are global, so a block knows
whether its first position continues the previous block's last run; if not, its entering state is zero (the
conv halo is masked by the same run ids, as `causal_depthwise_conv` masks any tap that crosses a segment).

The model never names mesh axes: `context_split` reads them from the active `activation_sharding` layout.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from jaxrl_vlm.models.activation_sharding import ActivationLayout

F32 = jnp.float32

# Logical names of the linear layer's q/k/v under context parallelism: rows, positions, value heads.
ROWS_SEQUENCE_HEADS = ("batch", "sequence", "linear_v_heads", None)  # [B, T, Hv, D]

MeshEntry = str | tuple[str, ...] | None


@dataclass(frozen=True)
class ContextSplit:
    """Where the linear layer's activations live: rows over `rows`, positions over `sequence` (cp > 1 blocks),
    value heads over `heads` (each None or the PartitionSpec entry of that dimension)."""

    mesh: Mesh
    rows: MeshEntry
    sequence: tuple[str, ...]
    heads: MeshEntry

    @property
    def size(self) -> int:
        """cp: the number of blocks a row is split into."""
        return math.prod(self.mesh.shape[a] for a in self.sequence)


def _entry(spec: PartitionSpec, dim: int) -> MeshEntry:
    return spec[dim] if dim < len(spec) else None


def context_split(layout: ActivationLayout | None, shape_bthd: tuple[int, ...]) -> ContextSplit | None:
    """The split of [B, T, Hv, D] activations under `layout`, or None where positions are not split (no layout,
    or the sequence resolves to no mesh axis of size > 1, e.g. T not divisible by cp)."""
    if layout is None:
        return None
    spec = layout.sharding(ROWS_SEQUENCE_HEADS, shape_bthd).spec
    seq = _entry(spec, 1)
    seq_axes = () if seq is None else (seq,) if isinstance(seq, str) else tuple(seq)
    split = ContextSplit(layout.mesh, _entry(spec, 0), seq_axes, _entry(spec, 2))
    return split if seq_axes and split.size > 1 else None


def _from_previous_block(x: jax.Array, axes: tuple[str, ...], cp: int) -> jax.Array:
    """Block j receives block j-1's `x` (block 0 receives zeros)."""
    return jax.lax.ppermute(x, axes, [(i, i + 1) for i in range(cp - 1)])


ConvFn = Callable[[jax.Array, jax.Array, jax.Array, jax.Array], jax.Array]
RuleFn = Callable[..., tuple[jax.Array, jax.Array]]


def context_causal_conv(
    conv: ConvFn, x_btc: jax.Array, w_kc: jax.Array, prev_bkc: jax.Array, run_bt: jax.Array, split: ContextSplit
) -> jax.Array:
    """`conv(x, w, prev, run)` (the model's `causal_depthwise_conv`: x [B, T, C], taps w [K, C], window prev
    [B, K-1, C] of run 0, run ids [B, T]; taps across runs read zero) with T split as `split` says, same result:
    each block reads the previous block's last K-1 inputs and run ids as its window; block 0 reads `prev_bkc`.
    Channels stay whole on every device. Needs T / cp >= K - 1. (The model passes its own conv in, so this
    module does not import the model that imports it.)"""
    kk, cp = w_kc.shape[0], split.size
    if x_btc.shape[1] // cp < kk - 1:
        raise ValueError(f"context parallelism: a block of {x_btc.shape[1] // cp} positions (T={x_btc.shape[1]}, "
                         f"cp={cp}) is shorter than the conv window of {kk - 1}; use fewer context shards")
    axes = split.sequence

    def block(x: jax.Array, w: jax.Array, prev: jax.Array, run: jax.Array) -> jax.Array:
        first = jax.lax.axis_index(axes) == 0
        halo = jnp.where(first, prev.astype(x.dtype), _from_previous_block(x[:, x.shape[1] - (kk - 1):], axes, cp))
        halo_run = jnp.where(first, 0, _from_previous_block(run[:, run.shape[1] - (kk - 1):], axes, cp))
        # The halo goes in front of the block rather than into the conv's window, whose run ids are all 0.
        xs, runs = jnp.concatenate([halo, x], axis=1), jnp.concatenate([halo_run.astype(run.dtype), run], axis=1)
        return conv(xs, w, jnp.zeros_like(halo), runs)[:, kk - 1:]

    rows = PartitionSpec(split.rows, axes, None)
    return jax.shard_map(
        block, mesh=split.mesh,
        in_specs=(rows, PartitionSpec(), PartitionSpec(split.rows, None, None), PartitionSpec(split.rows, axes)),
        out_specs=rows, check_vma=False,
    )(x_btc, w_kc, prev_bkc, run_bt)


def _combine_blocks(a_bhkk: jax.Array, b_bhkv: jax.Array, s0_bhkv: jax.Array, axes: tuple[str, ...], cp: int,
                    ) -> tuple[jax.Array, jax.Array]:
    """(state entering this block, state leaving it) from every block's map S -> A S + B (A already zero where
    the block starts a new run) and the state entering block 0."""
    a_all = jax.lax.all_gather(a_bhkk, axes, axis=0)  # [cp, B, H, Dk, Dk]
    b_all = jax.lax.all_gather(b_bhkv, axes, axis=0)  # [cp, B, H, Dk, Dv]
    states = [s0_bhkv]
    for i in range(cp):
        states.append(jnp.einsum("bhkj,bhjv->bhkv", a_all[i], states[-1]) + b_all[i])
    states_j = jnp.stack(states)  # [cp + 1, B, H, Dk, Dv]: entering block 0, leaving block 0, ..., leaving cp-1
    j = jax.lax.axis_index(axes)
    return (jax.lax.dynamic_index_in_dim(states_j, j, keepdims=False),
            jax.lax.dynamic_index_in_dim(states_j, j + 1, keepdims=False))


def context_chunk_gated_delta_rule(
    rule: RuleFn,
    q_bthk: jax.Array,
    k_bthk: jax.Array,
    v_bthv: jax.Array,
    g_bth: jax.Array,
    beta_bth: jax.Array,
    state_bhkv: jax.Array,
    run_bt: jax.Array,
    split: ContextSplit,
) -> tuple[jax.Array, jax.Array]:
    """`rule(q, k, v, g, beta, state, run)` (the model's `chunk_gated_delta_rule` at its chunk size: o
    [B, T, H, Dv] fp32 and the state after step T-1; the first step continues `state`, a change of run id
    restarts from zero) with T split into blocks as `split` says and value heads as `split.heads`, same result.
    run_bt: the whole row's run ids (global): a block whose first run differs from the previous block's last
    starts from zero."""
    axes, cp = split.sequence, split.size
    dv = v_bthv.shape[-1]

    def block(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array, s0: jax.Array,
              run: jax.Array) -> tuple[jax.Array, jax.Array]:
        b, _, h, dk = q.shape
        continues = (jax.lax.axis_index(axes) == 0) | (run[:, 0] == _from_previous_block(run[:, -1], axes, cp))
        wide_v = jnp.concatenate([v.astype(F32), jnp.zeros((*v.shape[:3], dk), F32)], axis=-1)
        wide_s = jnp.concatenate([jnp.zeros((b, h, dk, dv), F32), jnp.broadcast_to(jnp.eye(dk, dtype=F32),
                                                                                     (b, h, dk, dk))], axis=-1)
        o_wide, s_wide = rule(q, k, wide_v, g, beta, wide_s, run)
        o_zero, o_map = o_wide[..., :dv], o_wide[..., dv:]  # from a zero state; A_<=t^T q_t [B, Tb, H, Dk]
        b_map, a_map = s_wide[..., :dv], s_wide[..., dv:] * continues[:, None, None, None].astype(F32)
        s_in, s_out = _combine_blocks(a_map, b_map, s0.astype(F32), axes, cp)
        s_in = s_in * continues[:, None, None, None].astype(F32)
        o = o_zero + jnp.einsum("bthj,bhjv->bthv", o_map, s_in)
        return o, s_out[:, None]

    heads = PartitionSpec(split.rows, axes, split.heads, None)
    steps = PartitionSpec(split.rows, axes, split.heads)
    state = PartitionSpec(split.rows, split.heads, None, None)
    # Each block returns the state leaving it ([B, cp, ...] over the blocks) and the row's final state is the
    # last: every output of the shard_map is split over the blocks, so no replicated output's transpose rests on
    # the unchecked (check_vma=False) replication.
    o, leaving = jax.shard_map(
        block, mesh=split.mesh,
        in_specs=(heads, heads, heads, steps, steps, state, PartitionSpec(split.rows, axes)),
        out_specs=(heads, PartitionSpec(split.rows, axes, split.heads, None, None)), check_vma=False,
    )(q_bthk, k_bthk, v_bthv, g_bth, beta_bth, state_bhkv, run_bt.astype(jnp.int32))
    return o, leaving[:, -1]
