"""The zoom environment (DeepEyes-style): answer a question about a small detail of a large picture, with a crop tool.

Episode (`ZoomEnv`, options `ZoomOptions`):

- The prompt shows the whole scene (`scene.render_scene`), which the image processor shrinks until the digit in
  the small white box cannot be read.
- Each model turn is read by `grading.parse_turn`: a `zoom` call (`<tool_call>` with `{"bbox_2d": [x1, y1, x2, y2]}`
  in 0-1000 relative coordinates, or the text call `zoom(x1, y1, x2, y2)`) is answered by a **tool** message with
  the cropped region enlarged to `zoom_px` (the template path for images inside tool responses); an `answer` call,
  `<answer>d</answer>` or a reply holding a digit is the final answer and ends the episode.
- A malformed call or a reply with neither (documented policy: never an exception) costs `invalid_penalty` and is
  answered with the error.
- Reward (`verdict()`): 1 for the right digit, else 0, minus the invalid penalties; `max_turns` bounds the episode.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from envs.base import BaseInteractionEnv, EnvOptions, option, require_max_turns, sample_where
from envs.actions import ActionError
from envs.zoom.grading import Answer, Zoom, parse_turn
from envs.zoom.scene import crop, render_scene

OUT_OF_TURNS_TEXT = "No turns left."


@dataclass(frozen=True)
class ZoomOptions(EnvOptions):
    """The zoom env's `--custom-config-path` keys."""

    ENV_NAME = "zoom"

    zoom_px: int = option(64, "zoom: longer side in pixels of the enlarged crop the zoom tool returns.", ge=16)
    invalid_penalty: float = option(0.1, "zoom: reward subtracted per turn without a valid call or answer.", ge=0)


CONFIG_KEYS: dict[str, tuple[type, Any, str]] = ZoomOptions.config_keys()


class ZoomEnv(BaseInteractionEnv):
    """One scene: see the module docstring."""

    def __init__(self, params: dict[str, Any], max_turns: int, options: ZoomOptions | None = None):
        if not isinstance(max_turns, int) or max_turns < 1:
            raise ValueError(f"ZoomEnv: max_turns must be a positive int, got {max_turns!r}")
        self.params = params
        self.digit = int(params["digit"])
        self.max_turns = max_turns
        self.options = ZoomOptions() if options is None else options
        self.scene = render_scene(params)
        self.closed = False
        self.reset()

    def reset(self) -> None:
        self.turn = 0
        self.done = False
        self.zooms: list[list[int]] = []
        self.invalid = 0
        self.answer: int | None = None

    def step(self, response_text: str) -> tuple[dict[str, Any], bool, dict[str, Any]]:
        self.check_step(response_text)
        self.turn += 1
        action, tagged = parse_turn(response_text)
        role = "tool" if tagged else "user"
        info: dict[str, Any] = {"turn": self.turn}
        if isinstance(action, Answer):
            self.answer = action.digit
            self.done = True
            info.update(answer=action.digit, correct=action.digit == self.digit)
            return {"obs_str": "Answer received.", "role": role}, True, info
        if isinstance(action, ActionError):
            self.invalid += 1
            info["invalid"] = action.message
            obs: dict[str, Any] = {"obs_str": f"Invalid: {action.message}.", "role": role}
        else:
            assert isinstance(action, Zoom)
            self.zooms.append(action.bbox)
            info["zoom"] = action.bbox
            obs = {"obs_str": f"Region {action.bbox}:", "role": "tool" if tagged else "user",
                   "multi_modal_data": {"image": [crop(self.scene, action.bbox, self.options.zoom_px)]}}
        if self.turn >= self.max_turns:
            self.done = True
            return {"obs_str": OUT_OF_TURNS_TEXT, "role": role}, True, info
        return obs, False, info

    def verdict(self) -> float:
        return float(self.answer == self.digit) - self.options.invalid_penalty * self.invalid


def build_env(sample: Any, args: Any) -> ZoomEnv:
    """A ZoomEnv for the scene in `sample.label` (the JSON scene params from `envs.zoom.synthetic`)."""
    try:
        params = json.loads(getattr(sample, "label", None))
        missing = {"size", "digit", "digit_box", "shapes"} - set(params)
    except (TypeError, ValueError) as e:
        raise ValueError(f"zoom build_env: {sample_where(sample)} label is not JSON ({e}); make the data with "
                         "envs.zoom.synthetic") from e
    if missing:
        raise ValueError(f"zoom build_env: {sample_where(sample)} label lacks {sorted(missing)}; make the data with "
                         "envs.zoom.synthetic")
    return ZoomEnv(params, require_max_turns(args, "zoom"), ZoomOptions.from_args(args))
