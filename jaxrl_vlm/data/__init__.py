"""Prompt datasets: the Geometry3K-layout loader (parquet/jsonl), task prompts loaded by path, PromptIterator; and
the conversation datasets of SFT runs (`sft.py`).

A task's own prompt (system prompt, tools) and its synthetic data live with the task (`envs/geo3k/`).
Nothing here imports jax: rollout hosts load datasets too.
"""

from jaxrl_vlm.data.geo3k import (
    PROMPT_STYLES,
    DatasetError,
    PromptDataset,
    PromptIterator,
    build_messages,
    data_url_to_image,
    image_to_data_url,
    load_geo3k_dataset,
    load_prompt_dataset,
    load_styled_dataset,
    load_task_dataset,
    load_task_prompt,
)
from jaxrl_vlm.data.sft import ConversationDataset, load_conversation_dataset

__all__ = [
    "ConversationDataset",
    "PROMPT_STYLES",
    "DatasetError",
    "PromptDataset",
    "PromptIterator",
    "build_messages",
    "data_url_to_image",
    "image_to_data_url",
    "load_conversation_dataset",
    "load_geo3k_dataset",
    "load_prompt_dataset",
    "load_styled_dataset",
    "load_task_dataset",
    "load_task_prompt",
]
