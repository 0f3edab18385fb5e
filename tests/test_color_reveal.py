"""The color-reveal task (envs/color_reveal): answers, reward schedule, episodes, pictures, dataset, --make-data.

The chance levels the learning test compares against are checked here against a Monte Carlo simulation of the
env itself, so a wrong closed form cannot make the learning margins look better than they are.
"""

from __future__ import annotations

import base64
import io
import json
import string
from types import SimpleNamespace

import numpy as np
import pyarrow.parquet as pq
import pytest
from PIL import Image

import envs.color_reveal as task
from envs.color_reveal import COLORS, ColorRevealEnv, ColorRevealOptions, build_env, parse_answer
from envs.color_reveal.answers import RGB, blind_elimination_reward, chance_reward, turn_credit
from envs.color_reveal.env import CORRECT_TEXT, NO_ANSWER_TEXT, OUT_OF_TURNS_TEXT, REVEAL_TEXT
from envs.color_reveal.images import BLANK_RGB, blank_image, is_blank, png_bytes, stripes_image
from envs.color_reveal.synthetic import generate_rows, make_dataset
from jaxrl_vlm.config import ConfigError, load_config
from jaxrl_vlm.data.geo3k import load_styled_dataset
from jaxrl_vlm.job.assets import make_synthetic_data

CONFIG = "configs/color_reveal_tiny.yaml"


def _data_url(image: Image.Image) -> str:
    return "data:image/png;base64," + base64.b64encode(png_bytes(image)).decode("ascii")


def _args(blind: bool = False) -> SimpleNamespace:
    return SimpleNamespace(max_turns=2, turn_discount=0.75, blind=blind)


def _pixels(image_bytes: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(image_bytes)).convert("RGB"))


# ----------------------------------------------------------------------------------------------- answers
@pytest.mark.parametrize("color", COLORS)
def test_each_color_name_answers_itself_in_any_spelling(color):
    for reply in (color, color.upper(), color.capitalize() + ".", f"  {color}, I think", f"**{color}**", f"é {color}"):
        assert parse_answer(reply) == color, reply


def test_every_ascii_letter_answers_exactly_one_color_and_no_letter_answers_none():
    counts = {c: 0 for c in COLORS}
    for letter in string.ascii_lowercase:
        counts[parse_answer(letter)] += 1
        assert parse_answer(letter.upper()) == parse_answer(letter)
    assert sum(counts.values()) == 26 and all(n > 0 for n in counts.values())
    for reply in ("", "  ", "123 !?", "ñü"):
        assert parse_answer(reply) is None
    with pytest.raises(TypeError, match="must be str"):
        parse_answer(b"red")


def test_turn_credit_and_closed_form_chance_levels():
    assert turn_credit(1, 0.75) == 1.0 and turn_credit(2, 0.75) == 0.75 and turn_credit(3, 0.5) == 0.25
    with pytest.raises(ValueError):
        turn_credit(0, 0.75)
    # Two turns, four colors: right at once 1/4, else right on the second guess 1/4 (random) or 1/3 (elimination).
    assert chance_reward(2, 0.75) == pytest.approx(0.25 + 0.75 * 0.25 * 0.75)
    assert blind_elimination_reward(2, 0.75) == pytest.approx(0.25 + 0.75 * (1 / 3) * 0.75)
    assert chance_reward(1, 0.75) == pytest.approx(0.25)
    assert blind_elimination_reward(4, 1.0) == pytest.approx(1.0)  # exhaustive guessing always finds it


def _play(env: ColorRevealEnv, policy) -> float:
    done = False
    while not done:
        _, done, _ = env.step(policy(env))
    return env.verdict()


@pytest.mark.slow
@pytest.mark.parametrize("max_turns,discount", [(2, 0.75), (3, 0.5)])
def test_chance_levels_match_a_simulation_of_the_env(max_turns, discount):
    rng = np.random.default_rng(0)
    options = ColorRevealOptions(turn_discount=discount)
    n = 20000
    cards = rng.integers(len(COLORS), size=n)
    random_total = sum(_play(ColorRevealEnv(COLORS[c], max_turns, options), lambda e: COLORS[rng.integers(4)]) for c in cards)

    def eliminate(env):
        left = [c for c in COLORS if c not in env.guesses]
        return left[rng.integers(len(left))]

    elim_total = sum(_play(ColorRevealEnv(COLORS[c], max_turns, options), eliminate) for c in cards)
    assert random_total / n == pytest.approx(chance_reward(max_turns, discount), abs=0.012)
    assert elim_total / n == pytest.approx(blind_elimination_reward(max_turns, discount), abs=0.012)


# ----------------------------------------------------------------------------------------------- episodes
def test_a_right_first_guess_ends_the_episode_with_full_reward():
    env = ColorRevealEnv("green", 2)
    obs, done, info = env.step("Green")
    assert done and obs == {"obs_str": CORRECT_TEXT} and info == {"turn": 1, "guess": "green", "correct": True}
    assert env.verdict() == 1.0
    with pytest.raises(RuntimeError, match="after the episode ended"):
        env.step("green")


def test_a_wrong_guess_reveals_the_card_alone_and_a_right_second_guess_earns_the_discount():
    env = ColorRevealEnv("red", 2, ColorRevealOptions(turn_discount=0.75), image_size=48)
    assert env.verdict() == 0.0
    obs, done, info = env.step("blue")
    assert not done and obs["obs_str"] == REVEAL_TEXT and info["correct"] is False
    (image,) = obs["multi_modal_data"]["image"]
    pixels = np.asarray(image)
    assert image.size == (48, 48) and (pixels == np.array(RGB["red"], dtype=np.uint8)).all()  # one solid stripe
    _, done, _ = env.step("red!")
    assert done and env.verdict() == 0.75


def test_out_of_turns_and_no_answer_feedback():
    env = ColorRevealEnv("white", 2)
    obs, done, _ = env.step("42")
    assert not done and obs["obs_str"] == NO_ANSWER_TEXT and len(obs["multi_modal_data"]["image"]) == 1
    obs, done, _ = env.step("green")
    assert done and obs == {"obs_str": OUT_OF_TURNS_TEXT} and env.verdict() == 0.0
    assert env.guesses == [None, "green"]


def test_feedback_never_names_a_color():
    for text in (CORRECT_TEXT, REVEAL_TEXT, NO_ANSWER_TEXT, OUT_OF_TURNS_TEXT):
        assert not any(color in text.lower() for color in COLORS), text


def test_blind_env_reveals_a_blank_picture():
    env = ColorRevealEnv("blue", 2, ColorRevealOptions(blind=True))
    obs, _, _ = env.step("red")
    assert is_blank(obs["multi_modal_data"]["image"][0])


def test_options_validate_and_come_from_args():
    with pytest.raises(ValueError, match="turn_discount must be <= 1"):
        ColorRevealOptions(turn_discount=1.5)
    with pytest.raises(ValueError):
        ColorRevealOptions(turn_discount=0.0)
    from_args = ColorRevealOptions.from_args(SimpleNamespace(turn_discount=0.5, blind=True))
    assert from_args == ColorRevealOptions(turn_discount=0.5, blind=True)
    assert set(task.CONFIG_KEYS) == {"turn_discount", "blind"}


def test_build_env_reads_label_turns_and_picture_size():
    picture = stripes_image([RGB["red"], RGB["blue"]], 96)
    sample = SimpleNamespace(label=" Red ", image_data=[_data_url(picture)], group_index=3, index=1)
    env = build_env(sample, _args())
    assert env.color == "red" and env.max_turns == 2 and env.image_size == 96
    with pytest.raises(ValueError, match=r"sample\(group=3, index=1\) has label 'purple'"):
        build_env(SimpleNamespace(label="purple", image_data=[], group_index=3, index=1), _args())
    with pytest.raises(ValueError, match="max_turns is not set"):
        build_env(sample, SimpleNamespace(turn_discount=0.75, blind=False))


def test_blind_build_env_refuses_a_prompt_that_shows_the_card():
    seeing = SimpleNamespace(label="red", image_data=[_data_url(stripes_image([RGB["red"], RGB["blue"]], 64))])
    with pytest.raises(ValueError, match="not blank"):
        build_env(seeing, _args(blind=True))
    blind = SimpleNamespace(label="red", image_data=[_data_url(blank_image(64))])
    assert build_env(blind, _args(blind=True)).options.blind


# ----------------------------------------------------------------------------------------------- dataset
def test_rows_are_deterministic_prefix_stable_and_balanced():
    rows = generate_rows(40, seed=5)
    assert rows[:12] == generate_rows(12, seed=5)
    assert rows != generate_rows(40, seed=6)
    for block in range(0, 40, len(COLORS)):  # every unshuffled batch of 4 has each card color once
        assert sorted(r["answer"] for r in rows[block : block + 4]) == sorted(COLORS)


def test_the_picture_shows_the_card_beside_a_decoy_of_another_color():
    for row in generate_rows(24, seed=2, image_size=64):
        params = json.loads(row["params"])
        assert row["answer"] == params["card"] != params["decoy"] and row["problem"].startswith("<image>")
        pixels = _pixels(row["images"][0]["bytes"])
        left, right = pixels[:, :32].reshape(-1, 3), pixels[:, 32:].reshape(-1, 3)
        card_half, decoy_half = (left, right) if params["card_side"] == 0 else (right, left)
        assert (card_half == params["card_rgb"]).all() and (decoy_half == params["decoy_rgb"]).all()
        # the jittered shade stays nearer its own color than any other
        for rgb, name in ((params["card_rgb"], params["card"]), (params["decoy_rgb"], params["decoy"])):
            dist = {c: np.abs(np.array(rgb) - RGB[c]).sum() for c in COLORS}
            assert min(dist, key=dist.get) == name


def test_blind_rows_are_the_same_rows_with_a_blank_picture():
    seeing, blind = generate_rows(16, seed=3), generate_rows(16, seed=3, blind=True)
    for a, b in zip(seeing, blind):
        assert a["answer"] == b["answer"] and a["problem"] == b["problem"]
        pa_, pb = json.loads(a["params"]), json.loads(b["params"])
        assert {**pa_, "blind": True} == pb
        assert (_pixels(b["images"][0]["bytes"]) == BLANK_RGB).all()


@pytest.mark.parametrize("suffix", ["parquet", "jsonl"])
def test_dataset_loads_with_the_prompt_loader(tmp_path, suffix):
    path = make_dataset(str(tmp_path / f"cards.{suffix}"), 8, seed=1, image_size=64)
    if suffix == "parquet":
        assert pq.read_table(path).num_rows == 8
    ds = load_styled_dataset(path, "plain")
    rows = generate_rows(8, seed=1, image_size=64)
    assert len(ds) == 8
    for sample, row in zip(ds, rows):
        assert sample.label == row["answer"]
        image_item, text_item = sample.prompt[-1]["content"]
        assert text_item == {"type": "text", "text": task.QUESTION}
        url = image_item["image"]
        assert np.array_equal(_pixels(base64.b64decode(url.split(",", 1)[1])), _pixels(row["images"][0]["bytes"]))
    with pytest.raises(ValueError, match="writes .parquet or .jsonl"):
        make_dataset(str(tmp_path / "x.csv"), 1)


# ----------------------------------------------------------------------------------------------- --make-data
def test_make_data_uses_the_configured_task_generator_and_fresh_eval_seeds(tmp_path):
    cfg = load_config(CONFIG, ["--prompt-data", str(tmp_path / "train.parquet"),
                               "--eval-prompt-data", "heldout", str(tmp_path / "heldout.parquet"),
                               "--synthetic-rows", "8", "--synthetic-eval-rows", "4"])
    make_synthetic_data(cfg, tmp_path / "train.parquet", 8, seed=cfg.train.seed)
    make_synthetic_data(cfg, tmp_path / "heldout.parquet", 4, seed=cfg.train.seed + 1)
    train = pq.read_table(tmp_path / "train.parquet").to_pylist()
    heldout = pq.read_table(tmp_path / "heldout.parquet").to_pylist()
    assert train == generate_rows(8, seed=cfg.train.seed, image_size=cfg.data.synthetic_image_size)
    assert heldout == generate_rows(4, seed=cfg.train.seed + 1, image_size=cfg.data.synthetic_image_size)
    assert not {r["images"][0]["bytes"] for r in heldout} & {r["images"][0]["bytes"] for r in train}


def test_make_data_names_a_generator_module_without_make_dataset(tmp_path):
    module = tmp_path / "nogen.py"
    module.write_text("X = 1\n")
    cfg = load_config(CONFIG, ["--synthetic-data-module", str(module)])
    with pytest.raises(ConfigError, match="has no make_dataset"):
        make_synthetic_data(cfg, tmp_path / "d.parquet", 2, seed=0)
    cfg = load_config(CONFIG, ["--synthetic-data-module", "envs.no_such_task"])
    with pytest.raises(ConfigError, match="no_such_task"):
        make_synthetic_data(cfg, tmp_path / "d.parquet", 2, seed=0)
