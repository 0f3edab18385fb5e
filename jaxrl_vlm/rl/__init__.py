"""RL math of the trainer: advantage estimators and aggregation (host, numpy), the loss registries and rollout
corrections (jnp) and the metrics that carry their reduction.

Names are resolved lazily (PEP 562): importing a numpy-only submodule (`advantages`, `aggregation`) never
imports jax.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    **dict.fromkeys(
        ["ADVANTAGE_ESTIMATORS", "compute_advantages", "get_advantage_estimator", "kl_reward_penalty", "register_advantage",
         "registered_advantage_estimators"], "advantages"),
    **dict.fromkeys(["AGGREGATION_MODES", "AggregationMode", "aggregation_weights", "register_aggregation"],
                    "aggregation"),
    **dict.fromkeys(
        ["KL_ESTIMATORS", "KL_TYPES", "LOSS_TYPES", "POLICY_LOSSES", "LossConfig", "LossInputs", "check_loss_inputs",
         "get_loss", "kl_estimate", "register_kl_estimator", "register_loss", "register_loss_type", "registered_losses",
         "select_loss", "apply_rollout_correction"], "losses"),
    **dict.fromkeys(["Metric", "Reduction", "accumulate_metrics", "finalize_metrics", "init_metrics"], "metrics"),
    **dict.fromkeys(["ROLLOUT_CORRECTIONS", "Correction", "CorrectionResult", "register_correction",
                     "rollout_correction"], "corrections"),
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'jaxrl_vlm.rl' has no attribute {name!r}")
    return getattr(importlib.import_module(f"jaxrl_vlm.rl.{_EXPORTS[name]}"), name)
