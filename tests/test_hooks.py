"""slime's customization hooks (docs/guides/hooks.md): each one, from a user file, takes effect where slime's does, and a
wrong return type stops with an error naming the flag, the path, and what was expected.

Rollout hooks run in the real driver against the fake SGLang server (test_driver's harness); trainer hooks run on
the host functions that call them, the loss and TIS functions inside `jax.jit` and, once, inside the compiled train
step of a tiny model. The shipped examples (configs/hooks/) are the user files wherever they fit.
"""

from __future__ import annotations

import json
import textwrap
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_driver import EnvSpec, PromptSource, harness, prompt_number, run

from jaxrl_vlm.config import ConfigError, load_config
from jaxrl_vlm.job.trainer import Trainer, post_process_rewards, sample_advantages
from jaxrl_vlm.rl.advantages import compute_advantages
from jaxrl_vlm.rl.losses import LossConfig, LossInputs, custom_loss, get_loss
from jaxrl_vlm.rl.metrics import finalize_metrics
from rollout.driver import CarriedGroup, driver_state
from rollout.encoding import ChatEncoder
from rollout.hooks import HOOK_OPTIONS, HookError, load_hook, option_flag
from rollout.metrics import rollout_metrics
from rollout.sample import Sample, Status

ROOT = Path(__file__).resolve().parents[1]
HOOKS = ROOT / "configs" / "hooks"


def shipped(name: str) -> str:
    return f"{HOOKS / name}"


def user_file(tmp_path: Path, name: str, body: str) -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return path


@pytest.fixture(scope="module")
def encoder(tiny_tokenizer, tiny_image_processor) -> ChatEncoder:
    return ChatEncoder(tiny_tokenizer, tiny_image_processor)


def finished_sample(group: int, index: int, reward: float, *, text: str = "", status: Status = Status.COMPLETED,
                    model_tokens: int = 3, label: str = "3") -> Sample:
    s = Sample(group_index=group, index=index, label=label, response=text)
    s.set_prompt_tokens([1, 2, 3])
    s.append_model_tokens(list(range(10, 10 + model_tokens)), [-0.5] * model_tokens)
    s.reward = reward
    s.metadata["model_text"] = [text]
    s.set_status(status)
    return s


# ============================================================================ config: flags, loading, pairing
def test_slime_hook_flags_are_options_loaded_at_startup():
    argv = ["--custom-rm-path", shipped("custom_rm.py:group_rm"), "--group-rm",
            "--loss-type", "custom_loss", "--custom-loss-function-path", shipped("custom_loss.py:reinforce"),
            "--use-tis", "--custom-tis-function-path", shipped("custom_tis.py:masked_is")]
    cfg = load_config(None, argv)
    assert cfg.rollout.custom_rm_path.endswith("custom_rm.py:group_rm") and cfg.rollout.group_rm
    assert cfg.algo.loss_type == "custom_loss" and cfg.algo.custom_tis_function_path.endswith("masked_is")
    assert load_config(None, []).algo.loss_type == "policy_loss"


@pytest.mark.parametrize("option", HOOK_OPTIONS)
def test_a_bad_hook_path_fails_at_config_time_naming_the_flag(option, tmp_path):
    with pytest.raises(ConfigError, match=f"{option_flag(option)}: file .*missing.py does not exist"):
        load_config(None, [option_flag(option), str(tmp_path / "missing.py:fn")])
    empty = user_file(tmp_path, "empty.py", "X = 1\n")
    with pytest.raises(ConfigError, match=f"{option_flag(option)}: module .* has no attribute 'fn'"):
        load_config(None, [option_flag(option), f"{empty}:fn"])


@pytest.mark.parametrize(("argv", "needle"), [
    (["--loss-type", "custom_loss"], "--loss-type custom_loss and --custom-loss-function-path go together"),
    (["--custom-loss-function-path", shipped("custom_loss.py:reinforce")], "go together"),
    (["--custom-tis-function-path", shipped("custom_tis.py:masked_is")], "add --use-tis"),
    (["--group-rm"], "--group-rm scores groups with --custom-rm-path"),
    (["--custom-rm-path", shipped("custom_rm.py:rm"), "--rm-type", "math"], "set one"),
])
def test_hook_options_that_go_together(argv, needle):
    with pytest.raises(ConfigError, match=needle):
        load_config(None, argv)


# Every shipped example: its option, its function, and the flags it needs beside it.
EXAMPLES = [
    ("custom_rm_path", "custom_rm.py:rm", []),
    ("custom_rm_path", "custom_rm.py:group_rm", ["--group-rm"]),
    ("custom_reward_post_process_path", "reward_post_process.py:overlong_penalty", []),
    ("dynamic_sampling_filter_path", "dynamic_filter.py:informative_group", []),
    ("buffer_filter_path", "buffer_filter.py:oldest_first", []),
    ("rollout_sample_filter_path", "sample_filter.py:drop_truncated", []),
    ("rollout_all_samples_process_path", "all_samples_process.py:group_summaries", []),
    ("custom_rollout_log_function_path", "rollout_log.py:log_rollout", []),
    ("custom_loss_function_path", "custom_loss.py:reinforce", ["--loss-type", "custom_loss"]),
    ("custom_loss_function_path", "custom_loss.py:clipped_pg", ["--loss-type", "custom_loss"]),
    ("custom_tis_function_path", "custom_tis.py:masked_is", ["--use-tis"]),
    ("custom_advantage_function_path", "custom_advantage.py:group_rank", []),
]


def test_every_hook_kind_has_a_shipped_example():
    assert {option for option, _, _ in EXAMPLES} == set(HOOK_OPTIONS)
    assert all((HOOKS / path.split(":")[0]).is_file() for _, path, _ in EXAMPLES)


@pytest.mark.parametrize(("option", "path", "extra"), EXAMPLES, ids=[p for _, p, _ in EXAMPLES])
def test_each_shipped_example_loads_through_the_config(option, path, extra):
    cfg = load_config(None, [option_flag(option), shipped(path), *extra])
    section = "rollout" if hasattr(cfg.rollout, option) else "algo"
    hook = load_hook(getattr(getattr(cfg, section), option), option)
    assert callable(hook.fn) and hook.flag == option_flag(option)


# ============================================================================ --custom-rm-path
async def test_custom_rm_replaces_the_env_verdict(encoder, tmp_path):
    rm = user_file(tmp_path, "rm.py", """
        async def rm(args, sample):
            assert sample.status.value in ("completed", "truncated") and sample.reward is None
            return {"score": 0.25 + sample.index, "len": len(sample.loss_mask)}
    """)
    async with harness(encoder, lambda s: EnvSpec(turns=2, reward=1.0), custom_rm_path=f"{rm}:rm",
                       reward_key="score") as h:
        result = await run(h, 0, PromptSource(batch=2))
    assert len(result.samples) == 4 and not result.failed
    for s in result.samples:
        assert s.reward == 0.25 + s.index  # not the env's 1.0
        assert s.metadata["reward_source"] == "custom_rm" and s.metadata["reward_components"]["len"] > 0


async def test_group_rm_scores_each_group_once(encoder, tmp_path):
    rm = user_file(tmp_path, "group_rm.py", """
        CALLS = []
        async def rm(args, samples):
            CALLS.append(len(samples))
            return [10.0 * len(samples) + s.index for s in samples]
    """)
    async with harness(encoder, lambda s: EnvSpec(turns=1), custom_rm_path=f"{rm}:rm", group_rm=True,
                       n_samples_per_prompt=3) as h:
        result = await run(h, 0, PromptSource(batch=2))
    assert sorted(s.reward for s in result.groups[0]) == [30.0, 31.0, 32.0]
    assert load_hook(f"{rm}:rm", "custom_rm_path").fn.__globals__["CALLS"] == [3, 3]


async def test_custom_rm_that_raises_fails_its_episode_not_the_rollout(encoder, tmp_path):
    rm = user_file(tmp_path, "raising_rm.py", """
        async def rm(args, sample):
            if sample.index == 1:
                raise ConnectionError("reward service down")
            return 1.0
    """)
    async with harness(encoder, lambda s: EnvSpec(turns=1), custom_rm_path=f"{rm}:rm") as h:
        result = await run(h, 0, PromptSource(batch=2))
    assert all(s.index == 0 for s in result.samples) and len(result.failed) == 2
    assert all("reward service down" in s.metadata["error"] for s in result.failed)


@pytest.mark.parametrize(("body", "group_rm", "needle"), [
    ("async def rm(args, sample):\n    return 'high'\n", False,
     r"expected a reward \(a number, or a mapping reduced by --reward-key\), got str 'high'"),
    ("async def rm(args, samples):\n    return [1.0]\n", True,
     r"the rewards of a group of 2: expected a list of 2 rewards .*got list of length 1"),
])
async def test_custom_rm_wrong_return_type_is_named(encoder, tmp_path, body, group_rm, needle):
    rm = user_file(tmp_path, "bad_rm.py", body)
    async with harness(encoder, lambda s: EnvSpec(turns=1), custom_rm_path=f"{rm}:rm", group_rm=group_rm) as h:
        with pytest.raises(HookError, match=f"--custom-rm-path {rm}:rm: .*{needle}"):
            await run(h, 0, PromptSource(batch=2))


async def test_shipped_custom_rm_grades_the_model_text():
    args = types.SimpleNamespace()
    fn = load_hook(shipped("custom_rm.py:rm"), "custom_rm_path")
    right, wrong = finished_sample(0, 0, 0.0, text="so \\boxed{3}"), finished_sample(0, 1, 0.0, text="\\boxed{4}")
    cut = finished_sample(0, 2, 0.0, text="\\boxed{3}", status=Status.TRUNCATED)
    assert [await fn.call_async(args, s) for s in (right, wrong, cut)] == [1.0, 0.0, pytest.approx(0.8)]
    group = load_hook(shipped("custom_rm.py:group_rm"), "custom_rm_path")
    long_right = finished_sample(0, 3, 0.0, text="\\boxed{3}", model_tokens=9)
    assert await group.call_async(args, [long_right, wrong, right]) == [1.0, 0.0, 1.5]  # the shortest correct wins


# ============================================================================ --dynamic-sampling-filter-path
async def test_dynamic_sampling_filter_drops_what_it_says_and_counts_the_reason(encoder):
    # Even prompts: equal rewards (zero std); odd prompts: rewards 0 and 1.
    def plan(s: Sample) -> EnvSpec:
        return EnvSpec(turns=1, reward=1.0 if prompt_number(s) % 2 == 0 else float(s.index))

    path = shipped("dynamic_filter.py:informative_group")
    async with harness(encoder, plan, dynamic_sampling_filter_path=path) as h:
        result = await run(h, 0, PromptSource(batch=2))
    assert len(result.groups) == 2 and all(prompt_number(g[0]) % 2 == 1 for g in result.groups)
    assert result.dropped["zero_std_1.0"] >= 2 and result.groups_submitted >= 4  # over-sampled to refill
    assert rollout_metrics(result.samples, result)["rollout/dynamic_filter/drop_zero_std_1.0"] >= 2


async def test_dynamic_sampling_filter_may_return_a_bool(encoder, tmp_path):
    f = user_file(tmp_path, "odd.py", "def keep_odd(args, samples):\n    return int(samples[0].label) % 2 == 1\n")
    async with harness(encoder, lambda s: EnvSpec(turns=1), dynamic_sampling_filter_path=f"{f}:keep_odd") as h:
        result = await run(h, 0, PromptSource(batch=2))
    assert [prompt_number(g[0]) for g in result.groups] == [1, 3]
    assert result.dropped["dynamic_sampling_filter"] == 2


async def test_dynamic_sampling_filter_wrong_return_type_is_named(encoder, tmp_path):
    f = user_file(tmp_path, "bad_filter.py", "def keep(args, samples):\n    return 'yes'\n")
    async with harness(encoder, lambda s: EnvSpec(turns=1), dynamic_sampling_filter_path=f"{f}:keep") as h:
        with pytest.raises(HookError, match=rf"--dynamic-sampling-filter-path {f}:keep: expected a bool or a "
                                            r"DynamicFilterOutput\(keep: bool, reason: str \| None\), got str 'yes'"):
            await run(h, 0, PromptSource(batch=2))


# ============================================================================ --buffer-filter-path
def carry(args: types.SimpleNamespace, groups: list[list[Sample]], versions: list[str]) -> None:
    """Put finished groups back into the driver state as groups carried by partial rollout."""
    for group, version in zip(groups, versions):
        for s in group:
            s.weight_versions = [version]
    state = driver_state(args)
    state.partial_groups = [CarriedGroup(g[0].group_index, Sample(prompt=g[0].prompt, label=g[0].label), g)
                            for g in groups]


async def test_buffer_filter_picks_the_carried_groups_that_resume(encoder):
    async with harness(encoder, lambda s: EnvSpec(turns=1), rollout_batch_size=3,
                       buffer_filter_path=shipped("buffer_filter.py:oldest_first"),
                       over_sampling_batch_size=1) as h:
        first = await run(h, 0, PromptSource(batch=3))
        carried = [g[0].group_index for g in first.groups]
        carry(h.args, first.groups, ["7", "3", "5"])  # group 1 is the stalest, then group 2
        h.args.rollout_batch_size = 2
        second = await run(h, 1, PromptSource(batch=2, start=100))
    # num_samples = --over-sampling-batch-size 1: only the stalest group resumes; the others stay carried.
    assert [g[0].group_index for g in second.groups][0] == carried[1]
    assert prompt_number(second.groups[1][0]) >= 100  # the rest of the step is new prompts
    left = driver_state(h.args).partial_groups
    assert [c.group_index for c in left] == [carried[2], carried[0]]  # sorted by staleness, still carried


async def test_buffer_filter_discards_what_it_removes_without_returning(encoder, tmp_path):
    f = user_file(tmp_path, "clear.py", "def clear(args, rollout_id, buffer, num_samples):\n"
                                        "    buffer.clear()\n    return []\n")
    async with harness(encoder, lambda s: EnvSpec(turns=1), buffer_filter_path=f"{f}:clear") as h:
        first = await run(h, 0, PromptSource(batch=2))
        carry(h.args, first.groups, ["1", "1"])
        second = await run(h, 1, PromptSource(batch=2, start=100))
    assert all(prompt_number(g[0]) >= 100 for g in second.groups)
    assert second.dropped["buffer_filter_discarded_group"] == 2 and not driver_state(h.args).partial_groups


@pytest.mark.parametrize(("body", "needle"), [
    ("def f(args, rollout_id, buffer, num_samples):\n    return None\n",
     r"expected a list of groups \(list\[Sample\]\), got NoneType None"),
    ("from rollout.sample import Sample\ndef f(args, rollout_id, buffer, num_samples):\n    return [[Sample()]]\n",
     r"group 0: expected a group of the buffer it was given \(the same samples\), got list of length 1"),
])
async def test_buffer_filter_wrong_return_type_is_named(encoder, tmp_path, body, needle):
    f = user_file(tmp_path, "bad_buffer.py", body)
    async with harness(encoder, lambda s: EnvSpec(turns=1), buffer_filter_path=f"{f}:f") as h:
        first = await run(h, 0, PromptSource(batch=2))
        carry(h.args, first.groups, ["1", "1"])
        with pytest.raises(HookError, match=f"--buffer-filter-path {f}:f: {needle}"):
            await run(h, 1, PromptSource(batch=2))


# ============================================================================ --rollout-sample-filter-path
async def test_sample_filter_removes_samples_from_the_loss(encoder):
    from test_batching import build, make_batch_samples

    # Index 1 of every group runs out of response budget (its env never says done).
    def plan(s: Sample) -> EnvSpec:
        return EnvSpec(turns=1 if s.index == 0 else 99)

    async with harness(encoder, plan, max_turns=99, rollout_max_response_len=40,
                       rollout_sample_filter_path=shipped("sample_filter.py:drop_truncated")) as h:
        result = await run(h, 0, PromptSource(batch=2))
    assert [(s.index, s.status, s.remove_sample) for s in result.groups[0]] == [
        (0, Status.COMPLETED, False), (1, Status.TRUNCATED, True)]
    assert rollout_metrics(result.samples, result)["rollout/removed_samples"] == 2.0

    # The batch gives a removed sample no trainable token.
    samples, adv = make_batch_samples(0, 4, image_rate=0.0)
    samples[1].remove_sample = True
    kept_tokens = sum(sum(s.loss_mask) for i, s in enumerate(samples) if i != 1)
    assert sum(samples[1].loss_mask) > 0 and build(samples, adv).arrays.loss_mask.sum() == kept_tokens


@pytest.mark.parametrize(("body", "needle"), [
    ("def f(args, groups):\n    return groups\n", r"expected None \(it marks samples .*\), got list of length 2"),
    ("def f(args, groups):\n    groups[0][0].remove_sample = 1\n",
     r"sample\(group=0, index=0\): expected sample.remove_sample to be a bool, got int 1"),
])
async def test_sample_filter_wrong_return_type_is_named(encoder, tmp_path, body, needle):
    f = user_file(tmp_path, "bad_sample_filter.py", body)
    async with harness(encoder, lambda s: EnvSpec(turns=1), rollout_sample_filter_path=f"{f}:f") as h:
        with pytest.raises(HookError, match=f"--rollout-sample-filter-path {f}:f: {needle}"):
            await run(h, 0, PromptSource(batch=2))


# ============================================================================ --rollout-all-samples-process-path
async def test_all_samples_process_sees_dropped_groups_too(encoder, tmp_path):
    def plan(s: Sample) -> EnvSpec:
        return EnvSpec(turns=1, reward=1.0 if prompt_number(s) % 2 == 0 else float(s.index))

    async with harness(encoder, plan, dynamic_filter="zero_std", output_dir=str(tmp_path),
                       rollout_all_samples_process_path=shipped("all_samples_process.py:group_summaries")) as h:
        result = await run(h, 0, PromptSource(batch=2))
    lines = [json.loads(line) for line in (tmp_path / "all_groups.jsonl").read_text().splitlines()]
    assert len(lines) == len(result.groups) + result.dropped["zero_std_group"] > len(result.groups)
    assert any(line["rewards"] == [1.0, 1.0] for line in lines)  # a dropped group is in it
    assert all(line["rollout_id"] == 0 and line["statuses"] == ["completed"] * 2 for line in lines)


async def test_all_samples_process_wrong_return_type_is_named(encoder, tmp_path):
    f = user_file(tmp_path, "bad_all.py", "def f(args, all_groups, data_source):\n    return len(all_groups)\n")
    async with harness(encoder, lambda s: EnvSpec(turns=1), rollout_all_samples_process_path=f"{f}:f") as h:
        with pytest.raises(HookError, match=rf"--rollout-all-samples-process-path {f}:f: expected None .*got int 2"):
            await run(h, 0, PromptSource(batch=2))


# ============================================================================ --custom-rollout-log-function-path
async def test_rollout_log_function_adds_metrics(encoder):
    async with harness(encoder, lambda s: EnvSpec(turns=1 + s.index, reward=float(s.index)),
                       custom_rollout_log_function_path=shipped("rollout_log.py:log_rollout")) as h:
        result = await run(h, 0, PromptSource(batch=2))
    metrics = rollout_metrics(result.samples, result)
    assert metrics["rollout/reward_by_turns/1"] == 0.0 and metrics["rollout/reward_by_turns/2"] == 1.0
    assert metrics["rollout/model_tokens_per_s"] > 0 and "rollout/raw_reward" in metrics  # defaults kept


async def test_rollout_log_function_returning_true_skips_the_default_metrics(encoder, tmp_path):
    f = user_file(tmp_path, "log.py", """
        SEEN = []
        def log(rollout_id, args, samples, rollout_extra_metrics, rollout_time):
            SEEN.append((rollout_id, len(samples), rollout_time > 0))
            rollout_extra_metrics["mine/samples"] = len(samples)
            return True
    """)
    async with harness(encoder, lambda s: EnvSpec(turns=1), custom_rollout_log_function_path=f"{f}:log") as h:
        result = await run(h, 7, PromptSource(batch=2))
    assert rollout_metrics(result.samples, result) == {"mine/samples": 4.0}
    assert load_hook(f"{f}:log", "custom_rollout_log_function_path").fn.__globals__["SEEN"] == [(7, 4, True)]


@pytest.mark.parametrize(("body", "needle"), [
    ("def f(rollout_id, args, samples, extra, t):\n    return None\n",
     r"expected a bool \(True skips the default rollout metrics\), got NoneType None"),
    ("def f(rollout_id, args, samples, extra, t):\n    extra['x'] = 'high'\n    return False\n",
     r"metric 'x': expected a finite number, got str 'high'"),
])
async def test_rollout_log_function_wrong_return_type_is_named(encoder, tmp_path, body, needle):
    f = user_file(tmp_path, "bad_log.py", body)
    async with harness(encoder, lambda s: EnvSpec(turns=1), custom_rollout_log_function_path=f"{f}:f") as h:
        with pytest.raises(HookError, match=f"--custom-rollout-log-function-path {f}:f: {needle}"):
            await run(h, 0, PromptSource(batch=2))


# ============================================================================ eval rollouts
def test_eval_rollouts_leave_out_the_training_only_hooks():
    from jaxrl_vlm.job.eval import TRAINING_ONLY_HOOKS

    assert set(TRAINING_ONLY_HOOKS) | {"custom_rm_path"} == {o for o in HOOK_OPTIONS if hasattr(
        load_config(None, []).rollout, o)}


# ============================================================================ --custom-reward-post-process-path
def trainer_for(tmp_path: Path, *argv: str) -> Trainer:
    return Trainer(load_config(None, ["--output-dir", str(tmp_path / "run"), *argv]))


def rollout_samples() -> list[Sample]:
    """Two groups of three finished samples with distinct rewards and lengths."""
    rewards = [[0.0, 1.0, 1.0], [2.0, 0.5, 0.0]]
    return [finished_sample(g, i, r, model_tokens=4 + 30 * i) for g, rs in enumerate(rewards) for i, r in enumerate(rs)]


def test_reward_post_process_feeds_the_advantages(tmp_path):
    samples = rollout_samples()
    path = shipped("reward_post_process.py:overlong_penalty")
    trainer = trainer_for(tmp_path, "--custom-reward-post-process-path", path, "--rollout-max-response-len", "80")
    advantages, metrics = trainer.advantages(samples)
    # DAPO's soft zone is the last 20 tokens of 80: 4 tokens no penalty, 34 none, 64 -> (64 - 60) / 20 = 0.2.
    processed = np.array([0.0, 1.0, 0.8, 2.0, 0.5, -0.2])
    groups = np.array([s.group_index for s in samples])
    np.testing.assert_allclose(advantages, compute_advantages(processed, groups, "grpo"))
    assert metrics["rollout/raw_reward"] == pytest.approx(np.mean([s.reward for s in samples]))
    assert metrics["rollout/rewards"] == pytest.approx(processed.mean())


@pytest.mark.parametrize(("body", "needle"), [
    ("def f(args, samples):\n    return [s.reward for s in samples]\n",
     r"expected a \(raw_rewards, rewards\) tuple, got list of length 6"),
    ("def f(args, samples):\n    raw = [s.reward for s in samples]\n    return raw, raw[:5]\n",
     r"rewards: expected a list of 6 numbers, got list of length 5"),
    ("def f(args, samples):\n    raw = [s.reward for s in samples]\n    return raw, [float('nan')] * 6\n",
     r"rewards item 0 is nan: expected finite values"),
])
def test_reward_post_process_wrong_return_type_is_named(tmp_path, body, needle):
    f = user_file(tmp_path, "bad_post.py", body)
    hook = load_hook(f"{f}:f", "custom_reward_post_process_path")
    with pytest.raises(HookError, match=f"--custom-reward-post-process-path {f}:f: {needle}"):
        post_process_rewards(hook, types.SimpleNamespace(), rollout_samples())


# ============================================================================ --custom-advantage-function-path
def test_custom_advantage_function_replaces_the_estimator(tmp_path):
    samples = rollout_samples()
    cfg = load_config(None, ["--custom-advantage-function-path", shipped("custom_advantage.py:group_rank")])
    # Group 0 rewards (0, 1, 1): ranks 0, 1.5, 1.5 of 2 -> -1, 0.5, 0.5; group 1 (2, 0.5, 0): 1, 0, -1.
    np.testing.assert_allclose(sample_advantages(samples, cfg), [-1.0, 0.5, 0.5, 1.0, 0.0, -1.0])


@pytest.mark.parametrize(("body", "needle"), [
    ("def f(rewards, group_index, *, std_normalization, eps):\n    return rewards[:-1]\n",
     r"advantages: expected a float array of shape \(6,\), got ndarray of dtype float64 and shape \(5,\)"),
    ("def f(rewards, group_index, *, std_normalization, eps):\n    return [1.0] * 5\n",
     r"advantages: expected a list of 6 numbers, got list of length 5"),
    ("import numpy as np\ndef f(rewards, group_index, *, std_normalization, eps):\n    return rewards * np.nan\n",
     r"advantages item 0 is nan: expected finite values"),
])
def test_custom_advantage_wrong_return_type_is_named(tmp_path, body, needle):
    f = user_file(tmp_path, "bad_adv.py", body)
    cfg = load_config(None, ["--custom-advantage-function-path", f"{f}:f"])
    with pytest.raises(HookError, match=f"--custom-advantage-function-path {f}:f: {needle}"):
        sample_advantages(rollout_samples(), cfg)


# ============================================================================ --custom-loss-function-path
def loss_inputs(**overrides) -> LossInputs:
    """One micro-batch [2, 4]: two sequences, an observation hole, a padding slot, ratios away from 1."""
    base = dict(
        logprobs=jnp.array([[-0.5, -1.0, -2.0, -0.3], [-1.5, -0.2, -0.7, 0.0]]),
        old_logprobs=jnp.array([[-0.6, -0.7, -2.0, -0.1], [-1.0, -0.3, -0.9, 0.0]]),
        advantages=jnp.array([[1.0, 1.0, 1.0, 1.0], [-2.0, -2.0, -2.0, 0.0]]),
        loss_mask=jnp.array([[1.0, 1.0, 0.0, 1.0], [1.0, 1.0, 1.0, 0.0]]),
        sequence_ids=jnp.array([[0, 0, 0, 0], [1, 1, 1, -1]], jnp.int32),
        token_weights=jnp.array([[0.2, 0.2, 0.0, 0.2], [0.1, 0.1, 0.1, 0.0]]),
        rollout_logprobs=jnp.array([[-0.6, -2.5, 0.0, -0.1], [-1.0, -0.3, 0.0, 0.0]]),
    )
    base.update(overrides)
    return LossInputs(**base)


def test_custom_loss_matches_the_closed_form_inside_jit():
    inputs, cfg = loss_inputs(), LossConfig(num_sequences=2)
    fn = jax.jit(custom_loss(shipped("custom_loss.py:reinforce")), static_argnums=1)
    loss, metrics = fn(inputs, cfg)
    x = {k: np.asarray(getattr(inputs, k)) for k in ("logprobs", "advantages", "loss_mask", "token_weights")}
    expected = np.sum(x["token_weights"] * x["loss_mask"] * -x["advantages"] * x["logprobs"])
    assert float(loss) == pytest.approx(expected, rel=1e-6)
    assert float(metrics["weight_sum"].value) == pytest.approx(0.9)
    assert float(metrics["loss"].value) == pytest.approx(expected)
    grad = jax.grad(lambda lp: fn(loss_inputs(logprobs=lp), cfg)[0])(inputs.logprobs)
    np.testing.assert_allclose(grad, x["token_weights"] * x["loss_mask"] * -x["advantages"], rtol=1e-6)


def test_custom_loss_reimplementing_ppo_clip_equals_the_builtin():
    cfg = LossConfig(eps_clip=0.2, eps_clip_high=0.28, num_sequences=2)
    inputs = loss_inputs(rollout_logprobs=None)
    ours = custom_loss(shipped("custom_loss.py:clipped_pg"))

    def value_and_grad(fn):
        return jax.jit(jax.value_and_grad(lambda lp: fn(loss_inputs(logprobs=lp, rollout_logprobs=None), cfg)[0]))(
            inputs.logprobs)

    (l_ours, g_ours), (l_builtin, g_builtin) = value_and_grad(ours), value_and_grad(get_loss("ppo_clip"))
    assert float(l_ours) == pytest.approx(float(l_builtin), rel=1e-6) and float(l_ours) != 0.0
    np.testing.assert_allclose(g_ours, g_builtin, rtol=1e-6, atol=1e-7)
    # The example tags its clip fraction as a token-weighted mean: it reduces to the builtin's.
    clipfrac = finalize_metrics(ours(inputs, cfg)[1])["pg_clipfrac"]
    builtin = finalize_metrics(get_loss("ppo_clip")(inputs, cfg)[1])["pg_clipfrac"]
    assert float(clipfrac) == pytest.approx(float(builtin)) and float(builtin) > 0.0


@pytest.mark.parametrize(("body", "needle"), [
    ("def f(inputs, cfg):\n    return (inputs.logprobs * inputs.token_weights).sum()\n",
     r"expected a \(loss, metrics\) tuple, got .*Tracer of dtype float32 and shape \(\)"),
    ("def f(inputs, cfg):\n    return inputs.logprobs * inputs.token_weights, {}\n",
     r"loss: expected a float array of shape \(\), got .* and shape \(2, 4\)"),
    ("def f(inputs, cfg):\n    return (inputs.logprobs * inputs.token_weights).sum(), {'n': 3}\n",
     r"metrics\['n'\]: expected a Metric tagged with its reduction over micro-batches: Metric.sum\(x\), .*got int 3"),
    # A plain array says nothing about how it combines over micro-batches: it must be tagged.
    ("def f(inputs, cfg):\n    x = (inputs.logprobs * inputs.token_weights).sum()\n    return x, {'pg_loss': x}\n",
     r"metrics\['pg_loss'\]: expected a Metric tagged with its reduction .*got .*Tracer"),
    ("from jaxrl_vlm.rl.metrics import Metric\n"
     "def f(inputs, cfg):\n    x = (inputs.logprobs * inputs.token_weights).sum()\n"
     "    return x, {'n': Metric.mean(x, inputs.loss_mask)}\n",
     r"metrics\['n'\].weight: expected a float array of shape \(\), got .* and shape \(2, 4\)"),
])
def test_custom_loss_wrong_return_type_is_named(tmp_path, body, needle):
    f = user_file(tmp_path, "bad_loss.py", body)
    with pytest.raises(HookError, match=f"--custom-loss-function-path {f}:f: {needle}"):
        jax.jit(custom_loss(f"{f}:f"), static_argnums=1)(loss_inputs(), LossConfig())


# ============================================================================ --custom-tis-function-path
def test_custom_tis_masks_rejected_tokens_in_closed_form():
    cfg = LossConfig(rollout_correction="custom", rollout_correction_low=0.5, rollout_correction_high=2.0,
                     num_sequences=2, custom_tis_function_path=shipped("custom_tis.py:masked_is"))
    inputs = loss_inputs(old_logprobs=loss_inputs().logprobs)  # ratio 1: the pg loss per token is -A
    loss, metrics = jax.jit(get_loss("ppo_clip"), static_argnums=1)(inputs, cfg)
    x = {k: np.asarray(getattr(inputs, k)) for k in ("old_logprobs", "rollout_logprobs", "advantages", "loss_mask",
                                                     "token_weights")}
    is_ratio = np.exp(np.where(x["loss_mask"] > 0, x["old_logprobs"] - x["rollout_logprobs"], 0.0))
    keep = (is_ratio >= 0.5) & (is_ratio <= 2.0)
    assert keep[x["loss_mask"] > 0].tolist().count(False) == 2  # two tokens rejected
    w = x["token_weights"] * x["loss_mask"]
    assert float(loss) == pytest.approx(np.sum(w * keep * -x["advantages"] * is_ratio), rel=1e-6)
    # Its per-token metrics are token-weighted partial sums over the trainable tokens (finalize divides).
    assert float(metrics["tis/rejected"].value) == pytest.approx(np.sum(w * ~keep), rel=1e-6)
    assert float(metrics["tis/rejected"].weight) == pytest.approx(np.sum(w), rel=1e-6)


def test_custom_tis_reimplementing_the_builtin_equals_it(tmp_path):
    f = user_file(tmp_path, "vanilla_tis.py", """
        import jax
        import jax.numpy as jnp
        def tis(pg_loss, inputs, cfg):
            sg = jax.lax.stop_gradient
            w = jnp.exp(jnp.where(inputs.loss_mask > 0, sg(inputs.old_logprobs) - sg(inputs.rollout_logprobs), 0.0))
            lo, hi = cfg.rollout_correction_low, cfg.rollout_correction_high
            return pg_loss * jnp.clip(w, lo, hi), jnp.ones_like(pg_loss), {}
    """)
    base = LossConfig(rollout_correction="token_tis", rollout_correction_low=0.1, rollout_correction_high=1.5,
                      num_sequences=2, use_kl_loss=True, kl_loss_coef=0.1, entropy_coef=0.01)
    custom = LossConfig(**{**base.__dict__, "rollout_correction": "custom", "custom_tis_function_path": f"{f}:tis"})
    inputs = loss_inputs(ref_logprobs=loss_inputs().old_logprobs - 0.1, entropy=jnp.full((2, 4), 0.7))
    fn = jax.jit(get_loss("cispo"), static_argnums=1)
    (l_builtin, m_builtin), (l_custom, m_custom) = fn(inputs, base), fn(inputs, custom)
    assert float(l_custom) == pytest.approx(float(l_builtin), rel=1e-6)
    # Every metric agrees; the hook's own weighting is inside the loss it returns, so it has no weight_mean.
    builtin = finalize_metrics(m_builtin)
    assert builtin.pop("rollout_corr/weight_mean") > 0
    assert {k: pytest.approx(float(v), rel=1e-6) for k, v in builtin.items()} == {
        k: float(v) for k, v in finalize_metrics(m_custom).items()}


@pytest.mark.parametrize(("body", "needle"), [
    ("def f(pg_loss, inputs, cfg):\n    return pg_loss, inputs.loss_mask\n",
     r"expected a \(pg_loss, loss_mask, metrics\) tuple, got tuple of length 2"),
    ("def f(pg_loss, inputs, cfg):\n    return pg_loss.sum(), inputs.loss_mask, {}\n",
     r"pg_loss: expected a float array of shape \(2, 4\), got .* and shape \(\)"),
    ("def f(pg_loss, inputs, cfg):\n    return pg_loss, inputs.loss_mask[0], {}\n",
     r"loss_mask: expected an array of shape \(2, 4\), got .* and shape \(4,\)"),
])
def test_custom_tis_wrong_return_type_is_named(tmp_path, body, needle):
    f = user_file(tmp_path, "bad_tis.py", body)
    cfg = LossConfig(rollout_correction="custom", custom_tis_function_path=f"{f}:f")
    with pytest.raises(HookError, match=f"--custom-tis-function-path {f}:f: {needle}"):
        jax.jit(get_loss("ppo_clip"), static_argnums=1)(loss_inputs(), cfg)


# ============================================================================ inside the compiled train step
@pytest.mark.slow
def test_custom_loss_trains_in_the_compiled_step_like_the_builtin(tmp_path_factory, make_test_image):
    from _train_samples import train_samples

    from jaxrl_vlm.tiny import make_tiny

    tiny = make_tiny(tmp_path_factory.mktemp("tiny") / "model", seed=5)
    samples = [s for s in train_samples(tiny, make_test_image) if not s.image_data]  # text only: compiles faster
    trainer = Trainer(load_config(None, [
        "--hf-checkpoint", str(tiny), "--lr", "1e-3", "--seq-buckets", "256", "--row-buckets", "4",
        "--patch-buckets", "0", "--logprob-chunk-size", "64", "--mesh-data", "1", "--eps-clip-high", "0.28",
        "--output-dir", str(tmp_path_factory.mktemp("run")),
    ]), devices=jax.devices()[:1])
    trainer.build_policy(tiny)
    start = jax.tree.map(jnp.copy, trainer.state)
    builtin = trainer.train_on(samples)
    after_builtin = [np.asarray(x) for x in jax.tree.leaves(trainer.state.params)]

    trainer.state = start
    trainer.cfg.algo.loss_type = "custom_loss"
    trainer.cfg.algo.custom_loss_function_path = shipped("custom_loss.py:clipped_pg")
    trainer._step_fns.clear()
    custom = trainer.train_on(samples)
    assert custom["train/loss_total"] == pytest.approx(builtin["train/loss_total"], rel=1e-5)
    assert "train/ratio_max" not in custom and custom["train/skipped_nonfinite"] == 0.0  # the custom loss ran
    for a, b in zip(after_builtin, jax.tree.leaves(trainer.state.params)):
        np.testing.assert_allclose(np.asarray(b), a, rtol=1e-4, atol=1e-6)
