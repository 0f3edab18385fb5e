"""Rollout corrections: importance weights and masks for the gap between the engine that sampled and the trainer.

Each `ROLLOUT_CORRECTIONS` entry (`--rollout-correction NAME`) is a pure `jnp` function

    fn(train_logprobs, rollout_logprobs, loss_mask, sequence_ids, *, low, high, num_sequences) -> Correction

of [B, T] arrays: the trainer's log-probs of the sampled tokens (the behaviour policy it recomputes, `old_logprobs`;
constant), the engine's, the 0/1 loss mask (observation tokens are 0 and never count), and the sequence ids of a
packed micro-batch (-1 on padding; ids in [0, num_sequences)). It returns `Correction(weights, keep)`:

- `weights` [B, T]: constant (stop-gradient) factors of the per-token policy-gradient loss; 0 off the loss mask.
- `keep` [B, T]: 0/1; a 0 drops the token from every loss term (policy gradient, KL, entropy). The aggregation
  weights stay the host's (`rl/aggregation.py`): a dropped token counts as a token whose loss is 0, as the
  `--custom-tis-function-path` hook's mask always did (slime renormalises its per-sample denominators instead).

With d_t = clip(train_t - rollout_t, -20, 20) on loss-mask tokens (the bound of slime's and verl's helpers: exp
cannot overflow), r_t = exp(d_t), and for the packed sequence S of token t, D_S = clip(sum_{u in S} d_u, -20, 20)
and G_S = exp(mean_{u in S} d_u) over S's loss-mask tokens (one sequence never spans two micro-batches):

- none:          w = 1, keep = 1 (the diagnostics alone).
- token_tis:     w = clip(r_t, low, high) (slime's --use-tis, --tis-clip-low, --tis-clip).
- sequence_tis:  w = clip(exp(D_S), low, high) on every token of S.
- token_mis:     keep = [low <= r_t <= high], w = r_t on kept tokens (masked IS: slime's MIS mask mode at token
                 level; a dropped token leaves the pg, KL and entropy terms).
- sequence_mis:  keep = [low <= exp(D_S) <= high] for all of S, w = exp(D_S) (verl's Seq-MIS).
- icepop:        w = r_t * [low <= r_t <= high], keep = 1 (IcePop, AReaL/OpenRLHF: only the policy-gradient
                 coefficient is masked; unlike token_mis, an out-of-band token keeps its KL and entropy terms).
- geo_mask:      keep = [low <= G_S <= high] for all of S, w = 1 (SkyRL's geometric sequence mask,
                 OpenRLHF's seq-mask; length-independent, so the band is narrow, e.g. [0.999, 1.001]).
- custom:        w = 1, keep = 1 here: the loss calls the `--custom-tis-function-path` hook on the per-token
                 policy-gradient loss in place of a registry entry's weights and mask (`losses.py`).

`rollout_correction` applies an entry and adds its diagnostics (`Metric`s, each a mean with a count as its
weight, so micro-batches combine exactly), logged as `train/rollout_corr/<name>`:
- `k3`: mean over loss-mask tokens of r_t - 1 - d_t (k3 estimate of KL(rollout || trainer); verl's `k3_kl`).
- `chi2`: mean over loss-mask tokens of r_t^2 - 1 (token chi-squared divergence of trainer from rollout;
  verl's `chi2_token`).
- `masked_token_frac`: the share of loss-mask tokens whose policy-gradient term the correction removes
  (keep = 0, or weight 0 as icepop's).
- `masked_seq_frac`: the share of sequences (those with a loss-mask token) with at least one such token.
- `weight_mean`: the mean weight over the loss-mask tokens it keeps (absent with `custom`: the hook's
  weighting is inside the loss it returns).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxrl_vlm.rl.metrics import Metric
from jaxrl_vlm.rl.options import CUSTOM_CORRECTION as CUSTOM
from jaxrl_vlm.rl.registries import ROLLOUT_CORRECTIONS

LOG_RATIO_BOUND = 20.0  # |log ratio| bound before exp, token and sequence alike (slime's and verl's SAFETY_BOUND)
METRIC_PREFIX = "rollout_corr/"


class Correction(NamedTuple):
    """What a correction does to the per-token loss; both [B, T], constant, 0 off the loss mask.

    weights: factors of the per-token policy-gradient loss.
    keep: 0/1 float; 0 drops the token from every loss term.
    """

    weights: jax.Array
    keep: jax.Array


class CorrectionResult(NamedTuple):
    """A correction applied: its `Correction` fields and its diagnostics (`rollout_corr/<name>` Metrics)."""

    weights: jax.Array
    keep: jax.Array
    metrics: dict[str, Metric]


CorrectionFn = Callable[..., Correction]
register_correction = ROLLOUT_CORRECTIONS.register


# ----------------------------------------------------------------------------- shared math (pure)


def token_log_ratio(train_logprobs: jax.Array, rollout_logprobs: jax.Array, loss_mask: jax.Array) -> jax.Array:
    """d_t = clip(train - rollout, -20, 20) on loss-mask tokens, 0 elsewhere (padding garbage never leaks), [B, T]."""
    m = loss_mask > 0
    d = jnp.where(m, jax.lax.stop_gradient(train_logprobs) - jax.lax.stop_gradient(rollout_logprobs), 0.0)
    return jnp.clip(d, -LOG_RATIO_BOUND, LOG_RATIO_BOUND)


def _segments(sequence_ids: jax.Array, num_sequences: int | None) -> tuple[jax.Array, int]:
    """Flat segment ids [B*T] and the segment count: padding (-1) goes to an extra last segment never read back.
    Without `num_sequences`, B*T bounds the ids (each sequence has a token)."""
    n = sequence_ids.size if num_sequences is None else num_sequences
    return jnp.where(sequence_ids >= 0, sequence_ids, n).reshape(-1), n + 1


def per_sequence(x: jax.Array, loss_mask: jax.Array, sequence_ids: jax.Array, num_sequences: int | None,
                 ) -> tuple[jax.Array, jax.Array]:
    """(sum, count) of x over the loss-mask tokens of each token's sequence, broadcast back to [B, T]."""
    ids, n = _segments(sequence_ids, num_sequences)
    m = (loss_mask > 0).astype(x.dtype)
    sums = jax.ops.segment_sum((x * m).reshape(-1), ids, num_segments=n)
    counts = jax.ops.segment_sum(m.reshape(-1), ids, num_segments=n)
    return sums[ids].reshape(x.shape), counts[ids].reshape(x.shape)


def _in_band(ratio: jax.Array, low: float, high: float) -> jax.Array:
    return (ratio >= low) & (ratio <= high)


def _on_mask(x: jax.Array, loss_mask: jax.Array) -> jax.Array:
    return jnp.where(loss_mask > 0, x, jnp.zeros_like(x))


# ----------------------------------------------------------------------------- the registry


@register_correction("none")
def no_correction(train_logprobs, rollout_logprobs, loss_mask, sequence_ids, *, low, high, num_sequences):
    """No correction: w = 1, keep = 1 (the mismatch diagnostics are still logged)."""
    ones = _on_mask(jnp.ones_like(train_logprobs), loss_mask)
    return Correction(ones, ones)


@register_correction("token_tis")
def token_tis(train_logprobs, rollout_logprobs, loss_mask, sequence_ids, *, low, high, num_sequences):
    """Token truncated IS: w_t = clip(r_t, low, high), r_t = exp(train_t - rollout_t) (slime's --use-tis)."""
    d = token_log_ratio(train_logprobs, rollout_logprobs, loss_mask)
    return Correction(_on_mask(jnp.clip(jnp.exp(d), low, high), loss_mask), _on_mask(jnp.ones_like(d), loss_mask))


def _sequence_log_ratio(train_logprobs, rollout_logprobs, loss_mask, sequence_ids, num_sequences) -> jax.Array:
    """D_S = clip(sum of d_u over the sequence's loss-mask tokens, -20, 20), on each token of S, [B, T]."""
    d = token_log_ratio(train_logprobs, rollout_logprobs, loss_mask)
    total, _ = per_sequence(d, loss_mask, sequence_ids, num_sequences)
    return jnp.clip(total, -LOG_RATIO_BOUND, LOG_RATIO_BOUND)


@register_correction("sequence_tis")
def sequence_tis(train_logprobs, rollout_logprobs, loss_mask, sequence_ids, *, low, high, num_sequences):
    """Sequence truncated IS: w = clip(exp(sum_{u in S} d_u), low, high) on every token of sequence S."""
    ratio = jnp.exp(_sequence_log_ratio(train_logprobs, rollout_logprobs, loss_mask, sequence_ids, num_sequences))
    return Correction(_on_mask(jnp.clip(ratio, low, high), loss_mask), _on_mask(jnp.ones_like(ratio), loss_mask))


@register_correction("token_mis")
def token_mis(train_logprobs, rollout_logprobs, loss_mask, sequence_ids, *, low, high, num_sequences):
    """Token masked IS: tokens with r_t outside [low, high] leave the loss (pg, KL, entropy); kept ones weigh r_t."""
    ratio = jnp.exp(token_log_ratio(train_logprobs, rollout_logprobs, loss_mask))
    keep = _on_mask(_in_band(ratio, low, high).astype(ratio.dtype), loss_mask)
    return Correction(ratio * keep, keep)


@register_correction("sequence_mis")
def sequence_mis(train_logprobs, rollout_logprobs, loss_mask, sequence_ids, *, low, high, num_sequences):
    """Sequence masked IS: a sequence whose ratio exp(sum_{u in S} d_u) is outside [low, high] leaves the loss;
    a kept one weighs that ratio (verl's Seq-MIS)."""
    ratio = jnp.exp(_sequence_log_ratio(train_logprobs, rollout_logprobs, loss_mask, sequence_ids, num_sequences))
    keep = _on_mask(_in_band(ratio, low, high).astype(ratio.dtype), loss_mask)
    return Correction(ratio * keep, keep)


@register_correction("icepop")
def icepop(train_logprobs, rollout_logprobs, loss_mask, sequence_ids, *, low, high, num_sequences):
    """IcePop: the policy-gradient coefficient is r_t inside [low, high] and 0 outside (the paper's band: 0.5, 5);
    the token keeps its KL and entropy terms."""
    ratio = jnp.exp(token_log_ratio(train_logprobs, rollout_logprobs, loss_mask))
    inside = _in_band(ratio, low, high).astype(ratio.dtype)
    return Correction(_on_mask(ratio * inside, loss_mask), _on_mask(jnp.ones_like(ratio), loss_mask))


@register_correction("geo_mask")
def geo_mask(train_logprobs, rollout_logprobs, loss_mask, sequence_ids, *, low, high, num_sequences):
    """Geometric sequence mask: a sequence whose exp(mean_{u in S} d_u) is outside [low, high] leaves the loss;
    w = 1 (SkyRL's geometric mask; a narrow band such as [0.999, 1.001])."""
    d = token_log_ratio(train_logprobs, rollout_logprobs, loss_mask)
    total, count = per_sequence(d, loss_mask, sequence_ids, num_sequences)
    geo = jnp.exp(total / jnp.maximum(count, 1.0))
    keep = _on_mask(_in_band(geo, low, high).astype(d.dtype), loss_mask)
    return Correction(keep, keep)


@register_correction(CUSTOM)
def custom(train_logprobs, rollout_logprobs, loss_mask, sequence_ids, *, low, high, num_sequences):
    """slime's custom TIS/RS hook (--custom-tis-function-path): the loss calls it on the per-token policy-gradient
    loss in place of a correction's weights and mask; w = 1, keep = 1 here."""
    return no_correction(train_logprobs, rollout_logprobs, loss_mask, sequence_ids, low=low, high=high,
                         num_sequences=num_sequences)


# ----------------------------------------------------------------------------- applied, with diagnostics


def correction_metrics(train_logprobs: jax.Array, rollout_logprobs: jax.Array, loss_mask: jax.Array,
                       sequence_ids: jax.Array, weights: jax.Array | None, keep: jax.Array,
                       num_sequences: int | None) -> dict[str, Metric]:
    """The diagnostics of a correction (module docstring), as count-weighted means; `weights` None (a hook's
    correction) leaves out `weight_mean`."""
    m = (loss_mask > 0).astype(train_logprobs.dtype)
    d = token_log_ratio(train_logprobs, rollout_logprobs, loss_mask)
    r = jnp.exp(d)
    dropped = m * (keep <= 0) if weights is None else m * ((keep <= 0) | (weights == 0))
    kept = m - dropped
    tokens = jnp.sum(m)
    ids, n = _segments(sequence_ids, num_sequences)
    seq_tokens = jax.ops.segment_sum(m.reshape(-1), ids, num_segments=n)[:-1]
    seq_dropped = jax.ops.segment_sum(dropped.reshape(-1), ids, num_segments=n)[:-1]
    metrics = {
        # expm1: the engine and trainer agree to ~1e-7 nats, where exp(d) - 1 - d cancels to 0 in float32.
        "k3": Metric.mean(jnp.sum(m * (jnp.expm1(d) - d)), tokens),
        "chi2": Metric.mean(jnp.sum(m * jnp.expm1(2.0 * d)), tokens),
        "masked_token_frac": Metric.mean(jnp.sum(dropped), tokens),
        "masked_seq_frac": Metric.mean(jnp.sum((seq_dropped > 0).astype(m.dtype)),
                                       jnp.sum((seq_tokens > 0).astype(m.dtype))),
    }
    if weights is not None:
        metrics["weight_mean"] = Metric.mean(jnp.sum(kept * weights), jnp.sum(kept))
    return {METRIC_PREFIX + k: jax.tree.map(jax.lax.stop_gradient, v) for k, v in metrics.items()}


def rollout_correction(name: str, train_logprobs: jax.Array, rollout_logprobs: jax.Array, loss_mask: jax.Array,
                       sequence_ids: jax.Array, *, low: float, high: float,
                       num_sequences: int | None = None) -> CorrectionResult:
    """The `ROLLOUT_CORRECTIONS` entry `name` applied to one micro-batch ([B, T] arrays), with its diagnostics.

    `num_sequences` bounds the sequence ids (the train step's static `LossConfig.num_sequences`); None: B*T.
    """
    if not 0.0 <= low < high or not math.isfinite(high):
        raise ValueError(f"rollout correction {name!r} needs 0 <= low < high < inf, got low={low}, high={high}")
    fn = ROLLOUT_CORRECTIONS.get(name)
    c = fn(train_logprobs, rollout_logprobs, loss_mask, sequence_ids, low=low, high=high, num_sequences=num_sequences)
    weights, keep = jax.lax.stop_gradient(c.weights), jax.lax.stop_gradient(c.keep)
    metrics = correction_metrics(train_logprobs, rollout_logprobs, loss_mask, sequence_ids,
                                 None if name == CUSTOM else weights, keep, num_sequences)
    return CorrectionResult(weights, keep, metrics)
