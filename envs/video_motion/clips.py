"""The clips of the video-motion task (numpy): a bright square sliding horizontally across a dark frame.

The frame is a ring: the square leaves one side and comes back on the other (columns are taken modulo the frame
width W). A clip of T frames moves it by `step = W / (2 (T - 1))` pixels per frame, so its first and last frames are
half a width apart: from the same start, the left and the right clip have the SAME first and last frames, and only
the frames between them (in their order) tell the direction. The start column is uniform over the W columns (drawn
from the episode's seed), so every single frame, at every position in the clip, is exactly as likely under either
direction: no frame alone says anything (frame t of a right clip from x is frame t of the left clip from
x + 2 t step).

The slow clip is the same motion at half speed: 2T - 1 frames at the same rate, half a step apart, from the same
start to the same end (its even frames are the first clip's frames), lasting twice as long. Same rate, not twice the
rate over the same seconds: Qwen3-VL's video processor samples clips at 2 frames per second, so a clip taken at the
sampling rate keeps every frame (9 frames at 4 fps would be cut to 4 of them, unevenly spaced).

With `shuffled`, a clip has the same frames in an order drawn from the episode's seed (one order per clip kind): the
multiset of frames of a right clip from x is that of the left clip from x + W/2, so a shuffled clip carries no
direction at all.

No jax; numpy and `rollout.video.Clip`.
"""

from __future__ import annotations

import functools

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
           "num_frames_of", "positions", "shuffle_order", "square_side", "start_column", "step_of"]


def check_geometry(frame_size: int, num_frames: int) -> None:
    """ValueError unless both clips move by whole pixels (4 (num_frames - 1) must divide frame_size), num_frames >= 3
    (two frames half a width apart would say nothing) and frame_size >= 8."""
    for name, value, least in (("frame_size", frame_size, 8), ("num_frames", num_frames, 3)):
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            raise ValueError(f"{name} must be an int >= {least}, got {value!r}")
    if frame_size % (4 * (num_frames - 1)):
        fits = [t for t in range(3, frame_size // 4 + 2) if frame_size % (4 * (t - 1)) == 0]
        raise ValueError(f"frame_size {frame_size} is not a multiple of 4 * (num_frames - 1) = {4 * (num_frames - 1)}: "
                         f"the clips would move by fractions of a pixel (num_frames that fit: {fits})")


def square_side(frame_size: int) -> int:
    """Side of the square: a quarter of the frame."""
    return max(1, frame_size // 4)


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
    return frame_size // (2 * (num_frames_of(kind, num_frames) - 1))


def start_column(seed: int, frame_size: int) -> int:
    """The square's first column in the episode drawn by `seed`: uniform over the frame's columns."""
    return int(np.random.default_rng([seed, 0]).integers(frame_size))


def positions(direction: str, start: int, kind: str, frame_size: int, num_frames: int) -> list[int]:
    """The square's left column in each frame of the clip, in time order (modulo `frame_size`)."""
    sign = {"left": -1, "right": 1}.get(direction)
    if sign is None:
        raise ValueError(f"direction must be 'left' or 'right', got {direction!r}")
    step = step_of(kind, frame_size, num_frames)
    return [(start + sign * t * step) % frame_size for t in range(num_frames_of(kind, num_frames))]


@functools.lru_cache(maxsize=8)
def _ring(frame_size: int) -> np.ndarray:
    """Every frame of the ring [W, H, W, 3] uint8 (read-only), the c-th with the square's left side at column c."""
    side = square_side(frame_size)
    top = (frame_size - side) // 2
    span = np.arange(frame_size)
    on = (span[None, :] - span[:, None]) % frame_size < side  # [column, W]
    band = np.where(on[..., None], np.array(SQUARE_RGB, np.uint8), np.array(BACKGROUND_RGB, np.uint8))  # [c, W, 3]
    frames = np.empty((frame_size, frame_size, frame_size, 3), np.uint8)
    frames[:] = BACKGROUND_RGB
    frames[:, top : top + side] = band[:, None]
    frames.flags.writeable = False
    return frames


def frames_at(columns: list[int] | np.ndarray, frame_size: int) -> np.ndarray:
    """Frames [T, H, W, 3] uint8 (a new array), the t-th with the square's left side at `columns[t]` (wrapping around
    the right edge), the square vertically centred."""
    return _ring(frame_size)[np.asarray(columns, np.int64) % frame_size]


def frame_at(column: int, frame_size: int) -> np.ndarray:
    """One frame [H, W, 3] uint8 (`frames_at`)."""
    return frames_at([column], frame_size)[0]


def shuffle_order(seed: int, kind: str, length: int) -> np.ndarray:
    """The order a shuffled clip of `kind` shows its `length` frames in (drawn from the episode's seed)."""
    return np.random.default_rng([seed, 1, CLIP_KINDS.index(kind)]).permutation(length)


def clip_frames(direction: str, seed: int, kind: str, frame_size: int = DEFAULT_FRAME_SIZE,
                num_frames: int = DEFAULT_NUM_FRAMES, shuffled: bool = False) -> np.ndarray:
    """The frames [T, H, W, 3] uint8 of the episode's clip of `kind`: in time order, or in the seed's shuffled order."""
    start = start_column(seed, frame_size)
    frames = frames_at(positions(direction, start, kind, frame_size, num_frames), frame_size)
    if shuffled:
        frames = frames[shuffle_order(seed, kind, len(frames))]
    return frames


def make_clip(direction: str, seed: int, kind: str, frame_size: int = DEFAULT_FRAME_SIZE,
              num_frames: int = DEFAULT_NUM_FRAMES, fps: float = DEFAULT_FPS, shuffled: bool = False) -> Clip:
    """`clip_frames` as a `rollout.video.Clip` taken at `fps`."""
    return Clip.of(clip_frames(direction, seed, kind, frame_size, num_frames, shuffled), fps)
