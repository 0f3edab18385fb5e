"""A `--custom-rollout-log-function-path` for tests: appends every training step's samples (group, index, tokens,
weight versions) to `<output_dir>/trained.jsonl`, so a test can compare what two runs trained on."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def log_trained(rollout_id: int, args: Any, samples: list[Any], rollout_extra_metrics: dict[str, float],
                rollout_time: float) -> bool:
    record = {"rollout_id": rollout_id, "samples": [
        [s.group_index, s.index, list(s.tokens), list(s.weight_versions)] for s in samples]}
    with (Path(args.output_dir) / "trained.jsonl").open("a") as f:
        f.write(json.dumps(record) + "\n")
    return False
