"""The BabyAI task (`--rollout-interaction-env-path envs.babyai`): MiniGrid's GoToObj and GoToLocal levels, one
action word per turn, the agent's view as a new picture after every action.

- `world`: levels, action words, one world per seed, the view picture, the oracle bot (`minigrid`, imported on use);
- `env`: `BabyAIEnv`, `BabyAIOptions`, `parse_action`, `build_env`, `CONFIG_KEYS`;
- `prompts`: question, system prompt, `TASK_PROMPT`;
- `synthetic`: prompt rows (level + world seed) and SFT transcripts of the oracle bot (imported on use);
- `chance`: the success rates of random actions and of the oracle bot (`python -m envs.babyai.chance`).

No jax.
"""

from envs.babyai.env import CONFIG_KEYS, BabyAIEnv, BabyAIOptions, build_env, parse_action
from envs.babyai.prompts import TASK_PROMPT
from envs.babyai.world import ACTIONS, LEVELS

__all__ = ["ACTIONS", "CONFIG_KEYS", "LEVELS", "TASK_PROMPT", "BabyAIEnv", "BabyAIOptions", "build_env", "parse_action"]
