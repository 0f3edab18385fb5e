"""The video-motion task (envs/video_motion): reply reading, clips, episodes, the shuffled ablation, dataset, config.

What the task promises and these tests check directly: the frames are uint8 [T, H, W, 3] and the square moves by the
clip's step in the label's direction; no single frame (at any position in a clip) tells the direction, since every
frame is exactly as likely under both; from the same start both directions share their first and last frames; the
shuffled ablation shows the same frames in a seeded order that carries no direction; the slow look is the same path at
half speed; the reward schedule; the option and label checks; the dataset is balanced, deterministic and loads
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


def _frames_from(direction: str, start: int, kind: str) -> np.ndarray:
    return clips.frames_at(clips.positions(direction, start, kind, W, T), W)


def _square_column(frame: np.ndarray) -> int:
    """The square's left column, read back from the pixels (wrapping around the ring)."""
    size = frame.shape[1]
    lit = frame[size // 2, :, 0] > 128
    starts = [c for c in range(size) if lit[c] and not lit[c - 1]]
    assert len(starts) == 1, f"one square per frame, found {starts}"
    return starts[0]


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
@pytest.mark.parametrize("kind, length, step", [(clips.FIRST_CLIP, T, 4), (clips.SLOW_CLIP, 2 * T - 1, 2)])
@pytest.mark.parametrize("direction", DIRECTIONS)
def test_frames_are_uint8_and_the_square_moves_by_the_step_in_the_direction(kind, length, step, direction):
    for seed in range(20):
        frames = clips.clip_frames(direction, seed, kind)
        assert frames.dtype == np.uint8 and frames.shape == (length, W, W, 3)
        cols = [_square_column(f) for f in frames]
        assert cols[0] == clips.start_column(seed, W)
        moves = {(b - a) % W for a, b in zip(cols, cols[1:])}
        assert moves == {step if direction == "right" else W - step}
        assert (cols[-1] - cols[0]) % W == W // 2  # the whole clip spans half the ring
    assert clips.step_of(kind, W, T) == step


def test_no_single_frame_tells_the_direction():
    for kind in clips.CLIP_KINDS:
        step = clips.step_of(kind, W, T)
        by_dir = {d: np.stack([_frames_from(d, x, kind) for x in range(W)]) for d in DIRECTIONS}  # [start, t, H, W, 3]
        for t in range(by_dir["right"].shape[1]):
            # Each frame at position t comes from exactly one start in either direction: the same multiset.
            seen = {d: Counter(f.tobytes() for f in by_dir[d][:, t]) for d in DIRECTIONS}
            assert seen["left"] == seen["right"]
            for x in range(W):  # the witness: frame t of a right clip from x is frame t of the left clip from x + 2ts
                assert np.array_equal(by_dir["right"][x, t], by_dir["left"][(x + 2 * t * step) % W, t])
        # From the same start, both directions share the first and the last frame: only the frames between differ.
        assert np.array_equal(by_dir["left"][:, [0, -1]], by_dir["right"][:, [0, -1]])
        assert not np.array_equal(by_dir["left"][:, 1], by_dir["right"][:, 1])


def test_start_columns_cover_the_ring_and_depend_only_on_the_seed():
    starts = [clips.start_column(s, W) for s in range(640)]
    assert set(starts) == set(range(W))
    assert max(Counter(starts).values()) < 40  # ~uniform (20 expected per column)
    assert starts == [clips.start_column(s, W) for s in range(640)]


def test_the_shuffled_clip_has_the_same_frames_in_a_seeded_order_that_carries_no_direction():
    for kind in clips.CLIP_KINDS:
        reordered = 0
        for seed in range(100):
            plain = clips.clip_frames("right", seed, kind)
            shuffled = clips.clip_frames("right", seed, kind, shuffled=True)
            assert np.array_equal(shuffled, clips.clip_frames("right", seed, kind, shuffled=True))  # deterministic
            assert sorted(f.tobytes() for f in shuffled) == sorted(f.tobytes() for f in plain)
            reordered += not np.array_equal(shuffled, plain)
            # The same multiset as the left clip from half a ring further: the set of frames says nothing.
            other = _frames_from("left", (clips.start_column(seed, W) + W // 2) % W, kind)
            assert sorted(f.tobytes() for f in shuffled) == sorted(f.tobytes() for f in other)
        assert reordered >= 95  # 1 order in 120 (first) or 362880 (slow) is the identity
    # The order is drawn from the seed and the clip kind, never from the direction.
    for direction in DIRECTIONS:
        order = clips.shuffle_order(5, clips.FIRST_CLIP, T)
        assert np.array_equal(clips.clip_frames(direction, 5, clips.FIRST_CLIP, shuffled=True),
                              clips.clip_frames(direction, 5, clips.FIRST_CLIP)[order])


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
    ({"frame_size": 30}, ValueError, "not a multiple of 4 \\* \\(num_frames - 1\\) = 16"),
    ({"num_frames": 2}, ValueError, "num_frames must be >= 3"),
    ({"frame_size": 32, "num_frames": 4}, ValueError, "num_frames that fit: \\[3, 5, 9\\]"),
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
    cols = [_square_column(f) for f in first]
    assert {(a - b) % 64 for a, b in zip(cols, cols[1:])} == {4} and (cols[0] - cols[-1]) % 64 == 32
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
