"""How a zoom-task reply is read, and the chance and best-blind levels (closed form). No jax."""

from __future__ import annotations

import dataclasses
import re

from envs.actions import ActionError, ToolCall, parse_tool_call, raw_numbers
from envs.zoom.prompts import ANSWER_TOOL, ZOOM_TOOL
from envs.zoom.scene import COORD_MAX

NUM_DIGITS = 10
_ANSWER_TAG = re.compile(r"<answer>\s*(\d)")


@dataclasses.dataclass(frozen=True)
class Zoom:
    bbox: list[int]


@dataclasses.dataclass(frozen=True)
class Answer:
    digit: int


def _bbox(values: object, tagged: bool) -> list[int] | ActionError:
    if not (isinstance(values, list) and len(values) == 4 and all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                                                   for v in values)):
        return ActionError(f"bbox_2d must be four numbers [x1, y1, x2, y2], got {values!r}", tagged)
    x1, y1, x2, y2 = (int(v) for v in values)
    if not (0 <= x1 < x2 <= COORD_MAX and 0 <= y1 < y2 <= COORD_MAX):
        return ActionError(f"bbox_2d {[x1, y1, x2, y2]} must satisfy 0 <= x1 < x2 <= {COORD_MAX} and "
                           f"0 <= y1 < y2 <= {COORD_MAX}", tagged)
    return [x1, y1, x2, y2]


def _digit(text: str) -> int | None:
    match = re.search(r"\d", text)
    return None if match is None else int(match.group(0))


def parse_turn(text: str) -> tuple[Zoom | Answer | ActionError, bool]:
    """The turn's action and whether it came as a `<tool_call>` (see `env` for the rules, in order)."""
    call = parse_tool_call(text, (ZOOM_TOOL, ANSWER_TOOL))
    if isinstance(call, ActionError):
        return call, True
    if isinstance(call, ToolCall):
        if call.name == ZOOM_TOOL:
            values = call.arguments.get("bbox_2d") if call.tagged else raw_numbers(call.arguments["_raw"])
            box = _bbox(values, call.tagged)
            return (box if isinstance(box, ActionError) else Zoom(box)), call.tagged
        raw = str(call.arguments.get("answer", call.arguments.get("_raw", "")))
        digit = _digit(raw)
        if digit is None:
            return ActionError(f"the answer must be a digit, got {raw!r}", call.tagged), call.tagged
        return Answer(digit), call.tagged
    tag = _ANSWER_TAG.search(text)
    if tag is not None:
        return Answer(int(tag.group(1))), False
    digit = _digit(text)
    if digit is None:
        return ActionError("no zoom call and no digit answer", False), False
    return Answer(digit), False


def chance_reward(num_digits: int = NUM_DIGITS) -> float:
    """Expected reward of a uniformly random digit answer: 1/10 (no penalties)."""
    return 1.0 / num_digits


def best_blind_reward(num_digits: int = NUM_DIGITS) -> float:
    """Best reward without the pictures: the digits are balanced (every block of 10 rows has each once) and the
    words never name the digit, so no blind answer beats 1/10, zooms or not."""
    return 1.0 / num_digits

