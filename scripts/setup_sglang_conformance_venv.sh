#!/usr/bin/env bash
# Build .venv-sglang/: SGLang 0.5.23's HTTP layer without its GPU stack, for tests/sglang_conformance.
#
# sglang is installed --no-deps (its pins need CUDA torch 2.14.1 and CUDA kernels). Beside it: CPU torch 2.13.0,
# the pure-Python packages its http_server imports (found by importing it), at SGLang's own pins where it has one,
# and nothing that pulls CUDA: triton and torchvision are import-only stand-ins that the stub server installs
# (tests/sglang_conformance/standins). Never install any of this into the project's .venv.
#
#   bash scripts/setup_sglang_conformance_venv.sh [VENV_DIR]     (default: .venv-sglang)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${1:-.venv-sglang}"
export PIP_DISABLE_PIP_VERSION_CHECK=1
python3 -m venv "$VENV"
PIP=("$VENV/bin/pip" install -q)
# SGLang itself, and the packages that would pull CUDA or a 1 GB compiler, without dependencies.
"${PIP[@]}" --no-deps sglang==0.5.23 compressed-tensors==0.18.0 xgrammar==0.2.7
# CPU torch (a local wheel here), then what SGLang's HTTP layer imports, at its pins.
"${PIP[@]}" torch==2.13.0 \
  fastapi uvicorn orjson numpy psutil pybase64 requests packaging pillow msgspec pyzmq tqdm IPython aiohttp uvloop \
  transformers==5.19.0 tokenizers==0.23.2 dill apache-tvm-ffi==0.1.11 sentencepiece==0.2.1 loguru gguf \
  openai==2.8.0 partial_json_parser setproctitle einops jsonschema soundfile==0.13.1 python-multipart
# Nothing above may have brought the real GPU packages back (the stand-ins refuse to shadow them).
if "$VENV/bin/pip" show -q triton torchvision 2>/dev/null; then
  echo "setup_sglang_conformance_venv: triton or torchvision got installed into $VENV; remove it" >&2
  exit 1
fi
"$VENV/bin/python" - <<'PY'
import sys
sys.path.insert(0, "tests/sglang_conformance/standins")
import sglang_standins
sglang_standins.install()
import sglang.srt.entrypoints.http_server  # noqa: F401  (the app the conformance server serves)
from sglang.version import __version__
assert __version__ == "0.5.23", __version__
print(f"SGLang {__version__} HTTP layer imports in {sys.prefix}")
PY
