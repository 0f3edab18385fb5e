"""The colors of the color-reveal task, how a reply names one, and the reward schedule (no images here).

A reply names a color by its FIRST ASCII letter (either case): a-f blue, g-m green, n-s red, t-z white. Each
color's own name starts in its range, so "red", "Red." or " red, I think" all answer red; and every reply that
has a letter answers something (garbage from a random model included), so a random policy is right 1 time in 4
per turn: the reward has variance from the first step. A reply without any ASCII letter answers nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

#: The task's colors, alphabetical: the i-th owns the i-th range of first letters.
COLORS: tuple[str, ...] = ("blue", "green", "red", "white")
#: Inclusive first-letter ranges, one per color (together a..z, disjoint).
LETTER_RANGES: dict[str, tuple[str, str]] = {"blue": ("a", "f"), "green": ("g", "m"), "red": ("n", "s"), "white": ("t", "z")}
#: The canonical RGB of each color (pictures jitter around it). Normalised to [-1, 1] as Qwen3-VL's processor does,
#: they are near the corners (1,-1,-1), (-1,1,-1), (-1,-1,1), (1,1,1) of the cube: a regular tetrahedron, every
#: color as far from every other as can be, and each one linearly separable from the rest.
RGB: dict[str, tuple[int, int, int]] = {
    "blue": (25, 25, 230),
    "green": (25, 230, 25),
    "red": (230, 25, 25),
    "white": (240, 240, 240),
}


def first_letter(text: str) -> str | None:
    """The first ASCII letter of `text`, lower-cased, or None."""
    for ch in text:
        low = ch.lower()
        if "a" <= low <= "z" and ch.isascii():
            return low
    return None


def parse_answer(text: str) -> str | None:
    """The color a reply names (see the module docstring), or None when it has no ASCII letter."""
    if not isinstance(text, str):
        raise TypeError(f"parse_answer: text must be str, got {type(text).__name__}")
    letter = first_letter(text)
    if letter is None:
        return None
    for color, (lo, hi) in LETTER_RANGES.items():
        if lo <= letter <= hi:
            return color
    raise AssertionError(f"letter {letter!r} is in no range")  # the ranges cover a..z


def turn_credit(turn: int, discount: float) -> float:
    """Reward of an episode whose first right answer came at model turn `turn` (1-based): discount**(turn-1)."""
    if turn < 1:
        raise ValueError(f"turn must be >= 1, got {turn}")
    return float(discount ** (turn - 1))


def chance_reward(max_turns: int, discount: float, num_colors: int = len(COLORS)) -> float:
    """Expected reward of a blind policy that answers uniformly at random, independently each turn.

    Turn k is reached with probability (1 - 1/C)^(k-1) and is then right with probability 1/C. A blind policy
    that never repeats a wrong color does a little better (`blind_elimination_reward`); one that always names
    the same color does worse (1/C).
    """
    p = 1.0 / num_colors
    return sum((1 - p) ** (k - 1) * p * turn_credit(k, discount) for k in range(1, max_turns + 1))


def blind_elimination_reward(max_turns: int, discount: float, num_colors: int = len(COLORS)) -> float:
    """Expected reward of the best blind policy: a different color each turn (exhaustive guessing)."""
    total, left = 0.0, num_colors
    reach = 1.0
    for k in range(1, max_turns + 1):
        if left <= 0:
            break
        total += reach * (1.0 / left) * turn_credit(k, discount)
        reach *= 1 - 1.0 / left
        left -= 1
    return total


def is_color(name: str, colors: Sequence[str] = COLORS) -> bool:
    return name in colors
