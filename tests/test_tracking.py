"""Metrics beyond metrics.jsonl: TensorBoard event files read back by tensorboard's own reader (no torch), and a
wandb run in offline mode."""

from __future__ import annotations

import json
import math
import os
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from jaxrl_vlm.config import load_config
from jaxrl_vlm.job.run_log import RunLog, read_metrics
from jaxrl_vlm.job.tracking import TensorBoardSink, open_sinks

STEPS = [
    {"rollout/raw_reward": 0.25, "train/entropy_loss": 3.5, "perf/step_time": 1.5, "weight_version": 1},
    {"rollout/raw_reward": 0.5, "train/entropy_loss": 3.25, "perf/step_time": float("nan"), "weight_version": 2},
]


def test_tensorboard_event_files_are_read_back_by_tensorboard(tmp_path):
    log = RunLog(tmp_path, total_steps=2, sinks=[TensorBoardSink(tmp_path / "tb")])
    for step, metrics in enumerate(STEPS):
        log.log(step, metrics)
    log.close()
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"rollout/raw_reward", "train/entropy_loss", "perf/step_time", "weight_version"} <= tags
    assert [(e.step, e.value) for e in acc.Scalars("rollout/raw_reward")] == [(0, 0.25), (1, 0.5)]
    assert [(e.step, e.value) for e in acc.Scalars("train/entropy_loss")] == [(0, 3.5), (1, 3.25)]
    # A non-finite value is kept in the JSONL (the source of truth) but not written as a scalar.
    assert [e.step for e in acc.Scalars("perf/step_time")] == [0]
    assert math.isnan(read_metrics(tmp_path / "metrics.jsonl")[1]["perf/step_time"])


def test_sinks_follow_the_options_and_jsonl_stays_the_default(tmp_path):
    assert open_sinks(load_config(None, []).tracking, tmp_path, {}) == []
    sinks = open_sinks(load_config(None, ["--use-tensorboard", "--tensorboard-dir", str(tmp_path / "x")]).tracking,
                       tmp_path, {})
    assert [type(s).__name__ for s in sinks] == ["TensorBoardSink"]
    sinks[0].close()


def _wandb_records(path: Path) -> list[Any]:
    """The protobuf records of an offline `.wandb` file (a LevelDB-style log: 7-byte header, 32 KiB blocks)."""
    from wandb.proto import wandb_internal_pb2

    data, pos, records, pending = path.read_bytes(), 7, [], b""
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        _, size, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if size == 0 and kind == 0:
            break
        pending += data[pos + 7 : pos + 7 + size]
        pos += 7 + size
        if kind in (1, 4):  # FULL or LAST chunk
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def test_wandb_offline_run_records_config_and_metrics(tmp_path):
    # In a fresh interpreter: wandb keeps process-wide state (its service, settings, env) that earlier tests in the
    # same process can disturb.
    script = f"""
import json, sys
from pathlib import Path
from jaxrl_vlm.config import load_config
from jaxrl_vlm.job.run_log import RunLog
from jaxrl_vlm.job.tracking import open_sinks
cfg = load_config(None, ["--use-wandb", "--wandb-project", "jaxrl-test", "--wandb-group", "g1", "--wandb-mode",
                         "offline", "--wandb-dir", {str(tmp_path / "wb")!r}, "--lr", "3e-6", "--wandb-key",
                         "secret-key-123"])
out_dir = Path({str(tmp_path / "run")!r})
(sink,) = open_sinks(cfg.tracking, out_dir, cfg.to_dict())
log = RunLog(out_dir, total_steps=2, sinks=[sink])
for step, metrics in enumerate(json.loads(sys.argv[1])):
    log.log(step, metrics)
log.close()
"""
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env["WANDB_SILENT"] = "true"
    done = subprocess.run([sys.executable, "-c", script, json.dumps(STEPS)], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    (run_file,) = (tmp_path / "wb" / "wandb").glob("offline-run-*/run-*.wandb")
    records = _wandb_records(run_file)
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert (run.project, run.run_group, run.display_name) == ("jaxrl-test", "g1", "run")
    config = {i.key: json.loads(i.value_json) for i in run.config.update}
    assert config["optim"]["lr"] == 3e-6 and config["tracking"]["wandb_group"] == "g1"
    assert b"secret-key-123" not in run_file.read_bytes(), "the API key must never be logged"
    history = [{("/".join(i.nested_key) or i.key): json.loads(i.value_json) for i in r.history.item}
               for r in records if r.WhichOneof("record_type") == "history"]
    assert [(h["_step"], h["rollout/raw_reward"], h["train/entropy_loss"]) for h in history] == [(0, 0.25, 3.5), (1, 0.5, 3.25)]
    assert "perf/step_time" in history[0] and "perf/step_time" not in history[1]  # NaN is not sent
