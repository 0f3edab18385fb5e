"""RL math of the trainer: advantage estimators (host, numpy) and the policy-loss registry (jnp)."""

from jaxrl_vlm.rl.advantages import (
    compute_advantages,
    get_advantage_estimator,
    kl_reward_penalty,
    register_advantage,
    registered_advantage_estimators,
)
from jaxrl_vlm.rl.losses import (
    AGGREGATION_MODES,
    KL_TYPES,
    METRIC_KINDS,
    LossConfig,
    LossInputs,
    accumulate_metrics,
    aggregation_weights,
    check_loss_inputs,
    finalize_metrics,
    get_loss,
    kl_estimate,
    register_loss,
    registered_losses,
)

__all__ = [
    "AGGREGATION_MODES",
    "KL_TYPES",
    "METRIC_KINDS",
    "LossConfig",
    "LossInputs",
    "accumulate_metrics",
    "aggregation_weights",
    "check_loss_inputs",
    "compute_advantages",
    "finalize_metrics",
    "get_advantage_estimator",
    "get_loss",
    "kl_estimate",
    "kl_reward_penalty",
    "register_advantage",
    "register_loss",
    "registered_advantage_estimators",
    "registered_losses",
]
