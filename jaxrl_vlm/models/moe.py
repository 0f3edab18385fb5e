"""The routed sparse mixture-of-experts MLP block, family-neutral (Qwen3-VL-MoE now, Qwen3.5-MoE later).

Semantics follow transformers' `Qwen3VLMoeTextSparseMoeBlock` (5.24): router logits = x @ W_router (compute dtype),
probabilities = softmax in fp32, the top-k experts by probability, their probabilities renormalised to sum to 1
(`norm_topk_prob`; Qwen3-VL-MoE always does), cast back to the compute dtype; each chosen expert is a SwiGLU MLP
down(act(gate x) * up x), and a token's output is the weighted sum over its k experts. No capacity limit and no
token dropping, as transformers.

Expert compute is a grouped matmul: the N * k (token, expert) assignments are sorted by expert and each expert's
contiguous run is multiplied by that expert's weights with `jax.lax.ragged_dot`; the k results of a token are then
gathered back (an inverse permutation, no scatter) and summed with their routing weights. Work is O(N k D F), never
O(N E D F).

Routing is an explicit value (`Routing`: router logits [..., E] fp32, top-k ids [..., k], top-k weights, and the
copies each token lost to expert-parallel capacity), not hidden module state: `SparseMoE.forward` returns it, and
accepts forced top-k ids (routing replay: the ids an engine chose for these tokens; the weights are then the
current router's probabilities at those ids). The train step's extras are pure functions of it:
`load_balancing_loss` (transformers' `load_balancing_loss_func`) and `expert_load` (tokens per expert per layer).

Under a mesh whose `expert` axis splits the experts (an `activation_sharding` layout is active), the expert compute
is `expert_parallel.dispatch`: an all-to-all to the devices owning each copy's expert and back, with a capacity
(`ActivationLayout.moe_capacity_factor`; None: room for every copy, the exact result); otherwise it is the local
`grouped_expert_mlp` below.

Logical axes: expert kernels `gate_experts_edf`, `up_experts_edf` [E, D, F] and `down_experts_efd` [E, F, D] carry
("expert", "embed", "mlp") / ("expert", "mlp", "embed"); the router kernel `router_kernel_de` [D, E] is
("embed", None).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl_vlm.models import expert_parallel
from jaxrl_vlm.models.activation_sharding import ROWS_HIDDEN, constrain, current
from jaxrl_vlm.models.layers import activation, param

F32 = jnp.float32


class Routing(NamedTuple):
    """What the router decided for a set of tokens (leading dims [...], e.g. [B, T] or [N]).

    logits: router logits [..., E] (fp32 copy of the compute-dtype logits);
    topk_ids: int32 [..., k], the experts each token went to (in descending probability when chosen by the router);
    topk_weights: [..., k] the weights of those experts' outputs (compute dtype);
    dropped: int32 [...], how many of the token's k copies were over expert-parallel capacity (their experts'
    outputs left out of the token's); always 0 without expert parallelism or with the default (no-drop) capacity."""

    logits: jax.Array
    topk_ids: jax.Array
    topk_weights: jax.Array
    dropped: jax.Array


def route(logits_ne: jax.Array, top_k: int, norm_topk_prob: bool, forced_ids_nk: jax.Array | None = None,
          weight_dtype: Any = F32) -> tuple[jax.Array, jax.Array]:
    """(top-k weights [N, k] in `weight_dtype`, top-k ids int32 [N, k]) from router logits [N, E].

    softmax in fp32, top-k by probability, renormalised when `norm_topk_prob`. With `forced_ids_nk` the ids are
    those (routing replay) and the weights the probabilities at them, renormalised alike; a token whose forced
    row holds a negative id (no recorded routing: padding, a position the engine never forwarded) keeps the
    router's own choice."""
    probs = jax.nn.softmax(logits_ne.astype(F32), axis=-1)
    top, ids = jax.lax.top_k(probs, top_k)
    if forced_ids_nk is not None:
        forced = forced_ids_nk.astype(jnp.int32)
        ids = jnp.where(jnp.all(forced >= 0, axis=-1, keepdims=True), forced, ids)
        top = jnp.take_along_axis(probs, ids, axis=-1)
    if norm_topk_prob:
        top = top / jnp.sum(top, axis=-1, keepdims=True)
    return top.astype(weight_dtype), ids.astype(jnp.int32)


def grouped_expert_mlp(x_nd: jax.Array, ids_nk: jax.Array, weights_nk: jax.Array, gate_edf: jax.Array,
                       up_edf: jax.Array, down_efd: jax.Array, act: Any = jax.nn.silu) -> jax.Array:
    """sum_j weights[n, j] * down_e(act(gate_e x_n) * up_e x_n) with e = ids[n, j]: y [N, D] in x's dtype.

    The N * k assignments are sorted by expert (stable), so each expert's rows are one contiguous group of
    `ragged_dot`; `group_sizes` counts the rows per expert. An id equal to E marks an empty row (expert
    parallelism's unused slots): it sorts last, outside every group, and its output is 0; other ids outside [0, E)
    are not allowed."""
    n, d = x_nd.shape
    k = ids_nk.shape[1]
    e = gate_edf.shape[0]
    flat = ids_nk.reshape(-1)
    order = jnp.argsort(flat, stable=True)  # assignment rows sorted by expert
    group_sizes = jnp.bincount(flat, length=e).astype(jnp.int32)
    xs = jnp.take(x_nd, order // k, axis=0)  # [N k, D]: the token of each sorted assignment
    gate = jax.lax.ragged_dot(xs, gate_edf, group_sizes)
    up = jax.lax.ragged_dot(xs, up_edf, group_sizes)
    out = jax.lax.ragged_dot(act(gate) * up, down_efd, group_sizes)  # [N k, D], sorted order
    inverse = jnp.zeros_like(order).at[order].set(jnp.arange(n * k, dtype=order.dtype))
    per_token = jnp.take(out, inverse, axis=0).reshape(n, k, d)  # back to (token, j) order
    return jnp.einsum("nkd,nk->nd", per_token, weights_nk.astype(per_token.dtype))


class SparseMoE(nnx.Module):
    """The routed MoE MLP of one decoder layer. `text` is any text config with `hidden_size`, `hidden_act`,
    `num_experts`, `num_experts_per_tok`, `moe_intermediate_size` and `norm_topk_prob`.

    `block(x [B, T, D]) -> [B, T, D]` (the decoder's MLP slot, as `layers.TextMLP`); `block.forward(x,
    forced_topk_ids [B, T, k] or None) -> (y, Routing [B, T, ...])` also returns what the router decided."""

    def __init__(self, text: Any, *, rngs: nnx.Rngs, param_dtype: jnp.dtype, compute_dtype: jnp.dtype):
        d, f, e = text.hidden_size, text.moe_intermediate_size, text.num_experts
        self.compute_dtype = compute_dtype
        self.act_name = text.hidden_act
        self.top_k = text.num_experts_per_tok
        self.norm_topk_prob = text.norm_topk_prob
        self.router_kernel_de = param(rngs, (d, e), ("embed", None), param_dtype)
        self.gate_experts_edf = param(rngs, (e, d, f), ("expert", "embed", "mlp"), param_dtype)
        self.up_experts_edf = param(rngs, (e, d, f), ("expert", "embed", "mlp"), param_dtype)
        self.down_experts_efd = param(rngs, (e, f, d), ("expert", "mlp", "embed"), param_dtype)

    def forward(self, x_btd: jax.Array, forced_topk_ids: jax.Array | None = None) -> tuple[jax.Array, Routing]:
        """x [B, T, D] -> (y [B, T, D], Routing with leading dims [B, T]); forced_topk_ids int [B, T, k] replaces
        the router's choice (routing replay)."""
        cd = self.compute_dtype
        b, t, d = x_btd.shape
        x = x_btd.astype(cd).reshape(b * t, d)
        logits = jnp.einsum("nd,de->ne", x, self.router_kernel_de[...].astype(cd))
        forced = None if forced_topk_ids is None else forced_topk_ids.reshape(-1, self.top_k)
        weights, ids = route(logits, self.top_k, self.norm_topk_prob, forced, weight_dtype=cd)
        experts = (self.gate_experts_edf[...].astype(cd), self.up_experts_edf[...].astype(cd),
                   self.down_experts_efd[...].astype(cd))
        layout = current()
        plan = expert_parallel.expert_parallel(layout, (b, t, d), experts[0].shape,
                                               None if layout is None else layout.moe_capacity_factor)
        if plan is None:
            y = grouped_expert_mlp(x, ids, weights, *experts, activation(self.act_name)).reshape(b, t, d)
            dropped = jnp.zeros((b, t), jnp.int32)
        else:
            y, dropped = expert_parallel.dispatch(plan, x.reshape(b, t, d), ids.reshape(b, t, -1),
                                                  weights.reshape(b, t, -1), *experts, activation(self.act_name),
                                                  grouped_expert_mlp)
        routing = Routing(logits.astype(F32).reshape(b, t, -1), ids.reshape(b, t, -1), weights.reshape(b, t, -1),
                          dropped)
        return constrain(y, ROWS_HIDDEN), routing

    def __call__(self, x_btd: jax.Array) -> jax.Array:
        return self.forward(x_btd)[0]


# ----------------------------------------------------------------------------- train-step extras (pure)


def _stack(router_logits: jax.Array | Sequence[jax.Array]) -> jax.Array:
    """[L, N, E] from a stacked array [L, ..., E] or a sequence of per-layer [..., E] arrays."""
    stacked = router_logits if isinstance(router_logits, jax.Array) else jnp.stack(list(router_logits))
    return stacked.reshape(stacked.shape[0], -1, stacked.shape[-1])


def load_balancing_loss(router_logits: jax.Array | Sequence[jax.Array], top_k: int,
                        valid: jax.Array | None = None) -> jax.Array:
    """The Switch-Transformer auxiliary loss exactly as transformers' `load_balancing_loss_func` (Mixtral,
    Qwen3-VL-MoE) computes it, fp32 scalar: over all layers' tokens together,
    E * sum_e (assignments to e / tokens) * (mean router probability of e), where the top-k of each layer's softmax
    are the assignments (so the first factor sums to k). The train step adds `router_aux_loss_coef` times it.

    router_logits: [L, ..., E] (or L arrays [..., E]); valid: bool/0-1 over the token dims [...] (transformers'
    attention_mask; padding excluded), or None for every token."""
    logits = _stack(router_logits).astype(F32)
    num_layers, n, e = logits.shape
    probs = jax.nn.softmax(logits, axis=-1)
    _, ids = jax.lax.top_k(probs, top_k)  # [L, N, k]
    mask = jnp.ones((n,), F32) if valid is None else valid.reshape(-1).astype(F32)
    counts = jnp.sum(jax.nn.one_hot(ids, e, dtype=F32) * mask[None, :, None, None], axis=(0, 1, 2))  # [E]
    prob_sum = jnp.sum(probs * mask[None, :, None], axis=(0, 1))  # [E]
    rows = num_layers * jnp.sum(mask)
    return jnp.sum((counts / rows) * (prob_sum / rows)) * e


def expert_load(topk_ids: jax.Array | Sequence[jax.Array], num_experts: int, valid: jax.Array | None = None) -> jax.Array:
    """Tokens routed to each expert, per layer: int32 [L, E] from top-k ids [L, ..., k] (or L arrays [..., k]);
    `valid` [...] leaves padding out. Each row sums to k * (valid tokens)."""
    stacked = topk_ids if isinstance(topk_ids, jax.Array) else jnp.stack(list(topk_ids))
    ids = stacked.reshape(stacked.shape[0], -1, stacked.shape[-1])
    mask = jnp.ones(ids.shape[1], jnp.int32) if valid is None else valid.reshape(-1).astype(jnp.int32)
    return jnp.sum(jax.nn.one_hot(ids, num_experts, dtype=jnp.int32) * mask[None, :, None, None], axis=(1, 2))
