"""Embedded JAX inference engine serving SGLang's native HTTP API (see `server.py`).

Slotted KV cache (`forward.py`), per-row sampling (`sampling.py`), compiled programs per shape bucket
(`runner.py`), continuous batching (`scheduler.py`), prefix caching across turns (`prefix_cache.py`),
SGLang wire format (`protocol.py`).
"""

from jaxrl_vlm.engine.config import EngineConfig
from jaxrl_vlm.engine.core import Engine
from jaxrl_vlm.engine.scheduler import EngineStats
from jaxrl_vlm.engine.server import EmbeddedEngine, build_app, serve

__all__ = ["EmbeddedEngine", "Engine", "EngineConfig", "EngineStats", "build_app", "serve"]
