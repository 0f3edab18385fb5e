"""Host-side M-RoPE / vision position helpers vs transformers (and torch's own interpolation)."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import Any

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
    qwen3_vl_2b_instruct,
    vision_pos_embed_interp,
    vision_rotary_positions,
)
from jaxrl_vlm.models.config import Qwen3VLConfig
from jaxrl_vlm.models.rope import _sequence_positions


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

    from jaxrl_vlm.models.layers import mrope_cos_sin

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


# --- Vectorized host positions vs a straightforward reference --------------------------------------
# The reference is the earlier implementation (a Python walk over the tokens), kept here unchanged
# (scripts/bench_rope.py times it as the baseline): the vectorized code must give the same ids and the
# same first error for every input.


def ref_sequence_positions(ids: np.ndarray, grids: list[np.ndarray], cfg: Qwen3VLConfig, where: str) -> np.ndarray:
    """Walk the tokens in order; at an image token, the next grid takes the next t*(h/merge)*(w/merge) tokens."""
    merge = cfg.vision.spatial_merge_size
    is_image = ids == cfg.image_token_id  # a video token is text to the picture walk (no clip grids given here)
    out = np.empty((3, ids.shape[0]), np.int64)
    pos = i = g = 0
    n = ids.shape[0]
    while i < n:
        if not is_image[i]:
            j = i
            while j < n and not is_image[j]:
                j += 1
            out[:, i:j] = np.arange(pos, pos + j - i)[None, :]
            pos += j - i
            i = j
            continue
        if g >= len(grids):
            raise ValueError(f"{where}: more image-token runs than image_grid_thw rows ({len(grids)})")
        t, h, w = (int(x) for x in grids[g])
        lh, lw = h // merge, w // merge
        count = t * lh * lw
        if i + count > n or not is_image[i : i + count].all():
            run = int(np.argmin(np.append(is_image[i:], False)))
            raise ValueError(
                f"{where}: image {g} with grid (t={t}, h={h}, w={w}) needs {count} consecutive image tokens, "
                f"found {run} at token {i}"
            )
        tt, hh, ww = np.meshgrid(np.arange(t), np.arange(lh), np.arange(lw), indexing="ij")
        out[0, i : i + count] = tt.reshape(-1) + pos
        out[1, i : i + count] = hh.reshape(-1) + pos
        out[2, i : i + count] = ww.reshape(-1) + pos
        pos += max(h, w) // merge
        i += count
        g += 1
    if g != len(grids):
        raise ValueError(f"{where}: {len(grids)} image grids given but only {g} images found in the tokens")
    if (ids == cfg.video_token_id).any():
        raise ValueError(f"{where}: more video-token runs than video_grid_thw rows (0)")
    return out


def ref_split_grids(seqs: list[np.ndarray], grid: np.ndarray, cfg: Qwen3VLConfig) -> list[list[np.ndarray]]:
    """Hand each sequence grid rows, in order, until they hold its image tokens."""
    sizes = grid.prod(-1) // cfg.vision.merge_unit if len(grid) else np.zeros((0,), np.int64)
    out: list[list[np.ndarray]] = []
    g = 0
    for seq_idx, ids in enumerate(seqs):
        need = int((ids == cfg.image_token_id).sum())
        mine: list[np.ndarray] = []
        have = 0
        while have < need:
            if g >= len(grid):
                raise ValueError(
                    f"sequence {seq_idx} has {need} image tokens but image_grid_thw ran out after {len(grid)} rows"
                )
            mine.append(grid[g])
            have += int(sizes[g])
            g += 1
        if have != need:
            raise ValueError(f"sequence {seq_idx}: {need} image tokens do not match its grids' {have} merged tokens")
        out.append(mine)
    if g != len(grid):
        raise ValueError(f"image_grid_thw has {len(grid)} rows but the tokens only use {g}")
    for seq_idx, ids in enumerate(seqs):  # no clip grids are given here: clip tokens run out of them at once
        if (need := int((ids == cfg.video_token_id).sum())):
            raise ValueError(f"sequence {seq_idx} has {need} video tokens but video_grid_thw ran out after 0 rows")
    return out


def ref_get_rope_index(
    ids: np.ndarray, grid: np.ndarray, mask: np.ndarray, cfg: Qwen3VLConfig
) -> tuple[np.ndarray, np.ndarray]:
    rows = [ids[b][mask[b]] for b in range(ids.shape[0])]
    grids = ref_split_grids(rows, grid, cfg)
    positions = np.zeros((3,) + ids.shape, np.int32)
    deltas = np.zeros((ids.shape[0],), np.int32)
    for b, row in enumerate(rows):
        if row.size:
            pos = ref_sequence_positions(row, grids[b], cfg, where=f"batch row {b}")
            positions[:, b, mask[b]] = pos
            deltas[b] = int(pos.max()) + 1 - row.size
    return positions, deltas


def ref_get_rope_index_packed(
    tokens: np.ndarray, seg: np.ndarray, grid: np.ndarray, cfg: Qwen3VLConfig
) -> tuple[np.ndarray, np.ndarray]:
    """Per row, per segment in order of first appearance: mask out its tokens and walk them."""
    order: list[tuple[int, int]] = []
    seqs: list[np.ndarray] = []
    for b in range(tokens.shape[0]):
        firsts = sorted((int(np.argmax(seg[b] == k)), int(k)) for k in np.unique(seg[b]) if k > 0)
        for _, k in firsts:
            order.append((b, k))
            seqs.append(tokens[b][seg[b] == k])
    grids = ref_split_grids(seqs, grid, cfg)
    positions = np.zeros((3,) + tokens.shape, np.int32)
    deltas = np.zeros((tokens.shape[0], int(seg.max()) if seg.size else 0), np.int32)
    for (b, k), ids, gr in zip(order, seqs, grids):
        pos = ref_sequence_positions(ids, gr, cfg, where=f"row {b} segment {k}")
        positions[:, b, seg[b] == k] = pos
        deltas[b, k - 1] = int(pos.max()) + 1 - ids.size
    return positions, deltas


def merge_cfg(merge: int) -> Qwen3VLConfig:
    cfg = qwen3_vl_2b_instruct()
    return dataclasses.replace(cfg, vision=dataclasses.replace(cfg.vision, spatial_merge_size=merge))


def outcome(fn: Callable[..., Any], *args: Any) -> Any:
    """The function's result, or its ValueError message: the two implementations must agree on either."""
    try:
        return fn(*args)
    except ValueError as e:
        return str(e)


def assert_same_outcome(got: Any, want: Any) -> str:
    """Assert equal results (arrays or tuples of arrays) or equal messages; returns the kind of outcome."""
    if isinstance(want, str) or isinstance(got, str):
        assert got == want
        return error_kind(want)
    for g, w in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
        assert g.dtype == w.dtype
        np.testing.assert_array_equal(g, w)
    return "ok"


ERROR_KINDS = {
    "video": "video_grid_thw",  # clip tokens with no clip grids: in one sequence or at the split
    "more_runs": "more image-token runs",
    "run_too_short": "consecutive image tokens, found",
    "fewer_images": "images found in the tokens",
    "split_ran_out": "image_grid_thw ran out after",
    "split_mismatch": "do not match its grids'",
    "split_unused": "but the tokens only use",
}


def error_kind(message: str) -> str:
    kinds = [k for k, text in ERROR_KINDS.items() if text in message]
    assert len(kinds) == 1, message
    return kinds[0]


def random_grid(rng: np.random.Generator, merge: int) -> np.ndarray:
    """t in 1..2, h, w in merge..3*merge; sometimes not a multiple of merge (positions floor like transformers)."""
    t, h, w = int(rng.integers(1, 3)), merge * int(rng.integers(1, 4)), merge * int(rng.integers(1, 4))
    if merge > 1 and rng.random() < 0.1:
        h += int(rng.integers(1, merge))
    return np.array([t, h, w])


def random_sequence(rng: np.random.Generator, cfg: Qwen3VLConfig) -> tuple[np.ndarray, np.ndarray]:
    """Text runs (possibly empty, so images can open or close the sequence) around groups of 1-3
    ADJACENT images (one run of image tokens); no images at all a fifth of the time."""
    merge = cfg.vision.spatial_merge_size
    parts: list[np.ndarray] = []
    grids: list[np.ndarray] = []
    for _ in range(int(rng.integers(0, 4)) if rng.random() > 0.2 else 0):
        parts.append(rng.integers(0, 1000, size=int(rng.integers(0, 4))))
        for _ in range(int(rng.integers(1, 4))):
            g = random_grid(rng, merge)
            grids.append(g)
            parts.append(np.full(g[0] * (g[1] // merge) * (g[2] // merge), cfg.image_token_id))
    parts.append(rng.integers(0, 1000, size=int(rng.integers(0 if grids else 1, 4))))
    return np.concatenate(parts).astype(np.int64), np.array(grids, np.int64).reshape(-1, 3)


def corrupt(rng: np.random.Generator, ids: np.ndarray, grid: np.ndarray, cfg: Qwen3VLConfig):
    """One random defect (or none): a video token, a grid dropped / added / redrawn, a token flipped, or
    two tokens swapped (same image-token count, so the grids still split but an image may break)."""
    ids, grid = ids.copy(), grid.copy()
    kind = rng.choice(["none", "video", "drop_grid", "extra_grid", "redraw_grid", "flip_token", "swap_tokens"])
    if kind == "video":
        ids[rng.integers(ids.size)] = cfg.video_token_id
    elif kind == "drop_grid" and len(grid):
        grid = np.delete(grid, rng.integers(len(grid)), axis=0)
    elif kind == "extra_grid":
        grid = np.insert(grid, rng.integers(len(grid) + 1), random_grid(rng, cfg.vision.spatial_merge_size), axis=0)
    elif kind == "redraw_grid" and len(grid):
        grid[rng.integers(len(grid))] = random_grid(rng, cfg.vision.spatial_merge_size)
    elif kind == "flip_token":
        j = rng.integers(ids.size)
        ids[j] = 7 if ids[j] == cfg.image_token_id else cfg.image_token_id
    elif kind == "swap_tokens":
        j = rng.integers(ids.size, size=2)
        ids[j] = ids[j[::-1]]
    return ids, grid


@pytest.mark.parametrize("merge", [1, 2, 3])
def test_sequence_positions_match_reference_on_random_sequences(merge):
    cfg = merge_cfg(merge)
    rng = np.random.default_rng(merge)
    seen: dict[str, int] = {}
    for _ in range(600):
        ids, grid = corrupt(rng, *random_sequence(rng, cfg), cfg)
        got = outcome(_sequence_positions, ids, grid, cfg, "seq")
        kind = assert_same_outcome(got, outcome(ref_sequence_positions, ids, list(grid), cfg, "seq"))
        if kind == "ok" and len(grid) > 1 and (np.diff(np.flatnonzero(ids == cfg.image_token_id)) == 1).all():
            kind = "ok_adjacent"  # several images, all in one run of image tokens
        seen[kind] = seen.get(kind, 0) + 1
    # Every outcome the single-sequence walk can have was exercised, and plenty of successes.
    assert set(seen) == {"ok", "ok_adjacent", "video", "more_runs", "run_too_short", "fewer_images"}, seen
    assert seen["ok"] >= 100 and seen["ok_adjacent"] >= 10, seen


def test_adjacent_images_split_one_run_of_image_tokens():
    """Two images with no text between them: the run is split by grid sizes (hand-computed ids)."""
    cfg = merge_cfg(2)
    img = cfg.image_token_id
    ids = np.array([7, img, img, img, img, 8])
    grid = np.array([[1, 2, 4], [1, 4, 2]])  # 1x2 merged tokens, then 2x1; each advances by 2
    want = [[0, 1, 1, 3, 3, 5], [0, 1, 1, 3, 4, 5], [0, 1, 2, 3, 3, 5]]
    np.testing.assert_array_equal(_sequence_positions(ids, grid, cfg, "seq"), want)
    np.testing.assert_array_equal(ref_sequence_positions(ids, list(grid), cfg, "seq"), want)
    # One image covering the same four tokens is a different layout.
    assert not np.array_equal(_sequence_positions(ids, np.array([[1, 4, 4]]), cfg, "seq"), want)


I, V = qwen3_vl_2b_instruct().image_token_id, qwen3_vl_2b_instruct().video_token_id
MORE_RUNS = "s: more image-token runs than image_grid_thw rows (1)"
NEEDS_4 = "s: image {} with grid (t=1, h=4, w=4) needs 4 consecutive image tokens, found {} at token {}"
BAD_SEQUENCES = {  # tokens, grids (merge 2), the exact message
    "video": ([1, V, 2], [], "s: more video-token runs than video_grid_thw rows (0)"),
    "more_runs_than_grids": ([1, I, I, I, I, 2, I, I, I, I], [[1, 4, 4]], MORE_RUNS),
    "run_shorter_than_grid": ([1, I, I, I, 2], [[1, 4, 4]], NEEDS_4.format(0, 3, 1)),
    "run_longer_than_grid": ([1, I, I, I, I, I, 2], [[1, 4, 4]], MORE_RUNS),
    "adjacent_overrun": ([I, I, I, I, I, I], [[1, 4, 4], [1, 4, 4]], NEEDS_4.format(1, 2, 4)),
    "fewer_images_than_grids": ([1, I, I, I, I, 2], [[1, 4, 4], [1, 2, 2]],
                                "s: 2 image grids given but only 1 images found in the tokens"),
}


@pytest.mark.parametrize("case", list(BAD_SEQUENCES))
def test_sequence_positions_errors_name_the_cause(case):
    ids, grid, message = BAD_SEQUENCES[case]
    cfg, ids, grid = merge_cfg(2), np.array(ids), np.array(grid, np.int64).reshape(-1, 3)
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        _sequence_positions(ids, grid, cfg, "s")
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        ref_sequence_positions(ids, list(grid), cfg, "s")


def random_packed(rng: np.random.Generator, cfg: Qwen3VLConfig) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rows of random sequences; a row's segments are contiguous or interleaved in chunks, then padding."""
    rows, width = int(rng.integers(1, 4)), 40
    tokens = np.zeros((rows, width), np.int64)
    seg = np.zeros((rows, width), np.int32)
    grids: list[np.ndarray] = []
    for b in range(rows):
        seqs = [random_sequence(rng, cfg) for _ in range(int(rng.integers(0, 4)))]
        while sum(s.size for s, _ in seqs) > width:
            seqs.pop()
        owners = np.concatenate([np.full(s.size, k + 1) for k, (s, _) in enumerate(seqs)] + [np.zeros(0, int)])
        if rng.random() < 0.5:  # interleave: any order of the tokens that keeps each sequence's own order
            owners = owners[rng.permutation(owners.size)]
        cursor = [0] * len(seqs)
        for j, k in enumerate(owners):
            tokens[b, j] = seqs[k - 1][0][cursor[k - 1]]
            cursor[k - 1] += 1
        seg[b, : owners.size] = owners
        # Images are listed in token order: segments in order of first appearance.
        appearance = list(dict.fromkeys(owners.tolist()))
        grids += [seqs[k - 1][1] for k in appearance]
    return tokens, seg, np.concatenate(grids + [np.zeros((0, 3), np.int64)])


@pytest.mark.parametrize("merge", [1, 2])
def test_packed_and_batched_positions_match_reference_on_random_batches(merge):
    cfg = merge_cfg(merge)
    rng = np.random.default_rng(10 + merge)
    seen: dict[str, int] = {}
    for _ in range(300):
        tokens, seg, grid = random_packed(rng, cfg)
        flat_ids, grid = corrupt(rng, tokens.reshape(-1), grid, cfg)
        tokens = flat_ids.reshape(tokens.shape)
        got = outcome(get_rope_index_packed, tokens, seg, grid, cfg)
        kind = assert_same_outcome(got, outcome(ref_get_rope_index_packed, tokens, seg, grid, cfg))
        seen[kind] = seen.get(kind, 0) + 1
        # The same rows as a padded batch: segment ids > 0 become the attention mask (holes allowed).
        mask = seg > 0
        got = outcome(get_rope_index, tokens, grid, mask, cfg)
        assert_same_outcome(got, outcome(ref_get_rope_index, tokens, grid, mask, cfg))
    # (more image runs than grids cannot pass the split with grids that are multiples of merge)
    assert {"ok", "video", "run_too_short", "split_mismatch", "split_ran_out", "split_unused"} <= set(seen), seen
    assert seen["ok"] >= 100, seen


def test_vision_positions_match_transformers_on_random_grids():
    rng = np.random.default_rng(0)
    for merge in (1, 2, 3):
        grid = np.stack([rng.integers(1, 3, 6), merge * rng.integers(1, 6, 6), merge * rng.integers(1, 6, 6)], 1)
        want = vision_utils.get_vision_position_ids(torch.tensor(grid), merge).numpy()
        np.testing.assert_array_equal(vision_rotary_positions(grid, merge), want)
    assert vision_rotary_positions(np.zeros((0, 3), np.int64), 2).shape == (0, 2)
    with pytest.raises(ValueError, match=r"^image 1: grid h=4, w=6 must be multiples of spatial_merge_size=4$"):
        vision_rotary_positions(np.array([[1, 8, 8], [1, 4, 6], [1, 3, 3]]), 4)
