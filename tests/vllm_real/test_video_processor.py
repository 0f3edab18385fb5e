"""Our numpy video processor (`rollout.video`) against transformers' own `Qwen3VLVideoProcessor` and
`Qwen2VLVideoProcessor`, run in the vLLM venv (they need torchvision, which the project's venv does not have).

Everything is exact, resizing included: `rollout.video.resize_bicubic_uint8` reproduces torch's uint8 antialiased
bicubic kernel (what torchvision's `resize` runs on uint8 frames) bit for bit; Pillow's bicubic, used before, put
0.3-0.4% of the values a uint8 level or two away.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest

from conftest import vllm_python
from rollout.video import Clip, VideoProcessorConfig, process_clips, resize_bicubic_uint8

HERE = Path(__file__).parent
QWEN3 = {"video_processor_type": "Qwen3VLVideoProcessor", "patch_size": 16, "temporal_patch_size": 2,
         "merge_size": 2, "size": {"shortest_edge": 32 * 32, "longest_edge": 64 * 64 * 8},
         "image_mean": [0.5] * 3, "image_std": [0.5] * 3}
QWEN25 = {"video_processor_type": "Qwen2VLVideoProcessor", "patch_size": 14, "temporal_patch_size": 2,
          "merge_size": 2, "size": {"shortest_edge": 28 * 28, "longest_edge": 84 * 84}}
CASES = {  # config, clip shape (frames, height, width), clip fps, resized?
    "qwen3_sampled_at_2fps_resized": ({**QWEN3, "do_sample_frames": True, "fps": 2}, (13, 50, 70), 6.0, True),
    "qwen3_every_frame_odd_count": ({**QWEN3, "do_sample_frames": False}, (5, 64, 96), 4.0, False),
    "qwen2_5_every_frame_resized": ({**QWEN25, "do_sample_frames": False}, (6, 60, 90), 3.0, True),
    "qwen2_5_sampled_at_1fps": ({**QWEN25, "do_sample_frames": True, "fps": 1}, (12, 56, 84), 4.0, False),
    "qwen2_5_shrunk_by_more_than_2": ({**QWEN25, "do_sample_frames": False}, (4, 150, 260), 2.0, True),
    "qwen3_enlarged": ({**QWEN3, "do_sample_frames": False, "size": {"shortest_edge": 64 * 64 * 4,
                                                                       "longest_edge": 96 * 96 * 8}}, (4, 30, 41), 2.0, True),
}


def _frames(t: int, h: int, w: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w]
    frames = [(np.sin(x / 7 + k) + np.cos(y / 5 - k))[..., None] * [50, 60, 70] + 128 + rng.integers(-20, 20, (h, w, 3))
              for k in range(t)]
    return np.clip(np.stack(frames), 0, 255).astype(np.uint8)


RESIZES = [((50, 70), (64, 64)), ((60, 90), (56, 84)), ((64, 96), (32, 48)), ((120, 200), (56, 84)),
           ((33, 47), (64, 96)), ((100, 100), (100, 64)), ((480, 640), (224, 320))]  # (from, to), up and down


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    work = tmp_path_factory.mktemp("video_ref")
    spec: dict = {}
    for i, (name, (config, shape, fps, _)) in enumerate(CASES.items()):
        path = work / f"{name}.npy"
        np.save(path, _frames(*shape, seed=i))
        spec[name] = {"config": config, "frames": str(path), "fps": fps}
    rng = np.random.default_rng(0)
    for k, ((h, w), size) in enumerate(RESIZES):
        path = work / f"resize_{k}.npy"
        np.save(path, rng.integers(0, 256, (2, h, w, 3), dtype=np.uint8))  # noise: every tap's weight shows
        spec[f"resize_{k}"] = {"frames": str(path), "resize": list(size)}
    (work / "spec.json").write_text(json.dumps(spec))
    subprocess.run([str(vllm_python()), str(HERE / "_video_reference.py"), str(work / "spec.json"),
                    str(work / "out.json")], check=True, timeout=300)
    return work, json.loads((work / "out.json").read_text())


@pytest.mark.parametrize("name", list(CASES))
def test_the_processor_equals_transformers_video_processor(name, reference):
    work, grids = reference
    config, _, fps, resized = CASES[name]
    ours = process_clips([Clip.of(np.load(work / f"{name}.npy"), fps)], VideoProcessorConfig.from_dict(config))
    want = np.load(work / f"{name}.npy.pv.npy")
    assert ours.video_grid_thw.tolist() == grids[name]
    assert ours.pixel_values_videos.shape == want.shape
    frames, patch = np.load(work / f"{name}.npy"), VideoProcessorConfig.from_dict(config).patch_size
    assert bool((ours.video_grid_thw[0, 1:] * patch != frames.shape[1:3]).any()) == resized  # it resizes, or not
    np.testing.assert_allclose(ours.pixel_values_videos, want, rtol=0, atol=1e-5)


def test_the_resize_is_torchvisions_bit_for_bit(reference):
    work, _ = reference
    for k, (_, (h, w)) in enumerate(RESIZES):
        frames = np.load(work / f"resize_{k}.npy")
        np.testing.assert_array_equal(resize_bicubic_uint8(frames, h, w), np.load(work / f"resize_{k}.npy.resized.npy"))
