"""Aggregation weights of token losses, computed on the host over the GLOBAL batch (numpy only, no jax).

`sum_t w_t * loss_t` with these weights is the configured reduction of the whole batch, so summing it over any
split into micro-batches gives exactly the unsplit loss and gradient.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

AGGREGATION_MODES = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")


def _check_aggregation(mode: str, constant: float | None) -> None:
    if mode not in AGGREGATION_MODES:
        raise ValueError(f"unknown aggregation mode {mode!r}; expected one of {AGGREGATION_MODES}")
    if mode == "seq_mean_token_sum_norm" and (constant is None or not constant > 0):
        raise ValueError(
            f"aggregation 'seq_mean_token_sum_norm' (Dr.GRPO) needs a constant > 0 "
            f"(e.g. the max response length), got {constant!r}"
        )


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
    - token_mean: 1 / (masked tokens in the batch).
    - seq_mean_token_mean (slime default): 1 / (N * masked tokens of the sequence).
    - seq_mean_token_sum_norm (Dr.GRPO): 1 / (N * constant).
    Computed in float64, returned as `dtype`.
    """
    _check_aggregation(mode, constant)
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
    if mode == "token_mean":
        weights[masked] = 1.0 / masked.sum()
        return weights.astype(dtype)
    seq_of_token = ids[masked]
    uniq, inverse, counts = np.unique(seq_of_token, return_inverse=True, return_counts=True)
    n_seq = len(uniq)
    if mode == "seq_mean_token_mean":
        weights[masked] = 1.0 / (n_seq * counts[inverse])
    else:
        weights[masked] = 1.0 / (n_seq * float(constant))
    return weights.astype(dtype)
