"""Our clip data URLs (`rollout.video_io.clip_to_data_url`: PNG rgb24 frames in MP4) read by vLLM's own video path,
run in the vLLM venv: `MediaConnector.fetch_video` (what the server runs on a `video_url` data URL) with its default
"opencv" loader, and with the "qwen3_vl" loader a Qwen3-VL server picks. The frames vLLM decodes must be ours bit
for bit (noise frames of odd sizes, so any lossy step or colour conversion shows) and its fps the clip's exactly.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

from conftest import vllm_python
from rollout.video import Clip
from rollout.video_io import clip_to_data_url, load_clip

# Run by the vLLM venv's python: every case's data URL through vLLM's MediaConnector; frames to NAME.<loader>.npy,
# metadata to out.json.
_VLLM_SCRIPT = r"""
import json, sys
import numpy as np
from vllm.multimodal.media.connector import MediaConnector

spec, out_path = json.load(open(sys.argv[1])), sys.argv[2]
loaders = {
    "opencv": (MediaConnector(media_io_kwargs={"video": {"num_frames": -1, "video_backend": "opencv"}}), None),
    "qwen3_vl": (MediaConnector(), "Qwen3VLVideoProcessor"),
}
out = {}
for name, case in spec.items():
    for loader, (connector, processor) in loaders.items():
        media = connector.fetch_video(case["url"], video_processor=processor)
        frames, meta = media.media
        np.save(case["prefix"] + "." + loader + ".npy", np.asarray(frames))
        out[name + "." + loader] = {k: meta[k] for k in ("fps", "total_num_frames", "frames_indices", "video_backend")}
json.dump(out, open(out_path, "w"))
"""

CASES = {  # frames, height, width, fps
    "ntsc_odd_size": (5, 17, 23, 30000 / 1001),
    "decimal_29_97": (6, 9, 31, 29.97),
    "one_and_a_half": (4, 33, 47, 1.5),
    "half_fps": (7, 32, 48, 0.5),
    "two_fps": (9, 16, 15, 2.0),
    "one_frame": (1, 17, 23, 2.0),
}


def _noise(t: int, h: int, w: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (t, h, w, 3), dtype=np.uint8)


@pytest.fixture(scope="module")
def decoded(tmp_path_factory):
    work = tmp_path_factory.mktemp("video_wire")
    spec, clips = {}, {}
    for i, (name, (t, h, w, fps)) in enumerate(CASES.items()):
        clips[name] = Clip.of(_noise(t, h, w, seed=i), fps)
        spec[name] = {"url": clip_to_data_url(clips[name]), "prefix": str(work / name)}
    (work / "spec.json").write_text(json.dumps(spec))
    env = {**os.environ, "VLLM_LOGGING_LEVEL": "ERROR"}
    proc = subprocess.run([str(vllm_python()), "-c", _VLLM_SCRIPT, str(work / "spec.json"), str(work / "out.json")],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    meta = json.loads((work / "out.json").read_text())
    frames = {key: np.load(work / f"{key}.npy") for key in meta}
    return clips, meta, frames


@pytest.mark.parametrize("name", [n for n in CASES if n != "one_frame"])
def test_vllm_opencv_loader_decodes_our_frames_bit_for_bit(name, decoded):
    clips, meta, frames = decoded
    clip, got, info = clips[name], frames[f"{name}.opencv"], meta[f"{name}.opencv"]
    assert info["video_backend"] == "opencv"
    assert got.dtype == np.uint8 and got.shape == clip.frames.shape
    np.testing.assert_array_equal(got, clip.frames)
    assert info["fps"] == clip.fps  # exactly: the header's rate is the clip's
    assert info["total_num_frames"] == clip.frames.shape[0]
    assert info["frames_indices"] == list(range(clip.frames.shape[0]))


@pytest.mark.parametrize("name", [n for n in CASES if n != "one_frame"])
def test_vllm_qwen3_vl_loader_samples_our_frames(name, decoded):
    clips, meta, frames = decoded
    clip, got, info = clips[name], frames[f"{name}.qwen3_vl"], meta[f"{name}.qwen3_vl"]
    t = clip.frames.shape[0]
    # the Qwen3-VL loader's sampling at its default 2 fps (transformers' Qwen3VLVideoProcessor.sample_frames)
    want = np.linspace(0, t - 1, min(max(int(t / clip.fps * 2), 4), 768, t)).round().astype(int).tolist()
    assert info["frames_indices"] == want
    assert info["fps"] == clip.fps and info["total_num_frames"] == t
    np.testing.assert_array_equal(got, clip.frames[want])


def test_vllm_drops_a_one_frame_clip(decoded):
    """vLLM 0.32's opencv decoding returns no frame for any one-frame video (its end-of-stream seek leaves the
    capture unreadable; an H.264 one-frame MP4 fails the same way), while the header is read right. Pinned so
    that a vLLM that fixes it shows here; meanwhile a one-frame clip should go to vLLM as an image."""
    clips, meta, frames = decoded
    clip = clips["one_frame"]
    np.testing.assert_array_equal(load_clip(clip_to_data_url(clip)).frames, clip.frames)  # our own reader is fine
    for loader in ("opencv", "qwen3_vl"):
        info = meta[f"one_frame.{loader}"]
        assert frames[f"one_frame.{loader}"].shape[0] == 0
        assert (info["fps"], info["total_num_frames"]) == (clip.fps, 1)
