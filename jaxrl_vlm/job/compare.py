"""`jaxrl-vlm compare-losses`: train several loss variants on the same saved rollouts, from the same weights, and
compare them in one table and one plot per metric.

A comparison of losses on fresh rollouts mixes each variant's effect with sampling noise. Here every variant
replays the same steps (`--load-debug-rollout-data`, saved by a run with `--save-debug-rollout-data`): the same
samples, rewards and batches, from the same start (`--hf-checkpoint`, or the `--load` checkpoint), with a fresh
optimizer. Only the loss differs, and whatever else the variant sets.

A variant is a base config plus changes, given as

* `NAME=FLAGS`: flags as on the command line (`gspo=--policy-loss gspo`, `reinforce=--loss-type custom_loss
  --custom-loss-function-path configs/hooks/custom_loss.py:reinforce`, `baseline=` for the base config itself);
* `PATH.yaml` or `NAME=PATH.yaml`: a config mapping (nested by section or flat, as a run's YAML), named after the
  file unless NAME is given.

Each variant trains in `OUT/runs/NAME/` (metrics.jsonl, checkpoints, final_model) as a replay: no engine. With
eval sets (`--eval-prompt-data`), the start weights and each variant's weights at the run's eval schedule (before
training unless `--skip-eval-before-train`, every `--eval-interval`, and the final weights) are evaluated
afterwards with the run's engine (embedded unless `--engine-url`), and logged into the variant's metrics.jsonl as
a run logs its evals.

Output in OUT: `comparison.md` (printed too) and `comparison.csv`, one row per variant with the mean over steps
and the last step's value of each metric, and `plots/<metric>.png` with one curve per variant: loss, policy-gradient
loss, clip fraction, drift from the behaviour policy (mean |log p_train - log p_rollout| of the trained tokens, the
replay's off-policyness), grad norm, entropy, and the eval reward of each set.
"""

from __future__ import annotations

import asyncio
import copy
import csv
import io
import logging
import math
import re
import shlex
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jaxrl_vlm.checkpoint import CheckpointStore
from jaxrl_vlm.config import Config, ConfigError, load_config, read_yaml
from jaxrl_vlm.job.assets import load_eval_sets, prepare_eval_data, prepare_model
from jaxrl_vlm.job.eval import eval_due, evaluate_weights
from jaxrl_vlm.job.replay import RolloutReplay
from jaxrl_vlm.job.run import train
from jaxrl_vlm.job.run_log import RunLog, plot_runs, read_metrics
from rollout.rollout_data import RolloutDataError, read_rollout_data, step_path

logger = logging.getLogger(__name__)

# {file stem: (metric key or fnmatch pattern, title)}: the table's metrics and the plots, in order.
LOSS_METRICS: dict[str, tuple[str, str]] = {
    "loss": ("train/loss_total", "loss"),
    "pg_loss": ("train/pg_loss", "policy-gradient loss"),
    "clip_fraction": ("train/pg_clipfrac", "clip fraction"),
    "behaviour_drift": ("train/train_rollout_logprob_abs_diff",
                        "drift from the behaviour policy: mean |log p_train - log p_rollout|"),
    "grad_norm": ("train/grad_norm", "grad norm (before clipping)"),
    "entropy": ("train/entropy_loss", "entropy"),
    "eval_reward": ("eval/*/raw_reward", "eval mean reward"),
}

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
# Settings every variant must share with the base: the saved rollouts and the start weights.
_SHARED = (("debug", "load_debug_rollout_data"), ("model", "hf_checkpoint"), ("checkpoint", "load"),
           ("checkpoint", "load_step"))


@dataclass(frozen=True)
class LossVariant:
    """One variant: its name, and the changes to the base config (flags, and/or a config mapping from a YAML)."""

    name: str
    flags: tuple[str, ...] = ()
    mapping: dict[str, Any] = field(default_factory=dict)
    source: str = ""  # how it was given, for the table

    @property
    def description(self) -> str:
        return self.source or " ".join(self.flags) or "(base config)"


def parse_variant(spec: str) -> LossVariant:
    """`NAME=FLAGS`, `PATH.yaml` or `NAME=PATH.yaml` (module docstring); raises ConfigError naming the spec."""
    name, eq, rest = spec.partition("=")
    if not eq:
        name, rest = "", spec
    rest = rest.strip()
    if rest.endswith((".yaml", ".yml")) and " " not in rest:
        path = Path(rest)
        if not path.is_file():
            raise ConfigError(f"--variant {spec!r}: {rest} does not exist")
        name = name or path.stem
        mapping = read_yaml(path)
        variant = LossVariant(name, (), mapping, f"{rest}: " + ", ".join(f"{k}={v}" for k, v in _flat_items(mapping)))
    elif not eq:
        raise ConfigError(f"--variant {spec!r}: give NAME=FLAGS (e.g. 'gspo=--policy-loss gspo'), a variant YAML "
                          "file, or NAME=FILE.yaml")
    else:
        try:
            flags = tuple(shlex.split(rest))
        except ValueError as e:
            raise ConfigError(f"--variant {spec!r}: cannot split the flags ({e})") from None
        variant = LossVariant(name, flags, {}, " ".join(flags))
    if not _NAME.match(variant.name):
        raise ConfigError(f"--variant {spec!r}: the name {variant.name!r} must be a word of letters, digits, '_', '.', "
                          "'-' (it names the variant's directory and its curve)")
    return variant


def _flat_items(mapping: dict[str, Any]) -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    for key, value in mapping.items():
        if isinstance(value, dict):
            out.extend((f"{key}.{k}", v) for k, v in _flat_items(value))
        else:
            out.append((key, value))
    return out


# ----------------------------------------------------------------------------- configs
def variant_config(base_path: str | None, base_argv: Sequence[str], variant: LossVariant, run_dir: Path,
                   *, base: Config) -> Config:
    """The variant's resolved config: base file <- base flags <- the variant's flags <- its mapping <- where it
    writes (its run directory, its own checkpoints, nothing saved again). Raises ConfigError when the variant
    changes what all variants must share (the saved rollouts, the start weights)."""
    where = {"output_dir": str(run_dir), "save": str(run_dir / "checkpoints"), "save_debug_rollout_data": None}
    cfg = load_config(base_path, [*base_argv, *variant.flags],
                      overlays=[(f"variant {variant.name}", variant.mapping), ("compare-losses", where)])
    for section, key in _SHARED:
        mine, theirs = getattr(getattr(cfg, section), key), getattr(getattr(base, section), key)
        if mine != theirs:
            raise ConfigError(f"variant {variant.name}: changes {key} ({theirs!r} -> {mine!r}); every variant replays "
                              "the same rollouts from the same weights, so set it in the base config")
    return cfg


def _training_config(cfg: Config, eval_steps: list[int]) -> Config:
    """The replay's own config: no eval during the run (a replay has no engine; compare-losses evaluates after),
    and a checkpoint at every eval step so those weights can be evaluated."""
    train_cfg = copy.deepcopy(cfg)
    train_cfg.eval.eval_prompt_data, train_cfg.eval.eval_interval = [], None
    if eval_steps:
        train_cfg.checkpoint.save_interval = cfg.eval.eval_interval or 0
        train_cfg.checkpoint.keep_checkpoints = len(eval_steps) + 1
    return train_cfg


# ----------------------------------------------------------------------------- the comparison
@dataclass
class Comparison:
    """What `compare_losses` wrote: the run directory of each variant, the table files and the plots."""

    variants: list[LossVariant]
    run_dirs: list[Path]
    table_md: Path
    table_csv: Path
    plots: list[Path]
    markdown: str


def compare_losses(base_path: str | None, base_argv: Sequence[str], variants: Sequence[LossVariant],
                   out_dir: str | Path, *, devices: list[Any] | None = None) -> Comparison:
    """Train every variant on the base config's saved rollouts (`--load-debug-rollout-data`) from the same start,
    evaluate them when eval sets are given, and write the table and the plots under `out_dir`."""
    out = Path(out_dir)
    base = load_config(base_path, list(base_argv))
    if base.debug.load_debug_rollout_data is None:
        raise ConfigError("compare-losses trains on saved rollouts: add --load-debug-rollout-data PATH (the "
                          "--save-debug-rollout-data PATH of the run that made them)")
    if not variants:
        raise ConfigError("compare-losses needs at least one --variant")
    names = [v.name for v in variants]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ConfigError(f"compare-losses: variant names must differ, {repeated} repeat")
    run_dirs = [out / "runs" / v.name for v in variants]
    used = [str(d) for d in run_dirs if d.exists() and any(d.iterdir())]
    if used:  # a variant's metrics and checkpoints would mix with an earlier comparison's
        raise ConfigError(f"compare-losses: {', '.join(used)} already hold a run; choose another --out or remove them")
    cfgs = [variant_config(base_path, base_argv, v, d, base=base) for v, d in zip(variants, run_dirs)]
    start = _start_step(base)
    _preflight(cfgs, start)
    # Each variant's eval schedule (before training, every --eval-interval, its last step), from its own config.
    eval_steps = [[s for s in range(start, cfg.rollout.num_rollout + 1) if eval_due(cfg, s)] for cfg in cfgs]
    for cfg, steps in zip(cfgs, eval_steps):
        if steps:  # eval sets that cannot be read fail now, not after every variant trained
            prepare_model(cfg)
            prepare_eval_data(cfg)
            load_eval_sets(cfg)

    for variant, cfg, steps in zip(variants, cfgs, eval_steps):
        logger.info("compare-losses: training variant %s (%s)", variant.name, variant.description)
        train(_training_config(cfg, steps), devices=devices)
    start_metrics: dict[str, float] | None = None  # the shared start, evaluated once (the first variant's eval sets)
    for cfg, run_dir, steps in zip(cfgs, run_dirs, eval_steps):
        if not steps:
            continue
        log = RunLog(run_dir, total_steps=cfg.rollout.num_rollout)
        try:
            for step in steps:
                if step == start and start_metrics is None:
                    start_cfg = copy.deepcopy(cfg)
                    start_cfg.train.output_dir = str(out / "start_eval")
                    start_metrics = _evaluate(start_cfg, _start_weights(base), out / "start_eval" / "eval")
                metrics = start_metrics if step == start else _evaluate(
                    cfg, str(run_dir / "checkpoints" / str(step)), run_dir / "eval")
                log.log_eval(step, metrics)
        finally:
            log.close()

    rows = [comparison_row(v, read_metrics(d / "metrics.jsonl")) for v, d in zip(variants, run_dirs)]
    markdown = markdown_table(rows)
    out.mkdir(parents=True, exist_ok=True)
    table_md, table_csv = out / "comparison.md", out / "comparison.csv"
    table_md.write_text(markdown + "\n")
    table_csv.write_text(csv_table(rows))
    plots = plot_runs(run_dirs, out / "plots", plots=LOSS_METRICS, labels=names, skip_empty=True)
    return Comparison(list(variants), run_dirs, table_md, table_csv, plots, markdown)


def _preflight(cfgs: Sequence[Config], start: int) -> None:
    """Every variant can replay every step it trains (the files exist, the settings fit), before any trains."""
    first = step_path(cfgs[0].debug.load_debug_rollout_data, start)
    try:
        settings = read_rollout_data(first, rollout_id=start).settings
    except RolloutDataError as e:
        raise ConfigError(f"--load-debug-rollout-data: {e}") from e
    for cfg in cfgs:
        replay = RolloutReplay(cfg)
        replay.check_available(start, cfg.rollout.num_rollout)
        replay.check_settings(settings, first)


def _start_step(cfg: Config) -> int:
    """The step the replays start from: 0, or that of the `--load` checkpoint they all resume."""
    if not cfg.checkpoint.load:
        return 0
    if cfg.checkpoint.load_step is not None:
        return cfg.checkpoint.load_step
    store = CheckpointStore(cfg.checkpoint.load, keep=cfg.checkpoint.keep_checkpoints, read_only=True)
    try:
        return store.latest_step() or 0
    finally:
        store.close()


def _start_weights(cfg: Config) -> str | None:
    """What `jaxrl-vlm eval` loads for the shared start: the `--load` checkpoint (its step), or None for the
    `--hf-checkpoint` itself."""
    if not cfg.checkpoint.load:
        return None
    return str(Path(cfg.checkpoint.load) / str(cfg.checkpoint.load_step)) if cfg.checkpoint.load_step is not None \
        else cfg.checkpoint.load


def _evaluate(cfg: Config, load: str | None, dump_dir: Path) -> dict[str, float]:
    """`jaxrl-vlm eval` of `load` (None: the start model): the eval metrics, as a run logs them."""
    t0 = time.perf_counter()
    report = asyncio.run(evaluate_weights(cfg, load, dump_dir=dump_dir))
    return {**report.metrics, "perf/eval_time": time.perf_counter() - t0}


# ----------------------------------------------------------------------------- the table
def comparison_row(variant: LossVariant, records: list[dict[str, Any]]) -> dict[str, Any]:
    """One variant's row: its name and changes, the steps trained, and per metric the mean over the steps and the
    last step's value (None where the loss does not log it); per eval set the first and last eval reward."""
    trained = [r for r in records if "train/loss_total" in r]
    row: dict[str, Any] = {"variant": variant.name, "changes": variant.description, "steps": len(trained)}
    for stem, (key, _) in LOSS_METRICS.items():
        if "*" in key:
            continue
        values = [r[key] for r in trained if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
        row[f"{stem} mean"] = sum(values) / len(values) if values else None
        row[f"{stem} last"] = values[-1] if values and key in trained[-1] else None
    sets = sorted({k.split("/")[1] for r in records for k in r if k.startswith("eval/") and k.endswith("/raw_reward")})
    for name in sets:
        points = [r[f"eval/{name}/raw_reward"] for r in records if f"eval/{name}/raw_reward" in r]
        row[f"eval {name} start"] = points[0]
        row[f"eval {name} final"] = points[-1]
    return row


def _columns(rows: Sequence[dict[str, Any]]) -> list[str]:
    columns: list[str] = []
    for row in rows:
        columns.extend(c for c in row if c not in columns)
    return columns


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return "nan" if not math.isfinite(value) else format(value, ".4g")
    return str(value)


def markdown_table(rows: Sequence[dict[str, Any]]) -> str:
    columns = _columns(rows)
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    for row in rows:
        lines.append("| " + " | ".join(_cell(row.get(c)).replace("|", "\\|") for c in columns) + " |")
    return "\n".join(lines)


def csv_table(rows: Sequence[dict[str, Any]]) -> str:
    """The rows as CSV, full precision (repr of each float), empty where a metric is absent."""
    columns = _columns(rows)
    buf = io.StringIO()
    writer = csv.writer(buf)
    writer.writerow(columns)
    for row in rows:
        writer.writerow(["" if row.get(c) is None else repr(row[c]) if isinstance(row[c], float) else row[c]
                         for c in columns])
    return buf.getvalue()
