"""Prompt datasets: Geometry3K loader, prompt instructions and the synthetic geo3k generator.

Nothing here imports jax: rollout hosts load datasets too.
"""

from jaxrl_vlm.data.geo3k import (
    DatasetError,
    PromptDataset,
    PromptIterator,
    build_messages,
    data_url_to_image,
    image_to_data_url,
    load_geo3k_dataset,
    load_prompt_dataset,
)
from jaxrl_vlm.data.prompts import GEO3K_SYSTEM_PROMPT, GEO3K_TOOL_NAME, GEO3K_TOOLS, GEO3K_USER_INSTRUCTION
from jaxrl_vlm.data.synthetic import generate_rows, make_dataset

__all__ = [
    "DatasetError",
    "GEO3K_SYSTEM_PROMPT",
    "GEO3K_TOOLS",
    "GEO3K_TOOL_NAME",
    "GEO3K_USER_INSTRUCTION",
    "PromptDataset",
    "PromptIterator",
    "build_messages",
    "data_url_to_image",
    "generate_rows",
    "image_to_data_url",
    "load_geo3k_dataset",
    "load_prompt_dataset",
    "make_dataset",
]
