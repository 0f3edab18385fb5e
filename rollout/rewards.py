"""Which reward an episode gets, and its scalar: slime's `--rm-type` and `--reward-key`, rollout side.

* `--rm-type` (None by default) replaces the environment's verdict with a named reward function graded on the
  model's own text. The functions live in `envs/` and are loaded by dotted path (`RM_TYPES`): rollout never
  imports envs.
* `--reward-key K`: a reward that is a mapping (from an env verdict, a module's `reward_fn`, an `--rm-type`
  function or a custom generate function) is reduced to its entry K (slime's `Sample.get_reward_value`). A
  mapping without `--reward-key`, a missing key, a value that is not a number, or a non-finite one is a
  `RewardError` naming the key and the available keys; the episode then FAILs with cause `reward_error`.

Both options are declared in the run config's algo section; the rollout run (`rollout.run.RolloutRun.rewards`)
reads them once, from the typed config or (slime's entry points) from the flat `args`. This module never imports jax.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable

from rollout.loading import load_function
from rollout.options import ArgsOptions

# --rm-type name -> dotted path of `fn(model_text, label) -> float | Mapping` (blocking; run in a thread).
RM_TYPES: dict[str, str] = {"math": "envs.rewards.math_reward"}


class RewardError(ValueError):
    """A reward that cannot become the scalar to train on; the message names the sample, source and key."""


@dataclass
class RewardSettings(ArgsOptions):
    """`rm_type` and `reward_key` as the rollout reads them (declared, with help text, in the config's algo
    section; None here means unset, which is also their default there). Whether `--custom-rm-path` scores
    episodes instead is a rollout option (`RolloutOptions.custom_rm_path`), read there."""

    rm_type: str | None = None
    reward_key: str | None = None


def rm_function(rm_type: str) -> Callable[[str, Any], Any]:
    """The reward function of `--rm-type rm_type`; a RewardError names the known types."""
    path = RM_TYPES.get(rm_type)
    if path is None:
        raise RewardError(f"--rm-type {rm_type!r} is not known (known: {sorted(RM_TYPES)})")
    return load_function(path, f"--rm-type {rm_type}")


def scalar_reward(reward: Any, reward_key: str | None, where: str) -> float:
    """The finite float to train on from `reward` (a number, or a mapping read at `reward_key`).

    `where` names the sample and the reward's source in errors. A number is taken as is even when
    `reward_key` is set: the key applies to mappings.
    """
    value = reward
    if isinstance(reward, Mapping):
        keys = sorted(map(str, reward))
        if reward_key is None:
            raise RewardError(f"{where}: the reward is a mapping with keys {keys}; set --reward-key to the entry "
                              "to train on")
        if reward_key not in reward:
            raise RewardError(f"{where}: --reward-key {reward_key!r} is not in the reward mapping (keys: {keys})")
        value = reward[reward_key]
    try:
        out = float(value)
    except (TypeError, ValueError):
        what = f"reward[{reward_key!r}]" if isinstance(reward, Mapping) else "reward"
        raise RewardError(f"{where}: {what} is {type(value).__name__} {value!r}, not a number") from None
    if not math.isfinite(out):
        # One NaN reward would turn its whole group's advantages (and the loss) into NaN.
        raise RewardError(f"{where}: non-finite reward {out!r}")
    return out


def reward_components(reward: Any) -> dict[str, Any] | None:
    """A JSON-safe copy of a mapping reward, kept in the sample's metadata for dumps (None for a number)."""
    if not isinstance(reward, Mapping):
        return None
    return {str(k): v if isinstance(v, (str, int, float, bool, type(None))) else repr(v) for k, v in reward.items()}
