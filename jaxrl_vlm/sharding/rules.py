"""Logical axis names -> mesh axes: the rules table and how a tensor's PartitionSpec is resolved from it.

Parameters carry logical axis names (see `jaxrl_vlm.models.qwen3_vl`); a rules table maps each name
to a mesh axis, a tuple of mesh axes, or None (replicated). One change of rules or mesh sizes is a
new layout; presets live in `configs/mesh/*.yaml` (MaxText's scheme).

Mesh axes, outermost first: `data` (pure replicas of the parameters), `fsdp` (parameters sharded,
gathered per layer; ZeRO-3), `expert` (expert parallelism: the routed experts of an MoE layer split over it),
`context` (context parallelism: one long row's positions split into contiguous blocks, one per device of a
context group) and `tensor` (Megatron-style: heads / MLP / vocab split). `tensor` is innermost so a
tensor-parallel group is made of neighbouring devices (same host, fastest links); `context` next, since
attention gathers keys and values over it every layer; `expert` next, for its two all-to-alls per MoE layer.
Batch rows are split over the axes of the `batch` rule (default `("data", "fsdp", "expert")`), a row's
positions over those of the `sequence` rule (default `context`).

How `expert` composes (Megatron's expert-parallel group, carved out of data parallelism): for every dense
tensor it is one more data-parallel axis (rows split over it, weights replicated over it, gradients reduced
over it), so with `mesh_expert=1` nothing changes. MoE expert weights [E, ...] split their expert dimension over
it; each device routes its own tokens and sends each (token, expert) copy to the device of its expert group
that owns the expert (`models.moe`, an all-to-all inside `shard_map`), which runs its local experts and sends
the results back.

How a tensor's PartitionSpec is resolved from its logical names, dimension by dimension:
  1. look the name up in the rules (unknown names are errors);
  2. drop mesh axes of size 1 (sharding over them is a no-op; goldens then show the real layout);
  3. drop mesh axes an earlier dimension of the same tensor already uses (a mesh axis may shard
     one dimension only);
  4. if the dimension is not divisible by the product of the remaining axis sizes, replicate it
     and log a note. We fall back rather than fail because presets must work across model sizes:
     pure tensor parallelism over 8 devices cannot split the tiny test model's 4 heads, but it
     still splits its MLP and vocabulary. `spec_with_notes` returns the notes; goldens record them.

A leaf: it imports neither `jaxrl_vlm.config` nor `jaxrl_vlm.models` (the layout of a model's
parameters is `sharding.layout`, of its activations `sharding.activations`). Pure bookkeeping over
names and shapes: nothing here touches devices.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
from jax.sharding import Mesh, PartitionSpec

from jaxrl_vlm.errors import ConfigError

logger = logging.getLogger(__name__)

MESH_AXES: tuple[str, ...] = ("data", "fsdp", "expert", "context", "tensor")

# The logical names the model declares (one per parameter dimension), plus `batch` for input rows.
PARAM_LOGICAL_AXES: tuple[str, ...] = (
    "vocab", "embed", "mlp", "heads", "kv_heads", "head_dim", "norm",
    "vision_patch", "vision_pos", "vision_embed", "vision_heads", "vision_head_dim", "vision_mlp", "vision_merge",
    "linear_k_heads", "linear_v_heads", "linear_head_dim", "conv_taps", "expert",
)  # fmt: skip
BATCH_AXIS = "batch"
# Activation-only names: a row's positions (context parallelism) and the vision patches of a micro-batch.
SEQUENCE_AXIS = "sequence"
PATCH_AXIS = "patches"

MeshAxes = str | tuple[str, ...] | None
Rules = Mapping[str, MeshAxes]
# Anything with axis sizes: a Mesh, an AbstractMesh, or {"data": d, "fsdp": f, "expert": e, "context": c, "tensor": t}.
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
    # Gated DeltaNet (Qwen3.5 linear attention): its key and value heads split like attention heads.
    "linear_k_heads": "tensor",
    "linear_v_heads": "tensor",
    "linear_head_dim": None,
    "conv_taps": None,
    # MoE expert weights [E, ...]: their experts split over the expert-parallel axis (a no-op at mesh_expert=1).
    "expert": "expert",
    # Rows over every data-parallel axis; `expert` is one for the dense layers (see the module docstring).
    BATCH_AXIS: ("data", "fsdp", "expert"),
    # Context parallelism: positions of a row split in contiguous blocks over `context`; vision patches over
    # every device of the rows' and positions' axes (the tower is position-wise but for its attention, which
    # gathers keys across shards; merged image features are scattered to whichever sequence shard owns them).
    SEQUENCE_AXIS: "context",
    PATCH_AXIS: ("data", "fsdp", "expert", "context"),
}


class ShardingError(ConfigError):
    """A mesh or rules config that cannot work: bad sizes, unknown logical names or mesh axes."""


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


def axis_sizes(mesh: AnyMesh) -> dict[str, int]:
    """{mesh axis: size} of a Mesh, an AbstractMesh or a plain mapping."""
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
    sizes = None if mesh is None else axis_sizes(mesh)
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
