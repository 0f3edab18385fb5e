"""LoRA vs full fine-tuning: trainer state bytes, weight-sync bytes per step and the compiled train step's memory.

    python scripts/bench_lora.py                       # tiny, small and the Qwen3-VL 2B preset, rank 16
    python scripts/bench_lora.py --models tiny small --rank 8 --no-compile

Per model, from shapes only (nothing is allocated): the trainer state (full: fp32 parameters and Adam's two moments;
LoRA: the frozen base in the compute dtype, fp32 adapters and their moments), the bytes one weight sync moves in the
sync dtype (full: every parameter; LoRA: the adapters), and, unless --no-compile, the per-device peak of the
compiled train step on one device (XLA's memory_analysis of the real `train_step`, AOT-compiled from abstract
state, on a synthetic multi-turn batch of --seq-len tokens). Each line prints the full/LoRA ratio.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxrl_vlm.bench.sharding_bench import BenchOptions, bench_batch, bench_samples, model_config, plan_state, step_config  # noqa: E402
from jaxrl_vlm.config import load_config  # noqa: E402
from jaxrl_vlm.lora.adapters import abstract_adapters, adapter_nbytes, adapter_shardings, lora_setup  # noqa: E402
from jaxrl_vlm.lora.options import LoraOptions  # noqa: E402
from jaxrl_vlm.rl.train_step import TrainState, train_step  # noqa: E402
from jaxrl_vlm.sharding.layout import batch_shardings, build_mesh  # noqa: E402
from jaxrl_vlm.sharding.rules import resolve_rules  # noqa: E402

MODELS = {"tiny": "tiny", "small": "small", "2b": "qwen3_vl_2b"}


def tree_bytes(tree: Any) -> int:
    return sum(int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def cast(tree: Any, dtype: Any) -> Any:
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, dtype, sharding=getattr(x, "sharding", None)), tree)


def peak_bytes(compiled: Any) -> int | None:
    mem = compiled.memory_analysis()
    if mem is None:
        return None
    return int(mem.argument_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes + mem.temp_size_in_bytes)


def measure(name: str, ns: argparse.Namespace) -> dict[str, Any]:
    model_cfg = model_config(MODELS[name])
    cfg = load_config(None, ["--param-dtype", "float32", "--compute-dtype", ns.compute_dtype, "--remat", "full",
                             "--mesh-data", "1", "--lora-rank", str(ns.rank), "--lora-alpha", str(2 * ns.rank)])
    devices = jax.devices()[:1]
    mesh = build_mesh(cfg.mesh, devices)
    rules = resolve_rules(cfg.mesh.sharding_rules)
    plan = plan_state(model_cfg, cfg, mesh, rules)
    setup = lora_setup(model_cfg, plan.abstract.params, LoraOptions(lora_rank=ns.rank, lora_alpha=2.0 * ns.rank))
    adapters = abstract_adapters(setup)
    frozen = cast(plan.abstract.params, jnp.dtype(ns.compute_dtype))
    lora_opt = jax.eval_shape(plan.tx.init, adapters)
    full_state = tree_bytes(plan.abstract)
    lora_state = tree_bytes(frozen) + tree_bytes(adapters) + tree_bytes(lora_opt)
    sync = jnp.dtype(ns.sync_dtype)
    row = {
        "model": name, "params": sum(int(np.prod(x.shape)) for x in jax.tree.leaves(plan.abstract.params)),
        "adapter_params": sum(int(np.prod(x.shape)) for x in jax.tree.leaves(adapters)),
        "full_state": full_state, "lora_state": lora_state,
        "full_sync": tree_bytes(cast(plan.abstract.params, sync)), "lora_sync": adapter_nbytes(adapters, sync),
        "full_peak": None, "lora_peak": None,
    }
    if ns.compile:
        opts = BenchOptions(model=MODELS[name], rows=ns.rows, seq_len=ns.seq_len, measure_peak=False)
        batch = bench_batch(bench_samples(model_cfg, opts, True), model_cfg, cfg, opts, 1)
        b_sh = batch_shardings(batch.arrays, mesh, rules)
        abstract_batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), batch.arrays)
        step_cfg = step_config(cfg, batch, mesh, rules)
        t0 = time.perf_counter()
        full = jax.jit(partial(train_step, plan.graphdef, plan.tx, step_cfg),
                       in_shardings=(plan.shardings, b_sh, None, None), out_shardings=(plan.shardings, None),
                       donate_argnums=(0,))
        row["full_peak"] = peak_bytes(full.lower(plan.abstract, abstract_batch, None, None).compile())
        a_sh = adapter_shardings(setup, mesh, rules)
        replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        lora_state_abs = TrainState(params=adapters, opt_state=lora_opt, step=plan.abstract.step, rng=plan.abstract.rng)
        lora_sh = TrainState(params=a_sh, opt_state=jax.tree.map(lambda _: replicated, lora_opt), step=replicated,
                             rng=replicated)
        lora = jax.jit(partial(train_step, plan.graphdef, plan.tx, dataclasses.replace(step_cfg, lora=setup)),
                       in_shardings=(lora_sh, b_sh, None, None, plan.shardings.params), out_shardings=(lora_sh, None),
                       donate_argnums=(0,))
        row["lora_peak"] = peak_bytes(lora.lower(lora_state_abs, abstract_batch, None, None, frozen).compile())
        row["compile_s"] = time.perf_counter() - t0
    return row


def mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:10.2f} MiB"


def ratio(a: int | None, b: int | None) -> str:
    return "-" if a is None or b is None or b == 0 else f"{a / b:6.1f}x"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--compute-dtype", default="bfloat16", choices=("float32", "bfloat16"))
    p.add_argument("--sync-dtype", default="bfloat16", choices=("float32", "bfloat16"))
    p.add_argument("--seq-len", type=int, default=512, help="tokens per row of the synthetic batch of the compiled step")
    p.add_argument("--rows", type=int, default=4, help="rows of that batch")
    p.add_argument("--no-compile", dest="compile", action="store_false", help="skip the compiled-memory columns")
    ns = p.parse_args(argv)
    print(f"LoRA rank {ns.rank} on every text-decoder linear; compute {ns.compute_dtype}, sync {ns.sync_dtype}; "
          f"full = fp32 params + Adam; one {jax.devices()[0].platform} device")
    for name in ns.models:
        r = measure(name, ns)
        print(f"{r['model']:5s} params {r['params']:>13,d}  adapters {r['adapter_params']:>11,d}")
        print(f"      trainer state  full {mib(r['full_state'])}  lora {mib(r['lora_state'])}  "
              f"ratio {ratio(r['full_state'], r['lora_state'])}")
        print(f"      sync per step  full {mib(r['full_sync'])}  lora {mib(r['lora_sync'])}  "
              f"ratio {ratio(r['full_sync'], r['lora_sync'])}")
        if ns.compile:
            print(f"      compiled peak  full {mib(r['full_peak'])}  lora {mib(r['lora_peak'])}  "
                  f"ratio {ratio(r['full_peak'], r['lora_peak'])}  ({r['compile_s']:.0f} s to compile both)")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
