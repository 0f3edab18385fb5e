"""Saved rollouts (slime's `--save-debug-rollout-data` / `--load-debug-rollout-data`) and `jaxrl-vlm compare-losses`.

The fast tests hold the file format (every field back exactly, arrays to the byte; a clear error for a missing,
foreign, newer, truncated or altered file), the flags and the variant specs. The slow ones run the tiny color-reveal
task on one CPU device, as a user would (`jaxrl-vlm train`, images included): the run saves its rollouts, a replay
of them with the same config starts no engine and reproduces every per-step train/* metric bit for bit, and
`jaxrl-vlm compare-losses` trains ppo_clip, gspo and a user loss file on them from the same start and
writes the table and the plots.
"""

from __future__ import annotations

import csv
import gzip
import math
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from _slime_geo3k_args import argv as slime_argv
from _launch import xla_flags

from jaxrl_vlm.config import ConfigError, load_config
from jaxrl_vlm.job.compare import (
    LossVariant,
    compare_losses,
    comparison_row,
    csv_table,
    markdown_table,
    parse_variant,
)
from jaxrl_vlm.job.replay import RolloutReplay
from jaxrl_vlm.job.run_log import read_metrics
from rollout.driver import RolloutResult
from rollout.rollout_data import RolloutDataError, read_rollout_data, step_path, write_rollout_data
from rollout.sample import Sample, Status, Termination, TruncationCause, TurnRecord

ROOT = Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------- the format
def _sample(group: int, index: int, rng: np.random.Generator, *, status: Status = Status.COMPLETED) -> Sample:
    s = Sample(group_index=group, index=index, label={"answer": "red", "aliases": ["r"]},
               prompt=[{"role": "user", "content": [{"type": "image", "image": "data:image/png;base64,AAAA"},
                                                    {"type": "text", "text": "Which color? ünïcode"}]}])
    s.set_prompt_tokens(rng.integers(0, 1000, size=7).tolist())
    s.append_model_tokens([11, 12, 13], [-1 / 3, -5e-324, -(0.1 + 0.2)])  # no decimal rounding survives these
    s.append_observation_tokens([5, 6])
    s.append_model_tokens([14], [float(-rng.random())])
    s.image_data = ["data:image/png;base64,AAAA"]
    s.multimodal_train_inputs = {
        "pixel_values": rng.standard_normal((8, 1536)).astype(np.float32),
        "image_grid_thw": np.array([[1, 2, 4]], np.int64),
    }
    s.reward = 0.9 if index else -1 / 7
    s.weight_versions = [str(group)]
    s.turns = [TurnRecord(turn=0, generated_tokens=3, finish_reason="stop", engine_latency_s=0.125),
               TurnRecord(turn=1, generated_tokens=1, finish_reason="length", truncation_cause=TruncationCause.LENGTH)]
    s.metadata = {"row": index, "offpolicy_masked_runs": [[0, 1]], "nested": {"a": [1.5, None, "x"]}}
    s.remove_sample = index == 1
    s.set_status(status)
    s.termination = (Termination.truncated(TruncationCause.LENGTH) if status is Status.TRUNCATED
                     else None if status is Status.FAILED else Termination.parse("env_done"))
    if status is Status.FAILED:
        s.metadata["error"] = "engine_error: 503"
    return s


def _result(rng: np.random.Generator) -> RolloutResult:
    groups = [[_sample(g, i, rng, status=Status.TRUNCATED if (g, i) == (1, 0) else Status.COMPLETED) for i in range(2)]
              for g in range(2)]
    return RolloutResult(groups=groups, dropped=Counter({"zero_std_group": 2, "failed_sample": 1}),
                         failed=[_sample(5, 0, rng, status=Status.FAILED)], groups_submitted=5, episodes=9,
                         filtered_long_prompts=1, filtered_long_prompts_total=3, skip_default_log=False,
                         hook_metrics={"custom/x": 0.25})


def _assert_same_sample(a: Sample, b: Sample) -> None:
    for key, value in a.__dict__.items():
        got = getattr(b, key)
        if key == "multimodal_train_inputs":
            assert sorted(value) == sorted(got)
            for name, array in value.items():
                assert got[name].dtype == array.dtype and got[name].shape == array.shape
                assert got[name].tobytes() == array.tobytes(), name
        elif key == "rollout_log_probs":
            assert np.asarray(got, np.float64).tobytes() == np.asarray(value, np.float64).tobytes()
        else:
            assert got == value, key


@pytest.mark.parametrize("suffix", [".jsonl", ".jsonl.gz"])
def test_a_saved_step_reads_back_exactly(tmp_path, suffix):
    result = _result(np.random.default_rng(0))
    path = write_rollout_data(tmp_path / f"step_3{suffix}", 3, result, settings={"rollout_temperature": 1.0})
    assert (path.read_bytes()[:2] == b"\x1f\x8b") == suffix.endswith(".gz")
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # written under a temporary name, then renamed
    saved = read_rollout_data(path, rollout_id=3)
    assert saved.rollout_id == 3 and saved.settings == {"rollout_temperature": 1.0}
    back = saved.result
    assert [len(g) for g in back.groups] == [2, 2] and len(back.failed) == 1
    for a, b in zip([*result.samples, *result.failed], [*back.samples, *back.failed]):
        _assert_same_sample(a, b)
    assert back.dropped == result.dropped and isinstance(back.dropped, Counter)
    for key in ("groups_submitted", "episodes", "filtered_long_prompts", "filtered_long_prompts_total",
                "skip_default_log", "hook_metrics"):
        assert getattr(back, key) == getattr(result, key), key
    # The same step written twice gives the same content.
    again = write_rollout_data(tmp_path / f"again{suffix}", 3, result, settings={"rollout_temperature": 1.0})
    strip = (lambda b: b.split(b"\n", 1)[1]) if suffix == ".jsonl" else (lambda b: gzip.decompress(b).split(b"\n", 1)[1])
    assert strip(again.read_bytes()) == strip(path.read_bytes())


def test_a_failed_episode_that_is_also_kept_stays_one_object(tmp_path):
    result = _result(np.random.default_rng(1))
    result.failed = [result.groups[0][1]]
    back = read_rollout_data(write_rollout_data(tmp_path / "s.jsonl", 0, result)).result
    assert back.failed[0] is back.groups[0][1]


def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines(keepends=True)


@pytest.mark.parametrize(("damage", "message"), [
    (lambda p: p.unlink(), r"no saved rollout here for step 0"),
    (lambda p: p.write_bytes(b"PK\x03\x04torch"), r"zip/torch file \(slime's --save-debug-rollout-data writes torch"),
    (lambda p: p.write_text('{"rows": 1}\n'), r":1: not a jaxrl-vlm rollout data file"),
    (lambda p: p.write_text(_lines(p)[0].replace('"version":1', '"version":2') + "".join(_lines(p)[1:])),
     r":1: format version 2; this jaxrl-vlm reads versions \[1\]"),
    (lambda p: p.write_text("".join(_lines(p)[:-1])), r"truncated after line 6 \(no end record\)"),
    (lambda p: p.write_text("".join(_lines(p)[:3])), r"truncated after line 3"),
    (lambda p: p.write_text("".join(_lines(p)).replace('"reward":0.9', '"reward":0.8', 1)), r"corrupt: the end record"),
    (lambda p: p.write_text("".join(_lines(p)).replace('"tokens":[', '"tokens":[[', 1)), r":2: not valid JSON"),
    (lambda p: p.write_text("".join(_lines(p)) + "{}\n"), r":8: data after the end record"),
    (lambda p: p.write_text(_lines(p)[0].replace('"groups":[2,2]', '"groups":[2,1]') + "".join(_lines(p)[1:])),
     r"announces groups \[2, 1\] and 1 FAILED episodes, the file holds 4 kept samples"),
])
def test_a_missing_foreign_newer_truncated_or_altered_file_is_a_clear_error(tmp_path, damage, message):
    path = write_rollout_data(tmp_path / "step_0.jsonl", 0, _result(np.random.default_rng(2)))
    damage(path)
    with pytest.raises(RolloutDataError, match=message) as info:
        read_rollout_data(path, rollout_id=0)
    assert str(path) in str(info.value)


def test_a_file_of_another_step_and_a_sample_json_cannot_hold_are_errors_naming_them(tmp_path):
    path = write_rollout_data(tmp_path / "step_1.jsonl", 1, _result(np.random.default_rng(3)))
    with pytest.raises(RolloutDataError, match=r"holds step 1, not step 2"):
        read_rollout_data(path, rollout_id=2)
    result = _result(np.random.default_rng(3))
    result.groups[1][0].metadata["handle"] = object()
    with pytest.raises(RolloutDataError, match=r"sample\(group=1, index=0\) field 'metadata' cannot be saved"):
        write_rollout_data(tmp_path / "bad.jsonl", 0, result)
    assert not (tmp_path / "bad.jsonl").exists() and len(list(tmp_path.iterdir())) == 1


# ----------------------------------------------------------------------------- flags
@pytest.mark.parametrize(("argv", "message"), [
    (["--save-debug-rollout-data", "runs/x/rollout.jsonl"], r"must contain \{rollout_id\}"),
    (["--load-debug-rollout-data", "runs/{rollout_id}/{rank}.jsonl"], r"only \{rollout_id\} is filled in, not \['rank'\]"),
    (["--load-debug-rollout-data", "runs/{rollout_id.jsonl"], r"not a valid path template"),
    (["--save-debug-rollout-data", "a/{rollout_id}.jsonl", "--load-debug-rollout-data", "b/{rollout_id}.jsonl"],
     r"set one"),
])
def test_bad_rollout_data_flags_are_config_errors(argv, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, argv)


def test_slimes_run_line_with_the_rollout_data_flags_parses():
    template = "/root/shared/debug_rollout/data_{rollout_id}.pt"  # slime's spelling (our format inside)
    for flag in ("--save-debug-rollout-data", "--load-debug-rollout-data"):
        cfg = load_config(None, [*slime_argv("megatron"), flag, template])
        assert getattr(cfg.debug, flag[2:].replace("-", "_")) == template
        assert not any(flag in note for note in cfg.notes)  # our own flag, same meaning: no translation note
    assert step_path(template, 7) == Path("/root/shared/debug_rollout/data_7.pt")


def test_a_replay_names_the_missing_steps_and_refuses_another_temperature(tmp_path):
    template = str(tmp_path / "step_{rollout_id}.jsonl")
    for k in (0, 1, 3):
        write_rollout_data(step_path(template, k), k, _result(np.random.default_rng(k)),
                           settings={"rollout_temperature": 1.0, "hf_checkpoint": "a"})
    replay = RolloutReplay(load_config(None, ["--load-debug-rollout-data", template, "--num-rollout", "5"]))
    replay.check_available(0, 2)
    with pytest.raises(ConfigError, match=r"no saved rollout for step 2 .*2 of steps 0..4 are missing, saved steps "
                                          r"found: 0-1, 3 \(lower --num-rollout"):
        replay.check_available(0, 5)
    assert len(replay.load(1).samples) == 4
    hot = RolloutReplay(load_config(None, ["--load-debug-rollout-data", template, "--rollout-temperature", "0.7"]))
    with pytest.raises(ConfigError, match=r"sampled at --rollout-temperature 1.0, this run has 0.7"):
        hot.load(0)


# ----------------------------------------------------------------------------- compare-losses: specs and table
def test_variant_specs_flags_yaml_and_errors(tmp_path):
    assert parse_variant("gspo=--policy-loss gspo --eps-clip-high 0.28") == LossVariant(
        "gspo", ("--policy-loss", "gspo", "--eps-clip-high", "0.28"), {}, "--policy-loss gspo --eps-clip-high 0.28")
    assert parse_variant("base=").flags == () and parse_variant("base=").description == "(base config)"
    yaml_file = tmp_path / "dr_grpo.yaml"
    yaml_file.write_text("algo:\n  loss_aggregation: seq_mean_token_sum_norm\n  disable_grpo_std_normalization: true\n")
    v = parse_variant(str(yaml_file))
    assert v.name == "dr_grpo" and v.mapping["algo"]["disable_grpo_std_normalization"] is True
    assert "algo.loss_aggregation=seq_mean_token_sum_norm" in v.description
    assert parse_variant(f"drg={yaml_file}").name == "drg"
    for spec, message in [("--policy-loss gspo", r"give NAME=FLAGS"), (f"{tmp_path}/none.yaml", r"does not exist"),
                          ("a b=--lr 1", r"the name 'a b' must be a word"), ("x=--lr '1", r"cannot split")]:
        with pytest.raises(ConfigError, match=message):
            parse_variant(spec)


def test_comparison_rows_give_means_lasts_and_eval_and_a_dash_for_what_a_loss_does_not_log():
    records = [{"step": 0, "train/loss_total": 1.0, "train/pg_clipfrac": 0.5, "eval/held/raw_reward": 0.2},
               {"step": 1, "train/loss_total": 3.0},
               {"step": 2, "eval/held/raw_reward": 0.6}]
    row = comparison_row(LossVariant("a", ("--lr", "1")), records)
    assert row["steps"] == 2 and row["loss mean"] == 2.0 and row["loss last"] == 3.0
    assert row["clip_fraction mean"] == 0.5 and row["clip_fraction last"] is None and row["entropy mean"] is None
    assert row["eval held start"] == 0.2 and row["eval held final"] == 0.6
    md = markdown_table([row]).splitlines()
    assert md[0].startswith("| variant | changes | steps | loss mean | loss last |") and len(md) == 3
    assert "| a | --lr 1 | 2 | 2 | 3 |" in md[2] and " - |" in md[2]
    rows = list(csv.DictReader(csv_table([row]).splitlines()))
    assert rows[0]["loss mean"] == "2.0" and rows[0]["entropy mean"] == ""


def test_compare_losses_refuses_before_training_what_cannot_be_compared(tmp_path):
    template = str(tmp_path / "step_{rollout_id}.jsonl")
    for k in range(2):
        write_rollout_data(step_path(template, k), k, _result(np.random.default_rng(k)),
                           settings={"rollout_temperature": 1.0})
    base = ["--hf-checkpoint", str(tmp_path / "model"), "--num-rollout", "2", "--load-debug-rollout-data", template]
    gspo = parse_variant("gspo=--policy-loss gspo")
    cases = [
        (base[:-2], [gspo], r"add --load-debug-rollout-data PATH"),
        (base, [], r"at least one --variant"),
        (base, [gspo, parse_variant("gspo=--eps-clip 0.1")], r"variant names must differ, \['gspo'\] repeat"),
        (base, [parse_variant(f"m=--hf-checkpoint {tmp_path / 'other'}")], r"variant m: changes hf_checkpoint"),
        (base, [parse_variant(f"d=--load-debug-rollout-data {tmp_path / 'x_{rollout_id}.jsonl'}")],
         r"variant d: changes load_debug_rollout_data"),
        (base, [parse_variant("hot=--rollout-temperature 0.5")], r"sampled at --rollout-temperature 1.0, this run has 0.5"),
        (base, [parse_variant("long=--num-rollout 3")], r"no saved rollout for step 2"),
    ]
    for argv, variants, message in cases:
        with pytest.raises(ConfigError, match=message):
            compare_losses(None, argv, variants, tmp_path / "out")
    (tmp_path / "out" / "runs" / "gspo").mkdir(parents=True)
    (tmp_path / "out" / "runs" / "gspo" / "metrics.jsonl").write_text("{}\n")
    with pytest.raises(ConfigError, match=r"already hold a run; choose another --out"):
        compare_losses(None, base, [gspo], tmp_path / "out")
    assert not (tmp_path / "model").exists()  # nothing trained, nothing created


# ----------------------------------------------------------------------------- end to end, one CPU device
STEPS = 2


def _env() -> dict[str, str]:
    return {**os.environ, "XLA_FLAGS": xla_flags(1)}  # the CLI runs like a user's: one CPU device


def _run_argv(tmp: Path, *extra: str) -> list[str]:
    """The tiny color-reveal run (pictures in every prompt): 2 prompts x 4 samples per step, 2 optimizer steps
    per rollout (old log-probs recomputed), a KL loss (reference log-probs)."""
    return [
        "configs/color_reveal_tiny.yaml", "--hf-checkpoint", str(tmp / "tiny"),
        "--prompt-data", str(tmp / "train.parquet"), "--synthetic-rows", "8", "--num-rollout", str(STEPS),
        "--rollout-batch-size", "2", "--n-samples-per-prompt", "4", "--global-batch-size", "4",
        "--use-kl-loss", "--kl-loss-coef", "0.01", "--row-buckets", "4,8", "--engine-max-batch", "8", *extra,
    ]


NO_EVAL = ("--eval-prompt-data", "[]", "--eval-interval", "none")


def _cli(*args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-m", "jaxrl_vlm.cli", *args], cwd=ROOT, env=_env(), capture_output=True,
                          text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-4000:]
    return done


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    """A run with evaluation that saves every step's rollout."""
    tmp = tmp_path_factory.mktemp("replay")
    template = str(tmp / "rollouts" / "step_{rollout_id}.jsonl")
    _cli("train", *_run_argv(tmp, "--eval-prompt-data", "heldout", str(tmp / "heldout.parquet"),
                             "--synthetic-eval-rows", "2", "--n-samples-per-eval-prompt", "2", "--eval-interval", "none",
                             "--output-dir", str(tmp / "run"), "--save-debug-rollout-data", template))
    return tmp, template


_NOT_REPLAYED = ("perf/", "sync/", "eval/", "time")


@pytest.mark.slow
def test_a_replay_starts_no_engine_and_reproduces_every_per_step_loss_bit_for_bit(saved_run):
    tmp, template = saved_run
    saved = sorted(p.name for p in (tmp / "rollouts").iterdir())
    assert saved == [f"step_{k}.jsonl" for k in range(STEPS)]
    images = read_rollout_data(step_path(template, 0)).result.samples[0].multimodal_train_inputs
    assert images["pixel_values"].dtype == np.float32 and images["pixel_values"].shape[0] > 0

    # The same config (eval sets included: skipped, and said so), reading the saved rollouts.
    done = _cli("train", *_run_argv(tmp, "--eval-prompt-data", "heldout", str(tmp / "heldout.parquet"),
                                    "--synthetic-eval-rows", "2", "--n-samples-per-eval-prompt", "2",
                                    "--eval-interval", "none", "--output-dir", str(tmp / "replay"),
                                    "--load-debug-rollout-data", template))
    assert "no engine is started or contacted" in done.stderr
    assert "evaluation needs an engine and a replay has none: --eval-prompt-data is skipped" in done.stderr
    assert "embedded engine serving" not in done.stderr and not (tmp / "replay" / "weights").exists()

    run = read_metrics(tmp / "run" / "metrics.jsonl")
    replay = read_metrics(tmp / "replay" / "metrics.jsonl")
    assert [r["step"] for r in run] == list(range(STEPS + 1))  # + the final eval record
    assert any(k.startswith("eval/") for k in run[0]) and not any(k.startswith("eval/") for r in replay for k in r)
    assert [r["step"] for r in replay] == list(range(STEPS))
    for a, b in zip(run, replay):
        keys = {k for k in a if not any(k.startswith(p) for p in _NOT_REPLAYED)}
        assert keys == {k for k in b if not any(k.startswith(p) for p in _NOT_REPLAYED)}
        train_keys = sorted(k for k in keys if k.startswith("train/"))
        assert {"train/loss_total", "train/pg_loss", "train/kl_loss", "train/grad_norm", "train/entropy_loss",
                "train/pg_clipfrac", "train/train_rollout_logprob_abs_diff"} <= set(train_keys)
        for key in sorted(keys):  # every train/* metric bit for bit; rollout/* and batch/* too (the same samples)
            assert a[key] == b[key], (a["step"], key, a[key], b[key])
        assert a["train/optimizer_steps"] == 2.0 and a["train/loss_total"] != 0.0


@pytest.mark.slow
def test_compare_losses_trains_ppo_gspo_and_a_user_loss_on_the_same_rollouts(saved_run):
    """Three loss variants (CISPO's loss is checked in closed form in tests/test_losses.py; a fourth loss here added
    only another compilation), and the run's own loss with the vision tower once per copy of each picture
    (`--vision-reuse false`, the layout before issue 47): on the same rollouts it trains like the run itself (reuse
    on, the default) within float tolerance, so reuse leaves the main command's curves where they were."""
    tmp, template = saved_run
    out = tmp / "compare"
    done = _cli(
        "compare-losses", *_run_argv(tmp, *NO_EVAL), "--load-debug-rollout-data", template, "--out", str(out),
        "--variant", "ppo_clip=", "--variant", "gspo=--policy-loss gspo",
        "--variant", "reinforce=--loss-type custom_loss --custom-loss-function-path configs/hooks/custom_loss.py:reinforce",
        "--variant", "reuse_off=--vision-reuse false",
        timeout=1800,
    )
    names = ["ppo_clip", "gspo", "reinforce", "reuse_off"]
    md = (out / "comparison.md").read_text()
    assert md.strip() in done.stdout
    assert [line.split("|")[1].strip() for line in md.splitlines()[2:]] == names
    rows = list(csv.DictReader((out / "comparison.csv").read_text().splitlines()))
    assert [r["variant"] for r in rows] == names and all(r["steps"] == str(STEPS) for r in rows)
    for row in rows:
        for metric in ("loss", "pg_loss", "behaviour_drift", "grad_norm", "entropy"):
            assert math.isfinite(float(row[f"{metric} mean"])) and math.isfinite(float(row[f"{metric} last"])), metric
    assert rows[2]["clip_fraction mean"] == ""  # the user's REINFORCE has no clip
    assert sorted(p.name for p in (out / "plots").iterdir()) == sorted(
        f"{m}.png" for m in ("loss", "pg_loss", "clip_fraction", "behaviour_drift", "grad_norm", "entropy"))
    assert all(p.stat().st_size > 0 for p in (out / "plots").iterdir())

    runs = {n: read_metrics(out / "runs" / n / "metrics.jsonl") for n in names}
    original = read_metrics(tmp / "run" / "metrics.jsonl")[:STEPS]
    # The same start, the same rollouts: the variant with the run's own loss is the run itself, bit for bit.
    for a, b in zip(original, runs["ppo_clip"]):
        for key in (k for k in a if k.startswith("train/")):
            assert a[key] == b[key], (a["step"], key)
    # Every variant trained on step 0's rollout from the same weights (the behaviour policy's own: no drift), and
    # the losses differ.
    for n in names:
        assert runs[n][0]["train/train_rollout_logprob_abs_diff"] < 1e-5, n
    losses = {n: tuple(r["train/loss_total"] for r in runs[n]) for n in names[:3]}
    assert len(set(losses.values())) == 3, losses
    # Vision reuse: each group's prompt picture was encoded once per micro-batch instead of once per sample, and
    # every train metric stays within float tolerance of the run's (the reduction orders differ).
    for a, b in zip(runs["ppo_clip"], runs["reuse_off"]):
        assert a["train/vision_images_distinct"] < b["train/vision_images_distinct"] == b["train/vision_images"]
        for key in ("train/loss_total", "train/pg_loss", "train/kl_loss", "train/grad_norm", "train/entropy_loss",
                    "train/train_rollout_logprob_abs_diff"):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), (a["step"], key)
    assert all(not (out / "runs" / n / "weights").exists() for n in names)  # replays: no engine, no sync


@pytest.mark.slow
def test_compare_losses_with_eval_sets_evaluates_the_start_and_each_variants_weights(saved_run):
    tmp, template = saved_run
    out = tmp / "compare_eval"
    _cli("compare-losses", *_run_argv(tmp, "--eval-prompt-data", "heldout", f"{tmp / 'heldout.parquet'}@[:1]",
                                      "--n-samples-per-eval-prompt", "2", "--eval-interval", "none"),
         "--num-rollout", "1", "--load-debug-rollout-data", template, "--out", str(out),
         "--variant", "gspo=--policy-loss gspo", timeout=1800)
    records = read_metrics(out / "runs" / "gspo" / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1]
    assert all(0.0 <= r["eval/heldout/raw_reward"] <= 1.0 and r["eval/heldout/samples"] == 2 for r in records)
    # The dump and the pictures the engine received (rollout/dump.py), for `jaxrl-vlm view`.
    assert sorted(p.name for p in (out / "runs" / "gspo" / "eval" / "heldout").iterdir()) == ["step_1.jsonl",
                                                                                           "step_1_images"]
    row = next(csv.DictReader((out / "comparison.csv").read_text().splitlines()))
    assert float(row["eval heldout start"]) == records[0]["eval/heldout/raw_reward"]
    assert float(row["eval heldout final"]) == records[1]["eval/heldout/raw_reward"]
    assert (out / "plots" / "eval_reward_heldout.png").stat().st_size > 0
