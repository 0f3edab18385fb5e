"""Episode and turn-level metrics of one rollout step: pure functions over `list[Sample]` (and the driver's result).

Every function returns a flat `dict[str, float]`; `rollout_metrics` prefixes the keys with `rollout/`. Names
follow slime where slime has the metric (reference/slime.md §6): `response_len/{mean,median,max,min}` over the
loss-mask sum, `repetition_frac`, `truncated_ratio`, `zero_std/count_<r>`, `dynamic_filter/drop_<reason>`,
`raw_reward`. The rest is what slime only plans for multi-turn runs: turns per episode, termination causes, env
retries and errors by type, the observation-token share and per-turn latency of the engine vs the environment.

Two populations: *training* metrics (lengths, rewards, repetition, truncation, zero-std groups) describe the
samples that go to the trainer, as slime's do; *episode* metrics (turns, terminations, failures, env, latency,
observation share) also cover the FAILED episodes the driver dropped (`result.failed`), because that is where
environment trouble shows.

This module never imports jax.
"""

from __future__ import annotations

import re
import zlib
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from rollout.failures import failure_report
from rollout.metric_docs import MetricDoc
from rollout.sample import Sample, Status

if TYPE_CHECKING:
    from rollout.driver import RolloutResult

# slime's metric_utils.has_repetition: a response over 10,000 characters whose last 10,000 characters compress
# more than 10x under zlib level 9.
REPETITION_MIN_CHARS = 10_000
REPETITION_MIN_RATIO = 10.0

_ENV_ERROR = re.compile(r"^attempt \d+: (?:(?P<timeout>env\.step timed out)|(?P<type>[A-Za-z_][\w.]*):)")


# ----------------------------------------------------------------------------- the catalogue of names
# `rollout_metrics`' names, without their prefix (`rollout/` for the training rollout, `eval/<set>/` for an eval set).
# Episodes: the step's finished episodes, FAILED ones included; samples: those that go to the trainer.
ROLLOUT_METRICS: tuple[MetricDoc, ...] = (
    MetricDoc("samples", "count", "Samples that go to the trainer (scored, not FAILED)."),
    MetricDoc("episodes", "count", "Episodes that finished this step, FAILED ones included."),
    MetricDoc("turns/mean", "mean over episodes", "Model turns that produced tokens, per episode."),
    MetricDoc("turns/max", "max over episodes", "Most model turns of one episode."),
    MetricDoc("turns/count_<k>", "count", "Episodes with k model turns (a histogram)."),
    MetricDoc("termination/<cause>", "fraction of episodes",
              "Share of episodes that ended by this cause (env_done, max_turns, truncated/<why>, a failure cause)."),
    MetricDoc("failed/total", "count", "FAILED episodes (dropped from their group)."),
    MetricDoc("failed/<cause>", "count", "FAILED episodes by cause (engine_lost, env_error, env_timeout, ...)."),
    MetricDoc("env/retries", "sum over turns", "Retries of env.step."),
    MetricDoc("env/turns_with_retry", "count", "Turns whose env.step needed a retry."),
    MetricDoc("env/retries_per_turn", "mean over env-stepped turns", "Retries of env.step per turn."),
    MetricDoc("env/errors/<type>", "count", "Env errors by exception class (or timeout, reset_failed)."),
    MetricDoc("obs_token_frac", "ratio of sums over episodes", "Observation tokens / all response tokens."),
    MetricDoc("obs_tokens", "sum over episodes", "Response tokens that came from the environment (loss mask 0)."),
    MetricDoc("response_tokens", "sum over episodes", "Response tokens, model and observation."),
    MetricDoc("offpolicy_masked_tokens", "sum over episodes",
              "Model tokens whose loss mask was zeroed when a partial rollout resumed them."),
    MetricDoc("latency/engine_s/<stat>", "mean, p50, p90 over turns",
              "Seconds per turn in the engine's /generate, waiting for a slot included."),
    MetricDoc("latency/env_s/<stat>", "mean, p50, p90 over turns", "Seconds per turn in env.step, retries included."),
    MetricDoc("response_len/<stat>", "mean, median, max, min over samples",
              "Model tokens per sample (the loss-mask sum; slime's response_len)."),
    MetricDoc("response_len_with_obs/<stat>", "mean, median, max, min over samples",
              "Response tokens per sample, observations included."),
    MetricDoc("raw_reward", "mean over samples", "Reward (slime's raw_reward; after --custom-reward-post-process-path "
              "its raw rewards)."),
    MetricDoc("raw_reward_std", "population std over samples", "Spread of the rewards."),
    MetricDoc("zero_std/count_<r>", "count", "Groups whose rewards all equal r (rounded to 0.1): no advantage signal."),
    MetricDoc("zero_std/groups", "count", "Groups whose rewards are all equal."),
    MetricDoc("repetition_frac", "fraction of samples", "Responses that repeat themselves (slime's has_repetition)."),
    MetricDoc("truncated_ratio", "fraction of samples", "Samples whose episode was TRUNCATED."),
    MetricDoc("removed_samples", "count", "Samples a --rollout-sample-filter-path hook left out of the loss."),
    MetricDoc("dynamic_filter/drop_<reason>", "count", "Groups the dynamic filter (or a stale-group policy) dropped, "
              "by reason."),
    MetricDoc("groups_kept", "count", "Groups that go to the trainer."),
    MetricDoc("groups_submitted", "count", "Groups the driver submitted for this step."),
    MetricDoc("failed_samples", "count", "FAILED samples the driver dropped."),
    MetricDoc("failed_share", "fraction of episodes", "FAILED share of the finished episodes."),
    MetricDoc("filtered_long_prompts", "count", "Prompts skipped this step for --rollout-max-prompt-len."),
    MetricDoc("filtered_long_prompts_total", "running total", "Prompts skipped for --rollout-max-prompt-len so far."),
)

# `multi_turn_metrics`' names (slime's --log-multi-turn), written as they are.
MULTI_TURN_METRICS: tuple[MetricDoc, ...] = (
    MetricDoc("multi_turn/raw_response_length/response_length_clip_ratio", "fraction of samples",
              "Samples whose response (observations included) reached --rollout-max-response-len."),
    MetricDoc("multi_turn/raw_response_length/response_length_<stat>", "mean, max, min over samples",
              "Response tokens per sample, observations included."),
    MetricDoc("multi_turn/wo_obs_response_length/response_length_<stat>", "mean, max, min over samples",
              "Model tokens per sample."),
)


# ----------------------------------------------------------------------------- per-sample facts
def num_model_turns(sample: Sample) -> int:
    """Model turns that produced tokens. A turn resumed after an abort shares its index: counted once."""
    generated: dict[int, int] = defaultdict(int)
    for record in sample.turns:
        generated[record.turn] += record.generated_tokens
    return sum(1 for n in generated.values() if n > 0)


def offpolicy_masked_tokens(sample: Sample) -> int:
    """Model tokens whose loss mask the driver zeroed when resuming a partial rollout (`offpolicy_masked_runs`)."""
    return sum(int(n) for _, n in sample.metadata.get("offpolicy_masked_runs", ()))


def observation_tokens(sample: Sample) -> int:
    """Response tokens that came from the environment/template (mask 0 and not masked off-policy model tokens)."""
    return sample.response_length - sum(sample.loss_mask) - offpolicy_masked_tokens(sample)


def compression_ratio(text: str) -> float:
    """UTF-8 bytes over zlib level-9 compressed bytes (inf for the empty string, as slime)."""
    raw = text.encode("utf-8")
    if not raw:
        return float("inf")
    return len(raw) / len(zlib.compress(raw, 9))


def has_repetition(text: str) -> bool:
    """slime's definition: longer than 10,000 chars and the last 10,000 chars compress more than 10x."""
    return len(text) > REPETITION_MIN_CHARS and compression_ratio(text[-REPETITION_MIN_CHARS:]) > REPETITION_MIN_RATIO


def env_error_type(message: str) -> str:
    """The failure type of one `metadata["env_errors"]` entry: the exception class, `timeout` or `reset_failed`."""
    if message.startswith("env.reset failed"):
        return "reset_failed"
    m = _ENV_ERROR.match(message)
    if m is None:
        return "other"
    return "timeout" if m.group("timeout") else m.group("type").rsplit(".", 1)[-1]


# ----------------------------------------------------------------------------- small statistics
def summary(values: Sequence[float], name: str) -> dict[str, float]:
    """`name/{mean,median,max,min}` (slime's compute_statistics); empty input gives no keys."""
    if not values:
        return {}
    v = np.asarray(values, dtype=np.float64)
    return {f"{name}/mean": float(v.mean()), f"{name}/median": float(np.median(v)),
            f"{name}/max": float(v.max()), f"{name}/min": float(v.min())}


def latency_summary(values: Sequence[float], name: str) -> dict[str, float]:
    """`name/{mean,p50,p90}` in seconds (linear-interpolated percentiles); empty input gives no keys."""
    if not values:
        return {}
    v = np.asarray(values, dtype=np.float64)
    return {f"{name}/mean": float(v.mean()), f"{name}/p50": float(np.percentile(v, 50)),
            f"{name}/p90": float(np.percentile(v, 90))}


def _key(text: str) -> str:
    """A metric-name-safe form of a free-form name (a drop reason, an exception class)."""
    return re.sub(r"[^\w/.-]+", "_", text.replace(":", "/"))


def termination_name(sample: Sample) -> str:
    """The metric name of how an episode ended (`env_done`, `truncated/length`, ...; `unknown` when unset)."""
    return "unknown" if sample.termination is None else sample.termination.metric_name


# ----------------------------------------------------------------------------- metric groups
def turn_metrics(samples: Sequence[Sample]) -> dict[str, float]:
    """`turns/{mean,max}` and the histogram `turns/count_<k>` (episodes with k model turns)."""
    if not samples:
        return {}
    turns = [num_model_turns(s) for s in samples]
    out = {"turns/mean": float(np.mean(turns)), "turns/max": float(max(turns))}
    for k, count in sorted(Counter(turns).items()):
        out[f"turns/count_{k}"] = float(count)
    return out


def termination_metrics(samples: Sequence[Sample]) -> dict[str, float]:
    """Fraction of episodes per termination (`Sample.termination`), and FAILED episodes counted by cause."""
    if not samples:
        return {}
    causes = Counter(termination_name(s) for s in samples)
    out = {f"termination/{c}": n / len(samples) for c, n in sorted(causes.items())}
    failed = Counter(termination_name(s) for s in samples if s.status is Status.FAILED)
    out["failed/total"] = float(sum(failed.values()))
    for cause, n in sorted(failed.items()):
        out[f"failed/{cause}"] = float(n)
    return out


def env_metrics(samples: Sequence[Sample]) -> dict[str, float]:
    """Env retries (total, per env-stepped turn, turns that needed one) and env errors counted by type."""
    if not samples:
        return {}
    records = [r for s in samples for r in s.turns]
    stepped = [r for r in records if r.env_latency_s > 0]
    retries = sum(r.env_retries for r in records)
    out = {
        "env/retries": float(retries),
        "env/turns_with_retry": float(sum(1 for r in records if r.env_retries > 0)),
    }
    if stepped:
        out["env/retries_per_turn"] = sum(r.env_retries for r in stepped) / len(stepped)
    types = Counter(env_error_type(str(e)) for s in samples for e in s.metadata.get("env_errors", ()))
    for kind, n in sorted(types.items()):
        out[f"env/errors/{_key(kind)}"] = float(n)
    return out


def token_metrics(samples: Sequence[Sample]) -> dict[str, float]:
    """Observation-token share of all response tokens (with its totals)."""
    if not samples:
        return {}
    obs = sum(observation_tokens(s) for s in samples)
    total = sum(s.response_length for s in samples)
    return {
        "obs_token_frac": obs / total if total else 0.0,
        "obs_tokens": float(obs),
        "response_tokens": float(total),
        "offpolicy_masked_tokens": float(sum(offpolicy_masked_tokens(s) for s in samples)),
    }


def latency_metrics(samples: Sequence[Sample]) -> dict[str, float]:
    """Per-turn seconds in the engine (`/generate` incl. waiting for a slot) vs in `env.step` (incl. retries)."""
    records = [r for s in samples for r in s.turns]
    engine = [r.engine_latency_s for r in records if r.finish_reason is not None]
    env = [r.env_latency_s for r in records if r.env_latency_s > 0]
    return {**latency_summary(engine, "latency/engine_s"), **latency_summary(env, "latency/env_s")}


def length_metrics(samples: Sequence[Sample]) -> dict[str, float]:
    """slime's `response_len/*` over the loss-mask sum, and `response_len_with_obs/*` over all response tokens."""
    return {
        **summary([float(sum(s.loss_mask)) for s in samples], "response_len"),
        **summary([float(s.response_length) for s in samples], "response_len_with_obs"),
    }


def repetition_frac(samples: Sequence[Sample]) -> float:
    """Fraction of samples whose decoded response `has_repetition` (slime's `repetition_frac`)."""
    return float(np.mean([has_repetition(s.response) for s in samples])) if samples else 0.0


def reward_metrics(samples: Sequence[Sample]) -> dict[str, float]:
    """Mean (`raw_reward`, slime's name) and population std of the rewards that are set."""
    rewards = [float(s.reward) for s in samples if s.reward is not None]
    if not rewards:
        return {}
    return {"raw_reward": float(np.mean(rewards)), "raw_reward_std": float(np.std(rewards))}


def zero_std_metrics(samples: Sequence[Sample]) -> dict[str, float]:
    """slime's `zero_std/count_<r>`: groups (by `group_index`) whose rewards are all equal to r (rounded to 0.1)."""
    groups: dict[int, list[float]] = defaultdict(list)
    for s in samples:
        if s.reward is not None:
            groups[s.group_index].append(float(s.reward))
    zero = Counter(str(round(r[0], 1)) for r in groups.values() if all(x == r[0] for x in r))
    out = {f"zero_std/count_{r}": float(n) for r, n in sorted(zero.items())}
    out["zero_std/groups"] = float(sum(zero.values()))
    return out


def dropped_metrics(result: "RolloutResult") -> dict[str, float]:
    """The driver's accounting: `dynamic_filter/drop_<reason>` counts, groups kept and submitted, failed samples
    and their share of the finished episodes, prompts skipped for `--rollout-max-prompt-len` (this step and
    over the run)."""
    out = {f"dynamic_filter/drop_{_key(reason)}": float(n) for reason, n in sorted(result.dropped.items())}
    out["groups_kept"] = float(len(result.groups))
    out["groups_submitted"] = float(result.groups_submitted)
    out["failed_samples"] = float(len(result.failed))
    out["failed_share"] = failure_report(result).share
    out["filtered_long_prompts"] = float(result.filtered_long_prompts)
    out["filtered_long_prompts_total"] = float(result.filtered_long_prompts_total)
    return out


def _unique(samples: Iterable[Sample]) -> list[Sample]:
    seen: set[int] = set()
    out = []
    for s in samples:
        if id(s) not in seen:
            seen.add(id(s))
            out.append(s)
    return out


def multi_turn_metrics(samples: Sequence[Sample], max_response_len: int) -> dict[str, float]:
    """slime's `--log-multi-turn` lengths, under its names: the raw response (model and observation tokens) and
    the model's own tokens, with the share of samples whose raw response reached the budget."""
    if not samples:
        return {}
    raw = np.array([s.response_length for s in samples], np.float64)
    own = np.array([sum(s.loss_mask) for s in samples], np.float64)
    out = {}
    for name, lengths in (("raw_response_length", raw), ("wo_obs_response_length", own)):
        out[f"multi_turn/{name}/response_length_mean"] = float(lengths.mean())
        out[f"multi_turn/{name}/response_length_max"] = float(lengths.max())
        out[f"multi_turn/{name}/response_length_min"] = float(lengths.min())
    out["multi_turn/raw_response_length/response_length_clip_ratio"] = float(np.mean(raw >= max_response_len))
    return out


def rollout_metrics(
    samples: Sequence[Sample], result: "RolloutResult | None" = None, *, prefix: str = "rollout/"
) -> dict[str, float]:
    """All metrics of one rollout step as `{prefix + name: value}`.

    `samples`: the training samples (usually `result.samples`). With `result`, episode metrics also cover
    `result.failed`, and the driver's drop counts are added. A `--custom-rollout-log-function-path` hook that
    returned True leaves only the metrics it added (`result.hook_metrics`, logged under the names it gave).
    """
    hook_metrics = dict(result.hook_metrics) if result is not None else {}
    if result is not None and result.skip_default_log:
        return hook_metrics
    samples = list(samples)
    episodes = _unique([*samples, *(result.failed if result is not None else ())])
    out: dict[str, float] = {"samples": float(len(samples)), "episodes": float(len(episodes))}
    out.update(turn_metrics(episodes))
    out.update(termination_metrics(episodes))
    out.update(env_metrics(episodes))
    out.update(token_metrics(episodes))
    out.update(latency_metrics(episodes))
    out.update(length_metrics(samples))
    out.update(reward_metrics(samples))
    out.update(zero_std_metrics(samples))
    if samples:
        out["repetition_frac"] = repetition_frac(samples)
        out["truncated_ratio"] = float(np.mean([s.status is Status.TRUNCATED for s in samples]))
        # Samples a --rollout-sample-filter-path hook left out of the loss (slime's remove_sample).
        out["removed_samples"] = float(sum(s.remove_sample for s in samples))
    if result is not None:
        out.update(dropped_metrics(result))
    return {**{prefix + k: float(v) for k, v in out.items()}, **hook_metrics}
