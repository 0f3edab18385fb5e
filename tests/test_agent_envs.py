"""The three visual agent tasks (envs/sokoban, envs/zoom, envs/gui): rules, documented chance and best-blind levels
checked against the envs themselves, malformed actions (a penalty and a message, never an exception), and for each
shipped config a multi-turn rollout through the real episode loop and chat template (a scripted engine plays the
good policy), with pictures in the observations and a dump that validates.
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import json

import numpy as np
import pyarrow.parquet as pq
import pytest

from envs.gui import GuiEnv
from envs.actions import ActionError, parse_tool_call
from envs.env_server import EnvServer, running
from envs.gui.grading import Click, Type, best_blind_clicks, parse_action, random_policy, simulate
from envs.gui.screen import hit, initial_state, to_relative
from envs.gui.synthetic import solution, task_for
from envs.sokoban import SokobanEnv, SokobanOptions
from envs.sokoban.grading import best_blind_reward, chance_reward, optimal_reward, parse_move
from envs.sokoban.levels import DIRECTIONS, Level, generate_level, solve
from envs.sokoban.synthetic import level_for
from envs.zoom import ZoomEnv
from envs.zoom.grading import Answer, Zoom, parse_turn
from envs.zoom.grading import best_blind_reward as zoom_best_blind
from envs.zoom.grading import chance_reward as zoom_chance
from envs.zoom.scene import crop, digit_bbox, render_scene
from envs.zoom.synthetic import _params as zoom_params
from jaxrl_vlm.config import load_config
from jaxrl_vlm.data.geo3k import load_styled_dataset
from jaxrl_vlm.job.assets import make_synthetic_data
from jaxrl_vlm.job.session import task_env_module
from rollout.client import RetryPolicy, SGLangClient
from rollout.dump import dump_samples, validate_dump
from rollout.encoding import ChatEncoder
from rollout.fake_engine import FakeSGLangServer, Tokens
from rollout.multiturn import RolloutContext, generate
from rollout.sample import Status


# ----------------------------------------------------------------------------------------------- sokoban
def _level(rows: list[str]) -> Level:
    cells = {(r, c): ch for r, row in enumerate(rows) for c, ch in enumerate(row)}
    pick = lambda chars: frozenset(p for p, ch in cells.items() if ch in chars)  # noqa: E731
    (player,) = pick("@")
    return Level(len(rows), len(rows[0]), pick("#"), pick(".*"), pick("$*"), player)


def test_sokoban_moves_push_and_block():
    level = _level(["#####", "#@$.#", "#####"])
    assert solve(level) == ["right"]
    pushed, moved = level.move("right")
    assert moved and pushed.solved() and pushed.player == (1, 2)
    blocked, moved = level.move("up")
    assert not moved and blocked == level
    wedged = _level(["#####", "#.@$#", "#####"])  # the box is against the wall: it cannot be pushed further
    assert wedged.move("right") == (wedged, False) and solve(wedged) is None


def test_generated_levels_have_their_known_minimum():
    for i in range(20):
        level, minimum = generate_level(3, i, min_moves=2, max_moves=3)
        path = solve(level)
        assert 2 <= minimum <= 3 and len(path) == minimum
        for seq in itertools.product(DIRECTIONS, repeat=minimum - 1):  # no shorter sequence solves it
            lv = level
            for move in seq:
                lv, _ = lv.move(move)
                assert not lv.solved()
    assert level_for(5, 0) == level_for(5, 0)


def test_sokoban_episode_rewards_and_pictures():
    level, minimum = level_for(1, 0)
    env = SokobanEnv(level, max_turns=4, min_moves=minimum)
    done = False
    for move in solve(level):
        obs, done, info = env.step(f'<tool_call>{{"name": "move", "arguments": {{"direction": "{move}"}}}}</tool_call>')
        assert obs["role"] == "tool"
        if not done:
            assert obs["multi_modal_data"]["image"][0].size == (96, 96)
    assert done and info["solved"] and env.verdict() == pytest.approx(1 - 0.05 * minimum)


@pytest.mark.parametrize("reply,expected", [
    ("Up", "up"), ("I go left now", "left"), ("move(down)", "down"), ("move('right')", "right"),
    ('<tool_call>{"name": "move", "arguments": {"direction": "up"}}</tool_call> then left', "up"),
])
def test_sokoban_reads_moves_from_text_and_tool_calls(reply, expected):
    assert parse_move(reply)[0] == expected


@pytest.mark.parametrize("reply,message", [
    ("hmm", "say up, down, left or right"),
    ('<tool_call>{"name": "move", "arguments": {"direction": "north"}}</tool_call>', "direction must be one of"),
    ("<tool_call>{not json}</tool_call>", "not valid JSON"),
    ('<tool_call>{"name": "jump", "arguments": {}}</tool_call>', "unknown tool 'jump'"),
])
def test_sokoban_invalid_moves_cost_a_penalty_and_show_the_board(reply, message):
    level, _ = level_for(0, 0)
    env = SokobanEnv(level, max_turns=3)
    obs, done, info = env.step(reply)
    assert not done and message in obs["obs_str"] and message in info["invalid"]
    assert len(obs["multi_modal_data"]["image"]) == 1 and env.level == level
    assert env.verdict() == pytest.approx(-0.1)


def test_sokoban_chance_and_best_blind_are_exact_on_the_env():
    levels = [level_for(i, 9)[0] for i in range(12)]
    options = SokobanOptions()
    rng = np.random.default_rng(0)
    n = 3000
    total = 0.0
    for k in range(n):
        env = SokobanEnv(levels[k % len(levels)], max_turns=2, options=options)
        done = False
        while not done:
            _, done, _ = env.step(list(DIRECTIONS)[rng.integers(4)])
        total += env.verdict()
    assert total / n == pytest.approx(chance_reward(levels, 2, options), abs=0.03)
    best, seq = best_blind_reward(levels, 2, options)
    replay = []
    for level in levels:
        env = SokobanEnv(level, max_turns=2, options=options)
        for move in seq:
            if not env.done:
                env.step(move)
        replay.append(env.verdict())
    assert np.mean(replay) == pytest.approx(best)
    assert chance_reward(levels, 2, options) <= best < optimal_reward([level_for(i, 9)[1] for i in range(12)], options)


# ----------------------------------------------------------------------------------------------- zoom
def test_the_zoom_crop_shows_the_digit_box_enlarged():
    params = zoom_params(4, 0, 384)
    scene = render_scene(params)
    region = crop(scene, digit_bbox(params, margin=0.0), 64)
    assert max(region.size) == 64
    pixels = np.asarray(region)
    assert (pixels == 255).all(axis=-1).mean() > 0.3 and (pixels == 0).all(axis=-1).any()  # white box, black strokes
    whole = np.asarray(scene.resize((128, 128)))  # what the model sees of the whole scene: no white box left
    assert (whole == 255).all(axis=-1).sum() < 10


def test_zoom_episode_tool_messages_carry_the_crop():
    params = zoom_params(7, 1, 384)
    env = ZoomEnv(params, max_turns=3)
    call = json.dumps({"name": "zoom", "arguments": {"bbox_2d": digit_bbox(params)}})
    obs, done, info = env.step(f"<tool_call>{call}</tool_call>")
    assert not done and obs["role"] == "tool" and len(obs["multi_modal_data"]["image"]) == 1
    message = env.format_observation(obs)
    assert message["role"] == "tool" and message["content"][0]["type"] == "image"
    _, done, info = env.step(f"<answer>{params['digit']}</answer>")
    assert done and info["correct"] and env.verdict() == 1.0


@pytest.mark.parametrize("reply,kind", [
    ("zoom(10, 20, 300, 400)", Zoom), ("It is 7.", Answer),
    ('<tool_call>{"name": "answer", "arguments": {"answer": 3}}</tool_call>', Answer),
    ('<tool_call>{"name": "zoom", "arguments": {"bbox_2d": [500, 10, 400, 20]}}</tool_call>', ActionError),
    ("no idea", ActionError), ('<tool_call>{"name": "zoom", "arguments": {"bbox_2d": "all"}}</tool_call>', ActionError),
])
def test_zoom_reads_calls_and_answers(reply, kind):
    action, _ = parse_turn(reply)
    assert isinstance(action, kind), action


def test_zoom_invalid_turn_is_a_penalty_and_the_chance_levels_hold():
    params = zoom_params(0, 2, 384)
    env = ZoomEnv(params, max_turns=2)
    obs, done, _ = env.step("let me think")
    assert not done and "no zoom call and no digit answer" in obs["obs_str"]
    env.step("x")
    assert env.done and env.verdict() == pytest.approx(-0.2)
    rng = np.random.default_rng(0)
    hits = [ZoomEnv(zoom_params(0, i, 128), 1).step(str(rng.integers(10)))[2]["correct"] for i in range(400)]
    assert np.mean(hits) == pytest.approx(zoom_chance(), abs=0.05) and zoom_best_blind() == zoom_chance() == 0.1


# ----------------------------------------------------------------------------------------------- gui
def test_gui_scripted_solutions_complete_both_task_kinds():
    for index in (0, 1, 2, 3):
        layout, task, _ = task_for(index, 5)
        env = GuiEnv(layout, task, max_turns=3)
        for action in solution(env):
            obs, done, info = env.step(action)
        assert done and info["success"] and env.verdict() == pytest.approx(1 - 0.02 * len(solution(env)))


def test_gui_clicks_use_relative_coordinates_and_typing_needs_focus():
    layout, task, _ = task_for(1, 0)
    env = GuiEnv(layout, task, max_turns=4)
    state = initial_state(layout)
    assert hit(state, *to_relative(state, state.app_boxes["Mail"])) == "app:Mail"
    obs, done, info = env.step('type("kiwi")')
    assert not done and "no text field is focused" in obs["obs_str"] and env.verdict() == pytest.approx(-0.1)
    assert obs["multi_modal_data"]["image"][0].size == (256, 192)


@pytest.mark.parametrize("reply,expected", [
    ("click(120, 640)", Click(120, 640)), ('type("kiwi")', Type("kiwi")),
    ('<tool_call>{"name": "click", "arguments": {"x": 5, "y": 1000}}</tool_call>', Click(5, 1000, True)),
])
def test_gui_reads_actions(reply, expected):
    assert parse_action(reply) == expected


@pytest.mark.parametrize("reply,message", [
    ("click(1200, 5)", "must be in [0, 1000]"), ("click(5)", "two integers"), ("press enter", "no action"),
    ('<tool_call>{"name": "click", "arguments": {"x": "a", "y": 2}}</tool_call>', "must be an integer"),
])
def test_gui_malformed_actions_are_errors_not_exceptions(reply, message):
    action = parse_action(reply)
    assert isinstance(action, ActionError) and message in action.message
    layout, task, _ = task_for(0, 0)
    obs, done, _ = GuiEnv(layout, task, max_turns=2).step(reply)
    assert not done and "Invalid action" in obs["obs_str"]


def test_gui_chance_and_best_blind_simulations():
    make = lambda: [GuiEnv(*task_for(i, 3)[:2], max_turns=3) for i in range(24)]  # noqa: E731
    chance = simulate(make, random_policy)
    blind, seq = best_blind_clicks(make, grid=5)
    assert -0.2 < chance < 0.05 and chance <= blind < 0.2 and len(seq) == 3
    assert parse_tool_call("nothing here", ("click",)) is None


# ----------------------------------------------------------------------------------------------- rollouts
def _scripted_replies(task: str, sample) -> list[str]:
    """The good policy's replies for one prompt (what a trained model would say)."""
    if task == "sokoban":
        level = Level.from_json(json.loads(sample.label)["level"])
        return solve(level)
    if task == "zoom":
        params = json.loads(sample.label)
        return [f'<tool_call>{json.dumps({"name": "zoom", "arguments": {"bbox_2d": digit_bbox(params)}})}</tool_call>',
                f'<tool_call>{json.dumps({"name": "answer", "arguments": {"answer": str(params["digit"])}})}</tool_call>']
    data = json.loads(sample.label)
    return solution(GuiEnv(data["layout"], data["task"], max_turns=3))


async def _rollout(cfg, encoder, samples, replies, env_module=None):
    queues = {}

    def reply(body):
        ids = body["input_ids"]
        key = next(k for k, q in queues.items() if ids[: len(k)] == list(k))
        if not queues[key]:  # an empty script: the engine fails this request, the episode is FAILED
            raise RuntimeError("scripted engine: no reply left for this episode")
        text = queues[key].pop(0)
        out = encoder.tokenize(text) + [encoder.vision.im_end]
        return Tokens(output_ids=tuple(out), log_probs=tuple(-0.5 for _ in out))

    server = FakeSGLangServer(generate_fn=reply, eos_token_id=encoder.vision.im_end,
                              image_token_id=encoder.vision.image_pad)
    out = []
    async with server:
        client = SGLangClient(server.url, timeout_s=5.0, retry=RetryPolicy(max_retries=0))
        async with client:
            args = cfg.to_namespace()
            args.rollout_context = RolloutContext(client=client, encoder=encoder,
                                                  env_module=env_module or task_env_module(cfg),
                                                  generate_slots=asyncio.Semaphore(4))
            for sample, script in zip(samples, replies):
                seg = encoder.encode_prompt(sample.prompt, tools=sample.metadata.get("tools"))
                queues = {tuple(seg.wire_ids): list(script)}
                out.append(await generate(args, sample))
    return out


def _task_rollout_inputs(task, tmp_path, tiny_tokenizer, tiny_image_processor, *overrides):
    cfg = load_config(f"configs/{task}_tiny.yaml", ["--prompt-data", str(tmp_path / "p.parquet"), *overrides])
    make_synthetic_data(cfg, tmp_path / "p.parquet", 6, seed=0)
    data = load_styled_dataset(str(tmp_path / "p.parquet"), cfg.data.prompt_style, system_prompt=cfg.data.system_prompt)
    samples = [data[i] for i in range(len(data))]
    for k, s in enumerate(samples):
        s.group_index, s.index = k, 0
    replies = [_scripted_replies(task, s) for s in samples]
    return cfg, samples, replies, ChatEncoder(tiny_tokenizer, tiny_image_processor)


@pytest.mark.parametrize("task", ["sokoban", "zoom", "gui"])
def test_each_config_rolls_out_multi_turn_with_pictures_and_its_dump_validates(task, tmp_path, tiny_tokenizer,
                                                                               tiny_image_processor):
    cfg, samples, replies, encoder = _task_rollout_inputs(task, tmp_path, tiny_tokenizer, tiny_image_processor)
    episodes = asyncio.run(_rollout(cfg, encoder, samples, replies))
    for ep, script in zip(episodes, replies):
        assert ep.status is Status.COMPLETED, (ep.status, ep.metadata.get("error"))
        assert ep.reward > 0.5, ep.reward
        assert len(ep.turns) == len(script) and len(ep.image_data) == len(script)  # prompt picture + one per step
    dump = tmp_path / "dump.jsonl"
    dump_samples(episodes, dump, tiny_tokenizer)
    records = validate_dump(dump)
    multi = [r for r in records if len(r["turns"]) > 1]
    assert multi, "no multi-turn episode"
    for rec in multi:
        assert len(rec["prompt_images"]) == 1 and all(len(t["images"]) == 1 for t in rec["turns"][:-1])
        assert all((dump.parent / t["images"][0]["file"]).is_file() for t in rec["turns"][:-1])
    if task == "zoom":  # the crop comes back inside a tool message (the template's path for images in tool turns)
        assert "<|im_start|>user\n<tool_response>\n<|vision_start|><|image_pad|><|vision_end|>Region" in \
            records[0]["turns"][0]["observation_text"]


def test_configs_carry_the_tasks_own_system_prompts():
    from envs.gui.prompts import SYSTEM_PROMPT as GUI
    from envs.zoom.prompts import SYSTEM_PROMPT as ZOOM

    assert load_config("configs/zoom_tiny.yaml").data.system_prompt == ZOOM
    assert load_config("configs/gui_tiny.yaml").data.system_prompt == GUI


@pytest.mark.parametrize("task", ["sokoban", "zoom", "gui"])
def test_sft_transcripts_load_with_the_conversation_loader(task, tmp_path, tiny_tokenizer, tiny_image_processor):
    import importlib

    from jaxrl_vlm.data.sft import load_conversation_dataset

    synthetic = importlib.import_module(f"envs.{task}.synthetic")
    path = synthetic.make_sft_dataset(str(tmp_path / "t.parquet"), 3, seed=0)
    dataset = load_conversation_dataset(path, ChatEncoder(tiny_tokenizer, tiny_image_processor))
    assert len(dataset) == 3
    params = [json.loads(p) for p in pq.read_table(path).column("params").to_pylist()]
    assert all(p["reward"] > 0.5 for p in params)  # each transcript solved its episode in the env


@pytest.mark.parametrize("task", ["sokoban", "zoom"])
def test_a_task_played_on_env_serve_gives_the_in_process_episodes(task, tmp_path, tiny_tokenizer,
                                                                   tiny_image_processor):
    """`--env-url`: the same config's episodes on `jaxrl-vlm env-serve` of the task module (each reset sends the
    sample) are the in-process ones, token for token, picture for picture, reward for reward."""
    cfg, samples, replies, encoder = _task_rollout_inputs(task, tmp_path, tiny_tokenizer, tiny_image_processor)
    local = asyncio.run(_rollout(cfg, encoder, copy.deepcopy(samples), replies))  # an episode fills its sample

    async def on_env_serve():
        async with running(EnvServer(task_env_module(cfg), cfg.to_namespace())) as url:
            remote_cfg = load_config(f"configs/{task}_tiny.yaml",
                                     ["--prompt-data", str(tmp_path / "p.parquet"), "--env-url", url])
            module = task_env_module(remote_cfg)
            assert module.build_env is not task_env_module(cfg).build_env  # the remote client's
            return await _rollout(remote_cfg, encoder, samples, replies, module)

    far = asyncio.run(on_env_serve())
    for a, b in zip(local, far):
        assert b.status is a.status is Status.COMPLETED, b.metadata.get("error")
        assert (b.tokens, b.loss_mask, b.rollout_log_probs, b.image_data, b.reward) == (
            a.tokens, a.loss_mask, a.rollout_log_probs, a.image_data, a.reward)
        assert len(b.turns) == len(a.turns) > 1
