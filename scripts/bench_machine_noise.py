"""How steady is this machine? The same fixed work, timed round after round: the spread (max / min) is the floor
under any benchmark's spread on it, e.g. the embedded engine's against vLLM's (`bench_engine.py --cases peer`).

    python scripts/bench_machine_noise.py [--rounds 12] [--calls 64]

Three kinds of work, each `--calls` times per round: a small jitted XLA program (8 tanh(x @ w) layers on 32 x 512,
about 1 ms: an engine's decode step in miniature, on XLA's CPU thread pool), a numpy 256 x 256 matmul, and a pure
Python loop (one thread, the interpreter only). Prints per kind the median, min and max round time and the spread.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Callable

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402


@jax.jit
def _layers(x: jax.Array, w: jax.Array) -> jax.Array:
    for _ in range(8):
        x = jnp.tanh(x @ w)
    return x


def _python_work() -> int:
    return sum(range(20_000))


def time_rounds(fn: Callable[[], object], rounds: int, calls: int) -> list[float]:
    out = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        out.append(time.perf_counter() - start)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--calls", type=int, default=64)
    ns = p.parse_args(argv)
    x, w = jnp.ones((32, 512)), jnp.ones((512, 512)) * 1e-3
    jax.block_until_ready(_layers(x, w))  # compile outside the rounds
    a = np.ones((256, 256), np.float32)
    kinds = {"xla": lambda: jax.device_get(_layers(x, w)), "numpy": lambda: a @ a, "python": _python_work}
    one, five, fifteen = os.getloadavg()
    print(f"load average {one:.1f} / {five:.1f} / {fifteen:.1f} on {os.cpu_count()} cores; {ns.rounds} rounds of "
          f"{ns.calls} calls each")
    for name, fn in kinds.items():
        r = time_rounds(fn, ns.rounds, ns.calls)
        print(f"{name:<7} median {statistics.median(r) * 1e3:7.2f} ms  min {min(r) * 1e3:7.2f}  max {max(r) * 1e3:7.2f}  "
              f"spread {max(r) / min(r):.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
