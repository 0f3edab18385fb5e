"""Flax Qwen3-VL / Qwen2.5-VL vs transformers' PyTorch models on tiny random checkpoints (fp32, |dlogit| <= 1e-4).

Configs A, B are Qwen3-VL; Q25A, Q25B are Qwen2.5-VL (windowed vision tower: the 64x96 image spans two
attention windows of Q25A and one partial window of Q25B; `test_qwen2_5_vl.py` adds images of many windows).

HF inputs are built the HF way (image processor, expanded pads, mm_token_type_ids); ours come from
our host-side functions, padded to one fixed shape per config so each config compiles two programs
(with and without vision inputs).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from _hf_tiny import build_hf_model, hf_logits, make_batch, random_image, save_hf_model
from jaxrl_vlm.models import (
    Qwen3VL,
    Qwen3VLConfig,
    Qwen25VisionConfig,
    Qwen25VL,
    Qwen25VLConfig,
    TextConfig,
    VisionConfig,
    model_class,
    build_vision_inputs,
    from_hf,
    get_rope_index,
    get_rope_index_packed,
    token_logprobs,
)

B_FIX, T_FIX, PATCH_BUCKET = 2, 48, 64
TOL = 1e-4


@nnx.jit
def _logits_text(model: Qwen3VL, tokens, positions, segment_ids):
    return model.logits(model(tokens, positions, segment_ids))


@nnx.jit
def _logits_vision(model: Qwen3VL, tokens, positions, segment_ids, vision):
    return model.logits(model(tokens, positions, segment_ids, vision))


@pytest.fixture(scope="module", params=["A", "B", "Q25A", "Q25B"])
def pair(request, tmp_path_factory):
    """(transformers model, our model imported from its save_pretrained directory)."""
    hf = build_hf_model(request.param)
    path = save_hf_model(hf, tmp_path_factory.mktemp(f"tiny_{request.param}"))
    return hf, from_hf(path)


def _batch(ours, rows: list[list], images: list, seed: int):
    """`make_batch` with the image preprocessing of `ours`' family."""
    return make_batch(rows, images, seed=seed, qwen25=isinstance(ours.cfg, Qwen25VLConfig))


def _pad(a: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    out = np.zeros(shape, a.dtype)
    out[tuple(slice(0, s) for s in a.shape)] = a
    return out


def _ours(model: Qwen3VL, batch, *, with_vision: bool) -> np.ndarray:
    """Our logits for an HFBatch, padded to [B_FIX, T_FIX] and PATCH_BUCKET patches."""
    cfg = model.cfg
    ids = _pad(batch.input_ids, (B_FIX, T_FIX))
    mask = _pad(batch.attention_mask, (B_FIX, T_FIX))
    positions, _ = get_rope_index(ids, batch.image_grid_thw, mask, cfg)
    args = (jnp.asarray(ids, jnp.int32), jnp.asarray(positions), jnp.asarray(mask, jnp.int32))
    if not with_vision:
        return np.asarray(_logits_text(model, *args))
    if batch.pixel_values is None:
        pixels, grid = np.zeros((0, cfg.vision.patch_dim), np.float32), np.zeros((0, 3), np.int64)
    else:
        pixels, grid = batch.pixel_values, batch.image_grid_thw
    vis = build_vision_inputs(pixels, grid, ids, cfg, patch_bucket=PATCH_BUCKET, token_valid=mask)
    return np.asarray(_logits_vision(model, *args, vis))


def _max_diff(ours: np.ndarray, ref: np.ndarray, mask: np.ndarray) -> float:
    b, t = mask.shape
    return float(np.abs(ours[:b, :t] - ref)[mask.astype(bool)].max())


def test_text_only(pair):
    hf, ours = pair
    batch = _batch(ours, [[23]], [], 1)
    ref = hf_logits(hf, batch)
    assert _max_diff(_ours(ours, batch, with_vision=False), ref, batch.attention_mask) <= TOL
    # The vision program with zero images (all-padding patch bucket) must give the same logits.
    assert _max_diff(_ours(ours, batch, with_vision=True), ref, batch.attention_mask) <= TOL


def test_one_image(pair):
    hf, ours = pair
    batch = _batch(ours, [[5, "img", 9]], [random_image(64, 96, 1)], 2)
    assert batch.image_grid_thw.tolist() == [[1, 4, 6]]
    ref = hf_logits(hf, batch)
    assert _max_diff(_ours(ours, batch, with_vision=True), ref, batch.attention_mask) <= TOL


def test_two_images_of_different_sizes_in_one_sequence(pair):
    hf, ours = pair
    batch = _batch(ours, [[4, "img", 6, "img", 5]], [random_image(64, 96, 1), random_image(96, 32, 2)], seed=3)
    assert batch.image_grid_thw.tolist() == [[1, 4, 6], [1, 6, 2]]
    ref = hf_logits(hf, batch)
    assert _max_diff(_ours(ours, batch, with_vision=True), ref, batch.attention_mask) <= TOL


def test_right_padded_batch_of_two(pair):
    hf, ours = pair
    images = [random_image(64, 96, 1), random_image(96, 32, 2), random_image(64, 64, 3)]
    batch = _batch(ours, [[5, "img", 7, "img", 3], [4, "img", 2]], images, seed=4)
    assert batch.attention_mask[1].sum() < batch.attention_mask[0].sum()  # row 1 is right-padded
    ref = hf_logits(hf, batch)
    assert _max_diff(_ours(ours, batch, with_vision=True), ref, batch.attention_mask) <= TOL


def test_packed_row_equals_separate_sequences(pair):
    """Two sequences packed in one row (segment ids 1, 2; positions restart) == each run alone in HF."""
    hf, ours = pair
    cfg = ours.cfg
    images = [random_image(64, 96, 5), random_image(64, 64, 6)]
    first = _batch(ours, [[3, "img", 4]], images[:1], seed=5)
    second = _batch(ours, [[6, "img", 2]], images[1:], seed=6)
    ref1, ref2 = hf_logits(hf, first), hf_logits(hf, second)
    n1, n2 = first.input_ids.shape[1], second.input_ids.shape[1]
    tokens = np.zeros((B_FIX, T_FIX), np.int64)
    seg = np.zeros((B_FIX, T_FIX), np.int32)
    tokens[0, :n1], tokens[0, n1 : n1 + n2] = first.input_ids[0], second.input_ids[0]
    seg[0, :n1], seg[0, n1 : n1 + n2] = 1, 2
    grid = np.concatenate([first.image_grid_thw, second.image_grid_thw])
    pixels = np.concatenate([first.pixel_values, second.pixel_values])
    positions, _ = get_rope_index_packed(tokens, seg, grid, cfg)
    vis = build_vision_inputs(pixels, grid, tokens, cfg, patch_bucket=PATCH_BUCKET, token_valid=seg > 0)
    got = np.asarray(_logits_vision(ours, jnp.asarray(tokens, jnp.int32), jnp.asarray(positions), jnp.asarray(seg), vis))
    assert np.abs(got[0, :n1] - ref1[0]).max() <= TOL
    assert np.abs(got[0, n1 : n1 + n2] - ref2[0]).max() <= TOL


def test_token_logprobs_equal_full_log_softmax_with_chunking(pair):
    _, ours = pair
    rng = np.random.RandomState(0)
    b, t = 2, 13  # 13 is not a multiple of the chunk size: exercises the padded last chunk
    hidden = jnp.asarray(rng.randn(b, t, ours.cfg.text.hidden_size).astype(np.float32))
    targets = jnp.asarray(rng.randint(0, ours.cfg.text.vocab_size, size=(b, t)), jnp.int32)
    lp, ent = token_logprobs(ours, hidden, targets, chunk_size=4, return_entropy=True)
    logits = np.asarray(ours.logits(hidden), np.float64)
    logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) - logits.max(-1, keepdims=True)
    want = np.take_along_axis(logp, np.asarray(targets)[..., None], -1)[..., 0]
    want_ent = -(np.exp(logp) * logp).sum(-1)
    assert lp.shape == (b, t) and ent.shape == (b, t)
    np.testing.assert_allclose(np.asarray(lp), want, atol=1e-5, rtol=0)
    np.testing.assert_allclose(np.asarray(ent), want_ent, atol=1e-5, rtol=0)


def _tiny_config(family: str) -> Qwen3VLConfig | Qwen25VLConfig:
    text = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, mrope_section=(2, 1, 1))
    tokens = dict(image_token_id=100, video_token_id=101, vision_start_token_id=102, vision_end_token_id=103)
    if family == "qwen2_5_vl":
        return Qwen25VLConfig(
            text=TextConfig(**text, mrope_interleaved=False, attention_bias=True, qk_norm=False),
            vision=Qwen25VisionConfig(depth=2, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32,
                                      window_size=28, fullatt_block_indexes=(1,)),
            **tokens,
        )
    return Qwen3VLConfig(
        text=TextConfig(**text),
        vision=VisionConfig(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32,
                            num_position_embeddings=16, deepstack_visual_indexes=(0,)),
        **tokens,
    )


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3_vl", "qwen2_5_vl"])
def test_remat_gives_same_loss_and_gradients(family):
    cfg = _tiny_config(family)
    cls = model_class(cfg)
    assert cls is {"qwen3_vl": Qwen3VL, "qwen2_5_vl": Qwen25VL}[family]
    plain = cls(cfg, rngs=nnx.Rngs(3))
    remat = nnx.merge(nnx.graphdef(nnx.eval_shape(lambda: cls(cfg, rngs=nnx.Rngs(0), remat=True))), nnx.state(plain))
    assert remat.remat and not plain.remat
    rng = np.random.RandomState(1)
    ids = rng.randint(0, 100, size=(1, 10))
    ids[0, 3:5] = cfg.image_token_id  # two images of grid (1, 2, 2): one merged token each
    grid = np.array([[1, 2, 2], [1, 2, 2]])
    pixels = rng.randn(8, cfg.vision.patch_dim).astype(np.float32)
    vis = build_vision_inputs(pixels, grid, ids, cfg, patch_bucket=12)
    positions, _ = get_rope_index(ids, grid, None, cfg)
    tokens, positions, seg = jnp.asarray(ids, jnp.int32), jnp.asarray(positions), jnp.ones((1, 10), jnp.int32)

    @nnx.jit
    def loss_and_grad(model):
        def loss(m):
            lp, _ = token_logprobs(m, m(tokens, positions, seg, vis), jnp.roll(tokens, -1, axis=1), chunk_size=4)
            return lp.sum()

        return nnx.value_and_grad(loss)(model)

    l0, g0 = loss_and_grad(plain)
    l1, g1 = loss_and_grad(remat)
    np.testing.assert_allclose(float(l0), float(l1), rtol=1e-6)
    for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)
    assert float(jnp.abs(g0["visual"]["blocks"][0]["q_kernel_dnh"][...]).max()) > 0  # vision is in the graph


@pytest.mark.parametrize("family", ["qwen3_vl", "qwen2_5_vl"])
def test_one_program_serves_any_image_mix_up_to_the_bucket(family):
    cfg = _tiny_config(family)
    model = model_class(cfg)(cfg, rngs=nnx.Rngs(0))
    traces: list[int] = []

    @nnx.jit
    def forward(m, tokens, positions, seg, vis):
        traces.append(1)
        return m(tokens, positions, seg, vis)

    rng = np.random.RandomState(2)
    outs = []
    for grids in ([[1, 2, 4]], [[1, 2, 2], [1, 2, 2], [1, 2, 2]], []):
        grid = np.array(grids, np.int64).reshape(-1, 3)
        ids = rng.randint(0, 100, size=(2, 8))
        n_tokens = int(grid.prod(-1).sum()) // 4
        ids.reshape(-1)[1 : 1 + n_tokens] = cfg.image_token_id
        pixels = rng.randn(int(grid.prod(-1).sum()), cfg.vision.patch_dim).astype(np.float32)
        vis = build_vision_inputs(pixels, grid, ids, cfg, patch_bucket=16)
        positions, _ = get_rope_index(ids, grid, None, cfg)
        outs.append(forward(model, jnp.asarray(ids, jnp.int32), jnp.asarray(positions), jnp.ones((2, 8), jnp.int32), vis))
    assert len(traces) == 1
    assert all(bool(jnp.isfinite(o).all()) for o in outs)
