"""`python -m envs.video_motion.chance`: the video-motion task's chance and best-blind rewards, printed (closed form;
`answers`). No jax."""

from __future__ import annotations

import argparse

from envs.video_motion.answers import BEST_BLIND_REWARD, chance_reward, letter_shares
from envs.video_motion.env import VideoMotionOptions


def figures(max_turns: int, turn_discount: float) -> dict[str, float]:
    """The printed figures: chance with replies uniform over left/right/slow, chance with uniform first letters, the
    best blind policy (answer at once) and a policy that reads the first clip."""
    shares = letter_shares()
    return {
        "chance": chance_reward(max_turns, turn_discount),
        "chance_letters": chance_reward(max_turns, turn_discount, shares["left"], shares["right"], shares["slow"]),
        "best_blind": BEST_BLIND_REWARD,
        "reading": 1.0,
    }


def main(argv: list[str] | None = None) -> int:
    """Print chance and best-blind rewards (default: configs/video_motion_tiny.yaml's 2 turns and the env's default
    turn_discount)."""
    p = argparse.ArgumentParser(prog="python -m envs.video_motion.chance", description=main.__doc__.split("\n")[0])
    p.add_argument("--max-turns", type=int, default=2)
    p.add_argument("--turn-discount", type=float, default=VideoMotionOptions().turn_discount)
    ns = p.parse_args(argv)
    f = figures(ns.max_turns, ns.turn_discount)
    print(f"video_motion ({ns.max_turns} turns, turn_discount {ns.turn_discount:g}): chance {f['chance']:.3f} "
          f"(replies uniform over left/right/slow; uniform first letters {f['chance_letters']:.3f}), best blind "
          f"(answer at once) {f['best_blind']:.3f}, reading the first clip {f['reading']:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
