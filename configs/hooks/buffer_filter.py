"""Example `--buffer-filter-path`: resume the stalest carried groups first.

    jaxrl-vlm train CONFIG --partial-rollout --buffer-filter-path configs/hooks/buffer_filter.py:oldest_first

slime's signature, `fn(args, rollout_id, buffer, num_samples) -> list[list[Sample]]`: `buffer` holds the groups that
--partial-rollout carried from earlier steps. The groups returned resume now; those left in `buffer` stay carried to
the next step; a group removed from `buffer` without being returned is discarded.
"""

from __future__ import annotations

from typing import Any

from rollout.sample import Sample


def oldest_version(group: list[Sample]) -> int:
    """The oldest weight version that sampled a token of the group (groups with no tokens yet sort last)."""
    versions = [int(v) for s in group for v in s.weight_versions if str(v).lstrip("-").isdigit()]
    return min(versions, default=2**62)


def oldest_first(args: Any, rollout_id: int, buffer: list[list[Sample]], num_samples: int) -> list[list[Sample]]:
    buffer.sort(key=oldest_version)  # stable: ties keep their carried order
    taken = buffer[:num_samples]
    del buffer[:num_samples]
    return taken
