"""The Sokoban environment: push the box onto the target, one move per model turn, a new picture of the board each step.

Episode (`SokobanEnv`, options `SokobanOptions`):

- The prompt shows the board (`levels.render`). Each model turn is one move, read by `grading.parse_move`: the
  last `<tool_call>` of tool `move` (`{"direction": "up"}`), else a text call `move(up)`, else the first of the
  words up/down/left/right in the reply (with `first_letter_moves`: the reply's first ASCII letter, as color_reveal
  reads colors, so that every reply of a random model is a move).
- A valid move is applied (a blocked one leaves the board as it is) and answered with the new board picture and a
  text that only repeats the move: the words never say whether it moved, so a policy that ignores the pictures
  learns nothing from them (the best blind policy is open-loop, `grading.best_blind_reward`).
- A turn without a valid move (documented policy: never an exception) costs `invalid_penalty` and is answered with
  the error and the unchanged board.
- Done when the boxes are all on targets, or after `max_turns`. Reward (`verdict()`): 1 if solved, minus
  `step_penalty` per move made and `invalid_penalty` per invalid turn.

The feedback role is "tool" when the turn's action came as a `<tool_call>`, "user" otherwise.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from envs.base import BaseInteractionEnv, EnvOptions, option, require_max_turns, sample_where
from envs.actions import ActionError
from envs.sokoban.grading import episode_reward, parse_move
from envs.sokoban.levels import CELL_PX, Level, render
from envs.color_reveal.images import decode_data_url

SOLVED_TEXT = "Solved."
OUT_OF_TURNS_TEXT = "No moves left."


@dataclass(frozen=True)
class SokobanOptions(EnvOptions):
    """The sokoban env's `--custom-config-path` keys."""

    ENV_NAME = "sokoban"

    step_penalty: float = option(0.05, "sokoban: reward subtracted per move made.", ge=0)
    invalid_penalty: float = option(0.1, "sokoban: reward subtracted per turn without a valid move.", ge=0)
    first_letter_moves: bool = option(
        False, "sokoban: read a text reply by its first ASCII letter (a-f down, g-m left, n-s right, t-z up; each "
        "name starts in its own range), so every reply is a move: a tiny random model's rewards vary from step 1.")


CONFIG_KEYS: dict[str, tuple[type, Any, str]] = SokobanOptions.config_keys()


class SokobanEnv(BaseInteractionEnv):
    """One level: see the module docstring."""

    def __init__(self, level: Level, max_turns: int, options: SokobanOptions | None = None, min_moves: int | None = None,
                 cell_px: int = CELL_PX):
        if not isinstance(max_turns, int) or max_turns < 1:
            raise ValueError(f"SokobanEnv: max_turns must be a positive int, got {max_turns!r}")
        self.start = level
        self.max_turns = max_turns
        self.options = SokobanOptions() if options is None else options
        self.min_moves = min_moves
        self.cell_px = cell_px
        self.closed = False
        self.reset()

    def reset(self) -> None:
        self.level = self.start
        self.turn = 0
        self.done = False
        self.moves = 0
        self.invalid = 0
        self.actions: list[str | None] = []

    def picture(self):
        return render(self.level, self.cell_px)

    def step(self, response_text: str) -> tuple[dict[str, Any], bool, dict[str, Any]]:
        self.check_step(response_text)
        self.turn += 1
        move, tagged = parse_move(response_text, self.options.first_letter_moves)
        role = "tool" if tagged else "user"
        info: dict[str, Any] = {"turn": self.turn}
        if isinstance(move, ActionError):
            self.invalid += 1
            self.actions.append(None)
            info["invalid"] = move.message
            text = f"Invalid: {move.message}. The board:"
        else:
            self.moves += 1
            self.actions.append(move)
            self.level, moved = self.level.move(move)
            info.update(move=move, moved=moved)
            text = f"Move {self.turn}: {move}. The board:"
        if self.level.solved():
            self.done = True
            return {"obs_str": SOLVED_TEXT, "role": role}, True, {**info, "solved": True}
        if self.turn >= self.max_turns:
            self.done = True
            return {"obs_str": OUT_OF_TURNS_TEXT, "role": role}, True, {**info, "solved": False}
        return {"obs_str": text, "multi_modal_data": {"image": [self.picture()]}, "role": role}, False, info

    def verdict(self) -> float:
        return episode_reward(self.level.solved(), self.moves, self.invalid, self.options)


def build_env(sample: Any, args: Any) -> SokobanEnv:
    """A SokobanEnv for the level in `sample.label` (JSON `{"level": ..., "min_moves": k}`, from `synthetic`); its
    pictures take the cell size of the prompt's picture."""
    label = getattr(sample, "label", None)
    try:
        data = json.loads(label)
        level = Level.from_json(json.dumps(data["level"]) if isinstance(data["level"], dict) else data["level"])
    except (TypeError, ValueError, KeyError) as e:
        raise ValueError(f"sokoban build_env: {sample_where(sample)} label is not a sokoban level ({e}); "
                         "make the data with envs.sokoban.synthetic") from e
    images = getattr(sample, "image_data", None) or []
    cell_px = decode_data_url(images[0]).width // level.cols if images else CELL_PX  # the pictures keep the prompt's scale
    return SokobanEnv(level, require_max_turns(args, "sokoban"), SokobanOptions.from_args(args), data.get("min_moves"),
                      cell_px=max(cell_px, 1))
