"""Geometry3K prompts: the tool (its name, defined once here), the system prompt and `TASK_PROMPT`.

The model may check a candidate answer with the tool `calc_geo3k_reward` (the
Geometry3K environment answers the call) and must end with its answer in
`\\boxed{}`. `GEO3K_TOOLS` is the OpenAI-style function list that
`tokenizer.apply_chat_template(..., tools=GEO3K_TOOLS)` expects; the loader
stores it in `Sample.metadata["tools"]` so every consumer renders the same
preamble. `TASK_PROMPT` is what the dataset loader reads (`--prompt-style geo3k`).

No jax (envs/ never imports it): this module is read on rollout hosts too.
"""

from __future__ import annotations

import json

from envs.base import TaskPrompt

GEO3K_TOOL_NAME = "calc_geo3k_reward"
GEO3K_TOOL_NAMES = (GEO3K_TOOL_NAME, "calc_score")  # the names the env accepts in a call (slime's example accepts both)

GEO3K_TOOLS: list[dict] = [
    {
        "type": "function",
        "function": {
            "name": GEO3K_TOOL_NAME,
            "description": (
                "Check a candidate final answer to the geometry problem. "
                "Returns whether the answer is correct."
            ),
            "parameters": {
                "type": "object",
                "properties": {
                    "answer": {
                        "type": "string",
                        "description": (
                            "The candidate answer only, e.g. '12', '7.5', '30' or '5\\sqrt{3}' "
                            "(no units, no \\boxed{})."
                        ),
                    }
                },
                "required": ["answer"],
            },
        },
    }
]

_EXAMPLE_CALL = json.dumps({"name": GEO3K_TOOL_NAME, "arguments": {"answer": "..."}})

GEO3K_SYSTEM_PROMPT = (
    "You are an expert at geometry. Solve the problem shown in the image, reasoning step by step.\n"
    f"You may check a candidate answer by calling the tool `{GEO3K_TOOL_NAME}` like this:\n"
    f"<tool_call>{_EXAMPLE_CALL}</tool_call>\n"
    "The tool replies whether the answer is correct; use its feedback to revise your work.\n"
    "You must finally give your answer in \\boxed{}, for example \\boxed{12}."
)

GEO3K_USER_INSTRUCTION = (
    f"Think step by step. You may check your answer with the `{GEO3K_TOOL_NAME}` tool. "
    "Put your final answer in \\boxed{}."
)

#: The dataset's prompt for this task: the tool-calling system prompt and the tool schema. The user
#: instruction is opt-in (`instruction=GEO3K_USER_INSTRUCTION` when loading), not part of the default.
TASK_PROMPT = TaskPrompt(system_prompt=GEO3K_SYSTEM_PROMPT, tools=GEO3K_TOOLS)
