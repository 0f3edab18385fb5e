"""The zoom task (`--rollout-interaction-env-path envs.zoom`), DeepEyes-style: read a small digit in a large picture
with a crop tool whose answer is a tool message holding the enlarged crop.

- `scene`: the pictures, the crop; `grading`: reading a turn, chance/best-blind (closed form);
- `env`: `ZoomEnv`, `ZoomOptions`, `build_env`, `CONFIG_KEYS`; `prompts`: question, tools, `TASK_PROMPT`;
- `synthetic`: prompts and SFT transcripts (imported on use). No jax.
"""

from envs.zoom.env import CONFIG_KEYS, ZoomEnv, ZoomOptions, build_env
from envs.zoom.prompts import TASK_PROMPT

__all__ = ["CONFIG_KEYS", "TASK_PROMPT", "ZoomEnv", "ZoomOptions", "build_env"]
