"""The analytic model FLOPs (`bench.flops`) against an independent count: the matmuls of the forward program itself.

The count walks the jaxpr of one forward (embedding, decoder, LM head over every position) of a tiny model of each
family and adds 2 x (output size) x (contracted size) for every `dot_general` and `ragged_dot` (the grouped expert
matmul), entering scans (times their trip count), jitted calls and custom-gradient functions (the delta rule's
unit-lower inverse). Rows of 80 tokens cross the delta rule's 64-step chunk, so its padded second chunk counts. The
model FLOPs must equal that count exactly, apart from the Gated DeltaNet conv (elementwise taps, counted by hand).
The old model, which took every Qwen3.5 layer for softmax attention without the output gate and counted
Qwen3.5-MoE's MLPs as dense of the shared expert's width, fails it for both families.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _hf_tiny import VOCAB_SPECIALS
from _hf_tiny_qwen3_5 import TINY_QWEN3_5
from flax import nnx
from jax.extend import core as jax_core

from jaxrl_vlm.bench import flops
from jaxrl_vlm.models import get_rope_index
from jaxrl_vlm.models.config import MODEL_PRESETS, from_hf_dict
from jaxrl_vlm.models.hf_io import abstract_model
from jaxrl_vlm.models.qwen3_5 import DEFAULT_CHUNK

ROWS, TOKENS = 2, 80

TINY_MOE_TEXT = dict(TINY_QWEN3_5["text_config"], intermediate_size=48, num_experts=4, num_experts_per_tok=2,
                     moe_intermediate_size=40)
CONFIGS = {
    "qwen3_5": dict(TINY_QWEN3_5, model_type="qwen3_5"),
    "qwen3_5_moe": dict(TINY_QWEN3_5, model_type="qwen3_5_moe",
                        text_config={**{k: v for k, v in TINY_MOE_TEXT.items() if k != "intermediate_size"},
                                     "shared_expert_intermediate_size": 48}),
    "qwen3_vl_moe": dict(
        model_type="qwen3_vl_moe", tie_word_embeddings=False, **VOCAB_SPECIALS,
        text_config=dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4,
                         num_experts_per_tok=2, moe_intermediate_size=40, mlp_only_layers=[1],
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3],
                                          "mrope_interleaved": True}),
        vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                           num_position_embeddings=64, deepstack_visual_indexes=[]),
    ),
}


def matmul_flops(jaxpr: jax_core.Jaxpr) -> int:
    """2 x output size x contracted size over the dot_general / ragged_dot equations of `jaxpr`, sub-jaxprs included
    (a scan's body times its length)."""
    total = 0
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name in ("while", "cond"):
            raise AssertionError(f"{name} in the forward: its trip count / branch is not static")
        if name == "dot_general" or name.startswith("ragged_dot"):
            numbers = eqn.params.get("dimension_numbers") or eqn.params["ragged_dot_dimension_numbers"].dot_dimension_numbers
            (lhs_contract, _), _ = numbers
            lhs, out = eqn.invars[0].aval, eqn.outvars[0].aval
            total += 2 * math.prod(out.shape) * math.prod(lhs.shape[i] for i in lhs_contract)
        times = eqn.params["length"] if name == "scan" else 1
        for sub in jax_core.jaxprs_in_params(eqn.params):
            total += times * matmul_flops(sub)
    return total


def _forward_jaxpr(cfg) -> jax_core.Jaxpr:
    """The jaxpr of logits [ROWS, TOKENS, V] of a text batch (abstract parameters: nothing is allocated)."""
    graphdef, state = nnx.split(abstract_model(cfg))
    ids = np.full((ROWS, TOKENS), 7, np.int64)
    positions, _ = get_rope_index(ids, None, np.ones_like(ids), cfg)

    def logits(state, tokens, positions, segment_ids):
        model = nnx.merge(graphdef, state)
        return model.logits(model(tokens, positions, segment_ids))

    return jax.make_jaxpr(logits)(state, jnp.asarray(ids, jnp.int32), jnp.asarray(positions),
                                  jnp.ones((ROWS, TOKENS), jnp.int32)).jaxpr


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_model_flops_equal_the_matmuls_of_the_forward_program(family):
    cfg = from_hf_dict(CONFIGS[family])
    model = flops.forward_flops(cfg, (1, ROWS, TOKENS, 0))
    assert model["vision_matmul"] == model["vision_attention"] == 0
    assert model["text_matmul"] + model["text_attention"] + model["text_delta_rule"] == matmul_flops(_forward_jaxpr(cfg))
    t = cfg.text
    if family.startswith("qwen3_5"):
        # The conv, by hand: 4 taps over q|k|v channels (2 key heads x 16 twice, 4 value heads x 8), 3 linear layers.
        assert model["text_conv"] == 2 * ROWS * TOKENS * 4 * (2 * 2 * 16 + 4 * 8) * 3
        assert model["text_delta_rule"] > 0 and t.layer_types.count("full_attention") == 1
    else:
        assert model["text_conv"] == model["text_delta_rule"] == 0


def test_the_delta_rule_chunk_is_the_models():
    assert flops.DELTA_RULE_CHUNK == DEFAULT_CHUNK


def test_qwen3_5_35b_a3b_activates_about_3b_parameters_per_token():
    """The released 35B-A3B's name: ~3B parameters active per token (decoder matmul weights and LM head; measured
    2.94e9), of which the routed experts are 8 of 256."""
    cfg = MODEL_PRESETS["qwen3_5_35b_a3b"]()
    t = cfg.text
    active = sum(flops.text_layer_weights(t, i) for i in range(t.num_hidden_layers)) + t.hidden_size * t.vocab_size
    assert 2.7e9 < active < 3.3e9, active
    dense_width = sum(3 * t.hidden_size * t.intermediate_size for _ in range(t.num_hidden_layers))
    assert sum(flops.mlp_weights(t, i) for i in range(t.num_hidden_layers)) > 4 * dense_width
