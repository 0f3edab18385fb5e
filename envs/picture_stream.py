"""A long-episode stress environment: every turn is answered with a new picture, until `max_turns`.

For the seed's long experiment scaled to a CPU (`configs/geo3k_multiturn_long_tiny.yaml`: 20 turns, a 32,000-token
response budget): the episode never ends early, so each trajectory carries `max_turns` model turns and
`max_turns` observation pictures on top of the prompt's, and the trainer sees the longest rows the settings allow.
The reward is dense so that GRPO groups are not all-equal: the mean over turns of the share of a reply's letters
in a-m (`letter_game`'s signal; 0.5 for a random policy).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image

from envs.base import BaseInteractionEnv, EnvOptions, option, require_max_turns
from envs.letter_game import first_half_letter_share


@dataclass(frozen=True)
class PictureStreamOptions(EnvOptions):
    """The picture stream's `--custom-config-path` keys."""

    ENV_NAME = "picture_stream"

    picture_px: int = option(64, "picture_stream: side in pixels of each observation picture.", ge=16)


CONFIG_KEYS: dict[str, tuple[type, Any, str]] = PictureStreamOptions.config_keys()


def picture(seed: int, px: int) -> Image.Image:
    """A deterministic picture for turn `seed`: a color gradient with a bright square at a seed-chosen place."""
    rng = np.random.default_rng(seed)
    ramp = np.linspace(0, 255, px, dtype=np.float32)
    base = rng.uniform(0.3, 1.0, size=3).astype(np.float32)
    pixels = (ramp[:, None, None] * base[None, None, :] + ramp[None, :, None] * (1 - base)[None, None, :]) / 2
    x, y = rng.integers(0, px - px // 4, size=2)
    pixels[y : y + px // 4, x : x + px // 4] = 255
    return Image.fromarray(pixels.astype(np.uint8), "RGB")


class PictureStreamEnv(BaseInteractionEnv):
    """See the module docstring."""

    def __init__(self, seed: int, max_turns: int, options: PictureStreamOptions | None = None):
        self.seed = seed
        self.max_turns = max_turns
        self.options = PictureStreamOptions() if options is None else options
        self.reset()

    def reset(self) -> None:
        self.turn = 0
        self.done = False
        self.scores: list[float] = []

    def step(self, response_text: str) -> tuple[dict[str, Any], bool, dict[str, Any]]:
        self.check_step(response_text)
        self.turn += 1
        self.scores.append(first_half_letter_share(response_text))
        self.done = self.turn >= self.max_turns
        obs = {"obs_str": f"Picture {self.turn + 1}:",
               "multi_modal_data": {"image": [picture(self.seed * 1000 + self.turn, self.options.picture_px)]}}
        return obs, self.done, {"turn": self.turn}

    def verdict(self) -> float | None:
        return float(np.mean(self.scores)) if self.scores else 0.0


def build_env(sample: Any, args: Any) -> PictureStreamEnv:
    seed = int(getattr(sample, "index", 0) or 0) + 7919 * int(getattr(sample, "group_index", 0) or 0)
    return PictureStreamEnv(seed, require_max_turns(args, "picture_stream"), PictureStreamOptions.from_args(args))
