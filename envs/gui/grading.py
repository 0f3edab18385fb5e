"""How a GUI reply is read, the goal test, and the chance and best-blind levels (simulation). No jax."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from envs.actions import ActionError, ToolCall, int_argument, parse_tool_call, raw_numbers, raw_string
from envs.gui.prompts import CLICK_TOOL, TYPE_TOOL
from envs.gui.screen import COORD_MAX, GuiState


@dataclasses.dataclass(frozen=True)
class Click:
    x: int
    y: int
    tagged: bool = False


@dataclasses.dataclass(frozen=True)
class Type:
    text: str
    tagged: bool = False


def parse_action(text: str) -> Click | Type | ActionError:
    """The turn's action: the last `<tool_call>` of click/type, else the first text call `click(x, y)` / `type("t")`."""
    call = parse_tool_call(text, (CLICK_TOOL, TYPE_TOOL))
    if call is None:
        return ActionError('no action: reply click(x, y) or type("text")', False)
    if isinstance(call, ActionError):
        return call
    assert isinstance(call, ToolCall)
    if call.name == CLICK_TOOL:
        if call.tagged:
            args = call.arguments
        else:
            numbers = raw_numbers(call.arguments["_raw"])
            if len(numbers) != 2:
                return ActionError(f"click takes two integers x, y; got ({call.arguments['_raw']})", False)
            args = {"x": numbers[0], "y": numbers[1]}
        x, y = int_argument(args, "x", 0, COORD_MAX), int_argument(args, "y", 0, COORD_MAX)
        for value in (x, y):
            if isinstance(value, ActionError):
                return dataclasses.replace(value, tagged=call.tagged)
        return Click(x, y, call.tagged)
    value = call.arguments.get("text") if call.tagged else raw_string(call.arguments["_raw"])
    if not isinstance(value, str) or not value or len(value) > 64:
        return ActionError(f"type takes one non-empty string of at most 64 characters, got {value!r}", call.tagged)
    return Type(value, call.tagged)


def goal_reached(state: GuiState, task: dict[str, str]) -> bool:
    if task["kind"] == "toggle":
        return bool(state.toggles.get(task["target"]))
    return state.name == task["text"]


# ----------------------------------------------------------------------------- chance and best-blind (simulation)
Policy = Callable[[Any, np.random.Generator, int], str]


def simulate(make_envs: Callable[[], Sequence[Any]], policy: Policy, seed: int = 0) -> float:
    """Mean reward of `policy(env, rng, turn) -> reply text` over fresh envs from `make_envs()`."""
    rng = np.random.default_rng(seed)
    total, envs = 0.0, make_envs()
    for env in envs:
        done, turn = False, 0
        while not done:
            _, done, _ = env.step(policy(env, rng, turn))
            turn += 1
        total += env.verdict()
    return total / len(envs)


def random_policy(env: Any, rng: np.random.Generator, turn: int) -> str:
    """Chance: a uniformly random click (x, y in 0..1000), or 1 time in 4 typing the task's text (the words are
    visible to every policy, so typing them costs chance nothing)."""
    if rng.random() < 0.25:
        return f'type("{env.task.get("text", "x")}")'
    return f"click({int(rng.integers(COORD_MAX + 1))}, {int(rng.integers(COORD_MAX + 1))})"


def best_blind_clicks(make_envs: Callable[[], Sequence[Any]], grid: int = 20) -> tuple[float, list[str]]:
    """The best open-loop action sequence found greedily over a `grid` x `grid` lattice of click points (plus typing
    the task's text), and its mean reward: a policy that ignores the screenshots can only replay one sequence, since
    the feedback words never say what was hit. Greedy per turn, so a lower bound on the best blind policy."""
    points = [((i + 0.5) * COORD_MAX / grid, (j + 0.5) * COORD_MAX / grid) for i in range(grid) for j in range(grid)]
    candidates = [f"click({int(x)}, {int(y)})" for x, y in points] + ["__type__"]
    chosen: list[str] = []
    max_turns = make_envs()[0].max_turns
    best_value = -float("inf")
    for _turn in range(max_turns):
        scores = []
        for cand in candidates:
            seq = chosen + [cand]
            scores.append((_replay(make_envs, seq), cand))
        best_value, best = max(scores)
        chosen.append(best)
    return best_value, chosen


def _replay(make_envs: Callable[[], Sequence[Any]], seq: Sequence[str]) -> float:
    total, envs = 0.0, make_envs()
    for env in envs:
        for action in seq:
            if env.done:
                break
            env.step(f'type("{env.task.get("text", "x")}")' if action == "__type__" else action)
        total += env.verdict()
    return total / len(envs)

