"""A tiny random transformers Qwen3.5 (dense) checkpoint for the Qwen3.5 tests.

Built the HF way (`transformers.Qwen3_5Config` / `Qwen3_5ForConditionalGeneration`, fp32, `torch.manual_seed`),
weights re-spread like `_hf_tiny.spread_weights` so that a wrong layout changes logits far beyond 1e-4. The shape
exercises what is Qwen3.5's own: 3 Gated DeltaNet layers around 1 full-attention layer, value heads outnumbering
key heads (4 vs 2), key and value head dims that differ, partial rotary (half of a 32-dim head) with interleaved
M-RoPE, untied embeddings, and Qwen3-VL's vision tower without deepstack (patch 16, merge 2).
"""

from __future__ import annotations

import torch
from _hf_tiny import VOCAB_SPECIALS, spread_weights

TINY_QWEN3_5: dict = dict(
    text_config=dict(
        vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6,
        layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
        linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=8, linear_num_key_heads=2,
        linear_num_value_heads=4,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [3, 3, 2],
                         "mrope_interleaved": True, "partial_rotary_factor": 0.5},
    ),
    vision_config=dict(
        depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=16, temporal_patch_size=2,
        spatial_merge_size=2, out_hidden_size=64, num_position_embeddings=64,
    ),
    tie_word_embeddings=False,
    **VOCAB_SPECIALS,
)


def build_hf_qwen3_5(seed: int = 0):
    """A random fp32 `Qwen3_5ForConditionalGeneration` of `TINY_QWEN3_5`, in eval mode.

    After the spread: the zero-centred RMSNorms (weight w scales by 1 + w) are redrawn around 0, not 1, so that
    each norm does not double the activations (which pushes fp32 round-off towards the 1e-4 tolerance); A_log is
    redrawn near log(0.4) so that the recurrent state carries over many steps (the spread init would make most
    heads forget within a few tokens, and hide a wrong state hand-over)."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    torch.manual_seed(seed)
    model = Qwen3_5ForConditionalGeneration(Qwen3_5Config(**TINY_QWEN3_5)).eval().float()
    spread_weights(model, seed + 1)
    gen = torch.Generator().manual_seed(seed + 2)
    with torch.no_grad():
        for key, p in model.named_parameters():
            if key.endswith("A_log"):
                p.copy_(-1.0 + 0.5 * torch.randn(p.shape, generator=gen))
            elif key.startswith("model.language_model.") and key.endswith("norm.weight") and "linear_attn" not in key:
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))
    return model
