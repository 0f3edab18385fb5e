"""Policy-gradient losses: one registry, one signature, micro-batch-exact aggregation.

Every loss is `fn(inputs: LossInputs, cfg: LossConfig) -> (loss, metrics)`: pure
`jnp`, jittable with `cfg` static. Adding a variant is one decorated function
that builds the per-token policy-gradient term; `_assemble` adds what all
variants share (the rollout correction, KL-to-reference loss, entropy bonus,
aggregation, metrics).

Arrays are `[B, T]`, already aligned to next-token targets. Rows may be packed:
`sequence_ids` says which sequence of the micro-batch a token belongs to (-1 on
padding). The aggregation is NOT computed here: `token_weights` comes from
`aggregation_weights` on the host over the GLOBAL batch, so the loss of a
micro-batch is the plain sum `sum_t w_t * loss_t`. Summing the micro-batch
losses (and their gradients) gives the full-batch loss exactly, whatever the
split. (DESIGN.md's positional signature could not carry packing or global
normalisers; this one does.)

Semantics follow slime (`utils/ppo_utils.py`, `megatron_utils/loss.py`):
- ratio r = exp(logp - old); `ppo_kl` = old - logp.
- ppo_clip: max(-r A, -clip(r, 1-eps, 1+eps_high) A); dual clip for A < 0:
  min(that, -c A). Clipped tokens have zero gradient.
- gspo: the sequence ratio s_i = exp(mean over the sequence's masked tokens of
  (logp - old)) goes through the same clipped objective. Gradient as the
  GSPO-token objective of the GSPO paper (Zheng et al. 2025): s_{i,t} =
  sg(s_i) * exp(logp_t - sg(logp_t)), so d loss_t / d logp_t = -s_i A_t and
  nothing flows across tokens. slime instead lets the gradient flow through the
  mean, d/d logp_u = -(m_u / n_i) * s_i * sum over the sequence's unclipped
  tokens of w_t A_t; the two agree whenever w_t and A_t are constant within a
  sequence, which holds for all three aggregation modes and sequence-level
  advantages (tested). The token form keeps the backward local (no segment sum).
- cispo (MiniMax-M1): -sg(clip(r, 1-eps, 1+eps_high)) * A * logp.
- Rollout correction (`--rollout-correction`, `rl/corrections.py`, `apply_rollout_correction`):
  the `ROLLOUT_CORRECTIONS` entry, a function of (old = the trainer's behaviour log-probs,
  rollout, loss mask, sequence ids, bounds), gives stop-gradient weights that multiply the
  per-token policy-gradient loss and a keep-mask; slime's `--use-tis` is `token_tis`,
  w = clip(exp(old - rollout), low, high). `--custom-tis-function-path` is the entry
  `custom` (`custom_tis_function`): it returns the new per-token pg loss and a mask. Tokens
  a correction or the hook masks out leave the pg, KL and entropy terms (diagnostics keep
  them, as slime's mismatch metrics do), while the token weights (the aggregation
  denominators, computed on the host) stay as they were (slime rebuilds its denominators).
  Applied here, once, so every registered policy loss gets it; a `--loss-type custom_loss`
  function receives the settings in `cfg` and applies it with `apply_rollout_correction`.
- `--loss-type` picks what the step trains from `LOSS_TYPES`: `policy_loss` (the `POLICY_LOSSES` entry of
  `--policy-loss`), `custom_loss` (a user function on this module's contract, `custom_loss`, checked at trace
  time) or `sft_loss` (the NLL of the masked tokens, `sft_loss`, not a policy loss).
- KL(ref) loss with lr = logp - ref, from `KL_ESTIMATORS`: k1 = lr, k2 = lr^2/2, k3 =
  low_var_kl = exp(-lr) - 1 + lr; slime negates lr before exp(lr) - 1 - lr, which is the
  same expression. Only low_var_kl is clamped to [-10, 10].
- total = pg_loss + kl_loss_coef * kl_loss (if use_kl_loss) - entropy_coef * entropy.
  All three terms use the same token weights (slime uses the default reducer for
  the KL and entropy terms even under a custom pg reducer; with Dr.GRPO weights we
  normalise them the same way as the policy term).

Metrics are `Metric`s (`rl/metrics.py`): each carries its reduction over micro-batches, so
a train step combines them (`accumulate_metrics`) and reduces once (`finalize_metrics`):
- sum: exact loss components (`loss`, `pg_loss`, `kl_loss`, `entropy_loss`) and
  `weight_sum` = sum of the weights of the masked tokens.
- mean: diagnostics, partial sums of w_t * x_t over the weight of the masked tokens
  (a custom TIS function's `tis/<name>` too). Under token_mean and seq_mean_token_mean
  the global weights sum to 1, so these equal slime's `sum_of_sample_mean` values. The
  rollout correction's `rollout_corr/<name>` are plain token (or sequence) means instead:
  they describe the sampled data, whatever the aggregation.
- max: `ratio_max` over masked tokens (0 where there are none).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

# Host-side aggregation lives in a numpy-only module (batching imports it without jax); re-exported here.
from jaxrl_vlm.rl.aggregation import AGGREGATION_MODES, aggregation_weights, check_aggregation  # noqa: F401
from jaxrl_vlm.rl.corrections import CUSTOM, correction_metrics, rollout_correction
from jaxrl_vlm.rl.metrics import Metric, Reduction, accumulate_metrics, finalize_metrics  # noqa: F401
from jaxrl_vlm.rl.options import LossOptions, rollout_correction_problem
from jaxrl_vlm.rl.registries import KL_ESTIMATORS, LOSS_TYPES, POLICY_LOSSES, ROLLOUT_CORRECTIONS
from rollout.hooks import load_hook

KL_TYPES = KL_ESTIMATORS  # the --kl-loss-type names (a registry: `in`, iteration, `names()`)
LOW_VAR_KL_CLAMP = 10.0


@struct.dataclass
class LossInputs:
    """Per-token training inputs of one micro-batch; every array is [B, T].

    logprobs: current policy log p(token_{t+1}) (differentiated).
    old_logprobs: behaviour policy recomputed by the trainer (constant).
    advantages: per-token advantages (constant; broadcast from the sequence).
    loss_mask: float 0/1, 1 on trainable (model-generated) tokens.
    sequence_ids: int32, sequence index within the micro-batch, -1 on padding.
    token_weights: float, aggregation weight from `aggregation_weights` (global batch).
    ref_logprobs: reference policy, needed by the KL loss; None if unused.
    rollout_logprobs: the engine's sampling log-probs, needed by a rollout correction; None if unused.
    entropy: per-token policy entropy (nats), needed by the entropy bonus; None if unused.
    """

    logprobs: jax.Array
    old_logprobs: jax.Array
    advantages: jax.Array
    loss_mask: jax.Array
    sequence_ids: jax.Array
    token_weights: jax.Array
    ref_logprobs: jax.Array | None = None
    rollout_logprobs: jax.Array | None = None
    entropy: jax.Array | None = None


@dataclasses.dataclass(frozen=True)
class LossConfig(LossOptions):
    """Static loss hyperparameters (hashable; pass as a static jit argument).

    The user's hyper-parameters (clip ranges, rollout correction, KL loss, entropy bonus) are the fields of
    `LossOptions` (rl/options.py), declared there once with their help and bounds; the trainer adds:
    num_sequences: static upper bound on sequences per micro-batch (the segment
        sums of gspo and of the rollout corrections); ids must lie in [0, num_sequences).
    aggregation / aggregation_constant: the mode `aggregation_weights` should use
        on the host (the loss reads only the resulting `token_weights`).
    """

    num_sequences: int | None = None
    aggregation: str = "seq_mean_token_mean"
    aggregation_constant: float | None = None

    def __post_init__(self) -> None:
        # eps_clip >= 1 is allowed: it switches the lower bound off (canonical CISPO).
        if self.eps_clip < 0.0:
            raise ValueError(f"LossConfig.eps_clip must be >= 0, got {self.eps_clip}")
        if self.eps_clip_high is not None and self.eps_clip_high < 0.0:
            raise ValueError(f"LossConfig.eps_clip_high must be >= 0, got {self.eps_clip_high}")
        if self.eps_clip_c is not None and not self.eps_clip_c > 1.0:
            raise ValueError(f"LossConfig.eps_clip_c (dual clip) must be > 1, got {self.eps_clip_c}")
        if self.rollout_correction not in ROLLOUT_CORRECTIONS:
            raise ValueError(f"LossConfig.rollout_correction must be one of {ROLLOUT_CORRECTIONS.names()}, got "
                             f"{self.rollout_correction!r}")
        if self.rollout_correction_low < 0.0:
            raise ValueError(f"LossConfig.rollout_correction_low must be >= 0, got {self.rollout_correction_low}")
        problem = rollout_correction_problem(self.rollout_correction, self.rollout_correction_low,
                                             self.rollout_correction_high, self.custom_tis_function_path)
        if problem:
            raise ValueError(f"LossConfig: {problem}")
        if self.kl_loss_type not in KL_ESTIMATORS:
            raise ValueError(
                f"LossConfig.kl_loss_type must be one of {KL_ESTIMATORS.names()}, got {self.kl_loss_type!r}"
            )
        if self.num_sequences is not None and self.num_sequences < 1:
            raise ValueError(f"LossConfig.num_sequences must be >= 1, got {self.num_sequences}")
        check_aggregation(self.aggregation, self.aggregation_constant)

    @property
    def clip_high(self) -> float:
        return self.eps_clip if self.eps_clip_high is None else self.eps_clip_high


LossFn = Callable[[LossInputs, LossConfig], tuple[jax.Array, dict[str, Metric]]]
register_loss = POLICY_LOSSES.register
get_loss = POLICY_LOSSES.get
registered_losses = POLICY_LOSSES.names


def check_loss_inputs(inputs: LossInputs, cfg: LossConfig) -> None:
    """Host-side validation with actionable errors (call outside jit, e.g. in tests/batching).

    Inside jit nothing can be checked on values: an out-of-range sequence id would
    silently drop tokens from gspo's segment sums, so check batches here.
    """
    shape = np.shape(inputs.logprobs)
    if len(shape) != 2:
        raise ValueError(f"LossInputs.logprobs must be [B, T], got shape {shape}")
    for f in dataclasses.fields(inputs):
        v = getattr(inputs, f.name)
        if v is not None and np.shape(v) != shape:
            raise ValueError(f"LossInputs.{f.name} has shape {np.shape(v)}, expected {shape}")
    mask = np.asarray(inputs.loss_mask)
    ids = np.asarray(inputs.sequence_ids)
    if not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"LossInputs.sequence_ids must be integers, got {ids.dtype}")
    if not np.isin(mask, (0, 1)).all():
        raise ValueError("LossInputs.loss_mask must be 0/1")
    if ((mask > 0) & (ids < 0)).any():
        pos = tuple(int(i) for i in np.argwhere((mask > 0) & (ids < 0))[0])
        raise ValueError(f"masked token at {pos} has sequence id -1 (padding)")
    if cfg.num_sequences is not None and (ids >= cfg.num_sequences).any():
        raise ValueError(
            f"sequence id {int(ids.max())} >= LossConfig.num_sequences={cfg.num_sequences}; "
            "re-number ids per micro-batch or raise num_sequences"
        )
    w = np.asarray(inputs.token_weights)
    if not np.all(np.isfinite(w)) or (w < 0).any():
        raise ValueError("LossInputs.token_weights must be finite and >= 0")
    _check_optional_inputs(inputs, cfg)


def _check_optional_inputs(inputs: LossInputs, cfg: LossConfig) -> None:
    """Static (trace-time) checks that the inputs a config needs are present."""
    if cfg.use_kl_loss and inputs.ref_logprobs is None:
        raise ValueError("LossConfig.use_kl_loss=True needs LossInputs.ref_logprobs")
    if cfg.rollout_correction != "none" and inputs.rollout_logprobs is None:
        raise ValueError(f"LossConfig.rollout_correction={cfg.rollout_correction!r} needs LossInputs.rollout_logprobs")
    if cfg.entropy_coef != 0.0 and inputs.entropy is None:
        raise ValueError(f"LossConfig.entropy_coef={cfg.entropy_coef} needs LossInputs.entropy")


# ----------------------------------------------------------------------------- per-token math (pure)


def masked(x: jax.Array, mask: jax.Array) -> jax.Array:
    """x where mask > 0 else 0; keeps padding garbage (inf, nan) out of values and gradients."""
    return jnp.where(mask > 0, x, jnp.zeros_like(x))


register_kl_estimator = KL_ESTIMATORS.register


@register_kl_estimator("k1")
def kl_k1(log_ratio: jax.Array) -> jax.Array:
    """k1 = lr (unbiased, high variance)."""
    return log_ratio


@register_kl_estimator("k2")
def kl_k2(log_ratio: jax.Array) -> jax.Array:
    """k2 = lr^2 / 2."""
    return 0.5 * log_ratio**2


@register_kl_estimator("k3")
def kl_k3(log_ratio: jax.Array) -> jax.Array:
    """k3 = exp(-lr) - 1 + lr (unbiased, >= 0)."""
    return jnp.exp(-log_ratio) - 1.0 + log_ratio


@register_kl_estimator("low_var_kl")
def kl_low_var(log_ratio: jax.Array) -> jax.Array:
    """k3 clamped to [-10, 10], as slime's low_var_kl."""
    return jnp.clip(kl_k3(log_ratio), -LOW_VAR_KL_CLAMP, LOW_VAR_KL_CLAMP)


def kl_estimate(logprobs: jax.Array, ref_logprobs: jax.Array, kl_type: str) -> jax.Array:
    """Per-token KL(pi || ref) estimator on samples of pi (Schulman's k1/k2/k3), lr = logp - ref; `kl_type` is a
    `KL_ESTIMATORS` name."""
    return KL_ESTIMATORS.get(kl_type)(logprobs - ref_logprobs)


def clipped_surrogate(
    ratio: jax.Array, advantages: jax.Array, eps_low: float, eps_high: float, eps_c: float | None
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """PPO per-token loss, (loss, clipped, dual_clipped) with the two flags as 0/1 floats.

    Selection uses `where`, not max/min: outside the clip range the clipped branch
    is constant in the ratio, so clipped tokens get exactly zero gradient.
    """
    pg1 = -ratio * advantages
    pg2 = -jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high) * advantages
    clipped = pg2 > pg1
    loss = jnp.where(clipped, pg2, pg1)
    if eps_c is None:
        return loss, clipped.astype(ratio.dtype), jnp.zeros_like(ratio)
    pg3 = -eps_c * advantages
    dual = (advantages < 0) & (pg3 < loss)
    return jnp.where(dual, pg3, loss), clipped.astype(ratio.dtype), dual.astype(ratio.dtype)


def sequence_mean(x: jax.Array, mask: jax.Array, sequence_ids: jax.Array, num_sequences: int) -> jax.Array:
    """Mean of x over the masked tokens of each token's sequence, broadcast back to [B, T].

    Padding (id -1) goes to an extra segment that is never read back; a sequence
    with no masked tokens gets 0 (denominator clamped to 1, as slime does).
    """
    ids = jnp.where(sequence_ids >= 0, sequence_ids, num_sequences).reshape(-1)
    mx = masked(x, mask).reshape(-1)
    sums = jax.ops.segment_sum(mx, ids, num_segments=num_sequences + 1)
    counts = jax.ops.segment_sum((mask > 0).astype(x.dtype).reshape(-1), ids, num_segments=num_sequences + 1)
    means = sums / jnp.maximum(counts, 1.0)
    return means[ids].reshape(x.shape)


# ----------------------------------------------------------------------------- shared assembly


def _assemble(
    pg_per_token: jax.Array,
    ratio: jax.Array,
    ppo_kl: jax.Array,
    clipped: jax.Array,
    extra: Mapping[str, jax.Array],
    inputs: LossInputs,
    cfg: LossConfig,
) -> tuple[jax.Array, dict[str, Metric]]:
    """Apply the rollout correction, add KL and entropy terms, aggregate with the token weights, build metrics.

    pg_per_token, ratio, ppo_kl, clipped: [B, T]; extra: more per-token diagnostics (token-weighted means).
    """
    _check_optional_inputs(inputs, cfg)
    mask = inputs.loss_mask
    w = masked(inputs.token_weights, mask).astype(pg_per_token.dtype)
    weight_sum = jnp.sum(w)
    sg = jax.lax.stop_gradient

    def wsum(x: jax.Array) -> jax.Array:
        return jnp.sum(w * masked(x, mask))

    def wmean(x: jax.Array) -> Metric:
        """The token-weighted mean of a per-token diagnostic over the trainable tokens."""
        return Metric.mean(wsum(x), weight_sum)

    metrics: dict[str, Metric] = {}
    if inputs.rollout_logprobs is not None:
        pg_per_token, keep, correction = apply_rollout_correction(pg_per_token, inputs, cfg)
        metrics.update(correction)
        old, rollout = sg(inputs.old_logprobs), sg(inputs.rollout_logprobs)
        tis = jnp.exp(masked(old - rollout, mask))
        metrics["tis"] = wmean(tis)
        tis_w = jnp.clip(tis, cfg.rollout_correction_low, cfg.rollout_correction_high)
        metrics["tis_clipfrac"] = wmean((tis_w != tis).astype(w.dtype))
        metrics["train_rollout_logprob_abs_diff"] = wmean(jnp.abs(old - rollout))
    else:
        keep = mask

    # The loss terms' reduction: the host's weights on the tokens the correction keeps. Its mask applies to the pg,
    # KL and entropy terms only; diagnostics (and weight_sum, their denominator) keep the trainable tokens, as slime
    # reduces its mismatch metrics with the original mask.
    kept_w = masked(inputs.token_weights, keep).astype(pg_per_token.dtype)

    def lsum(x: jax.Array) -> jax.Array:
        return jnp.sum(kept_w * masked(x, keep))

    pg_loss = lsum(pg_per_token)
    loss = pg_loss
    if inputs.ref_logprobs is not None:
        kl = kl_estimate(masked(inputs.logprobs, mask), masked(sg(inputs.ref_logprobs), mask), cfg.kl_loss_type)
        kl_loss = lsum(kl)
        if cfg.use_kl_loss and cfg.kl_loss_coef != 0.0:
            loss = loss + cfg.kl_loss_coef * kl_loss
        metrics["kl_loss"] = Metric.sum(sg(kl_loss))
    if inputs.entropy is not None:
        entropy = lsum(inputs.entropy)
        if cfg.entropy_coef != 0.0:
            loss = loss - cfg.entropy_coef * entropy
        metrics["entropy_loss"] = Metric.sum(sg(entropy))

    r = sg(ratio)
    lr_old = sg(masked(inputs.logprobs - inputs.old_logprobs, mask))
    metrics.update(
        loss=Metric.sum(sg(loss)),
        pg_loss=Metric.sum(sg(pg_loss)),
        weight_sum=Metric.sum(weight_sum),
        pg_clipfrac=wmean(sg(clipped)),
        ppo_kl=wmean(sg(ppo_kl)),
        # k3 estimate of KL(old || current) on samples of the old policy.
        approx_kl=wmean(jnp.exp(lr_old) - 1.0 - lr_old),
        ratio_mean=wmean(r),
        ratio_max=Metric.max(jnp.max(masked(r, mask))),
    )
    for k, v in extra.items():
        metrics[k] = wmean(sg(v))
    return loss, metrics


def apply_rollout_correction(
    pg_per_token: jax.Array, inputs: LossInputs, cfg: LossConfig
) -> tuple[jax.Array, jax.Array, dict[str, Metric]]:
    """The rollout correction of `cfg` (`--rollout-correction`, or the `--custom-tis-function-path` hook for
    `custom`) applied to a per-token policy-gradient loss [B, T]: (corrected pg loss [B, T], the tokens that stay
    in the loss [B, T] (within `inputs.loss_mask`), its diagnostics). Needs `inputs.rollout_logprobs`; the
    correction compares the trainer's behaviour log-probs (`old_logprobs`) with them.
    """
    sg = jax.lax.stop_gradient
    mask = inputs.loss_mask
    old, rollout = sg(inputs.old_logprobs), sg(inputs.rollout_logprobs)
    if cfg.rollout_correction == CUSTOM:
        pg_per_token, keep, hook_metrics = custom_tis_function(cfg.custom_tis_function_path)(pg_per_token, inputs, cfg)
        metrics = correction_metrics(old, rollout, mask, inputs.sequence_ids, None, keep, cfg.num_sequences)
        w = masked(inputs.token_weights, mask).astype(pg_per_token.dtype)
        for k, v in hook_metrics.items():  # token-weighted means over the trainable tokens
            metrics[f"tis/{k}"] = Metric.mean(jnp.sum(w * masked(sg(v), mask)), jnp.sum(w))
        return pg_per_token, keep, metrics
    result = rollout_correction(cfg.rollout_correction, old, rollout, mask, inputs.sequence_ids,
                                low=cfg.rollout_correction_low, high=cfg.rollout_correction_high,
                                num_sequences=cfg.num_sequences)
    # `where`, not a product alone: a weight of 0 must not turn an inf of the loss into a nan.
    corrected = jnp.where(result.weights != 0, pg_per_token * result.weights, jnp.zeros_like(pg_per_token))
    return corrected, result.keep, result.metrics


# ----------------------------------------------------------------------------- variants


@register_loss("ppo_clip")
def ppo_clip_loss(inputs: LossInputs, cfg: LossConfig) -> tuple[jax.Array, dict[str, Metric]]:
    """PPO clipped surrogate with asymmetric clip (DAPO) and optional dual clip, per token."""
    mask = inputs.loss_mask
    adv = jax.lax.stop_gradient(inputs.advantages)
    log_ratio = masked(inputs.logprobs - jax.lax.stop_gradient(inputs.old_logprobs), mask)
    ratio = jnp.exp(log_ratio)
    pg, clipped, dual = clipped_surrogate(ratio, adv, cfg.eps_clip, cfg.clip_high, cfg.eps_clip_c)
    extra = {"pg_dualclip_frac": dual} if cfg.eps_clip_c is not None else {}
    return _assemble(pg, ratio, -log_ratio, clipped, extra, inputs, cfg)


@register_loss("gspo")
def gspo_loss(inputs: LossInputs, cfg: LossConfig) -> tuple[jax.Array, dict[str, Metric]]:
    """GSPO: the clipped objective on the sequence-level ratio, gradient as GSPO-token."""
    if cfg.num_sequences is None:
        raise ValueError("the gspo loss needs LossConfig.num_sequences (max sequences per micro-batch)")
    sg = jax.lax.stop_gradient
    mask = inputs.loss_mask
    adv = sg(inputs.advantages)
    logp = masked(inputs.logprobs, mask)
    log_ratio = masked(inputs.logprobs - sg(inputs.old_logprobs), mask)
    seq_log_ratio = sequence_mean(sg(log_ratio), mask, inputs.sequence_ids, cfg.num_sequences)
    # Value exp(seq_log_ratio); d/d logp_t = that value (the second factor is 1 with gradient 1).
    ratio = jnp.exp(seq_log_ratio) * jnp.exp(logp - sg(logp))
    pg, clipped, dual = clipped_surrogate(ratio, adv, cfg.eps_clip, cfg.clip_high, cfg.eps_clip_c)
    extra = {"pg_dualclip_frac": dual} if cfg.eps_clip_c is not None else {}
    return _assemble(pg, ratio, -seq_log_ratio, clipped, extra, inputs, cfg)


@register_loss("cispo")
def cispo_loss(inputs: LossInputs, cfg: LossConfig) -> tuple[jax.Array, dict[str, Metric]]:
    """CISPO: REINFORCE weighted by the stop-gradient clipped ratio; clipped tokens keep a gradient."""
    sg = jax.lax.stop_gradient
    mask = inputs.loss_mask
    adv = sg(inputs.advantages)
    log_ratio = masked(inputs.logprobs - sg(inputs.old_logprobs), mask)
    ratio = jnp.exp(log_ratio)
    truncated = jnp.clip(ratio, 1.0 - cfg.eps_clip, 1.0 + cfg.clip_high)
    pg = -sg(truncated) * adv * masked(inputs.logprobs, mask)
    clipped = (sg(truncated) != sg(ratio)).astype(ratio.dtype)
    return _assemble(pg, ratio, -log_ratio, clipped, {}, inputs, cfg)


# ----------------------------------------------------------------------------- supervised fine-tuning


def sft_loss(inputs: LossInputs, cfg: LossConfig) -> tuple[jax.Array, dict[str, Metric]]:
    """slime's `--loss-type sft_loss`: the negative log-likelihood of the masked (assistant) target tokens,
    `sum_t w_t * -logprobs_t` with the host's token weights (token_mean for SFT: the mean NLL over the global
    batch's assistant tokens, as slime's SFT runs get with `--calculate-per-token-loss`). Old, reference and
    rollout log-probs, advantages and `cfg` are not used; the log-probs are at temperature 1 (the trainer's
    SFT setting). Metrics: `sft_loss` (the NLL, a sum over micro-batches like `loss`) and `sft_tokens`."""
    mask = inputs.loss_mask
    w = masked(inputs.token_weights, mask).astype(inputs.logprobs.dtype)
    nll = jnp.sum(w * -masked(inputs.logprobs, mask))
    sg = jax.lax.stop_gradient
    return nll, {"loss": Metric.sum(sg(nll)), "sft_loss": Metric.sum(sg(nll)), "weight_sum": Metric.sum(jnp.sum(w)),
                 "sft_tokens": Metric.sum(jnp.sum((mask > 0).astype(w.dtype)))}


# ----------------------------------------------------------------------------- user functions (slime's hooks)


def custom_loss(path: str) -> LossFn:
    """The loss of `--loss-type custom_loss --custom-loss-function-path path`, on this module's contract.

    The user's `fn(inputs: LossInputs, cfg: LossConfig) -> (loss, metrics)` is traced inside the compiled
    train step like a registered loss: `loss` a float scalar array (the micro-batch's `sum_t w_t * loss_t`, so
    micro-batching stays exact), `metrics` a dict of `Metric`s of float scalars, each tagged with its reduction
    over micro-batches (`Metric.sum`, `Metric.mean`, `Metric.max`, `Metric.min`; `rl/metrics.py`).
    `loss` and `weight_sum` are filled in when it leaves them out, and so are the diagnostics that do not depend
    on the loss, as every registered loss logs them: `entropy_loss` (train/entropy_loss is always logged),
    `train_rollout_logprob_abs_diff` (the drift from the behaviour policy, which `jaxrl-vlm compare-losses`
    plots for every variant) and the engine-trainer mismatch `rollout_corr/k3` and `rollout_corr/chi2`. The
    function applies `--rollout-correction` itself, if it wants it: `apply_rollout_correction(pg_per_token,
    inputs, cfg)` gives the corrected per-token loss, the tokens to keep and the correction's metrics.
    A wrong return (a metric that is a plain array included) raises HookError naming the flag, the path and the
    metric, at trace time.
    """
    hook = load_hook(path, "custom_loss_function_path")

    def loss_fn(inputs: LossInputs, cfg: LossConfig) -> tuple[jax.Array, dict[str, Metric]]:
        out = hook(inputs, cfg)
        hook.expect(isinstance(out, tuple) and len(out) == 2, "a (loss, metrics) tuple", out)
        loss, metrics = out
        hook.expect_array(loss, (), "loss")
        hook.expect(isinstance(metrics, Mapping), "metrics: a dict of str -> Metric", metrics, "metrics")
        for k, v in metrics.items():
            hook.expect(isinstance(k, str), "metric names that are str", k, "metrics")
            hook.expect(isinstance(v, Metric), "a Metric tagged with its reduction over micro-batches: "
                        "Metric.sum(x), Metric.mean(sum_t w_t*x_t, sum_t w_t), Metric.max(x) or Metric.min(x) "
                        "(from jaxrl_vlm.rl.metrics import Metric)", v, f"metrics[{k!r}]")
            hook.expect_array(v.value, (), f"metrics[{k!r}].value")
            if v.weight is not None:
                hook.expect_array(v.weight, (), f"metrics[{k!r}].weight")
        sg = jax.lax.stop_gradient
        metrics = {k: jax.tree.map(sg, v) for k, v in metrics.items()}
        metrics.setdefault("loss", Metric.sum(sg(loss)))
        w = masked(inputs.token_weights, inputs.loss_mask)
        metrics.setdefault("weight_sum", Metric.sum(jnp.sum(w)))
        if inputs.entropy is not None:
            metrics.setdefault("entropy_loss", Metric.sum(jnp.sum(w * masked(sg(inputs.entropy), inputs.loss_mask))))
        if inputs.rollout_logprobs is not None:
            diff = jnp.abs(sg(inputs.old_logprobs) - sg(inputs.rollout_logprobs))
            metrics.setdefault("train_rollout_logprob_abs_diff",
                               Metric.mean(jnp.sum(w * masked(diff, inputs.loss_mask)), jnp.sum(w)))
            # The engine-trainer mismatch, whatever the function does with --rollout-correction.
            mismatch = correction_metrics(inputs.old_logprobs, inputs.rollout_logprobs, inputs.loss_mask,
                                          inputs.sequence_ids, None, inputs.loss_mask, cfg.num_sequences)
            for k in ("rollout_corr/k3", "rollout_corr/chi2"):
                metrics.setdefault(k, mismatch[k])
        return loss, metrics

    return loss_fn


def custom_tis_function(path: str) -> Callable[[jax.Array, LossInputs, LossConfig], tuple[jax.Array, jax.Array, dict]]:
    """The TIS/RS function of `--custom-tis-function-path path` (with `--use-tis`), JAX-native.

    The user's `fn(pg_loss, inputs, cfg) -> (pg_loss, loss_mask, metrics)` gets the per-token policy-gradient
    loss [B, T] before any weighting and returns it weighted, a [B, T] mask of the tokens to keep, and per-token
    [B, T] metrics (logged as `train/tis/<name>`, token-weighted means). Called inside the compiled step; its mask
    can only remove tokens (it multiplies `inputs.loss_mask`). A wrong return raises HookError at trace time.
    """
    hook = load_hook(path, "custom_tis_function_path")

    def tis_fn(pg_loss: jax.Array, inputs: LossInputs, cfg: LossConfig) -> tuple[jax.Array, jax.Array, dict]:
        out = hook(pg_loss, inputs, cfg)
        hook.expect(isinstance(out, tuple) and len(out) == 3, "a (pg_loss, loss_mask, metrics) tuple", out)
        weighted, keep, metrics = out
        shape = tuple(pg_loss.shape)
        hook.expect_array(weighted, shape, "pg_loss")
        hook.expect(hasattr(keep, "shape") and hasattr(keep, "dtype") and tuple(keep.shape) == shape,
                    f"an array of shape {shape}", keep, "loss_mask")
        _expect_metrics(hook, metrics, shape)
        return weighted, inputs.loss_mask * keep.astype(inputs.loss_mask.dtype), dict(metrics)

    return tis_fn


def _expect_metrics(hook: Any, metrics: Any, shape: tuple[int, ...]) -> None:
    hook.expect(isinstance(metrics, Mapping), f"metrics: a dict of str -> float arrays of shape {shape}", metrics,
                "metrics")
    for k, v in metrics.items():
        hook.expect(isinstance(k, str), "metric names that are str", k, "metrics")
        hook.expect_array(v, shape, f"metrics[{k!r}]")


# ----------------------------------------------------------------------------- what the step trains (--loss-type)

register_loss_type = LOSS_TYPES.register


@register_loss_type("policy_loss")
def _policy_loss(policy_loss: str, custom_loss_path: str | None) -> LossFn:
    """The `POLICY_LOSSES` entry named by `--policy-loss`."""
    return get_loss(policy_loss)


@register_loss_type("custom_loss")
def _custom_loss(policy_loss: str, custom_loss_path: str | None) -> LossFn:
    """The user's `--custom-loss-function-path` function."""
    if custom_loss_path is None:
        raise ValueError("--loss-type custom_loss needs --custom-loss-function-path")
    return custom_loss(custom_loss_path)


@register_loss_type("sft_loss")
def _sft_loss(policy_loss: str, custom_loss_path: str | None) -> LossFn:
    """Supervised fine-tuning: the NLL of the masked tokens."""
    return sft_loss


def select_loss(loss_type: str, policy_loss: str, custom_loss_path: str | None = None) -> LossFn:
    """The loss a `--loss-type` trains: a `LOSS_TYPES` entry, given `--policy-loss` and
    `--custom-loss-function-path` (each type reads the one it needs)."""
    return LOSS_TYPES.get(loss_type)(policy_loss, custom_loss_path)
