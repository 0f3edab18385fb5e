"""Evaluation (`--eval-prompt-data` and slime's other eval flags), `jaxrl-vlm eval` and `jaxrl-vlm plot`.

The fast tests cover the flags (slime's syntax, row slices and their errors), the eval schedule, pass@k, the eval
args copy and the metrics log. The slow ones run a tiny training job (embedded engine, tiny random model, the
letter game over two turns) with and without evaluation: the eval metrics, dumps and plots are there, training is
exactly the same as without evaluation, and `jaxrl-vlm eval` of the run's checkpoint repeats the run's own final
eval.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import shlex
from itertools import combinations
from pathlib import Path

import jax
import numpy as np
import pytest
from _slime_geo3k_args import EVAL, TRAIN_DATA

from jaxrl_vlm.cli import main
from jaxrl_vlm.config import ConfigError, EvalSetSpec, load_config, parse_eval_prompt_data
from jaxrl_vlm.job.assets import load_eval_set, load_eval_sets
from jaxrl_vlm.job.eval import (
    EVAL_PASS,
    EvalPrompts,
    eval_due,
    eval_namespace,
    eval_sampling,
    eval_seed,
    eval_table,
    first_pass,
    pass_at_k,
    passrate_metrics,
)
from jaxrl_vlm.job.run import train
from jaxrl_vlm.job.run_log import RunLog, plot_run, read_metrics
from rollout.driver import DriverState, RolloutResult
from rollout.dump import validate_dump
from rollout.multiturn import RolloutContext
from rollout.sample import Sample


def _prompts(path: Path, n: int, offset: int = 0) -> Path:
    path.write_text("".join(json.dumps({"problem": f"Say something about number {i + offset}.", "answer": "x",
                                        "images": []}) + "\n" for i in range(n)))
    return path


# ----------------------------------------------------------------------------- flags and slices
def test_slimes_eval_group_parses_in_slimes_syntax():
    cfg = load_config(None, shlex.split(EVAL))
    assert parse_eval_prompt_data(cfg.eval.eval_prompt_data) == [EvalSetSpec("geo3k_eval", TRAIN_DATA, 0, 64)]
    assert cfg.eval.eval_interval == 20 and cfg.eval.n_samples_per_eval_prompt == 1
    # Each eval setting falls back to the rollout's.
    assert eval_sampling(cfg) == {"rollout_temperature": cfg.rollout.rollout_temperature,
                                  "rollout_top_p": cfg.rollout.rollout_top_p, "rollout_top_k": 1,
                                  "rollout_max_response_len": 4096}
    # Several sets, open-ended and negative slices, YAML lists too.
    cfg = load_config(None, ["--eval-prompt-data", "a", "x.jsonl@[:64]", "b", "y.parquet@[10:]", "c", "z.jsonl@[-5:-1]",
                             "d", "w.jsonl", "--eval-temperature", "0.6", "--eval-top-p", "0.9"])
    specs = parse_eval_prompt_data(cfg.eval.eval_prompt_data)
    assert specs == [EvalSetSpec("a", "x.jsonl", None, 64), EvalSetSpec("b", "y.parquet", 10, None),
                     EvalSetSpec("c", "z.jsonl", -5, -1), EvalSetSpec("d", "w.jsonl")]
    assert [str(s) for s in specs] == ["x.jsonl@[:64]", "y.parquet@[10:]", "z.jsonl@[-5:-1]", "w.jsonl"]
    assert eval_sampling(cfg)["rollout_temperature"] == 0.6 and eval_sampling(cfg)["rollout_top_p"] == 0.9


@pytest.mark.parametrize(("argv", "match"), [
    (["--eval-prompt-data", "a", "x.jsonl", "b"], r"NAME PATH pairs.*'b' has no path"),
    (["--eval-prompt-data", "x.jsonl", "a"], r"name 'x.jsonl'.*NAME PATH pairs"),
    (["--eval-prompt-data", "a/b", "x.jsonl"], r"name 'a/b'"),
    (["--eval-prompt-data", "a", "x.jsonl", "a", "y.jsonl"], r"eval set 'a' is given twice"),
    (["--eval-prompt-data", "a", "x.jsonl@[1:b]"], r"eval set 'a': bad row slice in 'x.jsonl@\[1:b\]'"),
    (["--eval-prompt-data", "a", "x.jsonl@[0:4:2]"], r"eval set 'a': bad row slice"),
    (["--eval-prompt-data", "a", "x.jsonl@[3]"], r"eval set 'a': bad row slice"),
    (["--eval-interval", "5"], r"--eval-interval 5 needs eval sets"),
    (["--eval-prompt-data", "a", "x.jsonl", "--eval-interval", "0"], r"eval_interval must be >= 1, got 0 \(`--eval-interval none` evaluates only before"),
    (["--eval-prompt-data", "a", "x.jsonl", "--n-samples-per-eval-prompt", "0"], r"n_samples_per_eval_prompt"),
    (["--eval-top-p", "1.5"], r"eval_top_p must be in \(0, 1\]"),
    (["--eval-max-response-len", "0"], r"eval_max_response_len must be >= 1"),
])
def test_bad_eval_flags_are_errors_naming_the_set(argv, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, argv)


def test_eval_sets_load_like_the_prompt_data_and_slice_file_rows(tmp_path):
    data = _prompts(tmp_path / "p.jsonl", 10)
    base = ["--prompt-style", "plain", "--system-prompt", "Answer briefly."]

    def rows(path_spec: str) -> list[int]:
        cfg = load_config(None, [*base, "--eval-prompt-data", "s", path_spec])
        (eval_set,) = load_eval_sets(cfg)
        prompts = eval_set.prompts()
        assert all(p.prompt[0] == {"role": "system", "content": "Answer briefly."} for p in prompts)  # prompt style
        return [p.metadata["row"] for p in prompts]

    assert rows(str(data)) == list(range(10))
    assert rows(f"{data}@[0:4]") == [0, 1, 2, 3]
    assert rows(f"{data}@[:3]") == [0, 1, 2]
    assert rows(f"{data}@[7:]") == [7, 8, 9]
    assert rows(f"{data}@[-2:]") == [8, 9]
    assert rows(f"{data}@[2:-6]") == [2, 3]
    assert rows(f"{data}@[5:100]") == list(range(5, 10))
    with pytest.raises(ConfigError, match=r"eval set 's' .*keeps no usable row"):
        rows(f"{data}@[20:]")
    cfg = load_config(None, [*base, "--eval-prompt-data", "held", str(tmp_path / "missing.jsonl@[0:4]")])
    with pytest.raises(ConfigError, match=r"eval set 'held' .*missing.jsonl does not exist"):
        load_eval_sets(cfg)
    # Rows skipped as malformed keep their file row numbers: the slice is over file rows, as slime's.
    bad = tmp_path / "bad.jsonl"
    bad.write_text(data.read_text().replace('{"problem": "Say something about number 1."', "{not json", 1))
    cfg = load_config(None, [*base, "--on-bad-row", "skip", "--eval-prompt-data", "s", f"{bad}@[0:3]"])
    assert [p.metadata["row"] for p in load_eval_set(cfg, parse_eval_prompt_data(cfg.eval.eval_prompt_data)[0]).prompts()] == [0, 2]


# ----------------------------------------------------------------------------- schedule, pass@k, isolation
def test_eval_runs_before_training_every_interval_and_at_the_end():
    def due(*argv: str) -> list[int]:
        cfg = load_config(None, ["--num-rollout", "7", *argv])
        return [n for n in range(8) if eval_due(cfg, n)]

    assert due() == []  # no eval sets, no eval
    assert due("--eval-prompt-data", "a", "x.jsonl") == [0, 7]
    assert due("--eval-prompt-data", "a", "x.jsonl", "--eval-interval", "3") == [0, 3, 6, 7]
    assert due("--eval-prompt-data", "a", "x.jsonl", "--eval-interval", "1", "--skip-eval-before-train") == list(range(1, 8))


def test_pass_at_k_is_the_unbiased_estimator():
    for n in range(1, 7):
        for c in range(n + 1):
            for k in range(1, n + 1):
                # The fraction of k-subsets of the n samples holding at least one pass.
                outcomes = [1] * c + [0] * (n - c)
                expected = np.mean([any(s) for s in combinations(outcomes, k)])
                assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12), (n, c, k)
    samples = []
    for group, rewards in enumerate([[1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 0.5, 0.0], [0.0, 0.0, 0.0]]):
        for i, r in enumerate(rewards):
            samples.append(Sample(prompt=[], group_index=group, index=i, reward=r))
    metrics = passrate_metrics(samples, 4)
    assert metrics["pass@1"] == pytest.approx(np.mean([1 / 4, 2 / 4, 0]))  # reward 1 passes, 0.5 does not
    assert metrics["pass@2"] == pytest.approx(np.mean([1 - 3 / 6, 1 - 1 / 6, 0]))
    assert metrics["pass@4"] == pytest.approx(np.mean([1, 1]))  # the group of 3 (one FAILED) cannot give pass@4


def test_eval_args_are_a_copy_with_eval_sampling_fresh_state_and_their_own_seeds(tmp_path):
    data = _prompts(tmp_path / "p.jsonl", 6)
    cfg = load_config(None, ["--prompt-style", "plain", "--eval-prompt-data", "a", f"{data}@[:4]", "b", str(data),
                             "--n-samples-per-eval-prompt", "3", "--eval-temperature", "0.5", "--eval-top-k", "5",
                             "--dynamic-filter", "zero_std", "--partial-rollout", "--over-sampling-batch-size", "8"])
    sets = load_eval_sets(cfg)
    args = cfg.to_namespace()
    ctx = RolloutContext(client=None, encoder=None, env_module=None, generate_slots=asyncio.Semaphore(4))
    ctx.suspended[(0, 0)] = "a training episode"
    args.rollout_context = ctx
    args.driver_state = DriverState(next_group_index=17)
    ea = eval_namespace(args, cfg, sets[0])
    assert (ea.rollout_batch_size, ea.n_samples_per_prompt) == (4, 3)
    assert (ea.rollout_temperature, ea.rollout_top_k, ea.rollout_max_response_len) == (0.5, 5, cfg.rollout.rollout_max_response_len)
    assert ea.dynamic_filter is None and ea.partial_rollout is False and ea.over_sampling_batch_size is None
    assert ea.driver_state.next_group_index == 0 and ea.rollout_context.suspended == {}
    assert ea.rollout_context.generate_slots is ctx.generate_slots  # same engine, same concurrency bound
    # The run's own args are untouched.
    assert args.driver_state.next_group_index == 17 and ctx.suspended == {(0, 0): "a training episode"}
    assert (args.rollout_temperature, args.n_samples_per_prompt, args.dynamic_filter) == (1.0, 1, "zero_std")
    # Eval seeds: fixed per set, different per set and from the training seed.
    seeds = {eval_seed(cfg.rollout.rollout_seed, s.name) for s in sets}
    assert len(seeds) == 2 and cfg.rollout.rollout_seed not in seeds
    assert eval_namespace(args, cfg, sets[1]).rollout_seed == eval_seed(cfg.rollout.rollout_seed, "b")
    assert ea.rollout_seed == eval_namespace(args, cfg, sets[0]).rollout_seed

    # The source hands out the set once; a replacement request gets repeats that are not scored.
    source = EvalPrompts(sets[0])
    first, again = source.next_batch(), source.next_batch()
    assert [p.metadata["row"] for p in first] == [0, 1, 2, 3] and {p.metadata[EVAL_PASS] for p in again} == {1}
    kept = [Sample(prompt=[], group_index=0, metadata={EVAL_PASS: 0}), Sample(prompt=[], group_index=4, metadata={EVAL_PASS: 1})]
    result = first_pass(RolloutResult(groups=[[kept[0]], [kept[1]]], failed=[Sample(prompt=[], metadata={EVAL_PASS: 1})]))
    assert result.samples == [kept[0]] and result.failed == []


def test_read_metrics_merges_a_steps_lines_and_replaces_what_a_resume_reran(tmp_path, capsys):
    log = RunLog(tmp_path, total_steps=2)
    log.log_eval(0, {"eval/a/raw_reward": 0.25, "perf/eval_time": 1.0, "weight_version": 0})
    log.log(0, {"rollout/raw_reward": 0.5, "rollout/termination/env_done": 1.0, "weight_version": 1})
    log.log(1, {"rollout/raw_reward": 0.6, "weight_version": 2})  # then the run is killed
    log.close()
    assert "eval after 0 steps: a reward 0.250" in capsys.readouterr().err
    resumed = RunLog(tmp_path, total_steps=2, resumed_at=1)
    resumed.log(1, {"rollout/raw_reward": 0.7, "weight_version": 2})
    resumed.log_eval(2, {"eval/a/raw_reward": 0.75, "weight_version": 2})
    resumed.close()
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2]
    assert records[0]["eval/a/raw_reward"] == 0.25 and records[0]["rollout/raw_reward"] == 0.5
    assert records[0]["weight_version"] == 1  # the training record comes last and wins
    assert records[1]["rollout/raw_reward"] == 0.7
    assert set(records[2]) == {"step", "time", "eval/a/raw_reward", "weight_version"}
    written = plot_run(tmp_path / "metrics.jsonl", tmp_path / "plots")
    assert "eval_reward.png" in [p.name for p in written]
    # A run without evaluation writes no eval plot.
    no_eval = RunLog(tmp_path / "plain", total_steps=1)
    no_eval.log(0, {"rollout/raw_reward": 0.5})
    no_eval.close()
    assert "eval_reward.png" not in [p.name for p in plot_run(tmp_path / "plain" / "metrics.jsonl", tmp_path / "p2")]


def test_eval_table_has_a_row_per_set():
    table = eval_table({"eval/a/samples": 8, "eval/a/raw_reward": 0.5, "eval/a/pass@1": 0.25, "eval/a/pass@2": 0.5,
                        "eval/a/turns/mean": 1.75, "eval/a/truncated_ratio": 0.125, "eval/a/response_len/mean": 11.5,
                        "eval/a/failed_samples": 0, "eval/bb/samples": 4, "eval/bb/raw_reward": float("nan")},
                       ["a", "bb"])
    lines = table.splitlines()
    assert lines[0].split() == ["set", "samples", "failed", "mean", "reward", "pass@1", "pass@2", "turns", "mean",
                                "truncated", "response", "len"]
    assert lines[2].split() == ["a", "8", "0", "0.500", "0.250", "0.500", "1.75", "0.125", "11.5"]
    assert lines[3].split() == ["bb", "4", "-", "-", "-", "-", "-", "-", "-"]


def test_eval_command_without_eval_sets_is_a_clear_error(capsys):
    assert main(["eval", "--hf-checkpoint", "/nonexistent"]) == 2
    assert "needs eval sets: --eval-prompt-data" in capsys.readouterr().err


# ----------------------------------------------------------------------------- a tiny run
STEPS = 3


def _run_argv(root: Path, out: str, *extra: str) -> list[str]:
    return [
        "--hf-checkpoint", str(root / "tiny"), "--make-tiny", "--prompt-data", str(root / "train.jsonl"),
        "--prompt-style", "plain", "--system-prompt", "Answer briefly.",
        "--rollout-interaction-env-path", "envs.letter_game", "--max-turns", "2",
        "--num-rollout", str(STEPS), "--rollout-batch-size", "2", "--n-samples-per-prompt", "4",
        # A random tiny model almost never emits <|im_end|>: extra stop ids end its turns after a few tokens, so
        # episodes run two turns.
        "--rollout-max-response-len", "64", "--rollout-stop-token-ids", ",".join(str(i) for i in range(300, 450)),
        "--lr", "5e-3", "--weight-decay", "0", "--seq-buckets", "64,128", "--row-buckets", "8,16",
        "--patch-buckets", "0", "--engine-max-batch", "16", "--engine-max-seq-len", "256",
        "--logprob-chunk-size", "64", "--seed", "1234", "--rollout-seed", "7", "--save-interval", "2",
        # One device: these runs test evaluation, not sharding, and twice a full suite's worker deadlocked here in an
        # XLA:CPU all-reduce of the 8-device trainer beside the engine's thread (gdb: 8 threads in
        # InProcessCommunicator::AllReduce's rendezvous; never reproduced alone).
        "--train-devices", "0",
        "--output-dir", str(root / out), *extra,
    ]


def _eval_flags(root: Path) -> list[str]:
    return ["--eval-prompt-data", "letters", f"{root / 'eval.jsonl'}@[0:4]", "held", f"{root / 'eval.jsonl'}@[4:]",
            "--n-samples-per-eval-prompt", "2", "--eval-interval", "2", "--log-passrate"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval_runs")
    _prompts(root / "train.jsonl", 8)
    _prompts(root / "eval.jsonl", 7, offset=100)
    py_state, np_state = random.getstate(), np.random.get_state()
    # Compiled here, not loaded from the persistent cache: in a full suite an executable that another module wrote
    # earlier in the same run once aborted this process when its train step ran (SIGABRT, no message; XLA:CPU).
    jax.config.update("jax_enable_compilation_cache", False)
    try:
        train(load_config(None, _run_argv(root, "with_eval", *_eval_flags(root))))
        train(load_config(None, _run_argv(root, "no_eval")))
    finally:
        jax.config.update("jax_enable_compilation_cache", True)
    # Evaluation puts back the global random states it found (this process ran two whole runs in between).
    assert random.getstate() == py_state and np.array_equal(np.random.get_state()[1], np_state[1])
    return root


EVAL_KEYS = ("samples", "prompts", "raw_reward", "pass@1", "pass@2", "turns/mean", "turns/max", "truncated_ratio",
             "response_len/mean", "failed_samples", "time_s")


@pytest.mark.slow
def test_a_run_evaluates_before_training_every_interval_and_at_the_end(runs):
    out = runs / "with_eval"
    records = {r["step"]: r for r in read_metrics(out / "metrics.jsonl")}
    assert sorted(records) == [0, 1, 2, 3]  # step 3: the final eval only
    evaluated = [s for s, r in records.items() if any(k.startswith("eval/") for k in r)]
    assert evaluated == [0, 2, 3]
    for step in evaluated:
        r = records[step]
        assert r["perf/eval_time"] > 0
        for name, prompts in (("letters", 4), ("held", 3)):
            for key in EVAL_KEYS:
                assert f"eval/{name}/{key}" in r, (step, name, key)
            assert r[f"eval/{name}/prompts"] == prompts and r[f"eval/{name}/samples"] == 2 * prompts
            assert 0.0 <= r[f"eval/{name}/pass@1"] <= r[f"eval/{name}/pass@2"] <= 1.0
            turns = {int(k.rsplit("_", 1)[1]): v for k, v in r.items() if k.startswith(f"eval/{name}/turns/count_")}
            assert sum(turns.values()) == 2 * prompts and max(turns) == 2  # episodes ran two turns
            causes = sum(v for k, v in r.items() if k.startswith(f"eval/{name}/termination/"))
            assert causes == pytest.approx(1.0)  # the termination causes' shares
    assert set(records[3]) - {"step", "time", "weight_version", "perf/eval_time"} == {
        k for k in records[3] if k.startswith("eval/")}
    assert records[3]["weight_version"] == STEPS
    assert records[2]["weight_version"] == 3  # step 2's training record (version 3) wins over its eval's (2)
    # The rollout's pass rate with --log-passrate (slime's passrate/pass@k).
    assert {"passrate/pass@1", "passrate/pass@2", "passrate/pass@4"} <= set(records[0])
    # Every sample dumped per set and round, each prompt once (groups 0..n-1 of n_samples_per_eval_prompt).
    for name, prompts in (("letters", 4), ("held", 3)):
        assert sorted(p.name for p in (out / "eval" / name).iterdir()) == ["step_0.jsonl", "step_2.jsonl", "step_3.jsonl"]
        for step in evaluated:
            dump = validate_dump(out / "eval" / name / f"step_{step}.jsonl")
            assert sorted((d["group_index"], d["index"]) for d in dump) == [(g, i) for g in range(prompts) for i in range(2)]
            # The engine's current weights: those synced after `step` training steps.
            assert all(d["weight_versions"] == [str(step)] for d in dump), step
            assert np.mean([d["reward"] for d in dump]) == pytest.approx(records[step][f"eval/{name}/raw_reward"])
    assert (out / "plots" / "eval_reward.png").stat().st_size > 0


_NOT_COMPARED = ("perf/", "sync/", "time", "latency", "eval/", "passrate/")


@pytest.mark.slow
def test_evaluation_never_changes_training(runs):
    with_eval = read_metrics(runs / "with_eval" / "metrics.jsonl")[:STEPS]
    without = read_metrics(runs / "no_eval" / "metrics.jsonl")
    assert [r["step"] for r in without] == list(range(STEPS))
    for a, b in zip(with_eval, without):
        keys = {k for k in b if not any(k.startswith(p) or p in k for p in _NOT_COMPARED)}
        assert {k for k in a if not any(k.startswith(p) or p in k for p in _NOT_COMPARED)} == keys
        for key in sorted(keys):
            # The same tokens were sampled and trained on; only the order of finished groups (timing) may differ,
            # which moves float sums in the last bits.
            tol = dict(rel=1e-4, abs=1e-5) if key.startswith("train/") else dict(rel=1e-9, abs=1e-12)
            assert a[key] == pytest.approx(b[key], **tol), (a["step"], key)


@pytest.mark.slow
def test_eval_command_on_the_checkpoint_repeats_the_runs_final_eval(runs, capsys):
    out = runs / "with_eval"
    metrics_json = runs / "standalone.json"
    argv = ["eval", *_run_argv(runs, "standalone", *_eval_flags(runs)), "--load", str(out / "checkpoints"),
            "--metrics-json", str(metrics_json), "--dump-dir", str(runs / "standalone_dump")]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert f"checkpoint {out / 'checkpoints'} (step {STEPS}, weight version {STEPS})" in printed
    assert printed.splitlines()[1].split()[:4] == ["set", "samples", "failed", "mean"]
    assert [line.split()[0] for line in printed.splitlines()[3:5]] == ["letters", "held"]
    standalone = json.loads(metrics_json.read_text())["metrics"]
    final = read_metrics(out / "metrics.jsonl")[STEPS]
    for name in ("letters", "held"):
        for key in ("samples", "raw_reward", "pass@1", "pass@2", "turns/mean", "truncated_ratio", "response_len/mean"):
            assert standalone[f"eval/{name}/{key}"] == pytest.approx(final[f"eval/{name}/{key}"], rel=1e-9), (name, key)
    validate_dump(runs / "standalone_dump" / "letters" / f"step_{STEPS}.jsonl")
    # One step's directory of the checkpoint directory works too.
    one_step = runs / "one_step.json"
    assert main(["eval", *_run_argv(runs, "standalone", *_eval_flags(runs)), "--load", str(out / "checkpoints" / "2"),
                 "--metrics-json", str(one_step)]) == 0
    assert "(step 2, weight version 2)" in capsys.readouterr().out
    at_2 = read_metrics(out / "metrics.jsonl")[2]
    assert json.loads(one_step.read_text())["metrics"]["eval/held/raw_reward"] == pytest.approx(at_2["eval/held/raw_reward"])


@pytest.mark.slow
def test_eval_command_on_an_hf_directory(runs, capsys):
    final_model = runs / "with_eval" / "final_model"
    metrics_json = runs / "hf.json"
    flags = ["--eval-prompt-data", "letters", f"{runs / 'eval.jsonl'}@[:2]", "--n-samples-per-eval-prompt", "2"]
    assert main(["eval", *_run_argv(runs, "hf_eval", *flags), "--load", str(final_model),
                 "--metrics-json", str(metrics_json)]) == 0
    printed = capsys.readouterr().out
    assert f"HF directory {final_model}" in printed and "pass@2" in printed
    metrics = json.loads(metrics_json.read_text())["metrics"]
    assert metrics["eval/letters/samples"] == 4 and math.isfinite(metrics["eval/letters/raw_reward"])


@pytest.mark.slow
def test_plot_command_overlays_runs(runs, capsys):
    plots = runs / "compare"
    assert main(["plot", str(runs / "with_eval"), str(runs / "no_eval" / "metrics.jsonl"), "--out", str(plots)]) == 0
    assert "wrote 7 plots" in capsys.readouterr().out
    assert sorted(p.name for p in plots.glob("*.png")) == sorted([
        "reward.png", "eval_reward_held.png", "eval_reward_letters.png", "repetition_frac.png", "response_length.png",
        "turns.png", "truncation.png"])
    assert all(p.stat().st_size > 0 for p in plots.glob("*.png"))
    assert main(["plot", str(runs / "nothing_here"), "--out", str(plots)]) == 2
    assert "no metrics.jsonl" in capsys.readouterr().err


def test_plot_runs_labels_each_run(tmp_path):
    from jaxrl_vlm.job import run_log

    for name, reward in (("a", 0.25), ("b", 0.5)):
        log = RunLog(tmp_path / name / "run", total_steps=1)
        log.log(0, {"rollout/raw_reward": reward})
        log.close()
    assert run_log._labels([tmp_path / "a" / "run", tmp_path / "b" / "run"]) == [
        str(tmp_path / "a" / "run"), str(tmp_path / "b" / "run")]  # equal names: the paths
    assert run_log._labels([tmp_path / "a", tmp_path / "b" / "run" / "metrics.jsonl"]) == ["a", "run"]
    written = run_log.plot_runs([tmp_path / "a" / "run", tmp_path / "b" / "run"], tmp_path / "out")
    assert [p.name for p in written] == ["reward.png", "repetition_frac.png", "response_length.png", "turns.png",
                                         "truncation.png"]
