"""Example `--custom-rollout-log-function-path`: reward by number of model turns, and sampling throughput.

    jaxrl-vlm train CONFIG --custom-rollout-log-function-path configs/hooks/rollout_log.py:log_rollout

slime's signature, `fn(rollout_id, args, samples, rollout_extra_metrics, rollout_time) -> bool`: called at the end
of each training rollout with its training samples. Metrics added to `rollout_extra_metrics` are logged with the
step; returning True would skip the default rollout/* metrics.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from rollout.sample import Sample


def log_rollout(rollout_id: int, args: Any, samples: list[Sample], rollout_extra_metrics: dict[str, float],
                rollout_time: float) -> bool:
    by_turns: dict[int, list[float]] = defaultdict(list)
    for s in samples:
        turns = len({t.turn for t in s.turns if t.generated_tokens > 0})
        by_turns[turns].append(float(s.reward))
    for turns, rewards in sorted(by_turns.items()):
        rollout_extra_metrics[f"rollout/reward_by_turns/{turns}"] = sum(rewards) / len(rewards)
    model_tokens = sum(sum(s.loss_mask) for s in samples)
    rollout_extra_metrics["rollout/model_tokens_per_s"] = model_tokens / max(rollout_time, 1e-9)
    return False
