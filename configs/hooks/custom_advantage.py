"""Example `--custom-advantage-function-path` (ours): rank-based group advantages.

    jaxrl-vlm train CONFIG --custom-advantage-function-path configs/hooks/custom_advantage.py:group_rank

The registered estimators' signature (jaxrl_vlm/rl/advantages.py): `fn(rewards [N], group_index [N], *,
std_normalization, eps) -> advantages [N]`, numpy on the host, one advantage per sample; groups are the samples
sharing a group_index value (not positions).
"""

from __future__ import annotations

import numpy as np


def group_rank(rewards: np.ndarray, group_index: np.ndarray, *, std_normalization: bool, eps: float) -> np.ndarray:
    """Each sample's reward rank within its group, centred and scaled to [-1, 1] (ties share their mean rank).

    Invariant to any increasing transform of the rewards, so one outlier reward cannot dominate a group the way it
    does GRPO's mean and std. A group of one gets 0.
    """
    out = np.zeros_like(rewards, dtype=np.float64)
    for g in np.unique(group_index):
        idx = np.flatnonzero(group_index == g)
        if idx.size < 2:
            continue
        r = rewards[idx]
        # Mean rank of ties: the count of smaller rewards plus half the count of equal others.
        ranks = np.array([(r < x).sum() + 0.5 * ((r == x).sum() - 1) for x in r], np.float64)
        out[idx] = 2.0 * ranks / (idx.size - 1) - 1.0
    return out
