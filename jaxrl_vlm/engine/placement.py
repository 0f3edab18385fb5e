"""The embedded engine's devices: `dp_size` replicas of `tp_size` devices each (SGLang's --dp-size / --tp-size).

A replica is one `ModelRunner` + `Scheduler` on a mesh of its own tp devices, with the trainer's sharding rules:
the `tensor` axis splits heads, MLP and vocabulary as in Megatron (parameters are loaded straight into those
shards), and the KV cache splits its kv-heads the same way, so attention needs no communication. Replicas share
nothing: each holds its own copy of the weights and its own KV cache, and a router (`replicas.py`) spreads
requests over them. A dimension that does not divide by tp (the tiny test model's 2 kv heads over 4 devices)
is replicated, as `sharding.rules` documents. Each family's cache declares the logical axes of its arrays
(`families.DecodeCache.logical_axes`).

Expert parallelism (SGLang's --ep-size, which splits the experts inside the tp group): a replica's tp devices form
an `expert` axis of ep devices by a `tensor` axis of tp / ep. Every tensor-parallel name splits over both (so the
dense layers and attention stay tp-way, as without ep); the routed experts split their expert dimension over
`expert` and their width over `tensor` (SGLang's moe_tp = tp / ep). A replica's tokens are the same on all its
devices, so an MoE block runs the copies routed to each device's own experts and sums over the group
(`models.expert_parallel`); the runner traces its programs under `activations`, the layout that says so.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxrl_vlm.sharding.activations import ActivationSharding
from jaxrl_vlm.sharding.layout import build_mesh, param_shardings
from jaxrl_vlm.sharding.rules import BATCH_AXIS, DEFAULT_RULES, PATCH_AXIS, SEQUENCE_AXIS, Rules, spec_with_notes

# The logical names tensor parallelism splits (DEFAULT_RULES maps each to `tensor`).
TENSOR_PARALLEL_NAMES = tuple(name for name, axes in DEFAULT_RULES.items() if axes == "tensor")


@dataclass(frozen=True)
class _TensorParallel:
    """MeshSizes of one replica: its devices on the `expert` (ep) and `tensor` (tp / ep) axes."""

    mesh_tensor: int
    mesh_expert: int = 1
    mesh_data: int = 1
    mesh_fsdp: int = 1


def replica_rules(ep_size: int) -> Rules:
    """The rules of a replica: DEFAULT_RULES, with every tensor-parallel name over expert x tensor when ep > 1 (the
    whole replica), and rows, positions and patches whole (a replica's requests are on all its devices)."""
    if ep_size == 1:
        return DEFAULT_RULES
    rules = dict(DEFAULT_RULES, **dict.fromkeys(TENSOR_PARALLEL_NAMES, ("expert", "tensor")))
    rules.update(dict.fromkeys((BATCH_AXIS, SEQUENCE_AXIS, PATCH_AXIS), None))
    return rules


def check_ep_size(tp_size: int, ep_size: int) -> None:
    """ep must divide tp: the experts split inside a replica's tp devices (SGLang's constraint)."""
    if ep_size < 1 or tp_size % ep_size:
        raise ValueError(f"ep_size {ep_size} must divide tp_size {tp_size}: experts are split over ep of a replica's "
                         "tp devices")


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
    replicated). `ep_size` > 1 splits the routed experts over that many of its devices (module docstring)."""

    def __init__(self, devices: Sequence[Any], rules: Rules | None = None, ep_size: int = 1):
        self.devices = list(devices)
        check_ep_size(len(self.devices), ep_size)
        self.ep_size = ep_size
        self.rules = replica_rules(ep_size) if rules is None else rules
        sizes = _TensorParallel(mesh_tensor=len(self.devices) // ep_size, mesh_expert=ep_size)
        self.mesh: Mesh = build_mesh(sizes, self.devices)
        self.replicated = NamedSharding(self.mesh, PartitionSpec())
        # The layout the programs are traced under: only with ep (MoE blocks then run their own experts and sum);
        # without it nothing changes from the plain tensor-parallel engine.
        self.activations = ActivationSharding.create(self.mesh, self.rules) if ep_size > 1 else None

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


def replica_placements(tp_size: int, dp_size: int, devices: Sequence[Any] | None = None,
                       ep_size: int = 1) -> list[ReplicaPlacement]:
    """One placement per replica, each over `tp_size` neighbouring devices of the engine's devices (experts split
    over `ep_size` of them)."""
    check_ep_size(tp_size, ep_size)
    devs = engine_devices(tp_size, dp_size, devices)
    return [ReplicaPlacement(devs[r * tp_size:(r + 1) * tp_size], ep_size=ep_size) for r in range(dp_size)]
