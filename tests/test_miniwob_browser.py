"""envs.miniwob in real headless Chromium (`-m browser -n 0`; CI's browser step installs chromium, chromium-driver and
the `miniwob` extra): reset by seed is reproducible, the scripted demonstrations succeed, a malformed reply is a
penalty and the episode goes on, the 10-s in-page timer is really off, and an episode runs through `env-serve` over
/ws with our OpenEnv client."""

from __future__ import annotations

import json
import time
import types

import numpy as np
import pytest

import envs.miniwob as miniwob
import envs.remote as remote
from envs.env_server import EnvServer, running
from envs.miniwob.browser import BrowserPool
from envs.miniwob.env import SUCCESS_TEXT, MiniWoBEnv
from envs.miniwob.synthetic import make_sft_dataset, page_seed
from envs.miniwob.tasks import TASKS, scripted_reply

pytestmark = pytest.mark.browser


@pytest.fixture(scope="module")
def pool():
    pool = BrowserPool(1)
    yield pool
    pool.close()


def _page(pool: BrowserPool, task: str, seed: int) -> tuple[bytes, list[tuple]]:
    env = MiniWoBEnv(task, seed, max_turns=1, pool=pool)
    try:
        env.reset()
        assert env.screen is not None
        geometry = [(e.tag, e.text, e.left, e.top, e.width, e.height) for e in env.screen.elements]
        return np.asarray(env.screen.screenshot).tobytes(), geometry
    finally:
        env.close()


def test_reset_by_seed_draws_the_same_page(pool):
    first, again, other = _page(pool, "click-test", 11), _page(pool, "click-test", 11), _page(pool, "click-test", 12)
    assert first == again
    assert first[1] != other[1] and first[0] != other[0]
    assert pool.started == 1  # one persistent Chrome served all three episodes


@pytest.mark.parametrize("task", TASKS)
def test_the_scripted_demonstration_succeeds(pool, task):
    for index in range(5):
        env = MiniWoBEnv(task, page_seed(7, index), max_turns=1, pool=pool)
        try:
            opening = env.reset()
            assert opening["multi_modal_data"]["image"][0].size == (160, 210)
            obs, done, info = env.step(scripted_reply(task, env.screen))
            assert done and info["success"] and obs["obs_str"] == SUCCESS_TEXT and env.verdict() == 1.0
        finally:
            env.close()


def test_a_malformed_reply_is_a_penalty_and_the_episode_goes_on(pool):
    env = MiniWoBEnv("click-test", 3, max_turns=3, pool=pool)
    try:
        env.reset()
        obs, done, info = env.step("click the button please")
        assert not done and "invalid" in info and obs["obs_str"].startswith("Invalid action:")
        assert len(obs["multi_modal_data"]["image"]) == 1
        obs, done, info = env.step(scripted_reply("click-test", env.screen))
        assert done and info["success"] and env.verdict() == pytest.approx(1.0 - 0.1)
    finally:
        env.close()


def test_a_wrong_button_ends_with_the_pages_minus_one(pool):
    for seed in range(4, 24):  # the first page whose TWO button's centre is clear of ONE
        env = MiniWoBEnv("click-test-2", seed, max_turns=1, pool=pool)
        try:
            env.reset()
            two = next(e for e in env.screen.elements if e.text.strip() == "TWO")
            one = next(e for e in env.screen.elements if e.text.strip() == "ONE")
            x, y = two.center
            if one.left <= x <= one.left + one.width and one.top <= y <= one.top + one.height:
                continue
            obs, done, info = env.step("click({}, {})".format(*miniwob.to_normalized(x, y)))
            assert done and not info["success"] and env.verdict() == -1.0
            return
        finally:
            env.close()
    pytest.fail("no page among seeds 4-23 has TWO's centre clear of ONE")


def test_typing_goes_into_the_clicked_text_field(pool):
    for index in range(40):
        env = MiniWoBEnv("click-button", page_seed(9, index), max_turns=3, pool=pool)
        try:
            env.reset()
            field = next((e for e in env.screen.elements if e.tag == "input_text"), None)
            if field is None:
                continue
            obs, done, _ = env.step("click({}, {})".format(*miniwob.to_normalized(*field.center)))
            assert not done
            obs, done, info = env.step('type("kiwi")')
            assert not done and obs["obs_str"] == 'Typed "kiwi". The screen:' and "invalid" not in info
            assert [e.value for e in env.screen.elements if e.ref == field.ref] == ["kiwi"]
            return
        finally:
            env.close()
    pytest.fail("no click-button page with a text field in 40 seeds")


def test_the_in_page_timer_is_off(pool):
    """MiniWoB ends every episode with -1 after 10 s and scales rewards by the time left: an episode slower than
    that still gets its raw reward."""
    env = MiniWoBEnv("click-test", 21, max_turns=1, pool=pool)
    try:
        env.reset()
        time.sleep(10.5)
        _, done, info = env.step(scripted_reply("click-test", env.screen))
        assert done and info["success"] and info["raw_reward"] == 1.0 and env.verdict() == 1.0
    finally:
        env.close()


def test_sft_transcripts_replay_in_chromium(tmp_path):
    import pyarrow.parquet as pq

    rows = pq.read_table(make_sft_dataset(str(tmp_path / "sft.parquet"), 2, seed=3)).to_pylist()
    assert [m["role"] for m in rows[0]["messages"]] == ["user", "assistant"]
    assert rows[0]["messages"][0]["content"].count("<image>") == 1 and len(rows[0]["images"]) == 1
    assert rows[0]["messages"][1]["content"].startswith("click(") and json.loads(rows[0]["params"])["reward"] == 1.0


async def test_an_episode_through_env_serve_with_our_client():
    args = types.SimpleNamespace(max_turns=3, env_step_timeout=30.0, env_hook_timeout=60.0, browser_pool_size=1)
    server = EnvServer(miniwob, args)
    assert server.max_sessions == 1  # one Chrome page: one session at a time (`session_capacity`)
    async with running(server) as url:
        label = json.dumps({"task": "click-test", "seed": 5})
        sample = types.SimpleNamespace(group_index=0, index=0, prompt=[{"role": "user", "content": "q"}], label=label,
                                       image_data=[], metadata={})
        env = remote.build_env(sample, types.SimpleNamespace(**vars(args), env_url=url))
        try:
            opening = await env.reset()
            assert opening["obs_str"] == "Instruction: Click the button."
            assert opening["multi_modal_data"]["image"][0].startswith("data:image/png;base64,")
            obs, done, info = await env.step("not an action")
            assert not done and info["invalid"] and obs["multi_modal_data"]["image"]
            local_pool = BrowserPool(1)
            local = MiniWoBEnv("click-test", 5, max_turns=1, pool=local_pool)
            try:
                local.reset()  # the same seed draws the same page here: the scripted click for the served one
                reply = scripted_reply("click-test", local.screen)
            finally:
                local.close()
                local_pool.close()
            obs, done, info = await env.step(reply)
            assert done and obs["obs_str"] == SUCCESS_TEXT and env.verdict() == pytest.approx(0.9)
        finally:
            await env.close()
