"""Run in the vLLM venv (it has torchvision): transformers' own video processors on the clips a test saved.

    python _video_reference.py SPEC.json OUT.json

SPEC maps a case name to {"config": video_preprocessor_config dict, "frames": path of a [T, H, W, 3] uint8 .npy,
"fps": the clip's rate}; OUT gets each case's video_grid_thw, and pixel_values_videos goes to FRAMES.pv.npy. A case
{"frames": ..., "resize": [h, w]} instead gets torchvision's own antialiased bicubic resize of the uint8 frames
(what the processors run), saved to FRAMES.resized.npy.
"""

from __future__ import annotations

import json
import sys

import numpy as np
import torch
from torchvision.transforms import InterpolationMode
from torchvision.transforms.v2 import functional as tvF
from transformers import Qwen2VLVideoProcessor, Qwen3VLVideoProcessor
from transformers.video_utils import VideoMetadata


def main(spec_path: str, out_path: str) -> None:
    out = {}
    for name, case in json.load(open(spec_path)).items():
        if "resize" in case:
            frames = torch.from_numpy(np.load(case["frames"])).permute(0, 3, 1, 2)
            out_frames = tvF.resize(frames, list(case["resize"]), interpolation=InterpolationMode.BICUBIC, antialias=True)
            np.save(case["frames"] + ".resized.npy", out_frames.permute(0, 2, 3, 1).numpy())
            continue
        config = dict(case["config"])
        kind = config.pop("video_processor_type")
        cls = Qwen3VLVideoProcessor if kind == "Qwen3VLVideoProcessor" else Qwen2VLVideoProcessor
        proc = cls(**config, cap_pixels_per_frame=False)
        frames = np.load(case["frames"])
        t, h, w = frames.shape[:3]
        kwargs = {"do_sample_frames": bool(config.get("do_sample_frames", False))}
        if kwargs["do_sample_frames"]:
            kwargs["video_metadata"] = [VideoMetadata(total_num_frames=t, fps=case["fps"], width=w, height=h)]
        result = proc(videos=[frames], return_tensors="np", **kwargs)
        np.save(case["frames"] + ".pv.npy", result["pixel_values_videos"].astype(np.float32))
        out[name] = result["video_grid_thw"].tolist()
    json.dump(out, open(out_path, "w"))


if __name__ == "__main__":
    main(*sys.argv[1:3])
