"""Padding efficiency and compiled-program count of TrainBatch layouts: plain padding vs packing.

A realistic multi-turn VLM length mix (issue 6): each episode has a prompt of 300-1,200 tokens that
includes one image, then 1-5 turns of 50-1,500 tokens each (the model's reply, and for every turn
but the last an environment observation taking part of it). Each step builds one TrainBatch from
`--samples` episodes with the same buckets, and we report:
- padding efficiency = real tokens / token slots (K * R * T), per step (mean and min);
- distinct (K, R, T, P) shapes over all steps = programs the train step compiles;
- patch efficiency = real image patches / patch slots (K * P), the vision tower's padding;
- host time per step (numpy layout, M-RoPE and vision index computation).

The image patches are zero rows of a narrowed width: the layout depends only on the patch COUNT
(image_grid_thw), so we keep Qwen3-VL-2B's merge size and grids but not 1,536 floats per patch.

    .venv/bin/python scripts/bench_batching.py --samples 256 --steps 6
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jaxrl_vlm.batching import TrainBatch, build_train_batch, describe_shapes  # noqa: E402
from jaxrl_vlm.models.config import Qwen3VLConfig, qwen3_vl_2b_instruct  # noqa: E402
from rollout.sample import Sample  # noqa: E402


def bench_config() -> Qwen3VLConfig:
    """Qwen3-VL-2B ids, merge size and position table; pixel rows narrowed to 1 x 1 x 2 x 2 = 4 floats."""
    cfg = qwen3_vl_2b_instruct()
    vision = dataclasses.replace(cfg.vision, in_channels=1, temporal_patch_size=1, patch_size=2)
    return dataclasses.replace(cfg, vision=vision)


def episode(rng: np.random.Generator, cfg: Qwen3VLConfig, group: int, index: int) -> Sample:
    """One synthetic episode with the issue's length mix (image pads expanded, as in training)."""
    merge = cfg.vision.spatial_merge_size
    prompt_len = int(rng.integers(300, 1201))
    # Image of 256..2304 patches (e.g. 256x256 .. 768x768 pixels at patch 16): 64..576 merged tokens,
    # kept below the prompt length so the prompt keeps some text.
    while True:
        h, w = (int(x) * merge for x in rng.integers(8, 25, size=2))
        if h * w // merge**2 + 2 <= prompt_len - 20:
            break
    n_img = h * w // merge**2
    text = rng.integers(0, 150000, size=prompt_len - n_img - 2)
    cut = int(rng.integers(1, text.size))
    prompt = np.concatenate([text[:cut], [cfg.vision_start_token_id], np.full(n_img, cfg.image_token_id),
                             [cfg.vision_end_token_id], text[cut:]])
    s = Sample(group_index=group, index=index)
    s.set_prompt_tokens(prompt.tolist())
    n_turns = int(rng.integers(1, 6))
    for turn in range(n_turns):
        turn_len = int(rng.integers(50, 1501))
        obs = 0 if turn == n_turns - 1 else int(turn_len * rng.uniform(0.1, 0.4))
        reply = turn_len - obs
        s.append_model_tokens(rng.integers(0, 150000, size=reply).tolist(), (-rng.exponential(0.5, size=reply)).tolist())
        if obs:
            s.append_observation_tokens(rng.integers(0, 150000, size=obs).tolist())
    s.multimodal_train_inputs = {
        "pixel_values": np.zeros((h * w, cfg.vision.patch_dim), np.float32),
        "image_grid_thw": np.array([[1, h, w]]),
    }
    return s


def step_samples(seed: int, n: int, group_size: int, cfg: Qwen3VLConfig) -> tuple[list[Sample], np.ndarray]:
    rng = np.random.default_rng(seed)
    samples = [episode(rng, cfg, i // group_size, i) for i in range(n)]
    return samples, rng.normal(size=n)


def run(args: argparse.Namespace) -> dict[str, list[TrainBatch]]:
    cfg = bench_config()
    common = dict(
        seq_buckets=args.seq_buckets, row_buckets=args.row_buckets, patch_buckets=args.patch_buckets,
        micro_batch_rows=args.micro_batch_rows, row_multiple=args.row_multiple, aggregation="seq_mean_token_mean",
        aggregation_constant=None, overlong_policy="truncate",
    )
    results: dict[str, list[TrainBatch]] = {"padding": [], "packing": []}
    times: dict[str, list[float]] = {"padding": [], "packing": []}
    for step in range(args.steps):
        samples, adv = step_samples(args.seed + step, args.samples, args.group_size, cfg)
        for mode in results:
            t0 = time.perf_counter()
            batch = build_train_batch(samples, adv, cfg, packing=mode == "packing", **common)
            times[mode].append(time.perf_counter() - t0)
            results[mode].append(batch)
    lengths = [len(s.tokens) for s in samples]
    print(f"{args.samples} episodes/step x {args.steps} steps; last step lengths: mean {np.mean(lengths):.0f}, "
          f"max {max(lengths)} tokens")
    rows = f"R={args.micro_batch_rows}" if args.micro_batch_rows else f"from {args.row_buckets}"
    print(f"buckets: seq {args.seq_buckets}, rows {rows}, patches {args.patch_buckets}, row multiple {args.row_multiple}\n")
    header = (f"{'layout':<9} {'eff mean':>9} {'eff min':>8} {'shapes':>7} {'patch eff':>10} {'host s/step':>12}"
              "  shapes (K, R, T, P): steps")
    print(header)
    print("-" * len(header))
    summary = {}
    for mode, batches in results.items():
        eff = np.array([b.layout.padding_efficiency for b in batches])
        peff = np.array([b.layout.patch_efficiency for b in batches])
        shapes = describe_shapes(batches)
        summary[mode] = (eff.mean(), len(shapes), peff.mean())
        listing = ", ".join(f"{k}: {v}" for k, v in sorted(shapes.items()))
        print(f"{mode:<9} {eff.mean():>9.1%} {eff.min():>8.1%} {len(shapes):>7d} {peff.mean():>10.1%} "
              f"{np.mean(times[mode]):>12.3f}  {listing}")
    ratio = summary["packing"][0] / summary["padding"][0]
    patch_ratio = summary["packing"][2] / summary["padding"][2]
    print(f"{'ratio':<9} {ratio:>8.2f}x {'':>8} {'':>7} {patch_ratio:>9.2f}x   (packing / padding)")
    truncated = sum(len(b.layout.truncated) for b in results["packing"])
    print(f"\ntruncated episodes (longer than {max(args.seq_buckets)}): {truncated}")
    eff, n_shapes, _ = summary["packing"]
    verdict = "MET" if eff >= 0.90 and n_shapes <= 4 else "NOT MET"
    print(f"target packing >= 90% efficiency with <= 4 shapes: {verdict} ({eff:.1%}, {n_shapes} shapes)")
    return results


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--samples", type=int, default=256, help="episodes per step")
    p.add_argument("--group-size", type=int, default=8, help="samples per prompt")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--seq-buckets", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    p.add_argument("--row-buckets", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    p.add_argument("--micro-batch-rows", type=int, default=4, help="rows per micro-batch (0: from --row-buckets)")
    p.add_argument("--row-multiple", type=int, default=1, help="data-parallel shards of the batch axis")
    p.add_argument("--patch-buckets", type=int, nargs="+",
                   default=[0, 4096, 8192, 12288, 16384, 24576, 32768, 49152, 65536])
    args = p.parse_args(argv)
    args.micro_batch_rows = args.micro_batch_rows or None
    run(args)


if __name__ == "__main__":
    main()
