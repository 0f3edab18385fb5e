"""The video-motion task (envs/video_motion): reply reading, clips, episodes, the shuffled ablation, dataset, config.

What the task promises and these tests check directly: the frames are uint8 [T, H, W, 3]; the square sweeps from one
edge to the other by the clip's step in the label's direction, at a row drawn from the seed (uniform over the rows it
fits in); the left clip of a seed is its right clip reversed in time, so every frame appears in both directions and
only the order tells the direction; the shuffled ablation shows the same frames in a seeded order (the same multiset
for both directions of a seed), so it carries no direction; the slow look is the same path at half speed; the
geometry checks; the reward schedule; the option and label checks; the dataset is balanced, deterministic and loads
without pictures; and the closed-form chance level equals a Monte Carlo run of random replies through the env. No
jax, no engine.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from types import SimpleNamespace

import numpy as np
import pyarrow.parquet as pq
import pytest

from envs.video_motion import (CONFIG_KEYS, DIRECTIONS, QUESTION, SLOW_QUESTION, VideoMotionEnv, VideoMotionOptions,
                               build_env, chance_reward, parse_reply)
from envs.video_motion import chance as chance_printer
from envs.video_motion import clips
from envs.video_motion.answers import BEST_BLIND_REWARD, LETTER_RANGES, letter_shares
from envs.video_motion.env import CORRECT_TEXT, NO_ANSWER_TEXT, OUT_OF_TURNS_TEXT, WRONG_TEXT
from envs.video_motion.synthetic import generate_rows, make_dataset
from jaxrl_vlm.config import load_config
from jaxrl_vlm.data.geo3k import load_styled_dataset
from rollout.video import Clip, VideoProcessorConfig, sample_frame_indices

CONFIG = "configs/video_motion_tiny.yaml"
W = clips.DEFAULT_FRAME_SIZE
T = clips.DEFAULT_NUM_FRAMES


def _env(direction: str = "right", seed: int = 3, max_turns: int = 2, **options) -> VideoMotionEnv:
    return VideoMotionEnv(direction, seed, max_turns, VideoMotionOptions(**options))


def _label(direction: str = "right", seed: int = 3) -> str:
    return json.dumps({"direction": direction, "seed": seed})


SIDE = clips.square_side(W)


def _bytes(frames: np.ndarray) -> list[bytes]:
    return sorted(f.tobytes() for f in frames)


def _square(frame: np.ndarray) -> tuple[int, int]:
    """The square's (top row, left column), read back from the pixels; it must be one side x side block."""
    side = clips.square_side(frame.shape[1])
    lit = frame[..., 0] > 128
    rows, cols = np.flatnonzero(lit.any(axis=1)), np.flatnonzero(lit.any(axis=0))
    assert len(rows) == len(cols) == side and lit.sum() == side * side, "one square per frame"
    assert rows[-1] - rows[0] == cols[-1] - cols[0] == side - 1, "a contiguous block"
    return int(rows[0]), int(cols[0])


# -------------------------------------------------------------------------------------------------- replies
@pytest.mark.parametrize("text, action", [
    ("left", "left"), ("Left.", "left"), (" l", "left"), ("a", "left"), ("Lxx", "left"),
    ("right", "right"), ("Right!", "right"), ("m", "right"), ("R", "right"),
    ("slow", "slow"), ("Watch again", "slow"), ("see", "slow"), ("z", "slow"),
    ("12 right", "right"), ("é left", "left"), ("", None), ("42!", None), ("  ", None),
])
def test_a_reply_acts_by_its_first_ascii_letter(text, action):
    assert parse_reply(text) == action


def test_every_letter_acts_and_each_word_starts_in_its_range():
    import string

    assert {parse_reply(c) for c in string.ascii_letters} == {"left", "right", "slow"}
    for action, (lo, hi) in LETTER_RANGES.items():
        assert lo <= action[0] <= hi
    assert letter_shares() == pytest.approx({"left": 12 / 26, "right": 6 / 26, "slow": 8 / 26})
    with pytest.raises(TypeError, match="must be str"):
        parse_reply(None)


# ---------------------------------------------------------------------------------------------------- clips
@pytest.mark.parametrize("kind, length, step", [(clips.FIRST_CLIP, T, 6), (clips.SLOW_CLIP, 2 * T - 1, 3)])
@pytest.mark.parametrize("direction", DIRECTIONS)
def test_frames_are_uint8_and_the_square_sweeps_edge_to_edge_by_the_step(kind, length, step, direction):
    assert SIDE == 8 and clips.step_of(kind, W, T) == step
    sweep = list(range(0, W - SIDE + 1, step))  # 0, 6, ..., 24 (first) or 0, 3, ..., 24 (slow)
    assert len(sweep) == length and sweep[-1] == W - SIDE
    for seed in range(20):
        frames = clips.clip_frames(direction, seed, kind)
        assert frames.dtype == np.uint8 and frames.shape == (length, W, W, 3)
        tops, cols = zip(*(_square(f) for f in frames))
        assert set(tops) == {clips.top_row(seed, W)}  # one row per episode
        assert list(cols) == (sweep if direction == "right" else sweep[::-1])  # monotone, no wrapping
        assert set(np.unique(frames)) == set(clips.SQUARE_RGB) | set(clips.BACKGROUND_RGB)
    assert clips.positions(direction, kind, W, T) == (sweep if direction == "right" else sweep[::-1])


def test_the_row_comes_from_the_seed_and_is_uniform_over_the_rows_the_square_fits_in():
    n = 2500
    tops = [clips.top_row(s, W) for s in range(n)]
    assert tops == [clips.top_row(s, W) for s in range(n)]  # a function of the seed
    counts = Counter(tops)
    assert set(counts) == set(range(W - SIDE + 1))  # 0..24, every one reached, none outside
    assert 60 < min(counts.values()) and max(counts.values()) < 140  # 100 expected per row, sd ~10
    for seed in (0, 7, 123):  # the same row in both clips and both directions
        assert {_square(f)[0] for d in DIRECTIONS for k in clips.CLIP_KINDS
                for f in clips.clip_frames(d, seed, k)} == {clips.top_row(seed, W)}
    assert len({clips.clip_frames("right", s, clips.FIRST_CLIP).tobytes() for s in range(200)}) == W - SIDE + 1


def test_the_left_clip_is_the_right_clip_reversed_so_every_frame_appears_in_both_directions():
    for kind in clips.CLIP_KINDS:
        for seed in range(50):
            right = clips.clip_frames("right", seed, kind)
            left = clips.clip_frames("left", seed, kind)
            assert np.array_equal(left, right[::-1])
            assert not np.array_equal(left, right)  # the order differs: that is all the direction is
            assert _bytes(left) == _bytes(right)  # the same multiset of frames
            left_frames = {f.tobytes() for f in left}
            assert all(f.tobytes() in left_frames for f in right)
            # With its place in time, one frame says it all: the square starts on the side it leaves.
            assert _square(right[0])[1] == 0 and _square(left[0])[1] == W - SIDE


def test_the_slow_clip_is_the_same_sweep_at_half_speed():
    for direction in DIRECTIONS:
        for seed in range(10):
            first = clips.clip_frames(direction, seed, clips.FIRST_CLIP)
            slow = clips.clip_frames(direction, seed, clips.SLOW_CLIP)
            assert slow.shape[0] == 2 * T - 1
            assert np.array_equal(slow[::2], first)
            odd = [_square(f)[1] for f in slow[1::2]]  # half-way between the first clip's positions
            assert odd == [(a + b) // 2 for a, b in zip(clips.positions(direction, clips.FIRST_CLIP, W, T),
                                                         clips.positions(direction, clips.FIRST_CLIP, W, T)[1:])]


def test_the_shuffled_clip_has_the_same_frames_in_a_seeded_order_that_carries_no_direction():
    for kind in clips.CLIP_KINDS:
        reordered = 0
        for seed in range(100):
            plain = clips.clip_frames("right", seed, kind)
            shuffled = clips.clip_frames("right", seed, kind, shuffled=True)
            assert np.array_equal(shuffled, clips.clip_frames("right", seed, kind, shuffled=True))  # deterministic
            assert _bytes(shuffled) == _bytes(plain)
            reordered += not np.array_equal(shuffled, plain)
            # The same multiset as the shuffled left clip of the same seed: the set of frames says nothing.
            assert _bytes(shuffled) == _bytes(clips.clip_frames("left", seed, kind, shuffled=True))
        assert reordered >= 95  # 1 order in 120 (first) or 362880 (slow) is the identity
    # The order is drawn from the seed and the clip kind, never from the direction.
    orders = {tuple(clips.shuffle_order(s, clips.FIRST_CLIP, T)) for s in range(50)}
    assert len(orders) > 30  # different seeds, different orders
    first, slow = clips.shuffle_order(5, clips.FIRST_CLIP, T), clips.shuffle_order(5, clips.SLOW_CLIP, 2 * T - 1)
    assert sorted(first) == list(range(T)) and sorted(slow) == list(range(2 * T - 1))
    for direction in DIRECTIONS:
        order = clips.shuffle_order(5, clips.FIRST_CLIP, T)
        assert np.array_equal(clips.clip_frames(direction, 5, clips.FIRST_CLIP, shuffled=True),
                              clips.clip_frames(direction, 5, clips.FIRST_CLIP)[order])


def test_the_geometry_is_checked():
    fits = [3, 4, 5, 7, 13]  # 2 (t - 1) divides W - SIDE = 24
    for t in range(3, 20):
        if t in fits:
            clips.check_geometry(W, t)
            assert clips.positions("right", clips.SLOW_CLIP, W, t)[-1] == W - SIDE
        else:
            with pytest.raises(ValueError, match=f"num_frames that fit: \\{fits}"):
                clips.check_geometry(W, t)
    with pytest.raises(ValueError, match="travel frame_size - side = 30 - 7 = 23 is not a multiple of 2 "
                                         "\\* \\(num_frames - 1\\) = 8"):
        clips.check_geometry(30, 5)
    with pytest.raises(ValueError, match="columns must be in 0..24"):
        clips.frames_at([25], 0, W)
    with pytest.raises(ValueError, match="top must be in 0..24"):
        clips.frames_at([0], 25, W)
    with pytest.raises(ValueError, match="direction must be"):
        clips.positions("up", clips.FIRST_CLIP, W, T)


def test_every_frame_of_both_clips_survives_qwen3_vl_frame_sampling():
    cfg = VideoProcessorConfig.from_dict({"video_processor_type": "Qwen3VLVideoProcessor"})  # 2 fps, >= 4 frames
    for kind in clips.CLIP_KINDS:
        clip = _env().clip(kind)
        n = clip.frames.shape[0]
        assert list(sample_frame_indices(n, clip.fps, cfg)) == list(range(n))


# -------------------------------------------------------------------------------------------------- episodes
def test_reset_opens_with_the_first_clip_and_the_question():
    env = _env("left", 11)
    obs = env.reset()
    (clip,) = obs["multi_modal_data"]["video"]
    assert set(obs["multi_modal_data"]) == {"video"}
    assert isinstance(clip, Clip) and clip.fps == 2.0
    assert np.array_equal(clip.frames, clips.clip_frames("left", 11, clips.FIRST_CLIP))
    assert obs["obs_str"] == QUESTION
    message = env.format_observation(obs)
    assert message == {"role": "user",
                       "content": [{"type": "video", "video": clip}, {"type": "text", "text": QUESTION}]}


def test_the_look_returns_the_same_path_at_half_speed():
    env = _env("right", 8)
    first = env.reset()["multi_modal_data"]["video"][0]
    obs, done, info = env.step("slow")
    assert not done and info == {"turn": 1, "action": "slow", "correct": False}
    assert obs["obs_str"] == SLOW_QUESTION
    (slow,) = obs["multi_modal_data"]["video"]
    assert slow.frames.shape == (2 * T - 1, W, W, 3) and slow.fps == first.fps
    assert np.array_equal(slow.frames[::2], first.frames)  # same start, same end, half a step between frames
    assert env.verdict() == 0.0


@pytest.mark.parametrize("replies, reward, last_text", [
    (["right"], 1.0, CORRECT_TEXT),
    (["left"], 0.0, WRONG_TEXT),
    (["?!"], 0.0, NO_ANSWER_TEXT),
    (["slow", "right"], 0.9, CORRECT_TEXT),
    (["slow", "left"], 0.0, WRONG_TEXT),
    (["slow", "slow"], 0.0, OUT_OF_TURNS_TEXT),
])
def test_rewards(replies, reward, last_text):
    env = _env("right", 2)
    env.reset()
    for k, reply in enumerate(replies):
        obs, done, info = env.step(reply)
        assert done == (k == len(replies) - 1)
        assert "left" not in obs["obs_str"].lower() and "right" not in obs["obs_str"].lower()
    assert obs == {"obs_str": last_text} and info["correct"] == (reward > 0)
    assert env.verdict() == pytest.approx(reward)
    with pytest.raises(RuntimeError, match="after the episode ended"):
        env.step("right")


def test_discount_three_turns_and_reset():
    env = _env("left", 4, max_turns=3, turn_discount=0.75)
    env.reset()
    assert [env.step("slow")[1], env.step("see")[1], env.step("left")[1]] == [False, False, True]
    assert env.verdict() == pytest.approx(0.75**2)
    env.reset()
    assert env.turn == 0 and not env.done and env.verdict() == 0.0
    env.step("l")
    assert env.verdict() == 1.0


def test_the_shuffled_option_shuffles_every_clip_the_env_shows():
    env = _env("right", 9, shuffle_frames=True)
    first = env.reset()["multi_modal_data"]["video"][0]
    slow = env.step("slow")[0]["multi_modal_data"]["video"][0]
    assert np.array_equal(first.frames, clips.clip_frames("right", 9, clips.FIRST_CLIP, shuffled=True))
    assert np.array_equal(slow.frames, clips.clip_frames("right", 9, clips.SLOW_CLIP, shuffled=True))
    assert not np.array_equal(first.frames, clips.clip_frames("right", 9, clips.FIRST_CLIP))


# --------------------------------------------------------------------------------------------- options, labels
def test_config_keys_come_from_the_options():
    assert set(CONFIG_KEYS) == {"turn_discount", "shuffle_frames", "frame_size", "num_frames", "fps"}
    assert CONFIG_KEYS["shuffle_frames"][:2] == (bool, False) and CONFIG_KEYS["turn_discount"][:2] == (float, 0.9)


@pytest.mark.parametrize("options, error, match", [
    ({"turn_discount": 0}, ValueError, "turn_discount must be > 0"),
    ({"turn_discount": 1.5}, ValueError, "turn_discount must be <= 1"),
    ({"frame_size": 30}, ValueError, "23 is not a multiple of 2 \\* \\(num_frames - 1\\) = 8"),
    ({"num_frames": 2}, ValueError, "num_frames must be >= 3"),
    ({"frame_size": 32, "num_frames": 6}, ValueError, "num_frames that fit: \\[3, 4, 5, 7, 13\\]"),
    ({"fps": 0}, ValueError, "fps must be > 0"),
    ({"shuffle_frames": "yes"}, TypeError, "shuffle_frames must be bool"),
    ({"frame_size": 32.0}, TypeError, "frame_size must be int"),
])
def test_options_are_checked(options, error, match):
    with pytest.raises(error, match=match):
        build_env(SimpleNamespace(label=_label()), SimpleNamespace(max_turns=2, **options))


def test_another_geometry_keeps_the_promises():
    env = build_env(SimpleNamespace(label=_label("left", 5)), SimpleNamespace(max_turns=2, frame_size=64, num_frames=9))
    first = env.reset()["multi_modal_data"]["video"][0].frames
    assert first.shape == (9, 64, 64, 3)
    cols = [_square(f)[1] for f in first]  # side 16, travel 48, step 6, moving left
    assert cols == list(range(48, -1, -6))
    assert {_square(f)[0] for f in first} == {clips.top_row(5, 64)}
    assert env.step("slow")[0]["multi_modal_data"]["video"][0].frames.shape == (17, 64, 64, 3)


@pytest.mark.parametrize("label, match", [
    ("right", "is not JSON"), (None, "is not JSON"), ("[1]", "not a JSON object"),
    (json.dumps({"direction": "up", "seed": 1}), "direction 'up'"),
    (json.dumps({"direction": "left", "seed": -1}), "seed -1"),
    (json.dumps({"direction": "left", "seed": True}), "seed True"),
])
def test_build_env_names_a_bad_label(label, match):
    with pytest.raises(ValueError, match=match):
        build_env(SimpleNamespace(label=label, group_index=0, index=7), SimpleNamespace(max_turns=2))


def test_build_env_needs_max_turns_and_reads_the_label():
    with pytest.raises(ValueError, match="max_turns is not set"):
        build_env(SimpleNamespace(label=_label()), SimpleNamespace())
    env = build_env(SimpleNamespace(label=_label("left", 12)), SimpleNamespace(max_turns=3, turn_discount=0.5))
    assert (env.direction, env.seed, env.max_turns, env.options.turn_discount) == ("left", 12, 3, 0.5)


# ----------------------------------------------------------------------------------------------------- dataset
def test_dataset_is_balanced_and_deterministic():
    rows = generate_rows(64, seed=0)
    labels = [json.loads(r["answer"]) for r in rows]
    for k in range(0, 64, 2):
        assert {labels[k]["direction"], labels[k + 1]["direction"]} == set(DIRECTIONS)
    assert rows == generate_rows(64, seed=0) and rows[:10] == generate_rows(10, seed=0)
    other = generate_rows(64, seed=1)
    assert [r["answer"] for r in other] != [r["answer"] for r in rows]
    assert len({lab["seed"] for lab in labels}) == 64
    assert all(r["problem"] == "" and r["images"] == [] for r in rows)
    assert json.loads(rows[3]["params"]) == {**labels[3], "index": 3, "dataset_seed": 0}
    with pytest.raises(ValueError, match="num_rows"):
        generate_rows(-1)


@pytest.mark.parametrize("suffix", ["parquet", "jsonl"])
def test_dataset_loads_without_pictures_and_builds_envs(tmp_path, suffix):
    cfg = load_config(CONFIG)
    # --make-data's call (jaxrl_vlm/job/assets.py `make_synthetic_data`)
    path = make_dataset(str(tmp_path / f"motion.{suffix}"), 6, seed=2, image_size=cfg.data.synthetic_image_size)
    if suffix == "parquet":
        assert pq.read_table(path).to_pylist() == generate_rows(6, seed=2)
    ds = load_styled_dataset(path, cfg.data.prompt_style)
    assert len(ds) == 6
    for sample, row in zip(ds, generate_rows(6, seed=2)):
        assert sample.prompt == [{"role": "user", "content": []}] and sample.label == row["answer"]
        env = build_env(sample, SimpleNamespace(max_turns=cfg.multiturn.max_turns, **cfg.extra))
        assert env.reset()["multi_modal_data"]["video"][0].frames.shape == (T, W, W, 3)
    with pytest.raises(ValueError, match="writes .parquet or .jsonl"):
        make_dataset(str(tmp_path / "x.csv"), 1)


def test_the_config_runs_this_task():
    cfg = load_config(CONFIG)
    assert cfg.data.synthetic_data_module == "envs.video_motion.synthetic"
    assert cfg.rollout.rollout_interaction_env_path == "envs.video_motion"
    assert cfg.train.output_dir == "runs/video_motion_tiny" and cfg.model.hf_checkpoint == "runs/tiny_qwen3_vl"
    assert cfg.extra == {k: spec[1] for k, spec in CONFIG_KEYS.items()}
    assert cfg.multiturn.max_turns == 2
    # The slow clip's 20 patches and the first clip's 12 fit a row; 32 rows fit the patch bucket.
    assert max(cfg.batching.patch_buckets) >= max(cfg.batching.row_buckets) * (12 + 20)


# ------------------------------------------------------------------------------------------------------ chance
def test_the_closed_forms():
    assert chance_reward(1, 0.9) == pytest.approx(1 / 3)
    assert chance_reward(2, 0.9) == pytest.approx(1 / 3 + 1 / 3 * 0.9 / 3)
    assert chance_reward(2, 0.9, 0.5, 0.5, 0.0) == pytest.approx(BEST_BLIND_REWARD)  # never looking: a coin flip
    with pytest.raises(ValueError):
        chance_reward(2, 0.9, 0.6, 0.6, 0.0)


def test_the_printer_agrees_with_a_monte_carlo_run_of_random_replies_through_the_env(capsys):
    chance_printer.main([])
    printed = capsys.readouterr().out
    figures = chance_printer.figures(2, 0.9)
    assert f"chance {figures['chance']:.3f}" in printed and f"best blind (answer at once) {0.5:.3f}" in printed
    assert f"uniform first letters {figures['chance_letters']:.3f}" in printed
    rng = np.random.default_rng(0)
    n, total = 6000, 0.0  # standard error ~0.0064
    options = VideoMotionOptions()
    for _ in range(n):
        env = VideoMotionEnv(DIRECTIONS[rng.integers(2)], int(rng.integers(2**31 - 1)), 2, options)
        env.reset()
        done = False
        while not done:
            _, done, _ = env.step(("left", "right", "slow")[rng.integers(3)])
        total += env.verdict()
    assert abs(total / n - figures["chance"]) < 0.02
    assert abs(total / n - 0.4333) < 0.02


def test_the_package_never_imports_jax():
    code = ("import sys, envs.video_motion, envs.video_motion.synthetic, envs.video_motion.chance; "
            "assert 'jax' not in sys.modules, 'jax imported'")
    subprocess.run([sys.executable, "-c", code], check=True)
