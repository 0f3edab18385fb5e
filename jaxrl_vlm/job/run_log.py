"""Per-step metrics of a run: JSONL (always), a live progress line, PNG plots, and the opt-in TensorBoard / wandb
sinks of `job/tracking.py`.

The JSONL file is the source of truth (one object per step, appended and flushed), so a killed run keeps
everything it logged and a resumed run appends to the same file.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any

from jaxrl_vlm.job.tracking import MetricSink

PLOTS = {
    "reward.png": ("rollout/raw_reward", "mean reward"),
    "response_length.png": ("rollout/response_len/mean", "response length (tokens)"),
    "turns.png": ("rollout/turns/mean", "turns per episode"),
    "truncation.png": ("rollout/truncated_ratio", "truncated ratio"),
    "entropy_kl.png": (("train/entropy_loss", "train/approx_kl"), "entropy / approx KL"),
    "step_time.png": (("perf/rollout_time", "perf/train_time", "perf/update_weights_time"), "seconds per step"),
}


class RunLog:
    def __init__(self, out_dir: str | Path, *, total_steps: int, sinks: list[MetricSink] | None = None):
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.out_dir / "metrics.jsonl"
        self.total_steps = total_steps
        self._file = self.path.open("a", buffering=1)
        self._sinks = list(sinks or [])
        self._t_start = time.perf_counter()

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        clean = {k: _to_float(v) for k, v in metrics.items()}
        record = {"step": step, "time": time.time(), **clean}
        self._file.write(json.dumps(record, allow_nan=True) + "\n")
        for sink in self._sinks:
            sink.write(step, clean)
        self._progress(step, clean)

    def _progress(self, step: int, m: dict[str, float | None]) -> None:
        done = step + 1
        width = 24
        filled = int(width * done / max(1, self.total_steps))
        bar = "#" * filled + "." * (width - filled)
        elapsed = time.perf_counter() - self._t_start

        def fmt(key: str, spec: str) -> str:
            v = m.get(key)
            return "-" if v is None else format(v, spec)

        line = (
            f"[{bar}] step {done}/{self.total_steps} reward {fmt('rollout/raw_reward', '.3f')} "
            f"len {fmt('rollout/response_len/mean', '.0f')} turns {fmt('rollout/turns/mean', '.2f')} "
            f"loss {fmt('train/loss_total', '.4f')} step {fmt('perf/step_time', '.1f')}s elapsed {elapsed:.0f}s"
        )
        print(line, file=sys.stderr, flush=True)

    def close(self) -> None:
        self._file.close()
        for sink in self._sinks:
            sink.close()


def _to_float(value: Any) -> float | None:
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """All records of a metrics.jsonl; for a resumed run, the last record of each step wins."""
    by_step: dict[int, dict[str, Any]] = {}
    with Path(path).open() as f:
        for line in f:
            line = line.strip()
            if line:
                record = json.loads(line)
                by_step[int(record["step"])] = record
    return [by_step[k] for k in sorted(by_step)]


def plot_run(metrics_path: str | Path, out_dir: str | Path) -> list[Path]:
    """PNG plots of reward, response length, turns, truncation, entropy/KL and the step-time breakdown."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(metrics_path)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, (keys, title) in PLOTS.items():
        keys = (keys,) if isinstance(keys, str) else keys
        fig, ax = plt.subplots(figsize=(6, 3.5))
        plotted = False
        for key in keys:
            points = [(r["step"], r[key]) for r in records if r.get(key) is not None and math.isfinite(r[key])]
            if points:
                xs, ys = zip(*points)
                ax.plot(xs, ys, marker="o", markersize=3, label=key)
                plotted = True
        ax.set_title(title)
        ax.set_xlabel("step")
        if plotted:
            ax.legend(fontsize=7)
        else:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
        fig.tight_layout()
        path = out / name
        fig.savefig(path, dpi=80)
        plt.close(fig)
        written.append(path)
    return written
