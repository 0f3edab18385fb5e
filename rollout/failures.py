"""FAILED episodes of a rollout step, summarised: their share, their top causes, and the all-FAILED stop rule.

A FAILED episode never raises out of the rollout (DESIGN.md §4): it is dropped from its group and listed in
`RolloutResult.failed`. That keeps one bad episode from killing a run, but a run whose every episode fails (the
engine is gone, the env module is broken) would otherwise go on "training" on nothing. So:

* a step whose FAILED share exceeds `--failed-share-warning` logs one warning with the top causes (the driver);
* `--max-all-failed-steps` consecutive steps in which every finished episode FAILED stop the run with
  `AllFailedStepsError`, naming the causes and their counts (the main job, through `all_failed_streak`).

Pure functions over the driver's result; this module never imports jax.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Protocol

from rollout.sample import Sample

TOP_CAUSES = 3
_EXAMPLE_CHARS = 160


class StepResult(Protocol):
    """What a report reads of a step's result (`rollout.driver.RolloutResult`, without importing the driver)."""

    failed: list[Sample]
    episodes: int

    @property
    def samples(self) -> list[Sample]: ...


class AllFailedStepsError(RuntimeError):
    """Every finished episode FAILED in too many consecutive steps; the message names the top causes."""


@dataclass(frozen=True)
class Cause:
    """One termination cause of FAILED episodes: its metric name, how many, and one error message."""

    name: str
    count: int
    example: str


@dataclass(frozen=True)
class FailureReport:
    """The FAILED episodes of one step among the `episodes` that finished in it."""

    failed: int
    episodes: int
    causes: tuple[Cause, ...]  # most frequent first

    @property
    def share(self) -> float:
        return self.failed / self.episodes if self.episodes else 0.0

    @property
    def all_failed(self) -> bool:
        """Every finished episode FAILED (a step where nothing finished is not counted as one)."""
        return self.failed > 0 and self.failed >= self.episodes

    def describe(self, top: int = TOP_CAUSES) -> str:
        """`engine_error x 12 (e.g. 'engine: ...'), env_error x 3 (...)` for the `top` most frequent causes."""
        parts = [f"{c.name} x {c.count} (e.g. {c.example!r})" if c.example else f"{c.name} x {c.count}"
                 for c in self.causes[:top]]
        rest = len(self.causes) - top
        if rest > 0:
            parts.append(f"{rest} more cause(s)")
        return ", ".join(parts) or "none"


def _cause_name(sample: Sample) -> str:
    return "unknown" if sample.termination is None else sample.termination.metric_name


def _example(sample: Sample) -> str:
    error = str(sample.metadata.get("error") or "")
    return error if len(error) <= _EXAMPLE_CHARS else error[:_EXAMPLE_CHARS] + "..."


def failure_report(result: StepResult) -> FailureReport:
    """Summarise the FAILED episodes of `result`.

    The population is `result.episodes` (every episode of a group that finished in the step, as counted by the
    driver); a result from another rollout function that does not count it falls back to kept + failed samples.
    """
    failed = list(result.failed)
    episodes = max(result.episodes, len(result.samples) + len(failed))
    counts = Counter(_cause_name(s) for s in failed)
    examples: dict[str, str] = {}
    for s in failed:
        examples.setdefault(_cause_name(s), _example(s))
    causes = tuple(Cause(name, n, examples[name]) for name, n in counts.most_common())
    return FailureReport(failed=len(failed), episodes=episodes, causes=causes)


def all_failed_streak(streak: int, report: FailureReport, *, limit: int, step: int) -> int:
    """The number of consecutive all-FAILED steps including this one; raises AllFailedStepsError at `limit`.

    `streak` is the value returned for the previous step (0 at the start). `limit` 0 never stops.
    """
    streak = streak + 1 if report.all_failed else 0
    if limit > 0 and streak >= limit:
        raise AllFailedStepsError(
            f"step {step}: every episode FAILED in {streak} consecutive steps (--max-all-failed-steps {limit}); "
            f"this step: {report.failed} of {report.episodes} FAILED; top causes: {report.describe()}"
        )
    return streak
