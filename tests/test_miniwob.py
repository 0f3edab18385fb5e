"""envs.miniwob without a browser (the default run): coordinate mapping, action reading, the malformed-action penalty,
the episode logic on a stand-in page, the scripted click point, rows and config keys. The real Chromium tests are
tests/test_miniwob_browser.py (`-m browser`)."""

from __future__ import annotations

import json
import types

import pytest
import yaml
from PIL import Image

import envs.miniwob as miniwob
from envs.env_server import resolve_max_sessions
from envs.miniwob import browser
from envs.miniwob.browser import Element, Outcome, Screen
from envs.miniwob.env import FAILURE_TEXT, OUT_OF_TURNS_TEXT, SUCCESS_TEXT, MiniWoBEnv, MiniWoBOptions, build_env
from envs.miniwob.synthetic import generate_row, page_seed
from envs.miniwob.tasks import click_point, scripted_reply, to_normalized, to_pixels


def test_qwen_vl_coordinates_map_onto_the_160x210_task_area():
    assert to_pixels(0, 0) == (0.0, 0.0)
    assert to_pixels(500, 500) == (80.0, 105.0)
    assert to_pixels(1000, 1000) == (159.5, 209.5)  # the far edge stays inside the screenshot
    for x_px, y_px in [(0.0, 0.0), (37.0, 123.0), (159.0, 209.0)]:
        back = to_pixels(*to_normalized(x_px, y_px))
        assert abs(back[0] - x_px) <= 0.1 and abs(back[1] - y_px) <= 0.11
    assert to_normalized(-5, 500) == (0, 1000)


def test_replies_are_read_as_the_gui_task_reads_them():
    assert miniwob.parse_action("click(250, 750)").x == 250
    tagged = miniwob.parse_action('<tool_call>{"name": "click", "arguments": {"x": 1, "y": 2}}</tool_call>')
    assert (tagged.x, tagged.y, tagged.tagged) == (1, 2, True)
    assert miniwob.parse_action('type("bob")').text == "bob"
    assert "no action" in miniwob.parse_action("the button").message
    assert "[0, 1000]" in miniwob.parse_action("click(1200, 5)").message


class FakePage:
    """A page that records clicks: a hit inside `button` (task pixels) ends the episode with raw reward 1."""

    def __init__(self, task: str, button=(40.0, 90.0, 40.0, 40.0)) -> None:
        self.task, self.button, self.broken = task, button, False
        self.clicks: list[tuple[float, float]] = []
        self.seeds: list[int] = []
        self.hit = False

    def start(self, seed: int) -> Screen:
        self.seeds.append(seed)
        self.clicks, self.hit = [], False
        return self.screen()

    def screen(self) -> Screen:
        left, top, w, h = self.button
        return Screen("Click the button.", Image.new("RGB", (160, 210), "white"),
                      (Element(4, "button", "Click Me!", "subbtn", left, top, w, h),))

    def click(self, x: float, y: float) -> None:
        self.clicks.append((x, y))
        left, top, w, h = self.button
        self.hit = self.hit or (left <= x <= left + w and top <= y <= top + h)

    def type_text(self, text: str) -> None:
        raise AssertionError("not typed in these tests")

    def outcome(self) -> Outcome:
        return Outcome(self.hit, 1.0 if self.hit else 0.0)


class FakePool:
    def __init__(self) -> None:
        self.lent: list[FakePage] = []
        self.returned: list[FakePage] = []

    def lease(self, task: str) -> FakePage:
        self.lent.append(FakePage(task))
        return self.lent[-1]

    def give_back(self, page: FakePage) -> None:
        self.returned.append(page)


def test_a_malformed_reply_costs_the_penalty_and_the_episode_goes_on():
    pool = FakePool()
    env = MiniWoBEnv("click-test", 7, max_turns=3, pool=pool)
    opening = env.reset()
    assert opening["obs_str"] == "Instruction: Click the button." and len(opening["multi_modal_data"]["image"]) == 1
    assert pool.lent[0].seeds == [7]
    obs, done, info = env.step("I would press the button")
    assert not done and info["invalid"] and obs["obs_str"].startswith("Invalid action: no action")
    assert obs["multi_modal_data"]["image"] and pool.lent[0].clicks == []  # the page is as it was, shown again
    obs, done, info = env.step("click(0, 0)")  # a miss: click-test goes on
    assert not done and obs["obs_str"] == "Clicked (0, 0). The screen:"
    obs, done, info = env.step(scripted_reply("click-test", pool.lent[0].screen()))
    assert done and obs == {"obs_str": SUCCESS_TEXT, "role": "user"} and info["success"]
    assert pool.lent[0].clicks[-1] == pytest.approx((60.0, 110.0), abs=0.2)
    assert env.verdict() == pytest.approx(1.0 - 0.1)
    env.close()
    assert pool.returned == pool.lent and env.page is None


def test_the_turn_budget_ends_an_unfinished_episode_with_no_reward():
    env = MiniWoBEnv("click-test", 1, max_turns=1, options=MiniWoBOptions(invalid_penalty=0.25), pool=FakePool())
    env.reset()
    obs, done, info = env.step('<tool_call>{"name": "click", "arguments": {"x": 999, "y": 10}}</tool_call>')
    assert done and obs == {"obs_str": OUT_OF_TURNS_TEXT, "role": "tool"} and not info["success"]
    assert env.verdict() == 0.0
    env = MiniWoBEnv("click-test", 1, max_turns=1, options=MiniWoBOptions(invalid_penalty=0.25), pool=FakePool())
    env.reset()
    assert env.step("no")[1] and env.verdict() == -0.25
    assert FAILURE_TEXT != SUCCESS_TEXT


def test_the_scripted_click_avoids_a_button_lying_over_the_target():
    one = Element(1, "button", "ONE", "subbtn", 20, 60, 40, 40)
    two = Element(2, "button", "TWO", "subbtn2", 30, 70, 40, 40)  # covers ONE's centre (40, 80)
    x, y = click_point("click-test-2", Screen("Click button ONE.", Image.new("RGB", (160, 210)), (one, two)))
    assert 20 <= x <= 60 and 60 <= y <= 100 and not (30 <= x <= 70 and 70 <= y <= 110)
    ok = Element(3, "button", "Ok", "", 100, 150, 30, 20)
    screen = Screen('Click on the "Ok" button.', Image.new("RGB", (160, 210)), (one, ok))
    assert click_point("click-button", screen) == (115.0, 160.0)


def test_rows_name_a_task_and_a_page_seed_and_held_out_pages_differ():
    row = generate_row(3, seed=1234)
    assert json.loads(row["answer"]) == {"task": "click-test", "seed": page_seed(1234, 3)} and row["images"] == []
    assert generate_row(3, seed=1234) == row
    train = {page_seed(1234, i) for i in range(1024)}
    assert not train & {page_seed(1235, i) for i in range(200)}
    assert json.loads(generate_row(0, task="click-button")["answer"])["task"] == "click-button"


def test_options_and_build_env():
    assert set(miniwob.CONFIG_KEYS) == {"task", "invalid_penalty", "browser_pool_size"}
    with pytest.raises(ValueError, match="args.task"):
        MiniWoBOptions(task="click-everything")
    args = types.SimpleNamespace(max_turns=2, task="click-button")
    sample = types.SimpleNamespace(label=json.dumps({"task": "click-test", "seed": 5}), group_index=0, index=0)
    env = build_env(sample, args)
    assert (env.task, env.seed, env.max_turns) == ("click-button", 5, 2) and env.page is None  # no Chrome yet
    with pytest.raises(ValueError, match="never in the trainer's process"):
        build_env(sample, types.SimpleNamespace(max_turns=1, rollout_context=object()))
    with pytest.raises(ValueError, match="not a miniwob row"):
        build_env(types.SimpleNamespace(label="{}", group_index=0, index=0), args)


def test_without_the_miniwob_package_the_error_names_it(monkeypatch):
    def missing(name: str):
        raise ImportError(f"No module named {name!r}")

    monkeypatch.setattr(browser.importlib, "import_module", missing)
    with pytest.raises(ImportError, match=r"\.\[miniwob\]"):
        browser.Page("click-test")


def test_the_episode_keys_file_is_valid_for_env_serve():
    """configs/miniwob_multiturn.yaml is read by env-serve (--custom-config-path) and by the trainer alike
    (tests/test_config.py resolves the run configs)."""
    keys = yaml.safe_load(open("configs/miniwob_multiturn.yaml", encoding="utf-8"))
    options = MiniWoBOptions.from_args(types.SimpleNamespace(**keys))
    assert keys["max_turns"] == 1 and options.task is None and options.browser_pool_size >= 1


def test_click_test_chance_from_the_page_generator():
    """Against the continuous closed form: a random point of the 160x210 screenshot falls in a w x w button with
    probability w**2 / (160 * 210), w uniform over 35..99."""
    from envs.miniwob.chance import click_test_exact

    random, best, (x, y) = click_test_exact()
    assert random == pytest.approx(sum(w * w for w in range(35, 100)) / 65 / (160 * 210), abs=0.005)
    assert 0.5 < best < 0.65 and 400 <= x <= 600 and 500 <= y <= 700  # near the task area's centre


def test_env_serve_holds_one_session_per_chrome_page():
    """`session_capacity`: env-serve of MiniWoB holds `browser_pool_size` sessions by default (a session past the
    pool would wait inside a hook for a page, holding one of env-serve's few hook threads)."""
    assert resolve_max_sessions(miniwob, types.SimpleNamespace(max_turns=1), None) == MiniWoBOptions().browser_pool_size
    assert resolve_max_sessions(miniwob, types.SimpleNamespace(max_turns=1, browser_pool_size=3), None) == 3
    with pytest.raises(ValueError, match=r"browser_pool_size 3: one Chrome page per episode"):
        resolve_max_sessions(miniwob, types.SimpleNamespace(max_turns=1, browser_pool_size=3), 4)
