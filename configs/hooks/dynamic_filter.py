"""Example `--dynamic-sampling-filter-path`: drop groups that teach nothing (DAPO's dynamic sampling).

    jaxrl-vlm train CONFIG --dynamic-sampling-filter-path configs/hooks/dynamic_filter.py:informative_group

slime's signature, `fn(args, samples) -> bool | DynamicFilterOutput`: called on each finished group (its trainable
samples); a dropped group is counted as rollout/dynamic_filter/drop_<reason> and the driver over-samples prompts to
refill the step.
"""

from __future__ import annotations

import statistics
from typing import Any

from rollout.hooks import DynamicFilterOutput
from rollout.sample import Sample, Status

# A group in which more than this share of episodes ran out of budget says more about the budget than the policy.
MAX_TRUNCATED_SHARE = 0.5


def informative_group(args: Any, samples: list[Sample]) -> DynamicFilterOutput:
    rewards = [float(s.reward) for s in samples]
    if len(rewards) < 2 or statistics.pstdev(rewards) < 1e-6:
        return DynamicFilterOutput(keep=False, reason=f"zero_std_{round(rewards[0], 1)}")
    truncated = sum(s.status is Status.TRUNCATED for s in samples) / len(samples)
    if truncated > MAX_TRUNCATED_SHARE:
        return DynamicFilterOutput(keep=False, reason="mostly_truncated")
    return DynamicFilterOutput(keep=True)
