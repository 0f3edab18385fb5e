"""Host time of the M-RoPE position ids: vectorized `jaxrl_vlm.models.rope` vs the token-by-token
reference kept in tests/test_rope.py, measured in the same run on the same inputs.

Inputs are those of scripts/bench_batching.py (Qwen3-VL-2B ids and merge size, one image of 64-576
merged tokens per episode, 350-8,700 tokens per episode): the `get_rope_index_packed` calls that
`build_train_batch` makes are recorded (packing and padding layouts) and replayed. Reported:
- per sequence: `_sequence_positions` on each episode alone (what the engine and padding do per row);
- per step: all recorded `get_rope_index_packed` calls of one step;
- end to end: `build_train_batch` (packing) with the reference vs the new position ids.
Times are the best of --repeats; the outputs are checked equal before timing.

    .venv/bin/python scripts/bench_rope.py --samples 256
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "scripts"), str(ROOT / "tests")]

import bench_batching  # noqa: E402
from test_rope import ref_get_rope_index_packed, ref_sequence_positions  # noqa: E402

from jaxrl_vlm import batching  # noqa: E402
from jaxrl_vlm.models import rope  # noqa: E402


def best_of(fn: Callable[[], Any], repeats: int) -> float:
    """Smallest wall time of `repeats` calls (the machine may be shared; the minimum is the least noisy)."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def record_packed_calls(samples: list, adv: np.ndarray, cfg, args: argparse.Namespace, packing: bool) -> list[tuple]:
    """The (tokens, segment_ids, grid) of every `get_rope_index_packed` call of one `build_train_batch`."""
    calls: list[tuple] = []
    real = batching.get_rope_index_packed

    def spy(tokens, seg, grid, cfg):
        calls.append((tokens, seg, grid))
        return real(tokens, seg, grid, cfg)

    batching.get_rope_index_packed = spy
    try:
        build_step(samples, adv, cfg, args, packing)
    finally:
        batching.get_rope_index_packed = real
    return calls


def build_step(samples: list, adv: np.ndarray, cfg, args: argparse.Namespace, packing: bool):
    return batching.build_train_batch(
        samples, adv, cfg, packing=packing, seq_buckets=args.seq_buckets, row_buckets=[1, 2, 4, 8, 16, 32],
        patch_buckets=[0, 4096, 8192, 12288, 16384, 24576, 32768, 49152, 65536], micro_batch_rows=4, row_multiple=1,
        aggregation="seq_mean_token_mean", aggregation_constant=None, overlong_policy="truncate",
    )


def report(name: str, unit: str, scale: float, ref_s: float, new_s: float) -> None:
    print(f"{name:<34} {ref_s * scale:>12.3f} {new_s * scale:>12.3f} {ref_s / new_s:>8.1f}x  ({unit})")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--samples", type=int, default=256, help="episodes per step")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--seq-buckets", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    args = p.parse_args(argv)

    cfg = bench_batching.bench_config()
    samples, adv = bench_batching.step_samples(args.seed, args.samples, 8, cfg)
    seqs = [(np.asarray(s.tokens), np.asarray(s.multimodal_train_inputs["image_grid_thw"], np.int64)) for s in samples]
    lengths = [ids.size for ids, _ in seqs]
    print(f"{args.samples} episodes: {np.mean(lengths):.0f} tokens on average (max {max(lengths)}), one image each; "
          f"best of {args.repeats}\n")

    for ids, grid in seqs:
        np.testing.assert_array_equal(
            rope._sequence_positions(ids, grid, cfg, "bench"), ref_sequence_positions(ids, list(grid), cfg, "bench")
        )
    per_seq_ref = best_of(lambda: [ref_sequence_positions(ids, list(g), cfg, "bench") for ids, g in seqs], args.repeats)
    per_seq_new = best_of(lambda: [rope._sequence_positions(ids, g, cfg, "bench") for ids, g in seqs], args.repeats)

    print(f"{'':<34} {'reference':>12} {'vectorized':>12} {'ratio':>9}")
    report("_sequence_positions, per episode", "us", 1e6 / len(seqs), per_seq_ref, per_seq_new)
    for packing in (True, False):
        calls = record_packed_calls(samples, adv, cfg, args, packing)
        for tokens, seg, grid in calls:
            for got, want in zip(rope.get_rope_index_packed(tokens, seg, grid, cfg),
                                 ref_get_rope_index_packed(tokens, seg, grid, cfg)):
                np.testing.assert_array_equal(got, want)
        ref_s = best_of(lambda: [ref_get_rope_index_packed(*c, cfg) for c in calls], args.repeats)
        new_s = best_of(lambda: [rope.get_rope_index_packed(*c, cfg) for c in calls], args.repeats)
        layout = "packing" if packing else "padding"
        report(f"get_rope_index_packed, {layout} step", f"ms, {len(calls)} micro-batches", 1e3, ref_s, new_s)

    def with_positions(fn: Callable) -> float:
        batching.get_rope_index_packed = fn
        try:
            return best_of(lambda: build_step(samples, adv, cfg, args, True), args.repeats)
        finally:
            batching.get_rope_index_packed = rope.get_rope_index_packed

    report("build_train_batch, packing step", "ms, whole host step", 1e3,
           with_positions(ref_get_rope_index_packed), with_positions(rope.get_rope_index_packed))


if __name__ == "__main__":
    main()
