"""The video-motion task's words: the question after the clip, the rule for replies, `TASK_PROMPT`.

No jax (envs/ never imports it).
"""

from __future__ import annotations

from envs.base import TaskPrompt

#: The text after the first clip (reset's observation; the prompt rows themselves are empty). Short on purpose: a
#: tiny model's attention is spread over every prompt token, and the clip is only a few of them.
QUESTION = "Which way did the square move?"

#: The text after the slow clip (the answer to a "slow" reply).
SLOW_QUESTION = "The same, at half speed. Which way did it move?"

#: How replies are read (`answers.parse_reply`), for a system prompt.
SYSTEM_PROMPT = (
    "Say which way the square moved, left or right, in one word, or say slow to watch it again at half speed. "
    "Only your reply's first letter counts: a-l left, m-r right, s-z slow. A wrong answer ends the game; "
    "watching again costs a little."
)

#: What the dataset loader adds to each prompt when this module is the prompt style: the rule as system prompt.
TASK_PROMPT = TaskPrompt(system_prompt=SYSTEM_PROMPT)
