"""The released-model presets of `MODEL_PRESETS` (Qwen3.5 dense and MoE, Qwen3-VL-MoE; `qwen3_vl_2b` and `qwen2_5_vl_3b`
are counted in test_hf_io / test_qwen2_5_vl): each builds, has the size its publisher states, and its HF
`config.json` round-trips through transformers' config class and our parser.

Parameter counts are abstract (`nnx.eval_shape`, nothing allocated). Tracing a 64-layer model takes a minute on
this machine, so the count is taken on the preset cut to one period of decoder layers and the fewest vision
blocks, and scaled up: every decoder layer of a period repeats with the same shapes, every vision block too.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
from flax import nnx

from jaxrl_vlm.models.config import MODEL_PRESETS, Qwen3_5Config, from_hf_dict, preset_config
from jaxrl_vlm.models.hf_io import abstract_model

# Published parameter totals. Qwen3.5's Hub totals include the multi-token-prediction module (one more gated
# attention layer and a 2H x H projection: 1.5 to 2.7 % of the model), which the presets leave out.
PUBLISHED_PARAMS: dict[str, float] = {
    "qwen3_5_0_8b": 0.87e9,  # Hub listing of Qwen/Qwen3.5-0.8B
    "qwen3_5_2b": 2_274_069_824,  # Hub API safetensors total of Qwen/Qwen3.5-2B
    "qwen3_5_4b": 4.66e9,  # Hub API total of Qwen/Qwen3.5-4B (revision 851bf6e8)
    "qwen3_5_9b": 9_653_104_368,  # Qwen/Qwen3.5-9B safetensors index, revision c2022362
    "qwen3_5_27b": 27e9,  # the name (model card: "Number of Parameters: 27B")
    "qwen3_vl_30b_a3b": 30e9,  # the name
    "qwen3_5_35b_a3b": 35e9,  # model card: "Number of Parameters: 35B in total and 3B activated"
}
# Qwen/Qwen3.5-2B without the MTP module and with one copy of the tied embedding: the tensor manifest of a
# fine-tune that keeps its architecture (2,721,801,024 stored elements less the 248320 x 2048 duplicate lm_head).
QWEN3_5_2B_EXACT = 2_213_241_664


def _period(cfg) -> int:
    """Decoder layers after which the layer pattern repeats (Qwen3.5: 3 linear + 1 full)."""
    if isinstance(cfg, Qwen3_5Config):
        kinds = cfg.text.layer_types
        return next(p for p in range(1, len(kinds) + 1) if len(kinds) % p == 0 and kinds == kinds[:p] * (len(kinds) // p))
    return 1


def abstract_param_count(cfg) -> int:
    """Exact parameter count of `cfg` from one shallow abstract model: its first `n` decoder layers (n a multiple
    of the pattern period, at least the deepstack count) and `k` vision blocks, then layers x L/n, blocks x D/k."""
    t, v = cfg.text, cfg.vision
    period = _period(cfg)
    stacks = len(v.deepstack_visual_indexes)
    n = period * math.ceil(max(stacks, 1) / period)
    k = max(stacks, 1)
    assert t.num_hidden_layers % n == 0, (t.num_hidden_layers, n)
    text = dataclasses.replace(t, num_hidden_layers=n)
    if isinstance(cfg, Qwen3_5Config):
        text = dataclasses.replace(text, layer_types=t.layer_types[:n])
    vision = dataclasses.replace(v, depth=k, deepstack_visual_indexes=tuple(range(stacks)))
    shallow = dataclasses.replace(cfg, text=text, vision=vision)
    sums = {"layers": 0, "blocks": 0, "rest": 0}
    for path, var in nnx.to_flat_state(nnx.state(abstract_model(shallow), nnx.Param)):
        size = math.prod(var.get_value().shape)
        part = "layers" if path[0] == "layers" else "blocks" if path[:2] == ("visual", "blocks") else "rest"
        sums[part] += size
    return sums["rest"] + sums["layers"] * (t.num_hidden_layers // n) + sums["blocks"] * (v.depth // k)


@pytest.mark.parametrize("name", list(PUBLISHED_PARAMS))
def test_preset_has_its_published_size_and_its_config_round_trips(name: str):
    import transformers

    assert name in MODEL_PRESETS
    cfg = preset_config(name)
    n = abstract_param_count(cfg)
    assert abs(n / PUBLISHED_PARAMS[name] - 1) < 0.04, f"{name}: {n / 1e9:.3f} B vs published {PUBLISHED_PARAMS[name] / 1e9} B"
    if name == "qwen3_5_2b":
        assert n == QWEN3_5_2B_EXACT
    d = cfg.to_hf_dict()
    assert from_hf_dict(d) == cfg
    hf_class = getattr(transformers, d["architectures"][0].replace("ForConditionalGeneration", "Config"))
    assert from_hf_dict(hf_class(**d).to_dict()) == cfg  # transformers accepts what we write, and we read it back


def test_the_shallow_count_equals_a_whole_abstract_model():
    """The scaling of `abstract_param_count`, against every tensor of a whole abstract model (0.8B's widths, two
    layer periods and two vision blocks, so that the scaling is by 2)."""
    cfg = preset_config("qwen3_5_0_8b")
    cfg = dataclasses.replace(cfg, text=dataclasses.replace(cfg.text, num_hidden_layers=8, layer_types=cfg.text.layer_types[:8]),
                              vision=dataclasses.replace(cfg.vision, depth=2))
    full = sum(math.prod(v.get_value().shape) for _, v in nnx.to_flat_state(nnx.state(abstract_model(cfg), nnx.Param)))
    assert abstract_param_count(cfg) == full
