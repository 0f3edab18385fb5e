"""One text row split over a context-parallel group of simulated devices, for the attention benchmarks
(scripts/bench_cp_attention.py, scripts/bench_cp_balance.py): the mesh, its activation-sharding spec and the
abstract q / k,v / segment ids, and the per-device collective bytes of a compiled program on that mesh."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import jax
import jax.numpy as jnp

from jaxrl_vlm.bench import hlo
from jaxrl_vlm.sharding import layout as SL
from jaxrl_vlm.sharding import rules as SR
from jaxrl_vlm.sharding.activations import ActivationSharding


def context_row(t: int, cp: int, heads: int, kv_heads: int, head_dim: int) -> tuple[Any, ActivationSharding, Any, Any, Any]:
    """(mesh of cp devices on the `context` axis, its ActivationSharding, q [1, t, heads, head_dim], k/v
    [1, t, kv_heads, head_dim] (fp32 ShapeDtypeStructs), segment ids [1, t] int32)."""
    mesh = SL.build_mesh(SimpleNamespace(mesh_data=1, mesh_fsdp=1, mesh_tensor=1, mesh_context=cp), jax.devices()[:cp])
    spec = ActivationSharding.create(mesh, SR.resolve_rules())
    q = jax.ShapeDtypeStruct((1, t, heads, head_dim), jnp.float32)
    kv = jax.ShapeDtypeStruct((1, t, kv_heads, head_dim), jnp.float32)
    return mesh, spec, q, kv, jax.ShapeDtypeStruct((1, t), jnp.int32)


def collective_bytes(compiled: Any, mesh: Any) -> dict[str, int]:
    """Per-device bytes by collective kind in `compiled`'s optimized HLO (`hlo.collective_summary`)."""
    axes = tuple(mesh.axis_names)
    return hlo.collective_summary(compiled.as_text(), axes, [mesh.shape[a] for a in axes]).bytes_by_kind
