"""Qwen3-VL-MoE as a model family, against transformers 5's PyTorch `Qwen3VLMoeForConditionalGeneration` (the
independent reference), and the routed MoE block (`models/moe.py`) against numpy and transformers' loss.

One tiny random checkpoint serves every model test: 3 decoder layers, layers 0 and 2 routed MoE blocks (4 experts of
width 40, top-2) and layer 1 dense (`mlp_only_layers=[1]`), Qwen3-VL's vision tower with deepstack [0, 1], untied
embeddings. Checked: fp32 logits within 1e-4 of transformers' on text, one image, several images in a right-padded
batch, a three-turn conversation with images in its observations, and packed rows (each segment equals its own
unpacked forward and transformers on it alone); the router logits equal transformers'; export to transformers'
layout loads in transformers with its logits and reloads bit-identical; the grouped `ragged_dot` experts equal a
per-token numpy reference (values and gradients); the auxiliary loss equals transformers' `load_balancing_loss_func`;
forcing the router's own top-k ids reproduces the outputs bit for bit and forcing others takes effect; the engine's
prefill + greedy decode on the paged KV cache generate what transformers' `generate` does.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _hf_tiny import VOCAB_SPECIALS, make_batch, pack_batches, random_image, spread_weights
from flax import nnx

import jax
import jax.numpy as jnp
from jaxrl_vlm.models import build_vision_inputs, expert_parallel, from_hf, get_rope_index, get_rope_index_packed, to_hf
from jaxrl_vlm.models.config import ConfigError, Qwen3VLMoeConfig, from_hf_dict
from jaxrl_vlm.models.moe import expert_load, grouped_expert_mlp, load_balancing_loss, route
from jaxrl_vlm.models import qwen3_vl_moe as moe_engine
from jaxrl_vlm.models.paged_kv import decode, init_cache, prefill
from jaxrl_vlm.engine.options import EngineOptions
from jaxrl_vlm.engine.placement import ReplicaPlacement
from jaxrl_vlm.engine.runner import IntRow, FloatRow, ModelRunner

TOL = 1e-4
B_FIX, T_FIX, PATCH_BUCKET = 2, 64, 96
E, K = 4, 2

TINY_MOE: dict = dict(
    text_config=dict(
        vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, num_experts=E, num_experts_per_tok=K,
        moe_intermediate_size=40, decoder_sparse_step=1, mlp_only_layers=[1],
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 2, 2],
                         "mrope_interleaved": True},
    ),
    vision_config=dict(
        depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=16, temporal_patch_size=2,
        spatial_merge_size=2, out_hidden_size=64, num_position_embeddings=64, deepstack_visual_indexes=[0, 1],
    ),
    tie_word_embeddings=False,
    **VOCAB_SPECIALS,
)


@nnx.jit
def _forward(model, tokens, positions, segment_ids, vision, routed):
    hidden, routing = model.forward(tokens, positions, segment_ids, vision, routed)
    return model.logits(hidden), routing


_prefill = nnx.jit(prefill)
_decode = nnx.jit(decode)


def build_hf_moe(seed: int = 0):
    """A random fp32 `Qwen3VLMoeForConditionalGeneration` of `TINY_MOE`, weights spread to O(1) activations; the
    stacked expert kernels get variance 1 / fan-in of their last (input) axis, and the router std 1/sqrt(D), so
    routing is far from uniform and a wrong expert changes the logits."""
    from transformers import Qwen3VLMoeConfig as HFConfig
    from transformers import Qwen3VLMoeForConditionalGeneration

    torch.manual_seed(seed)
    model = Qwen3VLMoeForConditionalGeneration(HFConfig(**TINY_MOE)).eval().float()
    spread_weights(model, seed + 1)
    gen = torch.Generator().manual_seed(seed + 2)
    with torch.no_grad():
        for key, p in model.named_parameters():
            if key.endswith(("experts.gate_up_proj", "experts.down_proj")):
                p.copy_(torch.randn(p.shape, generator=gen) / np.sqrt(p.shape[-1]))
    return model


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(transformers fp32 model, our model imported from its save_pretrained directory)."""
    hf = build_hf_moe()
    path = tmp_path_factory.mktemp("qwen3_vl_moe")
    hf.save_pretrained(path)
    return hf, from_hf(path)


def _pad(a: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    out = np.zeros(shape, a.dtype)
    out[tuple(slice(0, s) for s in a.shape)] = a
    return out


def _vision(cfg, pixels, grid, tokens, valid, bucket=PATCH_BUCKET):
    if pixels is None:
        pixels, grid = np.zeros((0, cfg.vision.patch_dim), np.float32), np.zeros((0, 3), np.int64)
    return build_vision_inputs(pixels, grid, tokens, cfg, patch_bucket=bucket, token_valid=valid)


def _ours(model, ids, mask, grid, pixels, routed=None):
    """Our logits [B_FIX, T_FIX, V] and routing of right-padded rows (one program for every parity test)."""
    ids, mask = _pad(ids, (B_FIX, T_FIX)), _pad(mask, (B_FIX, T_FIX))
    positions, _ = get_rope_index(ids, grid, mask, model.cfg)
    vis = _vision(model.cfg, pixels, grid, ids, mask)
    logits, routing = _forward(model, jnp.asarray(ids, jnp.int32), jnp.asarray(positions),
                               jnp.asarray(mask, jnp.int32), vis, routed)
    return np.asarray(logits), routing


def _hf(hf, batch):
    with torch.no_grad():
        return hf(**batch.torch_kwargs(), output_router_logits=True)


def _check_batch(pair, rows, images, seed):
    hf, ours = pair
    batch = make_batch(rows, images, seed=seed)
    ref = _hf(hf, batch)
    got, routing = _ours(ours, batch.input_ids, batch.attention_mask, batch.image_grid_thw, batch.pixel_values)
    b, t = batch.input_ids.shape
    real = batch.attention_mask.astype(bool)
    assert np.abs(got[:b, :t] - ref.logits.numpy())[real].max() <= TOL
    # Router logits of each sparse layer (transformers records them [B*T, E] per sparse layer, in layer order).
    assert len(ref.router_logits) == routing.logits.shape[0] == 2
    for layer, hf_logits in enumerate(ref.router_logits):
        ours_l = np.asarray(routing.logits[layer, :b, :t]).reshape(-1, E)[real.reshape(-1)]
        np.testing.assert_allclose(ours_l, hf_logits.numpy()[real.reshape(-1)], atol=TOL, rtol=0)
    return batch, ref, routing


# ----------------------------------------------------------------------------- parity with transformers


def test_text_rows_match_transformers_and_the_aux_loss_is_transformers(pair):
    hf, _ = pair
    batch, ref, routing = _check_batch(pair, [[41], [17]], [], seed=1)
    assert batch.attention_mask[1].sum() < batch.attention_mask[0].sum()  # row 1 is right-padded
    b, t = batch.input_ids.shape
    mask = jnp.asarray(batch.attention_mask)
    # On transformers' router logits, and on ours: transformers' loss (as its forward reports it) to fp32 round-off.
    hf_logits = jnp.asarray(np.stack([x.numpy() for x in ref.router_logits]))
    np.testing.assert_allclose(float(load_balancing_loss(hf_logits, K, mask)), float(ref.aux_loss), rtol=1e-6)
    np.testing.assert_allclose(float(load_balancing_loss(routing.logits[:, :b, :t], K, mask)), float(ref.aux_loss),
                               rtol=1e-5)
    assert float(ref.aux_loss) > 1.0  # E * sum f_e p_e >= 1, equality only under perfect balance
    # Load statistics: each layer routes k experts per real token.
    load = np.asarray(expert_load(routing.topk_ids[:, :b, :t], E, mask))
    assert load.shape == (2, E) and (load.sum(axis=1) == K * int(mask.sum())).all()
    ids = np.asarray(routing.topk_ids[0, :b, :t])[batch.attention_mask.astype(bool)]
    np.testing.assert_array_equal(load[0], np.bincount(ids.reshape(-1), minlength=E))


def test_one_image_matches_transformers(pair):
    batch, _, _ = _check_batch(pair, [[5, "img", 9]], [random_image(64, 96, 1)], seed=2)
    assert batch.image_grid_thw.tolist() == [[1, 4, 6]]


def test_several_images_in_a_right_padded_batch_match_transformers(pair):
    images = [random_image(64, 96, 1), random_image(96, 32, 2), random_image(64, 64, 3)]
    _check_batch(pair, [[4, "img", 6, "img", 5], [3, "img", 12]], images, seed=3)


def test_three_turn_conversation_with_images_in_observations_matches_transformers(pair):
    """prompt + image, answer, observation + image, answer, observation + image, answer: one 55-token row."""
    images = [random_image(64, 64, 4), random_image(64, 96, 5), random_image(32, 64, 6)]
    turns = [5, "img", 4, 6, 3, "img", 3, 6, 3, "img", 2, 5]
    batch, _, _ = _check_batch(pair, [turns], images, seed=4)
    assert batch.input_ids.shape[1] == 55


def test_packed_segments_equal_their_own_forward_and_transformers(pair):
    """Three sequences packed in row 0, two in row 1: routing is per token, attention stays within a segment."""
    hf, ours = pair
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
    packed, routing = _forward(ours, jnp.asarray(tokens, jnp.int32), jnp.asarray(positions), jnp.asarray(seg), vis, None)
    packed = np.asarray(packed)
    for (row, lo, n), batch in zip(spans, batches):
        alone, alone_routing = _ours(ours, batch.input_ids, batch.attention_mask, batch.image_grid_thw,
                                     batch.pixel_values)
        np.testing.assert_allclose(packed[row, lo : lo + n], alone[0, :n], atol=2e-5, rtol=0)
        np.testing.assert_array_equal(np.asarray(routing.topk_ids[:, row, lo : lo + n]),
                                      np.asarray(alone_routing.topk_ids[:, 0, :n]))
        assert np.abs(packed[row, lo : lo + n] - _hf(hf, batch).logits.numpy()[0]).max() <= TOL


# ----------------------------------------------------------------------------- routing replay


def test_forcing_the_routers_own_ids_reproduces_the_outputs_and_other_ids_take_effect(pair):
    _, ours = pair
    batch = make_batch([[5, "img", 9], [12]], [random_image(64, 64, 12)], seed=5)
    args = (batch.input_ids, batch.attention_mask, batch.image_grid_thw, batch.pixel_values)
    free, routing = _ours(ours, *args)
    replayed, again = _ours(ours, *args, routed=routing.topk_ids)
    np.testing.assert_array_equal(replayed, free)
    np.testing.assert_array_equal(np.asarray(again.topk_weights), np.asarray(routing.topk_weights))
    other = (routing.topk_ids + 1) % E  # still k distinct experts per token, none the router chose first
    moved, forced = _ours(ours, *args, routed=other)
    np.testing.assert_array_equal(np.asarray(forced.topk_ids), np.asarray(other))
    real = np.asarray(_pad(batch.attention_mask, (B_FIX, T_FIX)), bool)
    assert np.abs(moved - free)[real].max() > 1e-2
    np.testing.assert_allclose(np.asarray(forced.topk_weights).sum(-1), 1.0, atol=1e-6)  # renormalised


# ----------------------------------------------------------------------------- the MoE block (pure functions)


def _expert_mlp_reference(x, ids, weights, gate, up, down):
    """Per token, per chosen expert, in float64 numpy: sum_j w_j * down_e(silu(gate_e x) * up_e x)."""
    out = np.zeros_like(x, dtype=np.float64)
    silu = lambda z: z / (1.0 + np.exp(-z))  # noqa: E731
    for n in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = ids[n, j]
            h = silu(x[n] @ gate[e]) * (x[n] @ up[e])
            out[n] += weights[n, j] * (h @ down[e])
    return out


def test_ragged_dot_experts_equal_a_per_token_reference_with_an_idle_expert():
    rng = np.random.RandomState(0)
    n, d, f, e, k = 13, 8, 6, 5, 2
    x = rng.randn(n, d).astype(np.float32)
    gate, up = rng.randn(e, d, f).astype(np.float32) / 3, rng.randn(e, d, f).astype(np.float32) / 3
    down = rng.randn(e, f, d).astype(np.float32) / 3
    logits = rng.randn(n, e).astype(np.float32)
    logits[:, 3] = -30.0  # expert 3 is never chosen: an empty group
    w, ids = jax.jit(route, static_argnums=(1, 2))(jnp.asarray(logits), k, True)
    probs = np.exp(logits - logits.max(1, keepdims=True))
    probs /= probs.sum(1, keepdims=True)
    want_ids = np.argsort(-probs, axis=1, kind="stable")[:, :k]
    np.testing.assert_array_equal(np.asarray(ids), want_ids)
    top = np.take_along_axis(probs, want_ids, axis=1)
    np.testing.assert_allclose(np.asarray(w), top / top.sum(1, keepdims=True), rtol=1e-6)
    assert 3 not in np.asarray(ids)
    grouped = jax.jit(grouped_expert_mlp)
    got = grouped(jnp.asarray(x), ids, w, jnp.asarray(gate), jnp.asarray(up), jnp.asarray(down))
    want = _expert_mlp_reference(x.astype(np.float64), np.asarray(ids), np.asarray(w, np.float64), gate, up, down)
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5, rtol=0)

    # Gradients of the grouped form equal those of a per-token gather of each token's expert weights.
    def per_token(x, w, g, u, dn):
        ge, ue, de = g[ids], u[ids], dn[ids]  # [N, k, ...]
        h = jax.nn.silu(jnp.einsum("nd,nkdf->nkf", x, ge)) * jnp.einsum("nd,nkdf->nkf", x, ue)
        return jnp.einsum("nkf,nkfd,nk->nd", h, de, w)

    args = (jnp.asarray(x), w, jnp.asarray(gate), jnp.asarray(up), jnp.asarray(down))
    loss = lambda fn: lambda *a: jnp.sum(jnp.sin(fn(*a)))  # noqa: E731
    g_grouped = jax.jit(jax.grad(loss(lambda x, w, g, u, dn: grouped_expert_mlp(x, ids, w, g, u, dn)),
                                 argnums=(0, 1, 2, 3, 4)))(*args)
    g_token = jax.jit(jax.grad(loss(per_token), argnums=(0, 1, 2, 3, 4)))(*args)
    for a, b in zip(g_grouped, g_token):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=1e-5)
    assert not np.asarray(g_grouped[2][3]).any()  # the idle expert gets no gradient


def test_aux_loss_equals_transformers_load_balancing_loss_func_with_and_without_a_mask():
    from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import load_balancing_loss_func

    rng = np.random.RandomState(1)
    logits = rng.randn(3, 2 * 7, 6).astype(np.float32) * 2  # 3 layers, batch 2 x 7 tokens, 6 experts
    mask = np.ones((2, 7), np.int64)
    mask[1, 4:] = 0
    layers = tuple(torch.from_numpy(x) for x in logits)
    for m in (None, mask):
        want = float(load_balancing_loss_func(layers, 6, 3, None if m is None else torch.from_numpy(m)))
        got = float(jax.jit(load_balancing_loss, static_argnums=1)(jnp.asarray(logits), 3,
                                                                   None if m is None else jnp.asarray(m)))
        np.testing.assert_allclose(got, want, rtol=1e-6)
    # A sequence of per-layer [B, T, E] arrays is the same input.
    per_layer = [jnp.asarray(x.reshape(2, 7, 6)) for x in logits]
    np.testing.assert_allclose(float(load_balancing_loss(per_layer, 3, jnp.asarray(mask))),
                               float(load_balancing_loss_func(layers, 6, 3, torch.from_numpy(mask))), rtol=1e-6)


# ----------------------------------------------------------------------------- config and HF import / export


def test_config_follows_transformers_rule_for_sparse_layers_and_rejects_what_it_does_not_model():
    from transformers import Qwen3VLMoeConfig as HFConfig
    from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import (
        Qwen3VLMoeTextDecoderLayer,
        Qwen3VLMoeTextSparseMoeBlock,
    )

    hf_cfg = HFConfig(**TINY_MOE)
    cfg = from_hf_dict(hf_cfg.to_dict())  # as transformers saves it: the expert count under num_local_experts
    assert isinstance(cfg, Qwen3VLMoeConfig) and cfg.text.sparse_layers == (0, 2) and cfg.text.num_experts == E
    assert from_hf_dict(cfg.to_hf_dict()) == cfg
    text = dict(TINY_MOE["text_config"], num_hidden_layers=7, decoder_sparse_step=2, mlp_only_layers=[3])
    hf_text = HFConfig(**dict(TINY_MOE, text_config=text)).text_config
    ours = from_hf_dict(dict(cfg.to_hf_dict(), text_config=dict(cfg.to_hf_dict()["text_config"], **text))).text
    hf_sparse = tuple(i for i in range(7)
                      if isinstance(Qwen3VLMoeTextDecoderLayer(hf_text, i).mlp, Qwen3VLMoeTextSparseMoeBlock))
    assert ours.sparse_layers == hf_sparse == (1, 5)
    base = cfg.to_hf_dict()
    for key, value, match in [("shared_expert_intermediate_size", 64, "shared_expert_intermediate_size"),
                              ("norm_topk_prob", False, "norm_topk_prob"),
                              ("num_experts_per_tok", 5, "num_experts_per_tok"),
                              ("mlp_only_layers", [3], "mlp_only_layers")]:
        with pytest.raises(ConfigError, match=match):
            from_hf_dict(dict(base, text_config=dict(base["text_config"], **{key: value})))


def test_export_loads_in_transformers_with_its_logits_and_reloads_bit_identical(pair, tmp_path):
    from transformers import Qwen3VLMoeForConditionalGeneration

    hf, ours = pair
    out = to_hf(ours, tmp_path / "export", dtype=jnp.float32)
    loaded = Qwen3VLMoeForConditionalGeneration.from_pretrained(out).eval()
    want, got = hf.state_dict(), loaded.state_dict()
    assert set(got) == set(want)
    for key, value in want.items():
        assert torch.equal(got[key], value), key
    batch = make_batch([[4, "img", 6]], [random_image(64, 64, 13)], seed=6)
    with torch.no_grad():
        assert torch.equal(loaded(**batch.torch_kwargs()).logits, hf(**batch.torch_kwargs()).logits)
    again = from_hf(out)
    a, b = dict(nnx.to_flat_state(nnx.state(ours, nnx.Param))), dict(nnx.to_flat_state(nnx.state(again, nnx.Param)))
    assert set(a) == set(b)
    for path in a:
        np.testing.assert_array_equal(np.asarray(a[path].get_value()), np.asarray(b[path].get_value()), err_msg=str(path))


# ----------------------------------------------------------------------------- engine functions


def test_prefill_and_greedy_decode_on_the_paged_cache_generate_as_transformers(pair):
    """A 22-token image prompt prefilled into pages of 8, then 5 greedy decode steps: the tokens of transformers'
    `generate`, and each step's logits those of the full forward of the sequence so far."""
    hf, ours = pair
    cfg = ours.cfg
    batch = make_batch([[5, "img", 9]], [random_image(64, 96, 11)], seed=21)
    n, steps, pages, page = batch.input_ids.shape[1], 5, 16, 8
    with torch.no_grad():
        out = hf.generate(**batch.torch_kwargs(), max_new_tokens=steps, do_sample=False)
    expected = out[0, n:].tolist()
    assert len(set(expected)) > 1, "degenerate reference: a wrong token would not show"
    positions, deltas = get_rope_index(batch.input_ids, batch.image_grid_thw, None, cfg)
    tokens = _pad(batch.input_ids, (1, 32))
    table = jnp.asarray([0, 1, 2, 3, 4] + [pages] * 3, jnp.int32)
    vis = _vision(cfg, batch.pixel_values, batch.image_grid_thw, tokens, None, bucket=32)
    cache = init_cache(cfg, pages, page, 1, jnp.float32)
    cache, logits = _prefill(ours, cache, jnp.int32(0), table, jnp.int32(0), jnp.asarray(tokens, jnp.int32),
                             jnp.asarray(_pad(positions, (3, 1, 32))), jnp.int32(n), vis)
    generated = []
    for step in range(steps):
        token = int(np.argmax(np.asarray(logits).reshape(-1)))
        generated.append(token)
        cache, logits = _decode(ours, cache, jnp.asarray([0], jnp.int32), table[None], jnp.asarray([token], jnp.int32),
                                jnp.asarray([n + step], jnp.int32), jnp.asarray([int(deltas[0])], jnp.int32))
    assert generated == expected
    ids = np.asarray([batch.input_ids[0].tolist() + generated])  # the last step fed generated[-1]
    full, _ = _ours(ours, ids, np.ones_like(ids), batch.image_grid_thw, batch.pixel_values)
    np.testing.assert_allclose(np.asarray(logits)[0], full[0, ids.shape[1] - 1], atol=TOL, rtol=0)


def test_prompts_side_by_side_store_the_kv_and_experts_of_one_prompt_at_a_time(pair):
    """The engine's batched prefill (`prefill_rows`, several text prompts in one forward): the logits, K/V and
    routed experts of prompts prefilled one at a time, a prefix extension among them."""
    _, ours = pair
    cfg, page, pages, t = ours.cfg, 8, 12, 16
    rng = np.random.default_rng(5)
    ids = [rng.integers(10, 200, size=n).astype(np.int32) for n in (5, 11, 16, 20)]
    tables = np.asarray([[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11]], np.int32)
    starts, lengths = np.asarray([0, 0, 0, 8], np.int32), np.asarray([5, 11, 16, 12], np.int32)
    tokens, positions = np.zeros((4, t), np.int32), np.zeros((3, 4, t), np.int32)
    for r, row in enumerate(ids):
        tokens[r, :lengths[r]] = row[starts[r]:]
        positions[:, r] = starts[r] + np.arange(t)
    one, rows = nnx.jit(moe_engine.prefill), nnx.jit(moe_engine.prefill_rows)
    # The fourth prompt's first 8 tokens are in its first page already (a reused prefix).
    prefix = np.zeros((1, t), np.int32)
    prefix[0, :8] = ids[3][:8]
    start = moe_engine.init_cache(cfg, pages, page, 4, jnp.float32)
    start, _ = one(ours, start, jnp.int32(0), jnp.asarray(tables[3]), jnp.int32(0), jnp.asarray(prefix),
                   jnp.asarray(np.broadcast_to(np.arange(t, dtype=np.int32), (3, 1, t))), jnp.int32(8), None)
    alone, logits_alone = start, []
    for r in range(4):
        alone, lg = one(ours, alone, jnp.int32(r), jnp.asarray(tables[r]), jnp.int32(starts[r]), jnp.asarray(tokens[r:r + 1]),
                        jnp.asarray(positions[:, r:r + 1]), jnp.int32(lengths[r]), None)
        logits_alone.append(np.asarray(lg))
    together, logits = rows(ours, start, jnp.asarray(tables), jnp.asarray(starts), jnp.asarray(tokens),
                            jnp.asarray(positions), jnp.asarray(lengths), None)
    np.testing.assert_allclose(np.asarray(logits), np.stack(logits_alone), atol=TOL, rtol=0)
    for part in ("k", "v"):
        np.testing.assert_allclose(np.asarray(getattr(together, part)), np.asarray(getattr(alone, part)), atol=TOL, rtol=0)
    np.testing.assert_array_equal(np.asarray(together.experts), np.asarray(alone.experts))
    recorded = np.asarray(together.experts)[tables[3, 1], :4][:, list(cfg.text.sparse_layers)]
    assert (recorded >= 0).all()  # the extension's experts, in its sparse layers


def test_a_checkpoint_in_the_released_expert_layout_imports_as_transformers_reads_it(pair, tmp_path):
    """Released Qwen3-VL-MoE checkpoints store gate_up_proj [E, D, 2F] and down_proj [E, F, D]; transformers
    transposes them at load time, and so does our reader: the same parameters as from transformers' own layout."""
    from safetensors.torch import save_file

    hf, ours = pair
    released = {k: (v.transpose(1, 2) if k.endswith(("experts.gate_up_proj", "experts.down_proj")) else v).contiguous()
                for k, v in hf.state_dict().items()}
    hf.config.save_pretrained(tmp_path)
    save_file(released, tmp_path / "model.safetensors", metadata={"format": "pt"})
    again = from_hf(tmp_path)
    a, b = dict(nnx.to_flat_state(nnx.state(ours, nnx.Param))), dict(nnx.to_flat_state(nnx.state(again, nnx.Param)))
    for path in a:
        np.testing.assert_array_equal(np.asarray(a[path].get_value()), np.asarray(b[path].get_value()), err_msg=str(path))


@pytest.mark.parametrize(("tp", "ep"), [(2, 1), (2, 2)], ids=["tp2", "tp2_ep2"])
def test_engine_runner_at_tp2_and_with_experts_split_over_2_devices_generates_as_transformers(pair, tp, ep,
                                                                                          monkeypatch):
    """The engine's runner (--tp-size 2, and --tp-size 2 --ep-size 2: each device holds 2 of the 4 experts, runs
    the copies routed to them and the partial outputs are summed) prefills the image prompt and decodes 5 greedy
    tokens: those of transformers' `generate`, which the one-device engine functions give above."""
    hf, ours = pair
    cfg = ours.cfg
    batch = make_batch([[5, "img", 9]], [random_image(64, 96, 11)], seed=21)
    n, steps = batch.input_ids.shape[1], 5
    with torch.no_grad():
        expected = hf.generate(**batch.torch_kwargs(), max_new_tokens=steps, do_sample=False)[0, n:].tolist()
    options = EngineOptions(max_batch=1, max_seq_len=64, min_prefill_bucket=32, min_kv_bucket=32, page_size=8,
                            min_patch_bucket=32, state_snapshots=0, tp_size=tp, ep_size=ep)
    placement = ReplicaPlacement(jax.devices()[:tp], ep_size=ep)
    if ep > 1:  # the experts really are split: each device holds E / ep of them
        gate = ours.layers[0].mlp.gate_experts_edf
        shards = placement.params(nnx.state(ours, nnx.Param))["layers"][0]["mlp"]["gate_experts_edf"].get_value()
        assert shards.shard_shape(gate.shape)[0] == E // ep
    traced = []  # the expert-parallel block really runs (not XLA gathering the split experts)
    real = expert_parallel._reduce_block
    monkeypatch.setattr(expert_parallel, "_reduce_block", lambda *a, **kw: traced.append(1) or real(*a, **kw))
    runner = ModelRunner(ours, options, (), placement=placement)
    positions, deltas = get_rope_index(batch.input_ids, batch.image_grid_thw, None, cfg)
    ints = np.zeros((len(IntRow), 1), np.int32)
    floats = np.zeros((len(FloatRow), 1), np.float32)
    floats[FloatRow.TOP_P] = 1.0  # temperature 0: greedy
    ints[IntRow.TOP_K] = -1
    pages = list(range(options.pages_per_request))
    token, _ = runner.prefill(0, pages, batch.input_ids[0], positions[:, 0], batch.pixel_values, batch.image_grid_thw,
                              None, ints[:, 0], floats[:, 0])
    generated = [token]
    for step in range(steps - 1):
        ints[IntRow.TOKEN], ints[IntRow.LENGTH], ints[IntRow.ROPE_DELTA] = token, n + step, int(deltas[0])
        ints[IntRow.STEP] = step + 1
        ids, _ = runner.decode(np.asarray([0], np.int32), np.asarray([pages], np.int32), ints, floats, filtered=False)
        token = int(ids[0])
        generated.append(token)
    assert generated == expected
    assert bool(traced) == (ep > 1)
