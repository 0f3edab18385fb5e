"""Model shape names the benchmark accepts, and the analytic FLOPs of one train step.

Why analytic FLOPs: XLA's `compiled.cost_analysis()` counts a `while` body once, whatever its trip
count (measured: a 16-step `lax.scan` of matmuls reports the FLOPs of one step), and the train step
has two loops (micro-batch scan, chunked log-prob map). MFU is therefore computed from model FLOPs
(PaLM's convention), which also leave out rematerialisation; the raw cost-analysis number is reported
next to it.

Model FLOPs of one step over a (K, R, T, P) batch, forward x 3 (backward = 2 x forward):
  text    2 * K*R*T * (per-layer matmul weights * L + lm head D*V)
          + 4 * K*R*T*T * H*hd * L              (QK^T and PV over every row's full T x T, as computed)
  vision  2 * K*P * (patch embed + per-block weights * depth) + 2 * K*P/m * merger weights * (1 + deepstack)
          + 4 * K*P*P * Hv*hdv * depth          (full P x P per micro-batch, masked by image or window)
Padding slots are computed, so they are counted: this is the work the program does, not the work a
perfectly packed batch would need (`batching` reports padding efficiency separately).
"""

from __future__ import annotations

from jaxrl_vlm.models.config import (
    MODEL_PRESETS,
    ModelConfig,
    Qwen3VLMoeTextConfig,
    Qwen25VisionConfig,
    TextConfig,
    VisionConfig,
)

# `--model` names: the tiny test models (`jaxrl_vlm.tiny`, one per family) and the architecture presets of
# `jaxrl_vlm.models.config`; `sharding_bench.model_config` builds them.
TINY_SHAPES: dict[str, str] = {"tiny": "qwen3_vl", "tiny_qwen2_5_vl": "qwen2_5_vl"}
MODEL_SHAPES: tuple[str, ...] = (*TINY_SHAPES, *MODEL_PRESETS)


def text_layer_weights(t: TextConfig, layer: int = 0) -> int:
    """Matmul weights one token meets in decoder layer `layer`: q, k, v, o projections and the gated MLP; in a
    routed MoE layer (`t.is_sparse(layer)`) the router and its k experts' MLPs (the active weights)."""
    attn = t.hidden_size * t.head_dim * (2 * t.num_attention_heads + 2 * t.num_key_value_heads)
    if isinstance(t, Qwen3VLMoeTextConfig) and t.is_sparse(layer):
        return attn + t.hidden_size * t.num_experts + t.num_experts_per_tok * 3 * t.hidden_size * t.moe_intermediate_size
    return attn + 3 * t.hidden_size * t.intermediate_size


def vision_block_weights(v: VisionConfig | Qwen25VisionConfig) -> int:
    """Matmul weights of one ViT block: q, k, v, o (each D x D) and fc1/fc2 (gate/up/down when gated)."""
    return 4 * v.hidden_size * v.hidden_size + (3 if v.gated_mlp else 2) * v.hidden_size * v.intermediate_size


def merger_weights(cfg: ModelConfig) -> int:
    m = cfg.vision.hidden_size * cfg.vision.merge_unit
    return m * m + m * cfg.vision.out_hidden_size


def forward_flops(cfg: ModelConfig, shape_key: tuple[int, int, int, int]) -> dict[str, float]:
    """Forward FLOPs of one step's batch, split into text and vision matmuls and attention."""
    k, r, t, p = shape_key
    tc, vc = cfg.text, cfg.vision
    slots = k * r * t
    layer_weights = sum(text_layer_weights(tc, i) for i in range(tc.num_hidden_layers))
    text_mm = 2.0 * slots * (layer_weights + tc.hidden_size * tc.vocab_size)
    text_attn = 4.0 * k * r * t * t * tc.num_attention_heads * tc.head_dim * tc.num_hidden_layers
    patches = k * p
    vision_mm = 2.0 * patches * (vc.patch_dim * vc.hidden_size + vision_block_weights(vc) * vc.depth)
    vision_mm += 2.0 * (patches // vc.merge_unit) * merger_weights(cfg) * (1 + len(vc.deepstack_visual_indexes))
    vision_attn = 4.0 * k * p * p * vc.num_heads * vc.head_dim * vc.depth
    return {"text_matmul": text_mm, "text_attention": text_attn, "vision_matmul": vision_mm, "vision_attention": vision_attn}


def train_step_flops(cfg: ModelConfig, shape_key: tuple[int, int, int, int]) -> float:
    """Model FLOPs of one optimizer step (forward + backward, no recompute) over the whole batch."""
    return 3.0 * sum(forward_flops(cfg, shape_key).values())
