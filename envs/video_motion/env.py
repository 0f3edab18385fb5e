"""The video-motion environment: which way did the square move? A reply may ask to watch it again, slower.

Episode (`VideoMotionEnv`, options `VideoMotionOptions` read once per env from `args`):

- The episode has a hidden direction (left or right) and a seed, both from the dataset row's label
  (`envs.video_motion.synthetic`). The prompt row has no picture: `reset()` opens the episode with the first clip
  (`clips`: by default 5 frames of 32x32 at 2 fps, the square sweeping from one edge of the frame to the other at
  a row drawn from the seed) and `prompts.QUESTION`. Both directions of a seed show the same frames (left is right
  reversed in time), so no frame without its place in time tells the direction; only the order of the frames does.
- Each model turn acts by its reply's first ASCII letter (`answers.parse_reply`): a-l answers left, m-r right,
  s-z asks for the slow clip (the same motion at half speed: 2T - 1 frames at the same rate, twice as long),
  which comes back with `prompts.SLOW_QUESTION` if turns are left. Every later "slow" shows the same slow clip.
- An answer ends the episode. A reply with no letter is a wrong answer. "slow" on the last turn ends it too.
- Reward (`verdict()`): `turn_discount ** (k - 1)` for a right answer at turn k, else 0. So a policy that reads
  the first clip earns 1; one that reads only the slow clip 0.9 (default discount); the best blind policy 0.5
  (answer at once: looking only discounts a guess); random replies, uniform over the three actions, 0.433 with
  2 turns (`answers.chance_reward`).

The feedback never names the direction (a reward computed on a transcript could not find the answer in it).

`shuffle_frames: true` is the ablation that shows the order of the frames carries the signal: every clip the env
shows has the same frames in an order drawn from the episode's seed, never from the direction; since the two
directions have the same frames, the direction cannot be recovered (a trained policy must stay at the blind 0.5).
The clips are made here at reset, so the same data serve both arms.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from envs.base import BaseInteractionEnv, EnvOptions, option, require_max_turns, sample_where
from envs.video_motion import clips
from envs.video_motion.answers import DIRECTIONS, SLOW, parse_reply, turn_credit
from envs.video_motion.prompts import QUESTION, SLOW_QUESTION
from rollout.video import Clip

CORRECT_TEXT = "Correct."
WRONG_TEXT = "Wrong."
NO_ANSWER_TEXT = "No answer."
OUT_OF_TURNS_TEXT = "Out of turns."


@dataclass(frozen=True)
class VideoMotionOptions(EnvOptions):
    """The video-motion env's `--custom-config-path` keys (the module's CONFIG_KEYS are derived from it)."""

    ENV_NAME = "video_motion"

    turn_discount: float = option(
        0.9, "video_motion: reward of a right answer at turn k is turn_discount**(k-1) (1 on the first turn).", gt=0)
    shuffle_frames: bool = option(
        False, "video_motion: frame-shuffled ablation; every clip shows its frames in an order drawn from the "
        "episode's seed, so the direction cannot be recovered.")
    frame_size: int = option(
        clips.DEFAULT_FRAME_SIZE, "video_motion: side of the square frames in pixels; the square (side "
        "frame_size//4) travels frame_size - frame_size//4, a multiple of 2*(num_frames-1) (32 is 2x2 patches for "
        "Qwen3-VL).", ge=8)
    num_frames: int = option(
        clips.DEFAULT_NUM_FRAMES, "video_motion: frames of the first clip; the slow clip has 2*num_frames-1.", ge=3)
    fps: float = option(
        clips.DEFAULT_FPS, "video_motion: frame rate of both clips (2: Qwen3-VL's video processor keeps every frame).",
        gt=0)

    def validate(self) -> None:
        if self.turn_discount > 1:
            raise ValueError(f"args.turn_discount must be <= 1 (a later right answer never earns more), got "
                             f"{self.turn_discount}")
        try:
            clips.check_geometry(self.frame_size, self.num_frames)
        except ValueError as e:
            raise ValueError(f"args.frame_size / args.num_frames: {e}") from e


CONFIG_KEYS: dict[str, tuple[type, Any, str]] = VideoMotionOptions.config_keys()


class VideoMotionEnv(BaseInteractionEnv):
    """One episode: see the module docstring."""

    def __init__(self, direction: str, seed: int, max_turns: int, options: VideoMotionOptions | None = None) -> None:
        if direction not in DIRECTIONS:
            raise ValueError(f"VideoMotionEnv: direction must be one of {DIRECTIONS}, got {direction!r}")
        if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
            raise ValueError(f"VideoMotionEnv: seed must be an int >= 0, got {seed!r}")
        if not isinstance(max_turns, int) or isinstance(max_turns, bool) or max_turns < 1:
            raise ValueError(f"VideoMotionEnv: max_turns must be a positive int, got {max_turns!r}")
        self.direction = direction
        self.seed = seed
        self.max_turns = max_turns
        self.options = VideoMotionOptions() if options is None else options
        self.closed = False
        self.reset()

    def clip(self, kind: str) -> Clip:
        """The episode's clip of `kind` (`clips.FIRST_CLIP` or `clips.SLOW_CLIP`), shuffled with `shuffle_frames`."""
        o = self.options
        return clips.make_clip(self.direction, self.seed, kind, o.frame_size, o.num_frames, o.fps, o.shuffle_frames)

    def reset(self) -> dict[str, Any]:
        """Start the episode; return its opening observation: the first clip and the question."""
        self.turn = 0
        self.done = False
        self.solved_at: int | None = None  # the turn of the right answer
        self.actions: list[str | None] = []
        return {"obs_str": QUESTION, "multi_modal_data": {"video": [self.clip(clips.FIRST_CLIP)]}}

    def step(self, response_text: str) -> tuple[dict[str, Any], bool, dict[str, Any]]:
        self.check_step(response_text)
        self.turn += 1
        action = parse_reply(response_text)
        self.actions.append(action)
        correct = action == self.direction
        info: dict[str, Any] = {"turn": self.turn, "action": action, "correct": correct}
        if action == SLOW:
            if self.turn >= self.max_turns:
                self.done = True
                return {"obs_str": OUT_OF_TURNS_TEXT}, True, info
            return {"obs_str": SLOW_QUESTION, "multi_modal_data": {"video": [self.clip(clips.SLOW_CLIP)]}}, False, info
        self.done = True
        if correct:
            self.solved_at = self.turn
            return {"obs_str": CORRECT_TEXT}, True, info
        return {"obs_str": WRONG_TEXT if action is not None else NO_ANSWER_TEXT}, True, info

    def verdict(self) -> float:
        """turn_discount**(k-1) for a right answer at turn k; 0.0 otherwise (also before any answer)."""
        if self.solved_at is None:
            return 0.0
        return turn_credit(self.solved_at, self.options.turn_discount)


def parse_label(label: Any, where: str = "label") -> tuple[str, int]:
    """(direction, seed) of a row label: JSON `{"direction": "left" | "right", "seed": int >= 0}`."""
    hint = "make the data with envs.video_motion.synthetic"
    try:
        params = json.loads(label)
    except (TypeError, ValueError) as e:
        raise ValueError(f"video_motion build_env: {where} label {str(label)[:60]!r} is not JSON ({e}); {hint}") from e
    if not isinstance(params, dict):
        raise ValueError(f"video_motion build_env: {where} label is not a JSON object; {hint}")
    direction, seed = params.get("direction"), params.get("seed")
    if direction not in DIRECTIONS:
        raise ValueError(f"video_motion build_env: {where} label has direction {direction!r}, not one of {DIRECTIONS}")
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise ValueError(f"video_motion build_env: {where} label has seed {seed!r}, not an int >= 0; {hint}")
    return direction, seed


def build_env(sample: Any, args: Any) -> VideoMotionEnv:
    """A VideoMotionEnv for the direction and seed in `sample.label` (JSON, from `envs.video_motion.synthetic`), with
    `args.max_turns` and VideoMotionOptions from `args`. The prompt's own pictures, if any, are not used."""
    direction, seed = parse_label(getattr(sample, "label", None), sample_where(sample))
    max_turns = require_max_turns(args, "video_motion")
    return VideoMotionEnv(direction, seed, max_turns, VideoMotionOptions.from_args(args))
