"""Qwen3.5-MoE as a model family, against transformers 5's PyTorch `Qwen3_5MoeForConditionalGeneration` (the
independent reference).

One tiny random checkpoint serves every test: the tiny Qwen3.5's hybrid stack (3 Gated DeltaNet layers around 1
gated full-attention layer, 4 value heads on 2 key heads, partial interleaved M-RoPE, the tower without deepstack)
with every MLP 4 routed experts of width 40 (top-2) plus a gated shared expert of width 48, untied embeddings,
written in the released checkpoints' fused expert layout. Our linear layers run with chunks of 16 so that the
64-token rows cross chunk boundaries.

Checked: our fp32 logits within 1e-4 of transformers' on text, several images in a right-padded batch, a three-turn
conversation with images in its observations and packed rows (each segment equals its own unpacked forward and
transformers on it alone); the router logits equal transformers' and our auxiliary loss equals the one its forward
reports; forcing the routers' own top-k ids reproduces the logits and other ids take effect in every layer; the
config parses transformers' dict, round-trips and rejects what the family does not model; export loads in
transformers with its exact parameters and reloads bit-identical; the engine's prefill + greedy decode on Qwen3.5's
hybrid cache generate what transformers' `generate` does, on one device, at tp 2 and with the experts split over 2
devices (--ep-size 2), and the experts the cache records for every fed position (prefill, decode, and a second turn
reusing the first's pages from a snapshot of its linear state) are the trainer router's on the same tokens.

As in test_qwen3_5.py, the logits reference is transformers run in float64: its own fp32 logits on this tiny hybrid
model stray up to ~9e-5 from the float64 ones.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from _hf_tiny import HFBatch, make_batch, pack_batches, random_image, spread_weights
from _hf_tiny_qwen3_5 import TINY_QWEN3_5
from flax import nnx

import jax
import jax.numpy as jnp
from jaxrl_vlm.engine.options import EngineOptions
from jaxrl_vlm.engine.placement import ReplicaPlacement
from jaxrl_vlm.engine.runner import FloatRow, IntRow, ModelRunner
from jaxrl_vlm.models import build_vision_inputs, expert_parallel, from_hf, get_rope_index, get_rope_index_packed, to_hf
from jaxrl_vlm.models.config import ConfigError, Qwen3_5MoeConfig, from_hf_dict
from jaxrl_vlm.models.moe import load_balancing_loss
from jaxrl_vlm.models.qwen3_5_moe import MoeHybridCache, Qwen3_5Moe, decode, init_cache, prefill

TOL = 1e-4
B_FIX, T_FIX, PATCH_BUCKET, CHUNK = 2, 64, 96, 16
E, K, LAYERS = 4, 2, 4

TINY_MOE: dict = dict(
    TINY_QWEN3_5,
    text_config={**{k: v for k, v in TINY_QWEN3_5["text_config"].items() if k != "intermediate_size"},
                 "num_experts": E, "num_experts_per_tok": K, "moe_intermediate_size": 40,
                 "shared_expert_intermediate_size": 48},
)


@nnx.jit
def _forward(model, tokens, positions, segment_ids, vision, routed):
    hidden, routing = model.forward(tokens, positions, segment_ids, vision, routed)
    return model.logits(hidden), routing


_prefill = nnx.jit(prefill)
_decode = nnx.jit(decode)


def build_hf_qwen3_5_moe(seed: int = 0):
    """A random fp32 `Qwen3_5MoeForConditionalGeneration` of `TINY_MOE`, weights spread to O(1) activations as the
    tiny Qwen3.5's (zero-centred norms near 0, A_log near log 0.4), the stacked experts with variance 1 / fan-in of
    their input axis, so that routing is far from uniform and a wrong expert changes the logits."""
    from transformers import Qwen3_5MoeConfig as HFConfig
    from transformers import Qwen3_5MoeForConditionalGeneration

    torch.manual_seed(seed)
    model = Qwen3_5MoeForConditionalGeneration(HFConfig(**TINY_MOE)).eval().float()
    spread_weights(model, seed + 1)
    gen = torch.Generator().manual_seed(seed + 2)
    with torch.no_grad():
        for key, p in model.named_parameters():
            if key.endswith("A_log"):
                p.copy_(-1.0 + 0.5 * torch.randn(p.shape, generator=gen))
            elif key.startswith("model.language_model.") and key.endswith("norm.weight") and "linear_attn" not in key:
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))
            elif key.endswith(("experts.gate_up_proj", "experts.down_proj")):
                p.copy_(torch.randn(p.shape, generator=gen) / np.sqrt(p.shape[-1]))
    return model


def save_released_layout(model, path):
    """`model` as released Qwen3.5-MoE checkpoints store it: each layer's experts as the two fused tensors (the
    module's own parameters; transformers' `save_pretrained` would split them per expert)."""
    from safetensors.torch import save_file

    model.config.save_pretrained(path)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, path / "model.safetensors",
              metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(transformers fp32 model, our model imported from its checkpoint, chunk size CHUNK)."""
    hf = build_hf_qwen3_5_moe()
    ours = from_hf(save_released_layout(hf, tmp_path_factory.mktemp("qwen3_5_moe")))
    for layer in ours.layers:
        if hasattr(layer, "linear_attn"):
            layer.linear_attn.chunk_size = CHUNK
    return hf, ours


@pytest.fixture(scope="module")
def hf64(pair):
    """transformers' model in float64; its experts run its per-expert loop (its grouped-GEMM path is fp32/bf16 only)."""
    model = copy.deepcopy(pair[0]).double()
    model.set_experts_implementation("eager")
    return model


def _hf_ref(hf64, batch: HFBatch, **kw):
    """transformers' output of `batch`, computed in float64."""
    args = batch.torch_kwargs()
    if "pixel_values" in args:
        args["pixel_values"] = args["pixel_values"].double()
    with torch.no_grad():
        return hf64(**args, **kw)


def _pad(a: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    out = np.zeros(shape, a.dtype)
    out[tuple(slice(0, s) for s in a.shape)] = a
    return out


def _vision(cfg, pixels, grid, tokens, valid, bucket=PATCH_BUCKET):
    if pixels is None:
        pixels, grid = np.zeros((0, cfg.vision.patch_dim), np.float32), np.zeros((0, 3), np.int64)
    return build_vision_inputs(pixels, grid, tokens, cfg, patch_bucket=bucket, token_valid=valid)


NO_REPLAY = -np.ones((LAYERS, B_FIX, T_FIX, K), np.int32)  # negative ids: every token keeps its router's choice


def _ours(model, ids, mask, grid, pixels, routed=NO_REPLAY):
    """Our logits [B_FIX, T_FIX, V] and routing of right-padded rows (one program for every parity test: replayed
    ids are always passed, by default none)."""
    ids, mask = _pad(ids, (B_FIX, T_FIX)), _pad(mask, (B_FIX, T_FIX))
    positions, _ = get_rope_index(ids, grid, mask, model.cfg)
    vis = _vision(model.cfg, pixels, grid, ids, mask)
    logits, routing = _forward(model, jnp.asarray(ids, jnp.int32), jnp.asarray(positions),
                               jnp.asarray(mask, jnp.int32), vis, jnp.asarray(routed))
    return np.asarray(logits), routing


def _check_batch(pair, hf64, rows, images, seed):
    _, ours = pair
    batch = make_batch(rows, images, seed=seed)
    ref = _hf_ref(hf64, batch, output_router_logits=True)
    got, routing = _ours(ours, batch.input_ids, batch.attention_mask, batch.image_grid_thw, batch.pixel_values)
    b, t = batch.input_ids.shape
    real = batch.attention_mask.astype(bool)
    assert np.abs(got[:b, :t] - ref.logits.numpy())[real].max() <= TOL
    # Router logits of every layer (transformers records them [B*T, E] per layer, in layer order).
    assert len(ref.router_logits) == routing.logits.shape[0] == LAYERS
    for layer, hf_logits in enumerate(ref.router_logits):
        ours_l = np.asarray(routing.logits[layer, :b, :t]).reshape(-1, E)[real.reshape(-1)]
        np.testing.assert_allclose(ours_l, hf_logits.numpy()[real.reshape(-1)], atol=TOL, rtol=0)
    return batch, ref, got, routing


# ----------------------------------------------------------------------------- parity with transformers


def test_text_rows_match_transformers_with_its_aux_loss_and_replayed_routing_reproduces_them(pair, hf64):
    _, ours = pair
    batch, ref, free, routing = _check_batch(pair, hf64, [[41], [17]], [], seed=1)
    assert batch.attention_mask[1].sum() < batch.attention_mask[0].sum()  # row 1 is right-padded
    b, t = batch.input_ids.shape
    mask = jnp.asarray(batch.attention_mask)
    np.testing.assert_allclose(float(load_balancing_loss(routing.logits[:, :b, :t], K, mask)), float(ref.aux_loss),
                               rtol=1e-5)
    assert float(ref.aux_loss) > 1.0  # E * sum f_e p_e >= 1, equality only under perfect balance
    # Routing replay: the routers' own ids give the same logits; other ids (in every layer) change them.
    args = (batch.input_ids, batch.attention_mask, None, None)
    replayed, again = _ours(ours, *args, routed=routing.topk_ids)
    np.testing.assert_array_equal(replayed, free)
    np.testing.assert_array_equal(np.asarray(again.topk_weights), np.asarray(routing.topk_weights))
    real = np.asarray(_pad(batch.attention_mask, (B_FIX, T_FIX)), bool)
    for layer in (0, LAYERS - 1):  # a linear-attention layer, the last layer
        other = routing.topk_ids.at[layer].set((routing.topk_ids[layer] + 1) % E)
        moved, forced = _ours(ours, *args, routed=other)
        np.testing.assert_array_equal(np.asarray(forced.topk_ids), np.asarray(other))
        assert np.abs(moved - free)[real].max() > 1e-2


def test_several_images_in_a_right_padded_batch_match_transformers(pair, hf64):
    images = [random_image(64, 96, 1), random_image(96, 32, 2), random_image(64, 64, 3)]
    _check_batch(pair, hf64, [[4, "img", 6, "img", 5], [3, "img", 12]], images, seed=3)


def test_three_turn_conversation_with_images_in_observations_matches_transformers(pair, hf64):
    """prompt + image, answer, observation + image, answer, observation + image, answer: one 55-token row."""
    images = [random_image(64, 64, 4), random_image(64, 96, 5), random_image(32, 64, 6)]
    turns = [5, "img", 4, 6, 3, "img", 3, 6, 3, "img", 2, 5]
    batch, *_ = _check_batch(pair, hf64, [turns], images, seed=4)
    assert batch.input_ids.shape[1] == 55


def _stacked(batches: list[HFBatch]) -> HFBatch:
    """Single-sequence batches as one right-padded transformers batch (images in row order)."""
    t = max(b.input_ids.shape[1] for b in batches)
    rows = lambda name: np.concatenate([_pad(getattr(b, name), (1, t)) for b in batches])  # noqa: E731
    with_images = [b for b in batches if b.pixel_values is not None]
    return HFBatch(rows("input_ids"), rows("attention_mask"), rows("mm_token_type_ids"),
                   np.concatenate([b.pixel_values for b in with_images]),
                   np.concatenate([b.image_grid_thw for b in with_images]))


def test_packed_segments_match_transformers_on_each_sequence_alone(pair, hf64):
    """Three sequences packed in row 0 (boundaries inside chunks of 16), two in row 1: each segment's logits and
    top-k experts are transformers' on that sequence alone, so no conv tap, recurrent state or attention crosses a
    segment boundary and routing is per token."""
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
    packed, routing = _forward(ours, jnp.asarray(tokens, jnp.int32), jnp.asarray(positions), jnp.asarray(seg), vis,
                               jnp.asarray(NO_REPLAY))
    packed = np.asarray(packed)
    ref = _hf_ref(hf64, _stacked(batches), output_router_logits=True)  # one row per sequence
    t_ref = ref.logits.shape[1]
    hf_ids = np.stack([torch.topk(x, K, dim=-1).indices.numpy().reshape(-1, t_ref, K) for x in ref.router_logits])
    for i, (row, lo, n) in enumerate(spans):
        assert np.abs(packed[row, lo : lo + n] - ref.logits.numpy()[i, :n]).max() <= TOL
        np.testing.assert_array_equal(np.sort(np.asarray(routing.topk_ids[:, row, lo : lo + n]), -1),
                                      np.sort(hf_ids[:, i, :n], -1))


# ----------------------------------------------------------------------------- config and HF import / export


def test_config_parses_transformers_dict_round_trips_and_rejects_what_it_does_not_model():
    from transformers import Qwen3_5MoeConfig as HFConfig

    cfg = from_hf_dict(HFConfig(**TINY_MOE).to_dict())
    t = cfg.text
    assert isinstance(cfg, Qwen3_5MoeConfig) and t.linear_layers == (0, 2, 3) and t.sparse_layers == (0, 1, 2, 3)
    assert (t.num_experts, t.num_experts_per_tok, t.moe_intermediate_size, t.shared_expert_intermediate_size) == (
        E, K, 40, 48)
    assert from_hf_dict(cfg.to_hf_dict()) == cfg
    assert HFConfig(**cfg.to_hf_dict()).text_config.shared_expert_intermediate_size == 48  # transformers reads ours
    base = cfg.to_hf_dict()
    for key, value in [("norm_topk_prob", False), ("mlp_only_layers", [1]), ("decoder_sparse_step", 2),
                       ("n_shared_experts", 2), ("routed_scaling_factor", 2.5), ("shared_expert_intermediate_size", 0),
                       ("num_experts_per_tok", 5)]:
        with pytest.raises(ConfigError, match=key):
            from_hf_dict(dict(base, text_config=dict(base["text_config"], **{key: value})))


def test_export_loads_in_transformers_and_reloads_bit_identical(pair, tmp_path):
    from transformers import Qwen3_5MoeForConditionalGeneration

    hf, ours = pair
    out = to_hf(ours, tmp_path / "export", dtype=jnp.float32)
    loaded = Qwen3_5MoeForConditionalGeneration.from_pretrained(out).eval()
    want, got = hf.state_dict(), loaded.state_dict()
    assert set(got) == set(want)
    for key, value in want.items():
        assert torch.equal(got[key], value), key
    again = from_hf(out)
    a, b = dict(nnx.to_flat_state(nnx.state(ours, nnx.Param))), dict(nnx.to_flat_state(nnx.state(again, nnx.Param)))
    assert set(a) == set(b)
    for path in a:
        np.testing.assert_array_equal(np.asarray(a[path].get_value()), np.asarray(b[path].get_value()), err_msg=str(path))


# ----------------------------------------------------------------------------- engine functions


STEPS = 5


@pytest.fixture(scope="module")
def generation(pair):
    """(a 22-token image prompt, the STEPS tokens transformers' `generate` greedily continues it with (fp32, its
    own cache)), shared by the engine tests."""
    batch = make_batch([[5, "img", 9]], [random_image(64, 96, 11)], seed=21)
    with torch.no_grad():
        out = pair[0].generate(**batch.torch_kwargs(), max_new_tokens=STEPS, do_sample=False)
    expected = out[0, batch.input_ids.shape[1]:].tolist()
    assert len(set(expected)) > 1, "degenerate reference: a wrong token would not show"
    return batch, expected


def test_prefill_and_greedy_decode_on_the_hybrid_cache_generate_as_transformers(pair, generation):
    """The image prompt prefilled into pages of 8 and the linear layers' state rows, then 5 greedy decode steps:
    the tokens of transformers' `generate`, the last step's logits those of the full forward of the sequence so
    far, and the experts recorded for every fed position the full forward's routers' choice."""
    _, ours = pair
    cfg = ours.cfg
    batch, expected = generation
    n, steps, pages, page = batch.input_ids.shape[1], STEPS, 16, 8
    positions, deltas = get_rope_index(batch.input_ids, batch.image_grid_thw, None, cfg)
    tokens = _pad(batch.input_ids, (1, 32))
    table = jnp.asarray([0, 1, 2, 3, 4] + [pages] * 3, jnp.int32)
    vis = _vision(cfg, batch.pixel_values, batch.image_grid_thw, tokens, None, bucket=32)
    cache = init_cache(cfg, pages, page, 2, jnp.float32)
    assert isinstance(cache, MoeHybridCache) and (np.asarray(cache.experts) == -1).all()
    cache, logits = _prefill(ours, cache, jnp.int32(1), table, jnp.int32(0), jnp.asarray(tokens, jnp.int32),
                             jnp.asarray(_pad(positions, (3, 1, 32))), jnp.int32(n), vis)
    generated = []
    for step in range(steps):
        token = int(np.argmax(np.asarray(logits).reshape(-1)))
        generated.append(token)
        cache, logits = _decode(ours, cache, jnp.asarray([1], jnp.int32), table[None], jnp.asarray([token], jnp.int32),
                                jnp.asarray([n + step], jnp.int32), jnp.asarray([int(deltas[0])], jnp.int32))
    assert generated == expected
    ids = np.asarray([batch.input_ids[0].tolist() + generated])  # the last step fed generated[-1]
    full, routing = _ours(ours, ids, np.ones_like(ids), batch.image_grid_thw, batch.pixel_values)
    np.testing.assert_allclose(np.asarray(logits)[0], full[0, ids.shape[1] - 1], atol=TOL, rtol=0)
    assert isinstance(ours, Qwen3_5Moe) and not np.asarray(cache.recurrent[0]).any()  # slot 0 untouched
    # Every fed position's experts, recorded by page (prefill, then each decode step's input token): the routers'
    # choice in the full forward of the same tokens, in every layer (linear and full attention).
    got = np.asarray(cache.routed_experts(table[:5], n + steps))
    assert got.shape == (n + steps, LAYERS, K)
    np.testing.assert_array_equal(np.sort(got, -1), _router_ids(routing, n + steps))


def _router_ids(routing, n: int, row: int = 0) -> np.ndarray:
    """The trainer forward's top-k ids of positions [0, n) of a row, [n, L, k], sorted within each top-k."""
    return np.sort(np.moveaxis(np.asarray(routing.topk_ids)[:, row, :n], 0, 1), -1)


@pytest.mark.parametrize(("tp", "ep"), [(2, 1), (2, 2)], ids=["tp2", "tp2_ep2"])
def test_engine_runner_at_tp2_and_with_experts_split_over_2_devices_generates_as_transformers_and_records_routing(
        pair, generation, tp, ep, monkeypatch):
    """The engine's runner (--tp-size 2, and --tp-size 2 --ep-size 2: each device holds 2 of the 4 experts; the
    shared expert is split as a dense MLP) prefills the image prompt and decodes 5 greedy tokens: those of
    transformers' `generate`, with the experts read back by page table the trainer router's on the same tokens.
    With ep, a second turn then continues the first from a snapshot of its linear layers' state, reusing its pages
    (the partly filled last one copied on write) and prefilling only the new observation: its experts are the
    first request's on the prefix and the trainer router's on the whole sequence."""
    _, ours = pair
    cfg = ours.cfg
    batch, expected = generation
    n, steps = batch.input_ids.shape[1], STEPS
    options = EngineOptions(max_batch=2, max_seq_len=64, min_prefill_bucket=32, min_kv_bucket=32, page_size=8,
                            min_patch_bucket=32, state_snapshots=1, tp_size=tp, ep_size=ep)
    placement = ReplicaPlacement(jax.devices()[:tp], ep_size=ep)
    state = placement.params(nnx.state(ours, nnx.Param))["layers"][0]["mlp"]
    # the routed experts split over ep devices (and their width over tp / ep); the shared expert over all tp
    assert state["gate_experts_edf"].get_value().shard_shape(ours.layers[0].mlp.gate_experts_edf.shape)[0] == E // ep
    assert state["shared"]["gate_kernel_df"].get_value().shard_shape((64, 48))[1] == 48 // tp
    traced = []  # the expert-parallel block really runs (not XLA gathering the split experts)
    real = expert_parallel._reduce_block
    monkeypatch.setattr(expert_parallel, "_reduce_block", lambda *a, **kw: traced.append(1) or real(*a, **kw))
    runner = ModelRunner(ours, options, (), placement=placement)
    assert runner.records_experts and runner.snapshot_rows == 1 and options.max_batch == 2
    positions, deltas = get_rope_index(batch.input_ids, batch.image_grid_thw, None, cfg)
    ints = np.zeros((len(IntRow), 1), np.int32)
    floats = np.zeros((len(FloatRow), 1), np.float32)
    floats[FloatRow.TOP_P] = 1.0  # temperature 0: greedy
    ints[IntRow.TOP_K] = -1
    pages = [0, 1, 2, 3]
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
    fed = n + steps - 1  # the last sampled token was never fed
    first = np.asarray([batch.input_ids[0].tolist() + generated])
    _, routing = _ours(ours, first, np.ones_like(first), batch.image_grid_thw, batch.pixel_values)
    got = runner.routed_experts(pages, fed)
    np.testing.assert_array_equal(np.sort(got, -1), _router_ids(routing, fed))
    if ep == 1:  # the second turn runs once (with ep: its programs differ from tp 2's in the experts' placement)
        return
    # Turn 2, in slot 1 (whose linear state was never written): the first request's state after its fed tokens kept
    # as a snapshot (row 2 = max_batch) and restored into slot 1; its 3 full pages shared, its 4th (2 positions
    # filled) copied into page 4; only the new tokens are computed, and its next token is the full forward's.
    runner.copy_state(0, 2)
    runner.copy_state(2, 1)
    runner.copy_page(3, 4)
    second = np.concatenate([first[0], [7, 30, 31, 32, 33, 8]]).astype(np.int64)
    pos2, _ = get_rope_index(second[None], batch.image_grid_thw, None, cfg)
    pages2 = [0, 1, 2, 4, 5]
    token2, _ = runner.prefill(1, pages2, second, pos2[:, 0], batch.pixel_values, batch.image_grid_thw, None,
                               ints[:, 0], floats[:, 0], start=fed)
    got2 = runner.routed_experts(pages2, len(second))
    np.testing.assert_array_equal(got2[:fed], got)
    full2, routing2 = _ours(ours, second[None], np.ones((1, len(second)), np.int64), batch.image_grid_thw,
                            batch.pixel_values)
    assert token2 == int(np.argmax(full2[0, len(second) - 1]))
    np.testing.assert_array_equal(np.sort(got2, -1), _router_ids(routing2, len(second)))
