"""Example `--rollout-all-samples-process-path`: one JSON line per finished group, kept or not.

    jaxrl-vlm train CONFIG --rollout-all-samples-process-path configs/hooks/all_samples_process.py:group_summaries

slime's signature, `fn(args, all_groups, data_source) -> None`: called at the end of the step with every group that
finished in it, including those a filter dropped and FAILED episodes, so the file shows what the filters removed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rollout.sample import Sample


def group_summaries(args: Any, all_groups: list[list[Sample]], data_source: Any) -> None:
    path = Path(args.output_dir) / "all_groups.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        for group in all_groups:
            f.write(json.dumps({
                "rollout_id": group[0].metadata.get("rollout_id"),
                "group_index": group[0].group_index,
                "rewards": [s.reward for s in group],
                "statuses": [s.status.value for s in group],
                "model_tokens": [sum(s.loss_mask) for s in group],
            }) + "\n")
