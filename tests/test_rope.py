"""Host-side M-RoPE / vision position helpers vs transformers (and torch's own interpolation)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from transformers import vision_utils

from _hf_tiny import VOCAB_SPECIALS, build_hf_model, make_batch, random_image
from jaxrl_vlm.models import (
    from_hf_dict,
    get_rope_index,
    get_rope_index_packed,
    vision_pos_embed_interp,
    vision_rotary_positions,
)


@pytest.fixture(scope="module")
def hf_model():
    return build_hf_model("A")


@pytest.fixture(scope="module")
def cfg(hf_model):
    return from_hf_dict(hf_model.config.to_dict())


def _hf_rope_index(hf_model, batch):
    kw = batch.torch_kwargs()
    pos, deltas = hf_model.model.get_rope_index(
        kw["input_ids"],
        mm_token_type_ids=kw["mm_token_type_ids"],
        image_grid_thw=kw.get("image_grid_thw"),
        attention_mask=kw["attention_mask"],
    )
    return pos.numpy(), deltas.numpy().reshape(-1)


CASES = {
    "text_only": ([[17]], []),
    "one_image": ([[5, "img", 9]], [(64, 96)]),
    "several_images": ([[4, "img", 6, "img", 5, "img", 2]], [(64, 96), (96, 32), (128, 64)]),
    "padded_batch": ([[5, "img", 7, "img", 3], [4, "img", 2], [9]], [(64, 96), (96, 32), (64, 64)]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_get_rope_index_matches_transformers(case, hf_model, cfg):
    rows, sizes = CASES[case]
    batch = make_batch(rows, [random_image(h, w, seed=i) for i, (h, w) in enumerate(sizes)], seed=7)
    want_pos, want_delta = _hf_rope_index(hf_model, batch)
    pos, delta = get_rope_index(batch.input_ids, batch.image_grid_thw, batch.attention_mask, cfg)
    assert pos.dtype == np.int32 and pos.shape == (3,) + batch.input_ids.shape
    np.testing.assert_array_equal(pos, want_pos)
    np.testing.assert_array_equal(delta, want_delta)
    if sizes:  # images compress positions: the last position is below the token count
        assert delta.min() < 0


def test_packed_positions_restart_per_segment(hf_model, cfg):
    """Each packed segment gets exactly the ids transformers gives it as a standalone sequence."""
    images = [random_image(64, 96, 1), random_image(96, 32, 2), random_image(64, 64, 3)]
    seqs = [make_batch([[3, "img", 4]], images[:1], seed=1), make_batch([[6]], [], seed=2),
            make_batch([[2, "img", 1, "img", 5]], images[1:], seed=3)]
    lens = [s.input_ids.shape[1] for s in seqs]
    tokens = np.zeros((2, 48), np.int64)
    seg = np.zeros((2, 48), np.int32)
    # row 0: sequences 0 and 1; row 1: sequence 2 followed by padding
    tokens[0, : lens[0]], seg[0, : lens[0]] = seqs[0].input_ids[0], 1
    tokens[0, lens[0] : lens[0] + lens[1]], seg[0, lens[0] : lens[0] + lens[1]] = seqs[1].input_ids[0], 2
    tokens[1, : lens[2]], seg[1, : lens[2]] = seqs[2].input_ids[0], 1
    grid = np.concatenate([seqs[0].image_grid_thw, seqs[2].image_grid_thw])
    pos, deltas = get_rope_index_packed(tokens, seg, grid, cfg)
    want = [_hf_rope_index(hf_model, s) for s in seqs]
    np.testing.assert_array_equal(pos[:, 0, : lens[0]], want[0][0][:, 0])
    np.testing.assert_array_equal(pos[:, 0, lens[0] : lens[0] + lens[1]], want[1][0][:, 0])
    np.testing.assert_array_equal(pos[:, 1, : lens[2]], want[2][0][:, 0])
    assert (pos[:, seg == 0] == 0).all()
    assert deltas[0, 0] == want[0][1][0] and deltas[0, 1] == want[1][1][0] and deltas[1, 0] == want[2][1][0]


def test_image_token_count_mismatch_is_a_clear_error(cfg):
    batch = make_batch([[5, "img", 9]], [random_image(64, 96, 1)], seed=1)
    ids = batch.input_ids.copy()
    ids[0, np.flatnonzero(ids[0] == VOCAB_SPECIALS["image_token_id"])[0]] = 7  # drop one pad
    with pytest.raises(ValueError, match="image tokens"):
        get_rope_index(ids, batch.image_grid_thw, batch.attention_mask, cfg)
    with pytest.raises(ValueError, match="image_grid_thw"):
        get_rope_index(batch.input_ids, np.concatenate([batch.image_grid_thw] * 2), batch.attention_mask, cfg)


GRIDS = np.array([[1, 4, 6], [1, 6, 2], [2, 8, 4], [1, 2, 2]])


def test_vision_rotary_positions_match_transformers():
    want = vision_utils.get_vision_position_ids(torch.tensor(GRIDS), 2).numpy()
    got = vision_rotary_positions(GRIDS, 2)
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, want)


def test_pos_embed_interp_matches_transformers_taps():
    want_idx, want_w = vision_utils.get_vision_interpolation_indices_and_weights(
        torch.tensor(GRIDS), num_grid_per_side=8, mode="bilinear", align_corners=True, spatial_merge_size=2
    )
    idx, w = vision_pos_embed_interp(GRIDS, 64, 2)
    np.testing.assert_array_equal(idx, want_idx.numpy())
    np.testing.assert_allclose(w, want_w.numpy(), atol=1e-7)


def test_pos_embed_interp_equals_torch_bilinear_resize():
    """Independent reference: F.interpolate(bilinear, align_corners=True) of the learned grid,
    then the processor's merge-window patch order."""
    side, dim, merge = 6, 5, 2
    table = np.random.RandomState(0).randn(side * side, dim).astype(np.float32)
    for t, h, w in GRIDS:
        idx, wts = vision_pos_embed_interp(np.array([[t, h, w]]), side * side, merge)
        ours = (table[idx] * wts[..., None]).sum(1)  # [t*h*w, dim]
        grid = torch.from_numpy(table).reshape(1, side, side, dim).permute(0, 3, 1, 2)
        resized = F.interpolate(grid, size=(int(h), int(w)), mode="bilinear", align_corners=True)[0].permute(1, 2, 0).numpy()
        blocks = resized.reshape(h // merge, merge, w // merge, merge, dim).transpose(0, 2, 1, 3, 4).reshape(-1, dim)
        np.testing.assert_allclose(ours, np.tile(blocks, (t, 1)), atol=1e-5)


def test_device_mrope_tables_match_transformers_rotary(hf_model, cfg):
    """cos/sin from our interleaved frequency selection == Qwen3VLTextRotaryEmbedding."""
    import jax.numpy as jnp

    from jaxrl_vlm.models.qwen3_vl import mrope_cos_sin

    rng = np.random.RandomState(0)
    positions = rng.randint(0, 500, size=(3, 2, 7))
    cos, sin = mrope_cos_sin(jnp.asarray(positions, jnp.int32), cfg, jnp.float32)
    rot = hf_model.model.language_model.rotary_emb
    want_cos, want_sin = rot(torch.zeros(1, dtype=torch.float32), torch.from_numpy(positions))
    np.testing.assert_allclose(np.asarray(cos), want_cos.numpy(), atol=2e-5)
    np.testing.assert_allclose(np.asarray(sin), want_sin.numpy(), atol=2e-5)


def test_build_vision_inputs_pads_to_the_bucket_and_validates(cfg):
    from jaxrl_vlm.models import build_vision_inputs

    batch = make_batch([[5, "img", 9], [3]], [random_image(64, 96, 1)], seed=1)
    vis = build_vision_inputs(batch.pixel_values, batch.image_grid_thw, batch.input_ids, cfg, patch_bucket=32)
    n = batch.pixel_values.shape[0]  # 24 patches -> 6 merged tokens
    assert vis.pixel_values.shape == (32, cfg.vision.patch_dim) and (vis.pixel_values[n:] == 0).all()
    assert (vis.patch_segment_ids[:n] == 0).all() and (vis.patch_segment_ids[n:] == -1).all()
    assert (vis.pos_interp_w[n:] == 0).all() and np.allclose(vis.pos_interp_w[:n].sum(1), 1.0)
    slots = np.flatnonzero(batch.input_ids.reshape(-1) == VOCAB_SPECIALS["image_token_id"])
    np.testing.assert_array_equal(vis.image_token_index[:6], slots)
    assert (vis.image_token_index[6:] == batch.input_ids.size).all()  # padding -> out of range, dropped
    with pytest.raises(ValueError, match="patch_bucket=16 is smaller"):
        build_vision_inputs(batch.pixel_values, batch.image_grid_thw, batch.input_ids, cfg, patch_bucket=16)
    with pytest.raises(ValueError, match="multiple of"):
        build_vision_inputs(batch.pixel_values, batch.image_grid_thw, batch.input_ids, cfg, patch_bucket=30)
    with pytest.raises(ValueError, match="image-pad tokens"):
        build_vision_inputs(batch.pixel_values, batch.image_grid_thw, batch.input_ids[:, :5], cfg)
