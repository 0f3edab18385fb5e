"""The bounded soak in CI: `scripts/soak_engine.py` drives a `jaxrl-vlm serve` of a tiny model (built by
make-tiny, nothing downloaded) with concurrent clients for 40 s (text and image requests, multi-turn
continuations that share prefixes, aborts by rid and dropped connections), and its report must show what the
engine promises under load: no failure but the injected ones, no KV page held or leaked once the load settled,
greedy answers equal to the quiet engine's, and a flat RSS after warm-up."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_soak_of_the_served_engine_has_no_unexpected_failure_leak_or_drift(tmp_path):
    report_path = tmp_path / "soak.json"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # the server runs on one CPU device
    env.update({"JAX_PLATFORMS": "cpu", "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))})
    # A 256-token context keeps the set of compiled shapes small, so warm-up ends well before the load does.
    argv = [sys.executable, str(ROOT / "scripts" / "soak_engine.py"), "--clients", "3", "--duration", "40",
            "--warmup", "10", "--max-seq-len", "256", "--max-total-tokens", "1024", "--workdir", str(tmp_path),
            "--json", str(report_path)]
    proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=540)
    output = proc.stdout[-6000:] + proc.stderr[-4000:]
    assert report_path.exists(), f"no report (exit {proc.returncode}):\n{output}"
    report = json.loads(report_path.read_text())

    outcomes = report["by_outcome"]
    assert report["unexpected_failures"] == 0, report["failure_examples"]
    assert report["answered"] > 100 and outcomes["injected_abort"] > 0 and outcomes["injected_drop"] > 0, output
    assert all(n > 0 for n in report["by_kind"].values()), report["by_kind"]
    assert report["pages_held_after_load"] == 0 and report["pages_leaked"] == 0, output
    assert report["pages_after_flush"] == report["pages_idle_baseline"], output
    assert report["greedy_probes_under_load"] > 0 and report["greedy_mismatches_under_load"] == 0, report["greedy_mismatch_details"]
    assert report["greedy_equal_after_load"] is True, report["greedy_mismatch_details"]
    assert report["rss_growth_after_warmup_mib"] is not None
    assert report["rss_growth_after_warmup_mib"] <= report["options"]["rss_growth_bound_mib"], output
    assert report["passed"] and proc.returncode == 0, output
