"""Clips for the Qwen-VL families: frame sampling, resizing, temporal patches and timestamps, in numpy.

Why not transformers' video processors: they need torchvision, which the project does not install (see
`processing.py` for the images). This module reproduces them from the checkpoint's video preprocessor config:
`Qwen3VLVideoProcessor` (Qwen3-VL, Qwen3-VL-MoE, Qwen3.5, Qwen3.5-MoE: the frame size is chosen for the whole
clip, with the temporal factor, and a timestamp is written before every frame group) and `Qwen2VLVideoProcessor`
(Qwen2.5-VL: each frame sized like a picture; time reaches the model through `second_per_grid_ts`). The sizes come
from transformers' own `smart_resize` functions, which import without torchvision. tests/vllm_real checks the
output against transformers' own processors, run in the vLLM venv (which has torchvision).

A clip is a list of frames (RGB, one size) and the frame rate they were taken at. Frames are sampled as the
processor would (`sample_frame_indices`), padded to a multiple of the temporal patch size with the last frame,
resized bit for bit as torchvision's antialiased bicubic resize of uint8 frames (`resize_bicubic_uint8`; Pillow's
bicubic differs from it by a level on ~0.3% of the values), rescaled and normalized, and cut into patches of
`temporal_patch_size x patch_size x patch_size` in merge-window order: the layout of `pixel_values_videos`.

Never imports jax.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
from PIL import Image

from rollout.processing import CLIP_IMAGE_MEAN, CLIP_IMAGE_STD

__all__ = ["Clip", "ClipError", "ProcessedClips", "VideoProcessorConfig", "frame_group_timestamps",
           "load_video_processor_config", "max_clip_frame_patches", "optional_video_config", "process_clips", "resize_bicubic_uint8", "sample_frame_indices"]


class ClipError(ValueError):
    """A clip that cannot be processed; the message names the clip and why."""


@dataclass(frozen=True)
class Clip:
    """Frames in time order (each [H, W, 3] uint8 RGB, all one size) and the rate they were taken at."""

    frames: np.ndarray  # [T, H, W, 3] uint8
    fps: float

    @staticmethod
    def of(frames: Sequence[Image.Image | np.ndarray] | np.ndarray, fps: float) -> "Clip":
        arrays = [np.asarray(f.convert("RGB") if isinstance(f, Image.Image) else f) for f in frames]
        if not arrays:
            raise ClipError("a clip needs at least one frame")
        shapes = {a.shape for a in arrays}
        if len(shapes) != 1:
            raise ClipError(f"a clip's frames must share one size, got {sorted(shapes)}")
        stack = np.stack(arrays)
        if stack.ndim != 4 or stack.shape[-1] != 3 or stack.dtype != np.uint8:
            raise ClipError(f"frames must be [H, W, 3] uint8 RGB, got {stack.shape[1:]} {stack.dtype}")
        if not (fps > 0 and math.isfinite(fps)):
            raise ClipError(f"a clip's fps must be a positive number, got {fps!r}")
        return Clip(stack, float(fps))


@dataclass(frozen=True)
class VideoProcessorConfig:
    """What the family's video processor reads from `video_preprocessor_config.json` (transformers' defaults)."""

    temporal_timestamps: bool  # Qwen3VLVideoProcessor (whole-clip sizing, timestamps) vs Qwen2VLVideoProcessor
    patch_size: int
    temporal_patch_size: int
    merge_size: int
    min_pixels: int  # size["shortest_edge"]
    max_pixels: int  # size["longest_edge"]
    image_mean: tuple[float, float, float]
    image_std: tuple[float, float, float]
    do_sample_frames: bool
    fps: float | None
    num_frames: int | None
    min_frames: int
    max_frames: int

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> "VideoProcessorConfig":
        kind = d.get("video_processor_type") or d.get("processor_class") or ""
        qwen3 = "Qwen3VL" in kind
        if not qwen3 and "Qwen2VL" not in kind:
            raise ClipError(f"video processor {kind!r}: only Qwen3VLVideoProcessor and Qwen2VLVideoProcessor are known")
        size = dict(d.get("size") or {})
        if "min_pixels" in d:
            size["shortest_edge"] = d["min_pixels"]
        if "max_pixels" in d:
            size["longest_edge"] = d["max_pixels"]
        default_size = ({"shortest_edge": 128 * 32 * 32, "longest_edge": 32 * 32 * 768} if qwen3
                        else {"shortest_edge": 128 * 28 * 28, "longest_edge": 28 * 28 * 768})
        if d.get("cap_pixels_per_frame"):
            raise ClipError("cap_pixels_per_frame is not supported (transformers' default is off)")
        return VideoProcessorConfig(
            temporal_timestamps=qwen3,
            patch_size=int(d.get("patch_size", 16 if qwen3 else 14)),
            temporal_patch_size=int(d.get("temporal_patch_size", 2)),
            merge_size=int(d.get("merge_size", 2)),
            min_pixels=int(size.get("shortest_edge", default_size["shortest_edge"])),
            max_pixels=int(size.get("longest_edge", default_size["longest_edge"])),
            image_mean=tuple(d.get("image_mean", (0.5, 0.5, 0.5) if qwen3 else CLIP_IMAGE_MEAN)),
            image_std=tuple(d.get("image_std", (0.5, 0.5, 0.5) if qwen3 else CLIP_IMAGE_STD)),
            do_sample_frames=bool(d.get("do_sample_frames", qwen3)),
            fps=_optional_float(d.get("fps", 2 if qwen3 else None)),
            num_frames=None if d.get("num_frames") is None else int(d["num_frames"]),
            min_frames=int(d.get("min_frames", 4)),
            max_frames=int(d.get("max_frames", 768)),
        )


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)


def load_video_processor_config(model_dir: str | Path) -> VideoProcessorConfig:
    """The checkpoint's `video_preprocessor_config.json` (released Qwen-VL checkpoints and tiny ones ship it)."""
    path = Path(model_dir) / "video_preprocessor_config.json"
    if not path.is_file():
        raise ClipError(f"{model_dir} has no video_preprocessor_config.json: clips cannot be processed for this model")
    try:
        return VideoProcessorConfig.from_dict(json.loads(path.read_text(encoding="utf-8")))
    except json.JSONDecodeError as e:
        raise ClipError(f"{path}: not valid JSON ({e})") from e


def optional_video_config(model_dir: str | Path) -> VideoProcessorConfig | None:
    """The checkpoint's video processor config, or None when it ships none (clips are then refused by name)."""
    if not (Path(model_dir) / "video_preprocessor_config.json").is_file():
        return None
    return load_video_processor_config(model_dir)


def max_clip_frame_patches(cfg: VideoProcessorConfig) -> int:
    """The most patches one frame of a clip can have after this processor: Qwen3-VL's sizing keeps the whole clip
    (at least one temporal patch of frames) within `max_pixels`, Qwen2-VL's each frame. The trainer's vision
    attention bound takes the larger of this and the pictures' (`processing.max_frame_patches`)."""
    frames = cfg.temporal_patch_size if cfg.temporal_timestamps else 1
    return cfg.max_pixels // frames // cfg.patch_size**2


def sample_frame_indices(total: int, clip_fps: float, cfg: VideoProcessorConfig) -> np.ndarray:
    """The frames the processor keeps of a `total`-frame clip taken at `clip_fps` (all of them when the config does
    not sample), as transformers' `sample_frames` of the family computes them."""
    if not cfg.do_sample_frames:
        return np.arange(total)
    num, fps = cfg.num_frames, (None if cfg.num_frames is not None else cfg.fps)  # a set num_frames wins
    if cfg.temporal_timestamps:
        if num is None and fps is not None:
            num = min(max(int(total / clip_fps * fps), cfg.min_frames), cfg.max_frames, total)
        if num is None:
            num = min(max(total, cfg.min_frames), cfg.max_frames)
        return np.linspace(0, total - 1, num).round().astype(int)
    tp = cfg.temporal_patch_size
    if num is not None:
        num = round(num / tp) * tp
    elif fps is not None:
        most = math.floor(min(cfg.max_frames, total) / tp) * tp
        num = math.floor(min(max(total / clip_fps * fps, cfg.min_frames), most, total) / tp) * tp
    if num is None:
        return np.arange(total)
    if num > total or num <= 0:
        raise ClipError(f"cannot sample {num} frames of a {total}-frame clip")
    # torch.arange(0, total, total / num).int(): float steps, truncated
    return np.arange(0, total, np.float32(total) / np.float32(num), dtype=np.float32).astype(int)[:num]


def frame_group_timestamps(indices: Sequence[int], clip_fps: float, temporal_patch_size: int) -> list[float]:
    """Seconds of each frame group (the mean of its first and last frame's time), as Qwen3-VL's processor writes
    them before each group; a short last group repeats its last frame."""
    idx = list(int(i) for i in indices)
    if len(idx) % temporal_patch_size:
        idx += [idx[-1]] * (temporal_patch_size - len(idx) % temporal_patch_size)
    times = [i / clip_fps for i in idx]
    return [(times[k] + times[k + temporal_patch_size - 1]) / 2 for k in range(0, len(times), temporal_patch_size)]


def sampled_fps(clip: Clip, cfg: VideoProcessorConfig) -> float:
    """The frame rate the kept frames stand for: the config's when it samples by rate, else the clip's own (what
    transformers' Qwen2.5-VL processor turns into `second_per_grid_ts` when called with the clip's fps)."""
    return cfg.fps if cfg.do_sample_frames and cfg.num_frames is None and cfg.fps else clip.fps


def frame_size(num_frames: int, height: int, width: int, cfg: VideoProcessorConfig) -> tuple[int, int]:
    """The (height, width) every frame is resized to, by transformers' own `smart_resize` of the family."""
    factor = cfg.patch_size * cfg.merge_size
    if cfg.temporal_timestamps:
        from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize as clip_resize

        return clip_resize(num_frames, height, width, temporal_factor=cfg.temporal_patch_size, factor=factor,
                           min_pixels=cfg.min_pixels, max_pixels=cfg.max_pixels)
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as frame_resize

    return frame_resize(height, width, factor=factor, min_pixels=cfg.min_pixels, max_pixels=cfg.max_pixels)


@dataclass(frozen=True)
class ProcessedClips:
    """`pixel_values_videos` [P, C*T*p*p] float32 and `video_grid_thw` [N, 3] of N clips, as the processor gives
    them; per clip the sampled frame indices, the seconds of each frame group (Qwen3-VL's timestamps) and the
    seconds one temporal patch spans (Qwen2.5-VL's `second_per_grid_ts`)."""

    pixel_values_videos: np.ndarray
    video_grid_thw: np.ndarray
    frame_indices: list[np.ndarray]
    timestamps: list[list[float]]
    second_per_grid_ts: np.ndarray


def _bicubic_taps(in_size: int, out_size: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Source index [out, k], int16-range weight [out, k] and precision bits of an antialiased bicubic resize of one
    axis, as torch's uint8 kernel computes them (`_upsample_bicubic2d_aa`, which torchvision's `resize` runs on uint8
    frames): Keys' cubic with a = -0.5 widened by the scale when shrinking, weights in float64 normalized per output
    pixel, then fixed point with as many bits as keep the largest weight in int16."""
    scale = in_size / out_size
    support = 2.0 * scale if scale >= 1.0 else 2.0
    invscale = 1.0 / scale if scale >= 1.0 else 1.0
    centers = scale * (np.arange(out_size) + 0.5)
    first = np.maximum((centers - support + 0.5).astype(np.int64), 0)
    sizes = np.minimum((centers + support + 0.5).astype(np.int64), in_size) - first
    k = int(sizes.max())
    taps = np.arange(k)
    x = np.abs((taps[None, :] + first[:, None] - centers[:, None] + 0.5) * invscale)
    a = -0.5
    w = np.where(x < 1, ((a + 2) * x - (a + 3)) * x * x + 1, np.where(x < 2, (((x - 5) * x + 8) * x - 4) * a, 0.0))
    w = np.where(taps[None, :] < sizes[:, None], w, 0.0)
    total = w.sum(1, keepdims=True)
    w = np.where(total != 0, w / np.where(total != 0, total, 1.0), w)
    bits = 0
    while bits < 22 and int(0.5 + w.max() * (1 << (bits + 1))) < (1 << 15):
        bits += 1
    fixed = np.trunc(w * (1 << bits) + np.where(w < 0, -0.5, 0.5)).astype(np.int64)
    index = np.where(taps[None, :] < sizes[:, None], first[:, None] + taps[None, :], first[:, None])
    return index, fixed, bits


def _resize_axis(x: np.ndarray, axis: int, out_size: int) -> np.ndarray:
    index, weight, bits = _bicubic_taps(x.shape[axis], out_size)
    x = np.moveaxis(x, axis, -1).astype(np.int64)
    acc = np.full(x.shape[:-1] + (out_size,), 1 << (bits - 1), np.int64)
    for j in range(index.shape[1]):
        acc += x[..., index[:, j]] * weight[:, j]
    return np.moveaxis(np.clip(acc >> bits, 0, 255).astype(np.uint8), -1, axis)


def resize_bicubic_uint8(frames: np.ndarray, height: int, width: int) -> np.ndarray:
    """[T, H, W, C] uint8 frames resized to (height, width) bit for bit as torchvision's antialiased bicubic
    `resize` does on uint8 tensors (transformers' video processors): width first, rounded to uint8, then height."""
    if frames.shape[2] != width:
        frames = _resize_axis(frames, 2, width)
    if frames.shape[1] != height:
        frames = _resize_axis(frames, 1, height)
    return frames


def _patchify(frames: np.ndarray, cfg: VideoProcessorConfig) -> tuple[np.ndarray, tuple[int, int, int]]:
    """[T, C, H, W] float32 -> patches [t*h*w, C*tp*p*p] in merge-window order and the grid (t, h, w)."""
    tp, p, m = cfg.temporal_patch_size, cfg.patch_size, cfg.merge_size
    if pad := -frames.shape[0] % tp:
        frames = np.concatenate([frames, np.repeat(frames[-1:], pad, axis=0)])
    t, c, height, width = frames.shape
    gt, gh, gw = t // tp, height // p, width // p
    x = frames.reshape(gt, tp, c, gh // m, m, p, gw // m, m, p)
    x = x.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return np.ascontiguousarray(x.reshape(gt * gh * gw, c * tp * p * p)), (gt, gh, gw)


def process_clips(clips: Sequence[Clip], cfg: VideoProcessorConfig) -> ProcessedClips:
    """Every clip through the family's video processor; patches of all clips concatenated in order."""
    mean = np.asarray(cfg.image_mean, np.float32)[:, None, None]
    std = np.asarray(cfg.image_std, np.float32)[:, None, None]
    patches, grids, indices, stamps, seconds = [], [], [], [], []
    for n, clip in enumerate(clips):
        idx = sample_frame_indices(clip.frames.shape[0], clip.fps, cfg)
        frames = clip.frames[idx]
        height, width = frames.shape[1:3]
        try:
            new_h, new_w = frame_size(len(idx), height, width, cfg)
        except ValueError as e:
            raise ClipError(f"clip {n} ({len(idx)} frames of {width}x{height}): {e}") from e
        x = resize_bicubic_uint8(frames, new_h, new_w).transpose(0, 3, 1, 2).astype(np.float32)
        # transformers fuses rescale and normalize: (x - 255 mean) / (255 std), in float32
        x = (x - mean * np.float32(255)) / (std * np.float32(255))
        flat, grid = _patchify(x, cfg)
        patches.append(flat)
        grids.append(grid)
        indices.append(idx)
        stamps.append(frame_group_timestamps(idx, clip.fps, cfg.temporal_patch_size))
        seconds.append(cfg.temporal_patch_size / sampled_fps(clip, cfg))
    dim = 3 * cfg.temporal_patch_size * cfg.patch_size**2
    return ProcessedClips(
        np.concatenate(patches) if patches else np.zeros((0, dim), np.float32),
        np.asarray(grids, np.int64).reshape(-1, 3), indices, stamps, np.asarray(seconds, np.float32))
