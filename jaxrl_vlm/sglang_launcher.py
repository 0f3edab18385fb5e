"""`--launch-sglang`: run `python -m sglang.launch_server` from SGLang's own interpreter, as a child process.

SGLang pins CUDA torch and its own transformers, so it never shares this venv: `--sglang-python` names the
interpreter of its venv. The child gets its own process group (stopped as a whole), its output goes to a log
file under the run directory, and a child that exits during start-up is reported with the tail of that log.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
from pathlib import Path
from collections.abc import MutableMapping
from typing import Any


class SGLangLaunchError(RuntimeError):
    """The SGLang server could not be started; the message has its command and the end of its log."""


# SGLang's default share of GPU memory for weights + KV cache is about 0.9: far too much beside a colocated trainer.
COLOCATED_SGLANG_MEM_FRACTION = 0.45
JAX_MEM_FRACTION_ENV = "XLA_PYTHON_CLIENT_MEM_FRACTION"


def _flag_value(args: list[str], flag: str) -> str | None:
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            return args[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


def colocated_memory_split(sglang_args: list[str], margin: float) -> tuple[list[str], float]:
    """(SGLang's arguments with a `--mem-fraction-static`, JAX's memory fraction) for one GPU shared by both.

    JAX pre-allocates a fraction of each GPU (`XLA_PYTHON_CLIENT_MEM_FRACTION`, default 0.75) and SGLang reserves
    `--mem-fraction-static` of it; colocated, the two must add up to at most 1 - margin, or whichever starts
    second runs out of memory.
    """
    raw = _flag_value(sglang_args, "--mem-fraction-static")
    args = list(sglang_args)
    if raw is None:
        sglang_fraction = COLOCATED_SGLANG_MEM_FRACTION
        args += ["--mem-fraction-static", str(sglang_fraction)]
    else:
        sglang_fraction = float(raw)
    jax_fraction = round(1.0 - sglang_fraction - margin, 4)
    if not 0.0 < jax_fraction < 1.0:
        raise SGLangLaunchError(
            f"colocated: SGLang --mem-fraction-static {sglang_fraction} + margin {margin} leaves JAX {jax_fraction} "
            "of the GPU; lower --sglang-mem-fraction-static"
        )
    return args, jax_fraction


def apply_colocation(engine: Any, environ: MutableMapping[str, str]) -> str | None:
    """With `--colocate --launch-sglang`: fix SGLang's `--mem-fraction-static` in `engine.sglang_args` and JAX's
    share in `environ` (before the JAX backend starts). Returns what it did, for the run log; None if not colocated."""
    if not (engine.colocate and engine.launch_sglang):
        return None
    engine.sglang_args, jax_fraction = colocated_memory_split(engine.sglang_args, engine.colocate_margin)
    sglang_fraction = _flag_value(engine.sglang_args, "--mem-fraction-static")
    if JAX_MEM_FRACTION_ENV in environ:
        return (f"colocated: SGLang --mem-fraction-static {sglang_fraction}; {JAX_MEM_FRACTION_ENV}="
                f"{environ[JAX_MEM_FRACTION_ENV]} was set by you and kept (the split suggests {jax_fraction})")
    environ[JAX_MEM_FRACTION_ENV] = str(jax_fraction)
    return f"colocated: SGLang --mem-fraction-static {sglang_fraction}, JAX {JAX_MEM_FRACTION_ENV}={jax_fraction}"


# Server flags that SGLang 0.5.23 renamed: older names (slime's `--sglang-cuda-graph-bs`, SGLang's own before the
# split into decode and prefill graphs) are ambiguous prefixes there, and argparse exits 2. The old flags set the
# decode graphs, so that is what they become.
RENAMED_SERVER_FLAGS: dict[str, str] = {
    "--cuda-graph-bs": "--cuda-graph-bs-decode",
    "--cuda-graph-max-bs": "--cuda-graph-max-bs-decode",
}


def current_server_flags(args: list[str]) -> list[str]:
    """`args` with every renamed SGLang flag (`--flag v` or `--flag=v`) under its 0.5.23 name."""
    out: list[str] = []
    for a in args:
        name, sep, value = a.partition("=")
        out.append(RENAMED_SERVER_FLAGS.get(name, name) + sep + value if name in RENAMED_SERVER_FLAGS else a)
    return out


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class SGLangProcess:
    def __init__(self, python: str, model_path: str, *, host: str = "127.0.0.1", port: int = 0,
                 extra_args: list[str] | None = None, log_path: str | Path):
        if not python:
            raise SGLangLaunchError("--launch-sglang needs --sglang-python (the interpreter of SGLang's own venv)")
        self.python = python
        self.model_path = str(model_path)
        self.host = host
        self.port = port or free_port(host)
        self.extra_args = current_server_flags(list(extra_args or []))
        self.log_path = Path(log_path)
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def command(self) -> list[str]:
        return [self.python, "-m", "sglang.launch_server", "--model-path", self.model_path,
                "--host", self.host, "--port", str(self.port), *self.extra_args]

    # The engine's name in messages, and environment variables its server needs (on top of this process's).
    engine_name = "SGLang"
    extra_env: dict[str, str] = {}

    def start(self) -> str:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("ab")
        try:
            self.process = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            start_new_session=True, env={**os.environ, **self.extra_env})
        except OSError as e:
            raise SGLangLaunchError(f"cannot run {self.command[0]!r}: {e}") from e
        finally:
            log.close()
        return self.url

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return "(no log)"

    async def wait_ready(self, client: Any, timeout_s: float) -> None:
        """Poll health until the server answers; fail at once if the child exits."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while loop.time() < deadline:
            if self.process is not None and self.process.poll() is not None:
                raise SGLangLaunchError(
                    f"{self.engine_name} exited with code {self.process.returncode} during start-up: {' '.join(self.command)}\n"
                    f"--- {self.log_path} ---\n{self.log_tail()}"
                )
            if await client.health():
                return
            await asyncio.sleep(1.0)
        raise SGLangLaunchError(f"{self.engine_name} did not become healthy within {timeout_s:g} s at {self.url}\n{self.log_tail()}")

    def stop(self, timeout_s: float = 30.0) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        pgid = os.getpgid(self.process.pid)
        os.killpg(pgid, signal.SIGTERM)
        try:
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(pgid, signal.SIGKILL)
            self.process.wait()
