"""BabyAI's words: the question that opens each prompt, the system prompt, `TASK_PROMPT`. No jax."""

from __future__ import annotations

from envs.babyai.world import ACTIONS
from envs.base import TaskPrompt

_WORDS = ", ".join(ACTIONS[:-1]) + " or " + ACTIONS[-1]
QUESTION = (f"The picture is your view: you are the red triangle at its bottom, facing up. Reply with one action: "
            f"{_WORDS}.")
SYSTEM_PROMPT = (
    "You play BabyAI in a grid world. The picture is your view: you are the red triangle at its bottom centre, "
    "facing up. Each reply is exactly one word: left or right (turn in place), forward (one step ahead), pickup, "
    "drop, toggle or done. The mission succeeds when you face the object it names; sooner earns more."
)
TASK_PROMPT = TaskPrompt(system_prompt=SYSTEM_PROMPT)
