"""Guess the number: a complete, minimal multi-turn environment (the example of docs/guides/custom-env.md).

The prompt asks for a whole number from 1 to 20; the row's `answer` is the secret. Each model turn is one guess.
A right guess ends the episode; a wrong one is answered "Higher." or "Lower." until `max_turns` runs out. Reward
(`verdict()`): 1 for a right first guess, `turn_penalty` less for each extra turn, 0 if never right. The feedback
never names the secret, and the reward is graded on the model's own replies only.

    jaxrl-vlm rollout docs/examples/guess_tiny.yaml --dump runs/guess/rollout.jsonl

This file is also the module's data generator (`--synthetic-data-module docs/examples/guess_env.py` with
`--make-data`): `make_dataset` writes prompt rows in the Geometry3K layout (`problem`, `answer`, `images`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from envs.base import BaseInteractionEnv, EnvOptions, option, require_max_turns, sample_label, sample_where

LOW, HIGH = 1, 20
QUESTION = f"I am thinking of a whole number from {LOW} to {HIGH}. Guess it: reply with the number only."


@dataclass(frozen=True)
class GuessOptions(EnvOptions):
    """The env's own options: each field is a `--custom-config-path` key (or a key under `extra:` in a config)."""

    ENV_NAME = "guess"

    turn_penalty: float = option(0.25, "guess: reward lost for each turn before the right guess.", ge=0)

    def validate(self) -> None:
        if self.turn_penalty > 1:
            raise ValueError(f"args.turn_penalty must be <= 1, got {self.turn_penalty}")


# The keys the config loader accepts for this env, derived from the options dataclass.
CONFIG_KEYS = GuessOptions.config_keys()


def parse_guess(text: str) -> int | None:
    """The first whole number in the reply, or None."""
    match = re.search(r"-?\d+", text)
    return int(match.group()) if match else None


class GuessEnv(BaseInteractionEnv):
    """One secret number. `format_observation` and `close` are the base class's."""

    def __init__(self, secret: int, max_turns: int, options: GuessOptions) -> None:
        self.secret = secret
        self.max_turns = max_turns
        self.options = options
        self.reset()

    def reset(self) -> None:
        self.turn = 0
        self.done = False
        self.solved_at: int | None = None

    def step(self, response_text: str) -> tuple[dict[str, Any], bool, dict[str, Any]]:
        self.check_step(response_text)  # no step after close() or after the end; the text is a str
        self.turn += 1
        guess = parse_guess(response_text)
        info = {"turn": self.turn, "guess": guess}
        if guess == self.secret:
            self.solved_at = self.turn
            self.done = True
            return {"obs_str": "Correct."}, True, info
        if self.turn >= self.max_turns:
            self.done = True
            return {"obs_str": "Wrong. No turns left."}, True, info
        if guess is None:
            hint = "No number found."
        else:
            hint = "Higher." if guess < self.secret else "Lower."
        return {"obs_str": f"{hint} Guess again."}, False, info

    def verdict(self) -> float:
        """The episode's reward: 1 - turn_penalty * (k - 1) for a right guess at turn k (at least 0), else 0."""
        if self.solved_at is None:
            return 0.0
        return max(0.0, 1.0 - self.options.turn_penalty * (self.solved_at - 1))


def build_env(sample: Any, args: Any) -> GuessEnv:
    """The rollout calls this once per episode: the secret is the sample's label, options come from `args`."""
    label = sample_label(sample)
    try:
        secret = int(label)
    except (TypeError, ValueError):
        raise ValueError(f"guess build_env: {sample_where(sample)} has label {label!r}, not a whole number") from None
    return GuessEnv(secret, require_max_turns(args, "guess"), GuessOptions.from_args(args))


def make_dataset(out_path: str, num_rows: int, seed: int = 0, image_size: int = 0) -> str:
    """`--make-data`'s generator: `num_rows` prompt rows as JSON lines (no pictures; `image_size` is unused)."""
    if not str(out_path).endswith(".jsonl"):
        raise ValueError(f"{out_path}: this generator writes .jsonl")
    rng = np.random.default_rng(seed)
    Path(out_path).parent.mkdir(parents=True, exist_ok=True)
    with open(out_path, "w", encoding="utf-8") as f:
        for _ in range(num_rows):
            secret = int(rng.integers(LOW, HIGH + 1))
            f.write(json.dumps({"problem": QUESTION, "answer": str(secret), "images": []}) + "\n")
    return str(out_path)
