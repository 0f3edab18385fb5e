#!/usr/bin/env bash
# One-GPU acceptance check for jaxrl-vlm, in under 8 minutes, installing nothing and using no network:
#   1. tests/test_model_parity.py on the GPU (fp32, full matmul precision),
#   2. one GRPO train step of the Qwen3-VL-2B architecture (random init, bf16 compute, remat, 8 x 4096
#      multi-turn batch) with MFU (vs the measured matmul peak and vs 989 TFLOP/s) and peak memory,
#   3. the sharding-layout benchmark on the one device;
# then one summary block. Outputs (CSV/JSON/PNG) go to runs/gpu_check (or --out DIR).
#
# The machine needs, prepared beforehand (this script checks and says what is missing):
#   - one NVIDIA GPU (H100/H200-class for the MFU target) with a CUDA 12 capable driver;
#   - the project venv at .venv (or PYTHON=/path/to/python) with `pip install -e '.[test]'` and
#     `pip install 'jax[cuda12]==0.10.2'` already done (CUDA jaxlib; the parity test uses CPU torch).
#
# Usage: scripts/gpu_check.sh [--require-mfu 0.4] [--skip-parity] [--out DIR] [--dry-run]
# Exit status: 0 pass, 1 a stage failed, 2 no usable GPU / venv, 124 the 8-minute limit was hit.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PYTHON="${PYTHON:-$ROOT/.venv/bin/python}"

if [[ ! -x "$PYTHON" ]]; then
  echo "gpu_check: no python at $PYTHON; create the project venv first (see the header of this script)" >&2
  exit 2
fi
if ! "$PYTHON" -c "import jax, flax, optax, transformers, torch" 2>/dev/null; then
  echo "gpu_check: $PYTHON lacks the project dependencies (jax, flax, optax, transformers, torch); run pip install -e '.[test]' beforehand" >&2
  exit 2
fi
if [[ " $* " != *" --dry-run "* ]] && ! "$PYTHON" -c "import jax_plugins.xla_cuda12" 2>/dev/null \
   && ! "$PYTHON" -c "import jax; assert any(d.platform == 'gpu' for d in jax.devices())" 2>/dev/null; then
  echo "gpu_check: jax in $PYTHON has no CUDA backend; install 'jax[cuda12]==0.10.2' in the venv beforehand (this script installs nothing)" >&2
  exit 2
fi

# No pre-allocation: the parity subprocess and the main process share the GPU; the allocator peak is still reported.
export XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_MEM_FRACTION=0.90
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
unset JAX_PLATFORMS  # a leftover JAX_PLATFORMS=cpu would silently run everything on the CPU

exec timeout --signal=TERM --kill-after=10 480 "$PYTHON" scripts/gpu_check.py --budget-s 420 "$@"
