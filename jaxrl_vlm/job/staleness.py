"""Which weights made each sample, checked against the weights the engine is known to hold.

The synchronous loop trains every step on rollouts of the weights it pushed last (and confirmed, see
`WeightSyncer.confirm`). A sample whose turns report another `weight_version` means an engine that did not
take the update, a second trainer pushing to the same engine, or a router serving a stale worker: training on it
would be silently off-policy, so the run stops with the samples and versions named.

Asynchronous training (`--max-staleness K`, below) trains at trainer version v on samples whose tokens came from
versions v - K .. v: `too_stale` is the admission verdict the rollout stream applies to each group, and
`check_bounded_staleness` checks (and accounts, as a staleness histogram and off-policy token counts) every batch
before it trains.

These are the checks only; the sample sources apply them (`job/sources.py`: `LiveRollout` for the synchronous
check, `StreamingSource` for the admission verdict, the per-batch check and the version the next batch trains at).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


class OffPolicySampleError(RuntimeError):
    """Samples of other weights than the engine's confirmed version reached training in synchronous mode."""


@dataclass(frozen=True)
class VersionReport:
    """What `check_sample_versions` found: samples checked, and those whose engine reported no version."""

    checked: int
    unreported: int


def check_sample_versions(samples: Sequence[Any], expected: str, *, step: int) -> VersionReport:
    """Every sample's `weight_versions` (one entry per version change across its turns) must be `[expected]`.

    A sample without any reported version (an engine too old to report it) is counted, not failed: it cannot be
    checked. Raises OffPolicySampleError naming up to three offending samples and how many there were.
    """
    wrong: list[str] = []
    unreported = 0
    for sample in samples:
        versions = list(getattr(sample, "weight_versions", None) or [])
        if not versions:
            unreported += 1
        elif any(v != expected for v in versions):
            wrong.append(f"{getattr(sample, 'name', '?')} made by weight version(s) {versions}")
    if wrong:
        shown = "; ".join(wrong[:3]) + (f"; and {len(wrong) - 3} more" if len(wrong) > 3 else "")
        raise OffPolicySampleError(
            f"step {step}: {len(wrong)} of {len(samples)} samples were not made by the engine's weight version "
            f"{expected!r} (synchronous mode trains on-policy only): {shown}")
    return VersionReport(checked=len(samples) - unreported, unreported=unreported)


def unreported_versions(samples: Sequence[Any]) -> VersionReport:
    """The count `check_sample_versions` reports, without checking against an engine (a replay has none)."""
    unreported = sum(1 for s in samples if not list(getattr(s, "weight_versions", None) or []))
    return VersionReport(checked=len(samples) - unreported, unreported=unreported)


# ----------------------------------------------------------------------------- asynchronous mode (--max-staleness)
# With K >= 1 the trainer at version v trains samples whose tokens came from versions v - K .. v (rollout keeps
# generating while it trains). The job labels every export with its integer step count, so versions are ints.


def sample_versions(sample: Any) -> list[int]:
    """The weight versions of a sample's tokens as this run's integers; OffPolicySampleError for any other label
    (an engine serving weights this run did not export)."""
    out = []
    for v in getattr(sample, "weight_versions", None) or []:
        try:
            out.append(int(v))
        except (TypeError, ValueError):
            raise OffPolicySampleError(
                f"{getattr(sample, 'name', '?')} was made by weight version {v!r}, which is not one of this run's "
                "(its exports are numbered 0, 1, 2, ...): another trainer or a stale worker serves that engine"
            ) from None
    return out


def oldest_version(samples: Sequence[Any]) -> int | None:
    """The oldest weight version of any token of `samples` (None when none reported one)."""
    versions = [v for s in samples for v in sample_versions(s)]
    return min(versions) if versions else None


def too_stale(samples: Sequence[Any], trainer_version: int, max_staleness: int) -> bool:
    """Whether a group may no longer train at `trainer_version`: its oldest token lags by more than K."""
    oldest = oldest_version(samples)
    return oldest is not None and trainer_version - oldest > max_staleness


def offpolicy_tokens(sample: Any, trainer_version: int) -> tuple[int, int]:
    """(model tokens made by older weights than `trainer_version`, all model tokens) of a sample, from its turn
    records (each request's tokens carry the version that made them)."""
    old = total = 0
    for record in getattr(sample, "turns", ()):
        total += record.generated_tokens
        if record.weight_version is not None and int(record.weight_version) < trainer_version:
            old += record.generated_tokens
    return old, total


@dataclass(frozen=True)
class StalenessReport:
    """What `check_bounded_staleness` found in one training batch: samples per staleness (trainer version minus
    the sample's oldest version) and the off-policy model tokens."""

    histogram: dict[int, int]
    offpolicy_tokens: int
    model_tokens: int

    def metrics(self, max_staleness: int) -> dict[str, float]:
        """`async/staleness_<k>` sample counts for k = 0..K, the mean, and the off-policy token count and share."""
        n = sum(self.histogram.values())
        out = {f"async/staleness_{k}": float(self.histogram.get(k, 0)) for k in range(max_staleness + 1)}
        out["async/staleness_mean"] = sum(k * c for k, c in self.histogram.items()) / n if n else 0.0
        out["async/offpolicy_tokens"] = float(self.offpolicy_tokens)
        out["async/offpolicy_token_frac"] = self.offpolicy_tokens / self.model_tokens if self.model_tokens else 0.0
        return out


def check_bounded_staleness(samples: Sequence[Any], *, trainer_version: int, engine_version: int,
                            max_staleness: int, step: int) -> StalenessReport:
    """The asynchronous counterpart of `check_sample_versions`, on the samples about to train at `trainer_version`:
    each reports its versions, each version is one the engine confirmed (<= `engine_version`), and none lags the
    trainer by more than `max_staleness`. The stream drops or regenerates stale groups before this; a violation here
    is a bug, and OffPolicySampleError names up to three samples."""
    histogram: dict[int, int] = {}
    wrong: list[str] = []
    old_tokens = all_tokens = 0
    for sample in samples:
        name = getattr(sample, "name", "?")
        versions = sample_versions(sample)
        if not versions:
            wrong.append(f"{name} reports no weight version (--max-staleness needs an engine that reports "
                         "meta_info.weight_version)")
            continue
        lag = trainer_version - min(versions)
        if max(versions) > engine_version or lag > max_staleness:
            wrong.append(f"{name} made by weight version(s) {versions}")
            continue
        histogram[lag] = histogram.get(lag, 0) + 1
        old, total = offpolicy_tokens(sample, trainer_version)
        old_tokens += old
        all_tokens += total
    if wrong:
        shown = "; ".join(wrong[:3]) + (f"; and {len(wrong) - 3} more" if len(wrong) > 3 else "")
        raise OffPolicySampleError(
            f"step {step}: {len(wrong)} of {len(samples)} samples may not train at trainer version {trainer_version} "
            f"(engine version {engine_version}, --max-staleness {max_staleness}): {shown}")
    return StalenessReport(histogram=dict(sorted(histogram.items())), offpolicy_tokens=old_tokens,
                           model_tokens=all_tokens)
