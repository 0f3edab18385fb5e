"""The Geometry3K task in one place (`--rollout-interaction-env-path envs.geo3k`, `--prompt-style geo3k`).

- `env`: the interaction environment (`Geo3kEnv`, its options `Geo3kOptions`, `build_env`, `CONFIG_KEYS`);
- `grading`: answers in model text (tool calls, final box) and `reward_fn`; the math comparison itself is
  the generic `envs.grading`;
- `prompts`: the tool (its name), the tool schema, the system prompt and `TASK_PROMPT` for the dataset loader;
- `synthetic`: the synthetic Geometry3K generator with real diagrams (numpy, PIL, pyarrow; imported on use,
  not here: `from envs.geo3k.synthetic import make_dataset`).

This package never imports jax.
"""

from envs.geo3k.env import CONFIG_KEYS, LAST_CHANCE, TOOL_FORMAT_HINT, Geo3kEnv, Geo3kOptions, build_env
from envs.geo3k.grading import ToolCall, final_model_answer, parse_tool_calls, reward_fn
from envs.geo3k.prompts import (
    GEO3K_SYSTEM_PROMPT,
    GEO3K_TOOL_NAME,
    GEO3K_TOOL_NAMES,
    GEO3K_TOOLS,
    GEO3K_USER_INSTRUCTION,
    TASK_PROMPT,
)

__all__ = [
    "CONFIG_KEYS",
    "GEO3K_SYSTEM_PROMPT",
    "GEO3K_TOOLS",
    "GEO3K_TOOL_NAME",
    "GEO3K_TOOL_NAMES",
    "GEO3K_USER_INSTRUCTION",
    "LAST_CHANCE",
    "TASK_PROMPT",
    "TOOL_FORMAT_HINT",
    "Geo3kEnv",
    "Geo3kOptions",
    "ToolCall",
    "build_env",
    "final_model_answer",
    "parse_tool_calls",
    "reward_fn",
]
