"""Tests of the guess-the-number env (docs/examples/guess_env.py): copy this file next to your own env and adapt.

    python -m pytest -q -n 0 -p no:randomly docs/examples/test_guess_env.py

They drive the env directly, as the rollout does (build_env, reset, step, verdict, format_observation, close),
with no model and no engine, so they take well under a second.
"""

from __future__ import annotations

import types
from pathlib import Path

import pytest

from jaxrl_vlm.data import load_prompt_dataset
from rollout.loading import load_module
from rollout.sample import Sample

# Loaded the way the trainer loads --rollout-interaction-env-path: by file path.
ENV = load_module(str(Path(__file__).with_name("guess_env.py")), "--rollout-interaction-env-path")


def make_env(secret: int = 7, max_turns: int = 3, **options):
    args = types.SimpleNamespace(max_turns=max_turns, **options)
    env = ENV.build_env(Sample(prompt="", label=str(secret)), args)
    env.reset()
    return env


def test_a_right_first_guess_earns_1():
    env = make_env(secret=7)
    observation, done, info = env.step("7")
    assert done and observation["obs_str"] == "Correct."
    assert info == {"turn": 1, "guess": 7}
    assert env.verdict() == 1.0


def test_hints_point_to_the_secret_and_later_right_guesses_earn_less():
    env = make_env(secret=7, turn_penalty=0.25)
    observation, done, _ = env.step("3")
    assert not done and observation["obs_str"].startswith("Higher.")
    observation, done, _ = env.step("I say 12")
    assert not done and observation["obs_str"].startswith("Lower.")
    _, done, _ = env.step("7")
    assert done and env.verdict() == pytest.approx(0.5)


def test_the_episode_ends_at_max_turns_with_no_reward():
    env = make_env(secret=7, max_turns=2)
    _, done, _ = env.step("no idea")
    assert not done
    observation, done, _ = env.step("8")
    assert done and observation["obs_str"] == "Wrong. No turns left."
    assert env.verdict() == 0.0
    with pytest.raises(RuntimeError, match="after the episode ended"):
        env.step("7")


def test_feedback_never_names_the_secret():
    for secret in range(ENV.LOW, ENV.HIGH + 1):
        env = make_env(secret=secret, max_turns=ENV.HIGH)
        for guess in range(ENV.LOW, ENV.HIGH + 1):
            if guess == secret:
                break
            observation, _, _ = env.step(str(guess))
            assert str(secret) not in observation["obs_str"]


def test_the_observation_becomes_a_user_message_and_close_ends_the_episode():
    env = make_env()
    observation, _, _ = env.step("1")
    message = env.format_observation(observation)
    assert message == {"role": "user", "content": [{"type": "text", "text": observation["obs_str"]}]}
    env.close()
    with pytest.raises(RuntimeError, match="after close"):
        env.step("7")


def test_bad_labels_and_options_are_errors_naming_the_cause():
    with pytest.raises(ValueError, match="not a whole number"):
        ENV.build_env(Sample(prompt="", label="seven"), types.SimpleNamespace(max_turns=3))
    with pytest.raises(ValueError, match="max_turns is not set"):
        ENV.build_env(Sample(prompt="", label="7"), types.SimpleNamespace())
    with pytest.raises(ValueError, match="turn_penalty must be <= 1"):
        make_env(turn_penalty=2.0)
    assert set(ENV.CONFIG_KEYS) == {"turn_penalty"}


def test_make_dataset_writes_rows_the_prompt_loader_reads(tmp_path: Path):
    path = ENV.make_dataset(str(tmp_path / "train.jsonl"), 12, seed=0)
    dataset = load_prompt_dataset(path)
    assert len(dataset) == 12
    for sample in dataset:
        env = ENV.build_env(sample, types.SimpleNamespace(max_turns=3))
        assert ENV.LOW <= env.secret <= ENV.HIGH
