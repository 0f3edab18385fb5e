"""The entry type of the metric catalogues: a metric's name as a run writes it, its reduction and its meaning.

Each family's catalogue lives beside the code that writes its metrics (`rollout/metrics.py`, `jaxrl_vlm/rl/metrics.py`);
`jaxrl_vlm/metric_catalog.py` composes them and `docs/reference/metrics.md` renders them. This module imports nothing
of the project (the trainer's rl/ package uses it and may not reach the rollout client).
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass


@dataclass(frozen=True)
class MetricDoc:
    """One documented metric of a run's `metrics.jsonl`: its name, where `<...>` stands for a variable part (a
    cause, a count, an eval set's name; it may span `/`), how its value was reduced, and what it means."""

    name: str
    reduction: str
    meaning: str

    def matches(self, key: str) -> bool:
        """Whether `key`, a name as a run writes it, is this metric."""
        return _name_pattern(self.name).fullmatch(key) is not None

    def under(self, prefix: str) -> MetricDoc:
        """This metric as written under `prefix` (`rollout/`, `eval/<set>/`)."""
        return MetricDoc(prefix + self.name, self.reduction, self.meaning)


@functools.lru_cache(maxsize=None)
def _name_pattern(name: str) -> re.Pattern[str]:
    return re.compile(".+".join(re.escape(part) for part in re.split(r"<[^>]*>", name)))
