"""The GUI task (`--rollout-interaction-env-path envs.gui`): multi-step tasks on a synthetic desktop drawn with PIL,
acted on with `click(x, y)` (Qwen3-VL 0-1000 coordinates) and `type(text)`, a new screenshot after every action.

- `screen`: state, layout, hit test, screenshots; `actions`: reading tool calls and text calls (shared by the
  agent tasks); `grading`: reading an action, the goal, chance and best-blind (simulation);
- `env`: `GuiEnv`, `GuiOptions`, `build_env`, `CONFIG_KEYS`; `prompts`: tools, task words, `TASK_PROMPT`;
- `synthetic`: prompts and SFT transcripts (imported on use). No jax.
"""

from envs.gui.env import CONFIG_KEYS, GuiEnv, GuiOptions, build_env
from envs.gui.prompts import TASK_PROMPT

__all__ = ["CONFIG_KEYS", "TASK_PROMPT", "GuiEnv", "GuiOptions", "build_env"]
