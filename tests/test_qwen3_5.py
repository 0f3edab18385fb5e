"""Qwen3.5 (dense) as a model family, against transformers 5's PyTorch Qwen3.5 (the independent reference).

One tiny random checkpoint (`_hf_tiny_qwen3_5`: 3 Gated DeltaNet layers + 1 gated full-attention layer, 4 value
heads on 2 key heads, partial interleaved M-RoPE, Qwen3-VL's tower without deepstack) serves every test. Our
linear layers run with chunks of 16 so that the fixed 64-token rows cross chunk boundaries (transformers uses 64).

Checked: our fp32 logits (<= 1e-4 from transformers' logits) of text, one image, several images in a right-padded batch, a three-turn
conversation with images in the observations, and packed rows (each segment equals its own unpacked forward and
transformers on it alone); the chunked and the recurrent delta rule agree (with segment resets); export to
transformers' layout and reload; the engine functions (prefill, greedy decode, a prefill split in two, slot copy,
save and restore of a slot's state) reproduce the full forward; remat keeps loss and gradients.

The logits reference is transformers' model run in float64 (`_hf_ref`): in fp32, transformers' own logits on this
tiny model stray up to ~9e-5 from its float64 ones (the gated RMSNorm over 8-dim value heads and the l2-norm of
16-dim keys magnify the round-off of small vectors), which would leave no room for ours within 1e-4. Our fp32
logits are within ~4e-5 of the float64 reference.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from _hf_tiny import HFBatch, make_batch, pack_batches, random_image, save_hf_model
from _hf_tiny_qwen3_5 import TINY_QWEN3_5, build_hf_qwen3_5
from flax import nnx

import jax
import jax.numpy as jnp
from jaxrl_vlm.models import build_vision_inputs, from_hf, get_rope_index, get_rope_index_packed, to_hf, token_logprobs
from jaxrl_vlm.models.config import ConfigError, Qwen3_5Config, from_hf_dict
from jaxrl_vlm.models.families import DecodeCache
from jaxrl_vlm.models.qwen3_5 import (
    HybridCache,
    Qwen3_5,
    chunk_gated_delta_rule,
    decode,
    init_cache,
    l2_normalize,
    prefill,
    recurrent_gated_delta_rule,
)

TOL = 1e-4
B_FIX, T_FIX, PATCH_BUCKET, CHUNK = 2, 64, 96, 16


@nnx.jit
def _logits(model, tokens, positions, segment_ids, vision):
    return model.logits(model(tokens, positions, segment_ids, vision))


_prefill = nnx.jit(prefill)
_chunked = jax.jit(chunk_gated_delta_rule, static_argnames="chunk_size")
_recurrent = jax.jit(recurrent_gated_delta_rule)
_decode = nnx.jit(decode)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(transformers fp32 model, our model imported from its save_pretrained directory, chunk size CHUNK)."""
    hf = build_hf_qwen3_5()
    ours = from_hf(save_hf_model(hf, tmp_path_factory.mktemp("qwen3_5")))
    for layer in ours.layers:
        if hasattr(layer, "linear_attn"):
            layer.linear_attn.chunk_size = CHUNK
    return hf, ours


@pytest.fixture(scope="module")
def hf64(pair):
    return copy.deepcopy(pair[0]).double()


def _hf_ref(hf64, batch: HFBatch) -> np.ndarray:
    """transformers' logits [B, T, V] of `batch`, computed in float64."""
    kw = batch.torch_kwargs()
    if "pixel_values" in kw:
        kw["pixel_values"] = kw["pixel_values"].double()
    with torch.no_grad():
        return hf64(**kw).logits.numpy()


def _pad(a: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    out = np.zeros(shape, a.dtype)
    out[tuple(slice(0, s) for s in a.shape)] = a
    return out


def _vision(cfg, pixels, grid, tokens, valid, bucket=PATCH_BUCKET):
    if pixels is None:
        pixels, grid = np.zeros((0, cfg.vision.patch_dim), np.float32), np.zeros((0, 3), np.int64)
    return build_vision_inputs(pixels, grid, tokens, cfg, patch_bucket=bucket, token_valid=valid)


def _ours(model, ids: np.ndarray, mask: np.ndarray, grid, pixels) -> np.ndarray:
    """Our logits [B_FIX, T_FIX, V] of right-padded rows (one program for every test)."""
    ids, mask = _pad(ids, (B_FIX, T_FIX)), _pad(mask, (B_FIX, T_FIX))
    positions, _ = get_rope_index(ids, grid, mask, model.cfg)
    vis = _vision(model.cfg, pixels, grid, ids, mask)
    return np.asarray(_logits(model, jnp.asarray(ids, jnp.int32), jnp.asarray(positions), jnp.asarray(mask, jnp.int32), vis))


def _check_batch(pair, hf64, rows, images, seed):
    _, ours = pair
    batch = make_batch(rows, images, seed=seed)
    ref = _hf_ref(hf64, batch)
    got = _ours(ours, batch.input_ids, batch.attention_mask, batch.image_grid_thw, batch.pixel_values)
    b, t = batch.input_ids.shape
    real = batch.attention_mask.astype(bool)
    assert np.abs(got[:b, :t] - ref)[real].max() <= TOL
    return batch


# ----------------------------------------------------------------------------- parity with transformers


def test_text_rows_match_transformers(pair, hf64):
    batch = _check_batch(pair, hf64, [[41], [17]], [], seed=1)
    assert batch.attention_mask[1].sum() < batch.attention_mask[0].sum()  # row 1 is right-padded


def test_one_image_matches_transformers(pair, hf64):
    batch = _check_batch(pair, hf64, [[5, "img", 9]], [random_image(64, 96, 1)], seed=2)
    assert batch.image_grid_thw.tolist() == [[1, 4, 6]]


def test_several_images_in_a_right_padded_batch_match_transformers(pair, hf64):
    images = [random_image(64, 96, 1), random_image(96, 32, 2), random_image(64, 64, 3)]
    _check_batch(pair, hf64, [[4, "img", 6, "img", 5], [3, "img", 12]], images, seed=3)


def test_three_turn_conversation_with_images_in_observations_matches_transformers(pair, hf64):
    """prompt + image, answer, observation + image, answer, observation + image, answer: one 55-token row."""
    images = [random_image(64, 64, 4), random_image(64, 96, 5), random_image(32, 64, 6)]
    turns = [5, "img", 4, 6, 3, "img", 3, 6, 3, "img", 2, 5]
    batch = _check_batch(pair, hf64, [turns], images, seed=4)
    assert batch.input_ids.shape[1] == 55


def test_packed_segments_equal_their_own_forward_and_transformers(pair, hf64):
    """Three sequences packed in row 0 (boundaries inside chunks of 16), two in row 1: no conv tap, no recurrent
    state and no attention crosses a segment boundary."""
    _, ours = pair
    cfg = ours.cfg
    specs = [([[3, "img", 4]], [random_image(64, 96, 7)]), ([[19]], []), ([[6, "img", 2]], [random_image(64, 64, 8)]),
             ([[2, "img", 9]], [random_image(32, 64, 9)]), ([[13]], [])]
    batches = [make_batch(rows, imgs, seed=10 + i) for i, (rows, imgs) in enumerate(specs)]
    layout = [(0, 1), (0, 2), (0, 3), (1, 1), (1, 2)]  # (row, segment id) of each sequence, in row-major order
    packed_rows = pack_batches(batches, layout, (B_FIX, T_FIX))
    tokens, seg, spans = packed_rows.tokens, packed_rows.segment_ids, packed_rows.spans
    grid, pixels = packed_rows.grid, packed_rows.pixels
    positions, _ = get_rope_index_packed(tokens, seg, grid, cfg)
    vis = _vision(cfg, pixels, grid, tokens, seg > 0)
    packed = np.asarray(_logits(ours, jnp.asarray(tokens, jnp.int32), jnp.asarray(positions), jnp.asarray(seg), vis))
    for (row, lo, n), batch in zip(spans, batches):
        alone = _ours(ours, batch.input_ids, batch.attention_mask, batch.image_grid_thw, batch.pixel_values)[0, :n]
        np.testing.assert_allclose(packed[row, lo : lo + n], alone, atol=5e-5, rtol=0)  # other chunk offsets: round-off
        assert np.abs(packed[row, lo : lo + n] - _hf_ref(hf64, batch)[0]).max() <= TOL


# ----------------------------------------------------------------------------- the delta rule (pure functions)


def _delta_inputs(seed: int, b: int, t: int, h: int = 3, dk: int = 8, dv: int = 5):
    rng = np.random.RandomState(seed)
    q = l2_normalize(jnp.asarray(rng.randn(b, t, h, dk), jnp.float32)) * dk**-0.5
    k = l2_normalize(jnp.asarray(rng.randn(b, t, h, dk), jnp.float32))
    v = jnp.asarray(rng.randn(b, t, h, dv), jnp.float32)
    g = -jnp.asarray(rng.uniform(0.0, 1.5, (b, t, h)), jnp.float32)
    beta = jnp.asarray(rng.uniform(0.0, 1.0, (b, t, h)), jnp.float32)
    state = jnp.asarray(rng.randn(b, h, dk, dv), jnp.float32)
    return q, k, v, g, beta, state


@pytest.mark.parametrize("t, chunk", [(5, 4), (16, 16), (37, 8)])
def test_chunked_and_recurrent_delta_rule_agree(t, chunk):
    """Same outputs and final state from a non-zero initial state, T a multiple of the chunk or not."""
    q, k, v, g, beta, state = _delta_inputs(t, 2, t)
    o_c, s_c = _chunked(q, k, v, g, beta, state, chunk_size=chunk)
    o_r, s_r = _recurrent(q, k, v, g, beta, state)
    np.testing.assert_allclose(np.asarray(o_c), np.asarray(o_r), atol=2e-5, rtol=0)
    np.testing.assert_allclose(np.asarray(s_c), np.asarray(s_r), atol=2e-5, rtol=0)


def test_chunked_delta_rule_restarts_every_run_from_zero_state():
    """Runs [0]*7 + [1]*9 + [2]*5 (boundaries inside chunks of 8): run 0 continues the initial state, later runs
    equal the recurrent rule started from zero on their own steps."""
    q, k, v, g, beta, state = _delta_inputs(3, 1, 21)
    bounds = [0, 7, 16, 21]
    runs = jnp.asarray(np.repeat([0, 1, 2], np.diff(bounds))[None], jnp.int32)
    o_c, s_c = _chunked(q, k, v, g, beta, state, runs, chunk_size=8)
    for r, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
        part = [x[:, lo:hi] for x in (q, k, v, g, beta)]
        o_r, s_r = _recurrent(*part, state if r == 0 else jnp.zeros_like(state))
        np.testing.assert_allclose(np.asarray(o_c[:, lo:hi]), np.asarray(o_r), atol=2e-5, rtol=0)
    np.testing.assert_allclose(np.asarray(s_c), np.asarray(s_r), atol=2e-5, rtol=0)


# ----------------------------------------------------------------------------- config and HF import / export


def test_config_parses_transformers_dict_and_round_trips():
    from transformers import Qwen3_5Config as HFConfig

    cfg = from_hf_dict(HFConfig(**TINY_QWEN3_5).to_dict())
    assert isinstance(cfg, Qwen3_5Config) and cfg.text.rotary_dim == 16 and cfg.text.linear_layers == (0, 2, 3)
    assert from_hf_dict(cfg.to_hf_dict()) == cfg
    default = HFConfig(text_config=dict(num_hidden_layers=8), vision_config=dict(out_hidden_size=4096)).to_dict()
    default["text_config"].pop("layer_types")  # then they follow full_attention_interval (4)
    assert from_hf_dict(default).text.full_layers == (3, 7)
    bad = HFConfig(**TINY_QWEN3_5).to_dict()
    bad["text_config"]["layer_types"][2] = "sliding_attention"
    with pytest.raises(ConfigError, match="layer_types.*sliding_attention"):
        from_hf_dict(bad)


def test_export_loads_in_transformers_and_reloads_bit_identical(pair, tmp_path):
    from transformers import Qwen3_5ForConditionalGeneration

    hf, ours = pair
    out = to_hf(ours, tmp_path / "export", dtype=jnp.float32)
    loaded = Qwen3_5ForConditionalGeneration.from_pretrained(out).eval()
    want = hf.state_dict()
    got = loaded.state_dict()
    assert set(got) == set(want)
    for key, value in want.items():
        assert torch.equal(got[key], value), key
    again = from_hf(out)
    a, b = dict(nnx.to_flat_state(nnx.state(ours, nnx.Param))), dict(nnx.to_flat_state(nnx.state(again, nnx.Param)))
    assert set(a) == set(b)
    for path in a:
        np.testing.assert_array_equal(np.asarray(a[path].get_value()), np.asarray(b[path].get_value()), err_msg=str(path))


# ----------------------------------------------------------------------------- engine functions

PAGES, PAGE, SLOTS, BUCKET = 16, 8, 3, 32


@pytest.fixture(scope="module")
def prompt(pair):
    """A 22-token prompt with one image (pads at 6..13), its M-RoPE ids and rope delta."""
    _, ours = pair
    batch = make_batch([[5, "img", 9]], [random_image(64, 96, 11)], seed=21)
    positions, deltas = get_rope_index(batch.input_ids, batch.image_grid_thw, None, ours.cfg)
    return batch, positions, int(deltas[0])


def _prefill_args(cfg, batch, positions, lo: int, hi: int, table):
    """prefill's arguments for prompt tokens [lo, hi), padded to BUCKET (images only in the chunk that holds them)."""
    tokens = _pad(batch.input_ids[:, lo:hi], (1, BUCKET))
    pos = _pad(positions[:, :, lo:hi], (3, 1, BUCKET))
    has_image = (tokens == cfg.image_token_id).any()
    vis = _vision(cfg, batch.pixel_values, batch.image_grid_thw, tokens, None, bucket=32) if has_image else None
    return (jnp.asarray(table, jnp.int32), jnp.int32(lo), jnp.asarray(tokens, jnp.int32), jnp.asarray(pos),
            jnp.int32(hi - lo), vis)


def _table(pages: list[int]) -> np.ndarray:
    return np.asarray(pages + [PAGES] * (8 - len(pages)), np.int32)


def _full_logits(ours, batch, ids: list[int]) -> np.ndarray:
    seq = np.asarray([ids])
    return _ours(ours, seq, np.ones_like(seq), batch.image_grid_thw, batch.pixel_values)[0, : len(ids)]


def test_prefill_then_greedy_decode_reproduce_the_full_forward(pair, prompt):
    """Two running rows (slot 0, and slot 1 started from a copy of slot 0's state and pages) and a padding row that
    carries slot 0, as the engine pads (its table of num_pages marks it: it must not touch slot 0's state)."""
    _, ours = pair
    batch, positions, delta = prompt
    n = batch.input_ids.shape[1]
    cache = init_cache(ours.cfg, PAGES, PAGE, SLOTS, jnp.float32)
    assert isinstance(cache, HybridCache) and isinstance(cache, DecodeCache) and cache.state_rows == SLOTS
    assert cache.recurrent.shape == (SLOTS, 3, 4, 16, 8) and cache.conv.shape == (SLOTS, 3, 2 * 32 + 32, 3)
    table0 = _table([0, 1, 2, 3, 4, 5])
    cache, last = _prefill(ours, cache, jnp.int32(0), *_prefill_args(ours.cfg, batch, positions, 0, n, table0))
    ids = batch.input_ids[0].tolist()
    full = _full_logits(ours, batch, ids)
    np.testing.assert_allclose(np.asarray(last), full[n - 1], atol=TOL, rtol=0)
    # Slot 1 shares pages 0, 1 and a copy of the partly filled page 2 (its decode writes there), and slot 0's state.
    cache = jax.jit(lambda c: c.copy_state(jnp.int32(0), jnp.int32(1)).copy_page(jnp.int32(2), jnp.int32(6)))(cache)
    tables = jnp.asarray(np.stack([table0, _table([0, 1, 6, 7, 8, 9]), _table([])]))
    slots = jnp.asarray([0, 1, 0], jnp.int32)
    token = int(np.argmax(full[n - 1]))
    for step in range(4):
        length = n + step
        cache, logits = _decode(ours, cache, slots, tables, jnp.asarray([token, token, 0], jnp.int32),
                                jnp.asarray([length, length, 0], jnp.int32), jnp.asarray([delta, delta, 0], jnp.int32))
        ids.append(token)
        want = _full_logits(ours, batch, ids)[length]
        np.testing.assert_allclose(np.asarray(logits[0]), want, atol=TOL, rtol=0)
        np.testing.assert_array_equal(np.asarray(logits[1]), np.asarray(logits[0]))
        token = int(np.argmax(want))
    assert not np.asarray(cache.recurrent[2]).any() and not np.asarray(cache.conv[2]).any()  # slot 2 untouched


def test_prefill_in_two_chunks_equals_one_prefill_and_slot_state_round_trips(pair, prompt):
    """Prompt [0, 16) then [16, 22) (start > 0 continues the slot's stored state) == [0, 22) at once; a slot's
    state saved with `slot_state` and written to another slot with `with_slot_state` is the same state."""
    _, ours = pair
    batch, positions, _ = prompt
    n, cut = batch.input_ids.shape[1], 16
    table = _table([0, 1, 2])
    one, want = _prefill(ours, init_cache(ours.cfg, PAGES, PAGE, SLOTS, jnp.float32), jnp.int32(1),
                         *_prefill_args(ours.cfg, batch, positions, 0, n, table))
    two, _ = _prefill(ours, init_cache(ours.cfg, PAGES, PAGE, SLOTS, jnp.float32), jnp.int32(1),
                      *_prefill_args(ours.cfg, batch, positions, 0, cut, table))
    two, got = _prefill(ours, two, jnp.int32(1), *_prefill_args(ours.cfg, batch, positions, cut, n, table))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=0)
    for name in ("k", "v", "conv", "recurrent"):
        np.testing.assert_allclose(np.asarray(getattr(two, name)), np.asarray(getattr(one, name)), atol=1e-5, rtol=0)
    saved = jax.jit(lambda c: c.slot_state(jnp.int32(1)))(one)
    restored = jax.jit(lambda c, s: c.with_slot_state(jnp.int32(0), s))(one, saved)
    np.testing.assert_array_equal(np.asarray(restored.recurrent[0]), np.asarray(one.recurrent[1]))
    np.testing.assert_array_equal(np.asarray(restored.conv[0]), np.asarray(one.conv[1]))
    assert np.asarray(one.recurrent[1]).any()


# ----------------------------------------------------------------------------- training path


def test_remat_gives_the_same_loss_and_gradients_on_packed_rows(pair):
    """The train step's path: token log-probs of two packed sequences, with and without per-layer remat; the
    gradients reach the linear layers' decay, conv and gate parameters."""
    _, ours = pair
    remat = nnx.merge(nnx.graphdef(nnx.eval_shape(lambda: Qwen3_5(ours.cfg, rngs=nnx.Rngs(0), remat=True))),
                      nnx.state(ours))
    rng = np.random.RandomState(2)
    tokens = jnp.asarray(rng.randint(0, 240, (1, 40)), jnp.int32)
    seg = jnp.asarray([[1] * 17 + [2] * 23], jnp.int32)
    positions = jnp.asarray(get_rope_index_packed(np.asarray(tokens), np.asarray(seg), None, ours.cfg)[0])

    @nnx.jit
    def loss_and_grad(model):
        def loss(m):
            lp, _ = token_logprobs(m, m(tokens, positions, seg), jnp.roll(tokens, -1, axis=1), chunk_size=8)
            return lp.sum()

        return nnx.value_and_grad(loss)(model)

    l0, g0 = loss_and_grad(ours)
    l1, g1 = loss_and_grad(remat)
    np.testing.assert_allclose(float(l0), float(l1), rtol=1e-6)
    for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-4, rtol=1e-4)  # recomputed in another order
    lin = g0["layers"][0]["linear_attn"]
    for name in ("a_log_h", "dt_bias_h", "conv_q_xhk", "z_kernel_dhv", "b_kernel_dh"):
        assert float(jnp.abs(lin[name][...]).max()) > 0, name
