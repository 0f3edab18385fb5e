"""Checkpoints as they exist outside our own exports: what released Qwen3.5 / Qwen3.5-MoE checkpoints and
transformers' own `save_pretrained` write, read by `hf_io.from_hf` as transformers reads them.

- Released Qwen3.5 checkpoints carry a multi-token-prediction head (`mtp.*`). transformers' Qwen3.5 classes skip
  exactly those tensors (`_keys_to_ignore_on_load_unexpected = [r"^mtp.*"]`), and so does our import: the
  checkpoint loads to the same parameters as without them, and the skip is logged. Any other tensor that the
  family does not read, even one named like the head elsewhere, still fails, naming the key; transformers itself
  (its loading info) is the reference for which keys are which.
- transformers 5.24 `save_pretrained` of Qwen3.5-MoE splits each layer's fused experts into one tensor per expert
  (`mlp.experts.{e}.gate_proj.weight` ...), the form SGLang and vLLM also accept beside the fused one. That output
  (with an MTP head added, as released) loads with exactly transformers' expert weights and our logits within
  1e-4 of transformers' float64 ones, and the engine's weight update reads it alike; a checkpoint missing one
  expert's tensor fails naming it.
"""

from __future__ import annotations

import copy
import logging
import shutil

import numpy as np
import pytest
import torch
from _hf_tiny import make_batch
from _hf_tiny_qwen3_5 import TINY_QWEN3_5, build_hf_qwen3_5
from flax import nnx
from safetensors.torch import load_file, save_file
from test_qwen3_5_moe import TINY_MOE, build_hf_qwen3_5_moe

import jax.numpy as jnp
from jaxrl_vlm.engine.weights import load_params_state
from jaxrl_vlm.models import from_hf, get_rope_index
from jaxrl_vlm.models.hf_io import CheckpointError

TOL = 1e-4


def _mtp_head(d: int, f: int, n: int, h: int) -> dict[str, torch.Tensor]:
    """A multi-token-prediction head under released Qwen3.5's names (fc over [embedding; hidden], its norms, one
    decoder layer, final norm), random values."""
    gen = torch.Generator().manual_seed(7)
    shapes = {
        "mtp.fc.weight": (d, 2 * d),
        "mtp.pre_fc_norm_embedding.weight": (d,),
        "mtp.pre_fc_norm_hidden.weight": (d,),
        "mtp.layers.0.input_layernorm.weight": (d,),
        "mtp.layers.0.self_attn.q_proj.weight": (2 * n * h, d),
        "mtp.layers.0.mlp.gate_proj.weight": (f, d),
        "mtp.norm.weight": (d,),
    }
    return {k: torch.randn(s, generator=gen) for k, s in shapes.items()}


def _with_tensors(src, dst, extra: dict[str, torch.Tensor], drop: tuple[str, ...] = ()):
    """A copy of checkpoint directory `src` at `dst` with `extra` tensors added to (and `drop` removed from) its
    single `model.safetensors`."""
    shutil.copytree(src, dst)
    tensors = {k: v for k, v in load_file(src / "model.safetensors").items() if k not in drop}
    save_file({**tensors, **extra}, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def _params(model) -> dict:
    return {path: np.asarray(v.get_value()) for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def _unexpected_in_transformers(cls, path) -> list[str]:
    _, info = cls.from_pretrained(path, output_loading_info=True)
    return sorted(info["unexpected_keys"])


def test_the_mtp_head_of_released_qwen3_5_is_skipped_as_transformers_skips_it(tmp_path, caplog):
    from transformers import Qwen3_5ForConditionalGeneration

    hf = build_hf_qwen3_5()
    plain = tmp_path / "plain"
    hf.save_pretrained(plain)
    t = TINY_QWEN3_5["text_config"]
    head = _mtp_head(t["hidden_size"], t["intermediate_size"], t["num_attention_heads"], t["head_dim"])
    released = _with_tensors(plain, tmp_path / "released", head)

    assert _unexpected_in_transformers(Qwen3_5ForConditionalGeneration, released) == []
    with caplog.at_level(logging.INFO, logger="jaxrl_vlm.models.hf_io"):
        got = _params(from_hf(released))
    assert f"ignored {len(head)} tensors" in caplog.text
    want = _params(from_hf(plain))
    assert got.keys() == want.keys()
    for path in want:
        np.testing.assert_array_equal(got[path], want[path], err_msg=str(path))

    # The head's name under the decoder is no MTP head to transformers, nor to us: it is an error, named.
    stray = "model.language_model.mtp.fc.weight"
    bad = _with_tensors(released, tmp_path / "stray", {stray: head["mtp.fc.weight"]})
    assert _unexpected_in_transformers(Qwen3_5ForConditionalGeneration, bad) == ["model.language_model.mtp.fc.weight"]
    with pytest.raises(CheckpointError, match=r"unexpected keys \(1\): \['model\.language_model\.mtp\.fc\.weight'\]"):
        from_hf(bad)


@pytest.fixture(scope="module")
def moe_saved(tmp_path_factory):
    """(transformers Qwen3.5-MoE fp32, its `save_pretrained` directory with an MTP head added)."""
    hf = build_hf_qwen3_5_moe()
    root = tmp_path_factory.mktemp("qwen3_5_moe_saved")
    hf.save_pretrained(root / "saved")
    t = TINY_MOE["text_config"]
    head = _mtp_head(t["hidden_size"], 48, t["num_attention_heads"], t["head_dim"])
    head["mtp.layers.0.mlp.experts.gate_up_proj"] = torch.zeros(t["num_experts"], 80, t["hidden_size"])
    return hf, _with_tensors(root / "saved", root / "released", head)


def test_save_pretrained_of_qwen3_5_moe_writes_experts_one_by_one_and_loads_with_transformers_logits(moe_saved):
    hf, path = moe_saved
    stored = load_file(path / "model.safetensors")
    e, f = TINY_MOE["text_config"]["num_experts"], TINY_MOE["text_config"]["moe_intermediate_size"]
    layer = "model.language_model.layers.3.mlp.experts."
    assert f"{layer}{e - 1}.up_proj.weight" in stored and f"{layer}gate_up_proj" not in stored

    ours = from_hf(path)
    # The engine's weight update reads the same directory to the same parameters.
    updated = dict(nnx.to_flat_state(load_params_state(path, ours.cfg, nnx.state(ours, nnx.Param))))
    for key, value in _params(ours).items():
        np.testing.assert_array_equal(np.asarray(updated[key].get_value()), value, err_msg=str(key))
    # Exactly transformers' fused experts (gate rows, then up rows; down), for every layer.
    for i, block in enumerate(ours.layers):
        gate_up = hf.model.language_model.layers[i].mlp.experts.gate_up_proj.detach().numpy()
        down = hf.model.language_model.layers[i].mlp.experts.down_proj.detach().numpy()
        np.testing.assert_array_equal(np.asarray(block.mlp.gate_experts_edf[...]), gate_up[:, :f].transpose(0, 2, 1))
        np.testing.assert_array_equal(np.asarray(block.mlp.up_experts_edf[...]), gate_up[:, f:].transpose(0, 2, 1))
        np.testing.assert_array_equal(np.asarray(block.mlp.down_experts_efd[...]), down.transpose(0, 2, 1))

    batch = make_batch([[29], [17]], [], seed=5)
    hf64 = copy.deepcopy(hf).double()
    hf64.set_experts_implementation("eager")  # its grouped-GEMM path is fp32/bf16 only
    with torch.no_grad():
        ref = hf64(**batch.torch_kwargs()).logits.numpy()
    positions, _ = get_rope_index(batch.input_ids, None, batch.attention_mask, ours.cfg)

    @nnx.jit
    def logits(model, tokens, positions, segment_ids):
        return model.logits(model(tokens, positions, segment_ids))

    got = np.asarray(logits(ours, jnp.asarray(batch.input_ids, jnp.int32), jnp.asarray(positions),
                            jnp.asarray(batch.attention_mask, jnp.int32)))
    real = batch.attention_mask.astype(bool)
    assert np.abs(got - ref)[real].max() <= TOL


def test_a_per_expert_checkpoint_missing_one_expert_fails_naming_it(moe_saved, tmp_path):
    _, path = moe_saved
    gone = "model.language_model.layers.1.mlp.experts.2.down_proj.weight"
    broken = _with_tensors(path, tmp_path / "broken", {}, drop=(gone,))
    with pytest.raises(CheckpointError, match=rf"missing keys \(1\): \['{gone}'\]"):
        from_hf(broken)
