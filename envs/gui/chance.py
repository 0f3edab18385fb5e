"""`python -m envs.gui.chance`: the GUI task's chance, best-blind and scripted rewards, printed (simulations;
`grading`). No jax."""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np

from envs.gui.env import GuiEnv
from envs.gui.grading import best_blind_clicks, random_policy, simulate
from envs.gui.synthetic import solution, task_for


def main(argv: list[str] | None = None) -> int:
    """Print chance, best-blind and scripted rewards on generated tasks (default: configs/gui_tiny.yaml's held-out
    set: seed 1235, 32 tasks, 3 turns)."""
    p = argparse.ArgumentParser(prog="python -m envs.gui.chance", description=main.__doc__.split("\n")[0])
    p.add_argument("--seed", type=int, default=1235)
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--max-turns", type=int, default=3)
    p.add_argument("--grid", type=int, default=10)
    ns = p.parse_args(argv)

    def make() -> list[Any]:
        return [GuiEnv(*task_for(i, ns.seed)[:2], max_turns=ns.max_turns) for i in range(ns.rows)]

    scripted = []
    for env in make():
        for action in solution(env):
            env.step(action)
        scripted.append(env.verdict())
    blind, seq = best_blind_clicks(make, ns.grid)
    print(f"gui (seed {ns.seed}, {ns.rows} tasks, {ns.max_turns} turns): chance {simulate(make, random_policy):.3f}, "
          f"best blind (greedy open-loop, {ns.grid}x{ns.grid} grid) {blind:.3f}, scripted {np.mean(scripted):.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
