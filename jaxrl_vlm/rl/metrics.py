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
