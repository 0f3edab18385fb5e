"""Flax NNX Qwen3-VL: config, host-side positions, model, HF checkpoint import/export."""

from jaxrl_vlm.models.config import (
    ConfigError,
    Qwen3VLConfig,
    TextConfig,
    VisionConfig,
    from_hf_dict,
    qwen3_vl_2b_instruct,
)
from jaxrl_vlm.models.hf_io import CheckpointError, from_hf, load_hf_config, param_count, to_hf
from jaxrl_vlm.models.qwen3_vl import Qwen3VL, attention, token_logprobs
from jaxrl_vlm.models.rope import (
    get_rope_index,
    get_rope_index_packed,
    vision_pos_embed_interp,
    vision_rotary_positions,
)
from jaxrl_vlm.models.vision import VisionInputs, build_vision_inputs

__all__ = [
    "CheckpointError",
    "ConfigError",
    "Qwen3VL",
    "Qwen3VLConfig",
    "TextConfig",
    "VisionConfig",
    "VisionInputs",
    "attention",
    "build_vision_inputs",
    "from_hf",
    "from_hf_dict",
    "get_rope_index",
    "get_rope_index_packed",
    "load_hf_config",
    "param_count",
    "qwen3_vl_2b_instruct",
    "to_hf",
    "token_logprobs",
    "vision_pos_embed_interp",
    "vision_rotary_positions",
]
