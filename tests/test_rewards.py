"""slime's `--rm-type math` and `--reward-key`, here: the last `\\boxed{}` of the model's own text graded with
math-verify, selectable instead of the env's verdict; a mapping reward reduced to one key, or a named failure.

The table holds slime's semantics (`grade_answer_verl` on the last `\\boxed{}`), except where our design rule
differs on purpose: environment feedback never counts as the answer (slime grades its whole decoded response).
Every row is checked on the reward function, and again through the real episode loop, where every observation
echoes `\\boxed{<label>}` back to the model: it must never count.
"""

from __future__ import annotations

import asyncio
import re
import types
from dataclasses import dataclass
from typing import Any

import pytest

from envs import grading
from envs.base import BaseInteractionEnv
from envs.rewards import last_boxed_answer, math_reward
from rollout.client import RetryPolicy, SGLangClient
from rollout.encoding import ChatEncoder
from rollout.fake_engine import FakeSGLangServer, Tokens
from rollout.multiturn import RolloutContext, generate
from rollout.rewards import RM_TYPES, RewardError, RewardSettings, rm_function, scalar_reward
from rollout.sample import Sample, Status


@pytest.fixture(scope="module", autouse=True)
def worker_pool():
    grading.configure_grading(2)
    yield
    grading.shutdown_grading_workers()


@dataclass(frozen=True)
class Case:
    id: str
    turns: tuple[str, ...]  # the model's text, one entry per turn
    label: Any
    expected: float


B = "\\boxed"
CASES = [
    # correct / incorrect
    Case("correct_integer", (f"The answer is {B}{{7}}.",), "7", 1.0),
    Case("incorrect_integer", (f"So {B}{{8}}.",), "7", 0.0),
    Case("negative", (f"{B}{{-3}}",), "-3", 1.0),
    Case("integer_label", (f"{B}{{7}}",), 7, 1.0),  # slime grades str(label)
    # only the last box counts
    Case("last_of_two_correct", (f"First {B}{{3}}, no wait: {B}{{7}}",), "7", 1.0),
    Case("last_of_two_wrong", (f"{B}{{7}} hmm, actually {B}{{5}}",), "7", 0.0),
    Case("last_turn_corrects", (f"{B}{{3}}", f"Fixed: {B}{{7}}"), "7", 1.0),
    Case("last_turn_spoils", (f"{B}{{7}}", f"Changing to {B}{{4}}"), "7", 0.0),
    Case("box_in_first_turn_only", (f"{B}{{7}}", "I stand by my answer."), "7", 1.0),
    # brace matching
    Case("nested_frac", (f"{B}{{\\frac{{1}}{{2}}}}",), "\\frac{1}{2}", 1.0),
    Case("nested_power", (f"{B}{{2^{{\\frac{{1}}{{2}}}}}}",), "\\sqrt{2}", 1.0),
    Case("unbalanced_last_box", (f"{B}{{7}} then {B}{{7",), "7", 0.0),  # a truncated box is no answer
    # equivalent forms (math-verify and the numeric check)
    Case("fraction_vs_decimal", (f"{B}{{\\frac{{1}}{{2}}}}",), "0.5", 1.0),
    Case("dfrac_vs_decimal", (f"{B}{{\\dfrac{{3}}{{4}}}}",), "0.75", 1.0),
    Case("radical_forms", (f"{B}{{2\\sqrt{{3}}}}",), "\\sqrt{12}", 1.0),
    Case("pi_forms", (f"{B}{{\\frac{{\\pi}}{{2}}}}",), "\\pi/2", 1.0),
    Case("wrong_fraction", (f"{B}{{\\frac{{2}}{{3}}}}",), "0.6", 0.0),
    Case("degrees_stripped", (f"{B}{{30^\\circ}}",), "30", 1.0),
    Case("units_stripped", (f"{B}{{12 \\text{{ cm}}}}",), "12", 1.0),
    Case("variable_prefix", (f"{B}{{x = 7}}",), "7", 1.0),
    Case("boxed_label", (f"{B}{{7}}",), f"{B}{{7}}", 1.0),  # slime extracts a boxed label too
    # no answer
    Case("no_box", ("The answer is 7.",), "7", 0.0),
    Case("empty_box", (f"{B}{{}}",), "7", 0.0),
    Case("box_without_braces", (f"{B} 7",), "7", 0.0),
    Case("fbox_only", ("\\fbox{7}",), "7", 0.0),  # slime's remove_boxed never accepts \fbox
    Case("answer_only_in_observation", ("I am not sure.", "Still not sure."), "7", 0.0),
    # falsy label
    Case("label_none", (f"{B}{{7}}",), None, 0.0),
    Case("label_empty", (f"{B}{{7}}",), "", 0.0),
]


def test_the_table_is_large_enough():
    assert len(CASES) >= 20 and len({c.id for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_math_reward_on_the_models_text(case: Case):
    assert math_reward("\n".join(case.turns), case.label) == case.expected


def test_last_boxed_answer_extraction():
    assert last_boxed_answer(f"a {B}{{1}} b {B}{{\\frac{{a}}{{b}}}} c") == "\\frac{a}{b}"
    assert last_boxed_answer("\\fbox{3}") is None and last_boxed_answer("") is None
    assert last_boxed_answer(None) is None  # type: ignore[arg-type]


def test_rm_types_name_loadable_functions():
    assert RM_TYPES == {"math": "envs.rewards.math_reward"} and rm_function("math") is math_reward
    with pytest.raises(RewardError, match=r"--rm-type 'nope' is not known \(known: \['math'\]\)"):
        rm_function("nope")


# ----------------------------------------------------------------------------- --reward-key
def test_scalar_reward_reads_a_mapping_at_the_key():
    assert scalar_reward({"acc": 1, "fmt": 0.5}, "acc", "s") == 1.0
    assert scalar_reward(0.25, None, "s") == 0.25 and scalar_reward(True, "acc", "s") == 1.0


@pytest.mark.parametrize(
    ("reward", "key", "message"),
    [
        ({"acc": 1.0, "fmt": 0.5}, None, "the reward is a mapping with keys ['acc', 'fmt']; set --reward-key"),
        ({"acc": 1.0, "fmt": 0.5}, "score", "--reward-key 'score' is not in the reward mapping (keys: ['acc', 'fmt'])"),
        ({"acc": "yes"}, "acc", "reward['acc'] is str 'yes', not a number"),
        ("high", None, "reward is str 'high', not a number"),
        (float("nan"), None, "non-finite reward nan"),
        ({"acc": float("inf")}, "acc", "non-finite reward inf"),
    ],
)
def test_scalar_reward_errors_name_the_cause(reward, key, message):
    with pytest.raises(RewardError) as info:
        scalar_reward(reward, key, "sample(group=0, index=0): env_verdict")
    assert str(info.value).startswith("sample(group=0, index=0): env_verdict: ") and message in str(info.value)


def test_reward_settings_default_to_unset():
    assert RewardSettings.from_args(types.SimpleNamespace()) == RewardSettings(None, None)
    both = types.SimpleNamespace(rm_type="math", reward_key="acc")
    assert RewardSettings.from_args(both) == RewardSettings("math", "acc")


# ----------------------------------------------------------------------------- through the episode loop
class EchoEnv(BaseInteractionEnv):
    """Answers every turn but the last with feedback that states the reference in a box; verdict fixed."""

    def __init__(self, turns: int, label: Any, verdict: Any):
        self.turns, self.label, self._verdict, self.steps = turns, label, verdict, 0

    def reset(self) -> None:
        pass

    def step(self, response_text: str):
        self.steps += 1
        if self.steps >= self.turns:
            return {"obs_str": ""}, True, {}
        return {"obs_str": f"Checked. The reference answer is {B}{{{self.label}}}."}, False, {}

    def verdict(self) -> Any:
        return self._verdict


@pytest.fixture(scope="module")
def encoder(tiny_tokenizer, tiny_image_processor) -> ChatEncoder:
    return ChatEncoder(tiny_tokenizer, tiny_image_processor)


_RID = re.compile(r"^g(\d+)-s\d+-t(\d+)-")


async def _episodes(encoder: ChatEncoder, cases: list[Case], verdict: Any, **args: Any) -> list[Sample]:
    """One episode per case (group index = case number), the model replying each case's turns in order."""

    def reply(body: dict) -> Tokens:
        group, turn = map(int, _RID.match(body["rid"]).groups())
        ids = encoder.tokenize(cases[group].turns[turn]) + [encoder.vision.im_end]
        return Tokens(output_ids=tuple(ids), log_probs=tuple(-0.5 for _ in ids))

    def build_env(sample: Sample, _args: Any) -> EchoEnv:
        case = cases[sample.group_index]
        return EchoEnv(len(case.turns), case.label, verdict)

    module = types.ModuleType("echo_env")
    module.build_env = build_env
    server = FakeSGLangServer(generate_fn=reply, eos_token_id=encoder.vision.im_end,
                              image_token_id=encoder.vision.image_pad)
    async with server:
        client = SGLangClient(server.url, timeout_s=10.0, retry=RetryPolicy(max_retries=0))
        async with client:
            ctx = RolloutContext(client=client, encoder=encoder, env_module=module,
                                 generate_slots=asyncio.Semaphore(8))
            base = dict(rollout_max_response_len=2000, max_turns=4, max_env_retries_per_turn=0,
                        episode_timeout=60.0, rollout_context=ctx, rm_type=None, reward_key=None)
            ns = types.SimpleNamespace(**{**base, **args})
            samples = [Sample(group_index=k, prompt=[{"role": "user", "content": "Find x."}], label=c.label)
                       for k, c in enumerate(cases)]
            return list(await asyncio.gather(*(generate(ns, s) for s in samples)))


async def test_rm_type_math_grades_the_models_turns_never_the_observations(encoder):
    samples = await _episodes(encoder, CASES, verdict=0.5, rm_type="math")
    for case, s in zip(CASES, samples):
        assert s.status is Status.COMPLETED, (case.id, s.metadata.get("error"))
        assert s.metadata["model_text"] == list(case.turns)
        assert (case.id, s.reward, s.metadata["reward_source"]) == (case.id, case.expected, "rm_type:math")
    echoed = samples[[c.id for c in CASES].index("answer_only_in_observation")]
    assert f"{B}{{7}}" in echoed.response and echoed.reward == 0.0  # in the transcript, yet not the answer


async def test_the_env_verdict_stays_the_default(encoder):
    cases = [c for c in CASES if c.id in ("correct_integer", "no_box")]
    samples = await _episodes(encoder, cases, verdict=0.5)
    assert [(s.reward, s.metadata["reward_source"]) for s in samples] == [(0.5, "env_verdict")] * 2


async def test_reward_key_reduces_a_mapping_verdict(encoder):
    cases = [CASES[0]]
    [s] = await _episodes(encoder, cases, verdict={"acc": 1.0, "format": 0.25}, reward_key="format")
    assert s.status is Status.COMPLETED and s.reward == 0.25
    assert s.metadata["reward_components"] == {"acc": 1.0, "format": 0.25}


@pytest.mark.parametrize(("key", "message"), [
    (None, "the reward is a mapping with keys ['acc', 'format']; set --reward-key"),
    ("score", "--reward-key 'score' is not in the reward mapping (keys: ['acc', 'format'])"),
])
async def test_a_mapping_reward_without_its_key_fails_the_episode_with_the_cause(encoder, key, message):
    [s] = await _episodes(encoder, [CASES[0]], verdict={"acc": 1.0, "format": 0.25}, reward_key=key)
    assert s.status is Status.FAILED and str(s.termination) == "reward_error" and s.reward is None
    assert message in s.metadata["error"] and "env_verdict" in s.metadata["error"]
