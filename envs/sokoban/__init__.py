"""The Sokoban task (`--rollout-interaction-env-path envs.sokoban`): push a box onto its target, one move per turn,
with a new picture of the board after every move.

- `levels`: boards, moves, the breadth-first solver (each level's known minimum), generation, pictures;
- `grading`: reading a move (tool call or text), the reward, chance and best-blind levels (exact enumeration);
- `env`: `SokobanEnv`, `SokobanOptions`, `build_env`, `CONFIG_KEYS`;
- `prompts`: question, move tool, system prompt, `TASK_PROMPT`;
- `synthetic`: prompts and SFT transcripts (imported on use).

No jax.
"""

from envs.sokoban.env import CONFIG_KEYS, SokobanEnv, SokobanOptions, build_env
from envs.sokoban.prompts import TASK_PROMPT

__all__ = ["CONFIG_KEYS", "TASK_PROMPT", "SokobanEnv", "SokobanOptions", "build_env"]
