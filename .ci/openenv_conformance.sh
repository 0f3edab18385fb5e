#!/usr/bin/env bash
# OpenEnv conformance (tests/openenv_conformance): the real openenv-core client against `env-serve`, and our client
# against openenv-core's create_app, in a venv of its own (.venv-openenv: openenv-core pulls gradio, fastapi and
# fastmcp, ~470 MB; never into .venv). The venv is reused once complete (a marker file written last).
# The MiniWoB test starts `jaxrl-vlm env-serve envs.miniwob` from the project venv (MINIWOB_ENV_SERVE, else jaxrl-vlm
# on PATH, else .venv/bin/jaxrl-vlm), which needs the miniwob extra and chromium-driver (.ci/run's browser step).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv-openenv
OPENENV_CORE_VERSION="${OPENENV_CORE_VERSION:-0.3.0}"
if [[ ! -f "$VENV/.complete-$OPENENV_CORE_VERSION" ]]; then
  rm -rf "$VENV"
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q "openenv-core==$OPENENV_CORE_VERSION" aiohttp pillow numpy pyarrow pyyaml pytest pytest-asyncio uvicorn
  touch "$VENV/.complete-$OPENENV_CORE_VERSION"
fi
PYTHONPATH="$PWD" "$VENV/bin/python" -m pytest -q -p no:cacheprovider -o addopts="" -o asyncio_mode=auto --confcutdir=tests/openenv_conformance tests/openenv_conformance
