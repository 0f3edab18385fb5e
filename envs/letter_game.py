"""A toy task whose reward a tiny random model can learn in a few dozen RL steps (closed-loop tests, demos).

The prompt does not matter: the model should answer using letters from the first half of the alphabet.
The reward is the fraction of the answer's ASCII letters that lie in a-m (0 when it has no letters). A random
model starts near 0.5 with plenty of variance between samples, so GRPO gets a dense signal; the reward only
rises if the rollout engine really samples from the updated weights.
"""

from __future__ import annotations

from typing import Any

from envs.base import BaseInteractionEnv, require_max_turns


def first_half_letter_share(text: str) -> float:
    letters = [c for c in text.lower() if "a" <= c <= "z"]
    if not letters:
        return 0.0
    return sum(1 for c in letters if c <= "m") / len(letters)


def reward_fn(model_text: str, label: Any) -> float:
    return first_half_letter_share(model_text)


class LetterGameEnv(BaseInteractionEnv):
    """Single verdict from the model's first turn; multi-turn configs get a short nudge as the observation."""

    def __init__(self, max_turns: int):
        self.max_turns = max_turns
        self.turn = 0
        self.score: float | None = None

    def reset(self) -> None:
        self.turn = 0
        self.score = None

    def step(self, response_text: str) -> tuple[dict[str, Any], bool, dict[str, Any]]:
        self.turn += 1
        self.score = first_half_letter_share(response_text)
        done = self.turn >= self.max_turns
        return {"obs_str": "Use earlier letters."}, done, {"score": self.score}

    def verdict(self) -> float | None:
        return self.score


def build_env(sample: Any, args: Any) -> LetterGameEnv:
    return LetterGameEnv(max_turns=require_max_turns(args, "letter_game"))
