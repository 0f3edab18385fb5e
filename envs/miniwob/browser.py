"""MiniWoB++ pages in headless Chromium (Farama's `miniwob` 1.1.0, through Selenium and ChromeDriver), pooled.

- `Page`: one persistent headless Chrome showing one task's page. `start(seed)` begins an episode of that seed with
  the in-page timer disabled; `click(x_px, y_px)` and `type_text(text)` act; `screen()` reads the screenshot
  (160x210 RGB, the task area with its 50-px instruction bar on top), the instruction and the DOM elements;
  `outcome()` reads whether the episode ended and its raw reward.
- `BrowserPool`: Chrome instances kept alive across episodes (starting one takes seconds), at most `size` of them;
  `lease(task)` lends one showing `task`, `give_back` returns it (a broken one is closed instead). They are quit at
  exit (atexit): env-serve exits cleanly on SIGINT (Ctrl-C) and SIGTERM; SIGKILL (and SIGINT to a server that bash
  started with `&`, which ignores it) leaves ChromeDriver and Chrome running.

Why the timer: every MiniWoB page ends its episode with -1 after `core.EPISODE_MAX_TIME` (10 s), and scales its
reward down with elapsed time. A model generating on a CPU takes longer than that per turn, so the limit is raised
to `NO_TIME_LIMIT_MS` before every episode starts (`core.startEpisodeReal` reads it) and only the raw reward
(`WOB_RAW_REWARD_GLOBAL`, not time-scaled) is used.

Chrome and ChromeDriver: `MINIWOB_CHROME_BINARY` and `MINIWOB_CHROMEDRIVER` (read by miniwob's
`SeleniumInstance.create_driver`, both or neither) default here to Debian's `/usr/bin/chromium` and
`/usr/bin/chromedriver` when those exist; unset, Selenium Manager would try a download.

`miniwob` (and selenium) are imported on first use, so `import envs.miniwob` works without them, and the error names
the package to install. No jax.
"""

from __future__ import annotations

import atexit
import dataclasses
import importlib
import logging
import os
import threading
import time
from typing import Any

import numpy as np
from PIL import Image

logger = logging.getLogger(__name__)

MINIWOB_REQUIREMENT = "miniwob==1.1.0"
#: Debian's chromium and its version-matched driver (`apt-get install chromium chromium-driver`).
DEFAULT_CHROME_BINARY = "/usr/bin/chromium"
DEFAULT_CHROMEDRIVER = "/usr/bin/chromedriver"
#: The episode time limit set before each episode, in ms: ~11.6 days, below setTimeout's 2**31-1 ms (a longer delay
#: overflows and fires at once).
NO_TIME_LIMIT_MS = 1_000_000_000
#: The task area MiniWoB screenshots and clicks in, in CSS pixels (miniwob.constants.TASK_WIDTH/HEIGHT).
TASK_WIDTH, TASK_HEIGHT = 160, 210


class BrowserError(RuntimeError):
    """Chrome, ChromeDriver or the page failed; the message says which and what to do."""


def _miniwob() -> tuple[Any, Any]:
    """(miniwob.environment.MiniWoBEnvironment, miniwob.selenium_actions), imported on first use."""
    for var, default in (("MINIWOB_CHROME_BINARY", DEFAULT_CHROME_BINARY),
                         ("MINIWOB_CHROMEDRIVER", DEFAULT_CHROMEDRIVER)):
        if not os.environ.get(var) and os.path.exists(default):
            os.environ[var] = default
    try:
        environment = importlib.import_module("miniwob.environment")
        actions = importlib.import_module("miniwob.selenium_actions")
    except ImportError as e:
        raise ImportError(f"envs.miniwob needs the miniwob package ({e}); install it: pip install -e '.[miniwob]' "
                          f"(or pip install '{MINIWOB_REQUIREMENT}'), plus chromium and chromium-driver") from e
    return environment.MiniWoBEnvironment, actions


@dataclasses.dataclass(frozen=True)
class Element:
    """One DOM element of the task page; geometry in task-area CSS pixels."""

    ref: int
    tag: str
    text: str
    id: str
    left: float
    top: float
    width: float
    height: float
    value: str = ""  # a text field's content

    @property
    def center(self) -> tuple[float, float]:
        return self.left + self.width / 2, self.top + self.height / 2


@dataclasses.dataclass(frozen=True)
class Screen:
    """What the page shows: the instruction, the screenshot (TASK_WIDTH x TASK_HEIGHT RGB) and the DOM elements."""

    utterance: str
    screenshot: Image.Image
    elements: tuple[Element, ...]


@dataclasses.dataclass(frozen=True)
class Outcome:
    """Whether the page's episode ended, and its raw (not time-scaled) reward: 1 success, -1 failure, 0 unfinished."""

    done: bool
    raw_reward: float
    reason: str | None = None


def _element(raw: dict[str, Any]) -> Element:
    def number(key: str) -> float:
        return float(np.asarray(raw[key]).reshape(-1)[0])

    value = raw.get("value")
    return Element(int(raw["ref"]), str(raw["tag"]), str(raw.get("text") or ""), str(raw.get("id") or ""),
                   number("left"), number("top"), number("width"), number("height"),
                   "" if value is None or isinstance(value, bool) else str(value))


class Page:
    """One headless Chrome showing MiniWoB task `task` (see the module docstring)."""

    def __init__(self, task: str) -> None:
        environment_cls, self._actions = _miniwob()
        self.task = task
        try:
            self._env = environment_cls(subdomain=task)
        except Exception as e:  # selenium's and miniwob's start-up errors share no base class
            raise BrowserError(f"miniwob: cannot start Chrome for {task!r} ({type(e).__name__}: {e}); check "
                               "MINIWOB_CHROME_BINARY / MINIWOB_CHROMEDRIVER (chromium and chromium-driver of the "
                               "same version)") from e
        self.episodes = 0
        self.broken = False

    @property
    def _driver(self) -> Any:
        return self._env.instance.driver

    def start(self, seed: int) -> Screen:
        """Begin the episode of `seed` (the page draws it with `Math.seedrandom(seed)`), timer disabled."""
        self._driver.execute_script(f"core.EPISODE_MAX_TIME = {NO_TIME_LIMIT_MS};")
        observation, _ = self._env.reset(seed=int(seed))
        self.episodes += 1
        return self._screen(observation)

    def screen(self) -> Screen:
        observation, _ = self._env.instance.get_observation(use_cached_fields=True)
        return self._screen(observation)

    @staticmethod
    def _screen(observation: dict[str, Any]) -> Screen:
        return Screen(str(observation["utterance"]), Image.fromarray(np.asarray(observation["screenshot"], np.uint8)),
                      tuple(_element(e) for e in observation["dom_elements"]))

    def click(self, x_px: float, y_px: float) -> None:
        """A left click at task-area pixel (x_px, y_px)."""
        self._actions.execute_click_coords(float(x_px), float(y_px), self._driver)

    def type_text(self, text: str) -> None:
        """Type `text` into the focused element."""
        self._actions.execute_type_text(text, self._driver)

    def outcome(self) -> Outcome:
        meta = self._env.instance.get_metadata()
        raw = meta.get("raw_reward") if meta.get("done") else 0.0
        return Outcome(bool(meta.get("done")), float(raw or 0.0), None if meta.get("reason") is None else str(meta["reason"]))

    def close(self) -> None:
        try:
            self._env.close()
        except Exception as e:  # the driver may be dead already; closing is best effort, but never silent
            logger.warning("miniwob: closing Chrome for %r raised %s: %s", self.task, type(e).__name__, e)


class BrowserPool:
    """At most `size` persistent Chrome pages, lent one per episode (thread-safe: env hooks run in worker threads).

    `lease(task)` returns an idle page of `task`, else starts one (closing an idle page of another task when the
    pool is full), else waits up to `wait_s` for one to come back; `give_back(page)` returns it (a page marked
    `broken`, or a pool that is closed, closes it).

    Serve at most `size` sessions (env-serve holds that many by default and refuses more: the env's
    `session_capacity`): env-serve runs sync hooks on asyncio's default executor (a few threads), so sessions waiting
    here for a page would hold the threads that the sessions holding the pages need to finish; the short `wait_s`
    bounds that, and past the session cap the client's CAPACITY_REACHED retries do the queueing.
    """

    def __init__(self, size: int, wait_s: float = 10.0) -> None:
        if size < 1:
            raise ValueError(f"BrowserPool: size must be >= 1, got {size}")
        self.size, self.wait_s = size, wait_s
        self._idle: list[Page] = []
        self._live = 0
        self._cond = threading.Condition()
        self.started = 0

    def lease(self, task: str) -> Page:
        deadline = time.monotonic() + self.wait_s
        with self._cond:
            while True:
                for k, page in enumerate(self._idle):
                    if page.task == task:
                        return self._idle.pop(k)
                evict = None
                if self._live >= self.size and self._idle:
                    evict = self._idle.pop(0)
                    self._live -= 1
                if self._live < self.size:
                    self._live += 1  # reserved; the start runs outside the lock
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    raise BrowserError(f"miniwob: all {self.size} Chrome pages busy for {self.wait_s:g} s: serve at "
                                       "most browser_pool_size sessions (env-serve --max-sessions)")
                self._cond.wait(left)
        if evict is not None:
            evict.close()
        try:
            page = Page(task)
        except BaseException:
            with self._cond:
                self._live -= 1
                self._cond.notify()
            raise
        self.started += 1
        return page

    def give_back(self, page: Page) -> None:
        with self._cond:
            if not page.broken:
                self._idle.append(page)
                self._cond.notify()
                return
            self._live -= 1
            self._cond.notify()
        page.close()

    def close(self) -> None:
        with self._cond:
            idle, self._idle = self._idle, []
            self._live -= len(idle)
        for page in idle:
            page.close()


_POOLS: dict[int, BrowserPool] = {}
_POOLS_LOCK = threading.Lock()


def shared_pool(size: int) -> BrowserPool:
    """The process's pool of `size` pages (one per size; env-serve builds every env with the same options)."""
    with _POOLS_LOCK:
        pool = _POOLS.get(size)
        if pool is None:
            pool = _POOLS[size] = BrowserPool(size)
        return pool


@atexit.register
def _close_pools() -> None:
    """Quit every pooled Chrome when the process exits (ChromeDriver's children would outlive it otherwise)."""
    with _POOLS_LOCK:
        pools = list(_POOLS.values())
        _POOLS.clear()
    for pool in pools:
        pool.close()
