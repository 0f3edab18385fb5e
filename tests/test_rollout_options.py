"""Typed rollout and multi-turn options (`rollout.options`): one home for names and defaults, composed by config."""

from __future__ import annotations

import dataclasses
import types

from jaxrl_vlm.config import Config
from rollout.options import MultiTurnOptions, RolloutOptions


def test_from_args_fills_missing_attributes_from_the_dataclass_defaults():
    args = types.SimpleNamespace(max_turns=5, rollout_max_response_len="30", partial_rollout=1, rollout_seed=None,
                                 unrelated_key="kept out")
    rollout, multiturn = RolloutOptions.from_args(args), MultiTurnOptions.from_args(args)
    assert multiturn == dataclasses.replace(MultiTurnOptions(), max_turns=5)
    assert rollout.rollout_max_response_len == 30 and rollout.partial_rollout is True
    assert rollout.rollout_seed is None  # None stays "unset", as the reads it replaces treated it
    assert rollout.episode_timeout == RolloutOptions().episode_timeout and rollout.rollout_stop_token_ids == []
    assert RolloutOptions.from_args(types.SimpleNamespace()) == RolloutOptions()
    assert RolloutOptions.from_args(rollout) == rollout  # an options object reads as its own namespace


def test_config_composes_the_option_sets_and_flattens_them_into_args():
    cfg = Config()
    assert isinstance(cfg.rollout, RolloutOptions) and isinstance(cfg.multiturn, MultiTurnOptions)
    args = cfg.to_namespace()
    assert RolloutOptions.from_args(args) == cfg.rollout
    assert MultiTurnOptions.from_args(args) == cfg.multiturn


def test_list_defaults_are_not_shared_between_instances():
    a, b = RolloutOptions(), RolloutOptions()
    a.rollout_stop_token_ids.append(7)
    assert b.rollout_stop_token_ids == []
