"""Trained-looking LoRA adapters on a stand-in policy, for the tests that push adapter versions through the weight
syncer (tests/test_lora_wire.py against stand-in engines, tests/vllm_real/test_vllm_lora.py against vLLM): the
syncer reads only the adapters attached to the policy it is given, so no model has to be built or trained."""

from __future__ import annotations

import numpy as np

from jaxrl_vlm.lora.adapters import LoraSetup, PolicyAdapters, attach_adapters


class StandInPolicy:
    """Stands for the trainer's merged policy model: the syncer sends only the adapters attached to it."""


def random_adapters(setup: LoraSetup, seed: int, scale: float = 1.0) -> list[dict[str, np.ndarray]]:
    """One (lora_A, lora_B) pair per adapted site, both non-zero (a fresh adapter's B is zero and changes nothing);
    host arrays: what the syncer writes does not depend on where they live."""
    rng = np.random.default_rng(seed)
    return [{"lora_A": (scale * rng.normal(size=(setup.rank, s.in_features))).astype(np.float32),
             "lora_B": (scale * rng.normal(size=(s.out_features, setup.rank))).astype(np.float32)}
            for s in setup.sites]


def policy_with(setup: LoraSetup, adapters: list[dict[str, np.ndarray]]) -> StandInPolicy:
    return attach_adapters(StandInPolicy(), PolicyAdapters(setup, adapters))
