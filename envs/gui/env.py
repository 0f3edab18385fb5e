"""The GUI environment: multi-step tasks on a synthetic desktop, one action per model turn, a new screenshot each step.

Episode (`GuiEnv`, options `GuiOptions`):

- The prompt shows the desktop and the task ("Open the settings and turn on Bluetooth." or "... set the name to
  "kiwi"."). Each model turn is one action, read by `grading.parse_action`: `click(x, y)` (Qwen3-VL coordinates,
  integers 0-1000 relative to the screenshot) or `type("text")` (into the focused field), as a `<tool_call>` or as a
  text call.
- Clicking the Settings button opens the settings window; in it a click flips a toggle, focuses the name field, or
  closes the window (the red box). Typing replaces the focused field's text (an error without a focused field).
- Every valid action is answered with the new screenshot and a text that only says which action ran (role "tool"
  for a `<tool_call>`, "user" otherwise); a malformed one (documented policy: never an exception) costs
  `invalid_penalty` and is answered with the error and the unchanged screenshot.
- Done when the task's goal holds (checked after every action), or after `max_turns`. Reward (`verdict()`): 1 on
  success, minus `step_penalty` per valid action and `invalid_penalty` per invalid turn.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from envs.base import BaseInteractionEnv, EnvOptions, option, require_max_turns, sample_where
from envs.actions import ActionError
from envs.gui.grading import Click, Type, goal_reached, parse_action
from envs.gui.screen import hit, initial_state, render

DONE_TEXT = "Task complete."
OUT_OF_TURNS_TEXT = "No actions left."


@dataclass(frozen=True)
class GuiOptions(EnvOptions):
    """The gui env's `--custom-config-path` keys."""

    ENV_NAME = "gui"

    step_penalty: float = option(0.02, "gui: reward subtracted per valid action.", ge=0)
    invalid_penalty: float = option(0.1, "gui: reward subtracted per turn without a valid action.", ge=0)


CONFIG_KEYS: dict[str, tuple[type, Any, str]] = GuiOptions.config_keys()


class GuiEnv(BaseInteractionEnv):
    """One task on one desktop layout: see the module docstring."""

    def __init__(self, layout: dict[str, Any], task: dict[str, str], max_turns: int, options: GuiOptions | None = None):
        if task.get("kind") not in ("toggle", "rename"):
            raise ValueError(f"GuiEnv: task kind must be 'toggle' or 'rename', got {task!r}")
        if not isinstance(max_turns, int) or max_turns < 1:
            raise ValueError(f"GuiEnv: max_turns must be a positive int, got {max_turns!r}")
        self.layout, self.task = layout, task
        self.max_turns = max_turns
        self.options = GuiOptions() if options is None else options
        self.closed = False
        self.reset()

    def reset(self) -> None:
        self.state = initial_state(self.layout)
        self.turn = 0
        self.done = False
        self.actions = 0
        self.invalid = 0
        self.success = False

    def apply(self, action: Click | Type) -> str | ActionError:
        """Change the state by one valid action; the feedback text, or an error when typing without focus."""
        state = self.state
        if isinstance(action, Type):
            if not (state.settings_open and state.focused):
                return ActionError("no text field is focused (click one first)", action.tagged)
            state.name = action.text
            return f'Typed "{action.text}".'
        widget = hit(state, action.x, action.y)
        if widget == "app:Settings":
            state.settings_open = True
        elif widget == "close":
            state.settings_open, state.focused = False, False
        elif widget is not None and widget.startswith("toggle:"):
            name = widget.split(":", 1)[1]
            state.toggles[name] = not state.toggles[name]
            state.focused = False
        elif widget == "field":
            state.focused = True
        return f"Clicked ({action.x}, {action.y})."

    def step(self, response_text: str) -> tuple[dict[str, Any], bool, dict[str, Any]]:
        self.check_step(response_text)
        self.turn += 1
        action = parse_action(response_text)
        tagged = action.tagged
        role = "tool" if tagged else "user"
        info: dict[str, Any] = {"turn": self.turn}
        text = action if isinstance(action, ActionError) else self.apply(action)
        if isinstance(text, ActionError):
            self.invalid += 1
            info["invalid"] = text.message
            text = f"Invalid action: {text.message}."
        else:
            self.actions += 1
        if goal_reached(self.state, self.task):
            self.done = self.success = True
            return {"obs_str": DONE_TEXT, "role": role}, True, {**info, "success": True}
        if self.turn >= self.max_turns:
            self.done = True
            return {"obs_str": OUT_OF_TURNS_TEXT, "role": role}, True, {**info, "success": False}
        return {"obs_str": text + " The screen:", "role": role,
                "multi_modal_data": {"image": [render(self.state)]}}, False, info

    def verdict(self) -> float:
        return float(self.success) - self.options.step_penalty * self.actions - self.options.invalid_penalty * self.invalid


def build_env(sample: Any, args: Any) -> GuiEnv:
    """A GuiEnv for `sample.label`: JSON `{"layout": ..., "task": {"kind": ..., ...}}` from `envs.gui.synthetic`."""
    try:
        data = json.loads(getattr(sample, "label", None))
        layout, task = data["layout"], data["task"]
    except (TypeError, ValueError, KeyError) as e:
        raise ValueError(f"gui build_env: {sample_where(sample)} label is not a gui task ({e}); make the data with "
                         "envs.gui.synthetic") from e
    return GuiEnv(layout, task, require_max_turns(args, "gui"), GuiOptions.from_args(args))
