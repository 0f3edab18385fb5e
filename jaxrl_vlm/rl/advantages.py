"""Sequence-level advantage estimators (host side, numpy).

Every estimator maps one scalar reward per sample to one scalar advantage per
sample; the batching module broadcasts it to the sample's tokens. Groups are the
samples that share a `group_index` value (the n samples of one prompt). They are
found by value, never by position: groups may be uneven and the samples may come
in any order (slime reshapes to `[-1, n]`, which breaks as soon as a group loses
or gains a sample).

Adding an estimator is one decorated function:

    @register_advantage("my_estimator")
    def my_estimator(rewards, group_index, *, std_normalization, eps): ...

or, without editing the package, the same function in a user file passed by
`--custom-advantage-function-path` (loaded as a `rollout.hooks.Hook` and given to
`compute_advantages` in place of the name; its output is checked and a wrong one
names the flag and the path).

Each estimator's docstring says what it computes (docs/reference/algorithms.md lists them).

The whitening std of the REINFORCE++ pair is unbiased (ddof=1), as slime's
`distributed_masked_whiten` is; a batch of one sample gets 0. Unlike slime we
whiten per sample, not per token, because this is the sequence-level form (no
token-level KL in the return); use `kl_reward_penalty` first to fold a KL in.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from jaxrl_vlm.rl.registries import ADVANTAGE_ESTIMATORS
from rollout.hooks import Hook


class AdvantageFn(Protocol):
    def __call__(
        self, rewards: np.ndarray, group_index: np.ndarray, *, std_normalization: bool, eps: float
    ) -> np.ndarray: ...


register_advantage = ADVANTAGE_ESTIMATORS.register
get_advantage_estimator = ADVANTAGE_ESTIMATORS.get
registered_advantage_estimators = ADVANTAGE_ESTIMATORS.names


def compute_advantages(
    rewards: np.ndarray,
    group_index: np.ndarray,
    estimator: str | Hook,
    *,
    std_normalization: bool = True,
    eps: float = 1e-6,
) -> np.ndarray:
    """Per-sample advantages [N] (float64) from rewards [N], grouped by `group_index` [N] values.

    `estimator`: a registry name, or the `--custom-advantage-function-path` hook (same signature), whose output
    must be N finite numbers (HookError otherwise). Raises ValueError naming the offending sample on non-finite
    rewards, and on shape or dtype mismatches.
    """
    r = np.asarray(rewards)
    g = np.asarray(group_index)
    if r.ndim != 1:
        raise ValueError(f"rewards must be 1-D [N], got shape {r.shape}")
    if g.shape != r.shape:
        raise ValueError(f"group_index shape {g.shape} != rewards shape {r.shape}")
    if r.size == 0:
        raise ValueError("compute_advantages got an empty batch (0 rewards)")
    if not np.issubdtype(g.dtype, np.integer):
        raise ValueError(f"group_index must be integers, got dtype {g.dtype}")
    if not (np.issubdtype(r.dtype, np.floating) or np.issubdtype(r.dtype, np.integer) or r.dtype == bool):
        raise ValueError(f"rewards must be numeric, got dtype {r.dtype}")
    r = r.astype(np.float64)
    bad = np.flatnonzero(~np.isfinite(r))
    if bad.size:
        raise ValueError(f"non-finite reward at sample index {int(bad[0])}: {r[bad[0]]!r}")
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    if isinstance(estimator, Hook):
        out = estimator(r.copy(), g.copy(), std_normalization=std_normalization, eps=eps)
        return np.asarray(estimator.expect_array(out, r.shape, "advantages", finite=True, sequence=True), np.float64)
    fn = get_advantage_estimator(estimator)
    out = np.asarray(fn(r, g, std_normalization=std_normalization, eps=eps), dtype=np.float64)
    if out.shape != r.shape:
        raise ValueError(f"estimator {estimator!r} returned shape {out.shape}, expected {r.shape}")
    return out


def _group_stats(rewards: np.ndarray, group_index: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-sample (group mean, unbiased group std, group size); std is 0 for groups of one."""
    _, inverse, counts = np.unique(group_index, return_inverse=True, return_counts=True)
    sums = np.bincount(inverse, weights=rewards)
    means = sums / counts
    sq = np.bincount(inverse, weights=(rewards - means[inverse]) ** 2)
    var = np.where(counts > 1, sq / np.maximum(counts - 1, 1), 0.0)
    return means[inverse], np.sqrt(var)[inverse], counts[inverse]


def _whiten(x: np.ndarray, eps: float) -> np.ndarray:
    """(x - mean) / (unbiased std + eps) over the whole batch; a batch of one gets 0."""
    if x.size < 2:
        return np.zeros_like(x)
    return (x - x.mean()) / (x.std(ddof=1) + eps)


@register_advantage("grpo")
def grpo(rewards: np.ndarray, group_index: np.ndarray, *, std_normalization: bool, eps: float) -> np.ndarray:
    """GRPO: (r - group mean) / (group std + eps), the std unbiased (ddof=1), eps=1e-6, exactly slime's
    `_post_process_rewards` (torch.std); `std_normalization=False` drops the division (slime's
    `--disable-grpo-std-normalization`). A group of one sample has no unbiased std and no contrast: advantage 0."""
    mean, std, size = _group_stats(rewards, group_index)
    adv = rewards - mean
    if std_normalization:
        adv = adv / (std + eps)
    return np.where(size > 1, adv, 0.0)


@register_advantage("dr_grpo")
def dr_grpo(rewards: np.ndarray, group_index: np.ndarray, *, std_normalization: bool, eps: float) -> np.ndarray:
    """Dr.GRPO: r - group mean, no std division whatever `std_normalization` says."""
    mean, _, size = _group_stats(rewards, group_index)
    return np.where(size > 1, rewards - mean, 0.0)


@register_advantage("rloo")
def rloo(rewards: np.ndarray, group_index: np.ndarray, *, std_normalization: bool, eps: float) -> np.ndarray:
    """RLOO: r - mean of the OTHER samples of the group (leave-one-out baseline), n/(n-1) * (r - group mean); a
    group of one sample gets 0."""
    mean, _, size = _group_stats(rewards, group_index)
    # Baseline = (group sum - own reward) / (n - 1).
    baseline = (mean * size - rewards) / np.maximum(size - 1, 1)
    return np.where(size > 1, rewards - baseline, 0.0)


@register_advantage("reinforce_plus_plus")
def reinforce_plus_plus(
    rewards: np.ndarray, group_index: np.ndarray, *, std_normalization: bool, eps: float
) -> np.ndarray:
    """REINFORCE++ (Hu et al. 2025) with one terminal reward and gamma=1: the return is the reward, whitened over
    the whole batch, (r - batch mean) / (batch std + eps); groups are ignored."""
    return _whiten(rewards, eps)


@register_advantage("reinforce_plus_plus_baseline")
def reinforce_plus_plus_baseline(
    rewards: np.ndarray, group_index: np.ndarray, *, std_normalization: bool, eps: float
) -> np.ndarray:
    """REINFORCE++-baseline: subtract the group mean, then whiten the result over the whole batch."""
    mean, _, _ = _group_stats(rewards, group_index)
    return _whiten(rewards - mean, eps)


def kl_reward_penalty(
    rewards: np.ndarray, per_token_kl: np.ndarray, mask: np.ndarray, coef: float
) -> np.ndarray:
    """KL as a reward penalty (slime's `--kl-coef`), sequence level.

    Returns rewards [N] minus `coef * sum_t(mask * kl)` per sample, with
    `per_token_kl` and `mask` [N, T] (e.g. k1 = logp_old - logp_ref from the
    trainer). With gamma=1 this is REINFORCE++'s return at the first response
    token. Apply it before `compute_advantages`.
    """
    r = np.asarray(rewards, dtype=np.float64)
    kl = np.asarray(per_token_kl, dtype=np.float64)
    m = np.asarray(mask, dtype=np.float64)
    if kl.ndim != 2 or kl.shape[0] != r.shape[0] or m.shape != kl.shape:
        raise ValueError(
            f"kl_reward_penalty: expected rewards [N], per_token_kl and mask [N, T]; got "
            f"{r.shape}, {kl.shape}, {m.shape}"
        )
    return r - coef * np.where(m > 0, kl, 0.0).sum(axis=1)
