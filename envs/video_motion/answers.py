"""How a video-motion reply is read, the reward schedule and the chance levels, in closed form (no clips here).

A reply acts by its FIRST ASCII letter (either case), as `envs.color_reveal.answers.parse_answer` reads colors:
a-l answers left, m-r answers right, s-z asks to watch the motion again at half speed ("slow", "see", "watch").
Each action's own word starts in its range ("left", "right", "slow"), so "Left.", " right" or "slow please" all act
as they say; every reply that has a letter does something (garbage from a random model included), so the reward
has variance from the first step. A reply without any ASCII letter does nothing: it counts as a wrong answer.

Chance figures (`chance_reward`) assume a reply model: each turn, independently of the clip, the policy answers
left with probability p_left, right with p_right and asks for the slow clip with p_slow. Directions are balanced,
so an answer is right with probability (p_left + p_right) / 2 whatever the split; turn k is reached only by asking
for the slow clip on every earlier turn. Two models are printed by `python -m envs.video_motion.chance`:

- uniform over the three actions (1/3 each), the task's reference chance level;
- uniform over the 26 first letters (12/26 left, 6/26 right, 8/26 slow), what the letter ranges give a policy
  whose first letters are uniform.

The best blind policy answers at once (`BEST_BLIND_REWARD` = 0.5): asking for the slow clip tells a blind policy
nothing and only discounts its answer. A policy that reads the first clip earns 1.
"""

from __future__ import annotations

import string

from envs.color_reveal.answers import first_letter, turn_credit

#: The two hidden directions, alphabetical.
DIRECTIONS: tuple[str, ...] = ("left", "right")
#: The action that asks for the motion again at half speed.
SLOW = "slow"
#: What a reply can do: answer a direction or ask for the slow clip.
ACTIONS: tuple[str, ...] = (*DIRECTIONS, SLOW)
#: Inclusive first-letter ranges, one per action (together a..z, disjoint).
LETTER_RANGES: dict[str, tuple[str, str]] = {"left": ("a", "l"), "right": ("m", "r"), SLOW: ("s", "z")}
#: Expected reward of the best blind policy: name either direction on the first turn.
BEST_BLIND_REWARD = 0.5

__all__ = ["ACTIONS", "BEST_BLIND_REWARD", "DIRECTIONS", "LETTER_RANGES", "SLOW", "chance_reward", "letter_shares",
           "parse_reply", "turn_credit"]


def parse_reply(text: str) -> str | None:
    """The action a reply takes ("left", "right" or "slow"; see the module docstring), or None when it has no ASCII
    letter."""
    if not isinstance(text, str):
        raise TypeError(f"parse_reply: text must be str, got {type(text).__name__}")
    letter = first_letter(text)
    if letter is None:
        return None
    for action, (lo, hi) in LETTER_RANGES.items():
        if lo <= letter <= hi:
            return action
    raise AssertionError(f"letter {letter!r} is in no range")  # the ranges cover a..z


def letter_shares() -> dict[str, float]:
    """The share of the 26 first letters each action owns (the uniform-letter reply model)."""
    letters = string.ascii_lowercase
    return {action: sum(lo <= c <= hi for c in letters) / len(letters) for action, (lo, hi) in LETTER_RANGES.items()}


def chance_reward(max_turns: int, discount: float, p_left: float = 1 / 3, p_right: float = 1 / 3,
                  p_slow: float = 1 / 3) -> float:
    """Expected reward of a blind policy that acts at random, independently each turn (module docstring):
    sum over k = 1..max_turns of (p_slow * discount)**(k-1) * (p_left + p_right) / 2.

    The probabilities must be >= 0 and sum to at most 1 (the rest: replies without a letter, wrong answers).
    """
    if not isinstance(max_turns, int) or isinstance(max_turns, bool) or max_turns < 1:
        raise ValueError(f"max_turns must be a positive int, got {max_turns!r}")
    if not 0 < discount <= 1:
        raise ValueError(f"discount must be in (0, 1], got {discount!r}")
    probs = (p_left, p_right, p_slow)
    if min(probs) < 0 or sum(probs) > 1 + 1e-12:
        raise ValueError(f"action probabilities must be >= 0 and sum to <= 1, got {probs}")
    right = (p_left + p_right) / 2
    return sum((p_slow * discount) ** (k - 1) * right for k in range(1, max_turns + 1))
