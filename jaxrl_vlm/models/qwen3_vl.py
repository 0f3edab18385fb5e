"""Qwen3-VL (vision tower with learned positions and deepstack mergers, Qwen3 text decoder) in plain Flax NNX.

Semantics follow transformers' `modeling_qwen3_vl.py`. Everything is a shared layer: the text decoder, attention
and norms (`layers.py`), and its vision tower, `layers.LearnedPositionVisionTower` (patch embedding with bias, a
learned square position table bilinearly resampled to each image, LayerNorm blocks with a two-matrix MLP, and the
deepstack mergers after the blocks of `deepstack_visual_indexes`, whose features are added to the hidden states after
the first decoder layers), which Qwen3.5 reuses without deepstack; its HF names are
`hf_links.learned_position_vision_links`. What is Qwen3-VL's own here is the composition and its registration
(`FAMILY_MODEL`): the engine runs it on the paged KV cache (`paged_kv.py`). The config and its parser are
`config.Qwen3VLConfig` / `qwen3_vl_from_hf_dict`.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from jaxrl_vlm.models import paged_kv
from jaxrl_vlm.models.config import Qwen3VLConfig
from jaxrl_vlm.models.families import FamilyModel
from jaxrl_vlm.models.hf_links import Link, learned_position_vision_links, text_decoder_links
from jaxrl_vlm.models.layers import LearnedPositionVisionTower, VisionLanguageDecoder
from jaxrl_vlm.models.remat import RematPlan


class Qwen3VL(VisionLanguageDecoder):
    """Qwen3-VL for causal LM: the shared decoder with Qwen3-VL's vision tower (learned positions, deepstack)."""

    def __init__(
        self,
        cfg: Qwen3VLConfig,
        *,
        rngs: nnx.Rngs,
        param_dtype: jnp.dtype = jnp.float32,
        compute_dtype: jnp.dtype = jnp.float32,
        remat: bool | str | RematPlan = False,
        attention_impl: str = "xla",
        patch_attention_block: int | None = None,
    ):
        """remat: recompute each decoder layer and vision block in the backward pass (True: activation memory ~
        one layer), or a policy per layer kind (`remat.RematPlan`, or its `--remat` spec string); attention_impl: "xla" (einsums, dense masks), "pallas_gpu" / "pallas_tpu"
        (the fused segment-aware kernels of `flash_attention.py`), or "ring" (text attention of `ring_attention.py`,
        the vision tower on XLA's); patch_attention_block: the most patches of
        one image frame (`rollout.processing.max_frame_patches`), which lets the XLA vision attention work
        chunk by chunk (`local_segment_attention`; None: dense)."""
        super().__init__(cfg, LearnedPositionVisionTower, rngs=rngs, param_dtype=param_dtype, compute_dtype=compute_dtype,
                         remat=remat, attention_impl=attention_impl, patch_attention_block=patch_attention_block)


# ----------------------------------------------------------------------------- HF tensor names


def weight_links(cfg: Qwen3VLConfig) -> list[Link]:
    """Every tensor of `Qwen3VLForConditionalGeneration` and where it lives in `Qwen3VL`."""
    return text_decoder_links(cfg) + learned_position_vision_links(cfg)


FAMILY_MODEL = FamilyModel(
    model_class=Qwen3VL,
    weight_links=weight_links,
    init_cache=paged_kv.init_cache,
    prefill=paged_kv.prefill,
    decode=paged_kv.decode,
    prefill_rows=paged_kv.prefill_rows,
)
