"""envs.picture_stream (the long-episode stress env): a new picture every turn, no early end, a dense reward."""

from __future__ import annotations

import types

import numpy as np
import pytest

from envs.base import observation_images
from envs.picture_stream import PictureStreamEnv, PictureStreamOptions, build_env, picture


def test_every_turn_brings_a_new_picture_until_max_turns():
    env = PictureStreamEnv(seed=3, max_turns=4, options=PictureStreamOptions(picture_px=32))
    pictures = []
    for turn in range(1, 5):
        obs, done, info = env.step("abc xyz" if turn % 2 else "zzz")
        assert done is (turn == 4) and info == {"turn": turn}
        (image,) = observation_images(obs)
        assert image.size == (32, 32)
        pictures.append(np.asarray(image))
    assert len({p.tobytes() for p in pictures}) == 4
    assert env.verdict() == pytest.approx(np.mean([3 / 6, 0.0, 3 / 6, 0.0]))  # a, b, c of abcxyz are in a-m
    with pytest.raises(RuntimeError, match="after the episode ended"):
        env.step("more")
    assert np.array_equal(np.asarray(picture(7, 32)), np.asarray(picture(7, 32)))  # deterministic


def test_build_env_reads_max_turns_and_options():
    args = types.SimpleNamespace(max_turns=20, picture_px=48)
    env = build_env(types.SimpleNamespace(index=1, group_index=2, label="x"), args)
    assert env.max_turns == 20 and env.options.picture_px == 48
    with pytest.raises(ValueError, match="picture_px"):
        build_env(types.SimpleNamespace(index=0, group_index=0), types.SimpleNamespace(max_turns=2, picture_px=4))
