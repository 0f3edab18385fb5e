"""Geometry3K answers in model text: tool calls, the final answer, and `reward_fn`.

A turn answers by a tool call `<tool_call>{"name": "calc_geo3k_reward" | "calc_score",
"arguments": {"answer": <str | number>}}</tool_call>` (strict JSON) or by a final `\\boxed{...}`.
Answers are compared with the reference by the generic math grading of `envs.grading`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from envs.geo3k.prompts import GEO3K_TOOL_NAME, GEO3K_TOOL_NAMES
from envs.grading import grade_answer, last_boxed_span

_TOOL_OPEN = "<tool_call>"
_TOOL_CLOSE = "</tool_call>"


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
    if name not in GEO3K_TOOL_NAMES:
        return None, f"unknown tool {name!r}; the only tool is {GEO3K_TOOL_NAME!r}"
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
