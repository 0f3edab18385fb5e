"""The train step's mixture-of-experts terms (pure jnp): router load-balancing loss, router z-loss and the
per-layer expert load they are logged with.

Everything counts only real tokens (`valid`: segment ids > 0, so prompt and response tokens, never padding).
A micro-batch's term is its own value weighted by its share of the batch's real tokens, so the terms summed over
the micro-batches of one optimizer step are the token-weighted mean of the per-micro-batch values (the
load-balancing loss is a product of two token means, not a token sum, so no split of it is exactly additive;
with one micro-batch it is exactly transformers' `load_balancing_loss_func` on the batch's real tokens).

The z-loss is ST-MoE's (Zoph et al. 2022, eq. 5): mean over tokens of logsumexp(router logits)^2, here also
averaged over the sparse layers (as the load-balancing loss pools them).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxrl_vlm.models.moe import Routing, expert_load, load_balancing_loss

F32 = jnp.float32


class RouterTerms(NamedTuple):
    """One micro-batch's router terms: `loss` (coef-weighted, share-weighted: added to the policy loss), the raw
    `aux_loss` and `z_loss` (share-weighted, so their sum over micro-batches is the batch value), `load`
    int32 [L_sparse, E] (tokens routed to each expert) and `dropped` (token copies over expert-parallel capacity,
    all sparse layers; both added over micro-batches)."""

    loss: jax.Array
    aux_loss: jax.Array
    z_loss: jax.Array
    load: jax.Array
    dropped: jax.Array


def router_z_loss(router_logits: jax.Array, valid: jax.Array) -> jax.Array:
    """mean over layers and valid tokens of logsumexp(logits)^2: fp32 scalar from logits [L, ..., E] and
    `valid` [...] (0 when there is no valid token)."""
    logits = router_logits.astype(F32).reshape(router_logits.shape[0], -1, router_logits.shape[-1])
    mask = valid.reshape(-1).astype(F32)
    z = jax.nn.logsumexp(logits, axis=-1) ** 2  # [L, N]
    return jnp.sum(z * mask[None]) / jnp.maximum(logits.shape[0] * jnp.sum(mask), 1.0)


def router_terms(routing: Routing, valid: jax.Array, share: jax.Array, *, top_k: int, aux_coef: float,
                 z_coef: float) -> RouterTerms:
    """The terms of one micro-batch's `routing` ([L, B, T, ...]); `valid` [B, T] marks real tokens and `share` is
    this micro-batch's real tokens over the batch's (a scalar in [0, 1])."""
    num_experts = routing.logits.shape[-1]
    aux = load_balancing_loss(routing.logits, top_k, valid) if aux_coef else jnp.zeros((), F32)
    z = router_z_loss(routing.logits, valid) if z_coef else jnp.zeros((), F32)
    load = expert_load(jax.lax.stop_gradient(routing.topk_ids), num_experts, valid)
    aux, z = share * aux, share * z
    dropped = getattr(routing, "dropped", None)
    dropped = jnp.zeros((), F32) if dropped is None else jnp.sum(dropped * valid[None]).astype(F32)
    return RouterTerms(aux_coef * aux + z_coef * z, aux, z, load, jax.lax.stop_gradient(dropped))


def load_metrics(load: jax.Array, dropped: jax.Array | float = 0.0) -> dict[str, jax.Array]:
    """Expert-load metrics from the batch's tokens per expert `load` [L_sparse, E] (layer i is the i-th sparse
    layer): per layer `moe/layer{i}/max_over_mean` (1 = perfect balance, E = everything on one expert) and
    `moe/layer{i}/max_tokens`; over layers `moe/max_over_mean` (the worst layer), `moe/mean_max_over_mean`,
    `moe/tokens_per_expert_mean` and `moe/dropped_tokens` (token copies over an expert's capacity under expert
    parallelism, summed over sparse layers: 0 with the default, no-drop capacity)."""
    load = load.astype(F32)
    mean = jnp.mean(load, axis=-1)  # [L]
    peak = jnp.max(load, axis=-1)
    ratio = jnp.where(mean > 0, peak / jnp.where(mean > 0, mean, 1.0), 0.0)
    out = {}
    for i in range(load.shape[0]):
        out[f"moe/layer{i}/max_over_mean"] = ratio[i]
        out[f"moe/layer{i}/max_tokens"] = peak[i]
    out["moe/max_over_mean"] = jnp.max(ratio)
    out["moe/mean_max_over_mean"] = jnp.mean(ratio)
    out["moe/tokens_per_expert_mean"] = jnp.mean(mean)
    out["moe/dropped_tokens"] = jnp.asarray(dropped, F32)
    return out
