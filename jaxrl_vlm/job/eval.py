"""Evaluation: every eval set (`--eval-prompt-data`) through the run's own rollout function and environment, on
the engine's current weights, with the eval sampling settings. It never reaches training.

One eval round = for each set, one call of the `--rollout-function-path` function on the run's `RolloutRun` with
its typed options replaced (`eval_run`: `dataclasses.replace`; a custom rollout function gets the derived run's
slime namespace, `eval_namespace`), in which

* the sampling settings are the eval ones (`--eval-temperature`, `--eval-top-p`, `--eval-top-k`,
  `--eval-max-response-len`, each falling back to the rollout's), and the group size is
  `--n-samples-per-eval-prompt`;
* `rollout_batch_size` is the size of the set, whose prompts the source hands out once, in file order: every
  prompt of the set is one group, once per round;
* there is no dynamic filter, no over-sampling and no partial rollout, and none of slime's training-rollout hooks
  (`TRAINING_ONLY_HOOKS`; `--custom-rm-path` does score eval episodes, as in slime), and no OPD teacher scoring
  (eval episodes never train);
* the driver state (group counter, prompt buffer, carried groups) is a fresh one, and the rollout context is a copy
  with its own (empty) table of suspended episodes: the training rollout's state is neither read nor advanced;
* `rollout_seed` is `eval_seed(rollout_seed, name)`: the run's seed plus a fixed offset, hashed with the set's
  name. The per-request seeds differ from every training request's, and they are the same in every round (group
  indices restart at 0 for each set), so two rounds differ only by their weights (common random numbers) and
  `jaxrl-vlm eval` of a checkpoint repeats the run's own eval of those weights.

Python's and numpy's global random states are saved before a round and restored after it, and the engine's prefix
cache is flushed (the weight sync of the step before flushed it too), so a run with evaluation samples and trains
exactly like the same run without it (tests/test_eval.py holds this).

If a whole group is dropped (every episode FAILED), the driver asks the source for more prompts: it gets the set
again, tagged as a repeat; those repeats run (as training would over-sample) but are not scored. Metrics and the
dump cover the first pass only, so each prompt is scored once.

Metrics of a set `name` are `rollout/metrics.py`'s under `eval/<name>/` (mean reward `eval/<name>/raw_reward`,
`turns/*`, `termination/*`, `truncated_ratio`, `response_len/*`, failures, ...), plus `eval/<name>/pass@k` with
`--log-passrate` and `eval/<name>/prompts`. The main job logs them into metrics.jsonl at the step whose rollout
the evaluated weights sample (run_log.read_metrics), and dumps every sample to
`<output_dir>/eval/<name>/step_<k>.jsonl` in `rollout/dump.py`'s format.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
import math
import random
import tempfile
import time
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Callable

import jax.numpy as jnp
import numpy as np

from jaxrl_vlm.checkpoint import CheckpointError, CheckpointStore, abstract_like
from jaxrl_vlm.config import Config, ConfigError
from jaxrl_vlm.job.assets import EvalSet, load_eval_sets
from jaxrl_vlm.job.session import check_external_engine, rollout_run, rollout_session
from jaxrl_vlm.job.trainer import Trainer
from jaxrl_vlm.models.hf_io import load_hf_config
from jaxrl_vlm.weight_sync import export_version
from rollout.client import EngineError
from rollout.driver import DriverState, RolloutResult, call_rollout_function
from rollout.dump import dump_samples
from rollout.loading import load_function
from rollout.metrics import rollout_metrics
from rollout.options import RolloutOptions
from rollout.run import RolloutRun
from rollout.sample import Sample

logger = logging.getLogger(__name__)

# Eval seeds are the run's rollout seed plus this (a prime), the same in every round.
EVAL_SEED_OFFSET = 1_000_003
# Metadata key of a prompt handed out again after the set was used up (only a group dropped whole asks for more).
EVAL_PASS = "eval_pass"
# slime calls these only in its training rollout (its eval path has its own log function, not offered here).
TRAINING_ONLY_HOOKS = ("dynamic_sampling_filter_path", "buffer_filter_path", "rollout_sample_filter_path",
                       "rollout_all_samples_process_path", "custom_rollout_log_function_path")


# ----------------------------------------------------------------------------- schedule, seeds, settings
def eval_due(cfg: Config, done: int) -> bool:
    """Whether the weights after `done` training steps are evaluated: before training (done 0) unless
    `--skip-eval-before-train`, every `--eval-interval` steps, and at the end. Never without eval sets."""
    e = cfg.eval
    if not e.eval_prompt_data:
        return False
    if done == 0:
        return not e.skip_eval_before_train
    if done == cfg.rollout.num_rollout:
        return True
    return bool(e.eval_interval) and done % e.eval_interval == 0


def eval_seed(rollout_seed: int, set_name: str) -> int:
    """The rollout seed of an eval set, the same in every round: the run's rollout seed plus a fixed offset, hashed
    with the set's name (so two sets sample independently), never the training rollout's seed."""
    key = f"{int(rollout_seed) + EVAL_SEED_OFFSET}:eval:{set_name}".encode()
    seed = int.from_bytes(hashlib.blake2b(key, digest_size=4).digest(), "little") & 0x7FFFFFFF
    return seed if seed != int(rollout_seed) else (seed + 1) & 0x7FFFFFFF


def eval_sampling(cfg: Config) -> dict[str, Any]:
    """The eval sampling settings, as rollout option values (each `--eval-*` falls back to the rollout's)."""
    e, r = cfg.eval, cfg.rollout

    def pick(value: Any, default: Any) -> Any:
        return default if value is None else value

    return {
        "rollout_temperature": pick(e.eval_temperature, r.rollout_temperature),
        "rollout_top_p": pick(e.eval_top_p, r.rollout_top_p),
        "rollout_top_k": pick(e.eval_top_k, r.rollout_top_k),
        "rollout_max_response_len": pick(e.eval_max_response_len, r.rollout_max_response_len),
    }


def eval_options(options: RolloutOptions, cfg: Config, eval_set: EvalSet) -> RolloutOptions:
    """The run's rollout options for one eval set (module docstring): eval sampling, one group per prompt of the
    set, no filter, over-sampling, partial rollout or training-only hook, and the set's eval seed."""
    return dataclasses.replace(
        options, **eval_sampling(cfg), rollout_batch_size=len(eval_set),
        n_samples_per_prompt=cfg.eval.n_samples_per_eval_prompt, over_sampling_batch_size=None, dynamic_filter=None,
        partial_rollout=False, mask_offpolicy_in_partial_rollout=False,
        rollout_seed=eval_seed(cfg.rollout.rollout_seed, eval_set.name), **dict.fromkeys(TRAINING_ONLY_HOOKS))


def eval_run(run: RolloutRun, cfg: Config, eval_set: EvalSet) -> RolloutRun:
    """The run of one eval set: its options (`eval_options`), a fresh driver state, and a copy of the rollout
    context with its own suspended-episode table (the same client, encoder and generate slots). The training run's
    state is neither read nor advanced."""
    return run.derive(options=eval_options(run.options, cfg, eval_set), state=DriverState(),
                      context=dataclasses.replace(run.context, suspended={}, aborting=False, teacher=None))


def eval_namespace(args: Any, cfg: Config, eval_set: EvalSet) -> Any:
    """The slime namespace of `eval_run` for the run `args` describes: what a custom rollout function receives."""
    return eval_run(RolloutRun.from_args(args), cfg, eval_set).args


class EvalPrompts:
    """The prompt source of one eval set: the whole set in file order per call. A call after the first (the
    driver replacing a group it dropped whole) gets the set again, tagged `metadata[EVAL_PASS] = pass`."""

    def __init__(self, eval_set: EvalSet):
        self.eval_set = eval_set
        self.passes = 0

    def next_batch(self) -> list[Sample]:
        batch = self.eval_set.prompts()
        for sample in batch:
            sample.metadata[EVAL_PASS] = self.passes
        self.passes += 1
        return batch


def first_pass(result: RolloutResult) -> RolloutResult:
    """The result restricted to the set's first pass (each prompt scored once; repeats are not scored)."""
    groups = [g for g in result.groups if g and g[0].metadata.get(EVAL_PASS, 0) == 0]
    failed = [s for s in result.failed if s.metadata.get(EVAL_PASS, 0) == 0]
    return dataclasses.replace(result, groups=groups, failed=failed)


# ----------------------------------------------------------------------------- pass@k
def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one prompt with n samples of which c pass: 1 - C(n-c, k) / C(n, k) (needs k <= n)."""
    if not 0 < k <= n:
        raise ValueError(f"pass@{k} needs 1 <= k <= n = {n}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def passrate_ks(n: int) -> list[int]:
    """slime's k values: 1, 2, 4, ... up to n."""
    return [2**i for i in range(int(math.log2(n)) + 1)] if n >= 1 else []


def passrate_metrics(samples: Sequence[Sample], n_per_prompt: int) -> dict[str, float]:
    """`pass@k` for k = 1, 2, 4, ... <= n_per_prompt, averaged over the prompts (groups by `group_index`) that
    have at least k scored samples; a sample passes when its reward is 1 (slime's rule)."""
    groups: dict[int, list[float]] = defaultdict(list)
    for s in samples:
        if s.reward is not None:
            groups[s.group_index].append(float(s.reward))
    out: dict[str, float] = {}
    for k in passrate_ks(n_per_prompt):
        values = [pass_at_k(len(r), sum(1 for x in r if x == 1.0), k) for r in groups.values() if len(r) >= k]
        if values:
            out[f"pass@{k}"] = float(np.mean(values))
    return out


# ----------------------------------------------------------------------------- one round
def eval_set_metrics(name: str, result: RolloutResult, *, num_prompts: int, n_per_prompt: int,
                     passrate: bool) -> dict[str, float]:
    """The metrics of one eval set (`result` already restricted to its first pass), under `eval/<name>/`."""
    prefix = f"eval/{name}/"
    metrics = rollout_metrics(result.samples, result, prefix=prefix)
    metrics[prefix + "prompts"] = float(num_prompts)
    if passrate:
        metrics.update({prefix + k: v for k, v in passrate_metrics(result.samples, n_per_prompt).items()})
    return metrics


async def _flush_engine(client: Any) -> None:
    """Drop the engine's prefix cache (best effort): the next training rollout starts as after a weight sync."""
    for url in client.worker_urls:
        try:
            for _ in range(50):
                if await client.flush_cache(url):
                    break
                await asyncio.sleep(0.1)
            else:
                logger.warning("%s stayed busy: prefix cache not flushed after evaluation", url)
        except EngineError as e:
            logger.warning("flushing %s after evaluation failed: %s", url, e)


class Evaluator:
    """Runs eval rounds of the configured sets with a rollout function (usually the run's own)."""

    def __init__(self, cfg: Config, sets: list[EvalSet], rollout_fn: Callable[..., Any], *,
                 passrate: bool | None = None):
        self.cfg = cfg
        self.sets = sets
        self.rollout_fn = rollout_fn
        self.passrate = cfg.eval.log_passrate if passrate is None else passrate

    async def run(self, run: RolloutRun, step: int, dump_dir: Path | None = None, *,
                  flush_engine: bool = True) -> dict[str, float]:
        """One round on the engine's current weights; returns every set's metrics. With `dump_dir`, each set's
        samples (scored and FAILED) go to `dump_dir/<name>/step_<step>.jsonl`. `flush_engine=False` leaves the
        prefix cache (asynchronous training generates meanwhile, so the engine is never idle to flush, and its
        training does not replay a run without eval anyway)."""
        ctx = run.context
        saved = random.getstate(), np.random.get_state()
        metrics: dict[str, float] = {}
        try:
            for eval_set in self.sets:
                t0 = time.perf_counter()
                one = eval_run(run, self.cfg, eval_set)
                result = await call_rollout_function(self.rollout_fn, one, step, EvalPrompts(eval_set))
                result = first_pass(result)
                metrics.update(eval_set_metrics(eval_set.name, result, num_prompts=len(eval_set),
                                                n_per_prompt=self.cfg.eval.n_samples_per_eval_prompt,
                                                passrate=self.passrate))
                metrics[f"eval/{eval_set.name}/time_s"] = time.perf_counter() - t0
                if dump_dir is not None:
                    dump_samples([*result.samples, *result.failed], Path(dump_dir) / eval_set.name / f"step_{step}.jsonl",
                                 ctx.encoder.tokenizer)
        finally:
            random.setstate(saved[0])
            np.random.set_state(saved[1])
            if flush_engine:
                await _flush_engine(ctx.client)
        return metrics


# ----------------------------------------------------------------------------- the table
def eval_table(metrics: dict[str, float], names: Sequence[str]) -> str:
    """One row per set: samples, mean reward, pass@k, turns, truncated ratio, response length."""
    ks = sorted({int(k.rsplit("@", 1)[1]) for k in metrics if "/pass@" in k})
    header = ["set", "samples", "failed", "mean reward", *(f"pass@{k}" for k in ks), "turns mean", "truncated",
              "response len"]
    rows = [header]
    for name in names:
        p = f"eval/{name}/"

        def cell(key: str, spec: str = ".3f") -> str:
            v = metrics.get(p + key)
            return "-" if v is None or not math.isfinite(v) else format(v, spec)

        rows.append([name, cell("samples", ".0f"), cell("failed_samples", ".0f"), cell("raw_reward"),
                     *(cell(f"pass@{k}") for k in ks), cell("turns/mean", ".2f"), cell("truncated_ratio"),
                     cell("response_len/mean", ".1f")])
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


# ----------------------------------------------------------------------------- jaxrl-vlm eval
@dataclasses.dataclass
class StandaloneEval:
    """What `jaxrl-vlm eval` evaluated and measured."""

    weights: str  # what was evaluated, in words
    step: int  # the checkpoint's step (0 for an HF directory)
    metrics: dict[str, float]
    names: list[str]

    def table(self) -> str:
        return eval_table(self.metrics, self.names)


def sync_dtype(cfg: Config) -> Any:
    """The dtype the run's weight sync exports (so a checkpoint is evaluated with the weights the run served)."""
    return jnp.dtype(cfg.engine.weight_sync_dtype or ("bfloat16" if cfg.engine.engine_url else cfg.model.param_dtype))


def _checkpoint_store_of(ckpt: Path) -> tuple[Path, int | None]:
    """`--load DIR` of `jaxrl-vlm eval` that is not an HF directory: (the checkpoint directory, the step to restore,
    None for its latest), DIR being a checkpoint directory or one step's directory in it (`.../checkpoints/6`).
    Raises CheckpointError, before any model is built, when DIR holds no step."""
    if ckpt.name.isdigit() and (ckpt / "meta").is_dir():
        return ckpt.parent, int(ckpt.name)
    if not any(p.name.isdigit() and p.is_dir() for p in ckpt.iterdir()):
        raise CheckpointError(f"--load {ckpt}: neither an HF model directory (no config.json) nor a checkpoint "
                              "directory of ours (no step in it)")
    return ckpt, None


def _restore_checkpoint(cfg: Config, ckpt: Path, model_dir: Path, out_root: Path) -> tuple[Path, int, str]:
    """Restore one of our checkpoints onto the config's model and export its policy as an HF directory under
    `out_root`; returns (directory, step, weight version). `ckpt` is a checkpoint directory (its latest complete
    step) or one step's directory in it (`.../checkpoints/6`)."""
    store_dir, wanted = _checkpoint_store_of(ckpt)
    trainer = Trainer(cfg)
    trainer.build_policy(model_dir)
    try:
        store = CheckpointStore(store_dir, keep=cfg.checkpoint.keep_checkpoints, read_only=True)
    except (FileNotFoundError, ValueError) as e:
        raise ConfigError(f"--load {ckpt}: not a checkpoint directory ({e})") from e
    try:
        step, state, meta = store.restore(abstract_like(trainer.state), wanted)
    except CheckpointError as e:
        raise ConfigError(f"--load {ckpt}: neither an HF model directory (no config.json) nor a checkpoint of "
                          f"ours: {e}") from e
    finally:
        store.close()
    trainer.state = state
    version = int(meta.get("weight_version", step))
    path = export_version(trainer.policy_model(), out_root, version, dtype=sync_dtype(cfg), copy_from=str(model_dir))
    return path, step, str(version)


async def evaluate_weights(cfg: Config, load: str | None = None, *, dump_dir: Path | None = None) -> StandaloneEval:
    """`jaxrl-vlm eval`: every eval set on the weights of `load` (an HF directory, or a checkpoint directory of
    ours restored onto `--hf-checkpoint`), or on `--hf-checkpoint` itself when `load` is None. pass@k is always
    measured. The engine is the run's (embedded, launched, or `--engine-url`, which is sent the weights)."""
    if not cfg.eval.eval_prompt_data:
        raise ConfigError("jaxrl-vlm eval needs eval sets: --eval-prompt-data NAME PATH[@[start:end]] ...")
    if load is not None and not Path(load).is_dir():
        raise ConfigError(f"--load {load}: no such directory (a checkpoint directory of ours, or an HF model directory)")
    base = Path(cfg.model.hf_checkpoint) if cfg.model.hf_checkpoint else None
    # Exported weights go where the engine can read them (an external SGLang reads --weight-sync-dir).
    root = Path(cfg.engine.weight_sync_dir or cfg.train.output_dir)
    root.mkdir(parents=True, exist_ok=True)
    hf_load = load is not None and (Path(load) / "config.json").exists()
    if not hf_load and (base is None or not (base / "config.json").exists()):
        raise CheckpointError(f"--hf-checkpoint {base}: no config.json (an HF model directory: the model to evaluate, "
                              "or the one the checkpoint was trained from)")
    load_hf_config(Path(load) if hf_load else base)  # a config.json of no known model stops here, before any model
    if load is not None and not hf_load:
        _checkpoint_store_of(Path(load))
    await check_external_engine(cfg)  # it is sent the weights: a vLLM that cannot reload them exactly is refused
    sets = load_eval_sets(cfg)
    rollout_fn = load_function(cfg.rollout.rollout_function_path, "--rollout-function-path")
    with tempfile.TemporaryDirectory(prefix="eval_weights_", dir=root) as tmp:
        step, version = 0, "0"
        if hf_load:
            model_dir = serve_dir = Path(load)
            weights = f"HF directory {load}"
        else:
            model_dir = base
            if load is None:
                serve_dir, weights = base, f"--hf-checkpoint {base}"
            else:
                serve_dir, step, version = _restore_checkpoint(cfg, Path(load), base, Path(tmp))
                weights = f"checkpoint {load} (step {step}, weight version {version})"
        args = cfg.to_namespace()
        evaluator = Evaluator(cfg, sets, rollout_fn, passrate=True)
        async with rollout_session(cfg, model_dir, serve_dir, args, version) as client:
            if cfg.engine.engine_url:  # an external engine serves whatever it loaded last: send it these weights
                await client.sync_weights_from_disk(str(serve_dir), version)
            metrics = await evaluator.run(rollout_run(cfg, args), step, dump_dir)
    return StandaloneEval(weights=weights, step=step, metrics=metrics, names=[s.name for s in sets])
