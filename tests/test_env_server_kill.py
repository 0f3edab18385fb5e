"""Issue 53: killing the env server mid-run fails the affected episodes with a typed cause, and the run goes on.

`jaxrl-vlm train configs/color_reveal_tiny.yaml --env-url ws://127.0.0.1:PORT/ws` runs its episodes on a
`jaxrl-vlm env-serve envs.color_reveal` subprocess. Once a step's episodes are mid-episode (they hold sessions
on the server, its /health, and the model is writing their turns, the run's engine's /v1/loads), the server is
SIGKILLed and started again on the same port. The run must exit 0 with every step logged; the
episodes the kill cut are FAILED as `env_error` (counted in `rollout/failed/env_error`), none lost: each step's
episodes are its trained samples plus its FAILED ones (plus any dropped group, counted); the cut step still trains
on its groups' survivors, and the steps after the restart train on full batches again.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from _launch import ROOT, free_port, log_tail, xla_flags

from jaxrl_vlm.job.run_log import read_metrics
from rollout.client import count_requests_in_loads

STEPS = 6
PROMPTS, PER_PROMPT = 2, 8  # 16 episodes a step, each holding one env-serve session from reset to close
KILL_AFTER_STEP = 1  # steps 0 and 1 train before the kill


def _env() -> dict[str, str]:
    return {**os.environ, "XLA_FLAGS": xla_flags(1), "JAX_PLATFORMS": "cpu"}  # the CLI runs like a user's


def _start_server(port: int, log: Path) -> subprocess.Popen:
    """`jaxrl-vlm env-serve envs.color_reveal` on 127.0.0.1:port, answering /health before this returns."""
    with open(log, "ab") as out:
        proc = subprocess.Popen([sys.executable, "-m", "jaxrl_vlm.cli", "env-serve", "envs.color_reveal",
                                 "--port", str(port), "--max-turns", "2"],
                                cwd=ROOT, env=_env(), stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while _health(port) is None:
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"env-serve did not come up on port {port} (rc={proc.poll()}):\n{log_tail(log)}")
        time.sleep(0.05)
    return proc


def _health(port: int) -> dict | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as answer:
            return json.load(answer)
    except OSError:
        return None


def _engine_requests(log: Path) -> int:
    """Running + waiting requests of the run's embedded engine (its log line `embedded engine serving DIR at URL`)."""
    line = next((ln for ln in log.read_text(errors="replace").splitlines() if "embedded engine serving" in ln), None)
    if line is None:
        return 0
    url = line.rsplit(" at ", 1)[1].strip() + "/v1/loads"
    try:
        with urllib.request.urlopen(url, timeout=5) as answer:
            return count_requests_in_loads(json.load(answer), endpoint=url)
    except OSError:
        return 0


def _wait(predicate, run: subprocess.Popen, log: Path, what: str, timeout_s: float = 600, poll_s: float = 0.01) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if run.poll() is not None:
            pytest.fail(f"the run exited with {run.returncode} before {what}:\n{log_tail(log)}")
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not within {timeout_s:g} s:\n{log_tail(log)}")
        time.sleep(poll_s)


def _logged_steps(metrics: Path) -> int:
    return len(read_metrics(metrics)) if metrics.exists() else 0


@pytest.mark.slow
@pytest.mark.ci_step
def test_killing_env_serve_mid_step_fails_its_episodes_typed_and_the_run_goes_on(tmp_path):
    port = free_port()
    server_log, run_log = tmp_path / "env_serve.log", tmp_path / "run.log"
    out = tmp_path / "run"
    metrics = out / "metrics.jsonl"
    argv = [sys.executable, "-m", "jaxrl_vlm.cli", "train", "configs/color_reveal_tiny.yaml",
            "--hf-checkpoint", str(tmp_path / "tiny"), "--prompt-data", str(tmp_path / "train.parquet"),
            "--synthetic-rows", "64", "--num-rollout", str(STEPS), "--rollout-batch-size", str(PROMPTS),
            "--n-samples-per-prompt", str(PER_PROMPT), "--eval-prompt-data", "[]", "--eval-interval", "none",
            "--output-dir", str(out), "--env-url", f"ws://127.0.0.1:{port}/ws",
            "--dump-rollout-interval", "1", "--dump-rollout-max-samples", "1000"]  # every episode, FAILED ones too
    server = _start_server(port, server_log)
    run = None
    try:
        with open(run_log, "wb") as log:
            run = subprocess.Popen(argv, cwd=ROOT, env=_env(), stdout=log, stderr=subprocess.STDOUT)
        _wait(lambda: _logged_steps(metrics) > KILL_AFTER_STEP, run, run_log, f"step {KILL_AFTER_STEP} was logged")
        # A step's episodes are mid-episode: they hold sessions on the server and the model is writing their turns.
        _wait(lambda: (_health(port) or {}).get("active_sessions", 0) >= PER_PROMPT and _engine_requests(run_log) > 0,
              run, run_log, "a step's episodes were mid-episode", poll_s=0.002)
        killed_at = _logged_steps(metrics)
        server.send_signal(signal.SIGKILL)
        server.wait(timeout=30)
        server = _start_server(port, server_log)
        rc = run.wait(timeout=900)
        assert rc == 0, log_tail(run_log)
    finally:
        for proc in (run, server):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)

    records = read_metrics(metrics)
    text = run_log.read_text(errors="replace")
    assert [r["step"] for r in records] == list(range(STEPS)), text[-3000:]
    assert "run finished" in text
    for r in records:
        _every_episode_accounted_for(r)
    cut = [r for r in records if r["rollout/failed/total"] > 0]
    assert [r["step"] for r in cut] == [killed_at], [_summary(r) for r in records]  # the step the kill cut, only
    cut = cut[0]
    # Its cut episodes FAILED with the typed env cause, each naming the lost server ...
    assert cut["rollout/failed/env_error"] == cut["rollout/failed/total"] == cut["rollout/failed_samples"], _summary(cut)
    assert any(k.startswith("rollout/env/errors/") for k in cut), _summary(cut)
    dumped = [json.loads(line) for line in (out / "rollout" / f"step_{killed_at}.jsonl").read_text().splitlines()]
    failed = [d for d in dumped if d["status"] == "failed"]
    assert len(dumped) == cut["rollout/samples"] + cut["rollout/failed/total"] and len(failed) == cut["rollout/failed/total"]
    for d in failed:
        assert d["termination"] == "env_error" and "remote env" in d["error"] and f"127.0.0.1:{port}" in d["error"], d
    # ... and every step trained: the cut one on its groups' surviving episodes (a group that lost them all was
    # replaced by one the restarted server played), every other one on a full batch.
    for r in records:
        assert r["rollout/groups_kept"] == PROMPTS and r["train/entropy_loss"] > 0, _summary(r)
        assert r is cut or r["rollout/samples"] == PROMPTS * PER_PROMPT, _summary(r)


def _summary(r: dict) -> dict:
    return {k: v for k, v in r.items() if k.startswith(("rollout/failed", "rollout/dynamic_filter", "rollout/env/"))
            or k in ("step", "rollout/episodes", "rollout/samples", "rollout/groups_submitted", "rollout/groups_kept")}


def _every_episode_accounted_for(r: dict) -> None:
    """Each episode the step started is trained, FAILED (counted by cause) or in a counted drop, never lost: the
    driver's counts add up to the groups it submitted."""
    drops = {k.removeprefix("rollout/dynamic_filter/drop_"): v for k, v in r.items()
             if k.startswith("rollout/dynamic_filter/drop_")}
    per_sample = ("failed_sample", "aborted_sample", "no_reward_sample")
    whole_groups = ("surplus_group", "straggler_group", "straggler_group_error", "partial_group_carried")
    assert set(drops) <= {*per_sample, *whole_groups, "empty_group"}, drops  # no filter that drops trainable groups
    started = r["rollout/groups_submitted"] * PER_PROMPT
    accounted = (r["rollout/samples"] + sum(drops.get(k, 0) for k in per_sample)
                 + PER_PROMPT * sum(drops.get(k, 0) for k in whole_groups))
    assert started == accounted, _summary(r)
    assert drops.get("failed_sample", 0) == r["rollout/failed/total"] == r["rollout/failed_samples"], _summary(r)
    by_cause = sum(v for k, v in r.items() if k.startswith("rollout/failed/") and k != "rollout/failed/total")
    assert by_cause == r["rollout/failed/total"], _summary(r)
