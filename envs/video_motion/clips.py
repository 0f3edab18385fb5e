"""The clips of the video-motion task (numpy): a bright square sweeping horizontally across a dark frame.

The square (side W/4 for a frame of side W) slides from one edge of the frame to the other, once, without wrapping.
Moving right, its left column is 0, s, 2s, ..., W - side over the first clip's T frames (s = (W - side) / (T - 1):
6 px for W = 32, T = 5); moving left, the same columns in the reverse order. Its row is the same in every frame of
an episode: the top row is drawn from the episode's seed, uniform over 0..W - side, so the frames differ between
episodes. The left clip of a seed is exactly the right clip of that seed reversed in time.

So what tells the direction is the frames' ORDER, not what is in them:

- the two directions of a seed show the same frames (the same multiset), and every frame of a sweep appears in both
  directions: a single frame, without its place in time, says nothing about the direction;
- a frame WITH its place in time says everything: moving right the square is on the left early and on the right
  late, moving left the other way round. Reading it needs no motion estimate between two frames, only where the
  square is in (say) the first frame;
- with `shuffled`, a clip shows its frames in an order drawn from the episode's seed (one order per clip kind, never
  from the direction). A shuffled right clip is the right sweep's frames in a random order, a shuffled left clip the
  same frames in a random order: the two have one distribution, and the shuffled clip carries no direction at all.
  That ablation is the proof that the task needs the order of the frames.

The slow clip is the same sweep at half speed: 2T - 1 frames at the same rate, half a step (s/2) apart, from the
same start to the same end (its even frames are the first clip's frames), lasting twice as long. Same rate, not twice
the rate over the same seconds: Qwen3-VL's video processor samples clips at 2 frames per second, so a clip taken at
the sampling rate keeps every frame (9 frames at 4 fps would be cut to 4 of them, unevenly spaced). Both clips move
by whole pixels: `check_geometry` wants W - side to be a multiple of 2 (T - 1).

No jax; numpy and `rollout.video.Clip`.
"""

from __future__ import annotations

import numpy as np

from rollout.video import Clip

#: Colors of the square and the background (RGB).
SQUARE_RGB: tuple[int, int, int] = (250, 250, 250)
BACKGROUND_RGB: tuple[int, int, int] = (12, 12, 12)
#: Side of the frames in pixels: 32x32 is 2x2 patches of 16 px, one merged token per temporal pair for Qwen3-VL.
DEFAULT_FRAME_SIZE = 32
#: Frames of the first clip: 5 at 2 fps (padded to 6 by the processor: 3 temporal pairs, 12 patches at 32 px).
DEFAULT_NUM_FRAMES = 5
#: Frame rate of both clips, the rate Qwen3-VL's video processor samples at (every frame is kept).
DEFAULT_FPS = 2.0
#: The clip kinds, in the order their shuffles are drawn.
FIRST_CLIP, SLOW_CLIP = "first", "slow"
CLIP_KINDS: tuple[str, ...] = (FIRST_CLIP, SLOW_CLIP)

__all__ = ["BACKGROUND_RGB", "CLIP_KINDS", "DEFAULT_FPS", "DEFAULT_FRAME_SIZE", "DEFAULT_NUM_FRAMES", "FIRST_CLIP",
           "SLOW_CLIP", "SQUARE_RGB", "check_geometry", "clip_frames", "frame_at", "frames_at", "make_clip",
           "num_frames_of", "positions", "shuffle_order", "square_side", "step_of", "top_row", "travel"]


def square_side(frame_size: int) -> int:
    """Side of the square: a quarter of the frame."""
    return max(1, frame_size // 4)


def travel(frame_size: int) -> int:
    """How far the square's left column goes over a sweep: frame_size - square_side (edge to edge)."""
    return frame_size - square_side(frame_size)


def check_geometry(frame_size: int, num_frames: int) -> None:
    """ValueError unless frame_size >= 8, num_frames >= 3 and both clips move by whole pixels: the square's travel
    (frame_size - frame_size // 4) must be a multiple of 2 (num_frames - 1), the slow clip's half steps included."""
    for name, value, least in (("frame_size", frame_size, 8), ("num_frames", num_frames, 3)):
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            raise ValueError(f"{name} must be an int >= {least}, got {value!r}")
    span = travel(frame_size)
    if span % (2 * (num_frames - 1)):
        fits = [t for t in range(3, span // 2 + 2) if span % (2 * (t - 1)) == 0]
        raise ValueError(f"the square's travel frame_size - side = {frame_size} - {square_side(frame_size)} = {span} "
                         f"is not a multiple of 2 * (num_frames - 1) = {2 * (num_frames - 1)}: the clips would move by "
                         f"fractions of a pixel (num_frames that fit: {fits})")


def num_frames_of(kind: str, num_frames: int) -> int:
    """Frames of a clip of `kind`: `num_frames` for the first clip, 2 num_frames - 1 for the slow one."""
    if kind == FIRST_CLIP:
        return num_frames
    if kind == SLOW_CLIP:
        return 2 * num_frames - 1
    raise ValueError(f"clip kind must be one of {CLIP_KINDS}, got {kind!r}")


def step_of(kind: str, frame_size: int, num_frames: int) -> int:
    """Pixels the square moves between consecutive frames of a clip of `kind` (the slow clip: half the first's)."""
    check_geometry(frame_size, num_frames)
    return travel(frame_size) // (num_frames_of(kind, num_frames) - 1)


def top_row(seed: int, frame_size: int) -> int:
    """The square's top row in the episode drawn by `seed`: uniform over 0..frame_size - side (the same in every
    frame of the episode, both clips and both directions)."""
    return int(np.random.default_rng([seed, 0]).integers(travel(frame_size) + 1))


def positions(direction: str, kind: str, frame_size: int, num_frames: int) -> list[int]:
    """The square's left column in each frame of the clip, in time order: 0 up to frame_size - side by the clip's
    step moving right, the same columns reversed moving left."""
    if direction not in ("left", "right"):
        raise ValueError(f"direction must be 'left' or 'right', got {direction!r}")
    step = step_of(kind, frame_size, num_frames)
    columns = [t * step for t in range(num_frames_of(kind, num_frames))]
    return columns if direction == "right" else columns[::-1]


def frames_at(columns: list[int] | np.ndarray, top: int, frame_size: int) -> np.ndarray:
    """Frames [T, H, W, 3] uint8 (a new array), the t-th with the square's left side at `columns[t]` and its top at
    row `top` (the square must lie inside the frame)."""
    side = square_side(frame_size)
    columns = np.asarray(columns, np.int64)
    if columns.size and (columns.min() < 0 or columns.max() > frame_size - side):
        raise ValueError(f"columns must be in 0..{frame_size - side}, got {columns.tolist()}")
    if not 0 <= top <= frame_size - side:
        raise ValueError(f"top must be in 0..{frame_size - side}, got {top!r}")
    span = np.arange(frame_size)
    on = (span[None, :] >= columns[:, None]) & (span[None, :] < columns[:, None] + side)  # [T, W]
    band = np.where(on[..., None], np.array(SQUARE_RGB, np.uint8), np.array(BACKGROUND_RGB, np.uint8))  # [T, W, 3]
    frames = np.empty((len(columns), frame_size, frame_size, 3), np.uint8)
    frames[:] = BACKGROUND_RGB
    frames[:, top : top + side] = band[:, None]
    return frames


def frame_at(column: int, top: int, frame_size: int) -> np.ndarray:
    """One frame [H, W, 3] uint8 (`frames_at`)."""
    return frames_at([column], top, frame_size)[0]


def shuffle_order(seed: int, kind: str, length: int) -> np.ndarray:
    """The order a shuffled clip of `kind` shows its `length` frames in (drawn from the episode's seed)."""
    return np.random.default_rng([seed, 1, CLIP_KINDS.index(kind)]).permutation(length)


def clip_frames(direction: str, seed: int, kind: str, frame_size: int = DEFAULT_FRAME_SIZE,
                num_frames: int = DEFAULT_NUM_FRAMES, shuffled: bool = False) -> np.ndarray:
    """The frames [T, H, W, 3] uint8 of the episode's clip of `kind`: in time order, or in the seed's shuffled order."""
    columns = positions(direction, kind, frame_size, num_frames)
    frames = frames_at(columns, top_row(seed, frame_size), frame_size)
    if shuffled:
        frames = frames[shuffle_order(seed, kind, len(frames))]
    return frames


def make_clip(direction: str, seed: int, kind: str, frame_size: int = DEFAULT_FRAME_SIZE,
              num_frames: int = DEFAULT_NUM_FRAMES, fps: float = DEFAULT_FPS, shuffled: bool = False) -> Clip:
    """`clip_frames` as a `rollout.video.Clip` taken at `fps`."""
    return Clip.of(clip_frames(direction, seed, kind, frame_size, num_frames, shuffled), fps)
