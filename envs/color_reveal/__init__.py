"""The color-reveal task in one place (`--rollout-interaction-env-path envs.color_reveal`): a learnable
multi-turn visual task for the CPU demo and the learning tests.

The card's color must be read from the pictures: the first shows the card beside a decoy (so a first guess is
often wrong by construction), a wrong guess brings a picture of the card alone, and the reward discounts later
right guesses. See `env` for the episode, `answers` for how replies are read and the chance levels.

- `answers`: colors, `parse_answer`, `turn_credit`, `chance_reward`, `blind_elimination_reward`;
- `images`: the pictures (PIL);
- `env`: `ColorRevealEnv`, `ColorRevealOptions`, `build_env`, `CONFIG_KEYS`;
- `prompts`: the question, the answer rule as a system prompt, `TASK_PROMPT`;
- `synthetic`: the dataset generator (imported on use: `from envs.color_reveal.synthetic import make_dataset`).

This package never imports jax.
"""

from envs.color_reveal.answers import COLORS, LETTER_RANGES, blind_elimination_reward, chance_reward, parse_answer, turn_credit
from envs.color_reveal.env import CONFIG_KEYS, ColorRevealEnv, ColorRevealOptions, build_env
from envs.color_reveal.prompts import QUESTION, SYSTEM_PROMPT, TASK_PROMPT

__all__ = [
    "COLORS",
    "CONFIG_KEYS",
    "LETTER_RANGES",
    "QUESTION",
    "SYSTEM_PROMPT",
    "TASK_PROMPT",
    "ColorRevealEnv",
    "ColorRevealOptions",
    "blind_elimination_reward",
    "build_env",
    "chance_reward",
    "parse_answer",
    "turn_credit",
]
