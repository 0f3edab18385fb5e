"""The video-motion task in one place (`--rollout-interaction-env-path envs.video_motion`): a learnable multi-turn
VIDEO task for the CPU demo, in which the order of the frames, not any one frame, carries the answer.

A bright square sweeps left or right across a dark 32x32 frame, from one edge to the other (no wrapping), at a row
drawn from the episode's seed. The episode opens with a short clip (reset's observation: 5 frames at 2 fps) and the
question; a reply answers left or right by its first letter, or asks to watch the motion again at half speed (a
9-frame clip over the same path). The left clip of a seed is the right clip of that seed reversed in time, so both
directions show exactly the same frames: a single frame without its place in time says nothing, and only the
frames' ORDER tells the direction (where the square is early and where late; no motion estimate between two frames
is needed). `shuffle_frames: true` shows every clip's frames in a seeded random order, which removes the order and
so the direction: the ablation, which no policy can beat the blind 0.5 on, is the proof that the task needs it.

Reward: `turn_discount ** (k - 1)` (default 0.9) for a right answer at turn k, 0 for a wrong one (or a reply with no
letter). With 2 turns (configs/video_motion_tiny.yaml): reading the first clip earns 1, reading only the slow one
0.9, the best blind policy 0.5 (answer at once), random replies uniform over left/right/slow 0.433 (uniform first
letters: 0.442). `python -m envs.video_motion.chance` prints them (closed form, `answers`).

- `answers`: actions, `parse_reply`, `turn_credit`, `chance_reward`, `BEST_BLIND_REWARD`;
- `clips`: the frames (numpy) and `rollout.video.Clip`s;
- `env`: `VideoMotionEnv`, `VideoMotionOptions`, `build_env`, `CONFIG_KEYS`;
- `prompts`: the questions, the reply rule as a system prompt, `TASK_PROMPT`;
- `synthetic`: the dataset generator (imported on use: `from envs.video_motion.synthetic import make_dataset`).

This package never imports jax.
"""

from envs.video_motion.answers import (ACTIONS, BEST_BLIND_REWARD, DIRECTIONS, LETTER_RANGES, SLOW, chance_reward,
                                       parse_reply, turn_credit)
from envs.video_motion.env import CONFIG_KEYS, VideoMotionEnv, VideoMotionOptions, build_env
from envs.video_motion.prompts import QUESTION, SLOW_QUESTION, SYSTEM_PROMPT, TASK_PROMPT

__all__ = [
    "ACTIONS",
    "BEST_BLIND_REWARD",
    "CONFIG_KEYS",
    "DIRECTIONS",
    "LETTER_RANGES",
    "QUESTION",
    "SLOW",
    "SLOW_QUESTION",
    "SYSTEM_PROMPT",
    "TASK_PROMPT",
    "VideoMotionEnv",
    "VideoMotionOptions",
    "build_env",
    "chance_reward",
    "parse_reply",
    "turn_credit",
]
