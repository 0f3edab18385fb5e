"""The BabyAI environment: reach the named object in a MiniGrid room, one action word per model turn, the agent's
view as a new picture after every action.

Episode (`BabyAIEnv`, options `BabyAIOptions`):

- The row names a level and a world seed (`synthetic`); `reset()` builds that world and opens the episode with the
  agent's view (a picture) and the mission ("Mission: go to the red box."), joined to the prompt's user turn.
- Each model turn is one action word, read strictly by `parse_action`: the whole reply, stripped, must be one of
  left, right, forward, pickup, drop, toggle, done (any case, one trailing period allowed).
- A valid action is one BabyAI step, answered with the new view and a text that only repeats the action
  ("Turn 3: forward.").
- With `view_text` (the default) every observation's text ends with the view in words (`world.describe_view`,
  BALROG's rendering: "You see a red box 2 ahead and 1 left. Wall 3 ahead."), read from the same partial
  observation the picture draws; the tiny model does not learn to read the 4-token picture alone.
- A turn without a valid action (documented policy: a penalty turn, never an exception) leaves the world as it
  is, costs `invalid_penalty` and is answered with "Invalid: not one action word. Your view:" and the unchanged
  view (`info["invalid"]` names the error). It spends a model turn, not one of BabyAI's own steps.
- Done when the mission succeeds (the agent faces the object), when BabyAI's own step limit ends the world, or
  after `max_turns`. Reward (`verdict()`): BabyAI's success reward, 1 - 0.9 * steps / its step limit (0 without
  success), minus `invalid_penalty` per invalid turn.

Chance (`python -m envs.babyai.chance --rows 1000`: worlds of dataset seed 1235, the tiny config's held-out seed):
uniformly random actions succeed in 0.031 of GoToObj and 0.044 of GoToLocal episodes within 8 turns (0.071 and
0.089 within 16); the oracle bot succeeds in every world (1.000; 4.98 and 5.36 actions on average, 0.936 and 0.849
of the worlds within 8 turns). No best-blind figure is computed.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from envs.actions import ActionError
from envs.babyai.world import ACTIONS, DEFAULT_TILE_PX, LEVELS, check_level, describe_view, new_world, view
from envs.base import BaseInteractionEnv, EnvOptions, option, require_max_turns, sample_where

SUCCESS_TEXT = "Mission complete."
OUT_OF_STEPS_TEXT = "Out of steps."
OUT_OF_TURNS_TEXT = "No turns left."
_REPLY = re.compile(r"\s*([A-Za-z]+)\.?\s*")


@dataclass(frozen=True)
class BabyAIOptions(EnvOptions):
    """The babyai env's `--custom-config-path` keys."""

    ENV_NAME = "babyai"

    level: str | None = option(
        None, f"babyai: the level every episode plays ({' or '.join(LEVELS)}), with each row's world seed; None "
        "plays each row's own level.")
    invalid_penalty: float = option(0.1, "babyai: reward subtracted per turn without a valid action word.", ge=0)
    view_text: bool = option(
        True, "babyai: every view also in words after the picture, BALROG-style (\"You see a red box 2 ahead and 1 "
        "left. Wall 3 ahead.\"), read from the same partial observation; false: the picture alone.")

    def validate(self) -> None:
        if self.level is not None:
            check_level(self.level, "args.level")


CONFIG_KEYS: dict[str, tuple[type, Any, str]] = BabyAIOptions.config_keys()


def parse_action(text: str) -> str | ActionError:
    """The action word of a reply (see the module docstring), or the error fed back to the model."""
    match = _REPLY.fullmatch(text)
    word = match.group(1).lower() if match else None
    if word in ACTIONS:
        return word
    shown = text.strip()
    shown = shown if len(shown) <= 40 else shown[:40] + "..."
    return ActionError(f"reply with exactly one of {', '.join(ACTIONS)}; got {shown!r}", False)


class BabyAIEnv(BaseInteractionEnv):
    """One BabyAI world: see the module docstring. `tile_px` is the picture's pixels per cell."""

    def __init__(self, level: str, seed: int, max_turns: int, options: BabyAIOptions | None = None,
                 tile_px: int = DEFAULT_TILE_PX):
        if not isinstance(max_turns, int) or max_turns < 1:
            raise ValueError(f"BabyAIEnv: max_turns must be a positive int, got {max_turns!r}")
        if not isinstance(tile_px, int) or tile_px < 1:
            raise ValueError(f"BabyAIEnv: tile_px must be a positive int, got {tile_px!r}")
        self.level = check_level(level, "BabyAIEnv")
        self.seed = int(seed)
        self.max_turns = max_turns
        self.options = BabyAIOptions() if options is None else options
        self.tile_px = tile_px
        self.world: Any = None
        self.closed = False
        self._clear()

    def _clear(self) -> None:
        """The episode's counters, as before the first action."""
        self.turn = 0
        self.done = False
        self.invalid = 0
        self.success = False
        self.babyai_reward = 0.0
        self.actions: list[str | None] = []

    def reset(self) -> dict[str, Any]:
        """Build the world of (level, seed) afresh; returns the opening observation: the view and the mission."""
        self.world = new_world(self.level, self.seed)
        self._clear()
        return {"obs_str": self._with_view_text(f"Mission: {self.world.mission}."),
                "multi_modal_data": {"image": [self.picture()]}, "role": "user"}

    @property
    def mission(self) -> str:
        return self.world.mission

    def picture(self):
        return view(self.world, self.tile_px)

    def _with_view_text(self, text: str) -> str:
        """`text`, then the view in words (`world.describe_view`) when the `view_text` option is on."""
        return f"{text} {describe_view(self.world)}" if self.options.view_text else text

    def step(self, response_text: str) -> tuple[dict[str, Any], bool, dict[str, Any]]:
        self.check_step(response_text)
        if self.world is None:
            raise RuntimeError("BabyAIEnv.step called before reset(): reset() builds the world")
        self.turn += 1
        action = parse_action(response_text)
        info: dict[str, Any] = {"turn": self.turn}
        ended = False
        if isinstance(action, ActionError):
            self.invalid += 1
            self.actions.append(None)
            info["invalid"] = action.message
            # Short: the words are in the prompt, and feedback tokens count against the response budget.
            text = "Invalid: not one action word. Your view:"
        else:
            self.actions.append(action)
            _, reward, terminated, truncated, _ = self.world.step(ACTIONS.index(action))
            info["action"] = action
            self.success = bool(terminated and reward > 0)
            self.babyai_reward = float(reward) if self.success else 0.0
            ended = bool(terminated or truncated)
            text = f"Turn {self.turn}: {action}."
        if self.success:
            self.done = True
            return {"obs_str": SUCCESS_TEXT}, True, {**info, "success": True}
        if ended or self.turn >= self.max_turns:
            self.done = True
            return {"obs_str": OUT_OF_STEPS_TEXT if ended else OUT_OF_TURNS_TEXT}, True, {**info, "success": False}
        return {"obs_str": self._with_view_text(text), "multi_modal_data": {"image": [self.picture()]}}, False, info

    def verdict(self) -> float:
        return self.babyai_reward - self.options.invalid_penalty * self.invalid


def parse_label(label: Any, where: str) -> tuple[str, int, int]:
    """(level, world seed, tile_px) of a row's label, the JSON `{"level": ..., "seed": s, "tile_px": p}`."""
    try:
        data = json.loads(label)
        level, seed, tile_px = data["level"], data["seed"], data.get("tile_px", DEFAULT_TILE_PX)
    except (TypeError, ValueError, KeyError) as e:
        raise ValueError(f"babyai build_env: {where} label is not a babyai row ({type(e).__name__}: {e}); make the "
                         "data with envs.babyai.synthetic") from e
    if not isinstance(seed, int) or not isinstance(tile_px, int) or tile_px < 1:
        raise ValueError(f"babyai build_env: {where} label needs an int seed and a positive int tile_px, got "
                         f"{seed!r}, {tile_px!r}")
    return check_level(level, f"babyai build_env: {where}"), seed, tile_px


def build_env(sample: Any, args: Any) -> BabyAIEnv:
    """A BabyAIEnv for the row in `sample.label`; the `level` option, when set, replaces the row's level."""
    level, seed, tile_px = parse_label(getattr(sample, "label", None), sample_where(sample))
    options = BabyAIOptions.from_args(args)
    return BabyAIEnv(options.level or level, seed, require_max_turns(args, "babyai"), options, tile_px=tile_px)
