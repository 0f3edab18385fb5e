"""Geometry3K interaction environment: the model answers by a tool call or a final boxed answer.

Per model turn (`Geo3kEnv.step`), in this order:

1. If the turn contains `<tool_call>`, the LAST tool call is the turn's answer. It must be strict
   JSON `{"name": "calc_geo3k_reward" | "calc_score", "arguments": {"answer": <str | number>}}`.
   A malformed call (bad JSON, wrong tool name, missing answer) gets feedback naming the error.
   A valid one is graded: "correct" ends the episode when `end_on_correct` (default True; the
   options are `Geo3kOptions`, read from `args` once per env);
   "incorrect" asks for another try.
2. Else, if the turn has a `\\boxed{...}` final answer, it is graded and ends the episode when
   `end_on_boxed_answer` (default True; otherwise it is handled like a tool answer).
3. Else the feedback asks for an answer in one of the two formats.

The episode also ends when `turn >= max_turns`. When exactly one turn is left (turn ==
max_turns - 1) any feedback that does not end the episode carries a "last chance" warning.

Feedback roles: a turn that contained `<tool_call>` gets a `"tool"` message (the tool's
response); any other turn gets a `"user"` message.

Feedback never repeats the model's answer: a reward computed on a transcript must not find the
answer in the environment's words (slime's defect). Reward is graded on model text only anyway:
`verdict()` uses the answers of `step` inputs, and `reward_fn` (`envs.geo3k.grading`, with the tool-call
parser) is given model text by the rollout.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from envs.base import BaseInteractionEnv, EnvOptions, option, require_max_turns, sample_label, sample_where
from envs.geo3k.grading import parse_tool_calls
from envs.geo3k.prompts import GEO3K_TOOL_NAME
from envs.grading import grade_answer_async, last_boxed_span


@dataclass(frozen=True)
class Geo3kOptions(EnvOptions):
    """The geo3k env's `--custom-config-path` keys (this module's CONFIG_KEYS are derived from it)."""

    ENV_NAME = "geo3k"

    end_on_correct: bool = option(True, "geo3k: end the episode when a tool-call answer is correct.")
    end_on_boxed_answer: bool = option(
        True, "geo3k: end the episode on a final \\boxed{} answer given without a tool call.")
    grading_timeout_s: float = option(
        2.0, "geo3k: seconds allowed per answer comparison; a timeout grades wrong.", gt=0)


CONFIG_KEYS: dict[str, tuple[type, Any, str]] = Geo3kOptions.config_keys()

TOOL_FORMAT_HINT = (
    f'<tool_call>{{"name": "{GEO3K_TOOL_NAME}", "arguments": {{"answer": "<your answer>"}}}}</tool_call>'
)
LAST_CHANCE = " Last chance: you have one turn left, so give your final answer in your next reply."


class Geo3kEnv(BaseInteractionEnv):
    """Grades a geometry answer given by tool call or final box; see the module docstring."""

    def __init__(self, label: str, max_turns: int, options: Geo3kOptions | None = None) -> None:
        if not isinstance(label, str) or not label.strip():
            raise ValueError(f"Geo3kEnv: label must be a non-empty string, got {label!r}")
        if not isinstance(max_turns, int) or isinstance(max_turns, bool) or max_turns < 1:
            raise ValueError(f"Geo3kEnv: max_turns must be a positive int, got {max_turns!r}")
        self.label = label
        self.max_turns = max_turns
        self.options = Geo3kOptions() if options is None else options
        self.closed = False
        self.reset()

    def reset(self) -> None:
        self.turn = 0
        self.done = False
        self.last_correct: bool | None = None  # grade of the episode's latest (decisive) answer
        self.history: list[dict[str, Any]] = []

    def verdict(self) -> float | None:
        """1.0/0.0 for the episode's last answer (tool call or final box); None if it never answered."""
        if self.last_correct is None:
            return None
        return 1.0 if self.last_correct else 0.0

    async def step(self, response_text: str) -> tuple[dict[str, Any], bool, dict[str, Any]]:
        """Grade one model turn; returns ({"obs_str", "role"}, done, info). See the module docstring."""
        self.check_step(response_text)
        self.turn += 1
        out_of_turns = self.turn >= self.max_turns
        one_left = self.turn == self.max_turns - 1
        info: dict[str, Any] = {"turn": self.turn, "answer_source": None, "answer": None, "correct": None, "error": None}

        calls = parse_tool_calls(response_text)
        box = last_boxed_span(response_text)
        if calls:
            role = "tool"
            call = calls[-1]
            info["answer_source"] = "tool"
            if call.error is not None:
                kind, done = "malformed", out_of_turns
                info["error"] = call.error
                text = f"Error: {call.error}. Call the tool exactly like {TOOL_FORMAT_HINT}"
            else:
                correct = await self._grade(call.answer)
                info.update(answer=call.answer, correct=correct)
                kind = "correct" if correct else "incorrect"
                done = out_of_turns or (correct and self.options.end_on_correct)
                text = self._graded_text(correct, done)
        elif box is not None:
            role = "user"
            answer = box[2].strip()
            correct = await self._grade(answer)
            info.update(answer_source="boxed", answer=answer, correct=correct)
            kind = "correct" if correct else "incorrect"
            done = out_of_turns or self.options.end_on_boxed_answer or (correct and self.options.end_on_correct)
            text = "Final answer received." if done else self._graded_text(correct, done)
        else:
            role = "user"
            kind, done = "no_answer", out_of_turns
            text = (
                f"No answer found. Submit your answer with the tool call {TOOL_FORMAT_HINT} "
                "or finish with your final answer inside \\boxed{}."
            )
        if not done and one_left:
            text += LAST_CHANCE
        if out_of_turns and kind != "correct":
            text += " No turns left."
        info["feedback_kind"] = kind
        self.done = done
        self.history.append(dict(info))
        return {"obs_str": text, "role": role}, done, info

    async def _grade(self, answer: str) -> bool:
        correct = await grade_answer_async(answer, self.label, timeout_s=self.options.grading_timeout_s)
        self.last_correct = correct
        return correct

    def _graded_text(self, correct: bool, done: bool) -> str:
        if correct:
            if done:
                return "Correct. Your answer is right."
            return "Correct. Your answer is right. Now state your final answer inside \\boxed{}."
        if done:
            return "Incorrect. Your answer is wrong."
        return f"Incorrect. Your answer is wrong. Check your reasoning and submit a corrected answer with {GEO3K_TOOL_NAME}."


def build_env(sample: Any, args: Any) -> Geo3kEnv:
    """A Geo3kEnv for `sample.label` with `args.max_turns` and this module's options (Geo3kOptions) from `args`."""
    label = sample_label(sample)
    if label is None or (isinstance(label, str) and not label.strip()):
        raise ValueError(f"geo3k build_env: {sample_where(sample)} has no label (the reference answer is required)")
    max_turns = require_max_turns(args, "geo3k")
    return Geo3kEnv(str(label), max_turns, Geo3kOptions.from_args(args))
