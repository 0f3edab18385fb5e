"""Sharding: `rules` (logical axis names -> mesh axes), `layout` (mesh, parameter and batch shardings),
`activations` (the layout of the model's activation constraints) and `goldens` (the layout dumps checked in
under tests/goldens/sharding/).

The package places models and is never imported by them (the model only names its axes). Names are resolved
lazily (PEP 562), so importing `rules` alone does not build the model-side modules.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    **dict.fromkeys(
        ["AnyMesh", "BATCH_AXIS", "DEFAULT_RULES", "MESH_AXES", "MeshAxes", "PARAM_LOGICAL_AXES", "Rules",
         "SEQUENCE_AXIS", "PATCH_AXIS",
         "ShardingError", "axis_sizes", "logical_to_spec", "resolve_rules", "spec_with_notes"], "rules"),
    **dict.fromkeys(
        ["MeshSizes", "ParamLayout", "abstract_mesh", "batch_sharding", "batch_shardings", "batch_spec",
         "build_mesh", "default_row_axis", "mesh_shape", "param_bytes_per_device", "param_layouts",
         "param_shardings", "put_batch", "row_multiple", "sequence_shards", "shard_model", "shard_shape", "shardings_for",
         "state_shardings"], "layout"),
    **dict.fromkeys(["ActivationSharding"], "activations"),
    **dict.fromkeys(
        ["GOLDEN_BATCH_LEAVES", "MeshLayout", "diff_shardings", "dump_shardings", "format_dump", "spec_to_json"],
        "goldens"),
}  # fmt: skip
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'jaxrl_vlm.sharding' has no attribute {name!r}")
    return getattr(importlib.import_module(f"jaxrl_vlm.sharding.{_EXPORTS[name]}"), name)
