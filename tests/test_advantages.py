"""Advantage estimators vs hand-computed values, torch.std, and permutation invariance."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from jaxrl_vlm.rl.advantages import (
    compute_advantages,
    get_advantage_estimator,
    kl_reward_penalty,
    register_advantage,
    registered_advantage_estimators,
)

ESTIMATORS = ["grpo", "dr_grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"]

# Three uneven groups whose members are interleaved by position:
#   group 7: rewards 1, 0, 0, 1      (positions 0, 2, 5, 6)
#   group 3: rewards 3, 1, 2         (positions 1, 4, 7)
#   group 9: reward 2                (position 3, a group of one)
REWARDS = np.array([1.0, 3.0, 0.0, 2.0, 1.0, 0.0, 1.0, 2.0])
GROUPS = np.array([7, 3, 7, 9, 3, 7, 7, 3])


def test_all_estimators_registered() -> None:
    assert set(ESTIMATORS) <= set(registered_advantage_estimators())


def test_grpo_hand_computed() -> None:
    adv = compute_advantages(REWARDS, GROUPS, "grpo")
    s7 = np.sqrt((4 * 0.25) / 3)  # unbiased std of [1, 0, 0, 1]
    s3 = 1.0  # unbiased std of [3, 1, 2]
    expected = np.array(
        [0.5 / (s7 + 1e-6), 1 / (s3 + 1e-6), -0.5 / (s7 + 1e-6), 0.0,
         -1 / (s3 + 1e-6), -0.5 / (s7 + 1e-6), 0.5 / (s7 + 1e-6), 0.0]
    )
    np.testing.assert_allclose(adv, expected, rtol=1e-12, atol=1e-12)


def test_grpo_matches_torch_unbiased_std_per_group() -> None:
    rng = np.random.default_rng(0)
    rewards = rng.normal(size=40)
    groups = rng.integers(0, 6, size=40)
    adv = compute_advantages(rewards, groups, "grpo")
    for g in np.unique(groups):
        idx = np.flatnonzero(groups == g)
        r = torch.tensor(rewards[idx], dtype=torch.float64)
        if len(idx) == 1:
            np.testing.assert_array_equal(adv[idx], 0.0)
            continue
        want = ((r - r.mean()) / (r.std() + 1e-6)).numpy()  # torch.std is unbiased, as slime uses
        np.testing.assert_allclose(adv[idx], want, rtol=1e-12, atol=1e-12)


def test_grpo_without_std_normalization_is_dr_grpo() -> None:
    no_std = compute_advantages(REWARDS, GROUPS, "grpo", std_normalization=False)
    dr = compute_advantages(REWARDS, GROUPS, "dr_grpo")
    expected = np.array([0.5, 1.0, -0.5, 0.0, -1.0, -0.5, 0.5, 0.0])
    np.testing.assert_allclose(no_std, expected, atol=1e-15)
    np.testing.assert_allclose(dr, expected, atol=1e-15)


def test_grpo_constant_group_gives_zero_not_nan() -> None:
    adv = compute_advantages(np.array([1.0, 1.0, 1.0, 0.0, 1.0]), np.array([0, 0, 0, 1, 1]), "grpo")
    np.testing.assert_allclose(adv[:3], 0.0)
    assert np.all(np.isfinite(adv))
    assert adv[3] < 0 < adv[4]


def test_rloo_hand_computed() -> None:
    adv = compute_advantages(REWARDS, GROUPS, "rloo")
    # group 7: 1 - (0+0+1)/3 = 2/3, 0 - (1+0+1)/3 = -2/3; group 3: 3 - 1.5, 1 - 2.5, 2 - 2
    expected = np.array([2 / 3, 1.5, -2 / 3, 0.0, -1.5, -2 / 3, 2 / 3, 0.0])
    np.testing.assert_allclose(adv, expected, rtol=1e-12, atol=1e-12)


def test_reinforce_plus_plus_whitens_over_the_batch() -> None:
    rewards = np.array([1.0, 2.0, 3.0, 4.0])
    adv = compute_advantages(rewards, np.array([0, 0, 1, 1]), "reinforce_plus_plus")
    std = np.sqrt((2.25 + 0.25 + 0.25 + 2.25) / 3)
    np.testing.assert_allclose(adv, (rewards - 2.5) / (std + 1e-6), rtol=1e-12)
    # Grouping is irrelevant to plain REINFORCE++.
    np.testing.assert_allclose(adv, compute_advantages(rewards, np.array([5, 6, 7, 8]), "reinforce_plus_plus"))


def test_reinforce_plus_plus_baseline_hand_computed() -> None:
    rewards = np.array([1.0, 0.0, 5.0, 3.0])
    adv = compute_advantages(rewards, np.array([0, 0, 1, 1]), "reinforce_plus_plus_baseline")
    centred = np.array([0.5, -0.5, 1.0, -1.0])  # minus group means 0.5 and 4
    std = np.sqrt((0.25 + 0.25 + 1 + 1) / 3)  # their mean is 0
    np.testing.assert_allclose(adv, centred / (std + 1e-6), rtol=1e-12)


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_permutation_invariance(estimator: str) -> None:
    rng = np.random.default_rng(1)
    rewards = rng.integers(0, 2, size=30).astype(float) + rng.normal(scale=0.1, size=30)
    groups = rng.integers(100, 107, size=30)
    adv = compute_advantages(rewards, groups, estimator)
    perm = rng.permutation(30)
    np.testing.assert_allclose(compute_advantages(rewards[perm], groups[perm], estimator), adv[perm], rtol=1e-12)


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo"])
def test_group_relative_estimators_are_zero_mean_per_group(estimator: str) -> None:
    rng = np.random.default_rng(2)
    rewards = rng.normal(size=25)
    groups = rng.integers(0, 4, size=25)
    adv = compute_advantages(rewards, groups, estimator)
    for g in np.unique(groups):
        assert abs(adv[groups == g].mean()) < 1e-12


def test_errors_name_the_cause() -> None:
    with pytest.raises(KeyError, match="registered: .*grpo"):
        compute_advantages(REWARDS, GROUPS, "ppo_gae")
    with pytest.raises(ValueError, match="sample index 2"):
        compute_advantages(np.array([1.0, 0.0, np.nan]), np.array([0, 0, 0]), "grpo")
    with pytest.raises(ValueError, match="group_index shape"):
        compute_advantages(REWARDS, GROUPS[:-1], "grpo")
    with pytest.raises(ValueError, match="integers"):
        compute_advantages(REWARDS, GROUPS.astype(float), "grpo")
    with pytest.raises(ValueError, match="empty"):
        compute_advantages(np.array([]), np.array([], dtype=int), "grpo")


def test_registering_a_new_estimator_is_one_function() -> None:
    @register_advantage("test_only_raw_reward")
    def raw(rewards, group_index, *, std_normalization, eps):  # noqa: ANN001, ANN202
        return rewards

    assert get_advantage_estimator("test_only_raw_reward") is raw
    np.testing.assert_array_equal(compute_advantages(REWARDS, GROUPS, "test_only_raw_reward"), REWARDS)
    with pytest.raises(ValueError, match="already registered"):
        register_advantage("grpo")(raw)


def test_kl_reward_penalty() -> None:
    kl = np.array([[0.1, 0.2, 9.0], [0.5, 0.0, 0.0]])
    mask = np.array([[1, 1, 0], [1, 0, 0]])
    out = kl_reward_penalty(np.array([1.0, 0.0]), kl, mask, coef=0.5)
    np.testing.assert_allclose(out, [1.0 - 0.5 * 0.3, -0.25])
    with pytest.raises(ValueError, match="per_token_kl"):
        kl_reward_penalty(np.array([1.0]), kl, mask, coef=0.5)
