"""How a Sokoban reply is read, the episode reward, and the chance and best-blind levels (by exact enumeration).

No jax.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Sequence
from typing import Any

from envs.actions import ActionError, ToolCall, parse_tool_call
from envs.sokoban.levels import DIRECTIONS, Level
from envs.sokoban.prompts import MOVE_TOOL

_WORD = re.compile(r"\b(up|down|left|right)\b", re.IGNORECASE)


#: With `first_letter_moves`, the move a reply's first ASCII letter names: each direction's own name starts in its
#: range (alphabetical: d, l, r, u), so "up" still means up, and every reply with a letter is a move.
LETTER_RANGES: dict[str, tuple[str, str]] = {"down": ("a", "f"), "left": ("g", "m"), "right": ("n", "s"), "up": ("t", "z")}


def first_letter_move(text: str) -> str | None:
    for ch in text:
        low = ch.lower()
        if ch.isascii() and "a" <= low <= "z":
            return next(d for d, (lo, hi) in LETTER_RANGES.items() if lo <= low <= hi)
    return None


def parse_move(text: str, first_letter: bool = False) -> tuple[str | ActionError, bool]:
    """(the move, or the error), and whether it came as a `<tool_call>`; see `env` for the rule. `first_letter`:
    a reply without a tool call is read by its first ASCII letter (`LETTER_RANGES`) instead of by words."""
    call = parse_tool_call(text, (MOVE_TOOL,))
    if isinstance(call, ActionError):
        return call, True
    if isinstance(call, ToolCall):
        raw = call.arguments.get("direction", call.arguments.get("_raw", ""))
        direction = str(raw).strip().strip("\"'").lower()
        if direction not in DIRECTIONS:
            return ActionError(f"direction must be one of up, down, left, right; got {raw!r}", call.tagged), call.tagged
        return direction, call.tagged
    if first_letter:
        move = first_letter_move(text)
        return (ActionError("no letter, so no move", False) if move is None else move), False
    match = _WORD.search(text)
    if match is None:
        return ActionError("say up, down, left or right", False), False
    return match.group(1).lower(), False


def episode_reward(solved: bool, moves: int, invalid: int, options: Any) -> float:
    """1 if solved, minus `step_penalty` per move and `invalid_penalty` per invalid turn."""
    return float(solved) - options.step_penalty * moves - options.invalid_penalty * invalid


def _play(level: Level, moves: Sequence[str], options: Any) -> float:
    n = 0
    for n, move in enumerate(moves, start=1):
        level, _ = level.move(move)
        if level.solved():
            return episode_reward(True, n, 0, options)
    return episode_reward(False, n, 0, options)


def chance_reward(levels: Sequence[Level], max_turns: int, options: Any) -> float:
    """Expected reward of uniformly random moves (every 4**max_turns sequence equally likely), mean over `levels`.

    Exact: enumerates every sequence (an episode that ends early is counted once per continuation, which is its
    probability)."""
    seqs = list(itertools.product(DIRECTIONS, repeat=max_turns))
    return sum(_play(lv, s, options) for lv in levels for s in seqs) / (len(levels) * len(seqs))


def best_blind_reward(levels: Sequence[Level], max_turns: int, options: Any) -> tuple[float, tuple[str, ...]]:
    """The best reward a policy that ignores the pictures can earn on `levels`, and its move sequence.

    The feedback text never depends on the board, so a blind policy is one fixed sequence of moves; this is the
    best of all 4**max_turns of them (exact for the given levels)."""
    best, arg = -float("inf"), ()
    for s in itertools.product(DIRECTIONS, repeat=max_turns):
        value = sum(_play(lv, s, options) for lv in levels) / len(levels)
        if value > best:
            best, arg = value, s
    return best, arg


def optimal_reward(min_moves: Sequence[int], options: Any) -> float:
    """Expected reward of a policy that solves each level in its minimum number of moves."""
    return sum(1.0 - options.step_penalty * m for m in min_moves) / len(min_moves)

