"""LoRA+ (Hayou et al. 2024): lora_B learns faster than lora_A, as one optax transform after the optimizer.

Scaling a leaf's final update by k is training it at k times the learning rate (AdamW's update is linear in the
learning rate, its decoupled weight decay included), so this is PEFT's `create_loraplus_optimizer` (lora_B at
`ratio` x lr, everything else at lr) on top of whatever schedule `make_optimizer` built. Stateless: the optimizer
state keeps its layout.
"""

from __future__ import annotations

from typing import Any

import jax
import optax

LORA_B = "lora_B"


def _is_lora_b(path: tuple[Any, ...]) -> bool:
    last = path[-1] if path else None
    return isinstance(last, jax.tree_util.DictKey) and last.key == LORA_B


def lora_plus(ratio: float) -> optax.GradientTransformation:
    """Multiply the updates of every `lora_B` leaf (a dict key of the adapters pytree) by `ratio`."""
    if not ratio > 0:
        raise ValueError(f"lora_plus: the ratio must be > 0, got {ratio!r}")

    def update(updates, state, params=None):
        del params
        scaled = jax.tree_util.tree_map_with_path(lambda p, u: u * ratio if _is_lora_b(p) else u, updates)
        return scaled, state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def adapter_optimizer(tx: optax.GradientTransformation, ratio: float) -> optax.GradientTransformation:
    """The optimizer of a LoRA run: `tx` itself at ratio 1 (plain LoRA, the optimizer state of earlier runs), else
    `tx` then `lora_plus(ratio)`."""
    return tx if ratio == 1.0 else optax.chain(tx, lora_plus(ratio))
