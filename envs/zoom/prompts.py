"""The zoom task's words: question, the two tools, system prompt, `TASK_PROMPT`. No jax."""

from __future__ import annotations

from envs.base import TaskPrompt

ZOOM_TOOL, ANSWER_TOOL = "zoom", "answer"
QUESTION = "Which digit is written in the small white box?"
SYSTEM_PROMPT = (
    "The picture is large and the detail is small. Look closer with the tool call "
    '<tool_call>{"name": "zoom", "arguments": {"bbox_2d": [x1, y1, x2, y2]}}</tool_call> '
    "(coordinates 0-1000, relative to the picture); it returns that region enlarged. "
    'Answer with <tool_call>{"name": "answer", "arguments": {"answer": "7"}}</tool_call> or just the digit.'
)
TOOLS = [
    {"type": "function", "function": {
        "name": ZOOM_TOOL, "description": "Crop a region of the picture and show it enlarged.",
        "parameters": {"type": "object", "properties": {"bbox_2d": {
            "type": "array", "items": {"type": "integer"}, "description": "[x1, y1, x2, y2], 0-1000 relative"}},
            "required": ["bbox_2d"]}}},
    {"type": "function", "function": {
        "name": ANSWER_TOOL, "description": "Give the final answer (one digit).",
        "parameters": {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}}},
]
TASK_PROMPT = TaskPrompt(system_prompt=SYSTEM_PROMPT, tools=TOOLS)
