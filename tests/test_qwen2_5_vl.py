"""Qwen2.5-VL as a second policy family, against transformers' Qwen2.5-VL (the independent reference).

What `test_model_parity.py` / `test_hf_io.py` / `test_encoding.py` check for both families (logits of text,
one image, two images, padded and packed rows; export and import) is not repeated here. This file covers
what is Qwen2.5-VL's own: window order of the vision tower, images of many attention windows, host
positions, the released checkpoint layout, the 3B architecture, make-tiny, and the embedded engine.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from _forward import full_logits
from _hf_tiny import build_hf_model, hf_logits, make_batch, random_image, save_hf_model, spread_weights
from flax import nnx
from test_engine import GREEDY, client, hf_generate, hf_logprobs, our_logits_logprobs
from transformers.vision_utils import get_vision_window_index

from jaxrl_vlm.engine import EmbeddedEngine, EngineOptions
from jaxrl_vlm.models import (
    Qwen25VL,
    Qwen25VLConfig,
    build_vision_inputs,
    from_hf,
    from_hf_dict,
    get_rope_index,
    get_rope_index_packed,
    load_hf_config,
    param_count,
    preset_config,
    qwen2_5_vl_3b_instruct,
    vision_window_index,
)
from jaxrl_vlm.models.hf_io import current_tensor_name
from jaxrl_vlm.tiny import init_tiny_model, make_tiny
from rollout.encoding import ChatEncoder

TOL = 1e-4


@nnx.jit
def _logits(model, tokens, positions, segment_ids, vision):
    return model.logits(model(tokens, positions, segment_ids, vision))


# ----------------------------------------------------------------------------- window order (host)


@pytest.mark.parametrize("grids, window", [
    ([[1, 8, 12]], 56),                       # 4 x 6 merged tokens in 2 x 2 windows: 6 full windows
    ([[1, 6, 10], [1, 4, 4], [2, 10, 6]], 56),  # partial edge windows, a two-frame grid
    ([[1, 14, 10]], 84),                      # 3 x 3 windows over 7 x 5 merged tokens
    ([[1, 2, 2]], 112),                       # one merged token, a window larger than the image
])
def test_window_index_and_window_boundaries_equal_transformers(grids, window):
    grid = np.array(grids)
    ours, window_ids = vision_window_index(grid, 2, window // 2 // 14)
    ref, cu_window_seqlens = get_vision_window_index(torch.tensor(grids), 2, window, 14)
    np.testing.assert_array_equal(ours, ref.numpy())
    # Our per-token window ids cut the same windows as transformers' cumulative lengths (in patches).
    starts = np.flatnonzero(np.diff(window_ids, prepend=-1)) * 4
    np.testing.assert_array_equal(np.append(starts, window_ids.size * 4), cu_window_seqlens.numpy())
    # The reverse permutation puts every merged token back in place.
    reverse = np.argsort(ours)
    np.testing.assert_array_equal(ours[reverse], np.arange(ours.size))


def test_vision_inputs_hold_patches_in_window_order_and_scatter_back_to_token_order():
    cfg = _tiny_cfg()
    grid = np.array([[1, 4, 8]])  # 2 x 4 merged tokens = 2 windows of 2 x 2
    n = int(grid.prod())
    pixels = np.arange(n, dtype=np.float32)[:, None] * np.ones((1, cfg.vision.patch_dim), np.float32)
    tokens = np.full((1, 12), 5)
    tokens[0, 2:10] = cfg.image_token_id
    vis = build_vision_inputs(pixels, grid, tokens, cfg, patch_bucket=40)
    window_index, _ = vision_window_index(grid, 2, cfg.vision.window_merged_side)
    np.testing.assert_array_equal(window_index, [0, 1, 4, 5, 2, 3, 6, 7])
    # Patch rows follow the windows merge unit by merge unit; padding rows are zero with id -1.
    np.testing.assert_array_equal(vis.pixel_values[:n, 0], (window_index[:, None] * 4 + np.arange(4)).reshape(-1))
    np.testing.assert_array_equal(vis.patch_window_ids[:n], np.repeat([0, 1], 16))
    assert (vis.patch_window_ids[n:] == -1).all() and (vis.patch_segment_ids[n:] == -1).all()
    assert (vis.patch_segment_ids[:n] == 0).all()
    # Merged token j (window order) is written to the pad of its original index: the reverse permutation.
    np.testing.assert_array_equal(vis.image_token_index[:8], 2 + window_index)
    assert (vis.image_token_index[8:] == tokens.size).all()


def _tiny_cfg() -> Qwen25VLConfig:
    d = json.loads(json.dumps(_hf_config_dict("Q25A")))
    return from_hf_dict(d)


def _hf_config_dict(name: str) -> dict[str, Any]:
    from _hf_tiny import TINY_QWEN25_CONFIGS
    from transformers import Qwen2_5_VLConfig

    return Qwen2_5_VLConfig(**TINY_QWEN25_CONFIGS[name]).to_dict()


# ----------------------------------------------------------------------------- parity on many windows


@pytest.fixture(scope="module", params=["Q25A", "Q25B"])
def pair(request, tmp_path_factory):
    hf = build_hf_model(request.param)
    return hf, from_hf(save_hf_model(hf, tmp_path_factory.mktemp(f"q25_{request.param}")))


def test_images_spanning_many_windows_match_transformers(pair):
    """A 168 x 196 image (6 x 7 merged tokens: 12 windows of Q25A, 6 partly filled ones of Q25B) and a small one,
    right-padded next to a text row; full-attention and window blocks both matter."""
    hf, ours = pair
    images = [random_image(168, 196, 1), random_image(56, 84, 2)]
    batch = make_batch([[3, "img", 5, "img", 4], [9]], images, seed=7, qwen25=True)
    assert batch.image_grid_thw.tolist() == [[1, 12, 14], [1, 4, 6]]
    ref = hf_logits(hf, batch)
    b, t = batch.input_ids.shape
    tokens = np.zeros((b, 64), np.int64)
    mask = np.zeros((b, 64), np.int64)
    tokens[:, :t], mask[:, :t] = batch.input_ids, batch.attention_mask
    positions, _ = get_rope_index(tokens, batch.image_grid_thw, mask, ours.cfg)
    vis = build_vision_inputs(batch.pixel_values, batch.image_grid_thw, tokens, ours.cfg, patch_bucket=256, token_valid=mask)
    got = np.asarray(_logits(ours, jnp.asarray(tokens, jnp.int32), jnp.asarray(positions), jnp.asarray(mask, jnp.int32), vis))
    real = batch.attention_mask.astype(bool)
    assert np.abs(got[:, :t] - ref)[real].max() <= TOL
    # Window attention is really used: the same weights with full attention in every block differ.
    full = build_vision_inputs(batch.pixel_values, batch.image_grid_thw, tokens, ours.cfg, patch_bucket=256, token_valid=mask)
    full = full._replace(patch_window_ids=full.patch_segment_ids)
    other = np.asarray(_logits(ours, jnp.asarray(tokens, jnp.int32), jnp.asarray(positions), jnp.asarray(mask, jnp.int32), full))
    assert np.abs(other[:, :t] - ref)[real].max() > 1e-2


def test_packed_row_with_many_window_images_equals_separate_sequences(pair):
    hf, ours = pair
    first = make_batch([[2, "img", 3]], [random_image(140, 112, 3)], seed=8, qwen25=True)
    second = make_batch([[4, "img", 2]], [random_image(84, 168, 4)], seed=9, qwen25=True)
    n1, n2 = first.input_ids.shape[1], second.input_ids.shape[1]
    tokens = np.zeros((1, 96), np.int64)
    seg = np.zeros((1, 96), np.int32)
    tokens[0, :n1], tokens[0, n1 : n1 + n2] = first.input_ids[0], second.input_ids[0]
    seg[0, :n1], seg[0, n1 : n1 + n2] = 1, 2
    grid = np.concatenate([first.image_grid_thw, second.image_grid_thw])
    pixels = np.concatenate([first.pixel_values, second.pixel_values])
    positions, _ = get_rope_index_packed(tokens, seg, grid, ours.cfg)
    vis = build_vision_inputs(pixels, grid, tokens, ours.cfg, patch_bucket=256, token_valid=seg > 0)
    got = np.asarray(_logits(ours, jnp.asarray(tokens, jnp.int32), jnp.asarray(positions), jnp.asarray(seg), vis))
    assert np.abs(got[0, :n1] - hf_logits(hf, first)[0]).max() <= TOL
    assert np.abs(got[0, n1 : n1 + n2] - hf_logits(hf, second)[0]).max() <= TOL


def test_rope_index_equals_transformers_with_left_and_right_padding(pair):
    hf, ours = pair
    images = [random_image(168, 196, 1), random_image(56, 84, 2), random_image(84, 56, 3)]
    batch = make_batch([[3, "img", 5, "img", 4], [6, "img", 1]], images, seed=10, qwen25=True)
    shift = (1 - batch.attention_mask).sum(1)  # left padding: each row's tokens rolled to its end
    left_ids = np.stack([np.roll(row, int(k)) for row, k in zip(batch.input_ids, shift)])
    left_mask = np.stack([np.roll(row, int(k)) for row, k in zip(batch.attention_mask, shift)])
    assert left_mask[1, 0] == 0 and batch.attention_mask[1, -1] == 0  # row 1 is padded on both sides
    for ids, mask in ((batch.input_ids, batch.attention_mask), (left_ids, left_mask)):
        ref_pos, ref_delta = hf.model.get_rope_index(
            torch.from_numpy(ids), torch.from_numpy((ids == ours.cfg.image_token_id).astype(np.int64)),
            image_grid_thw=torch.from_numpy(batch.image_grid_thw), attention_mask=torch.from_numpy(mask))
        pos, delta = get_rope_index(ids, batch.image_grid_thw, mask, ours.cfg)
        real = mask.astype(bool)
        np.testing.assert_array_equal(pos[:, real], ref_pos.numpy()[:, real])
        np.testing.assert_array_equal(delta, ref_delta.numpy()[:, 0])


# ----------------------------------------------------------------------------- checkpoints and configs


def test_released_layout_flat_config_and_legacy_names_load_identically(pair, tmp_path):
    """Released Qwen2.5-VL: text fields at the top level with rope_theta + rope_scaling {type: mrope}, `in_chans`,
    tensors named model.layers.* / visual.*; and the transformers-5 names are read too."""
    hf, ours = pair
    src = tmp_path / "src"
    save_hf_model(hf, src)
    conf = json.loads((src / "config.json").read_text())
    text = conf.pop("text_config")
    rope = text.pop("rope_parameters")
    conf.update({k: v for k, v in text.items() if k not in ("model_type", "architectures")})
    conf["rope_theta"] = rope.pop("rope_theta")
    conf["rope_scaling"] = {"type": "mrope", "mrope_section": rope["mrope_section"]}
    conf["vision_config"]["in_chans"] = conf["vision_config"].pop("in_channels")
    released = tmp_path / "released"
    released.mkdir()
    (released / "config.json").write_text(json.dumps(conf))
    from safetensors.torch import load_file, save_file

    tensors = load_file(src / "model.safetensors")
    assert any(k.startswith("visual.") for k in tensors) and any(k.startswith("model.layers.") for k in tensors)
    save_file(tensors, released / "model.safetensors", metadata={"format": "pt"})
    current = tmp_path / "current"
    current.mkdir()
    shutil.copyfile(src / "config.json", current / "config.json")
    save_file({current_tensor_name(k): v for k, v in tensors.items()}, current / "model.safetensors", metadata={"format": "pt"})
    assert load_hf_config(released) == load_hf_config(src) == ours.cfg
    want = nnx.to_flat_state(nnx.state(ours, nnx.Param))
    for path in (released, current):
        got = dict(nnx.to_flat_state(nnx.state(from_hf(path), nnx.Param)))
        for key, var in want:
            np.testing.assert_array_equal(np.asarray(got[key].get_value()), np.asarray(var.get_value()))


@pytest.mark.slow
def test_3b_preset_matches_transformers_architecture():
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    cfg = qwen2_5_vl_3b_instruct()
    assert preset_config("qwen2_5_vl_3b") == cfg
    hf_cfg = Qwen2_5_VLConfig(**cfg.to_hf_dict())
    assert from_hf_dict(hf_cfg.to_dict()) == cfg
    with torch.device("meta"):
        hf = Qwen2_5_VLForConditionalGeneration(hf_cfg)
    # tied: transformers' lm_head shares the embedding, so count each tensor once
    n_hf = sum(p.numel() for p in hf.parameters())
    assert param_count(cfg) == n_hf
    assert 3.7e9 < n_hf < 3.8e9  # the published Qwen2.5-VL-3B-Instruct has about 3.75 B parameters


def test_bad_qwen25_configs_fail_naming_the_key():
    from jaxrl_vlm.models import ConfigError

    good = qwen2_5_vl_3b_instruct().to_hf_dict()

    def broken(section: str, **changes: Any) -> dict[str, Any]:
        bad = json.loads(json.dumps(good))
        (bad if section == "top" else bad[section]).update(changes)
        return bad

    cases = [
        (broken("text_config", rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24],
                                                 "mrope_interleaved": True}), "contiguous"),
        (broken("text_config", use_sliding_window=True), "use_sliding_window"),
        (broken("vision_config", fullatt_block_indexes=[7, 32]), "fullatt_block_indexes"),
        (broken("vision_config", window_size=20), "window_size"),
        (broken("vision_config", out_hidden_size=1024), "out_hidden_size"),
        (broken("top", model_type="qwen2_vl"), "model_type='qwen2_vl' is not supported"),
    ]
    for bad, needle in cases:
        with pytest.raises(ConfigError, match=needle):
            from_hf_dict(bad)


@pytest.mark.slow
def test_make_tiny_qwen2_5_vl_loads_in_transformers_with_equal_logits(tmp_path):
    from transformers import Qwen2_5_VLForConditionalGeneration

    out = make_tiny(tmp_path / "tiny25", arch="qwen2_5_vl")
    cfg = load_hf_config(out)
    assert isinstance(cfg, Qwen25VLConfig) and cfg.vision.patch_size == 14
    assert json.loads((out / "preprocessor_config.json").read_text())["patch_size"] == 14
    assert "You are a helpful assistant." in (out / "chat_template.jinja").read_text()
    ours = from_hf(out)
    assert isinstance(ours, Qwen25VL)
    # our init (not transformers'), exported and reloaded by transformers: same logits with a 4-window image
    fresh = init_tiny_model(cfg, 0)
    hf = Qwen2_5_VLForConditionalGeneration.from_pretrained(str(out), dtype=torch.float32).eval()
    encoder = _encoder(out)
    seg = encoder.encode_prompt([{"role": "user", "content": [{"type": "image", "image": random_image(112, 112, 5)},
                                                              {"type": "text", "text": "what"}]}])
    grid = seg.mm_inputs["image_grid_thw"]
    assert grid.tolist() == [[1, 8, 8]]
    ids = np.asarray([seg.train_ids])
    x = torch.from_numpy(ids)
    with torch.no_grad():
        ref = hf(input_ids=x, attention_mask=torch.ones_like(x), mm_token_type_ids=(x == cfg.image_token_id).long(),
                 pixel_values=torch.from_numpy(seg.mm_inputs["pixel_values"]), image_grid_thw=torch.from_numpy(grid)).logits.numpy()
    positions, _ = get_rope_index(ids, grid, None, cfg)
    vis = build_vision_inputs(seg.mm_inputs["pixel_values"], grid, ids, cfg)
    for model in (ours, fresh):
        got = np.asarray(full_logits(model, jnp.asarray(ids, jnp.int32), jnp.asarray(positions), jnp.ones(ids.shape, jnp.int32), vis))
        assert np.abs(got - ref).max() <= TOL


def _encoder(path: Path) -> ChatEncoder:
    from rollout.processing import load_image_processor, load_tokenizer

    return ChatEncoder(load_tokenizer(path), load_image_processor(path))


# ----------------------------------------------------------------------------- the engine serves it


@pytest.fixture(scope="module")
def served(tiny_qwen25_processing_dir, tmp_path_factory):
    """(engine, transformers model, encoder): a tiny random Qwen2.5-VL built by transformers (spread weights),
    with the Qwen2.5-VL-style tiny tokenizer and patch-14 processor, served by the embedded engine."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    from jaxrl_vlm.tiny_assets import tiny_qwen2_5_vl_hf_config
    from rollout.processing import load_tokenizer

    config = tiny_qwen2_5_vl_hf_config(load_tokenizer(tiny_qwen25_processing_dir))
    torch.manual_seed(0)
    hf = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(**config)).float().eval()
    spread_weights(hf, 1, embed_std=0.1)  # small tied embeddings: large ones make the model copy its input
    text = config["text_config"]
    hf.generation_config.eos_token_id = [text["eos_token_id"], text["pad_token_id"]]
    out = tmp_path_factory.mktemp("q25_engine")
    hf.save_pretrained(str(out))
    for item in tiny_qwen25_processing_dir.iterdir():
        shutil.copy2(item, out / item.name)
    options = EngineOptions(max_batch=4, max_seq_len=256, min_prefill_bucket=64, min_kv_bucket=256,
                            decode_batch_sizes=(4,), min_patch_bucket=64)
    eng = EmbeddedEngine(str(out), config=options)
    eng.start()
    yield eng, hf, _encoder(out)
    eng.stop()


@pytest.mark.slow
async def test_engine_greedy_with_images_equals_transformers_generate_and_trainer_logprobs(served, make_test_image):
    engine, hf, encoder = served
    assert isinstance(engine.engine.runner.model(), Qwen25VL)
    image = make_test_image(5, (112, 112))  # 8 x 8 patches: 4 x 4 merged tokens in 4 attention windows
    seg = encoder.encode_prompt([{"role": "user", "content": [{"type": "image", "image": image},
                                                              {"type": "text", "text": "What is x?"}]}])
    assert seg.mm_inputs["image_grid_thw"].tolist() == [[1, 8, 8]]
    assert encoder.tokenizer.decode(seg.wire_ids).startswith("<|im_start|>system\nYou are a helpful assistant.")
    pad = encoder.vision.image_pad
    async with client(engine) as c:
        result = await c.generate(seg.wire_ids, image_data=seg.image_data, sampling_params=GREEDY)
        other = encoder.encode_prompt([{"role": "user", "content": [{"type": "image", "image": make_test_image(9, (112, 112))},
                                                                    {"type": "text", "text": "What is x?"}]}])
        second = await c.generate(other.wire_ids, image_data=other.image_data, sampling_params=GREEDY)
        info = await c.get_model_info()
    assert info["model_type"] == "qwen2_5_vl" and info["architectures"] == ["Qwen2_5_VLForConditionalGeneration"]
    expected = hf_generate(hf, seg.train_ids, GREEDY["max_new_tokens"], seg.mm_inputs, pad)
    assert result.output_ids == expected
    assert len(set(expected)) > 3, "degenerate reference: the test would not see a wrong token"
    assert second.output_ids == hf_generate(hf, other.train_ids, GREEDY["max_new_tokens"], other.mm_inputs, pad)
    assert second.output_ids != result.output_ids  # the picture changes the answer
    # The engine's log-probs equal the trainer's (token_logprobs over the full forward) and transformers'.
    trainer = our_logits_logprobs(engine, seg.train_ids, result.output_ids, seg.mm_inputs)
    np.testing.assert_allclose(result.output_log_probs, trainer, atol=TOL, rtol=0)
    np.testing.assert_allclose(result.output_log_probs, hf_logprobs(hf, seg.train_ids, result.output_ids, seg.mm_inputs, pad),
                               atol=TOL, rtol=0)


async def test_engine_multi_turn_with_a_second_image_reuses_the_prefix(served, make_test_image):
    """A second turn (delta-encoded observation with a new picture) extends the cached first turn; greedy output
    still equals transformers' on the whole conversation."""
    engine, hf, encoder = served
    prompt = [{"role": "user", "content": [{"type": "image", "image": make_test_image(1, (84, 112))},
                                           {"type": "text", "text": "Describe."}]}]
    seg = encoder.encode_prompt(prompt)
    params = {"temperature": 0.0, "max_new_tokens": 6, "ignore_eos": True}
    async with client(engine) as c:
        first = await c.generate(seg.wire_ids, image_data=seg.image_data, sampling_params=params)
        obs = encoder.encode_observation([{"role": "user", "content": [
            {"type": "image", "image": make_test_image(2, (112, 56))}, {"type": "text", "text": "And this?"}]}])
        wire = seg.wire_ids + first.output_ids + [encoder.vision.im_end] + obs.wire_ids
        images = seg.image_data + obs.image_data
        second = await c.generate(wire, image_data=images, sampling_params=params)
    train = seg.train_ids + first.output_ids + [encoder.vision.im_end] + obs.train_ids
    mm = {"pixel_values": np.concatenate([seg.mm_inputs["pixel_values"], obs.mm_inputs["pixel_values"]]),
          "image_grid_thw": np.concatenate([seg.mm_inputs["image_grid_thw"], obs.mm_inputs["image_grid_thw"]])}
    assert second.output_ids == hf_generate(hf, train, 6, mm, encoder.vision.image_pad)[:6]
    assert second.meta_info.get("cached_tokens", 0) > 0
