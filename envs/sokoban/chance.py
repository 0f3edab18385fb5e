"""`python -m envs.sokoban.chance`: the Sokoban task's chance, best-blind and solver rewards, printed (exact, by
enumeration; `grading`). No jax."""

from __future__ import annotations

import argparse

from envs.sokoban.env import SokobanOptions
from envs.sokoban.grading import best_blind_reward, chance_reward, optimal_reward
from envs.sokoban.synthetic import level_for


def main(argv: list[str] | None = None) -> int:
    """Print chance, best-blind and solver rewards on generated levels (default: configs/sokoban_tiny.yaml's
    held-out set: seed 1235, 64 levels, 4 turns)."""
    p = argparse.ArgumentParser(prog="python -m envs.sokoban.chance", description=main.__doc__.split("\n")[0])
    p.add_argument("--seed", type=int, default=1235)
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--max-turns", type=int, default=4)
    ns = p.parse_args(argv)
    options = SokobanOptions()
    pairs = [level_for(i, ns.seed) for i in range(ns.rows)]
    levels = [level for level, _ in pairs]
    best, seq = best_blind_reward(levels, ns.max_turns, options)
    print(f"sokoban (seed {ns.seed}, {ns.rows} levels, {ns.max_turns} turns): chance "
          f"{chance_reward(levels, ns.max_turns, options):.3f}, best blind {best:.3f} ({' '.join(seq)}), solver "
          f"{optimal_reward([m for _, m in pairs], options):.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
