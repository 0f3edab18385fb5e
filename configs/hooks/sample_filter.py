"""Example `--rollout-sample-filter-path`: leave truncated episodes out of the loss (DAPO's overlong filtering).

    jaxrl-vlm train CONFIG --rollout-sample-filter-path configs/hooks/sample_filter.py:drop_truncated

slime's signature, `fn(args, groups) -> None`: called at the end of the step on the kept groups; it marks samples
with `sample.remove_sample = True`. A removed sample trains no token but still counts in its group's advantage
statistics, so the rest of its group keeps the same advantages.
"""

from __future__ import annotations

from typing import Any

from rollout.sample import Sample, Status


def drop_truncated(args: Any, groups: list[list[Sample]]) -> None:
    for group in groups:
        for sample in group:
            if sample.status is Status.TRUNCATED:
                sample.remove_sample = True
