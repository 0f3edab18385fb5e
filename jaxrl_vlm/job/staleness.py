"""Which weights made each sample, checked against the weights the engine is known to hold.

The synchronous loop trains every step on rollouts of the weights it pushed last (and confirmed, see
`WeightSyncer.confirm`). A sample whose turns report another `weight_version` means an engine that did not
take the update, a second trainer pushing to the same engine, or a router serving a stale worker: training on it
would be silently off-policy, so the run stops with the samples and versions named.
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
