"""Example `--custom-reward-post-process-path`: DAPO's soft overlong punishment.

    jaxrl-vlm train CONFIG --custom-reward-post-process-path configs/hooks/reward_post_process.py:overlong_penalty

slime's signature, `fn(args, samples) -> (raw_rewards, rewards)`: the trainer calls it once per rollout with every
training sample, before the advantages. `rewards` are what the advantage estimator sees (GRPO's group normalisation
still follows, in the estimator); `raw_rewards` are logged as rollout/raw_reward.
"""

from __future__ import annotations

from typing import Any

from rollout.sample import Sample

# The last OVERLONG_SHARE of the response budget is the soft zone: the penalty grows linearly to MAX_PENALTY there.
OVERLONG_SHARE = 0.25
MAX_PENALTY = 1.0


def overlong_penalty(args: Any, samples: list[Sample]) -> tuple[list[float], list[float]]:
    budget = args.rollout_max_response_len
    soft = OVERLONG_SHARE * budget
    raw = [float(s.reward) for s in samples]
    rewards = []
    for sample, reward in zip(samples, raw):
        excess = sample.response_length - (budget - soft)
        rewards.append(reward - MAX_PENALTY * min(max(excess / soft, 0.0), 1.0))
    return raw, rewards
