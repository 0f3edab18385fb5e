"""A test environment whose every observation carries a new image, for three turns (loaded by file path)."""

from __future__ import annotations

from typing import Any

import numpy as np
from PIL import Image

from envs.base import BaseInteractionEnv

TURNS = 3


def _image(seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, size=(32 + 16 * (seed % 2), 48, 3), dtype=np.uint8))


class ImageObservationEnv(BaseInteractionEnv):
    """Answers every turn with a short text and a fresh image; done after TURNS model turns."""

    def __init__(self, seed: int):
        self.seed = seed
        self.turn = 0

    def reset(self) -> None:
        self.turn = 0

    def step(self, response_text: str) -> tuple[dict[str, Any], bool, dict[str, Any]]:
        self.turn += 1
        obs = {"obs_str": f"Look again ({self.turn}).", "multi_modal_data": {"image": [_image(self.seed + self.turn)]}}
        return obs, self.turn >= TURNS, {}

    def verdict(self) -> float | None:
        return float(self.seed % 2)


def build_env(sample: Any, args: Any) -> ImageObservationEnv:
    return ImageObservationEnv(seed=7 * int(sample.group_index) + int(sample.index))
