"""LoRA exports against PyTorch: peft applies our PEFT adapter directory to the transformers base, and transformers
loads our merged export; both give our adapted model's logits within 1e-4 (text and image rows, fp32), with adapters
on the text decoder, the vision tower (its fused qkv included), the patch mergers and the patch embedding's
convolution, and the final norm trained in full (PEFT's modules_to_save)."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from _hf_tiny import build_hf_model, hf_logits, make_batch, random_image, save_hf_model
from flax import nnx

from jaxrl_vlm.lora.adapters import init_adapters, lora_setup, merged_params
from jaxrl_vlm.lora.export import CONFIG_NAME, load_peft_adapter, save_peft_adapter
from jaxrl_vlm.lora.options import LoraOptions
from jaxrl_vlm.models import Qwen25VLConfig, build_vision_inputs, from_hf, get_rope_index, to_hf

TOL = 1e-4
B_FIX, T_FIX, PATCH_BUCKET = 2, 48, 64


@nnx.jit
def _logits(model, tokens, positions, segment_ids, vision):
    return model.logits(model(tokens, positions, segment_ids, vision))


def _pad(a: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    out = np.zeros(shape, a.dtype)
    out[tuple(slice(0, s) for s in a.shape)] = a
    return out


def _ours(model, batch) -> np.ndarray:
    cfg = model.cfg
    ids = _pad(batch.input_ids, (B_FIX, T_FIX))
    mask = _pad(batch.attention_mask, (B_FIX, T_FIX))
    positions, _ = get_rope_index(ids, batch.image_grid_thw, mask, cfg)
    vis = build_vision_inputs(batch.pixel_values, batch.image_grid_thw, ids, cfg, patch_bucket=PATCH_BUCKET,
                              token_valid=mask)
    out = _logits(model, jnp.asarray(ids, jnp.int32), jnp.asarray(positions), jnp.asarray(mask, jnp.int32), vis)
    b, t = batch.input_ids.shape
    return np.asarray(out)[:b, :t]


def _max_diff(a: np.ndarray, b: np.ndarray, mask: np.ndarray) -> float:
    return float(np.abs(a - b)[mask.astype(bool)].max())


def _load_hf(path, family: str):
    from transformers import Qwen2_5_VLForConditionalGeneration, Qwen3VLForConditionalGeneration

    cls = Qwen2_5_VLForConditionalGeneration if family == "Q25A" else Qwen3VLForConditionalGeneration
    return cls.from_pretrained(str(path), dtype=torch.float32).eval()


@pytest.mark.parametrize("name", ["A", "Q25A"])
def test_peft_adapter_and_merged_export_give_our_logits_in_pytorch(name, tmp_path):
    from peft import PeftModel

    base_dir = save_hf_model(build_hf_model(name), tmp_path / "base")
    ours = from_hf(str(base_dir))
    graphdef, params = nnx.split(ours, nnx.Param)
    setup = lora_setup(ours.cfg, params, LoraOptions(lora_rank=4, lora_alpha=8.0, lora_vision=True,
                                                     lora_target_modules=["all-linear", "patch_embed.proj"],
                                                     lora_modules_to_save=["model.language_model.norm"]))
    modules = setup.modules
    assert any(m.endswith("attn.qkv") for m in modules) and any("merger" in m for m in modules)
    assert "model.visual.patch_embed.proj" in modules  # the patch embedding's Conv3d: PEFT's conv LoRA
    assert any(m.endswith("self_attn.q_proj") for m in modules) and not any("lm_head" in m for m in modules)
    # Trained-looking adapters: lora_B is no longer zero.
    adapters = init_adapters(setup, jax.random.key(0), params)
    key = jax.random.key(1)
    n = len(setup.sites)
    adapters = [{"lora_A": a["lora_A"],
                 "lora_B": 0.15 * jax.random.normal(jax.random.fold_in(key, i), a["lora_B"].shape)}
                for i, a in enumerate(adapters[:n])] + [{"weight": 1.5 * adapters[n]["weight"]}]  # the final norm
    adapted = nnx.merge(graphdef, merged_params(params, adapters, setup))

    batch = make_batch([[5, "img", 9], [17]], [random_image(64, 96, 3)], seed=2, qwen25=isinstance(ours.cfg, Qwen25VLConfig))
    want = _ours(adapted, batch)
    assert _max_diff(want, _ours(ours, batch), batch.attention_mask) > 0.05, "the adapters barely change the model"

    adapter_dir = save_peft_adapter(setup, adapters, tmp_path / "adapter", base_model=str(base_dir))
    config = json.loads((adapter_dir / CONFIG_NAME).read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"]) == ("LORA", 4, 8.0)
    assert config["target_modules"] == list(modules)
    assert config["modules_to_save"] == ["model.language_model.norm"]
    peft_model = PeftModel.from_pretrained(_load_hf(base_dir, name), str(adapter_dir)).eval()
    assert _max_diff(hf_logits(peft_model, batch), want, batch.attention_mask) <= TOL

    to_hf(adapted, tmp_path / "merged", dtype=jnp.float32, copy_from=str(base_dir))
    assert _max_diff(hf_logits(_load_hf(tmp_path / "merged", name), batch), want, batch.attention_mask) <= TOL

    back = load_peft_adapter(adapter_dir, setup)
    assert len(back) == len(adapters)
    for got, put in zip(back, jax.device_get(adapters)):
        assert got.keys() == put.keys()
        for name in got:
            np.testing.assert_array_equal(got[name], np.asarray(put[name]))
