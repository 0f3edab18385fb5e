"""Code that runs inside vLLM's own interpreter, not the project's: `jaxrl_vlm_worker`, the worker extension that
applies the trainer's weight deltas. vLLM imports it as a top-level module from this directory (on the server's
PYTHONPATH, set by `jaxrl_vlm.vllm_launcher`); nothing in the project imports it at run time."""

from pathlib import Path

EXTENSION_DIR = Path(__file__).resolve().parent  # the PYTHONPATH entry that makes `jaxrl_vlm_worker` importable
