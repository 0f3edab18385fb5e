"""Geometry3K interaction environment: the model answers by a tool call or a final boxed answer.

Per model turn (`Geo3kEnv.step`), in this order:

1. If the turn contains `<tool_call>`, the LAST tool call is the turn's answer. It must be strict
   JSON `{"name": "calc_geo3k_reward" | "calc_score", "arguments": {"answer": <str | number>}}`.
   A malformed call (bad JSON, wrong tool name, missing answer) gets feedback naming the error.
   A valid one is graded: "correct" ends the episode when `end_on_correct` (default True);
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
`verdict()` uses the answers of `step` inputs, and `reward_fn` is given model text by the rollout.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from envs.base import BaseInteractionEnv
from envs.grading import grade_answer, grade_answer_async, last_boxed_span

TOOL_NAME = "calc_geo3k_reward"
TOOL_NAMES = (TOOL_NAME, "calc_score")  # slime's example accepts both
_TOOL_OPEN = "<tool_call>"
_TOOL_CLOSE = "</tool_call>"

CONFIG_KEYS: dict[str, tuple[type, Any, str]] = {
    "end_on_correct": (bool, True, "geo3k: end the episode when a tool-call answer is correct."),
    "end_on_boxed_answer": (bool, True, "geo3k: end the episode on a final \\boxed{} answer given without a tool call."),
    "grading_timeout_s": (float, 2.0, "geo3k: seconds allowed per answer comparison; a timeout grades wrong."),
}

TOOL_FORMAT_HINT = (
    f'<tool_call>{{"name": "{TOOL_NAME}", "arguments": {{"answer": "<your answer>"}}}}</tool_call>'
)
LAST_CHANCE = " Last chance: you have one turn left, so give your final answer in your next reply."


@dataclass(frozen=True)
class ToolCall:
    """One parsed `<tool_call>` block: `answer` when valid, else `error` says why not."""

    answer: str | None
    error: str | None
    start: int  # index of "<tool_call>" in the text
    end: int  # index just after "</tool_call>" (len(text) if unterminated)


def _answer_text(value: Any) -> str | None:
    if isinstance(value, bool):  # bool is an int subclass; true/false is not an answer
        return None
    if isinstance(value, str):
        return value.strip() or None
    if isinstance(value, int) or (isinstance(value, float) and math.isfinite(value)):
        return str(value)
    return None


def _parse_tool_body(body: str) -> tuple[str | None, str | None]:
    """(answer, None) or (None, error) for the JSON between the tool-call tags."""
    try:
        call = json.loads(body)
    except json.JSONDecodeError as e:
        return None, f"the tool call is not valid JSON ({e.msg} at line {e.lineno} column {e.colno})"
    if not isinstance(call, dict):
        return None, "the tool call must be a JSON object with 'name' and 'arguments'"
    name = call.get("name")
    if name not in TOOL_NAMES:
        return None, f"unknown tool {name!r}; the only tool is {TOOL_NAME!r}"
    arguments = call.get("arguments")
    if not isinstance(arguments, dict):
        return None, "'arguments' must be a JSON object like {\"answer\": \"...\"}"
    if "answer" not in arguments:
        return None, "'arguments' has no 'answer'"
    answer = _answer_text(arguments["answer"])
    if answer is None:
        return None, "'answer' must be a non-empty string or a number"
    return answer, None


def parse_tool_calls(text: str) -> list[ToolCall]:
    """Every `<tool_call>...</tool_call>` block of `text`, in order (an unterminated last one included)."""
    calls: list[ToolCall] = []
    pos = 0
    while True:
        start = text.find(_TOOL_OPEN, pos)
        if start < 0:
            return calls
        body_start = start + len(_TOOL_OPEN)
        close = text.find(_TOOL_CLOSE, body_start)
        if close < 0:
            calls.append(ToolCall(None, "the tool call is not closed with </tool_call>", start, len(text)))
            return calls
        # A nested "<tool_call>" before the close means the earlier one was never closed.
        nested = text.find(_TOOL_OPEN, body_start, close)
        if nested >= 0:
            calls.append(ToolCall(None, "the tool call is not closed with </tool_call>", start, nested))
            pos = nested
            continue
        answer, error = _parse_tool_body(text[body_start:close].strip())
        end = close + len(_TOOL_CLOSE)
        calls.append(ToolCall(answer, error, start, end))
        pos = end


def final_model_answer(model_text: str) -> str | None:
    """The last answer in model text: the later of the last valid tool-call answer and the last box."""
    best: tuple[int, str] | None = None
    for call in parse_tool_calls(model_text):
        if call.answer is not None:
            best = (call.end, call.answer)
    box = last_boxed_span(model_text)
    if box is not None and (best is None or box[1] > best[0]):
        best = (box[1], box[2].strip())
    return None if best is None else best[1]


def reward_fn(model_text: str, label: Any, *, timeout_s: float = 2.0) -> float:
    """1.0 if the last answer in the model's own text grades equal to `label`, else 0.0.

    `model_text` must be model-generated text only (all turns), never environment feedback.
    """
    if not isinstance(model_text, str) or label is None:
        return 0.0
    answer = final_model_answer(model_text)
    if answer is None:
        return 0.0
    return 1.0 if grade_answer(answer, str(label), timeout_s=timeout_s) else 0.0


class Geo3kEnv(BaseInteractionEnv):
    """Grades a geometry answer given by tool call or final box; see the module docstring."""

    def __init__(
        self,
        label: str,
        max_turns: int,
        *,
        end_on_correct: bool = True,
        end_on_boxed_answer: bool = True,
        grading_timeout_s: float = 2.0,
    ) -> None:
        if not isinstance(label, str) or not label.strip():
            raise ValueError(f"Geo3kEnv: label must be a non-empty string, got {label!r}")
        if not isinstance(max_turns, int) or isinstance(max_turns, bool) or max_turns < 1:
            raise ValueError(f"Geo3kEnv: max_turns must be a positive int, got {max_turns!r}")
        self.label = label
        self.max_turns = max_turns
        self.end_on_correct = end_on_correct
        self.end_on_boxed_answer = end_on_boxed_answer
        self.grading_timeout_s = grading_timeout_s
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

    def close(self) -> None:
        self.closed = True

    async def step(self, response_text: str) -> tuple[dict[str, Any], bool, dict[str, Any]]:
        """Grade one model turn; returns ({"obs_str", "role"}, done, info). See the module docstring."""
        if self.closed:
            raise RuntimeError("Geo3kEnv.step called after close()")
        if self.done:
            raise RuntimeError(f"Geo3kEnv.step called after the episode ended (turn {self.turn} of {self.max_turns})")
        if not isinstance(response_text, str):
            raise TypeError(f"Geo3kEnv.step: response_text must be str, got {type(response_text).__name__}")
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
                done = out_of_turns or (correct and self.end_on_correct)
                text = self._graded_text(correct, done)
        elif box is not None:
            role = "user"
            answer = box[2].strip()
            correct = await self._grade(answer)
            info.update(answer_source="boxed", answer=answer, correct=correct)
            kind = "correct" if correct else "incorrect"
            done = out_of_turns or self.end_on_boxed_answer or (correct and self.end_on_correct)
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
        correct = await grade_answer_async(answer, self.label, timeout_s=self.grading_timeout_s)
        self.last_correct = correct
        return correct

    def _graded_text(self, correct: bool, done: bool) -> str:
        if correct:
            if done:
                return "Correct. Your answer is right."
            return "Correct. Your answer is right. Now state your final answer inside \\boxed{}."
        if done:
            return "Incorrect. Your answer is wrong."
        return f"Incorrect. Your answer is wrong. Check your reasoning and submit a corrected answer with {TOOL_NAME}."


def build_env(sample: Any, args: Any) -> Geo3kEnv:
    """A Geo3kEnv for `sample.label` with `args.max_turns` and this module's CONFIG_KEYS from `args`."""
    where = f"sample(group={getattr(sample, 'group_index', '?')}, index={getattr(sample, 'index', '?')})"
    label = getattr(sample, "label", None)
    if label is None or (isinstance(label, str) and not label.strip()):
        raise ValueError(f"geo3k build_env: {where} has no label (the reference answer is required)")
    if isinstance(label, float) and label.is_integer():
        label = int(label)  # a numeric column read as 12.0 means "12"
    max_turns = getattr(args, "max_turns", None)
    if max_turns is None:
        raise ValueError("geo3k build_env: args.max_turns is not set (set max_turns in --custom-config-path)")
    options: dict[str, Any] = {}
    for key, (tp, default, _help) in CONFIG_KEYS.items():
        value = getattr(args, key, default)
        if tp is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, tp) or (tp is not bool and isinstance(value, bool)):
            raise TypeError(f"geo3k build_env: args.{key} must be {tp.__name__}, got {value!r}")
        options[key] = value
    if options["grading_timeout_s"] <= 0:
        raise ValueError(f"geo3k build_env: args.grading_timeout_s must be > 0, got {options['grading_timeout_s']}")
    return Geo3kEnv(str(label), int(max_turns), **options)
