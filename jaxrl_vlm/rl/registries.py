"""The RL registries, in a module without jax: the config offers and validates their names, and only asking
for the names imports the module that fills each one (`rl/losses.py` brings jax; `rl/advantages.py` numpy)."""

from __future__ import annotations

from typing import Any

from jaxrl_vlm.registry import Registry

POLICY_LOSSES: Registry[Any] = Registry("loss", populated_by="jaxrl_vlm.rl.losses")
ADVANTAGE_ESTIMATORS: Registry[Any] = Registry("advantage estimator", populated_by="jaxrl_vlm.rl.advantages")
