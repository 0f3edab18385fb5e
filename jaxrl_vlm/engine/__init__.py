"""Embedded JAX inference engine serving SGLang's native HTTP API (see `server.py`).

Paged KV cache (`forward.py`), per-row sampling (`sampling.py`), compiled programs per shape bucket
(`runner.py`), continuous batching (`scheduler.py`, fed typed messages from `inbox.py`), page ownership
and a radix tree sharing prefixes across requests and turns (`prefix_cache.py`), options shared by
`train` and `serve` (`options.py`). The wire format is `rollout.sglang_wire`; `protocol.py` holds the
engine's side of it (refusals, prompt preparation).
"""

from jaxrl_vlm.engine.core import Engine
from jaxrl_vlm.engine.options import EngineOptions
from jaxrl_vlm.engine.scheduler import EngineStats
from jaxrl_vlm.engine.server import EmbeddedEngine, build_app, serve

__all__ = ["EmbeddedEngine", "Engine", "EngineOptions", "EngineStats", "build_app", "serve"]
