"""The BabyAI worlds (Farama's `minigrid`): the levels, the action words, one reproducible level per seed, the
agent's view as a picture, and the oracle bot's actions.

`minigrid` is imported on first use (`_minigrid`), so `import envs.babyai` works without it (the docs' env list
imports every env) and the error names the package to install.

No jax; numpy, PIL and minigrid.
"""

from __future__ import annotations

import importlib
import os
from typing import Any

import numpy as np
from PIL import Image

#: The levels this task plays, by their gymnasium ids: one object in an empty 8x8 room (GoToObj), or the target
#: among 8 distractors (GoToLocal). Both succeed when the agent faces the named object.
LEVELS: tuple[str, ...] = ("BabyAI-GoToObj-v0", "BabyAI-GoToLocal-v0")
DEFAULT_LEVEL = LEVELS[0]
#: The action words in minigrid's order: ACTIONS[i] is `minigrid.core.actions.Actions(i)`.
ACTIONS: tuple[str, ...] = ("left", "right", "forward", "pickup", "drop", "toggle", "done")
#: The agent's view is VIEW_CELLS x VIEW_CELLS cells (minigrid's default agent_view_size).
VIEW_CELLS = 7
#: Pixels per cell of the view picture: 56 px a side, which the tiny model's processor (64-128 px, patch 16, merge 2)
#: rounds to 64: 4 image tokens.
DEFAULT_TILE_PX = 8
MINIGRID_REQUIREMENT = "minigrid==3.2.0"


def _minigrid() -> tuple[Any, Any]:
    """(gymnasium, minigrid.utils.baby_ai_bot.BabyAIBot), imported on first use."""
    # pygame (a minigrid dependency) prints a banner to stdout on import; the chance figures are read from stdout.
    os.environ.setdefault("PYGAME_HIDE_SUPPORT_PROMPT", "1")
    try:
        gym = importlib.import_module("gymnasium")
        importlib.import_module("minigrid")  # registers the BabyAI-* ids with gymnasium
        bot = importlib.import_module("minigrid.utils.baby_ai_bot")
        levels = importlib.import_module("minigrid.envs.babyai.core.roomgrid_level")
    except ImportError as e:
        raise ImportError(f"envs.babyai needs the minigrid package ({e}); install it: pip install "
                          f"'{MINIGRID_REQUIREMENT}'") from e
    # Level generation prints every rejected draw ("Sampling rejected: ...") to stdout, which carries the chance
    # figures the docs generator reads; a module-level `print` silences that module alone (redirecting sys.stdout
    # is not thread-safe, and resets run in worker threads).
    levels.print = _quiet
    return gym, bot.BabyAIBot


def _quiet(*_args: Any, **_kwargs: Any) -> None:
    """Stands in for `print` inside minigrid's level generation (see `_minigrid`)."""


def check_level(level: Any, where: str) -> str:
    if level not in LEVELS:
        raise ValueError(f"{where}: level {level!r} is not one of {', '.join(LEVELS)}")
    return level


def new_world(level: str, seed: int) -> Any:
    """The minigrid env of `level` (unwrapped: the bot reads its grid), reset with `seed`: the same seed gives the
    same room, objects, mission and start pose."""
    gym, _ = _minigrid()
    world = gym.make(check_level(level, "babyai"), disable_env_checker=True).unwrapped
    world.reset(seed=int(seed))
    return world


def view(world: Any, tile_px: int = DEFAULT_TILE_PX) -> Image.Image:
    """The agent's partial view (VIEW_CELLS x VIEW_CELLS cells, the agent at the bottom centre facing up) as an
    RGB picture of VIEW_CELLS * tile_px pixels a side. Cells hidden behind walls are black."""
    pixels = world.get_frame(highlight=False, tile_size=int(tile_px), agent_pov=True)
    return Image.fromarray(np.asarray(pixels, dtype=np.uint8), "RGB")


def describe_view(world: Any) -> str:
    """The agent's view in words, BALROG-style relative positions: every object it sees ("a red box 2 ahead and 1
    left"), nearest first, and the distance to the wall straight ahead ("Wall 3 ahead."). It reads the same partial
    observation (`gen_obs`) the picture draws, so it tells no more than the picture: what is in the 7x7 cells the
    agent sees. "ahead" counts cells forward from the agent, "left"/"right" cells sideways."""
    constants = importlib.import_module("minigrid.core.constants")
    cells = world.gen_obs()["image"]  # [x, y, (type, color, state)]: the agent at (VIEW_CELLS // 2, VIEW_CELLS - 1)
    me_x, me_y = VIEW_CELLS // 2, VIEW_CELLS - 1
    seen: list[tuple[int, str]] = []
    for x in range(VIEW_CELLS):
        for y in range(VIEW_CELLS):
            kind = constants.IDX_TO_OBJECT[int(cells[x, y, 0])]
            if kind in ("unseen", "empty", "wall", "floor", "agent") or (x, y) == (me_x, me_y):
                continue
            ahead, side = me_y - y, x - me_x
            where = [f"{ahead} ahead"] if ahead else []
            if side:
                where.append(f"{abs(side)} {'right' if side > 0 else 'left'}")
            seen.append((ahead + abs(side), f"a {constants.IDX_TO_COLOR[int(cells[x, y, 1])]} {kind} "
                                            f"{' and '.join(where)}"))
    text = "You see " + ", ".join(words for _, words in sorted(seen)) + "." if seen else "You see no object."
    for ahead in range(1, VIEW_CELLS):
        if constants.IDX_TO_OBJECT[int(cells[me_x, me_y - ahead, 0])] in ("wall", "unseen"):
            return f"{text} Wall {ahead} ahead."
    return text


def oracle_actions(level: str, seed: int, limit: int = 256) -> list[str]:
    """The oracle bot's (minigrid's `BabyAIBot`) actions for `level` with `seed`, played on a world of its own until
    the mission succeeds; a ValueError if it does not within `limit` actions."""
    _, bot_cls = _minigrid()
    world = new_world(level, seed)
    bot = bot_cls(world)
    actions: list[str] = []
    for _ in range(limit):
        action = int(bot.replan())
        actions.append(ACTIONS[action])
        _, reward, terminated, truncated, _ = world.step(action)
        if terminated or truncated:
            if terminated and reward > 0:
                return actions
            break
    raise ValueError(f"babyai: the oracle bot did not solve {level} seed {seed} in {len(actions)} actions")


def episode_seed(seed: int, index: int) -> int:
    """The world seed of row `index` of a dataset made with `seed` (distinct datasets' seeds do not collide)."""
    return int(np.random.SeedSequence([int(seed), int(index), 53]).generate_state(1)[0] & 0x7FFFFFFF)
