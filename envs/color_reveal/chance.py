"""`python -m envs.color_reveal.chance`: the color-reveal task's chance and best-blind rewards, printed (closed form;
`answers`). No jax."""

from __future__ import annotations

import argparse

from envs.color_reveal.answers import blind_elimination_reward, chance_reward
from envs.color_reveal.env import ColorRevealOptions


def main(argv: list[str] | None = None) -> int:
    """Print chance and best-blind rewards (default: configs/color_reveal_tiny.yaml's 2 turns and the env's default
    turn_discount)."""
    p = argparse.ArgumentParser(prog="python -m envs.color_reveal.chance", description=main.__doc__.split("\n")[0])
    p.add_argument("--max-turns", type=int, default=2)
    p.add_argument("--turn-discount", type=float, default=ColorRevealOptions().turn_discount)
    ns = p.parse_args(argv)
    print(f"color_reveal ({ns.max_turns} turns, turn_discount {ns.turn_discount:g}): chance "
          f"{chance_reward(ns.max_turns, ns.turn_discount):.3f}, best blind (a different color each turn) "
          f"{blind_elimination_reward(ns.max_turns, ns.turn_discount):.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
