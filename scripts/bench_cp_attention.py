"""Context-parallel text attention: the K/V all-gather (`attention_impl: xla`) against ring attention (`ring`),
measured in one run on simulated CPU devices.

For each row length T and context group size cp, the decoder's text attention (`layers.text_attention` with the
model's own mask, `layers.text_mask`) is compiled forward + backward (the gradient of the sum of its outputs with
respect to q, k, v) on one packed row split over cp devices, q/k/v laid out as the decoder layer holds them
(positions over `context`). Per device we read the compiled program's temporary memory (`memory_analysis()`), the
bytes its collectives move (`bench.hlo`: the all-gather of K/V and the reduce-scatter of dK/dV for xla, the
collective-permutes of the ring), and, where both fit the memory cap, the median time of a step run on this CPU.
Ratios are ring / all-gather, so < 1 means ring is smaller or faster.

Dims are tiny (the point is how memory scales with T and cp): 4 query heads, 2 key/value heads of 64, fp32, one
row. Simulated devices share this machine's cores, so a time is the group's total work, not a parallel speed-up.

    .venv/bin/python scripts/bench_cp_attention.py --tokens 2048 8192 32768 --cp 1 2 4 8
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")  # before jax is imported

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxrl_vlm.bench.context_row import collective_bytes, context_row  # noqa: E402
from jaxrl_vlm.models.activation_sharding import ROWS_KV, ROWS_Q, activation_sharding  # noqa: E402
from jaxrl_vlm.models.layers import text_attention, text_mask  # noqa: E402

IMPLS = ("xla", "ring")
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 64


def packed_segments(t: int, n: int = 5) -> np.ndarray:
    """[1, t] segment ids: n packed sequences of unequal length, then 1/16 of the row padding."""
    real = t - t // 16
    cuts = np.sort(np.random.default_rng(0).choice(np.arange(1, real), n - 1, replace=False))
    seg = np.zeros((1, t), np.int32)
    for i, (a, b) in enumerate(zip(np.r_[0, cuts], np.r_[cuts, real])):
        seg[0, a:b] = i + 1
    return seg


def compile_attention(impl: str, t: int, cp: int):
    """The compiled forward + backward of the text attention on a t-token row over cp devices, and its inputs'
    shardings."""
    mesh, spec, q, kv, seg = context_row(t, cp, HEADS, KV_HEADS, HEAD_DIM)

    def loss(q, k, v, seg):
        with activation_sharding(spec):
            return jnp.sum(text_attention(q, k, v, text_mask(seg, impl), HEAD_DIM**-0.5))

    shardings = (spec.sharding(ROWS_Q, q.shape), spec.sharding(ROWS_KV, kv.shape), spec.sharding(ROWS_KV, kv.shape),
                 spec.sharding(("batch", "sequence"), seg.shape))
    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)), in_shardings=shardings,
                   out_shardings=(None, shardings[:3]))
    start = time.perf_counter()
    compiled = step.lower(q, kv, kv, seg).compile()
    compile_s = time.perf_counter() - start
    collectives = collective_bytes(compiled, mesh)
    return compiled, shardings, compile_s, collectives


def step_seconds(compiled, shardings, t: int, repeats: int) -> float:
    """Median wall time of `repeats` runs after one warm-up, on random inputs of a packed row."""
    rng = np.random.default_rng(1)
    q = rng.normal(size=(1, t, HEADS, HEAD_DIM)).astype(np.float32)
    k, v = (rng.normal(size=(1, t, KV_HEADS, HEAD_DIM)).astype(np.float32) for _ in range(2))
    args = [jax.device_put(x, s) for x, s in zip((q, k, v, packed_segments(t)), shardings)]
    jax.block_until_ready(compiled(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(t: int, cp: int, run_cap_bytes: float, time_max_tokens: int, repeats: int) -> dict[str, dict]:
    """Both impls at (t, cp): per-device temp bytes, collective bytes, compile and (maybe) step seconds."""
    out: dict[str, dict] = {}
    compiled = {}
    for impl in IMPLS:
        compiled[impl], shardings, compile_s, coll = compile_attention(impl, t, cp)
        mem = compiled[impl].memory_analysis()  # of the SPMD program: one device's
        out[impl] = {"shardings": shardings, "compile_s": compile_s, "collective": sum(coll.values()),
                     "temp": None if mem is None else int(mem.temp_size_in_bytes), "step_s": None}
    # The cp simulated devices share this host's memory; time both impls or neither, so every time has its baseline.
    if t <= time_max_tokens and all(r["temp"] is not None and r["temp"] * cp <= run_cap_bytes for r in out.values()):
        for impl in IMPLS:
            out[impl]["step_s"] = step_seconds(compiled[impl], out[impl]["shardings"], t, repeats)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[2048, 8192, 32768], help="tokens per row")
    p.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4, 8], help="context-parallel group sizes")
    p.add_argument("--run-cap-gib", type=float, default=4.0,
                   help="time a (T, cp) point only when both programs' temporaries, summed over the group, fit this")
    p.add_argument("--time-max-tokens", type=int, default=8192, help="time only rows up to this length")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    mib = lambda b: "-" if b is None else f"{b / 2**20:,.1f}"  # noqa: E731
    ratio = lambda a, b: "-" if a is None or b is None or not b else f"{a / b:.3f}"  # noqa: E731
    print(f"text attention forward+backward, {HEADS} q / {KV_HEADS} kv heads x {HEAD_DIM}, fp32, 1 packed row; "
          f"per device; {jax.device_count()} simulated {jax.devices()[0].platform.upper()} devices")
    print("| tokens | cp | temp MiB all-gather | temp MiB ring | ring/ag | collective MiB all-gather | ring "
          "| step s all-gather | ring | ring/ag | compile s ag / ring |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for t in args.tokens:
        for cp in args.cp:
            r = measure(t, cp, args.run_cap_gib * 2**30, args.time_max_tokens, args.repeats)
            ag, ring = r["xla"], r["ring"]
            step = lambda x: "-" if x is None else f"{x:.3f}"  # noqa: E731
            print(f"| {t:,} | {cp} | {mib(ag['temp'])} | {mib(ring['temp'])} | {ratio(ring['temp'], ag['temp'])} "
                  f"| {mib(ag['collective'])} | {mib(ring['collective'])} | {step(ag['step_s'])} "
                  f"| {step(ring['step_s'])} | {ratio(ring['step_s'], ag['step_s'])} "
                  f"| {ag['compile_s']:.1f} / {ring['compile_s']:.1f} |", flush=True)


if __name__ == "__main__":
    main()
