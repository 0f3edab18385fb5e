"""The layout of the model's activation constraints: its logical names resolved with the sharding rules.

The model (`jaxrl_vlm.models.activation_sharding`) names the axes of its activations and applies whatever
`ActivationLayout` the train step puts in context; this is the one the trainer, the bench and the tests use.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from jax.sharding import Mesh, NamedSharding

from jaxrl_vlm.sharding.rules import MeshAxes, spec_with_notes


@dataclass(frozen=True)
class ActivationSharding:
    """Mesh + logical rules for activation constraints (and MoE blocks' expert-parallel capacity factor); hashable,
    so it can live in a static config."""

    mesh: Mesh
    rules: tuple[tuple[str, MeshAxes], ...]
    moe_capacity_factor: float | None = None

    @classmethod
    def create(cls, mesh: Mesh, rules: Mapping[str, MeshAxes], moe_capacity_factor: float | None = None
               ) -> "ActivationSharding":
        return cls(mesh, tuple(sorted(rules.items())), moe_capacity_factor)

    @classmethod
    def from_config(cls, mesh_cfg: object, mesh: Mesh, rules: Mapping[str, MeshAxes]) -> "ActivationSharding | None":
        """The constraints a run uses: None when `mesh.activation_constraints` is off (MoE blocks then leave the
        expert split to XLA, which gathers the experts: expert-parallel dispatch needs the layout)."""
        if not getattr(mesh_cfg, "activation_constraints", True):
            return None
        return cls.create(mesh, rules, getattr(mesh_cfg, "moe_capacity_factor", None))

    def sharding(self, names: Sequence[str | None], shape: Sequence[int]) -> NamedSharding:
        """The NamedSharding of an activation of `shape` with logical `names` (same resolution as parameters:
        size-1 axes dropped, non-dividing dimensions replicated)."""
        spec, _ = spec_with_notes(names, shape, dict(self.rules), self.mesh)
        return NamedSharding(self.mesh, spec)
