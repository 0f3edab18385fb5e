"""`jaxrl-vlm bench sharding ...`: argument parser and handler (imports jax only when the command runs).

    jaxrl-vlm bench sharding --config CONFIG --layouts configs/mesh/*.yaml [--model tiny|tiny_qwen2_5_vl|tiny_qwen3_vl_moe|small|qwen3_vl_2b|qwen2_5_vl_3b]
        [--steps N] [--out DIR] [--rows R --seq-len T] [--compile-only] [--device-memory-gb G]
        [--simulate-cpu-devices 8] [--flag value ...]

Unrecognised `--flag value` pairs are run-config overrides (`--micro-batch-size 8`, `--remat full`, ...).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from jaxrl_vlm.bench.flops import MODEL_SHAPES  # jax-free, like this module
from jaxrl_vlm.config import ConfigError

DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


def add_bench_parser(sub: Any) -> None:
    """Register `bench` (with its `sharding` target) on the top-level subparsers."""
    p = sub.add_parser("bench", help="Benchmarks that compile the real train step (sharding layouts).")
    targets = p.add_subparsers(dest="bench_command", required=True)
    s = targets.add_parser("sharding", help="Compare mesh layouts: step time, memory, FLOPs/MFU, collective bytes.")
    s.usage = (
        f"jaxrl-vlm bench sharding --config CONFIG --layouts configs/mesh/*.yaml [--model {'|'.join(MODEL_SHAPES)}] "
        "[--steps N] [--out DIR] [--flag value ...]"
    )
    s.add_argument("--config", default=None, help="Run config YAML (loss, optimizer, dtypes, remat, micro-batch size).")
    s.add_argument("--layouts", nargs="+", required=True, help="Mesh layout YAML files (configs/mesh/*.yaml).")
    s.add_argument("--model", choices=MODEL_SHAPES, default="tiny",
                   help="Model shape (random init; qwen3_vl_2b and qwen2_5_vl_3b are the real architectures; tiny_qwen2_5_vl the make-tiny Qwen2.5-VL).")
    s.add_argument("--steps", type=int, default=3, help="Timed steps per layout (median reported).")
    s.add_argument("--warmup", type=int, default=1, help="Untimed steps before timing.")
    s.add_argument("--rows", type=int, default=8, help="Batch rows (a multiple of every layout's batch shards).")
    s.add_argument("--seq-len", type=int, nargs="+", default=[512],
                   help="Tokens per row; several values run the whole comparison once per length.")
    s.add_argument("--context-sizes", type=int, nargs="+", default=None,
                   help="Run each layout at each context-parallel size N (--mesh-context N, on the first N x its "
                        "other fixed axis sizes devices) and print per-device memory by length and size.")
    s.add_argument("--fill", type=float, default=0.8, help="Synthetic tokens / (rows * seq-len).")
    s.add_argument("--seed", type=int, default=0, help="Seed of the synthetic batch and the random init (shadows the run config's --seed).")
    s.add_argument("--out", default="runs/bench_sharding", help="Directory for the CSV, JSON, PNG and table.")
    s.add_argument("--compile-only", action="store_true",
                   help="Only compile and size each layout (memory, FLOPs, collectives); nothing is allocated or run.")
    s.add_argument("--device-memory-gb", type=float, default=None,
                   help="Per-device memory to check fit against (default: what the device reports).")
    s.add_argument("--num-devices", type=int, default=None, help="Use the first N devices (default: all).")
    s.add_argument("--simulate-cpu-devices", type=int, default=None,
                   help="Run on N simulated CPU devices (sets XLA_FLAGS before jax starts).")
    s.add_argument("--no-peak", action="store_true", help="Skip the matmul peak measurement (no MFU).")
    s.set_defaults(func=run_bench_command)


def simulate_cpu_devices(n: int) -> None:
    """Make jax start with `n` CPU devices; must run before jax is imported."""
    if "jax" in sys.modules:
        raise RuntimeError("--simulate-cpu-devices must be applied before jax is imported")
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(DEVICE_COUNT_FLAG)]
    os.environ["XLA_FLAGS"] = " ".join([*flags, f"{DEVICE_COUNT_FLAG}={n}"])
    os.environ["JAX_PLATFORMS"] = "cpu"


def run_bench_command(ns: argparse.Namespace, rest: list[str]) -> int:
    if ns.bench_command != "sharding":
        raise ConfigError(f"bench: unknown target {ns.bench_command!r}")
    if ns.simulate_cpu_devices:
        simulate_cpu_devices(ns.simulate_cpu_devices)
    # Local on purpose: jax must be imported after `simulate_cpu_devices` has set XLA_FLAGS.
    import jax

    from jaxrl_vlm.bench.sharding_bench import (
        BenchOptions,
        format_context_table,
        format_table,
        run_sharding_bench,
        write_outputs,
    )

    try:
        runs = [BenchOptions(
            model=ns.model, rows=ns.rows, seq_len=seq_len, fill=ns.fill, steps=ns.steps, warmup=ns.warmup,
            seed=ns.seed, compile_only=ns.compile_only, measure_peak=not ns.no_peak,
            device_memory_bytes=None if ns.device_memory_gb is None else int(ns.device_memory_gb * 2**30),
        ) for seq_len in ns.seq_len]
    except ValueError as e:
        raise ConfigError(f"bench sharding: {e}") from e
    devices = jax.devices()
    if ns.num_devices is not None:
        if not 1 <= ns.num_devices <= len(devices):
            raise ConfigError(f"bench sharding: --num-devices {ns.num_devices} but {len(devices)} devices are visible")
        devices = devices[: ns.num_devices]
    reports = []
    for opts in runs:
        report = run_sharding_bench(
            ns.config, ns.layouts, opts, overrides=rest, devices=devices, context_sizes=ns.context_sizes,
            on_result=lambda r: print(f"[bench] {r.layout}: {r.status}" + (f" ({r.reason})" if r.reason else ""), file=sys.stderr),
        )
        print(format_table(report))
        stem = "sharding_bench" if len(runs) == 1 else f"sharding_bench_{opts.seq_len}"
        paths = write_outputs(report, ns.out, stem)
        print("wrote " + ", ".join(str(p) for p in paths.values()))
        reports.append(report)
    if ns.context_sizes:
        print(format_context_table(reports))
    return 0
