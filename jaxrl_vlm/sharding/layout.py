"""The device mesh and the shardings of parameters and batches, resolved with `sharding.rules`.

Mesh axes and sizes come from a `MeshConfig`'s `mesh_data` / `mesh_fsdp` / `mesh_expert` / `mesh_context` /
`mesh_tensor` (one -1 fills); this module reads them through the small `MeshSizes` protocol, so it does not import
`jaxrl_vlm.config`. Parameter layouts are read from the logical names the model's variables carry.

Everything here is bookkeeping over shapes and names except `build_mesh`, `shard_model` and
`put_batch`, which touch devices.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from jaxrl_vlm.models.config import ModelConfig
from jaxrl_vlm.models.hf_io import abstract_model
from jaxrl_vlm.sharding.rules import (
    BATCH_AXIS,
    DEFAULT_RULES,
    MESH_AXES,
    SEQUENCE_AXIS,
    AnyMesh,
    Rules,
    ShardingError,
    axis_sizes,
    logical_to_spec,
    spec_with_notes,
)

logger = logging.getLogger(__name__)


class MeshSizes(Protocol):
    """The mesh sizes of a `MeshConfig` (-1: fill with the remaining devices); an optional
    `mesh_config` attribute (the YAML it came from) names the source in error messages, and optional
    `mesh_expert` / `mesh_context` (default 1) the expert- and context-parallel sizes."""

    mesh_data: int
    mesh_fsdp: int
    mesh_tensor: int


# ----------------------------------------------------------------------------- mesh


def mesh_shape(mesh_cfg: MeshSizes, num_devices: int) -> dict[str, int]:
    """{"data": d, "fsdp": f, "expert": e, "context": c, "tensor": t} from `MeshConfig` sizes, one -1 filled so
    that d*f*e*c*t = num_devices."""
    sizes = {"data": int(mesh_cfg.mesh_data), "fsdp": int(mesh_cfg.mesh_fsdp),
             "expert": int(getattr(mesh_cfg, "mesh_expert", 1)),
             "context": int(getattr(mesh_cfg, "mesh_context", 1)), "tensor": int(mesh_cfg.mesh_tensor)}
    source = getattr(mesh_cfg, "mesh_config", None)
    where = (f"{source}: " if source else "") + ", ".join(f"mesh_{k}={v}" for k, v in sizes.items())
    fill = [k for k, v in sizes.items() if v == -1]
    if any(v == 0 or v < -1 for v in sizes.values()):
        raise ShardingError(f"{where}: mesh sizes must be positive or -1 (fill)")
    if len(fill) > 1:
        raise ShardingError(f"{where}: at most one mesh size may be -1 (fill)")
    fixed = math.prod(v for v in sizes.values() if v != -1)
    if fill:
        if num_devices % fixed:
            raise ShardingError(f"{where}: the fixed sizes multiply to {fixed}, which does not divide the {num_devices} devices")
        sizes[fill[0]] = num_devices // fixed
    elif fixed != num_devices:
        raise ShardingError(f"{where}: the sizes multiply to {fixed} but there are {num_devices} devices")
    return sizes


def build_mesh(mesh_cfg: MeshSizes, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A `Mesh` with axes `MESH_AXES` ("data", "fsdp", "expert", "context", "tensor") and explicit `AxisType.Auto`.

    Auto, not jax's default Explicit: the model relies on sharding propagation, and
    `with_sharding_constraint` raises under Explicit axes. `devices` defaults to all (global) devices.
    """
    devs = list(jax.devices() if devices is None else devices)
    sizes = mesh_shape(mesh_cfg, len(devs))
    return jax.make_mesh(
        tuple(sizes[a] for a in MESH_AXES), MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES), devices=devs
    )


def abstract_mesh(mesh_cfg: MeshSizes, num_devices: int) -> jax.sharding.AbstractMesh:
    """Mesh axes and sizes without devices: enough to resolve PartitionSpecs (goldens, planning)."""
    sizes = mesh_shape(mesh_cfg, num_devices)
    return jax.sharding.AbstractMesh(
        tuple(sizes[a] for a in MESH_AXES), MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES)
    )


# ----------------------------------------------------------------------------- parameters


def _names_of(var: nnx.Variable) -> tuple[str | None, ...]:
    shape = tuple(var.get_value().shape)
    names = var.get_metadata().get("out_sharding")
    if names is None:
        return (None,) * len(shape)
    return tuple(names)


def _param_state(model_or_state: Any) -> nnx.State:
    if isinstance(model_or_state, nnx.State):
        return model_or_state
    return nnx.state(model_or_state, nnx.Param)


def _is_var(x: Any) -> bool:
    return isinstance(x, nnx.Variable)


def _path_str(path: tuple) -> str:
    return ".".join(str(p) for p in path)


@dataclass(frozen=True)
class ParamLayout:
    """One parameter's layout: shape, logical names, resolved spec and any fallback notes."""

    path: str
    shape: tuple[int, ...]
    dtype: str
    logical: tuple[str | None, ...]
    spec: PartitionSpec
    notes: tuple[str, ...]


def param_layouts(model_or_state: Any, mesh: AnyMesh, rules: Rules) -> list[ParamLayout]:
    """Per parameter (flat-state order) its resolved layout; works on abstract (`eval_shape`) models."""
    out = []
    for path, var in nnx.to_flat_state(_param_state(model_or_state)):
        value = var.get_value()
        shape = tuple(int(s) for s in value.shape)
        names = _names_of(var)
        spec, notes = spec_with_notes(names, shape, rules, mesh)
        out.append(ParamLayout(_path_str(path), shape, str(np.dtype(value.dtype)), names, spec, tuple(notes)))
    return out


def state_shardings(state: nnx.State, mesh: Mesh, rules: Rules) -> nnx.State:
    """NamedShardings in the structure of `state` (each Variable holds its sharding instead of a value).

    Works for any NNX state whose variables carry logical names, e.g. `nnx.state(optimizer)`: NNX
    copies a parameter's names onto its Adam moments, so they shard like the parameter; variables
    without names (step counters) are replicated. Usable as `jax.jit` in/out_shardings and as
    `jax.device_put` targets; abstract (`nnx.eval_shape`) states work, nothing is read.
    """
    noted: set[str] = set()

    def to_sharding(var: nnx.Variable) -> nnx.Variable:
        names = _names_of(var)
        spec, notes = spec_with_notes(names, var.get_value().shape, rules, mesh)
        for note in notes:
            if note not in noted:
                noted.add(note)
                logger.info("sharding %s %s: %s", names, tuple(var.get_value().shape), note)
        return var.replace(value=NamedSharding(mesh, spec))

    return jax.tree.map(to_sharding, state, is_leaf=_is_var)


def param_shardings(model_or_state: Any, mesh: Mesh, rules: Rules) -> nnx.State:
    """`state_shardings` of `nnx.state(model, nnx.Param)` (or of a state given directly)."""
    return state_shardings(_param_state(model_or_state), mesh, rules)


def shardings_for(
    mesh: Mesh, rules: Rules, model_cfg: ModelConfig | None = None
) -> Callable[..., NamedSharding]:
    """The `from_hf(path, shardings_for=...)` callback: `(logical_names, shape=None) -> NamedSharding`.

    With `shape`, the spec is resolved exactly as `param_shardings` does. from_hf passes names only,
    so give `model_cfg` (a Qwen3-VL or Qwen2.5-VL config): the spec of each names-tuple is then resolved over every
    parameter shape that carries it, keeping per dimension only what all of them agree on (for
    Qwen3-VL every names-tuple resolves the same for all its shapes, so this equals
    `param_shardings`; `tests/test_sharding.py` checks it per layout). Without either, names are
    looked up with size-1 axes dropped and divisibility left to JAX.
    """
    by_names: dict[tuple[str | None, ...], PartitionSpec] = {}
    if model_cfg is not None:
        specs: dict[tuple[str | None, ...], list[PartitionSpec]] = {}
        for layout in param_layouts(abstract_model(model_cfg), mesh, rules):
            specs.setdefault(layout.logical, []).append(layout.spec)
        for names, options in specs.items():
            by_names[names] = _agreed_spec(options, len(names))

    def lookup(names: Sequence[str | None], shape: Sequence[int] | None = None) -> NamedSharding:
        names = tuple(names)
        if shape is not None:
            return NamedSharding(mesh, logical_to_spec(names, rules, shape, mesh))
        if names in by_names:
            return NamedSharding(mesh, by_names[names])
        if model_cfg is not None:
            raise ShardingError(f"no parameter of the model config has logical names {names}")
        return NamedSharding(mesh, logical_to_spec(names, rules, None, mesh))

    return lookup


def _agreed_spec(specs: Sequence[PartitionSpec], ndim: int) -> PartitionSpec:
    padded = [tuple(s) + (None,) * (ndim - len(s)) for s in specs]
    entries = [col[0] if all(c == col[0] for c in col) else None for col in zip(*padded)]
    while entries and entries[-1] is None:
        entries.pop()
    return PartitionSpec(*entries)


def shard_model(model: nnx.Module, mesh: Mesh, rules: Rules) -> nnx.Module:
    """Move `model`'s parameters into their shardings in place (returns the model).

    For a model that already lives in host/device memory (a fresh init); to load a checkpoint
    without ever holding a whole tensor on one device use `from_hf(..., shardings_for=...)`.
    """
    state = nnx.state(model, nnx.Param)
    nnx.update(model, jax.device_put(state, param_shardings(state, mesh, rules)))
    return model


def shard_shape(shape: Sequence[int], spec: PartitionSpec, mesh: AnyMesh) -> tuple[int, ...]:
    """Shape of one device's block of a `shape` array laid out as `spec` (dims assumed divisible)."""
    sizes = axis_sizes(mesh)
    entries = tuple(spec) + (None,) * (len(shape) - len(spec))
    ways = [1 if e is None else math.prod(sizes[a] for a in ((e,) if isinstance(e, str) else e)) for e in entries]
    return tuple(dim // w for dim, w in zip(shape, ways))


def param_bytes_per_device(model_or_state: Any, mesh: AnyMesh, rules: Rules) -> int:
    """Bytes of parameters one device holds under this layout (from shapes; nothing is allocated)."""
    return sum(
        math.prod(shard_shape(p.shape, p.spec, mesh)) * np.dtype(p.dtype).itemsize
        for p in param_layouts(model_or_state, mesh, rules)
    )


# ----------------------------------------------------------------------------- batches


def row_multiple(mesh: AnyMesh, rules: Rules | None = None) -> int:
    """Rows per micro-batch must be a multiple of this (the number of batch shards); for the batcher."""
    sizes = axis_sizes(mesh)
    rule = (rules or DEFAULT_RULES).get(BATCH_AXIS)
    axes = [] if rule is None else [rule] if isinstance(rule, str) else list(rule)
    return math.prod(sizes.get(a, 1) for a in axes)


def sequence_shards(mesh: AnyMesh, rules: Rules | None = None) -> int:
    """Devices one row's positions are split over (the `sequence` rule's axes: context parallelism; 1 = none).
    Padded row lengths must be multiples of it, and a row's tokens are spread over that many devices."""
    sizes = axis_sizes(mesh)
    rule = (rules or DEFAULT_RULES).get(SEQUENCE_AXIS)
    axes = [] if rule is None else [rule] if isinstance(rule, str) else list(rule)
    return math.prod(sizes.get(a, 1) for a in axes)


def batch_spec(
    ndim: int, row_axis: int | None, mesh: AnyMesh, rules: Rules | None = None
) -> PartitionSpec:
    """Spec of an `ndim` batch array whose rows are axis `row_axis` (None: replicated)."""
    if row_axis is None:
        return PartitionSpec()
    if not 0 <= row_axis < ndim:
        raise ShardingError(f"row axis {row_axis} is out of range for a {ndim}-d batch array")
    names: list[str | None] = [None] * ndim
    names[row_axis] = BATCH_AXIS
    spec, _ = spec_with_notes(names, None, rules or DEFAULT_RULES, mesh)  # divisibility: checked by batch_shardings
    return spec


def batch_sharding(mesh: Mesh, rules: Rules | None = None, *, ndim: int = 3, row_axis: int = 1) -> NamedSharding:
    """NamedSharding of a [K, R, T] batch array: micro-batch axis K replicated, rows R over the batch axes."""
    return NamedSharding(mesh, batch_spec(ndim, row_axis, mesh, rules))


def _key_name(entry: Any) -> str:
    for attr in ("name", "key", "idx"):
        if hasattr(entry, attr):
            return str(getattr(entry, attr))
    return str(entry)


def default_row_axis(path: tuple[str, ...], ndim: int) -> int | None:
    """Row axis of a TrainBatch leaf (`jaxrl_vlm.batching`), from its field path and rank.

    [K, R, ...] arrays: axis 1. `positions` [K, 3, R, T]: axis 2. Anything under `vision` holds the
    patches of a whole micro-batch (not per row) and stays replicated, except `vision.token_image_rows`
    [K, R, T] (vision reuse's gather map, per token like `tokens`); rank < 2 leaves stay replicated.
    """
    if path and path[-1] == "token_image_rows" and ndim == 3:
        return 1
    if "vision" in path or ndim < 2:
        return None
    if path and path[-1] == "positions":
        return 2 if ndim == 4 else 1
    return 1


def batch_shardings(
    tree: Any,
    mesh: Mesh,
    rules: Rules | None = None,
    row_axis_of: Callable[[tuple[str, ...], int], int | None] = default_row_axis,
) -> Any:
    """NamedShardings (same structure as `tree`) that split every leaf's rows over the batch axes.

    Raises if a leaf's row count is not a multiple of `row_multiple(mesh, rules)`: batches are
    padded to that multiple by the batcher, so a mismatch is a bug upstream, not something to hide
    by replicating.
    """
    multiple = row_multiple(mesh, rules)

    def one(path: tuple, leaf: Any) -> NamedSharding:
        names = tuple(_key_name(p) for p in path)
        ndim = int(np.ndim(leaf))
        axis = row_axis_of(names, ndim)
        if axis is not None and np.shape(leaf)[axis] % multiple:
            raise ShardingError(
                f"batch leaf {'.'.join(names) or '<root>'} has {np.shape(leaf)[axis]} rows (axis {axis} of shape "
                f"{tuple(np.shape(leaf))}), not a multiple of the {multiple} batch shards of mesh {dict(mesh.shape)}; "
                "build batches with row_multiple=sharding.row_multiple(mesh, rules)"
            )
        return NamedSharding(mesh, batch_spec(ndim, axis, mesh, rules))

    return jax.tree_util.tree_map_with_path(one, tree)


def put_batch(tree: Any, mesh: Mesh, rules: Rules | None = None, **kw: Any) -> Any:
    """device_put a host batch pytree into `batch_shardings` (single process; multi-host assembles
    global arrays from process-local rows instead)."""
    return jax.device_put(tree, batch_shardings(tree, mesh, rules, **kw))
