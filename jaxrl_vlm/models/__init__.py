"""Flax NNX Qwen-VL families (Qwen3-VL, Qwen2.5-VL, Qwen3.5, Qwen3-VL-MoE, Qwen3.5-MoE): configs, host-side
positions, models, HF import/export.

One file per family (`qwen3_vl.py`, `qwen2_5_vl.py`) on the shared layers (`layers.py`), found by model_type in
the registry (`families.py`).

Names are resolved lazily (PEP 562) so that the numpy-only submodules (`config`, `rope`, `vision`) can be
imported by host-side code (batching, rollout hosts) without importing jax.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "ConfigError": "config", "Qwen3VLConfig": "config", "TextConfig": "config", "VisionConfig": "config",
    "MODEL_PRESETS": "config", "from_hf_dict": "config", "preset_config": "config", "qwen3_vl_2b_instruct": "config",
    "small_model_config": "config", "Qwen25VLConfig": "config", "Qwen25VisionConfig": "config",
    "ModelConfig": "config", "qwen2_5_vl_3b_instruct": "config",
    "Qwen25VL": "qwen2_5_vl", "model_class": "hf_io", "WindowedVisionInputs": "vision", "vision_window_index": "vision",
    "CheckpointError": "hf_io", "from_hf": "hf_io", "load_hf_config": "hf_io", "param_count": "hf_io", "to_hf": "hf_io",
    "Qwen3VL": "qwen3_vl", "attention": "layers", "token_logprobs": "layers",
    "Family": "families", "FamilyModel": "families", "PolicyModel": "families",
    "DecodeCache": "families", "family": "families", "family_of": "families", "family_model": "families",
    "get_rope_index": "rope", "get_rope_index_packed": "rope", "vision_pos_embed_interp": "rope",
    "vision_rotary_positions": "rope",
    "VisionInputs": "vision", "build_vision_inputs": "vision",
    "Qwen3_5Config": "config", "Qwen35TextConfig": "config", "Qwen3_5": "qwen3_5", "HybridCache": "qwen3_5",
    "Qwen3VLMoeConfig": "config", "Qwen3VLMoeTextConfig": "config", "Qwen3VLMoe": "qwen3_vl_moe",
    "SparseMoE": "moe", "Routing": "moe", "load_balancing_loss": "moe", "expert_load": "moe",
    "Qwen3_5MoeConfig": "config", "Qwen35MoeTextConfig": "config", "Qwen3_5Moe": "qwen3_5_moe",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'jaxrl_vlm.models' has no attribute {name!r}")
    return getattr(importlib.import_module(f"jaxrl_vlm.models.{_EXPORTS[name]}"), name)
