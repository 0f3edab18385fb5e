"""Loss metrics that carry their own reduction over micro-batches.

A loss returns `{name: Metric}`; each `Metric` says how it combines when the train step adds up the micro-batches
of one optimizer step, so no table elsewhere can forget a name (Marin's `Metric.from_value(x, ReductionType.MAX)`):

- `Metric.sum(x)`: exact loss components (`loss`, `pg_loss`, ...); the micro-batch values are added.
- `Metric.mean(total, weight)`: a weighted mean; `total` is the micro-batch's partial sum `sum_t w_t * x_t` and
  `weight` its `sum_t w_t`. Both are added over micro-batches and divided once at the end (0 where the weight is
  0). With the host's aggregation weights (`inputs.token_weights`) this is the token-weighted mean of the global
  batch; with `weight` a count it is a plain mean.
- `Metric.max(x)` / `Metric.min(x)`: the largest / smallest micro-batch value.

A `Metric` is a pytree (the reduction is static), so it crosses `jit`, `lax.scan` and `eval_shape` as it is.
Anything else where a metric is expected is an error naming the metric.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from rollout.metric_docs import MetricDoc


class Reduction(enum.Enum):
    """How a metric combines over micro-batches."""

    SUM = "sum"
    MEAN = "mean"
    MAX = "max"
    MIN = "min"


@struct.dataclass
class Metric:
    """A scalar metric of one micro-batch and its reduction; `weight` is the denominator of a MEAN (else None)."""

    value: jax.Array
    reduction: Reduction = struct.field(pytree_node=False)
    weight: jax.Array | None = None

    @classmethod
    def sum(cls, value: jax.Array) -> "Metric":
        """Added over micro-batches."""
        return cls(value, Reduction.SUM)

    @classmethod
    def mean(cls, total: jax.Array, weight: jax.Array) -> "Metric":
        """Weighted mean: `total` = sum_t w_t * x_t and `weight` = sum_t w_t of this micro-batch."""
        return cls(total, Reduction.MEAN, weight)

    @classmethod
    def max(cls, value: jax.Array) -> "Metric":
        """The largest micro-batch value."""
        return cls(value, Reduction.MAX)

    @classmethod
    def min(cls, value: jax.Array) -> "Metric":
        """The smallest micro-batch value."""
        return cls(value, Reduction.MIN)

    def combine(self, other: "Metric") -> "Metric":
        """This metric and the same metric of another micro-batch, as one (jittable)."""
        r = self.reduction
        if r is Reduction.SUM:
            return Metric(self.value + other.value, r)
        if r is Reduction.MEAN:
            return Metric(self.value + other.value, r, self.weight + other.weight)
        if r is Reduction.MAX:
            return Metric(jnp.maximum(self.value, other.value), r)
        return Metric(jnp.minimum(self.value, other.value), r)

    def result(self) -> jax.Array:
        """The reduced value: a MEAN divided by its weight (0 where there was none), the others as they are."""
        if self.reduction is not Reduction.MEAN:
            return self.value
        safe = jnp.where(self.weight > 0, self.weight, 1.0)
        return self.value / safe


def _identity(value: Any, reduction: Reduction) -> jax.Array:
    """The element that leaves `combine` unchanged, shaped and typed like `value` (an array or ShapeDtypeStruct)."""
    dtype = jnp.dtype(value.dtype)
    if reduction in (Reduction.SUM, Reduction.MEAN):
        return jnp.zeros(value.shape, dtype)
    if jnp.issubdtype(dtype, jnp.inexact):
        low, high = -jnp.inf, jnp.inf
    else:
        low, high = jnp.iinfo(dtype).min, jnp.iinfo(dtype).max
    return jnp.full(value.shape, low if reduction is Reduction.MAX else high, dtype)


def check_metrics(metrics: Any, where: str = "loss metrics") -> Mapping[str, Metric]:
    """`metrics` when it is a dict of str -> Metric; else a TypeError naming the metric and how to tag it."""
    if not isinstance(metrics, Mapping):
        raise TypeError(f"{where}: expected a dict of str -> Metric, got {type(metrics).__name__}")
    for name, m in metrics.items():
        if not isinstance(m, Metric):
            raise TypeError(
                f"{where}: metric {name!r} is a {type(m).__name__}, not a Metric; tag it with its reduction over "
                f"micro-batches: Metric.sum(x), Metric.mean(sum_t w_t*x_t, sum_t w_t), Metric.max(x) or "
                f"Metric.min(x) (jaxrl_vlm.rl.metrics)"
            )
    return metrics


def init_metrics(shapes: Mapping[str, Metric]) -> dict[str, Metric]:
    """Identity metrics (the starting carry of a micro-batch scan) shaped like `shapes` (e.g. from eval_shape)."""
    out = {}
    for name, m in check_metrics(shapes).items():
        weight = None if m.weight is None else jnp.zeros(m.weight.shape, m.weight.dtype)
        out[name] = Metric(_identity(m.value, m.reduction), m.reduction, weight)
    return out


def accumulate_metrics(acc: Mapping[str, Metric] | None, new: Mapping[str, Metric]) -> dict[str, Metric]:
    """Combine the metrics of one more micro-batch (jittable), each by its own reduction."""
    check_metrics(new)
    if acc is None:
        return dict(new)
    if set(acc) != set(new):
        raise ValueError(f"metric keys differ between micro-batches: {sorted(acc)} vs {sorted(new)}")
    for name, m in new.items():
        if acc[name].reduction is not m.reduction:
            raise ValueError(f"metric {name!r} changes its reduction between micro-batches: "
                             f"{acc[name].reduction.value} vs {m.reduction.value}")
    return {name: acc[name].combine(m) for name, m in new.items()}


def finalize_metrics(acc: Mapping[str, Metric]) -> dict[str, jax.Array]:
    """The reduced value of every metric (means divided by their accumulated weight)."""
    return {name: m.result() for name, m in check_metrics(acc).items()}


# The train step's metrics as logged (`train/` + a loss's metric name; `moe/` as they are). The reduction is over the
# micro-batches of one optimizer step, and starts with the `Reduction` the code tags the metric with (a test traces
# every registered loss and checks it); the trainer then averages each over the rollout's optimizer steps.
TRAIN_METRICS: tuple[MetricDoc, ...] = (
    MetricDoc("train/loss", "sum over micro-batches", "The loss: policy gradient + KL and entropy terms."),
    MetricDoc("train/pg_loss", "sum over micro-batches", "The policy-gradient term."),
    MetricDoc("train/kl_loss", "sum over micro-batches",
              "KL(current || reference) by --kl-loss-type, when reference log-probs exist (--use-kl-loss)."),
    MetricDoc("train/entropy_loss", "sum over micro-batches", "Token-weighted entropy of the current policy."),
    MetricDoc("train/weight_sum", "sum over micro-batches", "Sum of the trainable tokens' aggregation weights."),
    MetricDoc("train/pg_clipfrac", "mean (token-weighted)", "Share of tokens whose ratio was clipped."),
    MetricDoc("train/pg_dualclip_frac", "mean (token-weighted)", "Share of tokens capped by the dual clip "
              "(--eps-clip-c)."),
    MetricDoc("train/ppo_kl", "mean (token-weighted)", "Old minus current log-prob (slime's ppo_kl)."),
    MetricDoc("train/approx_kl", "mean (token-weighted)", "k3 estimate of KL(old || current)."),
    MetricDoc("train/ratio_mean", "mean (token-weighted)", "Importance ratio current / old."),
    MetricDoc("train/ratio_max", "max over micro-batches", "Largest importance ratio of a trainable token."),
    MetricDoc("train/tis", "mean (token-weighted)", "exp(old - rollout log-prob), before clipping."),
    MetricDoc("train/tis_clipfrac", "mean (token-weighted)", "Share of tokens whose TIS weight was clipped."),
    MetricDoc("train/train_rollout_logprob_abs_diff", "mean (token-weighted)",
              "|trainer - engine| log-prob of the sampled tokens."),
    MetricDoc("train/rollout_corr/<name>", "mean (count-weighted)",
              "--rollout-correction diagnostics (k3, chi2, masked_token_frac, masked_seq_frac, weight_mean)."),
    MetricDoc("train/tis/<name>", "mean (token-weighted)", "A --custom-tis-function-path hook's own metrics."),
    MetricDoc("train/opd/reverse_kl", "mean (count-weighted)", "--use-opd: student - teacher log-prob of the "
              "loss-mask tokens (a per-token estimate of KL(student || teacher); rl/opd.py)."),
    MetricDoc("train/opd/teacher_logprob", "mean (count-weighted)", "--use-opd: the teacher's log-prob of the "
              "student's loss-mask tokens."),
    MetricDoc("train/opd/student_logprob", "mean (count-weighted)", "--use-opd: the student's behaviour log-prob "
              "(old_logprobs) of the same tokens."),
    MetricDoc("train/sft_loss", "sum over micro-batches", "--loss-type sft_loss: NLL per assistant token."),
    MetricDoc("train/sft_tokens", "sum over micro-batches", "--loss-type sft_loss: assistant tokens trained."),
    MetricDoc("train/loss_total", "sum over micro-batches", "The optimised loss, MoE router losses included."),
    MetricDoc("train/grad_norm", "of the accumulated gradient", "Global gradient norm, before clipping."),
    MetricDoc("train/skipped_nonfinite", "of the step", "1 when a non-finite loss or gradient skipped the update."),
    MetricDoc("moe/aux_loss", "sum over micro-batches", "MoE load-balancing loss (before its coefficient)."),
    MetricDoc("moe/z_loss", "sum over micro-batches", "MoE router z-loss (before its coefficient)."),
    MetricDoc("moe/layer<i>/max_over_mean", "of the step's tokens", "Sparse layer i: busiest expert's tokens / mean "
              "(1: balanced)."),
    MetricDoc("moe/layer<i>/max_tokens", "of the step's tokens", "Sparse layer i: tokens of the busiest expert."),
    MetricDoc("moe/max_over_mean", "max over sparse layers", "The worst layer's max_over_mean."),
    MetricDoc("moe/mean_max_over_mean", "mean over sparse layers", "max_over_mean averaged over the layers."),
    MetricDoc("moe/tokens_per_expert_mean", "mean over layers and experts", "Tokens per expert."),
    MetricDoc("moe/dropped_tokens", "sum over sparse layers", "Token copies over an expert's capacity "
              "(expert parallelism with --moe-capacity-factor)."),
)
