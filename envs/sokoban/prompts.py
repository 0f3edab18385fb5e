"""Sokoban's words: the question under the board, the move tool, the system prompt, `TASK_PROMPT`. No jax."""

from __future__ import annotations

from envs.base import TaskPrompt

MOVE_TOOL = "move"
QUESTION = "Push the box onto the red square. Your move?"
SYSTEM_PROMPT = (
    "You play Sokoban on the pictured board. Each reply is one move: up, down, left or right (the first of these "
    'words counts), or the tool call <tool_call>{"name": "move", "arguments": {"direction": "up"}}</tool_call>. '
    "Every move costs a little; solving earns 1."
)
TOOLS = [{
    "type": "function",
    "function": {
        "name": MOVE_TOOL,
        "description": "Move the player one cell (pushing a box in the way).",
        "parameters": {"type": "object", "required": ["direction"], "properties": {
            "direction": {"type": "string", "enum": ["up", "down", "left", "right"]}}},
    },
}]
TASK_PROMPT = TaskPrompt(system_prompt=SYSTEM_PROMPT)
