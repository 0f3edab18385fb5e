"""Per-step metrics of a run: JSONL (always), a live progress line, PNG plots, the opt-in TensorBoard / wandb
sinks of `job/tracking.py`, and overlays of several runs (`jaxrl-vlm plot`).

The JSONL file is the source of truth (lines appended and flushed), so a killed run keeps everything it logged and
a resumed run appends to the same file. Its lines:

* a step's training record `{"step": s, "time": ..., "rollout/...", "train/...", ...}`;
* an eval record `{"step": s, "time": ..., "eval/<name>/...", "perf/eval_time", "weight_version"}` for the
  weights that sample step s's rollout (after s training steps: written before step s's record; the final eval
  of a run of N steps is the only line of step N);
* `{"resumed_at_step": s, "time": ...}`, written when a run resumes from its step-s checkpoint.

`read_metrics` merges the lines of each step into one record (later lines win on a shared key) and drops
whatever an interrupted run had logged for steps >= s at each resume marker, so the resumed run's lines replace
them whole.
"""

from __future__ import annotations

import fnmatch
import json
import math
import sys
import time
from collections.abc import Sequence
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
    # Keys may be fnmatch patterns (one curve per eval set); a plot listed in ONLY_WITH_DATA is written only when
    # the run has its metrics.
    "eval_reward.png": (("eval/*/raw_reward",), "eval mean reward per set (x: steps trained)"),
    # An SFT run (--loss-type sft_loss): the training NLL and each eval set's held-out NLL per assistant token.
    "sft_nll.png": (("train/sft_loss", "eval/*/nll"), "NLL per assistant token (train, held-out sets)"),
}
ONLY_WITH_DATA = frozenset({"eval_reward.png", "sft_nll.png"})
SFT_KEY = "train/sft_loss"  # a run that logs it is an SFT run: its plots without data (rollout ones) are left out

# `jaxrl-vlm plot`: one PNG per metric, one curve per run (the seed article's panels). A pattern gives one PNG per
# match (per eval set).
COMPARE_PLOTS: dict[str, tuple[str, str]] = {
    "reward": ("rollout/raw_reward", "rollout mean reward"),
    "eval_reward": ("eval/*/raw_reward", "eval mean reward"),
    "repetition_frac": ("rollout/repetition_frac", "repetition fraction"),
    "response_length": ("rollout/response_len/mean", "response length (tokens)"),
    "turns": ("rollout/turns/mean", "turns per episode"),
    "truncation": ("rollout/truncated_ratio", "truncated ratio"),
}


class RunLog:
    def __init__(self, out_dir: str | Path, *, total_steps: int, sinks: list[MetricSink] | None = None,
                 resumed_at: int | None = None):
        """`resumed_at`: the step a resumed run starts from; a marker line tells `read_metrics` to drop what the
        interrupted run logged from that step on."""
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.out_dir / "metrics.jsonl"
        self.total_steps = total_steps
        had_lines = self.path.exists() and self.path.stat().st_size > 0
        self._file = self.path.open("a", buffering=1)
        if resumed_at is not None and had_lines:
            self._file.write(json.dumps({RESUMED_AT: int(resumed_at), "time": time.time()}) + "\n")
        self._sinks = list(sinks or [])
        self._t_start = time.perf_counter()

    def _write(self, step: int, metrics: dict[str, Any]) -> dict[str, float | None]:
        clean = {k: _to_float(v) for k, v in metrics.items()}
        record = {"step": step, "time": time.time(), **clean}
        self._file.write(json.dumps(record, allow_nan=True) + "\n")
        for sink in self._sinks:
            sink.write(step, clean)
        return clean

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        """The training record of `step`."""
        self._progress(step, self._write(step, metrics))

    def log_eval(self, step: int, metrics: dict[str, Any]) -> None:
        """The eval record of the weights that sample step `step`'s rollout (after `step` training steps)."""
        clean = self._write(step, metrics)
        names = sorted({k.split("/")[1] for k in clean if k.startswith("eval/") and k.count("/") >= 2})
        parts = []
        for name in names:
            nll = clean.get(f"eval/{name}/nll")
            if nll is not None:  # an SFT run's held-out NLL
                parts.append(f"{name} nll {nll:.4f}")
                continue
            reward = clean.get(f"eval/{name}/raw_reward")
            turns = clean.get(f"eval/{name}/turns/mean")
            parts.append(f"{name} reward {'-' if reward is None else format(reward, '.3f')} "
                         f"turns {'-' if turns is None else format(turns, '.2f')}")
        took = clean.get("perf/eval_time")
        print(f"eval after {step} steps: {'; '.join(parts)} ({'-' if took is None else format(took, '.1f')}s)",
              file=sys.stderr, flush=True)

    def _progress(self, step: int, m: dict[str, float | None]) -> None:
        done = step + 1
        width = 24
        filled = int(width * done / max(1, self.total_steps))
        bar = "#" * filled + "." * (width - filled)
        elapsed = time.perf_counter() - self._t_start

        def fmt(key: str, spec: str) -> str:
            v = m.get(key)
            return "-" if v is None else format(v, spec)

        if SFT_KEY in m:
            print(f"[{bar}] step {done}/{self.total_steps} sft_loss {fmt(SFT_KEY, '.4f')} epoch {fmt('sft/epoch', '.2f')} "
                  f"step {fmt('perf/step_time', '.1f')}s elapsed {elapsed:.0f}s", file=sys.stderr, flush=True)
            return
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


RESUMED_AT = "resumed_at_step"


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """One record per step of a metrics.jsonl, in step order (module docstring): the lines of a step merged in
    file order (its eval record and its training record; a later line wins on a shared key), after dropping at
    each resume marker what the interrupted run had logged for steps >= the resumed step. A run's final eval is the
    record of step num_rollout (eval keys only)."""
    by_step: dict[int, dict[str, Any]] = {}
    with Path(path).open() as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            record = json.loads(line)
            if RESUMED_AT in record:
                start = int(record[RESUMED_AT])
                by_step = {k: v for k, v in by_step.items() if k < start}
                continue
            step = int(record["step"])
            by_step[step] = {**by_step.get(step, {}), **record}
    return [by_step[k] for k in sorted(by_step)]


def _expand(keys: Sequence[str], records: list[dict[str, Any]]) -> list[str]:
    """`keys` with fnmatch patterns replaced by the matching keys of `records` (sorted)."""
    out: list[str] = []
    for key in keys:
        if any(c in key for c in "*?["):
            out.extend(sorted({k for r in records for k in r if fnmatch.fnmatchcase(k, key)}))
        else:
            out.append(key)
    return out


def _points(records: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    points = [(r["step"], r[key]) for r in records if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
    return [p[0] for p in points], [p[1] for p in points]


def _pyplot() -> Any:
    import matplotlib  # optional plotting stack, imported only when plotting

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _integer_steps(ax: Any) -> None:
    from matplotlib.ticker import MaxNLocator  # optional plotting stack, imported only when plotting

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def plot_run(metrics_path: str | Path, out_dir: str | Path) -> list[Path]:
    """PNG plots of reward, response length, turns, truncation, entropy/KL, the step-time breakdown, and the eval
    reward of each eval set (when the run evaluated); for an SFT run, the NLL curves and the step times."""
    plt = _pyplot()
    records = read_metrics(metrics_path)
    sft = any(SFT_KEY in r for r in records)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, (keys, title) in PLOTS.items():
        keys = _expand((keys,) if isinstance(keys, str) else keys, records)
        if (sft or name in ONLY_WITH_DATA) and not any(_points(records, key)[0] for key in keys):
            continue
        fig, ax = plt.subplots(figsize=(6, 3.5))
        plotted = False
        for key in keys:
            xs, ys = _points(records, key)
            if xs:
                ax.plot(xs, ys, marker="o", markersize=3, label=key)
                plotted = True
        ax.set_title(title)
        ax.set_xlabel("step")
        _integer_steps(ax)
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


def _run_metrics(run: str | Path) -> Path:
    path = Path(run)
    path = path / "metrics.jsonl" if path.is_dir() else path
    if not path.is_file():
        raise FileNotFoundError(f"{run}: no metrics.jsonl (pass a run's output directory or its metrics.jsonl)")
    return path


def _labels(runs: Sequence[str | Path]) -> list[str]:
    """A legend label per run: its directory name, or its path where two names are equal."""
    names = [(Path(r).parent if Path(r).name == "metrics.jsonl" else Path(r)).name or str(r) for r in runs]
    return [str(r) if names.count(n) > 1 else n for r, n in zip(runs, names)]


def plot_runs(runs: Sequence[str | Path], out_dir: str | Path, *, plots: dict[str, tuple[str, str]] | None = None,
              labels: Sequence[str] | None = None, skip_empty: bool = False) -> list[Path]:
    """`jaxrl-vlm plot`: one PNG per metric of `plots` (default COMPARE_PLOTS; `{stem: (key or pattern, title)}`,
    one PNG per eval set for a pattern), one curve per run with a legend (`labels`, default the run directories'
    names), so runs (loss variants, seeds, a run beside the seed's figures) can be compared. With `skip_empty`, a
    metric no run logged gets no PNG."""
    plt = _pyplot()
    if not runs:
        raise ValueError("plot_runs needs at least one run")
    loaded = [read_metrics(_run_metrics(r)) for r in runs]
    labels = list(labels) if labels is not None else _labels(runs)
    if len(labels) != len(runs):
        raise ValueError(f"plot_runs: {len(labels)} labels for {len(runs)} runs")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    everything = [r for records in loaded for r in records]
    written = []
    for stem, (pattern, title) in (COMPARE_PLOTS if plots is None else plots).items():
        keys = _expand((pattern,), everything)
        if skip_empty:
            keys = [k for k in keys if any(_points(records, k)[0] for records in loaded)]
        for key in keys:
            file_stem = stem if key == pattern else f"{stem}_{key.split('/')[1]}"
            fig, ax = plt.subplots(figsize=(6, 3.5))
            plotted = False
            for label, records in zip(labels, loaded):
                xs, ys = _points(records, key)
                if xs:
                    ax.plot(xs, ys, marker="o", markersize=3, label=label)
                    plotted = True
            ax.set_title(title if key == pattern else f"{title}: {key.split('/')[1]}")
            ax.set_xlabel("step")
            _integer_steps(ax)
            ax.set_ylabel(key, fontsize=7)
            ax.grid(alpha=0.3)
            if plotted:
                ax.legend(fontsize=7)
            else:
                ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
            fig.tight_layout()
            path = out / f"{file_stem}.png"
            fig.savefig(path, dpi=80)
            plt.close(fig)
            written.append(path)
    return written
