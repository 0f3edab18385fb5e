"""`python -m envs.babyai.chance`: the success rates of uniformly random actions and of the oracle bot on each
BabyAI level, measured over world seeds (a simulation; the figures are in the env's docs). No jax."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from envs.babyai.world import ACTIONS, LEVELS, episode_seed, new_world, oracle_actions


def random_success(level: str, seeds: Sequence[int], max_turns: int, rng_seed: int = 0) -> tuple[float, float]:
    """(success rate, mean BabyAI reward) of a policy that names one of the 7 actions uniformly at random each turn,
    for at most `max_turns` turns, over worlds `seeds`. Every random reply is a valid action, so the episode is
    BabyAI's own steps, played here on the world without pictures."""
    successes, rewards = 0, 0.0
    for seed in seeds:
        world = new_world(level, seed)
        rng = np.random.default_rng([rng_seed, seed])
        for _ in range(max_turns):
            _, reward, terminated, truncated, _ = world.step(int(rng.integers(len(ACTIONS))))
            if terminated or truncated:
                if terminated and reward > 0:
                    successes, rewards = successes + 1, rewards + float(reward)
                break
    return successes / len(seeds), rewards / len(seeds)


def oracle_lengths(level: str, seeds: Sequence[int]) -> list[int]:
    """The oracle bot's number of actions on each world (`oracle_actions` raises if it ever fails)."""
    return [len(oracle_actions(level, seed)) for seed in seeds]


def dump_success(path: str) -> tuple[float, int]:
    """(success rate, episodes) of a rollout or eval dump (`jaxrl-vlm eval --dump-dir`, `jaxrl-vlm rollout --dump`)
    of this task. An episode succeeded iff its reward is > 0: success earns at least 1 - 0.9 * 8 / 64 within 8 turns
    and the invalid penalties of the turns before it cost at most 0.1 each, so a success stays above 0 and every
    other episode is at or below it (with max_turns <= 8 and the default penalty)."""
    lines = Path(path).read_text(encoding="utf-8").split("\n")  # not splitlines(): U+2028 may sit inside a string
    rewards = [json.loads(line)["reward"] for line in lines if line.strip()]
    if not rewards:
        raise ValueError(f"{path}: no episodes")
    return sum(r > 0 for r in rewards) / len(rewards), len(rewards)


def main(argv: list[str] | None = None) -> int:
    """Print random and oracle success rates per level (default: configs/babyai_tiny.yaml's held-out worlds, seed 1235,
    64 of them, 8 turns)."""
    p = argparse.ArgumentParser(prog="python -m envs.babyai.chance", description=main.__doc__.split("\n")[0])
    p.add_argument("--seed", type=int, default=1235, help="dataset seed of the worlds (envs.babyai.synthetic)")
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--max-turns", type=int, default=8)
    p.add_argument("--dump", help="instead: the success rate of this eval or rollout dump (a model's episodes)")
    ns = p.parse_args(argv)
    if ns.dump:
        rate, episodes = dump_success(ns.dump)
        print(f"{ns.dump}: {episodes} episodes, success {rate:.3f}")
        return 0
    seeds = [episode_seed(ns.seed, i) for i in range(ns.rows)]
    for level in LEVELS:
        success, reward = random_success(level, seeds, ns.max_turns)
        lengths = np.array(oracle_lengths(level, seeds))  # raises unless the bot succeeds in every world
        print(f"{level} (seed {ns.seed}, {ns.rows} worlds, {ns.max_turns} turns): random actions succeed "
              f"{success:.3f} (reward {reward:.3f}); the oracle bot {len(lengths) / len(seeds):.3f} "
              f"({np.mean(lengths):.2f} actions on "
              f"average, {np.mean(lengths <= ns.max_turns):.3f} within {ns.max_turns} turns).")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
