"""Where a run's metrics go besides metrics.jsonl: TensorBoard event files and Weights & Biases.

The JSONL file stays the source of truth; these sinks are opt-in (`--use-tensorboard`, `--use-wandb`). The
TensorBoard writer is tensorboard's own event-file writer, so it needs neither torch nor TensorFlow. wandb is an
optional extra (`pip install 'jaxrl-vlm[wandb]'`), imported only when asked for.
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path
from typing import Any, Protocol


class MetricSink(Protocol):
    def write(self, step: int, metrics: dict[str, float | None]) -> None: ...

    def close(self) -> None: ...


def _finite(metrics: dict[str, float | None]) -> dict[str, float]:
    return {k: v for k, v in metrics.items() if v is not None and math.isfinite(v)}


class TensorBoardSink:
    """Scalars as TensorBoard event files (one `simple_value` summary per metric and step)."""

    def __init__(self, log_dir: str | Path):
        # Optional dependency (the `tensorboard` extra), imported only when TensorBoard output is asked for.
        from tensorboard.compat.proto import event_pb2, summary_pb2
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self._event_pb2, self._summary_pb2 = event_pb2, summary_pb2
        Path(log_dir).mkdir(parents=True, exist_ok=True)
        self._writer = EventFileWriter(str(log_dir))

    def write(self, step: int, metrics: dict[str, float | None]) -> None:
        values = [self._summary_pb2.Summary.Value(tag=k, simple_value=v) for k, v in _finite(metrics).items()]
        event = self._event_pb2.Event(wall_time=time.time(), step=step, summary=self._summary_pb2.Summary(value=values))
        self._writer.add_event(event)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class WandbSink:
    """One wandb run per training run; `mode="offline"` writes it locally for a later `wandb sync`."""

    def __init__(self, tracking: Any, out_dir: Path, config: dict[str, Any]):
        try:
            import wandb  # optional heavy dependency (the `wandb` extra), imported only for --use-wandb
        except ImportError as e:
            raise RuntimeError("--use-wandb needs wandb: pip install 'jaxrl-vlm[wandb]'") from e
        if tracking.wandb_key:
            os.environ.setdefault("WANDB_API_KEY", tracking.wandb_key)
        directory = Path(tracking.wandb_dir or out_dir / "wandb")
        directory.mkdir(parents=True, exist_ok=True)
        self._run = wandb.init(
            project=tracking.wandb_project, group=tracking.wandb_group, name=tracking.wandb_run_name or out_dir.name,
            mode=tracking.wandb_mode or "online", dir=str(directory), config=config, reinit="finish_previous",
        )

    def write(self, step: int, metrics: dict[str, float | None]) -> None:
        self._run.log(_finite(metrics), step=step)

    def close(self) -> None:
        self._run.finish()


def open_sinks(tracking: Any, out_dir: Path, config: dict[str, Any]) -> list[MetricSink]:
    """The sinks the tracking options ask for (none by default)."""
    sinks: list[MetricSink] = []
    if tracking.use_tensorboard:
        sinks.append(TensorBoardSink(tracking.tensorboard_dir or out_dir / "tb"))
    if tracking.use_wandb:
        sinks.append(WandbSink(tracking, out_dir, config))
    return sinks
