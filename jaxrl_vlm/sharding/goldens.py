"""Golden sharding dumps: every parameter's, batch input's and constrained activation's layout as JSON.

`jaxrl-vlm dump-shardings` writes them and `tests/test_sharding.py` compares them with the files
checked in under tests/goldens/sharding/, so a change that silently re-shards a tensor fails a test.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Protocol

from jax.sharding import PartitionSpec

from jaxrl_vlm.models.activation_sharding import ACTIVATIONS
from jaxrl_vlm.models.config import ModelConfig
from jaxrl_vlm.models.hf_io import abstract_model
from jaxrl_vlm.sharding.layout import (
    MeshSizes,
    abstract_mesh,
    batch_spec,
    default_row_axis,
    param_bytes_per_device,
    param_layouts,
)
from jaxrl_vlm.sharding.rules import resolve_rules, spec_with_notes


class MeshLayout(MeshSizes, Protocol):
    """What a dump reads from a `MeshConfig`: the sizes, the rules overrides and (optionally, via
    getattr) `mesh_config` and `activation_constraints`."""

    sharding_rules: Mapping[str, Any]


def spec_to_json(spec: PartitionSpec, ndim: int) -> list[str | list[str] | None]:
    """One JSON entry per dimension: null, a mesh axis, or a list of mesh axes."""
    entries = list(spec) + [None] * (ndim - len(spec))
    return [e if e is None or isinstance(e, str) else list(e) for e in entries]


# Batch leaves whose shardings the goldens record: name -> dims (TrainBatch layout).
GOLDEN_BATCH_LEAVES: dict[str, tuple[str, ...]] = {
    "tokens": ("K", "R", "T"),
    "positions": ("K", "3", "R", "T"),
    "loss_mask": ("K", "R", "T"),
    "vision.pixel_values": ("K", "P", "C*T*p*p"),
    "vision.image_token_index": ("K", "M"),
    "vision.token_image_rows": ("K", "R", "T"),
}


def dump_shardings(model_cfg: ModelConfig, mesh_cfg: MeshLayout, num_devices: int = 8) -> dict[str, Any]:
    """JSON-able layout of every parameter, of the batch inputs and of the constrained activations, for
    `model_cfg` under `mesh_cfg`.

    Resolved on an abstract mesh of `num_devices` (no devices or memory needed). Checked in as
    goldens under tests/goldens/sharding/ so a change that silently re-shards a tensor fails a test.
    """
    mesh = abstract_mesh(mesh_cfg, num_devices)
    rules = resolve_rules(mesh_cfg.sharding_rules, f"{getattr(mesh_cfg, 'mesh_config', None) or 'mesh'}: sharding_rules")
    model = abstract_model(model_cfg)
    params: dict[str, Any] = {}
    for layout in param_layouts(model, mesh, rules):
        entry: dict[str, Any] = {
            "shape": list(layout.shape),
            "logical": list(layout.logical),
            "spec": spec_to_json(layout.spec, len(layout.shape)),
        }
        if layout.notes:
            entry["notes"] = list(layout.notes)
        params[layout.path] = entry
    inputs = {}
    for name, dims in GOLDEN_BATCH_LEAVES.items():
        axis = default_row_axis(tuple(name.split(".")), len(dims))
        inputs[name] = {"dims": list(dims), "spec": spec_to_json(batch_spec(len(dims), axis, mesh, rules), len(dims))}
    # Activation constraints (when `activation_constraints` is on), for dimensions the mesh divides.
    activations = {}
    for name, (dims, names) in ACTIVATIONS.items() if getattr(mesh_cfg, "activation_constraints", True) else ():
        spec, _ = spec_with_notes(names, None, rules, mesh)
        activations[name] = {"dims": list(dims), "logical": list(names), "spec": spec_to_json(spec, len(dims))}
    return {
        "num_devices": num_devices,
        "mesh": dict(mesh.shape),
        "rules": {k: (v if v is None or isinstance(v, str) else list(v)) for k, v in sorted(rules.items())},
        "param_bytes_per_device": param_bytes_per_device(model, mesh, rules),
        "params": params,
        "inputs": inputs,
        "activations": activations,
    }


def diff_shardings(golden: Mapping[str, Any], current: Mapping[str, Any], prefix: str = "") -> list[str]:
    """Human-readable differences between two `dump_shardings` results (empty when equal)."""
    lines: list[str] = []
    for key in sorted(set(golden) | set(current), key=str):
        where = f"{prefix}{key}"
        if key not in current:
            lines.append(f"{where}: in golden, gone now")
        elif key not in golden:
            lines.append(f"{where}: new (not in golden): {current[key]!r}")
        elif isinstance(golden[key], Mapping) and isinstance(current[key], Mapping):
            lines += diff_shardings(golden[key], current[key], f"{where}.")
        elif golden[key] != current[key]:
            lines.append(f"{where}: golden {golden[key]!r} != now {current[key]!r}")
    return lines


def format_dump(dump: Mapping[str, Any], expand_depth: int = 2) -> str:
    """JSON text with one parameter per line (objects nested deeper than `expand_depth` stay compact),
    so a re-sharded tensor shows up as a one-line diff in review."""

    def render(value: Any, depth: int, indent: str) -> str:
        if isinstance(value, Mapping) and value and depth < expand_depth:
            inner = indent + " "
            items = [f"{inner}{json.dumps(str(k))}: {render(v, depth + 1, inner)}" for k, v in value.items()]
            return "{\n" + ",\n".join(items) + "\n" + indent + "}"
        return json.dumps(value, separators=(", ", ": "))

    return render(dump, 0, "") + "\n"
