"""Clips in the model, against transformers' own video path: M-RoPE positions (`get_rope_index`) and logits.

A clip reaches the model as the processor gives it (`pixel_values_videos`, one `video_grid_thw` row per clip) and
as the chat template lays it out: Qwen3-VL and Qwen3.5 write a timestamp (text) before every frame group, each
group between vision_start and vision_end; Qwen2.5-VL keeps the clip in one run and spaces its temporal positions
by tokens_per_second x `second_per_grid_ts`. The pixels here are random patches of the processor's layout (the
model's parity does not depend on where they came from). Checked per family, fp32 logits within 1e-4 of
transformers' (Qwen3.5: of its float64 run, as in test_qwen3_5.py): a clip in the prompt, and an episode with a
picture in the prompt and a clip in a later observation, in a right-padded batch of two; and the trainer's packed
batches of clip episodes (`build_train_batch`, vision reuse on and off), truncation and the refusals of clip inputs
that do not match their tokens.
"""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from _hf_tiny import VOCAB_SPECIALS, build_hf_model, save_hf_model
from _hf_tiny_qwen3_5 import build_hf_qwen3_5
from flax import nnx
from test_qwen3_5_moe import build_hf_qwen3_5_moe
from test_qwen3_vl_moe import build_hf_moe

from jaxrl_vlm.batching import BatchingError, build_train_batch
from jaxrl_vlm.models import (Qwen25VLConfig, build_vision_inputs, from_hf, from_hf_dict, get_rope_index,
                              get_rope_index_packed)
from jaxrl_vlm.models.rope import split_video_grids
from rollout.sample import Sample

TOL = 1e-4
B_FIX, T_FIX, PATCH_BUCKET = 2, 96, 160  # one shape: each family compiles one program
START, END, IMG, VID = (VOCAB_SPECIALS[k] for k in ("vision_start_token_id", "vision_end_token_id", "image_token_id",
                                                    "video_token_id"))


@nnx.jit
def _logits(model, tokens, positions, segment_ids, vision):
    return model.logits(model(tokens, positions, segment_ids, vision))


# Every shipped family: Qwen3-VL (config A), Qwen2.5-VL (Q25A), Qwen3.5, and the two MoE families.
BUILDERS = {"qwen3_vl": lambda: build_hf_model("A"), "qwen2_5_vl": lambda: build_hf_model("Q25A"),
            "qwen3_5": build_hf_qwen3_5, "qwen3_vl_moe": build_hf_moe, "qwen3_5_moe": build_hf_qwen3_5_moe}
FLOAT64_REFERENCE = {"qwen3_5", "qwen3_5_moe"}  # transformers' own fp32 round-off is near 1e-4 there


@pytest.fixture(scope="module", params=list(BUILDERS))
def pair(request, tmp_path_factory):
    """(transformers model, the reference to compare logits with, our model from its save_pretrained directory)."""
    hf = BUILDERS[request.param]()
    ours = from_hf(save_hf_model(hf, tmp_path_factory.mktemp(f"video_{request.param}")))
    ref = hf
    if request.param in FLOAT64_REFERENCE:
        ref = copy.deepcopy(hf).double()
        if request.param == "qwen3_5_moe":
            ref.set_experts_implementation("eager")  # its grouped-GEMM path is fp32/bf16 only
    return hf, ref, ours


@dataclass
class Episode:
    input_ids: np.ndarray  # [B, T], right-padded
    attention_mask: np.ndarray
    pixel_values: np.ndarray | None
    image_grid_thw: np.ndarray | None
    pixel_values_videos: np.ndarray
    video_grid_thw: np.ndarray
    second_per_grid_ts: np.ndarray | None

    def torch_kwargs(self, dtype: torch.dtype) -> dict:
        mm = (self.input_ids == IMG) * 1 + (self.input_ids == VID) * 2
        kw = dict(input_ids=torch.from_numpy(self.input_ids), attention_mask=torch.from_numpy(self.attention_mask),
                  mm_token_type_ids=torch.from_numpy(mm * self.attention_mask),
                  pixel_values_videos=torch.from_numpy(self.pixel_values_videos).to(dtype),
                  video_grid_thw=torch.from_numpy(self.video_grid_thw))
        if self.pixel_values is not None:
            kw.update(pixel_values=torch.from_numpy(self.pixel_values).to(dtype),
                      image_grid_thw=torch.from_numpy(self.image_grid_thw))
        if self.second_per_grid_ts is not None:
            kw["second_per_grid_ts"] = torch.from_numpy(self.second_per_grid_ts)
        return kw


def _episode(cfg, rows: list[list], clips: list[tuple[int, int, int]], pictures: list[tuple[int, int]],
             seed: int) -> Episode:
    """rows: per sequence, items: an int n = n random text tokens, "clip" = the next clip laid out as the family's
    template lays it out (a 2-token timestamp before each frame group where the family writes them), "img" = the
    next picture. Clips are (t, h, w) grids; pictures (h, w) grids (t = 1)."""
    rng = np.random.RandomState(seed)
    merge = cfg.vision.spatial_merge_size
    qwen25 = isinstance(cfg, Qwen25VLConfig)
    clip_grid = np.array(clips, np.int64).reshape(-1, 3)
    pic_grid = np.array([(1, h, w) for h, w in pictures], np.int64).reshape(-1, 3)
    seqs, c, p = [], 0, 0
    for row in rows:
        ids: list[int] = []
        for item in row:
            if item == "clip":
                t, h, w = clip_grid[c]
                c += 1
                if qwen25:
                    ids += [START] + [VID] * int(t * h * w // merge**2) + [END]
                else:
                    for _ in range(t):
                        ids += rng.randint(0, 200, size=2).tolist() + [START] + [VID] * int(h * w // merge**2) + [END]
            elif item == "img":
                _, h, w = pic_grid[p]
                p += 1
                ids += [START] + [IMG] * int(h * w // merge**2) + [END]
            else:
                ids += rng.randint(0, 200, size=int(item)).tolist()
        seqs.append(ids)
    width = max(map(len, seqs))
    input_ids = np.zeros((len(seqs), width), np.int64)
    mask = np.zeros_like(input_ids)
    for b, s in enumerate(seqs):
        input_ids[b, : len(s)], mask[b, : len(s)] = s, 1

    def patches(grid: np.ndarray) -> np.ndarray:
        return rng.randn(int(grid.prod(-1).sum()), cfg.vision.patch_dim).astype(np.float32)

    seconds = np.round(rng.uniform(0.3, 1.7, len(clip_grid)), 2).astype(np.float32) if qwen25 else None
    return Episode(input_ids, mask, patches(pic_grid) if len(pic_grid) else None, pic_grid if len(pic_grid) else None,
                   patches(clip_grid), clip_grid, seconds)


def _ours(model, ep: Episode) -> np.ndarray:
    cfg = model.cfg
    b, t = ep.input_ids.shape
    ids = np.zeros((B_FIX, T_FIX), np.int64)
    mask = np.zeros((B_FIX, T_FIX), np.int64)
    ids[:b, :t], mask[:b, :t] = ep.input_ids, ep.attention_mask
    positions, _ = get_rope_index(ids, ep.image_grid_thw, mask, cfg, video_grid_thw=ep.video_grid_thw,
                                  second_per_grid_ts=ep.second_per_grid_ts)
    pixels = ep.pixel_values if ep.pixel_values is not None else np.zeros((0, cfg.vision.patch_dim), np.float32)
    grid = ep.image_grid_thw if ep.image_grid_thw is not None else np.zeros((0, 3), np.int64)
    vis = build_vision_inputs(pixels, grid, ids, cfg, patch_bucket=PATCH_BUCKET, token_valid=mask,
                              pixel_values_videos=ep.pixel_values_videos, video_grid_thw=ep.video_grid_thw)
    out = _logits(model, jnp.asarray(ids, jnp.int32), jnp.asarray(positions), jnp.asarray(mask, jnp.int32), vis)
    return np.asarray(out)[:b, :t]


def _hf_positions(hf, ep: Episode) -> tuple[np.ndarray, np.ndarray]:
    kw = ep.torch_kwargs(torch.float32)
    pos, deltas = hf.model.get_rope_index(
        kw["input_ids"], mm_token_type_ids=kw["mm_token_type_ids"], image_grid_thw=kw.get("image_grid_thw"),
        video_grid_thw=kw["video_grid_thw"], attention_mask=kw["attention_mask"],
        **({"second_per_grid_ts": kw["second_per_grid_ts"]} if "second_per_grid_ts" in kw else {}))
    return pos.numpy(), deltas.numpy().reshape(-1)


def _check(pair, ep: Episode) -> None:
    hf, ref, ours = pair
    want_pos, want_delta = _hf_positions(hf, ep)
    pos, delta = get_rope_index(ep.input_ids, ep.image_grid_thw, ep.attention_mask, ours.cfg,
                                video_grid_thw=ep.video_grid_thw, second_per_grid_ts=ep.second_per_grid_ts)
    np.testing.assert_array_equal(pos, want_pos)
    np.testing.assert_array_equal(delta, want_delta)
    dtype = next(ref.parameters()).dtype
    with torch.no_grad():
        want = ref(**ep.torch_kwargs(dtype)).logits.numpy()
    got = _ours(ours, ep)
    diff = np.abs(got - want)[ep.attention_mask.astype(bool)].max()
    assert diff <= TOL, diff


def test_a_clip_in_the_prompt_matches_transformers(pair):
    _, _, ours = pair
    ep = _episode(ours.cfg, [[5, "clip", 7]], clips=[(3, 4, 6)], pictures=[], seed=1)
    _check(pair, ep)


def test_a_picture_then_a_clip_in_an_observation_in_a_padded_batch_matches_transformers(pair):
    """Turn 1: a picture in the prompt and the model's answer; turn 2: an observation holding a clip of 2 frame
    groups, then the next answer; a second, shorter row with a clip of its own (right padding)."""
    _, _, ours = pair
    ep = _episode(ours.cfg, [[4, "img", 3, 6, "clip", 2, 5], [3, "clip", 4]], clips=[(2, 4, 4), (2, 2, 6)],
                  pictures=[(4, 6)], seed=2)
    assert ep.attention_mask[1].sum() < ep.attention_mask[0].sum()
    _check(pair, ep)


def test_qwen3_families_place_each_frame_group_like_a_picture_and_qwen2_5_spaces_time():
    """Hand-computed ids for one clip of 2 frame groups (1 x 2 merged tokens each) after 1 text token."""
    a, q25 = from_hf_cfg_a(), from_hf_dict(build_hf_model("Q25A").config.to_dict())
    assert split_video_grids(np.array([[2, 2, 4], [1, 4, 4]])).tolist() == [[1, 2, 4], [1, 2, 4], [1, 4, 4]]
    # Qwen3-VL: a 2-token timestamp, <s>, the group at base 3 (t = h = 3, w = 3, 4), </s> at 3 + max(2, 4) // 2,
    # then the second group the same way from 8.
    ids = np.array([[9, 7, START, VID, VID, END, 8, START, VID, VID, END, 6]])
    pos, _ = get_rope_index(ids, None, None, a, video_grid_thw=np.array([[2, 2, 4]]))
    assert pos[:, 0].tolist() == [[0, 1, 2, 3, 3, 5, 6, 7, 8, 8, 10, 11], [0, 1, 2, 3, 3, 5, 6, 7, 8, 8, 10, 11],
                                  [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]]
    # Qwen2.5-VL: one run; frame 1's temporal id is base + trunc(1 x tokens_per_second x 1.5); text resumes at
    # base + max(h, w) // merge, as transformers 5 does.
    ids = np.array([[9, START, VID, VID, VID, VID, END, 6]])
    pos, _ = get_rope_index(ids, None, None, q25, video_grid_thw=np.array([[2, 2, 4]]),
                            second_per_grid_ts=np.array([1.5]))
    step = int(q25.vision.tokens_per_second * 1.5)
    assert pos[0, 0].tolist() == [0, 1, 2, 2, 2 + step, 2 + step, 4, 5]
    assert pos[2, 0].tolist() == [0, 1, 2, 3, 2, 3, 4, 5]
    with pytest.raises(ValueError, match="second_per_grid_ts is Qwen2.5-VL's"):
        get_rope_index(ids, None, None, a, video_grid_thw=np.array([[2, 2, 4]]), second_per_grid_ts=np.array([1.0]))
    with pytest.raises(ValueError, match="^sequence 0 has 4 video tokens but video_grid_thw ran out after 0 rows$"):
        get_rope_index(ids, None, None, q25)


def test_packed_rows_with_clips_restart_positions_per_segment(pair):
    _, _, ours = pair
    cfg = ours.cfg
    first = _episode(cfg, [[3, "clip", 2]], clips=[(2, 4, 4)], pictures=[], seed=3)
    second = _episode(cfg, [[2, "img", "clip", 4]], clips=[(2, 2, 4)], pictures=[(4, 4)], seed=4)
    n1, n2 = first.input_ids.shape[1], second.input_ids.shape[1]
    tokens = np.zeros((1, n1 + n2 + 3), np.int64)
    seg = np.zeros_like(tokens, np.int32)
    tokens[0, :n1], tokens[0, n1 : n1 + n2] = first.input_ids[0], second.input_ids[0]
    seg[0, :n1], seg[0, n1 : n1 + n2] = 1, 2
    seconds = (None if first.second_per_grid_ts is None
               else np.concatenate([first.second_per_grid_ts, second.second_per_grid_ts]))
    pos, deltas = get_rope_index_packed(tokens, seg, second.image_grid_thw, cfg,
                                        video_grid_thw=np.concatenate([first.video_grid_thw, second.video_grid_thw]),
                                        second_per_grid_ts=seconds)
    for ep, lo, n, k in ((first, 0, n1, 0), (second, n1, n2, 1)):
        alone, delta = get_rope_index(ep.input_ids, ep.image_grid_thw, None, cfg, video_grid_thw=ep.video_grid_thw,
                                      second_per_grid_ts=ep.second_per_grid_ts)
        np.testing.assert_array_equal(pos[:, 0, lo : lo + n], alone[:, 0])
        assert deltas[0, k] == delta[0]


def test_vision_inputs_refuse_clip_tokens_that_do_not_match_the_clips():
    cfg = from_hf_cfg_a()
    ids = np.array([[1, START, VID, VID, END]])
    pixels = np.zeros((8, cfg.vision.patch_dim), np.float32)
    with pytest.raises(ValueError, match="tokens hold 2 video-pad tokens .* but the clips give 4 merged tokens"):
        build_vision_inputs(np.zeros((0, cfg.vision.patch_dim), np.float32), np.zeros((0, 3)), ids, cfg,
                            pixel_values_videos=np.zeros((16, cfg.vision.patch_dim), np.float32),
                            video_grid_thw=np.array([[4, 2, 2]]))
    with pytest.raises(ValueError, match="pixel_values_videos has 8 patches but video_grid_thw"):
        build_vision_inputs(np.zeros((0, cfg.vision.patch_dim), np.float32), np.zeros((0, 3)), ids, cfg,
                            pixel_values_videos=pixels, video_grid_thw=np.array([[4, 2, 2]]))
    with pytest.raises(ValueError, match="come together"):
        build_vision_inputs(np.zeros((0, cfg.vision.patch_dim), np.float32), np.zeros((0, 3)), ids, cfg,
                            pixel_values_videos=pixels)


@functools.cache
def from_hf_cfg_a():
    """Config A as our parser reads transformers' (built once per module)."""
    return from_hf_dict(build_hf_model("A").config.to_dict())


def _sample(ep: Episode, row: int, response: int, name: int) -> Sample:
    """Row `row` of an episode as a rollout sample whose last `response` tokens are the answer."""
    n = int(ep.attention_mask[row].sum())
    clip_rows = _items_of_row(ep, row, VID, ep.video_grid_thw, ours_merge=2)
    pic_rows = _items_of_row(ep, row, IMG, ep.image_grid_thw, ours_merge=2)
    mm = {"pixel_values_videos": _rows_pixels(ep.pixel_values_videos, ep.video_grid_thw, clip_rows),
          "video_grid_thw": ep.video_grid_thw[clip_rows]}
    if ep.second_per_grid_ts is not None:
        mm["second_per_grid_ts"] = ep.second_per_grid_ts[clip_rows]
    if pic_rows.size:
        mm.update(pixel_values=_rows_pixels(ep.pixel_values, ep.image_grid_thw, pic_rows),
                  image_grid_thw=ep.image_grid_thw[pic_rows])
    return Sample(group_index=name, index=0, tokens=ep.input_ids[row, :n].tolist(), response_length=response,
                  loss_mask=[1] * response, rollout_log_probs=[0.0] * response, multimodal_train_inputs=mm)


def _items_of_row(ep: Episode, row: int, pad: int, grid: np.ndarray | None, ours_merge: int) -> np.ndarray:
    """Which grid rows (clips or pictures, listed in row-major token order) belong to batch row `row`."""
    if grid is None:
        return np.zeros(0, np.int64)
    need = (ep.input_ids[: row + 1] == pad) & ep.attention_mask[: row + 1].astype(bool)
    before, mine = int(need[:row].sum()), int(need[row].sum())
    ends = np.cumsum(grid.prod(-1) // ours_merge**2)
    return np.flatnonzero((ends > before) & (ends <= before + mine))


def _rows_pixels(pixels: np.ndarray, grid: np.ndarray, rows: np.ndarray) -> np.ndarray:
    starts = np.concatenate([[0], np.cumsum(grid.prod(-1))])
    return np.concatenate([pixels[starts[r] : starts[r + 1]] for r in rows])


@pytest.mark.parametrize("reuse", [True, False])
def test_the_train_batch_packs_clip_episodes_that_match_transformers(pair, reuse):
    """Three clip episodes (two of them the same prompt clip, as a GRPO group) packed into rows by
    `build_train_batch`: each segment's logits equal transformers' on that episode alone; with reuse the shared clip
    is encoded once."""
    hf, ref, ours = pair
    cfg = ours.cfg
    # (seed 5 gave Qwen3.5-MoE a text token so ill-conditioned that transformers' own fp32 run is 1.6e-4 from its
    # float64 one there, and ours 6.6e-4, with the same experts routed: not a clip's doing, so other random tokens)
    ep = _episode(cfg, [[4, "clip", 5], [3, "clip", 6]], clips=[(2, 4, 4), (2, 2, 4)], pictures=[], seed=8)
    samples = [_sample(ep, 0, 5, 0), _sample(ep, 0, 5, 1), _sample(ep, 1, 6, 2)]
    batch = build_train_batch(samples, np.ones(3), cfg, seq_buckets=[T_FIX], row_buckets=[2],
                              patch_buckets=[PATCH_BUCKET],
                              packing=True, micro_batch_rows=None, aggregation="token_mean", aggregation_constant=None,
                              overlong_policy="error", vision_reuse=reuse)
    a = batch.arrays  # [1, 2, T_FIX] and PATCH_BUCKET: without reuse, the program of the tests above serves it
    assert batch.layout.shape_key[0] == 1 and a.tokens.shape[1] <= 2
    assert batch.layout.real_patches == (32 + 16 if reuse else 2 * 32 + 16)
    assert (batch.layout.clips, batch.layout.distinct_clips, batch.layout.images) == (3, 2 if reuse else 3, 0)
    dtype = next(ref.parameters()).dtype
    with torch.no_grad():
        want = ref(**ep.torch_kwargs(dtype)).logits.numpy()
    got = np.asarray(_logits(ours, jnp.asarray(a.tokens[0]), jnp.asarray(a.positions[0]), jnp.asarray(a.segment_ids[0]),
                             jax.tree.map(lambda x: None if x is None else jnp.asarray(x[0]), a.vision,
                                          is_leaf=lambda x: x is None)))
    for p, row in zip(batch.layout.placements, (0, 0, 1)):
        n = int(ep.attention_mask[row].sum())
        diff = np.abs(got[p.row, p.offset : p.offset + p.length] - want[row, :n]).max()
        assert diff <= TOL, (p, diff)


def test_truncation_never_splits_a_clip():
    cfg = from_hf_cfg_a()
    ep = _episode(cfg, [[3, "clip", 2, "clip", 30]], clips=[(2, 2, 4), (2, 2, 4)], pictures=[], seed=6)
    sample = _sample(ep, 0, 30, 0)
    pads = np.flatnonzero(ep.input_ids[0] == VID)
    # A bucket ending inside the second clip's second frame group keeps only the first clip.
    cut_at = int(pads[6]) + 1
    batch = build_train_batch([sample], np.ones(1), cfg, seq_buckets=[cut_at], row_buckets=[1], patch_buckets=[64],
                              packing=False, micro_batch_rows=None, aggregation="token_mean",
                              aggregation_constant=None, overlong_policy="truncate", vision_reuse=False)
    kept = batch.layout.placements[0].length
    assert kept == int(pads[4]) and (batch.arrays.tokens[0, 0, :kept] == VID).sum() == 4
    assert batch.layout.real_patches == 16


def test_clip_inputs_that_do_not_match_their_tokens_are_refused_by_name():
    cfg = from_hf_cfg_a()
    ep = _episode(cfg, [[3, "clip", 2]], clips=[(2, 2, 4)], pictures=[], seed=7)
    good = _sample(ep, 0, 2, 0)
    kw = dict(seq_buckets=[64], row_buckets=[1], patch_buckets=[64], packing=False, micro_batch_rows=None,
              aggregation="token_mean", aggregation_constant=None, overlong_policy="error")
    cases = {
        "video_grid_thw .* gives 2 merged tokens": {"video_grid_thw": np.array([[1, 2, 4]])},
        "no 'pixel_values_videos'": {"pixel_values_videos": None},
        "second_per_grid_ts is Qwen2.5-VL's": {"second_per_grid_ts": np.array([1.0])},
    }
    for message, change in cases.items():
        mm = {**good.multimodal_train_inputs, **change}
        mm = {k: v for k, v in mm.items() if v is not None}
        bad = Sample(**{**good.__dict__, "multimodal_train_inputs": mm})
        with pytest.raises(BatchingError, match=message):
            build_train_batch([bad], np.ones(1), cfg, **kw)
    no_inputs = Sample(**{**good.__dict__, "multimodal_train_inputs": None})
    with pytest.raises(BatchingError, match="4 video-pad tokens but no multimodal_train_inputs"):
        build_train_batch([no_inputs], np.ones(1), cfg, **kw)
