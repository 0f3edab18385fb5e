"""The end-to-end job: `jaxrl-vlm train configs/geo3k_tiny.yaml` runs to the end on CPU; a run preempted with
SIGTERM (either policy) or killed with SIGKILL resumes from its last checkpoint with `--load` and continues exactly
like the uninterrupted run (one chain of runs)."""

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
from _launch import xla_flags

from jaxrl_vlm.job.run_log import read_metrics
from jaxrl_vlm.metric_catalog import uncatalogued
from rollout.client import count_requests_in_loads

ROOT = Path(__file__).resolve().parents[1]
CONFIG = "configs/geo3k_tiny.yaml"


def _cmd(tmp: Path, out: str, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "jaxrl_vlm.cli", "train", CONFIG,
        "--hf-checkpoint", str(tmp / "tiny"), "--prompt-data", str(tmp / "geo3k.parquet"),
        "--output-dir", str(tmp / out), *extra,
    ]


def _env() -> dict[str, str]:
    return {**os.environ, "XLA_FLAGS": xla_flags(1)}  # the CLI runs like a user's: one CPU device


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("main_job")
    done = subprocess.run(_cmd(tmp, "full"), cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return tmp, done


@pytest.mark.slow
def test_tiny_config_runs_to_the_end_and_writes_everything(full_run):
    tmp, done = full_run
    out = tmp / "full"
    records = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(6))  # num_rollout: 6
    for r in records:
        assert r["rollout/samples"] > 0 and r["weight_version"] == r["step"] + 1
        assert 0.0 <= r["batch/padding_efficiency"] <= 1.0
        # slime's names, so curves overlay the seed's (README: slime flag -> jaxrl-vlm).
        for key in ("perf/rollout_time", "perf/train_time", "perf/update_weights_time", "perf/step_time",
                    "train/entropy_loss", "train/tis", "train/pg_loss", "train/pg_clipfrac", "train/ppo_kl",
                    "rollout/advantages", "rollout/raw_reward", "multi_turn/raw_response_length/response_length_mean",
                    "multi_turn/raw_response_length/response_length_clip_ratio"):
            assert key in r, key
        assert r["train/entropy_loss"] > 0 and r["perf/step_time"] >= r["perf/train_time"] > 0
    # Every name the run wrote is in the catalogue that docs/reference/metrics.md renders.
    assert not uncatalogued(k for r in records for k in r), "declare them in jaxrl_vlm/metric_catalog.py"
    assert sorted(p.name for p in (out / "plots").glob("*.png")) == sorted(
        ["reward.png", "response_length.png", "turns.png", "truncation.png", "entropy_kl.png", "step_time.png"]
    )
    assert sorted(int(p.name) for p in (out / "checkpoints").iterdir() if p.name.isdigit()) == [4, 6]  # keep 2
    meta = json.loads((out / "checkpoints" / "6" / "meta" / "metadata").read_text())  # orbax's JsonSave file
    assert meta["weight_version"] == 6
    driver = meta["driver_state"]  # buffered prompts and carried groups survive a resume (test_driver.py)
    assert driver["version"] == 4 and isinstance(driver["prompt_buffer"], list)
    final = out / "final_model"
    config = json.loads((final / "config.json").read_text())
    assert config["model_type"] == "qwen3_vl" and (final / "model.safetensors").stat().st_size > 0
    assert (final / "tokenizer.json").exists() and (final / "preprocessor_config.json").exists()
    # The embedded engine lives in this process: every version went to it in memory, none through the disk.
    assert all(r["sync/in_memory"] == 1.0 and r["sync/gbytes"] == records[0]["sync/gbytes"] > 0 for r in records)
    assert not (out / "weights").exists()
    assert "run finished" in done.stdout


def _wait_for(predicate, proc: subprocess.Popen, log: Path, what: str, timeout_s: float = 600) -> None:
    """Poll `predicate` until it holds; fail naming `what` (with the log's tail) if the process ends or time runs out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        if proc.poll() is not None:
            pytest.fail(f"the run exited with {proc.returncode} before {what}:\n{log.read_text()[-3000:]}")
        time.sleep(0.05)
    pytest.fail(f"{what}: not within {timeout_s:g} s")


def _engine_url(log: Path) -> str:
    """The embedded engine's address, from the run's log line `embedded engine serving <dir> at <url>`."""
    line = next((ln for ln in log.read_text().splitlines() if "embedded engine serving" in ln), None)
    assert line is not None, log.read_text()[-3000:]
    return line.rsplit(" at ", 1)[1].strip()


def _requests_in(loads_url: str) -> int:
    """Running + waiting requests of the engine (SGLang's /v1/loads)."""
    with urllib.request.urlopen(loads_url, timeout=5) as answer:
        return count_requests_in_loads(json.load(answer), endpoint=loads_url)


def _checkpoints(out: Path) -> list[int]:
    return sorted(int(p.name) for p in (out / "checkpoints").iterdir() if p.name.isdigit())


def _sigterm_during_rollout(argv: list[str], log: Path, after_records: int) -> str:
    """Run `argv`, SIGTERM it once `after_records` step records are logged and the next step's rollout has requests
    in the engine, and return its stdout (exit code 0 asserted)."""
    metrics = log.parent / "metrics.jsonl"
    with open(log, "w") as err:
        proc = subprocess.Popen(argv, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=err, text=True)
    try:
        # The record is logged, then the next step's requests are in the engine: the run is in that step's
        # rollout. (Right after a record the run is still between steps for a moment; a signal there stops it at
        # the boundary, with no step to give up: seen once in a full suite.)
        _wait_for(lambda: metrics.exists() and len(read_metrics(metrics)) >= after_records, proc, log,
                  f"{after_records} steps were logged")
        _wait_for(lambda: "embedded engine serving" in log.read_text(), proc, log, "the engine started")
        loads = _engine_url(log) + "/v1/loads"
        _wait_for(lambda: _requests_in(loads) > 0, proc, log, "the next step's rollout reached the engine")
        proc.send_signal(signal.SIGTERM)
        stdout, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, log.read_text()[-3000:]
    return stdout


@pytest.mark.slow
def test_sigterm_either_policy_and_sigkill_resume_like_an_uninterrupted_run(full_run):
    """One chain of runs over the 6 steps, each link resumed with `--load` from the one before:
    1. SIGTERM while step 2 rolls out, `--preemption-policy abort`: the step is given up and step 2 checkpointed (the
       data cursor and driver state as the step began); exit 0 without the final export;
    2. SIGTERM while step 3 rolls out (the resumed run has trained step 2, so it knows a step's time),
       `--preemption-policy finish`: step 3 is trained within the grace period and step 4 checkpointed;
    3. periodic checkpoints every step; SIGKILL (no handler, no checkpoint of its own) once checkpoint 5 is written:
       periodic checkpoints, written by a resumed run, resume exactly too;
    4. the last resume finishes, and every step from the first preemption on equals the uninterrupted run's.
    (One chain for the three properties: separate runs cost the suite a start and several steps each.)"""
    tmp, _ = full_run
    name = "preempted"
    out = tmp / name
    out.mkdir()
    metrics = out / "metrics.jsonl"
    # --save-interval 0: the only checkpoint before the end is the preemption's.
    stdout = _sigterm_during_rollout(
        _cmd(tmp, name, "--save-interval", "0", "--preemption-policy", "abort", "--preemption-grace-seconds", "30"),
        out / "abort_stderr.log", after_records=2)
    stderr = (out / "abort_stderr.log").read_text()
    assert "gave up the step in progress (step 2: --preemption-policy abort)" in stderr, stderr[-3000:]
    assert "preempted by SIGTERM after 2 completed steps" in stderr
    assert "run preempted (SIGTERM) after 2 steps" in stdout
    assert _checkpoints(out) == [2]
    assert not (out / "final_model").exists()  # the preempted run is not finished
    assert [r["step"] for r in read_metrics(metrics)] == [0, 1]

    # finish: room for a step on a loaded 2-core machine
    stdout = _sigterm_during_rollout(
        _cmd(tmp, name, "--load", str(out / "checkpoints"), "--save-interval", "0", "--preemption-policy", "finish",
             "--preemption-grace-seconds", "300"),
        out / "finish_stderr.log", after_records=3)
    stderr = (out / "finish_stderr.log").read_text()
    assert "resumed from" in stderr and "at step 2" in stderr
    assert "step 3 trained; its weight sync is skipped for the preemption (SIGTERM)" in stderr, stderr[-3000:]
    assert "preempted by SIGTERM after 4 completed steps" in stderr
    assert "run preempted (SIGTERM) after 4 steps" in stdout
    assert _checkpoints(out) == [2, 4]  # keep_checkpoints: 2
    assert not (out / "final_model").exists()
    assert [r["step"] for r in read_metrics(metrics)] == [0, 1, 2, 3]

    _resume_then_sigkill_after_checkpoint_5(tmp, name)

    resumed = subprocess.run(_cmd(tmp, name, "--load", str(out / "checkpoints")), cwd=ROOT, env=_env(),
                             capture_output=True, text=True, timeout=900)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stderr and "at step 5" in resumed.stderr
    assert "run finished" in resumed.stdout
    full = {r["step"]: r for r in read_metrics(tmp / "full" / "metrics.jsonl")}
    after = {r["step"]: r for r in read_metrics(metrics)}
    assert sorted(after) == list(range(6))
    for step in range(2, 6):
        for key in ("rollout/raw_reward", "rollout/response_len/mean", "train/loss_total", "train/grad_norm"):
            assert after[step][key] == pytest.approx(full[step][key], rel=1e-4, abs=1e-6), (step, key)


def _resume_then_sigkill_after_checkpoint_5(tmp: Path, name: str) -> None:
    """`--load` the preempted run (checkpoint 4) with a periodic checkpoint every step, and SIGKILL it once
    checkpoint 5 is complete (step 4 is logged after it), before the run can finish."""
    out = tmp / name
    metrics = out / "metrics.jsonl"
    argv = _cmd(tmp, name, "--load", str(out / "checkpoints"), "--save-interval", "1")
    log = out / "killed_stderr.log"
    with open(log, "w") as err:
        proc = subprocess.Popen(argv, cwd=ROOT, env=_env(), stdout=subprocess.DEVNULL, stderr=err)
    try:
        # orbax renames a checkpoint's directory to its step only once it is complete, then removes the oldest
        # beyond keep_checkpoints (2): a kill between the two would leave checkpoint 2 too (seen once in a suite)
        _wait_for(lambda: "at step 4" in log.read_text() and len(read_metrics(metrics)) >= 5
                  and _checkpoints(out) == [4, 5], proc, log,
                  "the resumed run logged step 4, wrote checkpoint 5 and removed checkpoint 2")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert "resumed from" in log.read_text() and "at step 4" in log.read_text()
    assert len(read_metrics(metrics)) < 6, "the resumed run finished before it could be killed"
    assert _checkpoints(out) == [4, 5]
    assert not (out / "final_model").exists()


@pytest.mark.slow
def test_rollout_command_on_synthetic_geo3k_writes_a_valid_dump(full_run):
    from rollout.dump import validate_dump

    tmp, _ = full_run
    dump = tmp / "rollout.jsonl"
    done = subprocess.run(
        [sys.executable, "-m", "jaxrl_vlm.cli", "rollout", CONFIG, "--hf-checkpoint", str(tmp / "tiny"),
         "--prompt-data", str(tmp / "geo3k.parquet"), "--output-dir", str(tmp / "rollout_run"),
         "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--dump", str(dump)],
        cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "dump written and validated" in done.stdout
    records = validate_dump(dump)
    assert len(records) == 4
    for rec in records:
        assert rec["status"] in ("completed", "truncated")
        assert 1 <= len(rec["turns"]) <= 3  # max_turns: 3 from configs/geo3k_multiturn.yaml
        assert rec["turns"][0]["model_tokens"] > 0
