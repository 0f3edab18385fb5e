"""Example `--custom-rm-path`: the math reward of the model's own text, with a penalty for truncated episodes.

    jaxrl-vlm train CONFIG --custom-rm-path configs/hooks/custom_rm.py:rm
    jaxrl-vlm train CONFIG --custom-rm-path configs/hooks/custom_rm.py:group_rm --group-rm

`rm` is slime's per-sample signature (`async def rm(args, sample) -> float`); `group_rm` its `--group-rm` one
(`async def rm(args, samples) -> list[float]`). The driver calls them after each episode (or group) finished,
instead of the env's verdict. Grading can block, so it runs in a thread.
"""

from __future__ import annotations

import asyncio
from typing import Any

from envs.rewards import last_boxed_answer, math_reward
from rollout.sample import Sample, Status

TRUNCATION_PENALTY = 0.2


def model_text(sample: Sample) -> str:
    """The model's own turns (the default episode keeps them in metadata; a custom one may only set `response`)."""
    turns = sample.metadata.get("model_text")
    return "\n".join(turns) if turns else sample.response


async def rm(args: Any, sample: Sample) -> float:
    """1 for a correct final \\boxed{} answer, 0 otherwise, minus TRUNCATION_PENALTY when the budget cut it short."""
    reward = await asyncio.to_thread(math_reward, model_text(sample), sample.label)
    if sample.status is Status.TRUNCATED:
        reward -= TRUNCATION_PENALTY
    return reward


async def group_rm(args: Any, samples: list[Sample]) -> list[float]:
    """`rm` for each sample, plus 0.5 for the shortest correct answer of the group (fewest model tokens)."""
    rewards = list(await asyncio.gather(*(rm(args, s) for s in samples)))
    correct = [i for i, s in enumerate(samples) if rewards[i] >= 1.0 and last_boxed_answer(model_text(s))]
    if correct:
        shortest = min(correct, key=lambda i: sum(samples[i].loss_mask))
        rewards[shortest] += 0.5
    return rewards
