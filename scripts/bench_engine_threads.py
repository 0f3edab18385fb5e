"""The embedded engine's decode throughput and its spread under four CPU threading setups: free to use every core
(the default), the whole process pinned to one core, XLA's threads alone on one core (`--xla-cpu-cores`), and XLA's
Eigen multi-threading off; each engine in its own process, timed in alternation (issue 48: where the spread between
identical repeats comes from on a small shared machine).

    python scripts/bench_engine_threads.py --checkpoint DIR [--pin 1 0] [--concurrency 1 8 32] [--repeats 6]
                                           [--repeat-seconds 1] [--settle-seconds 1] [--json FILE]

One child process per mode serves DIR with the engine's default buckets and runs the bench's own repeats (rounds of C
concurrent `/generate` requests of 64 greedy tokens, back to back for at least `--repeat-seconds`) when the parent asks;
the parent rotates which mode goes first in each round of repeats and idles `--settle-seconds` before each repeat.
Modes: "all cores" (affinity untouched, the default); one per `--pin` core (the whole process, XLA's threads and
the engine's scheduler and HTTP threads alike, `os.sched_setaffinity` before jax starts); one "xla on N" per `--pin`
core (`jaxrl-vlm serve --xla-cpu-cores N`: XLA's CPU threads on core N, the scheduler's and HTTP threads on every
core, as vLLM's CPU server keeps its compute off its API server's core); and "eigen off"
(`XLA_FLAGS=--xla_cpu_multi_thread_eigen=false`: Eigen's kernels single-threaded; in a one-off check it did not make
XLA single-threaded, a chain of [384, 384] matmuls still keeping both cores of the 2-core machine busy as fast; XLA
sizes its thread pool from the process's affinity, which is what pinning changes). vLLM's CPU server pins its compute to one
core and leaves the other to its API server (shared/reference/vllm_cpu.md).

Printed per mode: the seconds its engine took to start and warm up (each mode's compilations, one child at a time);
per concurrency and mode: median tok/s, its ratio to "all cores" (the baseline, measured in the same run),
the spread (max / min) of the repeats, and the time inside the decode program per step (median and spread); and the
spread of one fixed piece of Python work (one core) and of one fixed XLA program (every core) timed in the parent
after each round of repeats (the machine's own floors).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_engine  # noqa: E402  (the bench's rounds, repeats and machine floor)
from jaxrl_vlm.xla_cpu_cores import confine_xla_threads  # noqa: E402 (imports no jax)

PROMPT = [{"role": "user", "content": "Find the area of the triangle with base 6."}]
NEW_TOKENS = 64
EIGEN_OFF = "--xla_cpu_multi_thread_eigen=false"


def serve(checkpoint: str, concurrencies: list[int], repeat_seconds: float) -> None:
    """The child: pin itself if asked (`PIN_CORE`), start an engine, warm it up at every concurrency, say "ready",
    then time one repeat per line read (the concurrency) and answer with one JSON line."""
    if os.environ.get("PIN_CORE"):
        os.sched_setaffinity(0, {int(os.environ["PIN_CORE"])})  # before jax starts its threads: they inherit it
    if os.environ.get("XLA_CORES"):
        confine_xla_threads(os.environ["XLA_CORES"])
    # Local on purpose: jax must start after the affinity is set.
    from jaxrl_vlm.engine import EmbeddedEngine, EngineOptions
    from rollout.encoding import ChatEncoder
    from rollout.processing import load_image_processor, load_tokenizer

    encoder = ChatEncoder(load_tokenizer(checkpoint), load_image_processor(checkpoint))
    prompt = encoder.encode_prompt(PROMPT).wire_ids
    start = time.perf_counter()
    with EmbeddedEngine(checkpoint, config=EngineOptions(max_batch=max(concurrencies), max_seq_len=2048)) as engine:
        runner, sched = engine.engine.runner, engine.engine.scheduler
        for c in concurrencies:
            asyncio.run(bench_engine._round(engine.url, prompt, c, NEW_TOKENS))  # warm-up: compiles
        asyncio.run(bench_engine._freeze_gc(engine.url))
        print(f"ready {time.perf_counter() - start:.3f}", flush=True)  # seconds to start and warm up: compilations
        for line in sys.stdin:
            steps, program_s = sched.timing.decode_steps, runner.decode_program_s
            tok_s, _ = asyncio.run(bench_engine._repeat(engine.url, prompt, int(line), NEW_TOKENS, "sglang",
                                                        repeat_seconds))
            n = max(1, sched.timing.decode_steps - steps)
            print(json.dumps({"tok_s": tok_s, "program_ms": 1e3 * (runner.decode_program_s - program_s) / n}),
                  flush=True)


class _Child:
    """One mode's engine process, asked for repeats over its stdin."""

    def __init__(self, ns: argparse.Namespace, env_overrides: dict[str, str]):
        env = {**os.environ, **env_overrides}
        args = [sys.executable, __file__, "--serve", "--checkpoint", ns.checkpoint, "--repeat-seconds",
                str(ns.repeat_seconds), "--concurrency", *map(str, ns.concurrency)]
        self.proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True)
        said = self.proc.stdout.readline().split()
        if not said or said[0] != "ready":
            raise RuntimeError(f"the engine child ({env_overrides}) did not start (exit {self.proc.wait()})")
        self.warmup_s = float(said[1])

    def repeat(self, concurrency: int) -> dict[str, float]:
        self.proc.stdin.write(f"{concurrency}\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", required=True, help="A checkpoint directory (e.g. from jaxrl-vlm make-tiny).")
    parser.add_argument("--pin", type=int, nargs="+", default=[os.cpu_count() - 1],
                        help="Cores to pin one engine each to (default: the last core).")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--repeat-seconds", type=float, default=1.0)
    parser.add_argument("--settle-seconds", type=float, default=1.0)
    parser.add_argument("--json", help="Write the results here.")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)  # the child's side
    ns = parser.parse_args()
    if ns.serve:
        serve(ns.checkpoint, ns.concurrency, ns.repeat_seconds)
        return 0

    eigen_off = f"{os.environ.get('XLA_FLAGS', '')} {EIGEN_OFF}".strip()
    modes: dict[str, dict[str, str]] = {"all cores": {}, **{f"core {c}": {"PIN_CORE": str(c)} for c in ns.pin},
                                        **{f"xla on {c}": {"XLA_CORES": str(c)} for c in ns.pin},
                                        "eigen off": {"XLA_FLAGS": eigen_off}}
    out: dict[str, Any] = {"load_before": bench_engine._load(), "rows": []}
    loops = bench_engine._fixed_work_loops(ns.repeat_seconds)
    xla_loops = bench_engine._fixed_xla_loops(ns.repeat_seconds)
    children: dict[str, _Child] = {}
    try:
        for name, env in modes.items():  # one at a time: each warm-up's compilations have the machine to themselves
            children[name] = _Child(ns, env)
        out["warmup_s"] = {name: child.warmup_s for name, child in children.items()}
        names = list(modes)
        for c in ns.concurrency:
            runs: dict[str, list[dict[str, float]]] = {name: [] for name in names}
            fixed: list[float] = []  # the machine's floors: fixed Python work, a fixed XLA program
            fixed_xla: list[float] = []
            for r in range(ns.repeats):
                for name in names[r % len(names):] + names[: r % len(names)]:
                    time.sleep(ns.settle_seconds)
                    runs[name].append(children[name].repeat(c))
                time.sleep(ns.settle_seconds)
                fixed.append(1.0 / bench_engine._fixed_work_seconds(loops))
                fixed_xla.append(1.0 / bench_engine._fixed_xla_seconds(xla_loops))
            row: dict[str, Any] = {"concurrency": c, "machine": bench_engine._spread(fixed),
                                   "machine_xla": bench_engine._spread(fixed_xla)}
            for name in names:
                row[name] = {"tok_s": bench_engine._spread([x["tok_s"] for x in runs[name]]),
                             "program_ms": bench_engine._spread([x["program_ms"] for x in runs[name]])}
            out["rows"].append(row)
    finally:
        for child in children.values():
            child.close()
    out["load_after"] = bench_engine._load()

    print(f"the embedded engine, each mode in its own process, {ns.repeats} repeats of >= {ns.repeat_seconds:g} s "
          f"per mode, alternated; {NEW_TOKENS} greedy tokens per request")
    print(f"machine: {out['load_before']} before, {out['load_after']} after")
    print(f"{'concurrent':>10} {'mode':>10} {'tok/s median (min-max)':>24} {'vs all':>7} {'spread':>7} "
          f"{'program ms/step (spread)':>25} {'machine py/xla':>14}")
    for row in out["rows"]:
        base = row["all cores"]["tok_s"]["median"]
        for name in modes:
            t, p = row[name]["tok_s"], row[name]["program_ms"]
            print(f"{row['concurrency']:>10} {name:>10} {t['median']:>9.0f} ({t['min']:>6.0f}-{t['max']:<6.0f}) "
                  f"{t['median'] / base:>6.2f}x {t['spread']:>6.2f}x {p['median']:>16.3f} ({p['spread']:.2f}x) "
                  f"{row['machine']['spread']:>7.2f}x/{row['machine_xla']['spread']:.2f}x")
    print("seconds to start and warm up (the compilations of every concurrency): "
          + ", ".join(f"{name} {s:.1f}" for name, s in out["warmup_s"].items()))
    print("vs all: the median's ratio to the unpinned engine in the same run; machine py/xla: the spread of one fixed "
          "piece of Python work (one core) and of one fixed XLA program (every core), each as long as a repeat, timed "
          "in this process after each round of repeats")
    if ns.json:
        Path(ns.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
