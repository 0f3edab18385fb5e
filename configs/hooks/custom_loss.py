"""Example `--loss-type custom_loss --custom-loss-function-path`: two policy losses on the loss registry's contract.

    jaxrl-vlm train CONFIG --loss-type custom_loss --custom-loss-function-path configs/hooks/custom_loss.py:reinforce
    jaxrl-vlm train CONFIG --loss-type custom_loss --custom-loss-function-path configs/hooks/custom_loss.py:clipped_pg

A loss is `fn(inputs: LossInputs, cfg: LossConfig) -> (loss, metrics)`, pure jax.numpy: the compiled train step
traces it once per batch shape. Arrays are [B, T] (one micro-batch); the loss is the token-weighted sum
`sum_t w_t * loss_t` with `inputs.token_weights` (computed over the global batch, so micro-batching stays exact).
Each metric is a `Metric` of a float scalar that says how it combines over micro-batches (a plain array is an
error): `Metric.sum(x)` adds, `Metric.mean(sum_t w_t * x_t, sum_t w_t)` is a weighted mean (both parts added, divided
once), `Metric.max(x)` / `Metric.min(x)` keep the extreme. They are logged as `train/<name>`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl_vlm.rl.losses import LossConfig, LossInputs
from jaxrl_vlm.rl.metrics import Metric


def _weights(inputs: LossInputs) -> jax.Array:
    return jnp.where(inputs.loss_mask > 0, inputs.token_weights, 0.0)


def reinforce(inputs: LossInputs, cfg: LossConfig) -> tuple[jax.Array, dict[str, jax.Array]]:
    """REINFORCE with the group baseline already in the advantages: loss_t = -A_t log p_t (no ratio, no clip)."""
    w = _weights(inputs)
    logp = jnp.where(inputs.loss_mask > 0, inputs.logprobs, 0.0)
    loss = jnp.sum(w * -jax.lax.stop_gradient(inputs.advantages) * logp)
    return loss, {"pg_loss": Metric.sum(jax.lax.stop_gradient(loss)), "weight_sum": Metric.sum(jnp.sum(w))}


def clipped_pg(inputs: LossInputs, cfg: LossConfig) -> tuple[jax.Array, dict[str, jax.Array]]:
    """PPO's clipped surrogate written out (asymmetric clip [1 - eps_clip, 1 + clip_high]), to start a variant from.

    Equals the registry's ppo_clip without TIS, KL loss, entropy bonus or dual clip.
    """
    sg = jax.lax.stop_gradient
    w = _weights(inputs)
    log_ratio = jnp.where(inputs.loss_mask > 0, inputs.logprobs - sg(inputs.old_logprobs), 0.0)
    ratio = jnp.exp(log_ratio)
    adv = sg(inputs.advantages)
    unclipped = -ratio * adv
    clipped = -jnp.clip(ratio, 1.0 - cfg.eps_clip, 1.0 + cfg.clip_high) * adv
    per_token = jnp.where(clipped > unclipped, clipped, unclipped)  # where, not max: clipped tokens get no gradient
    loss = jnp.sum(w * per_token)
    # The clip fraction is a token-weighted mean: its partial sum and weight here, divided after the micro-batches.
    clipfrac = Metric.mean(jnp.sum(w * (clipped > unclipped)), jnp.sum(w))
    return loss, {"pg_loss": Metric.sum(sg(loss)), "pg_clipfrac": clipfrac, "weight_sum": Metric.sum(jnp.sum(w))}
