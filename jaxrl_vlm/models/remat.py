"""Which rematerialisation (activation checkpointing) policy each kind of layer runs under: the `--remat` option.

Why per kind: the layers of one model differ in what their saved activations cost. A full-attention layer saves
[B, T, N, H] q/k/v and (XLA attention) its [B, K, G, T/cp, T] logits, a linear-attention layer its chunked
delta-rule states, a routed MoE layer its [N k, F] expert hidden, a vision block [P, F_vision]. Recomputing the
cheap ones and keeping the matmul outputs of the expensive ones is the usual trade (MaxText's per-layer policies).

Spec (a string, so it is one option on the command line and in YAML): comma-separated items, each either a bare
POLICY (every kind not named otherwise) or KIND=POLICY, e.g. `full`, `dots`, `full,vision=none`,
`full_attention=dots,linear_attention=full,moe=full`. Kinds not named and with no bare default are `none`.
`remat: none | full` (the old option) keep their meaning. Policies:
  none  keep every activation of the layer (no recomputation);
  full  keep only the layer's inputs, recompute the whole layer in the backward pass;
  dots  keep the outputs of matmuls without batch dimensions (the projections and MLPs: `x @ W`), recompute
        the rest (norms, rotary, activations, the batched attention einsums and their softmax);
        jax.checkpoint_policies.dots_with_no_batch_dims_saveable;
  offload  as dots, but the matmul outputs wait for the backward pass in host memory (`pinned_host`) instead of
        device memory; jax.checkpoint_policies.offload_dot_with_no_batch_dims.

This module is plain Python (the run config validates `--remat` with it and imports no jax); the layers map a
policy name to its jax checkpoint policy (`layers.remat_runner`).
"""

from __future__ import annotations

from dataclasses import dataclass

LAYER_KINDS = ("full_attention", "linear_attention", "moe", "vision")
POLICIES = ("none", "full", "dots", "offload")


@dataclass(frozen=True)
class RematPlan:
    """The policy of each layer kind: decoder layers with softmax attention (`full_attention`; a MoE family's dense
    layers too), Qwen3.5's gated delta-rule layers (`linear_attention`), decoder layers with a routed MoE MLP
    (`moe`) and vision-tower blocks (`vision`). Static (hashable) model configuration."""

    full_attention: str = "none"
    linear_attention: str = "none"
    moe: str = "none"
    vision: str = "none"

    def __post_init__(self) -> None:
        for kind in LAYER_KINDS:
            if getattr(self, kind) not in POLICIES:
                raise ValueError(f"remat policy {getattr(self, kind)!r} for {kind} layers: choose one of {POLICIES}")

    def __bool__(self) -> bool:
        """True when any kind of layer is rematerialised."""
        return any(getattr(self, kind) != "none" for kind in LAYER_KINDS)

    def policy(self, kind: str) -> str:
        if kind not in LAYER_KINDS:
            raise ValueError(f"unknown layer kind {kind!r}; the kinds are {LAYER_KINDS}")
        return getattr(self, kind)

    @classmethod
    def parse(cls, spec: str) -> RematPlan:
        """The plan of a `--remat` spec (see the module docstring); ValueError naming the bad item otherwise."""
        default, named = None, {}
        for item in (part.strip() for part in spec.split(",")):
            kind, sep, policy = (part.strip() for part in item.partition("="))
            if not sep:
                kind, policy = None, kind
            if policy not in POLICIES:
                raise ValueError(f"remat {spec!r}: policy {policy!r} in {item!r} is not one of {POLICIES}")
            if kind is None:
                if default is not None:
                    raise ValueError(f"remat {spec!r}: more than one default policy (a bare POLICY item)")
                default = policy
            elif kind not in LAYER_KINDS:
                raise ValueError(f"remat {spec!r}: unknown layer kind {kind!r} in {item!r}; the kinds are {LAYER_KINDS}")
            elif kind in named:
                raise ValueError(f"remat {spec!r}: {kind} is given twice")
            else:
                named[kind] = policy
        return cls(**{kind: named.get(kind, default or "none") for kind in LAYER_KINDS})

    @classmethod
    def of(cls, remat: bool | str | RematPlan) -> RematPlan:
        """A model's `remat` argument as a plan: a plan, a spec string, or a bool (True: `full` for every kind)."""
        if isinstance(remat, RematPlan):
            return remat
        if isinstance(remat, bool):
            return cls.parse("full" if remat else "none")
        if isinstance(remat, str):
            return cls.parse(remat)
        raise TypeError(f"remat must be a bool, a spec string or a RematPlan, got {type(remat).__name__}")
