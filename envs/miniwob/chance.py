"""`python -m envs.miniwob.chance`: chance and best blind with a budget of one click per episode.

- By default, exact figures for `click-test` from its page generator (`click-test.html`: a square button of side
  w = randi(35, 100), i.e. 35..99 px, at margins L, U = randi(0, 158 - w) inside the 160-px task area under the
  50-px instruction bar), no browser: a uniformly random click (x, y uniform over 0..1000, the whole 160x210
  screenshot) and the best single fixed click (a blind policy: the same point on every page), searched over the
  whole pixel grid.
- `--chromium`: measured in real Chromium on the held-out pages (dataset seed 1235, the tiny config's), for every
  task: random clicks, one fixed click at the task area's centre, and the scripted solution. Each episode is a
  `MiniWoBEnv` with max_turns 1: success means the page's raw reward is positive.

No jax (and no browser without `--chromium`)."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence

import numpy as np

from envs.miniwob.browser import TASK_HEIGHT, TASK_WIDTH, BrowserPool, Screen
from envs.miniwob.env import MiniWoBEnv
from envs.miniwob.synthetic import page_seed
from envs.miniwob.tasks import COORD_MAX, TASKS, scripted_reply, to_normalized

Policy = Callable[[str, Screen, np.random.Generator], str]
#: The top of click-test's task area (under the instruction bar), and its side, in task pixels.
AREA_TOP, AREA_SIDE = 50, 160
#: The centre of the 160x160 task area, in task pixels.
BLIND_POINT_PX = (80.0, 130.0)


def _hit_table(points_px: np.ndarray, offset: int) -> np.ndarray:
    """[w, p]: the probability that the button of side w (35..99) covers coordinate `points_px[p]` on one axis,
    over its uniform margin L in 0..158-w, the button spanning [offset + L, offset + L + w) (half-open pixels)."""
    table = np.zeros((100, len(points_px)))
    for w in range(35, 100):
        starts = offset + np.arange(0, AREA_SIDE - 2 - w + 1)  # randi(0, 160 - w - 2) = floor(r * (158 - w))
        inside = (points_px[None, :] >= starts[:, None]) & (points_px[None, :] < starts[:, None] + w)
        table[w] = inside.mean(axis=0)
    return table[35:]


def click_test_exact() -> tuple[float, float, tuple[int, int]]:
    """(random click success, best fixed click success, that click in 0-1000 coordinates) on `click-test`."""
    grid = np.arange(COORD_MAX + 1)
    x_px = np.floor(grid * TASK_WIDTH / COORD_MAX)  # WebDriver pointer moves are whole CSS pixels
    y_px = np.floor(np.minimum(grid * TASK_HEIGHT / COORD_MAX, TASK_HEIGHT - 0.5))
    x_px = np.minimum(x_px, TASK_WIDTH - 1)
    px, py = _hit_table(x_px, 0), _hit_table(y_px, AREA_TOP)  # [w, 1001] each; w uniform over 65 sides
    random = float(np.mean(px.mean(axis=1) * py.mean(axis=1)))
    fixed = px.T @ py / px.shape[0]  # [x, y]: success of always clicking (x, y)
    bx, by = np.unravel_index(int(np.argmax(fixed)), fixed.shape)
    return random, float(fixed[bx, by]), (int(bx), int(by))


def random_click(task: str, screen: Screen, rng: np.random.Generator) -> str:
    return f"click({int(rng.integers(COORD_MAX + 1))}, {int(rng.integers(COORD_MAX + 1))})"


def blind_click(task: str, screen: Screen, rng: np.random.Generator) -> str:
    return "click({}, {})".format(*to_normalized(*BLIND_POINT_PX))


def scripted(task: str, screen: Screen, rng: np.random.Generator) -> str:
    return scripted_reply(task, screen)


POLICIES: dict[str, Policy] = {"random": random_click, "blind centre": blind_click, "scripted": scripted}


def success_rate(task: str, seeds: Sequence[int], policy: Policy, pool: BrowserPool, rng_seed: int = 0) -> float:
    """Fraction of the pages `seeds` of `task` where `policy`'s one click succeeds (raw reward > 0), in Chromium."""

    successes = 0
    for seed in seeds:
        env = MiniWoBEnv(task, seed, max_turns=1, pool=pool)
        try:
            env.reset()
            assert env.screen is not None
            env.step(policy(task, env.screen, np.random.default_rng([rng_seed, seed])))
            successes += int(env.success)
        finally:
            env.close()
    return successes / len(seeds)


def main(argv: list[str] | None = None) -> int:
    """Print click-test's exact chance and best blind click; with --chromium, each policy's success rate per task
    measured in Chromium (default: the tiny config's held-out pages, dataset seed 1235, 200 of them)."""
    p = argparse.ArgumentParser(prog="python -m envs.miniwob.chance", description=main.__doc__.split(";")[0])
    p.add_argument("--chromium", action="store_true", help="measure in real Chromium (needs the miniwob extra)")
    p.add_argument("--seed", type=int, default=1235, help="dataset seed of the pages (envs.miniwob.synthetic)")
    p.add_argument("--rows", type=int, default=200)
    p.add_argument("--task", choices=TASKS, action="append", help="tasks to measure (default: all)")
    ns = p.parse_args(argv)
    if not ns.chromium:
        random, best, (bx, by) = click_test_exact()
        print(f"click-test, one click (exact, from the page generator): random clicks succeed {random:.3f}, the best "
              f"fixed blind click (click({bx}, {by})) {best:.3f}.")
        return 0

    seeds = [page_seed(ns.seed, i) for i in range(ns.rows)]
    pool = BrowserPool(1)
    try:
        for task in ns.task or TASKS:
            rates = {name: success_rate(task, seeds, policy, pool) for name, policy in POLICIES.items()}
            print(f"{task} (seed {ns.seed}, {ns.rows} pages, one click each, Chromium): "
                  + ", ".join(f"{name} {rate:.3f}" for name, rate in rates.items()))
    finally:
        pool.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
