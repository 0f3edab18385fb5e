"""Model shape names the benchmark accepts, and the analytic FLOPs of one train step.

Why analytic FLOPs: XLA's `compiled.cost_analysis()` counts a `while` body once, whatever its trip
count (measured: a 16-step `lax.scan` of matmuls reports the FLOPs of one step), and the train step
has two loops (micro-batch scan, chunked log-prob map). MFU is therefore computed from model FLOPs
(PaLM's convention), which also leave out rematerialisation; the raw cost-analysis number is reported
next to it.

Model FLOPs of one step over a (K, R, T, P) batch, forward x 3 (backward = 2 x forward): the matmuls the forward
runs (2 per multiply-add), plus the depthwise conv of linear-attention layers; other elementwise work is left out.
  text    2 * K*R*T * (per-layer matmul weights summed over the layers + lm head D*V)
            a full-attention layer: q, k, v, o (and Qwen3.5's output gate, a second q-sized projection);
            a Gated DeltaNet layer: in_proj q, k, v, z, b, a and out_proj;
            an MLP: gate, up, down; a routed MoE: router, the k chosen experts, their weighted combine, and
            Qwen3.5-MoE's shared expert and its gate
          + 4 * K*R*T*T * H*hd per full-attention layer   (QK^T and PV over every row's full T x T, as computed)
          + per Gated DeltaNet layer, K*R * ceil(T/C) chunks * Hv value heads * `delta_rule_chunk_flops`
            (the chunked delta rule as `qwen3_5.chunk_gated_delta_rule` computes it, padding chunk included)
          + 2 * K*R*T * conv taps * conv channels per Gated DeltaNet layer
  vision  2 * K*P * (patch embed + per-block weights * depth) + 2 * K*P/m * merger weights * (1 + deepstack)
          + 4 * K*P*P * Hv*hdv * depth          (full P x P per micro-batch, masked by image or window)
Padding slots are computed, so they are counted: this is the work the program does, not the work a
perfectly packed batch would need (`batching` reports padding efficiency separately).
P is the patch bucket the batch was built with: with vision reuse (`--vision-reuse`, on by default) it bounds a
micro-batch's DISTINCT patches (each image encoded once, then gathered into every sample showing it), so the vision
terms count the tower work actually run, not one encoding per copy; the gather itself is no matmul.
"""

from __future__ import annotations

import math

from jaxrl_vlm.models.config import (
    MODEL_PRESETS,
    ModelConfig,
    Qwen3VLMoeTextConfig,
    Qwen25VisionConfig,
    Qwen35MoeTextConfig,
    Qwen35TextConfig,
    TextConfig,
    VisionConfig,
)

# `--model` names: the tiny test models (`jaxrl_vlm.tiny`, one per family) and the architecture presets of
# `jaxrl_vlm.models.config`; `sharding_bench.model_config` builds them.
TINY_SHAPES: dict[str, str] = {"tiny": "qwen3_vl", "tiny_qwen2_5_vl": "qwen2_5_vl", "tiny_qwen3_vl_moe": "qwen3_vl_moe"}
MODEL_SHAPES: tuple[str, ...] = (*TINY_SHAPES, *MODEL_PRESETS)

# Chunk length of the chunked delta rule in training (`qwen3_5.DEFAULT_CHUNK`, transformers' 64; that module
# imports jax, this one must not: a test keeps the two equal).
DELTA_RULE_CHUNK = 64


def _is_full_attention(t: TextConfig | Qwen35TextConfig, layer: int) -> bool:
    return not isinstance(t, Qwen35TextConfig) or t.layer_types[layer] == "full_attention"


def mixer_weights(t: TextConfig | Qwen35TextConfig, layer: int = 0) -> int:
    """Matmul weights one token meets in the token mixer of decoder layer `layer`: q, k, v, o of (gated) attention,
    or the in/out projections of a Gated DeltaNet layer."""
    d = t.hidden_size
    if not _is_full_attention(t, layer):
        hk, hv, dk, dv = t.linear_num_key_heads, t.linear_num_value_heads, t.linear_key_head_dim, t.linear_value_head_dim
        return d * (2 * hk * dk + 2 * hv * dv + 2 * hv) + hv * dv * d  # in_proj q, k, v, z, b, a; out_proj
    q_sized = 3 if isinstance(t, Qwen35TextConfig) else 2  # q and o, and Qwen3.5's output gate
    return d * t.head_dim * (q_sized * t.num_attention_heads + 2 * t.num_key_value_heads)


def mlp_weights(t: TextConfig | Qwen35TextConfig, layer: int = 0) -> int:
    """Matmul weights one token meets in the MLP of decoder layer `layer`: a SwiGLU MLP; a routed MoE block's router,
    its k experts (the active weights) and the weighted combine of their outputs (k x D); Qwen3.5-MoE's shared
    expert (width `intermediate_size`) and its sigmoid gate [D, 1] besides."""
    d = t.hidden_size
    if isinstance(t, Qwen35MoeTextConfig) or (isinstance(t, Qwen3VLMoeTextConfig) and t.is_sparse(layer)):
        k = t.num_experts_per_tok
        routed = d * t.num_experts + k * 3 * d * t.moe_intermediate_size + k * d
        shared = 3 * d * t.intermediate_size + d if isinstance(t, Qwen35MoeTextConfig) else 0
        return routed + shared
    return 3 * d * t.intermediate_size


def text_layer_weights(t: TextConfig | Qwen35TextConfig, layer: int = 0) -> int:
    """Matmul weights one token meets in decoder layer `layer`: its token mixer and its MLP."""
    return mixer_weights(t, layer) + mlp_weights(t, layer)


def unit_lower_inverse_flops(c: int) -> int:
    """FLOPs of `qwen3_5.unit_lower_inverse` on one C x C matrix: C padded to a power of two `n`, and at each block
    size s = 1, 2, ..., n/2 the n/(2s) pairs of diagonal blocks take two s x s x s matmuls (2 n s^2 in all)."""
    n = 1 << max(c - 1, 0).bit_length()
    return sum(2 * n * (1 << i) ** 2 for i in range(n.bit_length() - 1))


def delta_rule_chunk_flops(c: int, dk: int, dv: int) -> int:
    """Matmul FLOPs of one chunk of C steps of the chunked gated delta rule, for one value head (UT form, as
    `qwen3_5.chunk_gated_delta_rule`): within the chunk k k^T, q k^T, the unit-lower inverse and its products with
    the values and the decayed keys; across chunks, reading the state with the decayed keys and queries, the intra-
    chunk attention times the new values, and the state update (state [Dk, Dv])."""
    within = 2 * c * c * (3 * dk + dv) + unit_lower_inverse_flops(c)  # k k^T, q k^T, inverse @ k; inverse @ v
    across = 3 * 2 * c * dk * dv + 2 * c * c * dv  # kcd @ S, q_dec @ S, k_dec^T @ v_new; intra @ v_new
    return within + across


def text_mixer_flops(t: TextConfig | Qwen35TextConfig, rows: int, tokens: int,
                     chunk: int = DELTA_RULE_CHUNK) -> dict[str, float]:
    """Token-mixing FLOPs over `rows` rows of `tokens` each, beyond the projections: softmax attention's QK^T and PV
    (full T x T per row) in full-attention layers; the chunked delta rule and the causal depthwise conv in Gated
    DeltaNet layers."""
    layers = range(t.num_hidden_layers)
    full = sum(1 for i in layers if _is_full_attention(t, i))
    out = {"text_attention": 4.0 * rows * tokens * tokens * t.num_attention_heads * t.head_dim * full,
           "text_delta_rule": 0.0, "text_conv": 0.0}
    linear = t.num_hidden_layers - full
    if linear:
        chunks = math.ceil(tokens / chunk)
        per_chunk = delta_rule_chunk_flops(chunk, t.linear_key_head_dim, t.linear_value_head_dim)
        out["text_delta_rule"] = float(rows) * chunks * t.linear_num_value_heads * per_chunk * linear
        out["text_conv"] = 2.0 * rows * tokens * t.linear_conv_kernel_dim * t.linear_conv_dim * linear
    return out


def vision_block_weights(v: VisionConfig | Qwen25VisionConfig) -> int:
    """Matmul weights of one ViT block: q, k, v, o (each D x D) and fc1/fc2 (gate/up/down when gated)."""
    return 4 * v.hidden_size * v.hidden_size + (3 if v.gated_mlp else 2) * v.hidden_size * v.intermediate_size


def merger_weights(cfg: ModelConfig) -> int:
    m = cfg.vision.hidden_size * cfg.vision.merge_unit
    return m * m + m * cfg.vision.out_hidden_size


def forward_flops(cfg: ModelConfig, shape_key: tuple[int, int, int, int]) -> dict[str, float]:
    """Forward FLOPs of one step's batch, split into text matmuls, text token mixing (attention, delta rule, conv),
    vision matmuls and vision attention."""
    k, r, t, p = shape_key
    tc, vc = cfg.text, cfg.vision
    slots = k * r * t
    layer_weights = sum(text_layer_weights(tc, i) for i in range(tc.num_hidden_layers))
    text_mm = 2.0 * slots * (layer_weights + tc.hidden_size * tc.vocab_size)
    patches = k * p
    vision_mm = 2.0 * patches * (vc.patch_dim * vc.hidden_size + vision_block_weights(vc) * vc.depth)
    vision_mm += 2.0 * (patches // vc.merge_unit) * merger_weights(cfg) * (1 + len(vc.deepstack_visual_indexes))
    vision_attn = 4.0 * k * p * p * vc.num_heads * vc.head_dim * vc.depth
    return {"text_matmul": text_mm, **text_mixer_flops(tc, k * r, t), "vision_matmul": vision_mm,
            "vision_attention": vision_attn}


def train_step_flops(cfg: ModelConfig, shape_key: tuple[int, int, int, int]) -> float:
    """Model FLOPs of one optimizer step (forward + backward, no recompute) over the whole batch."""
    return 3.0 * sum(forward_flops(cfg, shape_key).values())
