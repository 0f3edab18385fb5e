"""The embedded engine's devices: `dp_size` replicas of `tp_size` devices each (SGLang's --dp-size / --tp-size).

A replica is one `ModelRunner` + `Scheduler` on a mesh of its own tp devices, with the trainer's sharding rules:
the `tensor` axis splits heads, MLP and vocabulary as in Megatron (parameters are loaded straight into those
shards), and the KV cache splits its kv-heads the same way, so attention needs no communication. Replicas share
nothing: each holds its own copy of the weights and its own KV cache, and a router (`replicas.py`) spreads
requests over them. A dimension that does not divide by tp (the tiny test model's 2 kv heads over 4 devices)
is replicated, as `sharding.rules` documents. Each family's cache declares the logical axes of its arrays
(`families.DecodeCache.logical_axes`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxrl_vlm.sharding.layout import build_mesh, param_shardings
from jaxrl_vlm.sharding.rules import DEFAULT_RULES, Rules, spec_with_notes

@dataclass(frozen=True)
class _TensorParallel:
    """MeshSizes of one replica: all its devices on the `tensor` axis."""

    mesh_tensor: int
    mesh_data: int = 1
    mesh_fsdp: int = 1


def engine_devices(tp_size: int, dp_size: int, devices: Sequence[Any] | None = None) -> list[Any]:
    """The engine's devices: the given ones (exactly tp x dp of them), or the first tp x dp local devices."""
    if tp_size < 1 or dp_size < 1:
        raise ValueError(f"tp_size and dp_size must be >= 1, got tp_size={tp_size}, dp_size={dp_size}")
    want = tp_size * dp_size
    if devices is None:
        local = jax.local_devices()
        if len(local) < want:
            raise ValueError(f"tp_size {tp_size} x dp_size {dp_size} = {want} devices, but this host has {len(local)}")
        return list(local[:want])
    devices = list(devices)
    if len(devices) != want:
        raise ValueError(f"the engine was given {len(devices)} devices but tp_size {tp_size} x dp_size {dp_size} = {want}")
    return devices


class ReplicaPlacement:
    """Shardings of one replica's arrays on its mesh (parameters by the rules, KV cache by kv heads, the rest
    replicated)."""

    def __init__(self, devices: Sequence[Any], rules: Rules = DEFAULT_RULES):
        self.devices = list(devices)
        self.rules = rules
        self.mesh: Mesh = build_mesh(_TensorParallel(mesh_tensor=len(self.devices)), self.devices)
        self.replicated = NamedSharding(self.mesh, PartitionSpec())

    @property
    def tp_size(self) -> int:
        return len(self.devices)

    def params(self, state: Any) -> Any:
        """NamedShardings in the structure of a parameter state."""
        return param_shardings(state, self.mesh, self.rules)

    def cache(self, abstract_cache: Any) -> Any:
        """NamedShardings in the structure of a family's decode cache (`families.DecodeCache`, abstract or not),
        from the logical axes the cache declares for each of its arrays (KV pages by kv heads, recurrent state by
        its heads)."""
        def one(axes: tuple[str | None, ...], leaf: Any) -> NamedSharding:
            spec, _ = spec_with_notes(axes, tuple(leaf.shape), self.rules, self.mesh)
            return NamedSharding(self.mesh, spec)

        return jax.tree.map(one, abstract_cache.logical_axes(), abstract_cache,
                            is_leaf=lambda x: isinstance(x, tuple) and all(a is None or isinstance(a, str) for a in x))

    def put_params(self, state: Any) -> Any:
        """`state` moved (or resharded, also across device sets) into this replica's parameter shardings."""
        return jax.device_put(state, self.params(state))


def replica_placements(tp_size: int, dp_size: int, devices: Sequence[Any] | None = None) -> list[ReplicaPlacement]:
    """One placement per replica, each over `tp_size` neighbouring devices of the engine's devices."""
    devs = engine_devices(tp_size, dp_size, devices)
    return [ReplicaPlacement(devs[r * tp_size:(r + 1) * tp_size]) for r in range(dp_size)]
