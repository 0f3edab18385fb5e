"""The color-reveal task's words: the question under the first picture, the rule for answers, `TASK_PROMPT`.

No jax (envs/ never imports it).
"""

from __future__ import annotations

from envs.base import TaskPrompt

#: The user text of every prompt row, after its picture. Kept short on purpose: a tiny model's attention is
#: spread over every prompt token, and the picture is only 4 of them at 64x64.
QUESTION = "Card color?"

#: How answers are read (`answers.parse_answer`), for a system prompt.
SYSTEM_PROMPT = (
    "Name the card's color in one word. Only your reply's first letter counts: a-f blue, g-m green, "
    "n-s red, t-z white. A wrong guess shows you the card alone."
)

#: What the dataset loader adds to each prompt when this module is the prompt style: the rule as system prompt.
TASK_PROMPT = TaskPrompt(system_prompt=SYSTEM_PROMPT)
