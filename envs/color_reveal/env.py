"""The color-reveal environment: name a card's hidden color; a wrong guess reveals the card alone.

Episode (`ColorRevealEnv`, options `ColorRevealOptions` read once per env from `args`):

- The prompt's picture shows two equal stripes side by side, in random order: the card's color and a decoy of
  another color. Nothing in it tells which stripe is the card, so even a perfect first guess is right only
  half of the time.
- Each model turn is one guess, the color named by the reply's first ASCII letter (`answers.parse_answer`).
  A right guess ends the episode. A wrong one (or a reply with no letter) is answered with a new picture, the
  card alone (one solid stripe), and the question again, until `max_turns`.
- Reward (`verdict()`): `turn_discount ** (k - 1)` when the first right guess came at turn k, else 0. With the
  defaults (2 turns, discount 0.9) a policy that reads the pictures earns 0.5 * 1 + 0.5 * 0.9 = 0.95 in
  expectation; a blind one earns 0.25 + 0.75 * 0.25 * 0.9 = 0.419 guessing at random, at most 0.475 by never
  repeating a color (`answers.chance_reward`, `answers.blind_elimination_reward`).

The feedback never names a color (a reward computed on a transcript could not find the answer in it), and the
reward is graded on the model's own replies only.

`blind: true` is the ablation that shows the pictures carry the signal: every picture the model sees is the
same blank one. The env makes its reveal pictures blank, and refuses a sample whose prompt pictures are not
(the prompt is rendered before the env exists, so the blind dataset comes from `make_dataset(..., blind=True)`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from PIL import Image

from envs.base import BaseInteractionEnv, EnvOptions, option, require_max_turns, sample_label, sample_where
from envs.color_reveal.answers import COLORS, parse_answer, turn_credit
from envs.color_reveal.images import DEFAULT_IMAGE_SIZE, blank_image, decode_data_url, is_blank, shade, stripes_image

CORRECT_TEXT = "Correct."
REVEAL_TEXT = "Wrong. The card alone:"
NO_ANSWER_TEXT = "No color named. The card alone:"
OUT_OF_TURNS_TEXT = "Wrong. No turns left."


@dataclass(frozen=True)
class ColorRevealOptions(EnvOptions):
    """The color-reveal env's `--custom-config-path` keys (the module's CONFIG_KEYS are derived from it)."""

    ENV_NAME = "color_reveal"

    turn_discount: float = option(
        0.9, "color_reveal: reward of a right guess at turn k is turn_discount**(k-1) (1 on the first turn).", gt=0)
    blind: bool = option(
        False, "color_reveal: blind ablation; every picture is blank (the env's reveals; the prompt's must be "
        "blank already: data from make_dataset(..., blind=True)).")

    def validate(self) -> None:
        if self.turn_discount > 1:
            raise ValueError(f"args.turn_discount must be <= 1 (a later right guess never earns more), got {self.turn_discount}")


CONFIG_KEYS: dict[str, tuple[type, Any, str]] = ColorRevealOptions.config_keys()


class ColorRevealEnv(BaseInteractionEnv):
    """One card: see the module docstring."""

    def __init__(self, color: str, max_turns: int, options: ColorRevealOptions | None = None,
                 image_size: int = DEFAULT_IMAGE_SIZE) -> None:
        if color not in COLORS:
            raise ValueError(f"ColorRevealEnv: color must be one of {COLORS}, got {color!r}")
        if not isinstance(max_turns, int) or isinstance(max_turns, bool) or max_turns < 1:
            raise ValueError(f"ColorRevealEnv: max_turns must be a positive int, got {max_turns!r}")
        self.color = color
        self.max_turns = max_turns
        self.options = ColorRevealOptions() if options is None else options
        self.image_size = image_size
        self.closed = False
        self.reset()

    def reset(self) -> None:
        self.turn = 0
        self.done = False
        self.solved_at: int | None = None  # the turn of the first right guess
        self.guesses: list[str | None] = []

    def reveal_image(self) -> Image.Image:
        """The card alone (blank when blind)."""
        if self.options.blind:
            return blank_image(self.image_size)
        return stripes_image([shade(self.color)], self.image_size)

    def step(self, response_text: str) -> tuple[dict[str, Any], bool, dict[str, Any]]:
        self.check_step(response_text)
        self.turn += 1
        guess = parse_answer(response_text)
        self.guesses.append(guess)
        correct = guess == self.color
        info: dict[str, Any] = {"turn": self.turn, "guess": guess, "correct": correct}
        if correct:
            self.solved_at = self.turn
            self.done = True
            return {"obs_str": CORRECT_TEXT}, True, info
        if self.turn >= self.max_turns:
            self.done = True
            return {"obs_str": OUT_OF_TURNS_TEXT}, True, info
        text = REVEAL_TEXT if guess is not None else NO_ANSWER_TEXT
        return {"obs_str": text, "multi_modal_data": {"image": [self.reveal_image()]}}, False, info

    def verdict(self) -> float:
        """turn_discount**(k-1) for a first right guess at turn k; 0.0 otherwise (also before any guess)."""
        if self.solved_at is None:
            return 0.0
        return turn_credit(self.solved_at, self.options.turn_discount)


def build_env(sample: Any, args: Any) -> ColorRevealEnv:
    """A ColorRevealEnv for the card color `sample.label`, with `args.max_turns` and ColorRevealOptions from `args`.

    The reveal pictures take the size of the prompt's first picture. With `blind`, every prompt picture must be
    blank (ValueError otherwise).
    """
    label = sample_label(sample)
    color = label.strip().lower() if isinstance(label, str) else label
    if color not in COLORS:
        raise ValueError(f"color_reveal build_env: {sample_where(sample)} has label {label!r}, not one of {COLORS}")
    max_turns = require_max_turns(args, "color_reveal")
    options = ColorRevealOptions.from_args(args)
    images = [decode_data_url(url) for url in (getattr(sample, "image_data", None) or [])]
    if options.blind and not all(is_blank(image) for image in images):
        raise ValueError(
            f"color_reveal build_env: blind is set but {sample_where(sample)} has a prompt picture that is not blank "
            "(generate the blind dataset with make_dataset(..., blind=True))")
    size = images[0].width if images else DEFAULT_IMAGE_SIZE
    return ColorRevealEnv(color, max_turns, options, image_size=size)
