"""Expert parallelism for `moe.SparseMoE`: the experts split over the mesh axes of the `expert` logical name, each
device's (token, expert) copies sent to the devices owning their experts by an all-to-all, inside `jax.shard_map`.

Why by hand: XLA's partitioner cannot split a `ragged_dot` over its groups; left alone it all-gathers every
expert's weights on every device, which is what expert parallelism exists to avoid.

Per device of an expert group of `ep` devices (each owning E / ep consecutive experts), with its n local tokens:
  1. the router's top-k choices (computed outside, as without a mesh) give n k copies; copy a goes to device
     ids[a] // (E / ep), in slot `pos[a]` (its rank among this device's copies to that device, token order);
  2. send buffer [ep, C, D]: C slots per destination. A copy whose slot is >= C is over capacity: it is not sent,
     that expert's term is left out of its token's output, and it is counted (`dropped`, per token);
  3. `all_to_all` over the group: each device now holds [ep sources, C, D] rows and their local expert ids
     (E / ep marks an empty slot), runs them through `moe.grouped_expert_mlp` (one `ragged_dot` per projection over
     its local experts; empty slots fall outside every group) and sends the results back by a second all-to-all;
  4. each token gathers its copies' results from the slots it used and sums them with its routing weights, in the
     order the unsharded block uses, so with room for every copy the result equals it.

Capacity C per (source, destination) pair: `capacity_factor` x the balanced share n k / ep, or, with None, the worst
case n min(k, E / ep) (a token sends at most min(k, E / ep) copies to one device), so nothing can drop. The worst
case costs ep x the balanced buffer (the all-to-all bytes grow with it); training at scale sets a factor (1.25 - 2
in GShard / Switch practice) and watches the dropped count. The default is the exact one because this trainer's
log-probs must match the engine's, which never drops.

Composition with the other axes: the trainer splits tokens over the expert axes (the default `batch` rule includes
`expert`), so each device dispatches its own tokens as above. Where every device of an expert group holds the same
tokens (the engine: a replica's tokens are replicated over its tp devices, SGLang's ep-within-tp), there is nothing
to send: each device runs the copies routed to its own experts and one `psum` over the group adds the partial
outputs (no capacity, nothing dropped). A layout that splits tokens over some expert axes only falls back to XLA's
plan (experts gathered). The expert MLP width may stay split over the `mlp` rule's axes (tensor parallelism inside
each expert: partial outputs, one `psum` per layer); the model dimension is gathered on entry (FSDP), as for any
layer.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from jaxrl_vlm.models.activation_sharding import ROWS_HIDDEN, ActivationLayout

MeshEntry = str | tuple[str, ...] | None
EXPERT_KERNEL = ("expert", "embed", "mlp")  # logical names of the [E, D, F] kernels (down is [E, F, D])


def _axes(entry: MeshEntry) -> tuple[str, ...]:
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def capacity(tokens: int, top_k: int, num_experts: int, ep: int, capacity_factor: float | None) -> int:
    """Slots per (source, destination) pair for `tokens` local tokens: the worst case n min(k, E / ep) when
    `capacity_factor` is None, else ceil(factor n k / ep) clipped to [1, worst case]."""
    worst = tokens * min(top_k, num_experts // ep)
    if capacity_factor is None:
        return worst
    return max(1, min(worst, math.ceil(capacity_factor * tokens * top_k / ep)))


@dataclass(frozen=True)
class ExpertParallel:
    """Where an MoE block's arrays live under a mesh: tokens [B, T, ...] as `rows` x `sequence`, the experts over
    `expert_axes` (ep devices), the expert MLP width over `mlp_axes` (or whole)."""

    mesh: Mesh
    rows: MeshEntry
    sequence: MeshEntry
    expert_axes: tuple[str, ...]
    mlp_axes: tuple[str, ...]
    capacity_factor: float | None
    all_to_all: bool  # tokens split over the expert axes (dispatch); False: replicated there (local experts + psum)

    @property
    def ep(self) -> int:
        return math.prod(self.mesh.shape[a] for a in self.expert_axes)


def expert_parallel(layout: ActivationLayout | None, x_shape: tuple[int, ...], kernel_shape: tuple[int, ...],
                    capacity_factor: float | None) -> ExpertParallel | None:
    """The expert-parallel plan of a block with tokens [B, T, D] and expert kernels [E, D, F] under `layout`; None
    when there is no layout, the experts are not split (expert axis of size 1, or E not divisible by it) or the
    tokens are split over some of the expert axes only (then XLA's plan runs: the experts are gathered)."""
    if layout is None:
        return None
    kernel = tuple(layout.sharding(EXPERT_KERNEL, kernel_shape).spec) + (None,) * 3
    expert_axes = _axes(kernel[0])
    if not expert_axes:
        return None
    tokens = tuple(layout.sharding(ROWS_HIDDEN, x_shape).spec) + (None,) * 3
    token_axes = set(_axes(tokens[0])) | set(_axes(tokens[1]))
    split = set(expert_axes) & token_axes
    if split and split != set(expert_axes):
        return None
    mlp_axes = _axes(kernel[2])
    if set(mlp_axes) & (token_axes | set(expert_axes)):
        mlp_axes = ()  # a custom rule reusing a token axis for the width: keep each expert whole instead
    return ExpertParallel(layout.mesh, tokens[0], tokens[1], expert_axes, mlp_axes, capacity_factor, bool(split))


def _block(x_btd: jax.Array, ids_btk: jax.Array, w_btk: jax.Array, gate: jax.Array, up: jax.Array, down: jax.Array,
           *, plan: ExpertParallel, num_experts: int, act: Callable, mlp: Callable) -> tuple[jax.Array, jax.Array]:
    """One device's part: its tokens [b, t, D], their top-k ids and weights [b, t, k], its experts [E/ep, ...]."""
    b, t, d = x_btd.shape
    k = ids_btk.shape[-1]
    ep, e_local = plan.ep, num_experts // plan.ep
    n = b * t
    x = x_btd.reshape(n, d)
    ids = ids_btk.reshape(n * k)
    cap = capacity(n, k, num_experts, ep, plan.capacity_factor)
    dest = ids // e_local  # [n k] owning device (group index) of each copy
    one_hot = jax.nn.one_hot(dest, ep, dtype=jnp.int32)
    pos = jnp.sum((jnp.cumsum(one_hot, axis=0) - one_hot) * one_hot, axis=1)  # rank among copies to that device
    kept = pos < cap
    # Slot (g, c) of the send buffer holds the c-th copy to device g: copies sorted by destination (stable).
    order = jnp.argsort(dest, stable=True)
    counts = jnp.sum(one_hot, axis=0)
    starts = jnp.cumsum(counts) - counts
    slot = jnp.arange(cap, dtype=jnp.int32)
    filled = slot[None, :] < jnp.minimum(counts, cap)[:, None]  # [ep, C]
    copy = jnp.take(order, jnp.where(filled, starts[:, None] + slot[None, :], 0))  # [ep, C] copy index
    send_x = jnp.where(filled[..., None], jnp.take(x, copy // k, axis=0), 0).astype(x.dtype)
    send_e = jnp.where(filled, jnp.take(ids, copy) % e_local, e_local)  # e_local: an empty slot
    recv_x = jax.lax.all_to_all(send_x, plan.expert_axes, 0, 0)  # [ep sources, C, D]
    recv_e = jax.lax.all_to_all(send_e, plan.expert_axes, 0, 0)
    rows = recv_x.reshape(ep * cap, d)
    out = mlp(rows, recv_e.reshape(ep * cap, 1), jnp.ones((ep * cap, 1), x.dtype), gate, up, down, act)
    back = jax.lax.all_to_all(out.reshape(ep, cap, d), plan.expert_axes, 0, 0).reshape(ep * cap, d)
    per_copy = jnp.take(back, dest * cap + jnp.minimum(pos, cap - 1), axis=0)
    per_copy = jnp.where(kept[:, None], per_copy, 0).reshape(n, k, d)
    y = jnp.einsum("nkd,nk->nd", per_copy, w_btk.reshape(n, k).astype(per_copy.dtype))
    if plan.mlp_axes:
        y = jax.lax.psum(y, plan.mlp_axes)  # each device holds its slice of every expert's width
    dropped = k - jnp.sum(kept.reshape(n, k), axis=1, dtype=jnp.int32)
    return y.reshape(b, t, d), dropped.reshape(b, t)


def _reduce_block(x_btd: jax.Array, ids_btk: jax.Array, w_btk: jax.Array, gate: jax.Array, up: jax.Array,
                  down: jax.Array, *, plan: ExpertParallel, num_experts: int, act: Callable, mlp: Callable
                  ) -> tuple[jax.Array, jax.Array]:
    """One device's part when the group holds the same tokens: the copies routed to its own experts, summed over
    the group."""
    b, t, d = x_btd.shape
    k = ids_btk.shape[-1]
    e_local = num_experts // plan.ep
    local = ids_btk.reshape(b * t, k) - jax.lax.axis_index(plan.expert_axes) * e_local
    local = jnp.where((local >= 0) & (local < e_local), local, e_local)  # another device's expert: an empty row
    # Marked varying over the group by hand: each device's x feeds only its own experts, so x's gradient is the
    # sum over the group. Left implicit, the gather's transpose (a scatter-add into a zero buffer) is taken as
    # invariant and that sum is skipped (measured: x's gradient then missing the other devices' experts).
    x = jax.lax.pcast(x_btd.reshape(b * t, d), plan.expert_axes, to="varying")
    y = mlp(x, local, w_btk.reshape(b * t, k), gate, up, down, act)
    y = jax.lax.psum(y, plan.expert_axes + plan.mlp_axes)
    return y.reshape(b, t, d), jnp.zeros((b, t), jnp.int32)


def dispatch(plan: ExpertParallel, x_btd: jax.Array, ids_btk: jax.Array, weights_btk: jax.Array, gate_edf: jax.Array,
             up_edf: jax.Array, down_efd: jax.Array, act: Callable, mlp: Callable) -> tuple[jax.Array, jax.Array]:
    """(y [B, T, D], dropped int32 [B, T]: each token's copies over capacity) of the routed experts under `plan`.

    `mlp` is `moe.grouped_expert_mlp` (passed in: this module is imported by `moe`)."""
    rows_t = PartitionSpec(plan.rows, plan.sequence)
    tokens = PartitionSpec(plan.rows, plan.sequence, None)
    experts = tuple(plan.expert_axes) if len(plan.expert_axes) > 1 else plan.expert_axes[0]
    width = None if not plan.mlp_axes else plan.mlp_axes[0] if len(plan.mlp_axes) == 1 else tuple(plan.mlp_axes)
    in_kernel, out_kernel = PartitionSpec(experts, None, width), PartitionSpec(experts, width, None)
    block = _block if plan.all_to_all else _reduce_block
    fn = lambda *a: block(*a, plan=plan, num_experts=gate_edf.shape[0], act=act, mlp=mlp)  # noqa: E731
    return jax.shard_map(
        fn, mesh=plan.mesh, in_specs=(tokens, tokens, tokens, in_kernel, in_kernel, out_kernel),
        out_specs=(tokens, rows_t),
    )(x_btd, ids_btk, weights_btk, gate_edf, up_edf, down_efd)
