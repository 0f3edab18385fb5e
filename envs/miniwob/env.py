"""The MiniWoB++ environment: a real web task in headless Chromium, one action per model turn, a new screenshot after
every action. It runs behind `jaxrl-vlm env-serve envs.miniwob` (its own process, with a pool of persistent Chrome
instances), never in the trainer's process: the trainer plays it with `env_url`.

Episode (`MiniWoBEnv`, options `MiniWoBOptions`):

- The row names a task (`tasks.TASKS`) and a page seed (`synthetic`); `reset()` leases a Chrome page of that task from
  the process's pool, begins the episode of that seed with the in-page 10-s timer disabled (`browser`), and opens the
  episode with the screenshot (160x210, the instruction bar on top) and the instruction as text
  ("Instruction: Click the button."). The same seed draws the same page.
- Each model turn is one action, read by `envs.gui.grading.parse_action`: `click(x, y)` (Qwen-VL coordinates,
  integers 0-1000 relative to the screenshot; `tasks.to_pixels`) or `type("text")` (into the focused element), as a
  `<tool_call>` or as a text call.
- A valid action runs in the page; unless the episode ended, it is answered with the new screenshot and a text that
  only says which action ran (role "tool" for a `<tool_call>`, "user" otherwise). A turn without a valid action
  (documented policy: a penalty turn, never an exception) leaves the page as it is, costs `invalid_penalty` and is
  answered with the error and the unchanged screenshot; the episode goes on.
- Done when the page ends its episode (its own JavaScript decides: a success, or a wrong button), or after
  `max_turns`. Reward (`verdict()`): the page's raw reward (1 success, -1 a wrong button, 0 unfinished; never
  scaled by time) minus `invalid_penalty` per invalid turn.

Chance (`python -m envs.miniwob.chance`, real Chromium, one click per episode, the tiny config's held-out pages,
dataset seed 1235): see docs/benchmarks.md and docs/guides/agent-tasks.md.

No jax; PIL, and miniwob/selenium on first use (`browser`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from envs.actions import ActionError
from envs.base import BaseInteractionEnv, EnvOptions, SessionCapacity, option, require_max_turns, sample_where
from envs.gui.grading import Click, Type, parse_action
from envs.miniwob.browser import BrowserError, BrowserPool, Page, Screen, shared_pool
from envs.miniwob.tasks import TASKS, check_task, to_pixels

SUCCESS_TEXT = "Task complete."
FAILURE_TEXT = "Task failed."
OUT_OF_TURNS_TEXT = "No actions left."


@dataclass(frozen=True)
class MiniWoBOptions(EnvOptions):
    """The miniwob env's `--custom-config-path` keys (the env-serve process reads them)."""

    ENV_NAME = "miniwob"

    task: str | None = option(
        None, f"miniwob: the MiniWoB++ task every episode plays ({', '.join(TASKS)}), with each row's page seed; None "
        "plays each row's own task.")
    invalid_penalty: float = option(0.1, "miniwob: reward subtracted per turn without a valid action.", ge=0)
    browser_pool_size: int = option(
        8, "miniwob: persistent headless Chrome instances of the env-serve process (about 0.5 GB each); env-serve "
        "holds this many sessions at once by default and refuses a larger --max-sessions: the client's "
        "CAPACITY_REACHED retries queue the rest.", ge=1)

    def validate(self) -> None:
        if self.task is not None:
            check_task(self.task, "args.task")


CONFIG_KEYS: dict[str, tuple[type, Any, str]] = MiniWoBOptions.config_keys()


def opening_text(screen: Screen) -> str:
    return f"Instruction: {screen.utterance}"


class MiniWoBEnv(BaseInteractionEnv):
    """One MiniWoB episode (task, seed) on a pooled Chrome page: see the module docstring."""

    def __init__(self, task: str, seed: int, max_turns: int, options: MiniWoBOptions | None = None,
                 pool: BrowserPool | None = None):
        if not isinstance(max_turns, int) or max_turns < 1:
            raise ValueError(f"MiniWoBEnv: max_turns must be a positive int, got {max_turns!r}")
        self.task = check_task(task, "MiniWoBEnv")
        self.seed = int(seed)
        self.max_turns = max_turns
        self.options = MiniWoBOptions() if options is None else options
        self.pool = pool if pool is not None else shared_pool(self.options.browser_pool_size)
        self.page: Page | None = None
        self.screen: Screen | None = None
        self.closed = False
        self._clear()

    def _clear(self) -> None:
        self.turn = 0
        self.done = False
        self.invalid = 0
        self.success = False
        self.raw_reward = 0.0
        self.actions: list[Click | Type | None] = []

    def _in_page(self, what: str, fn: Any, *args: Any) -> Any:
        """`fn(*args)` on the page; a failure marks the page broken (the pool closes it) and names the task."""
        assert self.page is not None
        try:
            return fn(*args)
        except BrowserError:
            self.page.broken = True
            raise
        except Exception as e:  # selenium's errors (dead driver, lost window) share no base class with ours
            self.page.broken = True
            raise BrowserError(f"miniwob {self.task} seed {self.seed}: {what} failed in Chrome "
                               f"({type(e).__name__}: {e})") from e

    def reset(self) -> dict[str, Any]:
        """Lease a page (kept until close) and begin the seed's episode; returns the screenshot and instruction."""
        if self.closed:
            raise RuntimeError("MiniWoBEnv.reset called after close()")
        if self.page is None:
            self.page = self.pool.lease(self.task)
        self.screen = self._in_page("reset", self.page.start, self.seed)
        self._clear()
        return {"obs_str": opening_text(self.screen), "multi_modal_data": {"image": [self.screen.screenshot]},
                "role": "user"}

    def step(self, response_text: str) -> tuple[dict[str, Any], bool, dict[str, Any]]:
        self.check_step(response_text)
        if self.page is None or self.screen is None:
            raise RuntimeError("MiniWoBEnv.step called before reset(): reset() begins the episode")
        self.turn += 1
        action = parse_action(response_text)
        role = "tool" if action.tagged else "user"
        info: dict[str, Any] = {"turn": self.turn}
        if isinstance(action, ActionError):
            self.invalid += 1
            self.actions.append(None)
            info["invalid"] = action.message
            text = f"Invalid action: {action.message}."
        elif isinstance(action, Click):
            self.actions.append(action)
            x_px, y_px = to_pixels(action.x, action.y)
            self._in_page("click", self.page.click, x_px, y_px)
            info["click_x_px"], info["click_y_px"] = x_px, y_px
            text = f"Clicked ({action.x}, {action.y})."
        else:
            self.actions.append(action)
            self._in_page("type", self.page.type_text, action.text)
            text = f'Typed "{action.text}".'
        outcome = self._in_page("reading the outcome", self.page.outcome)
        if outcome.done:
            self.done = True
            self.raw_reward = outcome.raw_reward
            self.success = outcome.raw_reward > 0
            return ({"obs_str": SUCCESS_TEXT if self.success else FAILURE_TEXT, "role": role}, True,
                    {**info, "success": self.success, "raw_reward": outcome.raw_reward})
        if self.turn >= self.max_turns:
            self.done = True
            return {"obs_str": OUT_OF_TURNS_TEXT, "role": role}, True, {**info, "success": False, "raw_reward": 0.0}
        if not isinstance(action, ActionError):  # an invalid turn leaves the page as it was
            self.screen = self._in_page("screenshot", self.page.screen)
        return ({"obs_str": text + " The screen:", "role": role,
                 "multi_modal_data": {"image": [self.screen.screenshot]}}, False, info)

    def verdict(self) -> float:
        return self.raw_reward - self.options.invalid_penalty * self.invalid

    def close(self) -> None:
        self.closed = True
        page, self.page = self.page, None
        if page is not None:
            self.pool.give_back(page)


def parse_label(label: Any, where: str) -> tuple[str, int]:
    """(task, page seed) of a row's label, the JSON `{"task": ..., "seed": s}`."""
    try:
        data = json.loads(label)
        task, seed = data["task"], data["seed"]
    except (TypeError, ValueError, KeyError) as e:
        raise ValueError(f"miniwob build_env: {where} label is not a miniwob row ({type(e).__name__}: {e}); make the "
                         "data with envs.miniwob.synthetic") from e
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise ValueError(f"miniwob build_env: {where} label needs an int seed, got {seed!r}")
    return check_task(task, f"miniwob build_env: {where}"), seed


def session_capacity(args: Any) -> SessionCapacity:
    """One pooled Chrome page per episode: env-serve holds at most `browser_pool_size` sessions at once."""
    size = MiniWoBOptions.from_args(args).browser_pool_size
    return SessionCapacity(size, f"browser_pool_size {size}: one Chrome page per episode")


def build_env(sample: Any, args: Any) -> MiniWoBEnv:
    """A MiniWoBEnv for the row in `sample.label` (the `task` option, when set, replaces the row's task), on the
    process's browser pool. Refused inside a rollout (`args.rollout_context` is the trainer's): Chrome belongs in
    the env-serve process."""
    if getattr(args, "rollout_context", None) is not None:
        raise ValueError("miniwob build_env: MiniWoB runs behind env-serve, never in the trainer's process: start "
                         "`jaxrl-vlm env-serve envs.miniwob --max-turns N` and set env_url: ws://HOST:PORT/ws")
    task, seed = parse_label(getattr(sample, "label", None), sample_where(sample))
    options = MiniWoBOptions.from_args(args)
    return MiniWoBEnv(options.task or task, seed, require_max_turns(args, "miniwob"), options)
