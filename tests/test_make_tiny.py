"""`jaxrl-vlm make-tiny`: a checkpoint made by our init and exporter that transformers and we both load,
with the same logits, a working tokenizer / chat template / image processor, Instruct-style stop ids,
and an init whose scale lets a 64-wide model produce non-trivial logits."""

from __future__ import annotations

import json
import math
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from _forward import full_logits
from flax import nnx

from jaxrl_vlm.models import build_vision_inputs, from_hf, get_rope_index
from jaxrl_vlm.models.hf_io import load_hf_config, read_safetensors_header
from jaxrl_vlm.tiny import init_tiny_model, make_tiny, tiny_model_config


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    from jaxrl_vlm.cli import main

    out = tmp_path_factory.mktemp("make_tiny") / "ckpt"
    assert main(["make-tiny", str(out), "--seed", "5"]) == 0
    return out


def _flat(model) -> dict:
    return {p: np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def test_output_is_a_complete_model_dir(tiny_dir):
    from rollout.processing import load_image_processor, load_tokenizer

    names = {p.name for p in tiny_dir.iterdir()}
    assert {"model.safetensors", "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
            "chat_template.jinja", "preprocessor_config.json"} <= names  # fmt: skip
    tok = load_tokenizer(tiny_dir)
    load_image_processor(tiny_dir)
    gen = json.loads((tiny_dir / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")]
    cfg = load_hf_config(tiny_dir)
    assert cfg.text.vocab_size == len(tok) == 1024
    assert cfg.image_token_id == tok.convert_tokens_to_ids("<|image_pad|>")
    header, _ = read_safetensors_header(tiny_dir / "model.safetensors")
    assert header.pop("__metadata__") == {"format": "pt"}
    assert {entry["dtype"] for entry in header.values()} == {"F32"}
    assert "lm_head.weight" not in header  # tied, like Qwen3-VL-2B


def test_weights_are_our_init_and_import_exactly(tiny_dir):
    ours = _flat(init_tiny_model(load_hf_config(tiny_dir), seed=5))
    loaded = _flat(from_hf(tiny_dir))
    assert ours.keys() == loaded.keys()
    for key in ours:
        np.testing.assert_array_equal(loaded[key], ours[key], err_msg=str(key))


@pytest.mark.slow
def test_transformers_loads_it_with_the_same_logits(tiny_dir, make_test_image):
    import torch
    from transformers import Qwen3VLForConditionalGeneration

    from rollout.processing import hf_reference_processor, load_image_processor, load_tokenizer

    tok = load_tokenizer(tiny_dir)
    processor = hf_reference_processor(tok, load_image_processor(tiny_dir))
    messages = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Find the angle ABC."}]},
        {"role": "assistant", "content": "The answer is \\boxed{42}."},
        {"role": "user", "content": [{"type": "text", "text": "Now this one:"}, {"type": "image"}]},
    ]
    prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    images = [make_test_image(3, 64), make_test_image(4, (128, 96))]
    inputs = processor(text=[prompt], images=images, return_tensors="np")

    hf = Qwen3VLForConditionalGeneration.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    for name, p in hf.named_parameters():
        assert p.dtype == torch.float32, name
    with torch.no_grad():
        ref = hf(**{k: torch.from_numpy(np.asarray(v)) for k, v in inputs.items()}).logits.numpy()[0]

    model = from_hf(tiny_dir)
    cfg = model.cfg
    ids = np.asarray(inputs["input_ids"], np.int32)
    mask = np.asarray(inputs["attention_mask"], np.int32)
    grid = np.asarray(inputs["image_grid_thw"])
    positions, _ = get_rope_index(ids, grid, mask, cfg)
    vision = build_vision_inputs(np.asarray(inputs["pixel_values"]), grid, ids, cfg, patch_bucket=128, token_valid=mask)
    logits = np.asarray(full_logits(model, jnp.asarray(ids), jnp.asarray(positions), jnp.asarray(mask), vision))[0]
    assert int((ids == cfg.image_token_id).sum()) == int(grid.prod(-1).sum()) // 4 > 4
    np.testing.assert_allclose(logits, ref, atol=1e-4, rtol=0)
    assert ref.std() > 0.5  # the scaled init gives logits a usable spread (HF's std 0.02 gives ~0.15)


def test_scaled_init_statistics():
    cfg = tiny_model_config()
    model = init_tiny_model(cfg, seed=0)
    d, layers = cfg.text.hidden_size, cfg.text.num_hidden_layers
    layer = model.layers[0]
    checks = {
        "embed": (model.embed_vd, d**-0.5),
        "q": (layer.attn.q_kernel_dnh, d**-0.5),
        "gate": (layer.mlp.gate_kernel_df, d**-0.5),
        "down": (layer.mlp.down_kernel_fd, cfg.text.intermediate_size**-0.5 / math.sqrt(2 * layers)),
        "o": (layer.attn.o_kernel_nhd, (cfg.text.num_attention_heads * cfg.text.head_dim) ** -0.5 / math.sqrt(2 * layers)),
        "patch": (model.visual.patch_kernel_cd, cfg.vision.patch_dim**-0.5),
    }
    for name, (param, std) in checks.items():
        value = np.asarray(param.get_value())
        assert abs(value.std() / std - 1) < 0.1, (name, value.std(), std)
        assert abs(value.mean()) < 3 * std / math.sqrt(value.size) + 1e-7, name
    np.testing.assert_array_equal(np.asarray(layer.input_norm.scale.get_value()), 1.0)
    np.testing.assert_array_equal(np.asarray(model.visual.blocks[0].q_bias_nh.get_value()), 0.0)
    hf_style = np.asarray(init_tiny_model(cfg, seed=0, init="hf").layers[0].attn.q_kernel_dnh.get_value())
    assert abs(hf_style.std() / 0.02 - 1) < 0.1
    # deterministic in the seed, different across seeds
    same = np.asarray(init_tiny_model(cfg, seed=0).embed_vd.get_value())
    other = np.asarray(init_tiny_model(cfg, seed=1).embed_vd.get_value())
    np.testing.assert_array_equal(same, np.asarray(model.embed_vd.get_value()))
    assert not np.array_equal(same, other)


def test_bf16_and_bad_arguments(tmp_path, capsys):
    from jaxrl_vlm.cli import main

    (tmp_path / "bf16").mkdir()
    (tmp_path / "bf16" / "config.json").write_text("{}")  # a model already there: replaced only when asked
    out = make_tiny(tmp_path / "bf16", dtype="bfloat16", vocab_size=512, overwrite=True)
    header, _ = read_safetensors_header(out / "model.safetensors")
    assert {e["dtype"] for k, e in header.items() if k != "__metadata__"} == {"BF16"}
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    assert load_hf_config(out).text.vocab_size == 512
    assert main(["make-tiny", str(tmp_path / "x"), "--vocab-size", "100"]) == 2
    assert "vocab_size=100 is too small" in capsys.readouterr().err
