"""The SGLang conformance suite: the project's client against SGLang 0.5.23's own HTTP layer.

It needs the separate venv that `scripts/setup_sglang_conformance_venv.sh` builds (`.venv-sglang/`, or the
interpreter named by `SGLANG_CONFORMANCE_PYTHON`). Without it the suite fails at once, naming the script: a suite
that skipped itself green would say SGLang was checked when it was not. The default test run does not recurse into
this directory (`norecursedirs` in pyproject.toml); CI runs it as its own step (`.ci/sglang_conformance.sh`), and
`python -m pytest -q tests/sglang_conformance` runs it by hand.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
STUB_SERVER = HERE / "_sglang_stub_server.py"
SGLANG_VERSION = "0.5.23"
START_TIMEOUT_S = 120.0
LORA_RANK = 4  # the suite's server serves adapters up to this rank (--max-lora-rank)


def sglang_python() -> Path:
    """The SGLang venv's interpreter; pytest.fail (not skip) when it is missing."""
    python = Path(os.environ.get("SGLANG_CONFORMANCE_PYTHON", ROOT / ".venv-sglang" / "bin" / "python"))
    if not python.exists():
        pytest.fail(f"SGLang conformance venv not found at {python}: build it with "
                    "`bash scripts/setup_sglang_conformance_venv.sh` (or set SGLANG_CONFORMANCE_PYTHON)",
                    pytrace=False)
    return python


def run_in_sglang(code: str, timeout_s: float = 120.0) -> str:
    """Run `code` in the SGLang venv (stand-ins installed first); its stdout, or a failure with its stderr."""
    prelude = (f"import sys; sys.path.insert(0, {str(HERE / 'standins')!r}); "
               "import sglang_standins; sglang_standins.install()\n")
    proc = subprocess.run([str(sglang_python()), "-c", prelude + code], capture_output=True, text=True,
                          timeout=timeout_s, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    if proc.returncode != 0:
        pytest.fail(f"SGLang venv code failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}", pytrace=False)
    return proc.stdout


@dataclass
class StubServer:
    url: str
    log: Path
    api_key: str | None


def server_flags() -> list[str]:
    """The SGLang flags the suite's server runs with, as our launcher passes them: LoRA serving for a rank-LORA_RANK
    run (`lora.serving.sglang_lora_args`) and routed-expert capture (routing replay)."""
    from jaxrl_vlm.config import load_config
    from jaxrl_vlm.job.session import _routing_args
    from jaxrl_vlm.lora.options import LoraOptions
    from jaxrl_vlm.lora.serving import sglang_lora_args

    replay = load_config(None, ["--use-rollout-routing-replay", "true"])
    return [*sglang_lora_args(LoraOptions(lora_rank=LORA_RANK), []), *_routing_args(replay)]


def _start(api_key: str | None) -> Iterator[StubServer]:
    python = sglang_python()
    workdir = Path(tempfile.mkdtemp(prefix="sglang-conformance-"))
    port_file, log = workdir / "port", workdir / "server.log"
    cmd = ([str(python), str(STUB_SERVER), "--port-file", str(port_file)] + (["--api-key", api_key] if api_key else [])
           + server_flags())
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env={**os.environ, "HF_HUB_OFFLINE": "1"}, start_new_session=True)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not (port_file.exists() and port_file.read_text().strip()):
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"SGLang stub server did not start (exit {proc.poll()}):\n"
                            f"{log.read_text(errors='replace')[-4000:]}", pytrace=False)
            time.sleep(0.2)
        yield StubServer(f"http://127.0.0.1:{port_file.read_text().strip()}", log, api_key)
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    if proc.returncode not in (0, -15, None):
        sys.stderr.write(log.read_text(errors="replace")[-2000:])


@pytest.fixture(scope="session")
def sglang_server() -> Iterator[StubServer]:
    """SGLang 0.5.23's app with the scripted scheduler, once per session (start-up imports take ~15 s)."""
    yield from _start(None)


@pytest.fixture(scope="module")
def embedded_engine_url(tiny_hf_checkpoint: Path) -> Iterator[str]:
    """Our embedded engine on the tiny random Qwen3-VL, to compare its answers with SGLang's (stopped with the
    module that uses it: tests/conftest.py warns about engine threads a module leaves running)."""
    from jaxrl_vlm.engine import EmbeddedEngine
    from jaxrl_vlm.engine.options import EngineOptions

    config = EngineOptions(max_batch=4, max_seq_len=128, min_prefill_bucket=32, min_kv_bucket=128,
                           decode_batch_sizes=(4,))
    engine = EmbeddedEngine(str(tiny_hf_checkpoint), config=config)
    engine.start()
    yield engine.url
    engine.stop()
