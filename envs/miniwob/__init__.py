"""The MiniWoB++ task (`--rollout-interaction-env-path envs.miniwob`, played behind `jaxrl-vlm env-serve envs.miniwob`
with `env_url`): real web tasks (`click-test`, `click-test-2`, `click-button`) in headless Chromium, Qwen-VL 0-1000
coordinate clicks and typing, a new screenshot after every action.

- `browser`: a MiniWoB page in Chrome (timer disabled, raw reward), the pool of persistent pages (`miniwob`,
  imported on use: `pip install -e '.[miniwob]'`, plus chromium and chromium-driver);
- `tasks`: the tasks, the coordinate mapping, the scripted solutions read from the DOM;
- `env`: `MiniWoBEnv`, `MiniWoBOptions`, `build_env`, `CONFIG_KEYS`, `session_capacity` (one Chrome page per
  episode);
- `prompts`: question, system prompt, `TASK_PROMPT`;
- `synthetic`: prompt rows (task + page seed) and SFT transcripts of the scripted solution (imported on use);
- `chance`: success rates of random clicks, a fixed blind click and the scripted solution, measured in Chromium
  (`python -m envs.miniwob.chance`).

No jax.
"""

from envs.gui.grading import parse_action
from envs.miniwob.env import CONFIG_KEYS, MiniWoBEnv, MiniWoBOptions, build_env, session_capacity
from envs.miniwob.prompts import TASK_PROMPT
from envs.miniwob.tasks import TASKS, to_normalized, to_pixels

__all__ = ["CONFIG_KEYS", "TASKS", "TASK_PROMPT", "MiniWoBEnv", "MiniWoBOptions", "build_env", "parse_action",
           "session_capacity", "to_normalized", "to_pixels"]
