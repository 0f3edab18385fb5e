"""Reading an agent's action from one model turn: a JSON tool call, or a call written as text.

Shared by the agent tasks (envs.sokoban, envs.zoom, envs.gui). A turn may hold a Hermes/Qwen tool call
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (the LAST one counts), or, without one, the first
`name(args)` call of a known name written in plain text (`click(120, 640)`, `type("bob")`, `move(up)`).

`ActionError` is the documented outcome of a malformed action: the env turns it into a penalty and an
observation that names the error, never an exception out of `step`.

No jax.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Sequence
from typing import Any

TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """One action: the tool's name and its arguments (a JSON object), and whether it came as a `<tool_call>`."""

    name: str
    arguments: dict[str, Any]
    tagged: bool


@dataclasses.dataclass(frozen=True)
class ActionError:
    """Why a turn holds no valid action, in words fed back to the model."""

    message: str
    tagged: bool


def _last_tagged_block(text: str) -> str | None:
    start = text.rfind(TOOL_OPEN)
    if start < 0:
        return None
    body = text[start + len(TOOL_OPEN):]
    close = body.find(TOOL_CLOSE)
    return body if close < 0 else body[:close]


def parse_tool_call(text: str, names: Sequence[str]) -> ToolCall | ActionError | None:
    """The turn's action among tools `names`: the last `<tool_call>` block (strict JSON), else the first
    `name(...)` text call; None when the turn has neither (the env decides what plain text means)."""
    if not isinstance(text, str):
        raise TypeError(f"parse_tool_call: text must be str, got {type(text).__name__}")
    block = _last_tagged_block(text)
    if block is not None:
        try:
            call = json.loads(block.strip())
        except json.JSONDecodeError as e:
            return ActionError(f"the tool call is not valid JSON ({e.msg})", True)
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return ActionError('a tool call is {"name": ..., "arguments": {...}}', True)
        if call["name"] not in names:
            return ActionError(f"unknown tool {call['name']!r}: use one of {', '.join(names)}", True)
        args = call.get("arguments", {})
        if isinstance(args, str):  # some templates double-encode the arguments
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                return ActionError("the tool call's arguments are not a JSON object", True)
        if not isinstance(args, dict):
            return ActionError("the tool call's arguments are not a JSON object", True)
        return ToolCall(call["name"], args, True)
    pattern = re.compile(r"\b(" + "|".join(re.escape(n) for n in names) + r")\s*\(([^()]*)\)")
    match = pattern.search(text)
    if match is None:
        return None
    return ToolCall(match.group(1), {"_raw": match.group(2).strip()}, False)


def int_argument(args: dict[str, Any], key: str, lo: int, hi: int) -> int | ActionError:
    """An integer argument in [lo, hi] (a whole float is accepted), or the error naming it."""
    value = args.get(key)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, str) and re.fullmatch(r"\s*-?\d+\s*", value):
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool):
        return ActionError(f"argument {key!r} must be an integer, got {value!r}", True)
    if not lo <= value <= hi:
        return ActionError(f"argument {key!r} must be in [{lo}, {hi}], got {value}", True)
    return value


def raw_numbers(raw: str) -> list[int]:
    """The integers of a text call's argument list (`click(120, 640)` -> [120, 640])."""
    return [int(m) for m in re.findall(r"-?\d+", raw)]


def raw_string(raw: str) -> str:
    """A text call's single string argument, quotes removed (`type("bob")` -> bob)."""
    raw = raw.strip()
    if len(raw) >= 2 and raw[0] == raw[-1] and raw[0] in "\"'":
        return raw[1:-1]
    return raw
