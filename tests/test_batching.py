"""list[Sample] -> TrainBatch: every real token exactly once, aligned to its target, with its image patches,
its M-RoPE ids and its global aggregation weight, in shapes drawn only from the configured buckets.

References are independent of the batching code: the samples themselves (tokens, masks, log-probs,
pixel_values), `get_rope_index` on each sample alone (checked against transformers in test_rope.py),
the per-image vision helpers on each sample's own grid, and closed-form aggregation weights.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxrl_vlm.batching import (
    BatchingError,
    TrainBatch,
    build_train_batch,
    describe_shapes,
    micro_batch_bucket,
    pack_rows,
)
from jaxrl_vlm.models.config import Qwen3VLConfig, TextConfig, VisionConfig
from jaxrl_vlm.models.rope import get_rope_index, vision_pos_embed_interp, vision_rotary_positions
from jaxrl_vlm.rl.losses import LossConfig, LossInputs, check_loss_inputs
from rollout.sample import Sample

VISION_START, VISION_END, IMAGE, VIDEO = 250, 251, 252, 253

CFG = Qwen3VLConfig(
    text=TextConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, rope_theta=10000.0, mrope_section=(4, 2, 2),
    ),
    vision=VisionConfig(
        depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, num_position_embeddings=64,
        deepstack_visual_indexes=(0,), patch_size=4,  # patch_dim = 3 * 2 * 4 * 4 = 96
    ),
    image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=VISION_START, vision_end_token_id=VISION_END,
    bos_token_id=None, eos_token_id=None,
)
MERGE2 = CFG.vision.merge_unit
SEQ_BUCKETS = [32, 64, 128, 256]
ROW_BUCKETS = [1, 2, 4, 8]
PATCH_BUCKETS = [0, 64, 256, 1024]
AGGREGATIONS = ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"]


# ----------------------------------------------------------------------------- synthetic samples


def _image(rng: np.random.Generator) -> tuple[list[int], np.ndarray, np.ndarray]:
    """(vision_start, pads..., vision_end), grid [1, 3], pixel_values [h*w, patch_dim] (t = 1)."""
    h, w = (int(x) for x in rng.choice([2, 4, 6], size=2))
    pads = [VISION_START] + [IMAGE] * (h * w // MERGE2) + [VISION_END]
    return pads, np.array([[1, h, w]]), rng.normal(size=(h * w, CFG.vision.patch_dim)).astype(np.float32)


def _text(rng: np.random.Generator, n: int) -> list[int]:
    return [int(x) for x in rng.integers(1, 200, size=n)]


def make_sample(rng: np.random.Generator, group: int, index: int, *, max_turns: int = 3, image_rate: float = 0.5,
                max_tokens: int = 200) -> Sample:
    """A multi-turn episode: prompt (maybe with an image), model turns, observations (maybe with images)."""
    s = Sample(group_index=group, index=index)
    grids, pixels = [], []

    def segment_with_images(text_len: int) -> list[int]:
        ids = _text(rng, text_len)
        while rng.random() < image_rate:
            pads, g, p = _image(rng)
            ids += pads + _text(rng, int(rng.integers(0, 3)))
            grids.append(g)
            pixels.append(p)
        return ids

    s.set_prompt_tokens(segment_with_images(int(rng.integers(1, 8))))
    for turn in range(int(rng.integers(1, max_turns + 1))):
        n = int(rng.integers(1, 12))
        s.append_model_tokens(_text(rng, n), [float(-x) for x in rng.uniform(0.01, 3.0, size=n)])
        if turn < max_turns - 1 and rng.random() < 0.7 and len(s.tokens) < max_tokens:
            s.append_observation_tokens(segment_with_images(int(rng.integers(1, 5))))
    if grids:
        s.multimodal_train_inputs = {"pixel_values": np.concatenate(pixels), "image_grid_thw": np.concatenate(grids)}
        s.image_data = [f"image-{j}" for j in range(len(grids))]  # engine view; only its count matters here
    s.validate(image_token_id=IMAGE, vision_start_token_id=VISION_START, merge_size=CFG.vision.spatial_merge_size)
    return s


def make_batch_samples(seed: int, n: int, image_rate: float = 0.5) -> tuple[list[Sample], np.ndarray]:
    rng = np.random.default_rng(seed)
    samples, group, left = [], 0, 0
    for i in range(n):
        if left == 0:  # uneven group sizes, as after filtering
            group, left = group + 1, int(rng.integers(1, 5))
        samples.append(make_sample(rng, group, i, image_rate=image_rate))
        left -= 1
    return samples, rng.normal(size=n)


def build(samples: list[Sample], adv: np.ndarray, **overrides) -> TrainBatch:
    kw = dict(
        seq_buckets=SEQ_BUCKETS, row_buckets=ROW_BUCKETS, patch_buckets=PATCH_BUCKETS, packing=True,
        micro_batch_rows=None, row_multiple=1, aggregation="seq_mean_token_mean", aggregation_constant=None,
        overlong_policy="error",
    )
    kw.update(overrides)
    return build_train_batch(samples, adv, CFG, **kw)


# ----------------------------------------------------------------------------- independent per-sample views


def expected_aligned(sample: Sample, advantage: float) -> dict[str, np.ndarray]:
    """What slot j of the sample must hold: the values of token j+1 (0 after the last token)."""
    n, resp = len(sample.tokens), sample.response_length
    tokens = np.array(sample.tokens)
    full_mask = np.concatenate([np.zeros(n - resp), np.array(sample.loss_mask, float)])
    full_lp = np.concatenate([np.zeros(n - resp), np.array(sample.rollout_log_probs, float)])
    full_adv = np.concatenate([np.zeros(n - resp), np.full(resp, advantage)])

    def shifted(x: np.ndarray) -> np.ndarray:
        return np.append(x[1:], 0)

    return dict(targets=shifted(tokens), loss_mask=shifted(full_mask), rollout_logprobs=shifted(full_lp),
                advantages=shifted(full_adv))


def closed_form_weights(samples: list[Sample], mode: str, constant: float | None) -> list[np.ndarray]:
    """Aligned per-token weights of each sample from the definitions (global batch)."""
    masks = [expected_aligned(s, 0.0)["loss_mask"] for s in samples]
    total = sum(m.sum() for m in masks)
    n_seq = sum(1 for m in masks if m.sum() > 0)
    out = []
    for m in masks:
        if mode == "token_mean":
            out.append(m / total)
        elif mode == "seq_mean_token_mean":
            out.append(m / (n_seq * m.sum()) if m.sum() else m)
        else:
            out.append(m / (n_seq * constant))
    return out


def image_patches_of(batch: TrainBatch, p) -> np.ndarray:
    """Patch rows the device will merge into this placement's image-token slots, in slot order."""
    a = batch.arrays
    _, _, t_n = a.tokens.shape
    span = a.tokens[p.micro_batch, p.row, p.offset : p.offset + p.length]
    slots = p.row * t_n + p.offset + np.flatnonzero(span == IMAGE)
    index = a.vision.image_token_index[p.micro_batch]
    where = {int(slot): m for m, slot in enumerate(index) if slot < a.tokens[0].size}  # R*T = padding entry
    rows = [a.vision.pixel_values[p.micro_batch, where[int(s)] * MERGE2 : (where[int(s)] + 1) * MERGE2] for s in slots]
    return np.concatenate(rows) if rows else np.zeros((0, CFG.vision.patch_dim), np.float32)


def check_batch(batch: TrainBatch, samples: list[Sample], adv: np.ndarray, *, aggregation: str,
                constant: float | None, packing: bool, row_multiple: int, micro_batch_rows: int | None) -> None:
    """Every contract of the TrainBatch, checked against the samples."""
    a, lay = batch.arrays, batch.layout
    k_n, r_n, t_n = a.tokens.shape
    # Shapes come from the buckets.
    assert lay.shape_key[:3] == (k_n, r_n, t_n)
    assert t_n in SEQ_BUCKETS and r_n % row_multiple == 0
    assert (r_n == micro_batch_rows) if micro_batch_rows else (r_n in ROW_BUCKETS)
    assert k_n == micro_batch_bucket(k_n)
    for name in ("targets", "segment_ids", "loss_mask", "rollout_logprobs", "advantages", "token_weights", "sequence_ids"):
        assert getattr(a, name).shape == (k_n, r_n, t_n), name
    assert a.positions.shape == (k_n, 3, r_n, t_n)
    assert a.tokens.dtype == a.targets.dtype == a.positions.dtype == a.segment_ids.dtype == a.sequence_ids.dtype == np.int32
    assert a.loss_mask.dtype == a.token_weights.dtype == a.advantages.dtype == a.rollout_logprobs.dtype == np.float32
    has_images = any((s.multimodal_train_inputs or {}).get("image_grid_thw") is not None for s in samples)
    assert (a.vision is not None) == has_images
    if has_images:
        assert lay.shape_key[3] in PATCH_BUCKETS and a.vision.pixel_values.shape[:2] == (k_n, lay.shape_key[3])
        assert a.vision.image_token_index.shape == (k_n, lay.shape_key[3] // MERGE2)

    # Every real token exactly once: placements tile exactly the non-padding slots.
    cover = np.zeros((k_n, r_n, t_n), int)
    for p in lay.placements:
        cover[p.micro_batch, p.row, p.offset : p.offset + p.length] += 1
    assert cover.max() <= 1
    np.testing.assert_array_equal(cover > 0, a.segment_ids > 0)
    assert lay.real_tokens == sum(len(s.tokens) for s in samples) == int((a.segment_ids > 0).sum())
    assert lay.slots == k_n * r_n * t_n
    pad = a.segment_ids == 0
    for name in ("tokens", "targets", "loss_mask", "rollout_logprobs", "advantages", "token_weights"):
        assert not getattr(a, name)[pad].any(), f"{name} nonzero on padding"
    assert (a.sequence_ids[pad] == -1).all()
    if not packing:
        assert all(p.offset == 0 and p.segment_id == 1 for p in lay.placements)

    weights = closed_form_weights(samples, aggregation, constant)
    seen_segments: set[tuple[int, int, int]] = set()
    for p in lay.placements:
        s = samples[p.sample_position]
        assert (p.group_index, p.index) == (s.group_index, s.index) and p.length == p.original_length == len(s.tokens)
        sl = (p.micro_batch, slice(None), p.row, slice(p.offset, p.offset + p.length))
        view = lambda x: x[p.micro_batch, p.row, p.offset : p.offset + p.length]  # noqa: E731
        np.testing.assert_array_equal(view(a.tokens), s.tokens)
        want = expected_aligned(s, float(adv[p.sample_position]))
        np.testing.assert_array_equal(view(a.targets), want["targets"])
        np.testing.assert_array_equal(view(a.loss_mask), want["loss_mask"])
        np.testing.assert_allclose(view(a.rollout_logprobs), want["rollout_logprobs"], rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(view(a.advantages), want["advantages"], rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(view(a.token_weights), weights[p.sample_position], rtol=1e-5, atol=1e-9)
        assert set(view(a.segment_ids).tolist()) == {p.segment_id}
        assert set(view(a.sequence_ids).tolist()) == {p.sequence_id}
        assert (p.micro_batch, p.row, p.segment_id) not in seen_segments
        seen_segments.add((p.micro_batch, p.row, p.segment_id))
        # M-RoPE ids of the segment = the model's position function on the sample alone.
        grid = (s.multimodal_train_inputs or {}).get("image_grid_thw")
        alone, _ = get_rope_index(np.array([s.tokens]), grid, None, CFG)
        np.testing.assert_array_equal(a.positions[sl], alone[:, 0])
        # Image patches line up with image tokens; per-patch geometry is the sample's own.
        if grid is not None:
            pixels = s.multimodal_train_inputs["pixel_values"]
            np.testing.assert_array_equal(image_patches_of(batch, p), pixels)
            v = a.vision
            mine = slice(p.patch_offset, p.patch_offset + p.num_patches)
            np.testing.assert_array_equal(v.pixel_values[p.micro_batch, mine], pixels)
            np.testing.assert_array_equal(v.patch_rotary_pos[p.micro_batch, mine], vision_rotary_positions(grid, 2))
            idx, w = vision_pos_embed_interp(grid, CFG.vision.num_position_embeddings, 2)
            np.testing.assert_array_equal(v.pos_interp_idx[p.micro_batch, mine], idx)
            np.testing.assert_array_equal(v.pos_interp_w[p.micro_batch, mine], w)
            frames = v.patch_segment_ids[p.micro_batch, mine]
            sizes = np.repeat(grid[:, 1] * grid[:, 2], grid[:, 0])
            # one attention block per frame: ids change exactly at frame boundaries
            assert len(np.unique(frames)) == len(sizes)
            np.testing.assert_array_equal(np.diff(frames) != 0, np.isin(np.arange(1, frames.size), np.cumsum(sizes)[:-1]))

    # Per micro-batch: ids in [0, n_k), unique per sequence; the loss's own input check passes.
    for k in range(k_n):
        n_k = lay.sequences_per_micro_batch[k]
        ids = a.sequence_ids[k][a.sequence_ids[k] >= 0]
        assert set(ids.tolist()) == set(range(n_k))
        if has_images:
            v = a.vision
            valid = v.image_token_index[k] < r_n * t_n
            assert valid.sum() * MERGE2 == (v.patch_segment_ids[k] >= 0).sum()
            padding = v.patch_segment_ids[k] < 0
            assert not v.pixel_values[k][padding].any() and not v.pos_interp_w[k][padding].any()
        zeros = np.zeros((r_n, t_n), np.float32)
        inputs = LossInputs(zeros, zeros, a.advantages[k], a.loss_mask[k], a.sequence_ids[k], a.token_weights[k],
                            rollout_logprobs=a.rollout_logprobs[k])
        check_loss_inputs(inputs, LossConfig(num_sequences=lay.max_sequences_per_micro_batch,
                                             aggregation=aggregation, aggregation_constant=constant))
    if aggregation != "seq_mean_token_sum_norm" and a.loss_mask.any():
        assert abs(float(a.token_weights.astype(np.float64).sum()) - 1.0) < 1e-5


# ----------------------------------------------------------------------------- property test


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**31 - 1),
    n=st.integers(1, 14),
    packing=st.booleans(),
    micro_batch_rows=st.sampled_from([None, 1, 2, 4]),
    row_multiple=st.sampled_from([1, 2]),
    aggregation=st.sampled_from(AGGREGATIONS),
    image_rate=st.sampled_from([0.0, 0.4, 0.7]),
)
def test_every_token_once_with_its_values_images_and_positions(seed, n, packing, micro_batch_rows, row_multiple,
                                                               aggregation, image_rate):
    if micro_batch_rows is not None and micro_batch_rows % row_multiple:
        micro_batch_rows *= row_multiple
    samples, adv = make_batch_samples(seed, n, image_rate)
    constant = 50.0 if aggregation == "seq_mean_token_sum_norm" else None
    batch = build(samples, adv, packing=packing, micro_batch_rows=micro_batch_rows, row_multiple=row_multiple,
                  aggregation=aggregation, aggregation_constant=constant)
    check_batch(batch, samples, adv, aggregation=aggregation, constant=constant, packing=packing,
                row_multiple=row_multiple, micro_batch_rows=micro_batch_rows)


# ----------------------------------------------------------------------------- alignment by hand


def test_alignment_of_one_text_sample_by_hand():
    s = Sample(group_index=3, index=7)
    s.set_prompt_tokens([10, 11])
    s.append_model_tokens([12], [-0.5])
    s.append_observation_tokens([13])
    s.append_model_tokens([14], [-0.25])
    batch = build([s], np.array([2.0]), aggregation="token_mean")
    a = batch.arrays
    assert batch.shape_key == (1, 1, 32, 0) and a.vision is None
    row = lambda x: x[0, 0, :6].tolist()  # noqa: E731
    assert row(a.tokens) == [10, 11, 12, 13, 14, 0]
    assert row(a.targets) == [11, 12, 13, 14, 0, 0]
    assert row(a.loss_mask) == [0, 1, 0, 1, 0, 0]
    assert row(a.rollout_logprobs) == [0, -0.5, 0, -0.25, 0, 0]
    assert row(a.advantages) == [0, 2, 2, 2, 0, 0]  # response targets 12, 13, 14
    assert row(a.token_weights) == [0, 0.5, 0, 0.5, 0, 0]
    assert row(a.segment_ids) == [1, 1, 1, 1, 1, 0]
    assert row(a.sequence_ids) == [0, 0, 0, 0, 0, -1]
    assert a.positions[0, :, 0, :6].tolist() == [[0, 1, 2, 3, 4, 0]] * 3
    assert batch.layout.real_tokens == 5 and batch.layout.padding_efficiency == 5 / 32


# ----------------------------------------------------------------------------- aggregation under splitting


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_micro_batch_splitting_keeps_global_weights(aggregation):
    samples, adv = make_batch_samples(11, 12)
    constant = 64.0 if aggregation == "seq_mean_token_sum_norm" else None
    whole = build(samples, adv, aggregation=aggregation, aggregation_constant=constant, row_buckets=[64])
    split = build(samples, adv, aggregation=aggregation, aggregation_constant=constant, micro_batch_rows=1)
    assert whole.shape_key[0] == 1 and split.shape_key[0] > 1
    want = closed_form_weights(samples, aggregation, constant)
    for batch in (whole, split):
        per_sample = [batch.arrays.token_weights[p.micro_batch, p.row, p.offset : p.offset + p.length]
                      for p in batch.layout.placements]
        for got, ref in zip(per_sample, want):
            np.testing.assert_allclose(got, ref, rtol=1e-6)
    total = lambda b: float(b.arrays.token_weights.astype(np.float64).sum())  # noqa: E731
    assert total(whole) == pytest.approx(total(split), abs=1e-6)
    if aggregation != "seq_mean_token_sum_norm":
        assert total(split) == pytest.approx(1.0, abs=1e-5)
    mb_sums = split.arrays.token_weights.astype(np.float64).sum(axis=(1, 2))
    assert (mb_sums >= 0).all() and mb_sums.sum() == pytest.approx(total(whole), abs=1e-6)


# ----------------------------------------------------------------------------- overlong policy


def _long_sample(prompt_len: int, image_at: int | None = None, response_len: int = 40) -> Sample:
    rng = np.random.default_rng(prompt_len)
    s = Sample(group_index=5, index=2)
    prompt = _text(rng, prompt_len)
    grids, pixels = [], []
    if image_at is not None:
        pads = [VISION_START] + [IMAGE] * 9 + [VISION_END]  # a 6x6-patch image: 9 merged tokens
        g, p = np.array([[1, 6, 6]]), rng.normal(size=(36, CFG.vision.patch_dim)).astype(np.float32)
        prompt = prompt[:image_at] + pads + prompt[image_at:]
        grids.append(g)
        pixels.append(p)
    s.set_prompt_tokens(prompt)
    s.append_model_tokens(_text(rng, response_len), [-0.1] * response_len)
    if grids:
        s.multimodal_train_inputs = {"pixel_values": np.concatenate(pixels), "image_grid_thw": np.concatenate(grids)}
    return s


def test_overlong_error_names_sample_and_lengths():
    s = _long_sample(30, response_len=40)  # 70 tokens > largest bucket 64
    with pytest.raises(BatchingError, match=r"group=5, index=2.*70 tokens \(prompt 30, response 40\).*64"):
        build([s], np.array([1.0]), seq_buckets=[32, 64])


def test_overlong_truncate_cuts_the_tail_and_records_it():
    s = _long_sample(30, response_len=40)
    batch = build([s], np.array([1.0]), seq_buckets=[32, 64], overlong_policy="truncate", aggregation="token_mean")
    (p,) = batch.layout.truncated
    assert (p.length, p.original_length, batch.shape_key[2]) == (64, 70, 64)
    a = batch.arrays
    np.testing.assert_array_equal(a.tokens[0, 0], s.tokens[:64])
    # Response tokens 30..63 stay; slot 63 has no target inside the kept sequence.
    np.testing.assert_array_equal(a.loss_mask[0, 0], np.r_[np.zeros(29), np.ones(34), 0.0])
    assert a.targets[0, 0, 63] == 0 and a.targets[0, 0, 62] == s.tokens[63]
    assert a.token_weights.sum() == pytest.approx(1.0)


def test_truncate_never_splits_an_image():
    # Image pads occupy tokens 51..59 (vision_start at 50); a cut at 56 would split it.
    s = _long_sample(50, image_at=50, response_len=5)
    s56 = build([s], np.array([1.0]), seq_buckets=[56], overlong_policy="truncate", patch_buckets=[0, 64])
    (p,) = s56.layout.truncated
    assert p.length == 51 and p.num_patches == 0 and s56.arrays.vision is None  # cut right before the first pad
    # With room for the whole image it is kept, patches and all.
    s62 = build([s], np.array([1.0]), seq_buckets=[62], overlong_policy="truncate", patch_buckets=[0, 64])
    (p,) = s62.layout.truncated
    assert p.length == 62 and p.num_patches == 36
    v = s62.arrays.vision
    np.testing.assert_array_equal(v.pixel_values[0, :36], s.multimodal_train_inputs["pixel_values"])
    alone, _ = get_rope_index(np.array([s.tokens[:62]]), s.multimodal_train_inputs["image_grid_thw"], None, CFG)
    np.testing.assert_array_equal(s62.arrays.positions[0, :, 0, :62], alone[:, 0])


# ----------------------------------------------------------------------------- buckets and packing


def test_packing_fills_rows_and_padding_keeps_one_sample_per_row():
    samples = []
    for i, n in enumerate([20, 12, 20, 12, 8, 24]):  # pairs to 32 exactly: 20+12, 20+12, 24+8
        s = Sample(group_index=i, index=i)
        s.set_prompt_tokens(list(range(1, n - 1)))
        s.append_model_tokens([7, 8], [-1.0, -1.0])
        samples.append(s)
    adv = np.zeros(len(samples))
    packed = build(samples, adv, seq_buckets=[32], row_buckets=[1, 2, 4, 8])
    plain = build(samples, adv, seq_buckets=[32], row_buckets=[1, 2, 4, 8], packing=False)
    assert packed.layout.rows_used == 3 and packed.shape_key == (1, 4, 32, 0)
    assert plain.layout.rows_used == 6 and plain.shape_key == (1, 8, 32, 0)
    assert packed.layout.padding_efficiency == pytest.approx(96 / 128)
    assert plain.layout.padding_efficiency == pytest.approx(96 / 256)


def test_row_multiple_and_fixed_micro_batch_rows():
    samples, adv = make_batch_samples(5, 9, image_rate=0.0)
    b = build(samples, adv, row_multiple=4, row_buckets=[1, 2, 3, 4, 8, 12])
    assert b.shape_key[1] in (4, 8, 12)
    b = build(samples, adv, micro_batch_rows=2, row_multiple=2, packing=False)
    assert b.shape_key[1] == 2 and b.shape_key[0] == micro_batch_bucket(9 // 2 + 1)
    with pytest.raises(BatchingError, match="micro_batch_rows=3 must be a positive multiple of row_multiple=2"):
        build(samples, adv, micro_batch_rows=3, row_multiple=2)
    with pytest.raises(BatchingError, match="no row bucket"):
        build(samples, adv, row_buckets=[1, 3], row_multiple=2)


@pytest.mark.parametrize("budget", [64, 128, 256, 10_000])
def test_token_budget_per_micro_batch_bounds_rows_times_length(budget):
    """slime's --use-dynamic-batch-size --max-tokens-per-gpu: R x T <= budget, every token still placed once."""
    samples, adv = make_batch_samples(21, 14)
    batch = build(samples, adv, max_tokens_per_micro_batch=budget)
    k, r, t = batch.shape_key[:3]
    assert r * t <= max(budget, ROW_BUCKETS[0] * t)
    check_batch(batch, samples, adv, aggregation="seq_mean_token_mean", constant=None, packing=True, row_multiple=1,
                micro_batch_rows=None)
    unlimited = build(samples, adv)
    if budget < unlimited.shape_key[1] * unlimited.shape_key[2]:
        assert k > unlimited.shape_key[0], "a tighter budget must spread the rows over more micro-batches"
    # With data-parallel shards the budget is per device: rows per shard x T stays within budget / shards.
    sharded = build(samples, adv, row_multiple=2, row_buckets=[2, 4, 8], max_tokens_per_micro_batch=2 * 64)
    assert sharded.shape_key[1] // 2 * sharded.shape_key[2] <= max(64, sharded.shape_key[2])


def test_explicit_micro_batch_buckets():
    samples, adv = make_batch_samples(5, 9, image_rate=0.0)
    b = build(samples, adv, micro_batch_rows=1, packing=False, micro_batch_buckets=[4, 16])
    assert b.shape_key[0] == 16
    with pytest.raises(BatchingError, match="more than the largest of micro_batch_buckets"):
        build(samples, adv, micro_batch_rows=1, packing=False, micro_batch_buckets=[2, 4])


def test_patch_capacity_spreads_images_over_micro_batches():
    samples = []
    for i in range(4):  # 4 samples x 36 patches, at most 64 patches per micro-batch
        s = _long_sample(10, image_at=5, response_len=3)
        s.index = i
        samples.append(s)
    b = build(samples, np.zeros(4), patch_buckets=[0, 64], row_buckets=[1, 2, 4, 8])
    assert b.shape_key[3] == 64 and b.shape_key[0] >= 3
    assert max(b.arrays.vision.patch_segment_ids[k].max() for k in range(b.shape_key[0])) == 0  # one image each
    check_batch(b, samples, np.zeros(4), aggregation="seq_mean_token_mean", constant=None, packing=True,
                row_multiple=1, micro_batch_rows=None)


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(patch_buckets=[0, 30]), "patch bucket 30 is not a multiple of spatial_merge_size\\*\\*2=4"),
        (dict(patch_buckets=[0, 16]), "36 image patches, more than the largest patch bucket 16"),
        (dict(seq_buckets=[64, 32]), "seq_buckets must be a non-empty strictly increasing"),
        (dict(overlong_policy="drop"), "overlong_policy must be one of"),
        (dict(aggregation="seq_mean_token_sum_norm"), "needs a constant > 0"),
    ],
)
def test_bad_configuration_is_named(change, message):
    s = _long_sample(10, image_at=5, response_len=3)
    with pytest.raises((BatchingError, ValueError), match=message):
        build([s], np.zeros(1), **change)


def test_bad_samples_are_named():
    s = _long_sample(10, image_at=5, response_len=3)
    s.multimodal_train_inputs["image_grid_thw"] = np.array([[1, 4, 4]])
    with pytest.raises(BatchingError, match=r"group=5, index=2.*9 image-pad tokens.*gives 4 merged tokens"):
        build([s], np.zeros(1))
    s = _long_sample(10, image_at=5, response_len=3)
    s.multimodal_train_inputs = None
    with pytest.raises(BatchingError, match="9 image-pad tokens but no multimodal_train_inputs"):
        build([s], np.zeros(1))
    s = _long_sample(10, response_len=3)
    with pytest.raises(BatchingError, match=r"advantages must have shape \(1,\)"):
        build([s], np.zeros(2))
    s.loss_mask = s.loss_mask[:-1]
    with pytest.raises(BatchingError, match="loss_mask has 2 and rollout_log_probs 3 entries"):
        build([s], np.zeros(1))


def test_no_images_means_no_vision_inputs_and_mixed_batches_work():
    text_only, adv = make_batch_samples(2, 5, image_rate=0.0)
    assert build(text_only, adv).arrays.vision is None
    rng = np.random.default_rng(9)
    mixed = text_only + [make_sample(rng, 99, 100 + i, image_rate=0.9) for i in range(3)]
    adv = np.r_[adv, np.ones(3)]
    b = build(mixed, adv, micro_batch_rows=1)
    assert b.arrays.vision is not None
    check_batch(b, mixed, adv, aggregation="seq_mean_token_mean", constant=None, packing=True, row_multiple=1,
                micro_batch_rows=1)


@given(lengths=st.lists(st.integers(1, 64), min_size=1, max_size=60), capacity=st.sampled_from([64, 100]))
@settings(max_examples=60, deadline=None)
def test_pack_rows_places_each_item_once_within_capacity(lengths, capacity):
    lengths = np.array(lengths)
    rows = pack_rows(lengths, np.zeros_like(lengths), capacity, 0)
    assert sorted(i for r in rows for i in r) == list(range(len(lengths)))
    assert all(lengths[r].sum() <= capacity for r in rows)
    # Any-fit packing never opens a row while an item still fits an open one, so at most one row is at most
    # half full (the bound 11/9 OPT + 1 needs the true OPT, which total/capacity only bounds from below).
    loads = [int(lengths[r].sum()) for r in rows]
    assert sum(load * 2 <= capacity for load in loads) <= 1, loads
    assert len(rows) < 2 * lengths.sum() / capacity + 1


def test_micro_batch_bucket_ladder():
    values = sorted({micro_batch_bucket(n) for n in range(1, 100)})
    assert values == list(range(1, 17)) + list(range(18, 33, 2)) + list(range(36, 65, 4)) + list(range(72, 105, 8))
    for n in range(1, 2000):
        b = micro_batch_bucket(n)
        assert n <= b < 1.125 * n + 1 and micro_batch_bucket(b) == b  # at most 1/9 of the micro-batches are padding


def test_describe_shapes_counts_programs():
    samples, adv = make_batch_samples(4, 6, image_rate=0.0)
    batches = [build(samples, adv), build(samples, adv), build(samples, adv, packing=False, micro_batch_rows=1)]
    shapes = describe_shapes(batches)
    assert batches[2].shape_key == (6, 1, 32, 0) != batches[0].shape_key
    assert shapes == {batches[0].shape_key: 2, batches[2].shape_key: 1}


def test_bench_script_runs_and_packing_beats_padding(capsys):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "scripts" / "bench_batching.py"
    spec = importlib.util.spec_from_file_location("bench_batching", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    args = ["--samples", "24", "--steps", "2", "--micro-batch-rows", "2"]
    bench.main(args)
    out = capsys.readouterr().out
    assert "packing" in out and "padding" in out and "ratio" in out
    results = bench.run(bench.argparse.Namespace(
        samples=24, group_size=8, steps=2, seed=1, seq_buckets=[1024, 2048, 4096, 8192, 16384],
        row_buckets=[1, 2, 4], micro_batch_rows=2, row_multiple=2, patch_buckets=[0, 4096, 8192, 16384, 32768]))
    for packed, plain in zip(results["packing"], results["padding"]):
        assert packed.layout.real_tokens == plain.layout.real_tokens
        assert packed.layout.padding_efficiency > plain.layout.padding_efficiency


def test_batching_is_host_only_and_imports_no_jax():
    import subprocess
    import sys

    code = "import sys, jaxrl_vlm.batching, jaxrl_vlm.rl.advantages; assert 'jax' not in sys.modules, 'jax imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
