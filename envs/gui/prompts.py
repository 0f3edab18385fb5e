"""The GUI task's words: tasks, tools, system prompt, `TASK_PROMPT`. No jax."""

from __future__ import annotations

from envs.base import TaskPrompt

CLICK_TOOL, TYPE_TOOL = "click", "type"
SYSTEM_PROMPT = (
    "You operate the computer in the screenshot. One action per reply: click(x, y) with x, y from 0 to 1000 relative "
    'to the screenshot, or type("text") into the focused field; or the same as a tool call, e.g. '
    '<tool_call>{"name": "click", "arguments": {"x": 500, "y": 300}}</tool_call>.'
)
TOOLS = [
    {"type": "function", "function": {
        "name": CLICK_TOOL, "description": "Click at (x, y), 0-1000 relative to the screenshot.",
        "parameters": {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
                       "required": ["x", "y"]}}},
    {"type": "function", "function": {
        "name": TYPE_TOOL, "description": "Type text into the focused field (replacing its content).",
        "parameters": {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}}},
]
TASK_PROMPT = TaskPrompt(system_prompt=SYSTEM_PROMPT, tools=TOOLS)


def toggle_task(name: str) -> str:
    return f"Open the settings and turn on {name}."


def rename_task(text: str) -> str:
    return f'Open the settings and set the name to "{text}".'
