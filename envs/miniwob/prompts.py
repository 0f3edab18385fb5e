"""MiniWoB's words: the question that opens each prompt, the system prompt, `TASK_PROMPT`. No jax."""

from __future__ import annotations

from envs.base import TaskPrompt
from envs.gui.prompts import TOOLS

QUESTION = "The screenshot is a web page. Do what its instruction says: reply click(x, y), x and y from 0 to 1000."
SYSTEM_PROMPT = (
    "You operate the web page in the screenshot; its instruction is in the bar on top. One action per reply: "
    "click(x, y) with x, y from 0 to 1000 relative to the screenshot, or type(\"text\") into the focused field; or "
    'the same as a tool call, e.g. <tool_call>{"name": "click", "arguments": {"x": 500, "y": 300}}</tool_call>.'
)
TASK_PROMPT = TaskPrompt(system_prompt=SYSTEM_PROMPT, tools=TOOLS)
