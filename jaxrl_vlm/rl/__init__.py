"""RL math of the trainer: advantage estimators and aggregation (host, numpy) and the loss registry (jnp).

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
    **dict.fromkeys(["AGGREGATION_MODES", "aggregation_weights"], "aggregation"),
    **dict.fromkeys(
        ["KL_TYPES", "METRIC_KINDS", "POLICY_LOSSES", "LossConfig", "LossInputs", "accumulate_metrics", "check_loss_inputs",
         "finalize_metrics", "get_loss", "kl_estimate", "register_loss", "registered_losses"], "losses"),
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'jaxrl_vlm.rl' has no attribute {name!r}")
    return getattr(importlib.import_module(f"jaxrl_vlm.rl.{_EXPORTS[name]}"), name)
