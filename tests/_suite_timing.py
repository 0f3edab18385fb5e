"""Where the suite's time goes: XLA compilation, subprocesses and the rest, per test.

A pytest plugin, loaded by `conftest.py` when `JAXRL_SUITE_TIMING=<path.jsonl>` is set. For each test (setup,
call and teardown together) it writes one JSON line:
- `wall_s`: the test's wall time;
- `compile_s`: time JAX spent compiling in this process (tracing, lowering and XLA backend compile), from JAX's
  own monitoring events, so cache hits cost nothing here;
- `subprocess_s`: wall time during which this process had at least one live child process (servers, CLI runs,
  multi-host workers), sampled every 50 ms from /proc; compilation inside a child counts here;
- `n_compiles`: XLA backend compiles in this process.

`python scripts/suite_timing_table.py <path.jsonl>` turns the lines into the table of the slowest tests.
Under pytest-xdist each worker appends to its own file (`<path>.<worker>`).
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import jax
import pytest

_COMPILE_EVENTS = (
    "/jax/core/compile/jaxpr_trace_duration",
    "/jax/core/compile/jaxpr_to_mlir_module_duration",
    "/jax/core/compile/backend_compile_duration",
)
_BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"


def _has_children(pid: int) -> bool:
    task_dir = Path(f"/proc/{pid}/task")
    try:
        for task in task_dir.iterdir():
            if (task / "children").read_text().strip():
                return True
    except OSError:
        return False
    return False


class SuiteTiming:
    def __init__(self, path: Path):
        self.path = path
        self.compile_s = 0.0
        self.n_compiles = 0
        self.subprocess_s = 0.0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._sampler = threading.Thread(target=self._sample_children, daemon=True)
        self._sampler.start()
        jax.monitoring.register_event_duration_secs_listener(self._on_duration)

    def _on_duration(self, event: str, duration: float, **_: object) -> None:
        if event in _COMPILE_EVENTS:
            with self._lock:
                self.compile_s += duration
                self.n_compiles += event == _BACKEND_COMPILE

    def _sample_children(self) -> None:
        pid, period = os.getpid(), 0.05
        while not self._stop.wait(period):
            if _has_children(pid):
                with self._lock:
                    self.subprocess_s += period

    def snapshot(self) -> tuple[float, int, float]:
        with self._lock:
            return self.compile_s, self.n_compiles, self.subprocess_s

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem: pytest.Item | None):
        start_compile, start_n, start_sub = self.snapshot()
        start = time.perf_counter()
        yield
        wall = time.perf_counter() - start
        compile_s, n_compiles, sub = self.snapshot()
        record = {
            "test": item.nodeid, "wall_s": round(wall, 3), "compile_s": round(compile_s - start_compile, 3),
            "n_compiles": n_compiles - start_n, "subprocess_s": round(sub - start_sub, 3),
            "slow": item.get_closest_marker("slow") is not None,
        }
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")


def register(config: pytest.Config, path: str) -> None:
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    target = Path(f"{path}.{worker}" if worker else path)
    config.pluginmanager.register(SuiteTiming(target), "jaxrl_suite_timing")
