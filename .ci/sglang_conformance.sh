#!/usr/bin/env bash
# CI step: build SGLang 0.5.23's venv (.venv-sglang, rebuilt each run) and run the conformance suite against it.
# Needs the project's test venv active (run after .ci/run's install). Fails if SGLang's app refuses any client
# call or an answer shape differs from the embedded engine's; a missing venv is a failure, never a skip.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .venv-sglang
start=$(date +%s)
bash scripts/setup_sglang_conformance_venv.sh .venv-sglang
echo "sglang conformance: venv built in $(( $(date +%s) - start )) s"
SGLANG_CONFORMANCE_PYTHON="$PWD/.venv-sglang/bin/python" python -m pytest -q tests/sglang_conformance
echo "sglang conformance: step took $(( $(date +%s) - start )) s"
