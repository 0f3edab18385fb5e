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
