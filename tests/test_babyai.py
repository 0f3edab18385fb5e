"""The BabyAI task (envs/babyai) at the env level, no model: the reset and step contract, worlds reproducible by
seed, strict action words and the penalty turn, the oracle bot's demonstrations replayed through the env, the
chance figures' simulation against the env itself, and SFT transcripts the conversation loader accepts."""

from __future__ import annotations

import json
import re
import types

import numpy as np
import pyarrow.parquet as pq
import pytest
from PIL import Image

from envs.babyai import ACTIONS, LEVELS, BabyAIEnv, BabyAIOptions, build_env, parse_action
from envs.babyai.chance import dump_success, random_success
from envs.babyai.env import OUT_OF_TURNS_TEXT, SUCCESS_TEXT
from jaxrl_vlm.data.sft import parse_conversation
from rollout.multiturn import prompt_with_opening
from rollout.processing import ImageReadPolicy
from envs.babyai.prompts import QUESTION
from envs.babyai.synthetic import generate_row, make_dataset, make_sft_dataset, opening_message
from envs.babyai.world import describe_view, episode_seed, new_world, oracle_actions

GO_TO_OBJ, GO_TO_LOCAL = LEVELS


def _sample(row: dict, index: int = 0) -> types.SimpleNamespace:
    return types.SimpleNamespace(label=row["answer"], index=index, group_index=0, image_data=[])


def _args(**keys) -> types.SimpleNamespace:
    return types.SimpleNamespace(max_turns=8, **keys)


def _pixels(observation: dict) -> np.ndarray:
    (image,) = observation["multi_modal_data"]["image"]
    return np.asarray(image)


def test_reset_opens_with_the_view_and_the_mission_and_each_action_brings_a_new_view():
    env = build_env(_sample(generate_row(0, seed=3)), _args())
    opening = env.reset()
    assert opening["role"] == "user" and opening["obs_str"] == f"Mission: {env.mission}. {describe_view(env.world)}"
    assert env.mission.startswith("go to ")
    (image,) = opening["multi_modal_data"]["image"]
    assert isinstance(image, Image.Image) and image.size == (56, 56) and image.mode == "RGB"
    observation, done, info = env.step("left")
    assert not done and info == {"turn": 1, "action": "left"}
    assert observation["obs_str"] == f"Turn 1: left. {describe_view(env.world)}"
    assert _pixels(observation).shape == (56, 56, 3)
    message = env.format_observation(observation)
    assert message["role"] == "user" and [c["type"] for c in message["content"]] == ["image", "text"]
    env.close()
    with pytest.raises(RuntimeError, match="after close"):
        env.step("left")


_PLACE = re.compile(r"a (\w+) (\w+)(?: (\d+) ahead)?(?: and)?(?: (\d+) (left|right))?$")


@pytest.mark.parametrize("level", LEVELS)
def test_the_view_in_words_places_each_object_where_minigrid_has_it(level):
    """Each object the words name lies at agent + ahead x the facing direction + sideways x the right vector, by
    minigrid's own agent pose and object positions; and the words name no object the agent cannot see."""
    checked = 0
    for index in range(6):
        world = new_world(level, episode_seed(9, index))
        for action in ("forward", "left", "forward", "right"):
            text = describe_view(world)
            objects = text.split(". Wall")[0].removeprefix("You see ").rstrip(".")
            named = [] if objects == "no object" else objects.split(", ")
            for words in named:
                color, kind, ahead, side, way = _PLACE.fullmatch(words).groups()
                side = int(side or 0) * (1 if way == "right" else -1)
                x, y = np.asarray(world.agent_pos) + int(ahead or 0) * world.dir_vec + side * world.right_vec
                cell = world.grid.get(int(x), int(y))
                assert (cell.color, cell.type) == (color, kind), (text, words)
                assert world.in_view(int(x), int(y))
                checked += 1
            visible = [o for o in world.grid.grid if o is not None and o.type not in ("wall", "door")
                       and world.agent_sees(*o.cur_pos)]
            assert len(named) == len(visible), (text, visible)
            world.step(ACTIONS.index(action))
    assert checked >= 6


def test_the_view_in_words_is_an_option():
    env = BabyAIEnv(GO_TO_OBJ, 3, max_turns=2, options=BabyAIOptions(view_text=False))
    assert env.reset()["obs_str"] == f"Mission: {env.mission}."
    assert env.step("left")[0]["obs_str"] == "Turn 1: left."
    with_words = BabyAIEnv(GO_TO_OBJ, 3, max_turns=2)
    assert with_words.reset()["obs_str"] == f"Mission: {env.mission}. {describe_view(with_words.world)}"


def test_step_before_reset_is_refused_naming_reset():
    env = BabyAIEnv(GO_TO_OBJ, 1, max_turns=2)
    with pytest.raises(RuntimeError, match=r"before reset\(\)"):
        env.step("left")


@pytest.mark.parametrize("level", LEVELS)
def test_a_seed_gives_the_same_world_and_the_same_views(level):
    def play(seed: int) -> tuple[str, list[np.ndarray]]:
        env = BabyAIEnv(level, seed, max_turns=4)
        views = [_pixels(env.reset())]
        for action in ("right", "forward", "left"):
            observation, done, _ = env.step(action)
            if done:
                break
            views.append(_pixels(observation))
        return env.mission, views

    mission, views = play(11)
    again_mission, again_views = play(11)
    assert mission == again_mission and all(np.array_equal(a, b) for a, b in zip(views, again_views, strict=True))
    others = [play(seed) for seed in (12, 13, 14)]
    assert any(m != mission or not np.array_equal(v[0], views[0]) for m, v in others)
    # a reset rebuilds the world from the seed: the same opening after any play
    env = BabyAIEnv(level, 11, max_turns=4)
    env.reset()
    env.step("forward")
    assert np.array_equal(_pixels(env.reset()), views[0]) and env.turn == 0


def test_level_generation_prints_nothing(capsys):
    for index in (16, 21):  # worlds whose GoToLocal layout is redrawn: minigrid prints each rejected draw
        new_world(GO_TO_LOCAL, episode_seed(1, index))
    assert capsys.readouterr().out == ""


@pytest.mark.parametrize("text, action", [("forward", "forward"), (" Left.\n", "left"), ("DONE", "done"),
                                          ("toggle ", "toggle")])
def test_an_action_is_exactly_one_action_word(text, action):
    assert parse_action(text) == action


@pytest.mark.parametrize("text", ["", "go forward", "forward forward", "forwards", "left, right", "turn(left)",
                                  "forward!", "1"])
def test_anything_else_is_not_an_action(text):
    error = parse_action(text)
    assert not isinstance(error, str) and "left, right, forward, pickup, drop, toggle, done" in error.message


def test_an_invalid_reply_is_a_penalty_turn_that_leaves_the_world_as_it_is():
    env = BabyAIEnv(GO_TO_OBJ, 5, max_turns=2, options=BabyAIOptions(invalid_penalty=0.25))
    first = _pixels(env.reset())
    pose = (tuple(env.world.agent_pos), env.world.agent_dir, env.world.step_count)
    observation, done, info = env.step("walk north")
    assert not done and observation["obs_str"] == f"Invalid: not one action word. Your view: {describe_view(env.world)}"
    assert "walk north" in info["invalid"]
    assert np.array_equal(_pixels(observation), first)
    assert (tuple(env.world.agent_pos), env.world.agent_dir, env.world.step_count) == pose
    observation, done, info = env.step("???")  # the turn was spent: the second is the last
    assert done and observation == {"obs_str": OUT_OF_TURNS_TEXT} and info["success"] is False
    assert env.verdict() == pytest.approx(-0.5) and env.actions == [None, None]
    with pytest.raises(RuntimeError, match="after the episode ended"):
        env.step("left")


@pytest.mark.parametrize("level", LEVELS)
def test_the_oracle_bots_actions_succeed_when_replayed_through_the_env(level):
    for index in range(4):
        seed = episode_seed(7, index)
        actions = oracle_actions(level, seed)
        env = BabyAIEnv(level, seed, max_turns=len(actions))
        env.reset()
        for k, action in enumerate(actions, start=1):
            observation, done, info = env.step(action)
            assert done == (k == len(actions)), (level, seed, k)
        assert observation == {"obs_str": SUCCESS_TEXT} and info["success"] is True
        assert env.verdict() == pytest.approx(1 - 0.9 * len(actions) / env.world.max_steps)  # BabyAI's reward


@pytest.mark.parametrize("level", LEVELS)
def test_the_chance_simulation_is_the_env_played_with_random_actions(level):
    seeds = [episode_seed(1235, i) for i in range(6)]
    max_turns = 12
    wins, total = 0, 0.0
    for seed in seeds:
        rng = np.random.default_rng([0, seed])
        env = BabyAIEnv(level, seed, max_turns=max_turns)
        env.reset()
        done = False
        while not done:
            _, done, info = env.step(ACTIONS[int(rng.integers(len(ACTIONS)))])
        wins += info["success"]
        total += env.verdict()
    assert random_success(level, seeds, max_turns) == (pytest.approx(wins / len(seeds)), pytest.approx(total / 6))


def test_build_env_reads_the_row_and_the_level_option_replaces_its_level(tmp_path):
    rows = pq.read_table(make_dataset(str(tmp_path / "p.parquet"), 3, seed=2, image_size=70)).to_pylist()
    assert [r["images"] for r in rows] == [[], [], []] and rows[0]["problem"] == QUESTION
    label = json.loads(rows[1]["answer"])
    assert label == {"level": GO_TO_OBJ, "seed": episode_seed(2, 1), "tile_px": 10}
    env = build_env(_sample(rows[1]), _args())
    assert (env.level, env.seed, env.max_turns) == (GO_TO_OBJ, label["seed"], 8)
    assert env.reset()["multi_modal_data"]["image"][0].size == (70, 70)
    assert build_env(_sample(rows[1]), _args(level=GO_TO_LOCAL)).level == GO_TO_LOCAL


def test_bad_rows_and_options_are_refused_naming_the_cause():
    with pytest.raises(ValueError, match=r"sample\(group=0, index=4\) label is not a babyai row"):
        build_env(types.SimpleNamespace(label="12", index=4, group_index=0), _args())
    bad_level = json.dumps({"level": "BabyAI-BossLevel-v0", "seed": 1})
    with pytest.raises(ValueError, match="BabyAI-BossLevel-v0.*is not one of BabyAI-GoToObj-v0"):
        build_env(types.SimpleNamespace(label=bad_level, index=0, group_index=0), _args())
    with pytest.raises(ValueError, match="babyai build_env: args.level: level 'GoToObj'"):
        build_env(_sample(generate_row(0)), _args(level="GoToObj"))
    with pytest.raises(ValueError, match="invalid_penalty must be >= 0"):
        build_env(_sample(generate_row(0)), _args(invalid_penalty=-1.0))


def test_sft_transcripts_are_the_oracles_episodes_in_the_loaders_layout(tmp_path):

    path = make_sft_dataset(str(tmp_path / "t.parquet"), 3, seed=4)
    for index, row in enumerate(pq.read_table(path).to_pylist()):
        params = json.loads(row["params"])
        assert params["seed"] == episode_seed(4, index)
        assert params["actions"] == oracle_actions(GO_TO_OBJ, params["seed"])
        assert params["reward"] > 0.5
        messages, trained, tools = parse_conversation(row, fmt="parquet", base_dir=str(tmp_path),
                                                      input_key="messages", image_key="images", tool_key="tools",
                                                      caps=ImageReadPolicy())
        turns = len(params["actions"])
        assert [m["role"] for m in messages] == ["user"] + ["assistant", "user"] * (turns - 1) + ["assistant"]
        assert [m["content"] for m in messages[1::2]] == params["actions"] and all(trained) and tools is None
        assert len(row["images"]) == len(params["actions"])  # the opening view and one per action but the last
    # the first message is the RL prompt with the env's reset observation joined as the rollout joins it
    env = BabyAIEnv(GO_TO_OBJ, episode_seed(4, 0), max_turns=8)
    opening = env.format_observation(env.reset())
    rollout_prompt = prompt_with_opening([{"role": "user", "content": QUESTION}], opening)
    assert rollout_prompt == [opening_message(QUESTION, opening)]


def test_dump_success_reads_lines_whose_text_holds_unicode_line_separators(tmp_path):
    """A dump writes a random model's text raw (ensure_ascii=False); U+2028 inside it must not split a record."""
    path = tmp_path / "dump.jsonl"
    records = [{"reward": 0.8, "response": "go\u2028forward"}, {"reward": -0.1, "response": "a\x85b"}]
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    assert dump_success(str(path)) == (0.5, 2)
