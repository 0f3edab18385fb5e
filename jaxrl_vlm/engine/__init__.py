"""Embedded JAX inference engine serving SGLang's native HTTP API (see `server.py`).

Paged KV cache (`forward.py`), per-row sampling (`sampling.py`), compiled programs per shape bucket
(`runner.py`), continuous batching (`scheduler.py`, fed typed messages from `inbox.py`), page ownership
and a radix tree sharing prefixes across requests and turns (`prefix_cache.py`), options shared by
`train` and `serve` (`options.py`). The wire format is `rollout.sglang_wire`; `protocol.py` holds the
engine's side of it (refusals, prompt preparation).

Names are resolved lazily (PEP 562): the run config composes `options` (jax-free) without starting jax.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {"EmbeddedEngine": "server", "Engine": "core", "EngineOptions": "options", "EngineStats": "scheduler",
            "build_app": "server", "serve": "server"}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'jaxrl_vlm.engine' has no attribute {name!r}")
    return getattr(importlib.import_module(f"jaxrl_vlm.engine.{_EXPORTS[name]}"), name)
