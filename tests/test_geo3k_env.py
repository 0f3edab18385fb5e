"""Geo3kEnv: scripted multi-turn episodes through build_env, feedback, verdict, reward_fn, observation format."""

from __future__ import annotations

import asyncio
import inspect
import json
from types import SimpleNamespace

import pytest
from PIL import Image

from envs import geo3k, grading
from envs.base import BaseInteractionEnv
from envs.geo3k import CONFIG_KEYS, Geo3kEnv, build_env, final_model_answer, parse_tool_calls, reward_fn
from envs.grading import extract_final_answer, grade_answer
from rollout.sample import Sample


@pytest.fixture(scope="module", autouse=True)
def worker_pool():
    grading.configure_grading(2)
    yield
    grading.shutdown_grading_workers()


def tool(answer, name: str = "calc_geo3k_reward") -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": {"answer": answer}}) + "</tool_call>"


def make_env(label: str = "5\\sqrt{3}", max_turns: int = 3, **extra) -> Geo3kEnv:
    sample = Sample(group_index=1, index=2, label=label)
    env = build_env(sample, SimpleNamespace(max_turns=max_turns, **extra))
    env.reset()
    return env


async def play(env: Geo3kEnv, turns: list[str]) -> list[tuple[dict, bool, dict]]:
    out = []
    for text in turns:
        result = env.step(text)
        assert inspect.isawaitable(result)  # the rollout awaits awaitable steps
        out.append(await result)
    return out


def assert_feedback_never_boxes_an_answer(steps, label: str) -> None:
    for obs, _, _ in steps:
        boxed = extract_final_answer(obs["obs_str"])
        assert boxed is None or not grade_answer(boxed, label)


# ------------------------------------------------------------------ scripted episodes
async def test_correct_tool_call_ends_the_episode():
    env = make_env()
    steps = await play(env, ["Height is 5 times root 3. " + tool("8.66")])
    obs, done, info = steps[0]
    assert done is True
    assert info["answer_source"] == "tool" and info["answer"] == "8.66" and info["correct"] is True
    assert obs["role"] == "tool" and obs["obs_str"].startswith("Correct")
    assert env.verdict() == 1.0
    with pytest.raises(RuntimeError, match="after the episode ended"):
        await env.step(tool("8.66"))


async def test_wrong_answers_then_last_chance_warning_then_out_of_turns():
    env = make_env(max_turns=3)
    steps = await play(env, [tool("7"), tool("8"), tool("9")])
    (o1, d1, i1), (o2, d2, i2), (o3, d3, i3) = steps
    assert (d1, d2, d3) == (False, False, True)
    assert [i["feedback_kind"] for i in (i1, i2, i3)] == ["incorrect"] * 3
    assert o1["obs_str"].startswith("Incorrect") and "last chance" not in o1["obs_str"].lower()
    assert "last chance" in o2["obs_str"].lower()  # turn 2 of 3: one turn left
    assert "no turns left" in o3["obs_str"].lower()
    assert env.verdict() == 0.0
    assert_feedback_never_boxes_an_answer(steps, env.label)


async def test_recovery_after_a_wrong_answer():
    env = make_env(max_turns=3)
    steps = await play(env, [tool("9"), tool("5\\sqrt{3}")])
    assert [d for _, d, _ in steps] == [False, True]
    assert env.verdict() == 1.0


@pytest.mark.parametrize(
    "turn,error",
    [
        ('<tool_call>{"name": "calc_geo3k_reward", "arguments": {"answer": "8.66"}</tool_call>', "not valid JSON"),
        ("<tool_call>{'name': 'calc_geo3k_reward', 'arguments': {'answer': '8.66'}}</tool_call>", "not valid JSON"),
        (tool("8.66", name="calculator"), "unknown tool 'calculator'"),
        ('<tool_call>{"name": "calc_geo3k_reward", "arguments": {"value": "8.66"}}</tool_call>', "no 'answer'"),
        ('<tool_call>{"name": "calc_geo3k_reward", "arguments": {"answer": ""}}</tool_call>', "non-empty"),
        ('<tool_call>{"name": "calc_geo3k_reward", "arguments": "8.66"}</tool_call>', "'arguments' must be"),
        ('<tool_call>["calc_geo3k_reward", "8.66"]</tool_call>', "JSON object"),
        ('<tool_call>{"name": "calc_geo3k_reward", "arguments": {"answer": "8.66"}}', "not closed"),
    ],
)
async def test_malformed_tool_calls_get_feedback_naming_the_error(turn, error):
    env = make_env(max_turns=3)
    (obs, done, info), = await play(env, [turn])
    assert done is False
    assert info["feedback_kind"] == "malformed" and error in info["error"]
    assert obs["role"] == "tool" and error in obs["obs_str"] and "calc_geo3k_reward" in obs["obs_str"]
    assert env.verdict() is None  # a malformed call is not an answer


async def test_last_tool_call_of_the_turn_is_the_answer_and_calc_score_is_accepted():
    env = make_env(max_turns=3)
    (_, done, info), = await play(env, [tool("5\\sqrt{3}") + " wait, no: " + tool("9", name="calc_score")])
    assert info["answer"] == "9" and info["correct"] is False and done is False
    (_, done, info), = await play(env, [tool("8.66", name="calc_score")])
    assert info["correct"] is True and done is True


async def test_numeric_json_answer_is_graded():
    env = make_env(label="12", max_turns=2)
    (_, done, info), = await play(env, ['<tool_call>{"name": "calc_geo3k_reward", "arguments": {"answer": 12}}</tool_call>'])
    assert info["answer"] == "12" and info["correct"] is True and done is True


@pytest.mark.parametrize("answer,verdict", [("\\frac{10\\sqrt{3}}{2}", 1.0), ("10", 0.0)])
async def test_boxed_final_answer_without_tool_call_ends_the_episode(answer, verdict):
    env = make_env(max_turns=3)
    (obs, done, info), = await play(env, [f"So the height is \\boxed{{{answer}}}."])
    assert done is True and obs["role"] == "user"
    assert info["answer_source"] == "boxed" and info["answer"] == answer
    assert env.verdict() == verdict


async def test_no_answer_asks_for_the_format_until_turns_run_out():
    env = make_env(max_turns=2)
    steps = await play(env, ["Let me think about the triangle.", "Still thinking."])
    (o1, d1, i1), (o2, d2, i2) = steps
    assert (d1, d2) == (False, True)
    assert i1["feedback_kind"] == i2["feedback_kind"] == "no_answer"
    assert o1["role"] == "user" and "calc_geo3k_reward" in o1["obs_str"] and "\\boxed" in o1["obs_str"]
    assert "last chance" in o1["obs_str"].lower()  # max_turns=2: after turn 1 one turn is left
    assert env.verdict() is None
    assert reward_fn("Let me think about the triangle.Still thinking.", env.label) == 0.0
    assert_feedback_never_boxes_an_answer(steps, env.label)


async def test_max_turns_one_ends_after_the_first_turn():
    env = make_env(max_turns=1)
    (obs, done, info), = await play(env, [tool("1")])
    assert done is True and info["correct"] is False
    assert "no turns left" in obs["obs_str"].lower() and "last chance" not in obs["obs_str"].lower()


async def test_end_on_correct_false_asks_for_a_boxed_final_answer():
    env = make_env(max_turns=3, end_on_correct=False)
    (o1, d1, _), (o2, d2, i2) = await play(env, [tool("8.66"), "Final: \\boxed{5\\sqrt{3}}"])
    assert d1 is False and o1["obs_str"].startswith("Correct") and "\\boxed{}" in o1["obs_str"]
    assert d2 is True and i2["answer_source"] == "boxed"
    assert env.verdict() == 1.0


async def test_end_on_boxed_answer_false_keeps_going_after_a_wrong_box():
    env = make_env(max_turns=3, end_on_boxed_answer=False)
    (o1, d1, i1), (_, d2, i2) = await play(env, ["\\boxed{4}", "\\boxed{5\\sqrt{3}}"])
    assert d1 is False and i1["correct"] is False and o1["obs_str"].startswith("Incorrect")
    assert d2 is True and i2["correct"] is True  # correct + end_on_correct (default) ends it
    assert env.verdict() == 1.0


async def test_verdict_follows_the_last_answer():
    env = make_env(max_turns=3, end_on_correct=False)
    await play(env, [tool("8.66"), "\\boxed{9}"])
    assert env.verdict() == 0.0  # the decisive (final) answer was wrong


async def test_concurrent_episodes_and_close():
    envs = [make_env(label=str(k), max_turns=2) for k in range(4)]
    results = await asyncio.gather(*(env.step(tool(str(k if k % 2 == 0 else k + 1))) for k, env in enumerate(envs)))
    assert [info["correct"] for _, _, info in results] == [True, False, True, False]
    for env in envs:
        env.close()
        env.close()  # idempotent
        with pytest.raises(RuntimeError, match="close"):
            await env.step(tool("1"))


async def test_reset_restarts_the_episode():
    env = make_env(max_turns=2)
    await play(env, [tool("8.66")])
    env.reset()
    assert env.turn == 0 and env.verdict() is None
    (_, done, _), = await play(env, [tool("1")])
    assert done is False


# ------------------------------------------------------------------ reward on model text only
def test_reward_fn_uses_the_last_answer_in_model_text():
    label = "5\\sqrt{3}"
    assert reward_fn(tool("9") + " then " + tool("8.66"), label) == 1.0
    assert reward_fn(tool("8.66") + " then \\boxed{9}", label) == 0.0  # the box comes later
    assert reward_fn("\\boxed{9} then " + tool("8.66"), label) == 1.0  # the tool call comes later
    assert reward_fn(tool("8.66", name="calculator"), label) == 0.0  # invalid calls are not answers
    assert reward_fn("no answer at all", label) == 0.0
    assert reward_fn("\\boxed{5\\sqrt3}", label) == 1.0


async def test_env_feedback_with_a_box_is_never_graded_as_the_answer():
    env = make_env(label="5", max_turns=3)
    model_turns = [tool("3"), tool("4")]
    steps = await play(env, model_turns)
    assert_feedback_never_boxes_an_answer(steps, "5")
    # A feedback string that does box the gold answer (slime's echo style) must not leak into the reward:
    echoed_feedback = "Your answer \\boxed{5} is wrong."
    model_text = "".join(model_turns)
    assert reward_fn(model_text, "5") == 0.0
    assert env.verdict() == 0.0
    assert reward_fn(model_text + echoed_feedback, "5") == 1.0  # what grading a whole transcript would do


def test_parse_tool_calls_positions_and_final_answer():
    text = "a" + tool("1") + "b" + tool("2")
    calls = parse_tool_calls(text)
    assert [c.answer for c in calls] == ["1", "2"]
    assert calls[0].start == 1 and text[calls[1].end :] == ""
    assert final_model_answer(text) == "2"
    assert final_model_answer("<tool_call>{bad</tool_call>") is None


# ------------------------------------------------------------------ observations, build_env, config
def test_format_observation_roles_and_image_order():
    env = make_env()
    img = Image.new("RGB", (8, 8), "red")
    msg = env.format_observation({"obs_str": "look", "multi_modal_data": {"image": [img, "data:image/png;base64,AAAA"]}})
    assert msg["role"] == "user"
    assert [c["type"] for c in msg["content"]] == ["image", "image", "text"]
    assert msg["content"][0]["image"] is img and msg["content"][2]["text"] == "look"
    assert env.format_observation({"obs_str": "x", "role": "tool"}) == {
        "role": "tool",
        "content": [{"type": "text", "text": "x"}],
    }
    with pytest.raises(TypeError, match=r"\['image'\]\[0\]"):
        env.format_observation({"obs_str": "x", "multi_modal_data": {"image": ["/tmp/not-a-data-url.png"]}})
    with pytest.raises(ValueError, match=r"unsupported keys \['audio'\]"):  # clips are a modality; audio is not
        env.format_observation({"obs_str": "x", "multi_modal_data": {"audio": []}})
    assert env.format_observation({"obs_str": "x", "multi_modal_data": {"video": []}})["content"] == [
        {"type": "text", "text": "x"}]
    with pytest.raises(ValueError, match="role"):
        env.format_observation({"obs_str": "x", "role": "system"})


async def test_step_observation_formats_to_a_tool_or_user_message():
    env = make_env(max_turns=3)
    (obs, _, _), = await play(env, [tool("1")])
    assert env.format_observation(obs)["role"] == "tool"
    (obs, _, _), = await play(env, ["thinking"])
    assert env.format_observation(obs)["role"] == "user"


def test_base_env_defaults():
    class Echo(BaseInteractionEnv):
        def reset(self) -> None:
            pass

        def step(self, response_text: str):
            return {"obs_str": response_text}, True, {}

    env = Echo()
    assert env.recoverable is False and env.verdict() is None
    env.close()
    with pytest.raises(TypeError):
        BaseInteractionEnv()  # abstract


async def test_shared_step_preamble_refuses_closed_ended_and_non_text_turns():
    env = make_env(max_turns=2)
    with pytest.raises(TypeError, match=r"Geo3kEnv.step: response_text must be str, got bytes"):
        await env.step(b"12")
    env.close()
    with pytest.raises(RuntimeError, match=r"Geo3kEnv.step called after close\(\)"):
        await env.step(tool("12"))


def test_env_options_dataclass_derives_config_keys_and_checks_values():
    from dataclasses import dataclass

    from envs.base import EnvOptions, option

    @dataclass(frozen=True)
    class ToyOptions(EnvOptions):
        ENV_NAME = "toy"

        toy_url: str | None = option(None, "toy: url (required).", required=True)
        toy_tries: int = option(2, "toy: tries.", ge=0)
        toy_wait_s: float = option(1.0, "toy: wait.", gt=0)
        toy_loud: bool = option(False, "toy: loud.")

        def validate(self) -> None:
            if self.toy_url == "bad":
                raise ValueError("args.toy_url is bad")

    assert ToyOptions.config_keys() == {
        "toy_url": (str | None, None, "toy: url (required)."), "toy_tries": (int, 2, "toy: tries."),
        "toy_wait_s": (float, 1.0, "toy: wait."), "toy_loud": (bool, False, "toy: loud."),
    }
    opts = ToyOptions.from_args(SimpleNamespace(toy_url="u", toy_wait_s=3, unrelated=1))
    assert opts == ToyOptions(toy_url="u", toy_tries=2, toy_wait_s=3.0, toy_loud=False)
    assert type(opts.toy_wait_s) is float
    cases = [
        ({}, ValueError, r"^toy build_env: args.toy_url is not set \(set toy_url in --custom-config-path\)$"),
        ({"toy_url": "u", "toy_tries": True}, TypeError, r"args.toy_tries must be int, got True"),
        ({"toy_url": "u", "toy_loud": 1}, TypeError, r"args.toy_loud must be bool, got 1"),
        ({"toy_url": "u", "toy_tries": -1}, ValueError, r"args.toy_tries must be >= 0, got -1"),
        ({"toy_url": "u", "toy_wait_s": 0}, ValueError, r"args.toy_wait_s must be > 0, got 0.0"),
        ({"toy_url": "bad"}, ValueError, r"^toy build_env: args.toy_url is bad$"),
    ]
    for values, kind, message in cases:
        with pytest.raises(kind, match=message):
            ToyOptions.from_args(SimpleNamespace(**values))
    with pytest.raises(TypeError, match="declare env options with option"):

        @dataclass(frozen=True)
        class Undeclared(EnvOptions):
            x: int = 1

        Undeclared.config_keys()


def test_build_env_reads_config_keys_and_validates():
    assert set(CONFIG_KEYS) == {"end_on_correct", "end_on_boxed_answer", "grading_timeout_s"}
    for key, (tp, default, help_text) in CONFIG_KEYS.items():
        assert isinstance(default, tp) and help_text
    env = build_env(Sample(label=12.0), SimpleNamespace(max_turns=4, end_on_correct=False, grading_timeout_s=1))
    assert env.label == "12" and env.max_turns == 4
    assert env.options == geo3k.Geo3kOptions(end_on_correct=False, end_on_boxed_answer=True, grading_timeout_s=1.0)
    with pytest.raises(ValueError, match=r"sample\(group=3, index=7\) has no label"):
        build_env(Sample(group_index=3, index=7, label=None), SimpleNamespace(max_turns=2))
    with pytest.raises(ValueError, match="max_turns"):
        build_env(Sample(label="1"), SimpleNamespace())
    with pytest.raises(TypeError, match="end_on_correct"):
        build_env(Sample(label="1"), SimpleNamespace(max_turns=2, end_on_correct="yes"))
    assert geo3k.build_env is build_env
