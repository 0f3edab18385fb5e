"""`rollout.video` without transformers' video processors (they need torchvision): frame sampling and timestamps
by transformers' formulas, the patch layout decoded back to frame pixels, and clear refusals. The outputs against
transformers' own processors: tests/vllm_real/test_video_processor.py."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from jaxrl_vlm.tiny_assets import TINY_ARCHS, save_tiny_processing
from rollout.video import (Clip, ClipError, VideoProcessorConfig, frame_group_timestamps, load_video_processor_config,
                           process_clips, resize_bicubic_uint8, sample_frame_indices)

QWEN3 = VideoProcessorConfig.from_dict({"video_processor_type": "Qwen3VLVideoProcessor", "fps": 2,
                                        "size": {"shortest_edge": 32 * 32, "longest_edge": 64 * 64 * 8}})
QWEN25 = VideoProcessorConfig.from_dict({"video_processor_type": "Qwen2VLVideoProcessor", "do_sample_frames": True,
                                         "fps": 1, "size": {"shortest_edge": 28 * 28, "longest_edge": 84 * 84}})


def test_frames_are_sampled_by_each_familys_rule():
    # Qwen3-VL: int(13 / 6 fps * 2) = 4 frames (at least min_frames 4), linspace(0, 12, 4) rounded.
    assert sample_frame_indices(13, 6.0, QWEN3).tolist() == [0, 4, 8, 12]
    # 30 frames at 10 fps, 2 per second: 6 frames, linspace(0, 29, 6) = 0, 5.8, 11.6, 17.4, 23.2, 29 rounded.
    assert sample_frame_indices(30, 10.0, QWEN3).tolist() == [0, 6, 12, 17, 23, 29]
    # A clip shorter than min_frames keeps all its frames.
    assert sample_frame_indices(3, 1.0, QWEN3).tolist() == [0, 1, 2]
    # Qwen2.5-VL: 12 / 4 fps * 1 = 3, raised to min_frames 4, a multiple of temporal 2; arange(0, 12, 12 / 4).
    assert sample_frame_indices(12, 4.0, QWEN25).tolist() == [0, 3, 6, 9]
    # Without sampling, every frame.
    every = VideoProcessorConfig.from_dict({"video_processor_type": "Qwen2VLVideoProcessor"})
    assert not every.do_sample_frames and sample_frame_indices(5, 3.0, every).tolist() == [0, 1, 2, 3, 4]


def test_timestamps_are_the_middle_of_each_frame_group_and_a_short_group_repeats_its_last_frame():
    assert frame_group_timestamps([0, 4, 8, 12], 6.0, 2) == pytest.approx([1 / 3, 5 / 3])
    assert frame_group_timestamps([0, 1, 2], 2.0, 2) == pytest.approx([0.25, 1.0])


def test_patches_are_frame_groups_in_merge_window_order_and_decode_back_to_the_frames():
    """Each pixel encodes its own (frame, row, column); a patch must hold temporal x patch x patch of them, channel
    first, in transformers' order (t, window row, window col, row in window, col in window)."""
    cfg = VideoProcessorConfig.from_dict({"video_processor_type": "Qwen3VLVideoProcessor", "do_sample_frames": False,
                                          "image_mean": [0, 0, 0], "image_std": [1 / 255] * 3,
                                          "size": {"shortest_edge": 16, "longest_edge": 10**7}})
    t, h, w, p, m = 3, 64, 96, 16, 2
    frames = np.zeros((t, h, w, 3), np.uint8)
    frames[..., 0] = np.arange(t)[:, None, None] * 50 + 1
    frames[..., 1] = (np.arange(h) // p)[None, :, None] * 10 + np.arange(w)[None, None, :] // p
    frames[..., 2] = (np.arange(h) % p)[None, :, None] * 16 + np.arange(w)[None, None, :] % p
    out = process_clips([Clip.of(frames, 5.0)], cfg)
    assert out.video_grid_thw.tolist() == [[2, 4, 6]]  # 3 frames padded to 4 with the last one
    patches = out.pixel_values_videos.reshape(2, h // p // m, w // p // m, m, m, 3, 2, p, p)
    for gt, wr, wc, r, c in [(0, 0, 0, 0, 0), (1, 1, 2, 1, 0), (0, 0, 1, 0, 1), (1, 1, 1, 1, 1)]:
        patch = patches[gt, wr, wc, r, c]  # [channel, temporal, y, x]
        row, col = wr * m + r, wc * m + c
        frames_in_patch = [min(2 * gt + k, t - 1) for k in range(2)]
        assert patch[0, :, 0, 0].tolist() == [f * 50 + 1 for f in frames_in_patch]
        assert (patch[1] == row * 10 + col).all()
        assert (patch[2] == np.arange(p)[:, None] * 16 + np.arange(p)[None, :]).all()


def test_resized_frames_take_the_familys_size_and_second_per_grid_follows_the_sampling_rate():
    clip = Clip.of([Image.new("RGB", (70, 50), (k * 20, 0, 0)) for k in range(12)], 4.0)
    out = process_clips([clip, clip], QWEN25)
    # 4 frames of 56 x 56 by Qwen2-VL's smart_resize (70 / 28 = 2.5 rounds to 2: Python rounds half to even)
    assert out.video_grid_thw.tolist() == [[2, 4, 4], [2, 4, 4]]
    assert out.pixel_values_videos.shape == (64, 3 * 2 * 14 * 14)
    assert out.second_per_grid_ts.tolist() == [2.0, 2.0]  # temporal 2 / sampled at 1 fps
    unsampled = VideoProcessorConfig.from_dict({"video_processor_type": "Qwen2VLVideoProcessor"})
    assert process_clips([clip], unsampled).second_per_grid_ts.tolist() == [0.5]  # 2 / the clip's own 4 fps


def test_bad_clips_and_unknown_processors_are_refused_by_name():
    with pytest.raises(ClipError, match="at least one frame"):
        Clip.of([], 2.0)
    with pytest.raises(ClipError, match="share one size"):
        Clip.of([np.zeros((8, 8, 3), np.uint8), np.zeros((8, 9, 3), np.uint8)], 2.0)
    with pytest.raises(ClipError, match=r"\[H, W, 3\] uint8"):
        Clip.of([np.zeros((8, 8), np.uint8)], 2.0)
    with pytest.raises(ClipError, match="fps must be a positive number"):
        Clip.of([np.zeros((8, 8, 3), np.uint8)], 0.0)
    with pytest.raises(ClipError, match="only Qwen3VLVideoProcessor and Qwen2VLVideoProcessor"):
        VideoProcessorConfig.from_dict({"video_processor_type": "LlavaNextVideoProcessor"})
    with pytest.raises(ClipError, match="cap_pixels_per_frame"):
        VideoProcessorConfig.from_dict({"video_processor_type": "Qwen3VLVideoProcessor", "cap_pixels_per_frame": True})
    with pytest.raises(ClipError, match="clip 0 .*aspect ratio"):
        process_clips([Clip.of(np.zeros((2, 8, 3000, 3), np.uint8), 1.0)], QWEN3)


def test_tiny_checkpoints_ship_the_familys_video_processor_config(tmp_path):
    for arch in TINY_ARCHS:
        cfg = load_video_processor_config(save_tiny_processing(tmp_path / arch, vocab_size=300, arch=arch))
        qwen25 = arch == "qwen2_5_vl"
        assert cfg.temporal_timestamps == (not qwen25) and cfg.patch_size == (14 if qwen25 else 16)
        clip = Clip.of(np.zeros((8, 64, 64, 3), np.uint8), 4.0)
        grid = process_clips([clip], cfg).video_grid_thw
        assert grid.shape == (1, 3) and (grid[0, 1:] % cfg.merge_size == 0).all()
    with pytest.raises(ClipError, match="has no video_preprocessor_config.json"):
        load_video_processor_config(tmp_path)
    (tmp_path / "video_preprocessor_config.json").write_text("{not json")
    with pytest.raises(ClipError, match="not valid JSON"):
        load_video_processor_config(tmp_path)


def test_the_resize_keeps_flat_frames_flat_and_a_ramp_a_ramp():
    """(Bit-exactness against torchvision is checked in the vLLM venv, tests/vllm_real/test_video_processor.py.)
    Normalized weights keep a flat frame flat at every scale; a horizontal ramp stays monotone and spans the same
    range within the filter's overshoot; the untouched axis is untouched."""
    flat = np.full((2, 30, 41, 3), 77, np.uint8)
    for h, w in [(64, 96), (12, 20), (30, 17)]:
        out = resize_bicubic_uint8(flat, h, w)
        assert out.shape == (2, h, w, 3) and out.dtype == np.uint8 and (out == 77).all()
    ramp = np.broadcast_to(np.linspace(0, 255, 80).astype(np.uint8)[None, None, :, None], (1, 5, 80, 3)).copy()
    out = resize_bicubic_uint8(ramp, 5, 33)
    assert (np.diff(out[0, 0, :, 0].astype(int)) >= 0).all() and out[0, 0, 0, 0] <= 4 and out[0, 0, -1, 0] >= 251
    assert (out == out[:, :1]).all()  # every row the same: height kept, so no vertical pass
