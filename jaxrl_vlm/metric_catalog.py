"""The catalogue of the metric names a run writes to `metrics.jsonl` (and to TensorBoard / wandb), by family.

Families whose names are written by one module are declared there (`rollout/metrics.py`: the rollout's episode
metrics; `rl/metrics.py`: the train step's); this module composes them. The records the job assembles around them
(timings, batch shapes, evaluation, asynchronous training, weight sync, engine outages) are declared here: the
reference generator (`jaxrl_vlm/docgen.py`) renders this catalogue and must not import the job (DESIGN.md §3).

`tests/test_main_job.py` checks that every key of a real run's records matches an entry, so a new metric that is
not declared here (or at its family's home) fails the suite.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from jaxrl_vlm.rl.metrics import TRAIN_METRICS
from rollout.metric_docs import MetricDoc
from rollout.metrics import MULTI_TURN_METRICS, ROLLOUT_METRICS


@dataclass(frozen=True)
class MetricFamily:
    """Metrics of one kind: a title, the modules that write them (repository paths), a note on how to read them, the
    metrics, and `restated`: names the note describes as another family's under a prefix (matched, not listed)."""

    title: str
    written_by: tuple[str, ...]
    note: str
    metrics: tuple[MetricDoc, ...]
    restated: tuple[MetricDoc, ...] = ()


_RECORD = (
    MetricDoc("step", "-", "Training steps done before this record's rollout (eval records: steps trained)."),
    MetricDoc("time", "-", "Unix time the record was written."),
    MetricDoc("weight_version", "-", "Weight version that sampled the step's rollout (or that an eval record saw)."),
    MetricDoc("resumed_at_step", "-", "A resume marker: what the interrupted run logged from this step on is "
              "replaced."),
)

_PERF = (
    MetricDoc("perf/rollout_time", "seconds of the step", "Generating the step's groups (asynchronous training: the "
              "trainer's wait for them)."),
    MetricDoc("perf/train_time", "seconds of the step", "The optimizer steps of the step."),
    MetricDoc("perf/update_weights_time", "seconds of the step", "Exporting and loading new weights into the engine."),
    MetricDoc("perf/release_memory_time", "seconds of the step", "--colocate: the engine releasing and resuming its "
              "memory."),
    MetricDoc("perf/step_time", "seconds of the step", "The whole step."),
    MetricDoc("perf/eval_time", "seconds of the round", "One evaluation round, every set."),
    MetricDoc("perf/host_peak_rss_gib", "peak so far", "The process's peak resident memory (GiB)."),
    MetricDoc("perf/device_peak_gib", "max over the trainer's devices", "Allocator high-water mark (GiB; GPU/TPU)."),
)

_BATCH = (
    MetricDoc("train/optimizer_steps", "count", "Optimizer steps of this rollout."),
    MetricDoc("batch/padding_efficiency", "mean over the step's batches", "Real tokens / token slots."),
    MetricDoc("batch/rows_per_micro_batch", "of the first batch", "Rows of one micro-batch."),
    MetricDoc("batch/real_tokens", "sum over the step's batches", "Tokens trained (padding excluded)."),
    MetricDoc("train/vision_images", "sum over the step's batches", "Image occurrences in the trained samples."),
    MetricDoc("train/vision_images_distinct", "sum over the step's batches", "Images the vision tower encodes: "
              "distinct per micro-batch with --vision-reuse (on by default), else every copy."),
    MetricDoc("train/vision_clips", "sum over the step's batches", "Clip (video) occurrences in the trained samples."),
    MetricDoc("train/vision_clips_distinct", "sum over the step's batches", "Clips the vision tower encodes: "
              "distinct per micro-batch with --vision-reuse, else every copy."),
    MetricDoc("batch/compiled_programs", "running total", "Train-step programs compiled so far (one per shape)."),
)

_ADVANTAGES = (
    MetricDoc("rollout/advantages", "mean over samples", "Advantage (slime's rollout/advantages)."),
    MetricDoc("rollout/advantage_abs_mean", "mean over samples", "|advantage|."),
    MetricDoc("rollout/rewards", "mean over samples", "Rewards a --custom-reward-post-process-path hook returned."),
    MetricDoc("rollout/kl_penalty_mean", "mean over samples", "--kl-coef: the KL penalty taken off the reward."),
    MetricDoc("rollout/shaped_reward_mean", "mean over samples", "--kl-coef: the reward after the penalty."),
    MetricDoc("rollout/samples_without_weight_version", "count", "Samples whose tokens carry no weight version."),
)

_EVAL = (
    MetricDoc("eval/<set>/prompts", "count", "Prompts of the eval set."),
    MetricDoc("eval/<set>/pass@<k>", "mean over prompts", "--log-passrate: pass@k (reward 1 passes)."),
    MetricDoc("eval/<set>/time_s", "seconds", "Evaluating this set."),
    MetricDoc("eval/<set>/nll", "per token", "--loss-type sft_loss: held-out NLL per assistant token."),
    MetricDoc("eval/<set>/tokens", "sum", "--loss-type sft_loss: held-out assistant tokens."),
    MetricDoc("eval/<set>/conversations", "count", "--loss-type sft_loss: held-out conversations."),
    MetricDoc("passrate/pass@<k>", "mean over prompts", "--log-passrate: pass@k of the training groups."),
)

_SFT = (
    MetricDoc("sft/conversations", "count", "Conversations trained this step."),
    MetricDoc("sft/epoch", "-", "Epochs of the dataset done (fractional)."),
)

_ASYNC = (
    MetricDoc("async/overlap_fraction", "of the step", "Share of the training time during which groups generated."),
    MetricDoc("async/engine_idle_s", "seconds of the step", "The engine generating nothing (weight update included)."),
    MetricDoc("async/engine_paused_s", "seconds of the step", "The engine paused for the weight update."),
    MetricDoc("async/buffered_groups", "at the step's end", "Finished groups waiting for the trainer."),
    MetricDoc("async/running_groups", "at the step's end", "Groups generating."),
    MetricDoc("async/trainer_idle_s", "seconds of the step", "The trainer waiting for a batch."),
    MetricDoc("async/stale_groups", "count", "Groups over --max-staleness in this batch."),
    MetricDoc("async/stale_groups_regenerated", "count", "Stale groups generated again."),
    MetricDoc("async/stale_groups_dropped", "count", "Stale groups dropped."),
    MetricDoc("async/stale_samples", "count", "Samples of stale groups."),
    MetricDoc("async/continued_requests", "count", "Turns a weight update cut and that continued on the new weights."),
    MetricDoc("async/rerun_episodes", "count", "Episodes a weight update made run again (--inflight-update-policy)."),
    MetricDoc("async/staleness_<k>", "count", "Samples whose oldest token is k versions behind the trainer."),
    MetricDoc("async/staleness_mean", "mean over samples", "Versions behind the trainer."),
    MetricDoc("async/offpolicy_tokens", "sum over samples", "Model tokens sampled by older weights."),
    MetricDoc("async/offpolicy_token_frac", "ratio of sums", "Off-policy share of the model tokens."),
)

_SYNC = (
    MetricDoc("sync/export_s", "seconds of the step", "Exporting the new weights."),
    MetricDoc("sync/gbytes", "of the step", "Gigabytes written (or staged in the in-process engine)."),
    MetricDoc("sync/in_memory", "0 or 1", "The weights went device to device to the embedded engine."),
    MetricDoc("sync/adapters_only", "0 or 1", "LoRA: only the adapters moved."),
    MetricDoc("sync/delta", "0 or 1", "--weight-sync-mode delta (or auto with vLLM): the version went as a delta (0: "
              "in full)."),
    MetricDoc("sync/delta_unavailable", "0 or 1", "Deltas were asked for (--weight-sync-mode delta, or auto with vLLM) "
              "but this engine takes full syncs only: SGLang (no delta route), a vLLM without the project's worker "
              "extension, a multi-process job; the log says why once."),
    MetricDoc("sync/bytes", "bytes of the step", "Delta mode: what crossed to the engine (payload + manifest; a delta "
              "resent in full counts both)."),
    MetricDoc("sync/full_bytes", "bytes of the step", "Delta mode: what a full sync in the engine's dtypes would have "
              "sent."),
    MetricDoc("sync/changed_fraction", "of all elements", "Delta mode: weight elements whose bytes changed since the "
              "version the engine held."),
    MetricDoc("sync/diff_s", "seconds of the step", "Delta mode: comparing the new bytes with the engine's."),
    MetricDoc("sync/encode_s", "seconds of the step", "Delta mode: building the chunks, buckets and checksums."),
    MetricDoc("sync/write_s", "seconds of the step", "Delta mode: writing the payload where it crosses by disk (0 "
              "in process)."),
    MetricDoc("sync/apply_s", "seconds of the step", "Delta mode: the engine applying it off to the side."),
    MetricDoc("sync/confirm_s", "seconds of the step", "Delta mode: every replica's checksums against the manifest."),
    MetricDoc("sync/checksum_mismatches", "running total", "Delta mode: versions whose bytes in the engine differed "
              "from the trainer's (each then went in full)."),
    MetricDoc("sync/full_resyncs", "running total", "Delta mode: versions sent in full after the first (a mismatch, "
              "a restarted engine, a refused or missing base, a retried swap)."),
    MetricDoc("sync/frozen_gbytes_left_out", "of the step", "--freeze-vision-tower / --freeze-vision-merger: gigabytes "
              "of frozen tensors this version left out (the engines hold them; 0 on the first version)."),
)

_ENGINE = (
    MetricDoc("engine/outages", "running total", "Times the engine became unreachable and came back."),
    MetricDoc("engine/outage_seconds", "running total", "Seconds waited for it."),
    MetricDoc("engine/weight_restores", "running total", "Weight re-pushes after an outage."),
    MetricDoc("engine/requests_resent", "running total", "Requests re-sent after an outage."),
    MetricDoc("engine/workers", "at the step's end", "Router workers in use."),
    MetricDoc("engine/workers_lost", "running total", "Router workers dropped (--allow-worker-loss)."),
)

METRIC_FAMILIES: tuple[MetricFamily, ...] = (
    MetricFamily("Record fields", ("jaxrl_vlm/job/run_log.py",), "Every line of metrics.jsonl has step and time.",
                 _RECORD),
    MetricFamily("Rollout", ("rollout/metrics.py",),
                 "The training rollout's episodes, under rollout/; each eval set's under eval/<set>/ (the same names). "
                 "A --custom-rollout-log-function-path hook adds names of its own, or replaces these.",
                 tuple(m.under("rollout/") for m in ROLLOUT_METRICS)),
    MetricFamily("Multi-turn lengths", ("rollout/metrics.py",), "slime's --log-multi-turn names.", MULTI_TURN_METRICS),
    MetricFamily("Evaluation", ("rollout/metrics.py", "jaxrl_vlm/job/eval.py", "jaxrl_vlm/job/sft.py"),
                 "Per eval set (--eval-prompt-data NAME PATH): every Rollout metric as eval/<set>/<name> (without "
                 "rollout/), and these.", _EVAL, restated=tuple(m.under("eval/<set>/") for m in ROLLOUT_METRICS)),
    MetricFamily("Train step", ("jaxrl_vlm/rl/losses.py", "jaxrl_vlm/rl/corrections.py", "jaxrl_vlm/rl/train_step.py",
                                "jaxrl_vlm/rl/router_losses.py"),
                 "Reduced over the micro-batches of one optimizer step as shown, then averaged over the rollout's "
                 "optimizer steps (--num-steps-per-rollout). A --custom-loss-function-path loss logs its own names.",
                 TRAIN_METRICS),
    MetricFamily("Batches and advantages", ("jaxrl_vlm/job/trainer.py",), "", (*_BATCH, *_ADVANTAGES)),
    MetricFamily("Timings and memory", ("jaxrl_vlm/job/run.py", "jaxrl_vlm/job/sources.py", "jaxrl_vlm/job/sft.py"),
                 "", _PERF),
    MetricFamily("Weight sync", ("jaxrl_vlm/weight_sync.py",), "", _SYNC),
    MetricFamily("Engine", ("rollout/engine_link.py", "jaxrl_vlm/job/sources.py"),
                 "--engine-url runs: outages (--engine-reconnect-timeout) and router workers.", _ENGINE),
    MetricFamily("Asynchronous training", ("jaxrl_vlm/job/sources.py", "jaxrl_vlm/job/staleness.py"),
                 "--max-staleness >= 1.", _ASYNC),
    MetricFamily("Supervised fine-tuning", ("jaxrl_vlm/job/sft.py",), "--loss-type sft_loss.", _SFT),
)

METRICS: tuple[MetricDoc, ...] = tuple(m for family in METRIC_FAMILIES for m in (*family.metrics, *family.restated))


def find(key: str) -> MetricDoc | None:
    """The catalogue entry of `key`, a name as a run writes it (None: not catalogued)."""
    return next((m for m in METRICS if m.matches(key)), None)


def uncatalogued(keys: Iterable[str]) -> list[str]:
    """The keys of a run's records that no catalogue entry describes, sorted."""
    return sorted({k for k in keys if find(k) is None})
