"""What one clip costs, per shipped model preset: engine KV bytes and the trainer's vision FLOPs, against the same
frames shown as pictures (what a picture-only agent pays for them today).

    python scripts/bench_video_cost.py                                   # 8 s at 2 fps, 640x360, every preset
    python scripts/bench_video_cost.py --seconds 4 --fps 2 --width 1280 --height 720 --presets qwen3_vl_2b

Analytic, not timed: counts from the presets' shapes (`jaxrl_vlm.models.config.MODEL_PRESETS`) and the family's
video processor with transformers' class defaults (`rollout.video.VideoProcessorConfig`; a released checkpoint's
`video_preprocessor_config.json` may cap pixels differently). The clip's frames are sized and grouped as
`rollout.video.process_clips` does (Qwen3-VL and Qwen3.5: the whole clip within its pixel cap, 2 frames per temporal
patch; Qwen2.5-VL: each frame like a picture, 2 frames per temporal patch). Two baselines send every kept frame as a
picture (a picture repeats its one frame over the temporal patch): `same size` at the clip's frame size (the
temporal patch's saving alone), and `as pictures` at the size the image processor gives a picture (the released
checkpoints' pixel range: Qwen3-VL and Qwen3.5 65,536-16,777,216 pixels, Qwen2.5-VL 3,136-12,845,056), what an agent
that shows its frames as screenshots pays.

Printed per preset:
  frames                frames kept by the video processor
  clip grid, picture    the clip's grid (t, h, w) in patches; one frame's (h, w) patches as a picture
  tokens                the clip's tokens in the engine and the trainer: its pads (t*h*w / merge^2) plus two vision
                        markers per frame group (Qwen3 layout; Qwen2.5-VL: two per clip); Qwen3's timestamp text
                        (`<1.5 seconds>`, a few tokens per group) is left out: its length depends on the tokenizer
  KV MiB                the engine's KV cache for those tokens: full-attention layers x 2 (K, V) x kv heads x head dim
                        x 2 bytes (bf16); Qwen3.5's linear-attention layers hold a fixed state, not per-token KV
  vision GFLOP          the tower's forward over the clip's patches: patch embedding, blocks, merger (and deepstack
                        mergers) as `jaxrl_vlm.bench.flops` counts them, plus attention within each frame group
                        (Qwen2.5-VL's windowed blocks attend less: its attention term is an upper bound)
  ratio                 the clip's tokens (= KV) and vision FLOPs over each baseline's
"""

from __future__ import annotations

import argparse
import datetime

from jaxrl_vlm.bench.flops import merger_weights, vision_block_weights
from jaxrl_vlm.models.config import MODEL_PRESETS, ModelConfig, Qwen25VisionConfig, Qwen35TextConfig
from rollout.video import VideoProcessorConfig, frame_size, sample_frame_indices

# (min, max) pixels of a picture in the released checkpoints' preprocessor_config.json.
RELEASED_IMAGE_PIXELS = {"qwen3": (65_536, 16_777_216), "qwen2_5": (3_136, 12_845_056)}

DEFAULT_PRESETS = ("qwen3_vl_2b", "qwen2_5_vl_3b", "qwen3_5_2b", "qwen3_5_9b", "qwen3_vl_30b_a3b", "qwen3_5_35b_a3b")
KV_BYTES = 2  # bf16


def video_config(cfg: ModelConfig) -> VideoProcessorConfig:
    """transformers' class defaults of the family's video processor."""
    kind = "Qwen2VLVideoProcessor" if isinstance(cfg.vision, Qwen25VisionConfig) else "Qwen3VLVideoProcessor"
    return VideoProcessorConfig.from_dict({"video_processor_type": kind})


def kv_bytes(cfg: ModelConfig, tokens: int) -> int:
    t = cfg.text
    layers = (sum(1 for kind in t.layer_types if kind == "full_attention") if isinstance(t, Qwen35TextConfig)
              else t.num_hidden_layers)
    return tokens * layers * 2 * t.num_key_value_heads * t.head_dim * KV_BYTES


def vision_flops(cfg: ModelConfig, groups: int, frame_patches: int) -> float:
    """Forward FLOPs of the tower over `groups` frame groups of `frame_patches` patches each (attention stays inside
    a group)."""
    v = cfg.vision
    patches = groups * frame_patches
    matmul = 2.0 * patches * (v.patch_dim * v.hidden_size + vision_block_weights(v) * v.depth)
    matmul += 2.0 * (patches // v.merge_unit) * merger_weights(cfg) * (1 + len(v.deepstack_visual_indexes))
    attention = 4.0 * groups * frame_patches * frame_patches * v.num_heads * v.head_dim * v.depth
    return matmul + attention


def picture_grid(vc: VideoProcessorConfig, height: int, width: int) -> tuple[int, int]:
    """(h, w) patches of one frame shown as a picture at the released image processor's size."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    low, high = RELEASED_IMAGE_PIXELS["qwen3" if vc.temporal_timestamps else "qwen2_5"]
    h, w = smart_resize(height, width, factor=vc.patch_size * vc.merge_size, min_pixels=low, max_pixels=high)
    return h // vc.patch_size, w // vc.patch_size


def costs(cfg: ModelConfig, frames: int, height: int, width: int, fps: float) -> dict[str, float]:
    """Tokens and vision FLOPs of the clip and of its kept frames as pictures (same size, picture size)."""
    vc = video_config(cfg)
    kept = len(sample_frame_indices(frames, fps, vc))
    h, w = frame_size(kept, height, width, vc)
    gh, gw = h // vc.patch_size, w // vc.patch_size
    groups = -(-kept // vc.temporal_patch_size)
    merge = vc.merge_size**2
    markers = 2 * groups if vc.temporal_timestamps else 2
    ph, pw = picture_grid(vc, height, width)
    return {"frames": kept, "grid": f"{groups}x{gh}x{gw}", "picture_grid": f"{ph}x{pw}",
            "clip_tokens": groups * gh * gw // merge + markers, "clip_flops": vision_flops(cfg, groups, gh * gw),
            "same_tokens": kept * (gh * gw // merge + 2), "same_flops": vision_flops(cfg, kept, gh * gw),
            "picture_tokens": kept * (ph * pw // merge + 2), "picture_flops": vision_flops(cfg, kept, ph * pw)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=8.0)
    p.add_argument("--fps", type=float, default=2.0, help="the clip's frame rate")
    p.add_argument("--width", type=int, default=640)
    p.add_argument("--height", type=int, default=360)
    p.add_argument("--presets", nargs="+", default=list(DEFAULT_PRESETS), choices=sorted(MODEL_PRESETS))
    a = p.parse_args(argv)
    frames = max(1, round(a.seconds * a.fps))
    print(f"# bench_video_cost {datetime.date.today()}: a clip of {frames} frames ({a.seconds:g} s at {a.fps:g} fps) of "
          f"{a.width}x{a.height}; baselines: the kept frames as pictures of the clip's frame size (same size) and "
          "of a picture's size (as pictures)")
    print(f"{'preset':<18} {'frames':>6} {'clip grid':>10} {'picture':>8} {'tokens clip/same/pictures':>26} "
          f"{'KV MiB clip/pictures':>21} {'vision GFLOP clip/same/pictures':>32} {'clip/same':>10} {'clip/pictures':>14}")
    for name in a.presets:
        cfg = MODEL_PRESETS[name]()
        c = costs(cfg, frames, a.height, a.width, a.fps)
        tokens = f"{c['clip_tokens']}/{c['same_tokens']}/{c['picture_tokens']}"
        kv = f"{kv_bytes(cfg, c['clip_tokens']) / 2**20:.1f}/{kv_bytes(cfg, c['picture_tokens']) / 2**20:.1f}"
        flops = f"{c['clip_flops'] / 1e9:.0f}/{c['same_flops'] / 1e9:.0f}/{c['picture_flops'] / 1e9:.0f}"
        same = f"{c['clip_tokens'] / c['same_tokens']:.2f}/{c['clip_flops'] / c['same_flops']:.2f}"
        pictures = f"{c['clip_tokens'] / c['picture_tokens']:.3f}/{c['clip_flops'] / c['picture_flops']:.3f}"
        print(f"{name:<18} {c['frames']:>6} {c['grid']:>10} {c['picture_grid']:>8} {tokens:>26} {kv:>21} {flops:>32} "
              f"{same:>10} {pictures:>14}")
    print("ratios: tokens (= KV bytes) / vision FLOPs of the clip over each baseline's")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
