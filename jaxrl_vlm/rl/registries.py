"""The RL registries, in a module without jax: the config offers and validates their names, and only asking
for the names imports the module that fills each one (`rl/losses.py` brings jax; `rl/advantages.py` and
`rl/aggregation.py` numpy).

- `LOSS_TYPES` (`--loss-type`): what the train step optimises; `policy_loss` is the `POLICY_LOSSES` entry named by
  `--policy-loss`, `custom_loss` the user's `--custom-loss-function-path`, `sft_loss` the NLL of SFT.
- `POLICY_LOSSES` (`--policy-loss`), `KL_ESTIMATORS` (`--kl-loss-type`), `AGGREGATION_MODES` (`--loss-aggregation`),
  `ADVANTAGE_ESTIMATORS` (`--advantage-estimator`).
- `ROLLOUT_CORRECTIONS` (`--rollout-correction`): importance weights and masks between the engine's and the
  trainer's log-probs (`rl/corrections.py`), applied to the per-token policy loss of every `POLICY_LOSSES` entry.
"""

from __future__ import annotations

from typing import Any

from jaxrl_vlm.registry import Registry

LOSS_TYPES: Registry[Any] = Registry("loss type", populated_by="jaxrl_vlm.rl.losses")
POLICY_LOSSES: Registry[Any] = Registry("loss", populated_by="jaxrl_vlm.rl.losses")
KL_ESTIMATORS: Registry[Any] = Registry("KL estimator", populated_by="jaxrl_vlm.rl.losses")
AGGREGATION_MODES: Registry[Any] = Registry("aggregation mode", populated_by="jaxrl_vlm.rl.aggregation")
ADVANTAGE_ESTIMATORS: Registry[Any] = Registry("advantage estimator", populated_by="jaxrl_vlm.rl.advantages")
ROLLOUT_CORRECTIONS: Registry[Any] = Registry("rollout correction", populated_by="jaxrl_vlm.rl.corrections")
