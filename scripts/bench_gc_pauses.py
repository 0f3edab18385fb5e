"""The garbage collector's full collections during a train job, with the run option `freeze_gc` on and off.

Each mode runs the main job (default: the README's configs/color_reveal_tiny.yaml, the embedded engine in the
same process) for --steps steps in a fresh process of its own, and records every full (generation-2) collection:
when it came and how long it stopped the interpreter. Collections between the end of the first step and the end
of the last are the steady state a long run lives in (the first step compiles, and the job freezes its heap again
after it; after the last step the engine stops and the heap is unfrozen). Modes alternate over
--repeats runs each. Prints the pauses per mode, the ratio of their medians (off / on), and whether every run
trained to the same rewards (the freeze changes when memory is walked, never what is computed).

    python scripts/bench_gc_pauses.py [--config configs/color_reveal_tiny.yaml] [--steps 12] [--repeats 1]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def _child(config: str, steps: int, freeze_gc: bool, out_dir: str) -> dict[str, Any]:
    """One train job in this process; the full collections and the step ends, in seconds since the job started."""
    from jaxrl_vlm import cli  # here, not at the top: the parent process only starts the children (no jax in it)
    from jaxrl_vlm.job import run

    started = time.perf_counter()
    pauses: list[tuple[float, float]] = []
    step_ends: list[float] = []
    began: list[float] = []

    def on_gc(phase: str, info: dict[str, Any]) -> None:
        if info["generation"] != 2:
            return
        if phase == "start":
            began.append(time.perf_counter())
        elif began:
            t = began.pop()
            pauses.append((t - started, time.perf_counter() - t))

    step = run.MainJob.step

    async def timed_step(self: Any, n: int) -> dict[str, Any]:  # the step's end, for "after the first step"
        out = await step(self, n)
        step_ends.append(time.perf_counter() - started)
        return out

    run.MainJob.step = timed_step
    gc.callbacks.append(on_gc)
    try:
        rc = cli.main(["train", config, "--num-rollout", str(steps), "--output-dir", out_dir,
                       "--freeze-gc", "true" if freeze_gc else "false"])
    finally:
        gc.callbacks.remove(on_gc)
    rewards = [record["rollout/raw_reward"] for record in map(json.loads, (Path(out_dir) / "metrics.jsonl").open())
               if "rollout/raw_reward" in record]
    return {"rc": rc, "pauses": pauses, "step_ends": step_ends, "wall_s": time.perf_counter() - started,
            "rewards": rewards}


def _run_mode(config: str, steps: int, freeze_gc: bool) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="bench_gc_") as tmp:
        result = Path(tmp) / "result.json"
        cmd = [sys.executable, __file__, "--child", "--config", config, "--steps", str(steps),
               "--freeze-gc", "true" if freeze_gc else "false", "--out", str(result), "--run-dir", str(Path(tmp) / "run")]
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        if proc.returncode != 0 or not result.exists():
            raise SystemExit(f"the train job failed (freeze_gc={freeze_gc}):\n{proc.stderr[-4000:]}")
        return json.loads(result.read_text())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="configs/color_reveal_tiny.yaml")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--repeats", type=int, default=1, help="Runs per mode, alternated.")
    p.add_argument("--json", default=None, help="Also write the results to this file.")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--freeze-gc", default="true", help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    p.add_argument("--run-dir", default=None, help=argparse.SUPPRESS)
    ns = p.parse_args(argv)
    if ns.child:
        Path(ns.out).write_text(json.dumps(_child(ns.config, ns.steps, ns.freeze_gc == "true", ns.run_dir)))
        return 0

    load = " / ".join(f"{x:.1f}" for x in os.getloadavg())
    modes: dict[str, list[dict[str, Any]]] = {"on": [], "off": []}
    for r in range(ns.repeats):
        for name in (("on", "off") if r % 2 == 0 else ("off", "on")):
            modes[name].append(_run_mode(ns.config, ns.steps, name == "on"))
    print(f"full collections of a train job ({ns.config}, {ns.steps} steps, {ns.repeats} run(s) per mode, alternated); "
          f"load average before {load} on {os.cpu_count()} cores, after "
          f"{' / '.join(f'{x:.1f}' for x in os.getloadavg())}")
    print(f"{'freeze_gc':>9} {'steps 2-N: n':>15} {'median ms':>10} {'max ms':>8} {'total ms':>9} "
          f"{'whole run: n':>12} {'total ms':>9} {'max ms':>8}")
    medians: dict[str, float] = {}
    for name, runs in modes.items():
        steady = [d for run in runs for t, d in run["pauses"]
                  if run["step_ends"] and run["step_ends"][0] < t < run["step_ends"][-1]]
        every = [d for run in runs for _, d in run["pauses"]]
        medians[name] = statistics.median(steady) if steady else 0.0
        print(f"{name:>9} {len(steady):>15} {1e3 * medians[name]:>10.1f} {1e3 * max(steady, default=0):>8.1f} "
              f"{1e3 * sum(steady):>9.1f} {len(every):>12} {1e3 * sum(every):>9.1f} {1e3 * max(every, default=0):>8.1f}")
    ratio = medians["off"] / medians["on"] if medians["on"] else float("inf")
    same = len({json.dumps(run["rewards"]) for runs in modes.values() for run in runs}) == 1
    print(f"every run trained to the same rewards step for step: {'yes' if same else 'NO'} "
          f"({len(modes['on'][0]['rewards'])} steps)")
    print(f"RATIO median full-collection pause in steps 2-{ns.steps}, off / on: {ratio:.2f}x")
    if ns.json:
        Path(ns.json).write_text(json.dumps({"modes": modes, "ratio": ratio}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
