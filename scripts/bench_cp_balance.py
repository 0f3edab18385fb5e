"""Work per device of the `pallas_gpu` attention under context parallelism: contiguous query blocks (device d of cp
attends queries [d T/cp, (d+1) T/cp)) against the zig-zag order the model runs (device d attends chunks d and
2cp - 1 - d of the row's 2cp), counted in the same run.

Work is the (query block, key block) tiles the kernels visit per row and head, from their own loop bounds
(`block_flash.device_tiles`; the backward visits the same tiles as the forward), with the block sizes the model
picks (`flash_attention.block_size`). The slowest device sets the layer's time, so the figure is slowest / mean
(1.0 = balanced). These are counts, not timings.

`--collectives T`: the price of the order, measured: the attention's forward + backward compiled (not run) on
cp simulated CPU devices at T tokens with Qwen3-VL-2B's attention heads (16 query, 8 key/value heads of 128, fp32),
and the per-device bytes of its collectives read from the optimized HLO (`bench.hlo`): the K/V all-gather (and
the dk/dv reduction) every CP attention pays, and the collective-permutes that move query and output chunks.

    .venv/bin/python scripts/bench_cp_balance.py --tokens 32768 --cp 2 4 8 [--collectives 4096]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")  # before jax is imported

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402

from jaxrl_vlm.bench.context_row import collective_bytes, context_row  # noqa: E402
from jaxrl_vlm.models.activation_sharding import activation_sharding  # noqa: E402
from jaxrl_vlm.models.block_flash import device_tiles  # noqa: E402
from jaxrl_vlm.models.flash_attention import block_size, flash_attention  # noqa: E402


def balance(t: int, cp: int) -> dict[str, object]:
    """Tiles per device and slowest/mean for contiguous blocks and for the zig-zag order at t tokens, cp devices."""
    contiguous = device_tiles(t, cp, block_size(t // cp), block_size(t), zigzag=False)
    zigzag = device_tiles(t, cp, block_size(t // (2 * cp)), block_size(t))
    mean = sum(contiguous) / cp
    return {
        "contiguous": contiguous, "zigzag": zigzag,
        "before": max(contiguous) / mean, "after": max(zigzag) / (sum(zigzag) / cp),
        "slowest_speedup": max(contiguous) / max(zigzag),
    }


def attention_collectives(t: int, cp: int, heads: int = 16, kv_heads: int = 8, head_dim: int = 128) -> dict[str, int]:
    """Per-device bytes by collective kind of the `pallas_gpu` attention's loss and gradients on one t-token row
    split over cp simulated devices (compiled only)."""
    mesh, spec, q, kv, seg = context_row(t, cp, heads, kv_heads, head_dim)

    def loss(q, k, v, seg):
        with activation_sharding(spec):
            return jnp.sum(flash_attention(q, k, v, seg, impl="pallas_gpu", scale=head_dim**-0.5, causal=True))

    # q, k, v arrive split over the context axis as the decoder layer holds them; the segment ids whole.
    split = NamedSharding(mesh, PartitionSpec(None, "context"))
    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)), in_shardings=(split, split, split, None),
                   out_shardings=(None, (split, split, split)))
    return collective_bytes(step.lower(q, kv, kv, seg).compile(), mesh)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[32768], help="tokens per row")
    p.add_argument("--cp", type=int, nargs="+", default=[2, 4, 8], help="context-parallel group sizes")
    p.add_argument("--collectives", type=int, default=0, metavar="T",
                   help="also compile the attention at T tokens and print its collective bytes per device")
    args = p.parse_args(argv)
    print("| tokens | cp | tiles per device, contiguous | zig-zag | slowest/mean contiguous | zig-zag "
          "| slowest device, contiguous / zig-zag |")
    print("|---:|---:|---|---|---:|---:|---:|")
    for t in args.tokens:
        for cp in args.cp:
            r = balance(t, cp)
            c, z = r["contiguous"], r["zigzag"]
            span = lambda x: f"{min(x):,} ... {max(x):,}" if min(x) != max(x) else f"{x[0]:,} each"  # noqa: E731
            print(f"| {t:,} | {cp} | {span(c)} | {span(z)} | {r['before']:.3f} | {r['after']:.3f} "
                  f"| {r['slowest_speedup']:.3f}x |")
    if args.collectives:
        t = args.collectives
        mib = lambda b: f"{b / 2**20:,.1f}"  # noqa: E731
        print(f"\nCollectives per device, attention forward + backward, {t:,} tokens, MiB:")
        print("| cp | all-gather | reduce-scatter | all-reduce | collective-permute (zig-zag q, o moves) |")
        print("|---:|---:|---:|---:|---:|")
        for cp in args.cp:
            b = attention_collectives(t, cp)
            print(f"| {cp} | {mib(b['all-gather'])} | {mib(b['reduce-scatter'])} | {mib(b['all-reduce'])} "
                  f"| {mib(b['collective-permute'])} |")


if __name__ == "__main__":
    main()
