"""Sharding constraints on activations, so XLA gathers FSDP weights instead of reducing activations.

Why: under FSDP a matrix is sharded along its model ("embed") dimension and batch rows are sharded
over the same mesh axis. Given only the parameter and input shardings, XLA's propagation may choose
to shard the activation's embed dimension to match the weight and all-reduce the partial products
(the log-prob projection's [B, C, V] fp32 logits, the MLP's [B, T, F] hidden) instead of
all-gathering the (much smaller, per layer) weight. `jaxrl-vlm bench sharding` measured exactly that.
Constraining the activations to "rows over the batch axes, model dimension whole" at each layer
boundary leaves gathering the weight as the only cheap plan (MaxText does the same with its
logical-constraint annotations).

The model calls `constrain(x, names)` with logical names (`batch` for rows, `heads`/`kv_heads`/
`mlp`/`vocab` for tensor-parallel dims, None for dims that are never split). Outside an
`activation_sharding(...)` context (the engine, eager use, tests of the math) it returns `x`
unchanged. The train step enters the context while it is traced, from its static `StepConfig`, so a
compiled program always matches the layout it was built for; the context is a trace-time setting,
not state that outlives a call.

The model only names axes: what a name resolves to on a mesh is the sharding rules' business, so the
context holds any `ActivationLayout` (`jaxrl_vlm.sharding.activations.ActivationSharding` resolves the
names with the rules table). `models/` thus imports nothing of `sharding/`, which places models.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Sequence
from typing import Protocol

import jax
from jax.sharding import Mesh, NamedSharding


class ActivationLayout(Protocol):
    """What the model needs of a layout: the mesh, the sharding of an activation from its logical names, and the
    expert-parallel capacity factor of MoE blocks (`models.expert_parallel`; None: no token ever dropped)."""

    mesh: Mesh
    moe_capacity_factor: float | None

    def sharding(self, names: Sequence[str | None], shape: Sequence[int]) -> NamedSharding: ...


_CURRENT: contextvars.ContextVar[ActivationLayout | None] = contextvars.ContextVar("activation_sharding", default=None)


@contextlib.contextmanager
def activation_sharding(spec: ActivationLayout | None) -> Iterator[None]:
    """Within the block, `constrain` applies `spec` (None: constraints off)."""
    token = _CURRENT.set(spec)
    try:
        yield
    finally:
        _CURRENT.reset(token)


def current() -> ActivationLayout | None:
    """The active constraints (None outside an `activation_sharding` context)."""
    return _CURRENT.get()


def constrain(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
    """`x` constrained to the sharding its logical `names` resolve to; `x` itself when no context is active."""
    spec = _CURRENT.get()
    if spec is None:
        return x
    if len(names) != x.ndim:
        raise ValueError(f"activation names {tuple(names)} do not match shape {x.shape}")
    return jax.lax.with_sharding_constraint(x, spec.sharding(names, x.shape))


# Logical names of the activations the model constrains (one place, so the layout is reviewable).
# `batch` splits rows, `sequence` a row's positions (context parallelism: contiguous blocks, one per device of a
# context group; a no-op when the context axis has size 1).
ROWS_HIDDEN = ("batch", "sequence", None)  # [B, T, D]: rows and positions split, model dimension whole
ROWS_Q = ("batch", "sequence", "heads", None)  # [B, T, N, H]
ROWS_KV = ("batch", "sequence", "kv_heads", None)  # [B, T, K, H] as projected
# Keys and values every query block attends to: under context parallelism each device keeps its block of
# queries and gathers the whole row's keys and values (all-gather attention; see `layers.text_attention`).
KV_WHOLE = ("batch", None, "kv_heads", None)  # [B, T, K, H]
TEXT_MASK = ("batch", "sequence", None)  # [B, Tq, Tk] bool
TEXT_LOGITS = ("batch", "kv_heads", None, "sequence", None)  # [B, K, G, Tq, Tk] attention logits
ROWS_ROPE = ("batch", "sequence", None)  # [B, T, head_dim] rotary tables
ROWS_MLP = ("batch", "sequence", "mlp")  # [B, T, F]
ROWS_VOCAB = ("batch", "sequence", "vocab")  # [B, C, V] log-prob logits chunk (C: positions of every shard)
# Vision patches of a micro-batch [P, ...]: split over every device of the rows' and positions' axes
# (`patches`), so the vision tower runs data-parallel instead of on every device (attention gathers the other
# shards' keys and values; merged image features are scattered into whichever sequence shard owns their slot).
PATCH_HIDDEN = ("patches", None)  # [P, D_vision]
PATCH_HEADS = ("patches", "vision_heads", None)  # [P, N, H]
PATCH_MLP = ("patches", "vision_mlp")  # [P, F_vision]
PATCH_LOGITS = (None, "vision_heads", None, "patches", None)  # attention logits [1, N, 1, P (queries), P (keys)]
PATCH_HEADS_WHOLE = (None, None, "vision_heads", None)  # [1, P, N, H] for a fused kernel: every patch on each shard


# name -> (dims, logical names), for the sharding goldens (`jaxrl_vlm.sharding.goldens.dump_shardings`).
ACTIVATIONS: dict[str, tuple[tuple[str, ...], tuple[str | None, ...]]] = {
    "hidden": (("B", "T", "D"), ROWS_HIDDEN),
    "q": (("B", "T", "N", "H"), ROWS_Q),
    "kv": (("B", "T", "K", "H"), ROWS_KV),
    "kv_whole": (("B", "T", "K", "H"), KV_WHOLE),
    "text_mask": (("B", "T", "T"), TEXT_MASK),
    "text_logits": (("B", "K", "G", "T", "T"), TEXT_LOGITS),
    "rope": (("B", "T", "H"), ROWS_ROPE),
    "mlp": (("B", "T", "F"), ROWS_MLP),
    "logprob_logits": (("B", "C", "V"), ROWS_VOCAB),
    "patch_hidden": (("P", "D_vision"), PATCH_HIDDEN),
    "patch_heads": (("P", "N_vision", "H_vision"), PATCH_HEADS),
    "patch_mlp": (("P", "F_vision"), PATCH_MLP),
    "patch_logits": (("1", "N_vision", "1", "P", "P"), PATCH_LOGITS),
}
