"""Aggregation weights of token losses, computed on the host over the GLOBAL batch (numpy only, no jax).

`sum_t w_t * loss_t` with these weights is the configured reduction of the whole batch, so summing it over any
split into micro-batches gives exactly the unsplit loss and gradient.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from jaxrl_vlm.rl.registries import AGGREGATION_MODES


@dataclass(frozen=True)
class AggregationMode:
    """One reduction of token losses (an `AGGREGATION_MODES` entry).

    weights: `fn(seq_of_token, constant)` -> the weight of each trainable token (a float64 array in batch order, or
        one float for all), given their sequence ids `seq_of_token` [n] (non-empty) and the mode's constant.
    needs_constant: the mode divides by `constant`, which must then be > 0.
    """

    weights: Callable[[np.ndarray, float | None], np.ndarray | float]
    needs_constant: bool = False


def register_aggregation(name: str, *, needs_constant: bool = False) -> Callable[[Callable], Callable]:
    """Decorator: `fn(seq_of_token, constant) -> weights` becomes the aggregation mode `name`."""

    def deco(fn: Callable) -> Callable:
        AGGREGATION_MODES.register(name)(AggregationMode(fn, needs_constant))
        return fn

    return deco


@register_aggregation("token_mean")
def token_mean(seq_of_token: np.ndarray, constant: float | None) -> float:
    """1 / (trainable tokens in the batch)."""
    return 1.0 / len(seq_of_token)


@register_aggregation("seq_mean_token_mean")
def seq_mean_token_mean(seq_of_token: np.ndarray, constant: float | None) -> np.ndarray:
    """slime's default: 1 / (N * trainable tokens of the token's sequence)."""
    uniq, inverse, counts = np.unique(seq_of_token, return_inverse=True, return_counts=True)
    return 1.0 / (len(uniq) * counts[inverse])


@register_aggregation("seq_mean_token_sum_norm", needs_constant=True)
def seq_mean_token_sum_norm(seq_of_token: np.ndarray, constant: float | None) -> float:
    """Dr.GRPO: 1 / (N * constant)."""
    return 1.0 / (len(np.unique(seq_of_token)) * float(constant))


def check_aggregation(mode: str, constant: float | None) -> AggregationMode:
    """The registered mode `mode`, checked against `constant`."""
    if mode not in AGGREGATION_MODES:
        raise ValueError(f"unknown aggregation mode {mode!r}; expected one of {AGGREGATION_MODES.names()}")
    entry = AGGREGATION_MODES.get(mode)
    if entry.needs_constant and (constant is None or not constant > 0):
        raise ValueError(
            f"aggregation {mode!r} needs a constant > 0 (e.g. the max response length), got {constant!r}"
        )
    return entry


def aggregation_weights(
    loss_mask: np.ndarray,
    sequence_ids: np.ndarray,
    mode: str,
    constant: float | None = None,
    dtype: npt.DTypeLike = np.float32,
) -> np.ndarray:
    """Per-token weights w with `loss = sum_t w_t * loss_t`, over the GLOBAL batch.

    loss_mask: 0/1, any shape (usually [B, T]); sequence_ids: same shape, int,
    globally unique per sequence, -1 on padding. Weights are 0 where the mask is 0.
    N counts only sequences with at least one masked token (a fully masked sample
    contributes nothing and never divides by zero; slime's sample-mean still
    counts it in the denominator).
    `mode` is an `AGGREGATION_MODES` name (token_mean, seq_mean_token_mean, seq_mean_token_sum_norm, or one
    registered with `register_aggregation`).
    Computed in float64, returned as `dtype`.
    """
    entry = check_aggregation(mode, constant)
    mask = np.asarray(loss_mask)
    ids = np.asarray(sequence_ids)
    if mask.shape != ids.shape:
        raise ValueError(f"loss_mask shape {mask.shape} != sequence_ids shape {ids.shape}")
    if not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"sequence_ids must be integers, got dtype {ids.dtype}")
    bad = ~np.isin(mask, (0, 1))
    if bad.any():
        pos = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ValueError(f"loss_mask must be 0/1; found {mask[pos]!r} at position {pos}")
    masked = mask.astype(bool)
    orphan = masked & (ids < 0)
    if orphan.any():
        pos = tuple(int(i) for i in np.argwhere(orphan)[0])
        raise ValueError(f"masked token at position {pos} has sequence id {int(ids[pos])} (padding)")

    weights = np.zeros(mask.shape, dtype=np.float64)
    if not masked.any():
        return weights.astype(dtype)
    weights[masked] = entry.weights(ids[masked], constant)
    return weights.astype(dtype)
