"""Vision reuse (issue 47): a micro-batch encodes each distinct image once and gathers its features into every
sample showing it. The loss and every gradient equal the per-sample encoding (`vision_reuse=False`, the layout
before reuse) for each family's tower (Qwen3-VL with deepstack, Qwen2.5-VL's windows, Qwen3.5, Qwen3-VL-MoE),
on a batch where a GRPO group shares its prompt picture and a multi-turn sample shows an earlier turn's picture
again, and on one where a picture is split across micro-batches.

Precision: the comparisons run in float64 (`jax.enable_x64`): the reused and per-sample towers run programs of
different patch buckets, whose float32 reduction orders differ by ~1e-5 after the delta rule and deepstack sums,
which would hide a real 1e-5 discrepancy. Qwen3.5's Gated DeltaNet accumulates in at least float32
(`qwen3_5.accumulation_dtype`), so in float64 too: with a float32 rule its gradients agreed to float32 accuracy
only (1.04e-5 relative on `a_log`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl_vlm.batching import build_train_batch, image_key
from jaxrl_vlm.rl.train_step import policy_logprobs
from jaxrl_vlm.tiny import init_tiny_model, tiny_model_config
from rollout.sample import Sample, Status

BUCKETS = dict(seq_buckets=[64, 128], patch_buckets=[0, 64, 128, 256], aggregation="token_mean",
               aggregation_constant=None, overlong_policy="error")


def _picture(cfg, seed: int, grid=(1, 4, 4)) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.normal(size=(int(np.prod(grid)), cfg.vision.patch_dim)).astype(np.float32), np.array(grid, np.int64)


def _image_ids(cfg, grid) -> list[int]:
    return [cfg.vision_start_token_id] + [cfg.image_token_id] * (int(np.prod(grid)) // cfg.vision.merge_unit) + [
        cfg.vision_start_token_id + 1]


def _sample(cfg, group: int, index: int, prompt_images: list, turn_images: list, seed: int) -> Sample:
    """Prompt (its pictures, text), a model turn, then an observation with `turn_images` and a last model turn."""
    rng = np.random.default_rng(seed)
    text = lambda n: rng.integers(10, 900, size=n).tolist()  # noqa: E731
    s = Sample(group_index=group, index=index, prompt=[], label="")
    s.set_prompt_tokens(sum((_image_ids(cfg, g) for _, g in prompt_images), []) + text(4))
    n = 3 + index
    s.append_model_tokens(text(n), (-rng.uniform(0.1, 2.0, size=n)).tolist())
    s.append_observation_tokens(sum((_image_ids(cfg, g) for _, g in turn_images), []) + text(2))
    s.append_model_tokens(text(2), [-0.5, -0.3])
    images = prompt_images + turn_images
    if images:
        s.multimodal_train_inputs = {"pixel_values": np.concatenate([p for p, _ in images]),
                                     "image_grid_thw": np.stack([g for _, g in images])}
    s.reward = 1.0
    s.set_status(Status.COMPLETED)
    return s


def _shared_batch(cfg) -> list[Sample]:
    """A GRPO group of 4 sharing its prompt picture; a multi-turn group whose episodes share their first picture,
    one showing it again in a later turn; a text-only sample."""
    big = (1, 8, 8) if getattr(cfg.vision, "window_merged_side", None) else (1, 4, 4)  # Qwen2.5-VL: several windows per image
    prompt, first, later = _picture(cfg, 1, big), _picture(cfg, 2), _picture(cfg, 3)
    samples = [_sample(cfg, 0, i, [prompt], [], seed=i) for i in range(4)]
    samples += [_sample(cfg, 1, 0, [first], [later], seed=10), _sample(cfg, 1, 1, [first], [first], seed=11)]
    samples.append(_sample(cfg, 2, 0, [], [], seed=12))
    return samples


def _model(cfg):
    return init_tiny_model(cfg, seed=0, param_dtype=jnp.float64, compute_dtype=jnp.float64)


def _objective(model, batch, temperature: float = 1.0):
    """sum over micro-batches of the weighted log-probs (and entropy): the forward every loss and the old / reference
    log-probs read; its gradient reaches every tower parameter through the gathered features."""
    graphdef, params = nnx.split(model)
    arrays = jax.tree.map(lambda x: jnp.asarray(x, jnp.float64) if x.dtype == np.float32 else jnp.asarray(x), batch.arrays)

    def loss(params):
        def add_micro_batch(total, mb):  # a scan compiles the forward once, not once per micro-batch
            lp, ent = policy_logprobs(graphdef, params, mb, chunk_size=64, need_entropy=True, temperature=temperature)
            return total + jnp.sum(mb.token_weights * (lp + 0.1 * ent)), None

        return jax.lax.scan(add_micro_batch, jnp.zeros((), jnp.float64), arrays)[0]

    return jax.jit(jax.value_and_grad(loss))(params)


def _assert_same(cfg, reused, per_sample):
    with jax.enable_x64(True):
        model = _model(cfg)
        _compare(model, reused, per_sample, 1e-5)


def _compare(model, reused, per_sample, rtol: float):
    (loss_r, grads_r), (loss_p, grads_p) = _objective(model, reused), _objective(model, per_sample)
    assert float(loss_r) == pytest.approx(float(loss_p), rel=rtol)
    flat_r, flat_p = nnx.to_flat_state(grads_r), nnx.to_flat_state(grads_p)
    vision_moved = False
    for (path, g_r), (_, g_p) in zip(flat_r, flat_p):
        a, b = np.asarray(g_r.get_value()), np.asarray(g_p.get_value())
        scale = float(np.linalg.norm(b))  # relative to the leaf's gradient norm
        assert float(np.linalg.norm(a - b)) <= rtol * scale + 1e-12, path
        vision_moved |= path[0] == "visual" and scale > 1e-9
    assert vision_moved  # the tower's gradients are live, so they were compared


@pytest.mark.parametrize("arch", ["qwen3_vl", "qwen2_5_vl", "qwen3_5", "qwen3_vl_moe"])
def test_shared_pictures_give_the_per_sample_loss_and_gradients(arch):
    cfg = tiny_model_config(arch=arch)
    samples = _shared_batch(cfg)
    adv = np.linspace(-1, 1, len(samples))
    reused = build_train_batch(samples, adv, cfg, row_buckets=[8], micro_batch_rows=None, packing=True,
                               vision_reuse=True, **BUCKETS)
    per_sample = build_train_batch(samples, adv, cfg, row_buckets=[8], micro_batch_rows=None, packing=True,
                                   vision_reuse=False, **BUCKETS)
    # 8 image occurrences, 3 distinct pictures: the tower's patch bucket shrinks.
    assert (reused.layout.images, reused.layout.distinct_images) == (8, 3)
    assert per_sample.layout.distinct_images == per_sample.layout.images == 8
    assert reused.layout.real_patches < per_sample.layout.real_patches
    assert reused.shape_key[3] < per_sample.shape_key[3]
    _assert_same(cfg, reused, per_sample)


def test_a_picture_split_over_micro_batches_is_encoded_once_in_each():
    cfg = tiny_model_config(arch="qwen3_vl")
    samples = [s for s in _shared_batch(cfg) if s.group_index == 0 or s.index == 1]
    adv = np.linspace(-1, 1, len(samples))
    kw = dict(row_buckets=[2], micro_batch_rows=2, packing=False, **BUCKETS)  # two samples per micro-batch
    reused = build_train_batch(samples, adv, cfg, vision_reuse=True, **kw)
    per_sample = build_train_batch(samples, adv, cfg, vision_reuse=False, **kw)
    assert reused.shape_key[0] == 3
    # The group's picture sits in two micro-batches (encoded once in each); the sample showing its first picture
    # twice encodes it once.
    assert (reused.layout.images, reused.layout.distinct_images) == (6, 3)
    _assert_same(cfg, reused, per_sample)


def test_index_map_points_every_image_slot_at_its_pictures_rows():
    cfg = tiny_model_config(arch="qwen3_vl")
    samples = _shared_batch(cfg)
    batch = build_train_batch(samples, np.zeros(len(samples)), cfg, row_buckets=[8], micro_batch_rows=None,
                              packing=True, vision_reuse=True, **BUCKETS)
    a, v = batch.arrays, batch.arrays.vision
    k_n, r_n, t_n, p_n = batch.shape_key
    assert v.token_image_rows.shape == a.tokens.shape and v.token_image_rows.dtype == np.int32
    assert (v.image_token_index == r_n * t_n).all()  # the one-to-one scatter is unused
    merged = p_n // cfg.vision.merge_unit
    for k in range(k_n):
        rows, valid = v.token_image_rows[k], a.segment_ids[k] > 0
        is_image = (a.tokens[k] == cfg.image_token_id) & valid
        assert ((rows >= 0) == is_image).all() and (rows < merged).all()
        # Distinct pictures only: one attention frame per stored picture, no two with the same content.
        frames = v.patch_segment_ids[k]
        stored = [v.pixel_values[k][frames == f] for f in np.unique(frames[frames >= 0])]
        assert len({image_key(np.array([len(x)]), x) for x in stored}) == len(stored)
    assert sum(len(np.unique(f[f >= 0])) for f in v.patch_segment_ids) == batch.layout.distinct_images == 3
    # Each sample's image slots read, in order, the merged rows of its own pictures: the gathered patches equal
    # the sample's pixel values merge unit by merge unit (Qwen3-VL keeps row-major order).
    for p in batch.layout.placements:
        s = samples[p.sample_position]
        if not s.multimodal_train_inputs:
            continue
        rows = v.token_image_rows[p.micro_batch, p.row, p.offset : p.offset + p.length]
        rows = rows[rows >= 0]
        unit = cfg.vision.merge_unit
        patches = v.pixel_values[p.micro_batch].reshape(-1, unit, cfg.vision.patch_dim)[rows].reshape(-1, cfg.vision.patch_dim)
        np.testing.assert_array_equal(patches, s.multimodal_train_inputs["pixel_values"])


def test_reuse_off_is_the_per_sample_layout_and_reuse_keeps_a_group_together():
    cfg = tiny_model_config(arch="qwen3_vl")
    # 4 groups of 4, each sharing one 64-patch picture; micro-batches of 4 rows, one sample per row.
    samples = [_sample(cfg, g, i, [_picture(cfg, 100 + g, (1, 8, 8))], [], seed=10 * g + i)
               for g in range(4) for i in range(4)]
    adv = np.zeros(len(samples))
    kw = dict(row_buckets=[4], micro_batch_rows=4, packing=False, **{**BUCKETS, "patch_buckets": [0, 64, 128, 256]})
    off = build_train_batch(samples, adv, cfg, vision_reuse=False, **kw)
    assert off.arrays.vision.token_image_rows is None
    assert off.layout.real_patches == 16 * 64 and off.shape_key == (4, 4, 64, 256)
    on = build_train_batch(samples, adv, cfg, vision_reuse=True, **kw)
    assert on.shape_key == (4, 4, 64, 64)  # each micro-batch holds one group: one picture
    assert on.layout.padding_efficiency == off.layout.padding_efficiency
    for k in range(4):
        assert len({p.group_index for p in on.layout.placements if p.micro_batch == k}) == 1
    # The same samples, each once, and the same token slots: only which micro-batch holds which row changed.
    assert sorted(p.sample_position for p in on.layout.placements) == list(range(16))
    assert on.layout.slots == off.layout.slots
