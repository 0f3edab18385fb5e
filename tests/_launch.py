"""Subprocess launching for the multi-process CPU tests (`test_multihost.py`, `test_multihost_trainer.py`), and the
XLA flags of every child process the tests start (`xla_flags`).

A multi-host job on one machine is N copies of one command, each with the JAXRL_* settings of its process
and a share of simulated CPU devices, talking gloo over loopback. The helpers here start such a job (or a
single-process reference run), wait for every process under one deadline, fail fast when any process
fails (a surviving peer would otherwise block in a collective until the heartbeat timeout), and show the
log tails of all processes in the failure message.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import socket
import subprocess
import sys
import time
import types
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Launched:
    """One started process: a name for messages, the process and the file holding its stdout + stderr."""

    name: str
    proc: subprocess.Popen
    log: Path


def load_script(name: str) -> types.ModuleType:
    """`scripts/<name>.py` imported as module `name` (scripts/ is no package), for tests of a script's functions."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def log_tail(path: Path, lines: int = 60) -> str:
    """The last `lines` lines of a log, without gloo's per-connection chatter."""
    text = path.read_text(errors="replace") if path.exists() else "<no output>"
    kept = [ln for ln in text.splitlines() if not ln.startswith("[Gloo]")]
    return "\n".join(kept[-lines:])


def _clean_environ() -> dict[str, str]:
    """This process's environment minus any multi-process setting (ours or jax's) it may carry."""
    return {k: v for k, v in os.environ.items() if not k.startswith(("JAX_COORDINATOR", "JAXRL_"))}


def xla_flags(num_devices: int) -> str:
    """conftest's XLA flags (the suite's optimisation level, collective timeouts) with `num_devices` simulated CPU
    devices instead of the test process's 8: a child compiles like the suite does, so it shares its speed and the
    persistent compilation cache's entries (the flags are part of the cache key)."""
    kept = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")]
    return " ".join([*kept, f"--xla_force_host_platform_device_count={num_devices}"])


def single_process_env(num_devices: int) -> dict[str, str]:
    """Environment of a one-process run on `num_devices` simulated CPU devices."""
    env = _clean_environ()
    env.update({"XLA_FLAGS": xla_flags(num_devices), "JAX_PLATFORMS": "cpu"})
    return env


def process_env(process_id: int, num_processes: int, local_devices: int, port: int) -> dict[str, str]:
    """Environment of process `process_id` of a loopback job whose coordinator listens on `port`."""
    env = single_process_env(local_devices)  # replaces conftest's 8 devices with this process's share
    env.update({
        "JAXRL_COORDINATOR": f"127.0.0.1:{port}",
        "JAX_COORDINATOR_BIND_ADDRESS": f"127.0.0.1:{port}",  # listen on loopback only
        "JAXRL_NUM_PROCESSES": str(num_processes),
        "JAXRL_PROCESS_ID": str(process_id),
    })
    return env


def start(name: str, argv: Sequence[str], env: dict[str, str], log: Path) -> Launched:
    """Start `argv` in the repository root with `env`, stdout and stderr into `log`."""
    with open(log, "wb") as out:
        proc = subprocess.Popen(list(argv), cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    return Launched(name, proc, log)


def launch_job(argv: Sequence[str], log_dir: Path, *, num_processes: int, local_devices: int,
               name: str = "worker") -> list[Launched]:
    """`num_processes` copies of `argv`, process i logging to `log_dir/<name>_<i>.log`."""
    port = free_port()
    return [
        start(f"{name} {pid}", argv, process_env(pid, num_processes, local_devices, port), log_dir / f"{name}_{pid}.log")
        for pid in range(num_processes)
    ]


def _all_logs(procs: Sequence[Launched]) -> str:
    return "\n".join(f"--- {p.name} (rc={p.proc.poll()}) ---\n{log_tail(p.log)}" for p in procs)


def wait_all(procs: Sequence[Launched], deadline: float) -> None:
    """Return once every process exited 0; fail as soon as one exits non-zero, or at `deadline`
    (a `time.monotonic()` value) if some are still running."""
    while True:
        codes = [p.proc.poll() for p in procs]
        failed = [(p, rc) for p, rc in zip(procs, codes) if rc not in (None, 0)]
        if failed:
            p, rc = failed[0]
            pytest.fail(f"{p.name} exited with {rc}\n{_all_logs(procs)}")
        if all(rc == 0 for rc in codes):
            return
        if time.monotonic() > deadline:
            running = [p.name for p, rc in zip(procs, codes) if rc is None]
            pytest.fail(f"{', '.join(running)} still running at the deadline\n{_all_logs(procs)}")
        time.sleep(0.25)


@contextlib.contextmanager
def killed_on_exit(procs: list[Launched]) -> Iterator[list[Launched]]:
    """Yield `procs` (a list that may still grow); kill whichever is still running on the way out."""
    try:
        yield procs
    finally:
        for p in procs:
            if p.proc.poll() is None:
                p.proc.kill()
                p.proc.wait(timeout=30)
