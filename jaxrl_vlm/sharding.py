"""Device mesh from config, logical-axis rules, and the shardings of parameters and batches.

Parameters carry logical axis names (see `jaxrl_vlm.models.qwen3_vl`); a rules table maps each name
to a mesh axis, a tuple of mesh axes, or None (replicated). One change of rules or mesh sizes is a
new layout; presets live in `configs/mesh/*.yaml` (MaxText's scheme).

Mesh axes, outermost first: `data` (pure replicas of the parameters), `fsdp` (parameters sharded,
gathered per layer; ZeRO-3) and `tensor` (Megatron-style: heads / MLP / vocab split). `tensor` is
innermost so a tensor-parallel group is made of neighbouring devices (same host, fastest links).
Batch rows are split over the axes of the `batch` rule (default `("data", "fsdp")`).

How a tensor's PartitionSpec is resolved from its logical names, dimension by dimension:
  1. look the name up in the rules (unknown names are errors);
  2. drop mesh axes of size 1 (sharding over them is a no-op; goldens then show the real layout);
  3. drop mesh axes an earlier dimension of the same tensor already uses (a mesh axis may shard
     one dimension only);
  4. if the dimension is not divisible by the product of the remaining axis sizes, replicate it
     and log a note. We fall back rather than fail because presets must work across model sizes:
     pure tensor parallelism over 8 devices cannot split the tiny test model's 4 heads, but it
     still splits its MLP and vocabulary. `spec_with_notes` returns the notes; goldens record them.

Everything here is bookkeeping over shapes and names except `build_mesh`, `shard_model` and
`put_batch`, which touch devices.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from jaxrl_vlm.config import ConfigError

logger = logging.getLogger(__name__)

MESH_AXES: tuple[str, str, str] = ("data", "fsdp", "tensor")

# The logical names the model declares (one per parameter dimension), plus `batch` for input rows.
PARAM_LOGICAL_AXES: tuple[str, ...] = (
    "vocab", "embed", "mlp", "heads", "kv_heads", "head_dim", "norm",
    "vision_patch", "vision_pos", "vision_embed", "vision_heads", "vision_head_dim", "vision_mlp", "vision_merge",
)  # fmt: skip
BATCH_AXIS = "batch"

MeshAxes = str | tuple[str, ...] | None
Rules = Mapping[str, MeshAxes]
# Anything with axis sizes: a Mesh, an AbstractMesh, or {"data": d, "fsdp": f, "tensor": t}.
AnyMesh = Mesh | jax.sharding.AbstractMesh | Mapping[str, int]

# FSDP shards the model ("embed") dimension of every matrix; tensor parallelism splits the dimension
# Megatron splits (heads, MLP hidden, vocabulary); vectors (norms, biases over heads) follow their
# single dimension or stay replicated. A mesh axis of size 1 turns its entries into no-ops, so this
# one table serves the dp / fsdp / tp / fsdp+tp presets.
DEFAULT_RULES: dict[str, MeshAxes] = {
    "vocab": "tensor",
    "embed": "fsdp",
    "mlp": "tensor",
    "heads": "tensor",
    "kv_heads": "tensor",
    "head_dim": None,
    "norm": None,
    "vision_patch": None,
    "vision_pos": None,
    "vision_embed": "fsdp",
    "vision_heads": "tensor",
    "vision_head_dim": None,
    "vision_mlp": "tensor",
    "vision_merge": "fsdp",
    BATCH_AXIS: ("data", "fsdp"),
}


class ShardingError(ConfigError):
    """A mesh or rules config that cannot work: bad sizes, unknown logical names or mesh axes."""


# ----------------------------------------------------------------------------- mesh


def mesh_shape(mesh_cfg: Any, num_devices: int) -> dict[str, int]:
    """{"data": d, "fsdp": f, "tensor": t} from `MeshConfig` sizes, one -1 filled so d*f*t = num_devices."""
    sizes = {"data": int(mesh_cfg.mesh_data), "fsdp": int(mesh_cfg.mesh_fsdp), "tensor": int(mesh_cfg.mesh_tensor)}
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


def build_mesh(mesh_cfg: Any, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A `Mesh` with axes ("data", "fsdp", "tensor") and explicit `AxisType.Auto`.

    Auto, not jax's default Explicit: the model relies on sharding propagation, and
    `with_sharding_constraint` raises under Explicit axes. `devices` defaults to all (global) devices.
    """
    devs = list(jax.devices() if devices is None else devices)
    sizes = mesh_shape(mesh_cfg, len(devs))
    return jax.make_mesh(
        tuple(sizes[a] for a in MESH_AXES), MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES), devices=devs
    )


def abstract_mesh(mesh_cfg: Any, num_devices: int) -> jax.sharding.AbstractMesh:
    """Mesh axes and sizes without devices: enough to resolve PartitionSpecs (goldens, planning)."""
    sizes = mesh_shape(mesh_cfg, num_devices)
    return jax.sharding.AbstractMesh(tuple(sizes[a] for a in MESH_AXES), MESH_AXES, axis_types=(AxisType.Auto,) * 3)


# ----------------------------------------------------------------------------- rules


def _normalize_axes(name: str, value: Any, source: str) -> MeshAxes:
    if value is None:
        return None
    axes = (value,) if isinstance(value, str) else value
    if not isinstance(axes, (list, tuple)) or not all(isinstance(a, str) for a in axes):
        raise ShardingError(f"{source}: rule {name!r} must be a mesh axis, a list of mesh axes or null, got {value!r}")
    unknown = [a for a in axes if a not in MESH_AXES]
    if unknown:
        raise ShardingError(f"{source}: rule {name!r} names unknown mesh axes {unknown}; mesh axes are {list(MESH_AXES)}")
    if len(set(axes)) != len(axes):
        raise ShardingError(f"{source}: rule {name!r} repeats a mesh axis: {list(axes)}")
    if not axes:
        return None
    return axes[0] if len(axes) == 1 else tuple(axes)


def resolve_rules(overrides: Mapping[str, Any] | None = None, source: str = "sharding_rules") -> dict[str, MeshAxes]:
    """DEFAULT_RULES with `overrides` (from `MeshConfig.sharding_rules`) applied and validated.

    Values: a mesh axis, a list of mesh axes (the dimension is split over their product), or null.
    """
    rules = dict(DEFAULT_RULES)
    for name, value in (overrides or {}).items():
        if name not in DEFAULT_RULES:
            raise ShardingError(f"{source}: unknown logical axis {name!r}; known names are {sorted(DEFAULT_RULES)}")
        rules[name] = _normalize_axes(name, value, source)
    for name, value in rules.items():
        rules[name] = _normalize_axes(name, value, source)
    return rules


def _axis_sizes(mesh: AnyMesh) -> dict[str, int]:
    return dict(mesh.shape) if hasattr(mesh, "shape") else dict(mesh)


def spec_with_notes(
    names: Sequence[str | None],
    shape: Sequence[int] | None,
    rules: Rules,
    mesh: AnyMesh | None,
) -> tuple[PartitionSpec, list[str]]:
    """PartitionSpec of a tensor of `shape` with logical `names`, and a note per fallback taken.

    See the module docstring for the resolution steps. `names` entries may be None (replicated).
    Without `mesh` no axis is dropped for size 1; without `shape` divisibility is not checked.
    """
    if shape is not None and len(names) != len(shape):
        raise ShardingError(f"logical names {tuple(names)} do not match shape {tuple(shape)}")
    sizes = None if mesh is None else _axis_sizes(mesh)
    used: set[str] = set()
    entries: list[MeshAxes] = []
    notes: list[str] = []
    for dim, name in enumerate(names):
        if name is None:
            entries.append(None)
            continue
        if name not in rules:
            raise ShardingError(f"logical axis {name!r} has no sharding rule; known names are {sorted(rules)}")
        rule = rules[name]
        axes = [] if rule is None else ([rule] if isinstance(rule, str) else list(rule))
        if sizes is not None:
            axes = [a for a in axes if sizes.get(a, 1) > 1]
        clash = [a for a in axes if a in used]
        if clash:
            notes.append(f"dim {dim} ({name}): mesh axes {clash} already shard an earlier dim; not used here")
            axes = [a for a in axes if a not in used]
        if axes and shape is not None and sizes is not None:
            ways = math.prod(sizes[a] for a in axes)
            if shape[dim] % ways:
                notes.append(f"dim {dim} ({name}) of size {shape[dim]} is not divisible by {ways} ({'x'.join(axes)}); replicated")
                axes = []
        used.update(axes)
        entries.append(None if not axes else axes[0] if len(axes) == 1 else tuple(axes))
    while entries and entries[-1] is None:
        entries.pop()  # canonical form: P('x') not P('x', None), so goldens and equality are stable
    return PartitionSpec(*entries), notes


def logical_to_spec(
    names: Sequence[str | None],
    rules: Rules,
    shape: Sequence[int] | None = None,
    mesh: AnyMesh | None = None,
) -> PartitionSpec:
    """PartitionSpec for logical `names`: the rules-table lookup, refined by `mesh` (size-1 axes
    dropped) and `shape` (non-dividing dimensions replicated, with a logged note)."""
    spec, notes = spec_with_notes(names, shape, rules, mesh)
    for note in notes:
        logger.info("sharding %s %s: %s", tuple(names), None if shape is None else tuple(shape), note)
    return spec


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
    mesh: Mesh, rules: Rules, model_cfg: Any | None = None
) -> Callable[..., NamedSharding]:
    """The `from_hf(path, shardings_for=...)` callback: `(logical_names, shape=None) -> NamedSharding`.

    With `shape`, the spec is resolved exactly as `param_shardings` does. from_hf passes names only,
    so give `model_cfg` (a `Qwen3VLConfig`): the spec of each names-tuple is then resolved over every
    parameter shape that carries it, keeping per dimension only what all of them agree on (for
    Qwen3-VL every names-tuple resolves the same for all its shapes, so this equals
    `param_shardings`; `tests/test_sharding.py` checks it per layout). Without either, names are
    looked up with size-1 axes dropped and divisibility left to JAX.
    """
    by_names: dict[tuple[str | None, ...], PartitionSpec] = {}
    if model_cfg is not None:
        from jaxrl_vlm.models.hf_io import abstract_model

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
    sizes = _axis_sizes(mesh)
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
    sizes = _axis_sizes(mesh)
    rule = (rules or DEFAULT_RULES).get(BATCH_AXIS)
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
    patches of a whole micro-batch (not per row) and stays replicated; so do rank < 2 leaves.
    """
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


# ----------------------------------------------------------------------------- goldens


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
}


def dump_shardings(model_cfg: Any, mesh_cfg: Any, num_devices: int = 8) -> dict[str, Any]:
    """JSON-able layout of every parameter, of the batch inputs and of the constrained activations, for
    `model_cfg` under `mesh_cfg`.

    Resolved on an abstract mesh of `num_devices` (no devices or memory needed). Checked in as
    goldens under tests/goldens/sharding/ so a change that silently re-shards a tensor fails a test.
    """
    from jaxrl_vlm.models.activation_sharding import ACTIVATIONS
    from jaxrl_vlm.models.hf_io import abstract_model

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
