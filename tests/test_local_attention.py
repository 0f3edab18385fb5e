"""The vision tower's chunked attention (`local_segment_attention`, `patch_attention_block`): the same numbers as
the dense masked attention, forward and backward, for both families' towers; the bound comes from the image
processor, and the trainer refuses frames larger than it."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl_vlm.job.trainer import check_frame_patches, frame_patch_cap
from jaxrl_vlm.models import build_vision_inputs, get_rope_index
from jaxrl_vlm.models.layers import attention, local_segment_attention, patch_mask
from jaxrl_vlm.models.qwen3_vl import Qwen3VL
from jaxrl_vlm.tiny import tiny_model_config
from rollout.processing import max_frame_patches
from rollout.sample import Sample
from rollout.video import load_video_processor_config, max_clip_frame_patches


def _segments(rng: np.random.Generator, total: int, block: int, pad: int) -> np.ndarray:
    """Contiguous runs of 1..block positions (ids 0, 1, ...), then `pad` padding positions (-1)."""
    seg, sid = [], 0
    while len(seg) < total - pad:
        seg += [sid] * int(min(rng.integers(1, block + 1), total - pad - len(seg)))
        sid += 1
    return np.array(seg + [-1] * pad, np.int32)


@pytest.mark.parametrize("total,block,pad", [(200, 16, 0), (203, 16, 11), (96, 32, 5), (64, 64, 0), (130, 7, 3)])
def test_equals_dense_masked_attention_with_gradients(total, block, pad):
    rng = np.random.default_rng(total + block)
    n, h = 2, 8
    q, k, v = (jnp.asarray(rng.normal(size=(total, n, h)), jnp.float32) for _ in range(3))
    seg = jnp.asarray(_segments(rng, total, block, pad))
    real = np.asarray(seg) >= 0
    weights = jnp.asarray(rng.normal(size=(total, n, h)) * real[:, None, None], jnp.float32)  # real rows only

    def dense(q, k, v):
        return attention(q[None], k[None], v[None], (seg[:, None] == seg[None, :])[None], 0.3)[0]

    def local(q, k, v):
        return local_segment_attention(q, k, v, seg, block, 0.3)

    np.testing.assert_allclose(np.asarray(local(q, k, v))[real], np.asarray(dense(q, k, v))[real], atol=1e-5)
    g_dense = jax.grad(lambda *a: jnp.sum(dense(*a) * weights), argnums=(0, 1, 2))(q, k, v)
    g_local = jax.grad(lambda *a: jnp.sum(local(*a) * weights), argnums=(0, 1, 2))(q, k, v)
    for a, b in zip(g_local, g_dense):
        assert np.isfinite(np.asarray(a)).all()
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)


def test_a_segment_longer_than_the_block_is_not_what_it_computes():
    """The bound matters: with a run longer than `block`, chunked attention differs from dense (so the trainer
    must refuse such frames rather than trust it)."""
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.normal(size=(64, 1, 4)), jnp.float32) for _ in range(3))
    seg = jnp.zeros((64,), jnp.int32)  # one run of 64 positions
    dense = attention(q[None], k[None], v[None], jnp.ones((1, 64, 64), bool), 1.0)[0]
    assert not np.allclose(local_segment_attention(q, k, v, seg, 8, 1.0), dense, atol=1e-3)


def test_patch_mask_chooses_chunks_only_where_they_are_cheaper():
    seg = jnp.zeros((256,), jnp.int32)
    assert patch_mask(seg, "xla", 64).block == 64 and patch_mask(seg, "xla", 64).dense is None
    assert patch_mask(seg, "xla", 128).block is None and patch_mask(seg, "xla", 128).dense is not None
    assert patch_mask(seg, "xla").block is None
    assert patch_mask(seg, "pallas_gpu", 16).block is None  # the fused kernels skip masked tiles themselves


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3_vl", "qwen2_5_vl"])
def test_model_forward_and_gradient_with_chunked_vision_equal_dense(family):
    """A packed batch of several small images through the whole model, with and without the bound."""
    from jaxrl_vlm.models.qwen2_5_vl import Qwen25VL

    cfg = tiny_model_config(arch=family)
    cls = Qwen3VL if family == "qwen3_vl" else Qwen25VL
    rng = np.random.default_rng(5)
    grid = np.array([[1, 4, 4], [1, 4, 8], [1, 4, 4], [1, 8, 4], [1, 4, 4]])
    merged = (grid.prod(axis=1) // cfg.vision.spatial_merge_size**2).tolist()
    ids = [rng.integers(10, 500, 3)]
    for m in merged:
        ids += [np.full(m, cfg.image_token_id), rng.integers(10, 500, 2)]
    ids = np.concatenate(ids)
    tokens = np.pad(ids, (0, 128 - ids.size))[None].astype(np.int32)
    seg = (np.arange(128)[None] < ids.size).astype(np.int32)
    positions, _ = get_rope_index(tokens, grid, seg, cfg)
    pixels = rng.normal(size=(int(grid.prod(axis=1).sum()), cfg.vision.patch_dim)).astype(np.float32)
    vision = build_vision_inputs(pixels, grid, tokens, cfg, patch_bucket=256, token_valid=seg > 0)
    dense = cls(cfg, rngs=nnx.Rngs(0))
    chunked = cls(cfg, rngs=nnx.Rngs(0), patch_attention_block=32)  # frames of 16 and 32 patches
    args = (jnp.asarray(tokens), jnp.asarray(positions, jnp.int32), jnp.asarray(seg), vision)
    valid = seg[..., None] > 0
    np.testing.assert_allclose(np.where(valid, chunked(*args), 0), np.where(valid, dense(*args), 0), atol=5e-5)

    probe = jnp.asarray(rng.normal(size=(1, 128, cfg.text.hidden_size)) * valid, jnp.float32)

    @nnx.jit
    def grads(model):
        return nnx.grad(lambda m: jnp.sum(m(*args) * probe))(model)

    g_dense, g_chunked = grads(dense), grads(chunked)
    for (path, a), (_, b) in zip(nnx.to_flat_state(g_chunked), nnx.to_flat_state(g_dense)):
        a, b = np.asarray(a.get_value()), np.asarray(b.get_value())
        np.testing.assert_allclose(a, b, atol=1e-4 * max(1.0, float(np.abs(b).max())), err_msg=str(path))
    with pytest.raises(ValueError, match="patch_attention_block"):
        cls(cfg, rngs=nnx.Rngs(0), patch_attention_block=0)


def test_the_bound_is_the_image_processors_pixel_cap(tiny_processing_dir, tiny_image_processor, tmp_path):
    # The tiny processor caps images at 16,384 pixels: 64 patches of 16 x 16.
    assert max_frame_patches(tiny_image_processor) == 16384 // 16**2 == 64
    assert frame_patch_cap(tiny_processing_dir) == 64  # a clip frame stays within it too (2 frames of 16,384 a clip)
    assert max_clip_frame_patches(load_video_processor_config(tiny_processing_dir)) == 64
    assert frame_patch_cap(tmp_path) is None  # no preprocessor_config.json: a text model
    # A video processor whose frames may be larger than the pictures raises the bound.
    (tmp_path / "big").mkdir()
    for name in ("preprocessor_config.json", "video_preprocessor_config.json"):
        config = json.loads((tiny_processing_dir / name).read_text())
        if name.startswith("video"):
            config["size"]["longest_edge"] *= 4
        (tmp_path / "big" / name).write_text(json.dumps(config))
    assert frame_patch_cap(tmp_path / "big") == 4 * 64


def test_the_trainer_refuses_frames_over_the_bound():
    ok = Sample(group_index=0, index=0, prompt=[], multimodal_train_inputs={"image_grid_thw": np.array([[1, 8, 8]])})
    big = Sample(group_index=3, index=1, prompt=[], multimodal_train_inputs={"image_grid_thw": np.array([[1, 8, 16]])})
    check_frame_patches([ok], 64)
    check_frame_patches([ok, big], None)
    with pytest.raises(ValueError, match=r"group 3, index 1\) has an image frame of 128 patches, more than the 64"):
        check_frame_patches([ok, big], 64)
    clip = Sample(group_index=2, index=0, prompt=[], multimodal_train_inputs={
        "image_grid_thw": np.array([[1, 8, 8]]), "video_grid_thw": np.array([[2, 4, 4], [3, 8, 12]])})
    with pytest.raises(ValueError, match=r"group 2, index 0\) has a clip frame of 96 patches, more than the 64"):
        check_frame_patches([clip], 64)
