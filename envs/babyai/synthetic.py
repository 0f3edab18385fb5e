"""Synthetic BabyAI prompts and SFT transcripts of the oracle bot.

Rows have the Geometry3K layout the prompt loader reads (`problem`, `answer`, `images`, `params`): `problem` is the
question (no picture: the env's reset observation brings the first view and the mission), `answer` the JSON
`{"level": ..., "seed": s, "tile_px": p}` the env is built from. Row i's world seed is `world.episode_seed(seed, i)`,
so a row always plays the same world. `image_size` is the view picture's side in pixels (`tile_px` =
image_size // 7 per cell).

SFT transcripts (`make_sft_dataset`): prompt row i's opening (question, first view, mission, joined as the rollout
joins a reset observation to the prompt), then the oracle bot's actions, one per turn, each answered by the env's
own observation (the default options: the view in pictures and words); played through `BabyAIEnv`, which must end in
success.
Run `python -m envs.babyai.synthetic OUT --rows N --seed S [--level L] [--sft]`.

No jax; numpy, PIL, pyarrow, minigrid.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from envs.babyai.env import BabyAIEnv
from envs.babyai.prompts import QUESTION
from envs.babyai.world import (DEFAULT_LEVEL, DEFAULT_TILE_PX, LEVELS, VIEW_CELLS, check_level, episode_seed,
                               oracle_actions)
from envs.rows import write_rows
from envs.transcripts import transcript_row, write_transcripts

DEFAULT_IMAGE_SIZE = VIEW_CELLS * DEFAULT_TILE_PX  # 56 px: the tiny model's processor rounds it to 64, 4 image tokens


def tile_px_for(image_size: int) -> int:
    if not isinstance(image_size, int) or image_size < VIEW_CELLS:
        raise ValueError(f"babyai: image_size must be an int >= {VIEW_CELLS} (one pixel per cell), got {image_size!r}")
    return image_size // VIEW_CELLS


def generate_row(index: int, seed: int = 0, image_size: int = DEFAULT_IMAGE_SIZE,
                 level: str = DEFAULT_LEVEL) -> dict[str, Any]:
    world_seed = episode_seed(seed, index)
    label = {"level": check_level(level, "babyai make_dataset"), "seed": world_seed, "tile_px": tile_px_for(image_size)}
    return {"problem": QUESTION, "answer": json.dumps(label, sort_keys=True), "images": [],
            "params": json.dumps({"dataset_seed": seed, "index": index}, sort_keys=True)}


def make_dataset(out_path: str, num_rows: int, seed: int = 0, image_size: int = DEFAULT_IMAGE_SIZE,
                 level: str = DEFAULT_LEVEL) -> str:
    return write_rows(out_path, [generate_row(i, seed, image_size, level) for i in range(num_rows)])


def opening_message(question: str, opening: dict[str, Any]) -> dict[str, Any]:
    """The first user message of an episode: the prompt's question, then the reset observation's content (pictures,
    then its text on a line of its own), as the rollout joins them (`rollout.multiturn.prompt_with_opening`)."""
    items = list(opening["content"])
    if items and items[-1].get("type") == "text":
        items[-1] = {**items[-1], "text": "\n" + items[-1]["text"]}
    return {"role": "user", "content": [{"type": "text", "text": question}, *items]}


def generate_transcript(index: int, seed: int = 0, image_size: int = DEFAULT_IMAGE_SIZE,
                        level: str = DEFAULT_LEVEL) -> dict[str, Any]:
    """Transcript `index`: row `index`'s opening, then the oracle bot's actions with the env's observations."""
    world_seed = episode_seed(seed, index)
    actions = oracle_actions(level, world_seed)
    env = BabyAIEnv(level, world_seed, max_turns=len(actions), tile_px=tile_px_for(image_size))
    messages: list[dict[str, Any]] = [opening_message(QUESTION, env.format_observation(env.reset()))]
    done = False
    for action in actions:
        messages.append({"role": "assistant", "content": action})
        observation, done, _ = env.step(action)
        if not done:
            messages.append(env.format_observation(observation))
    if not (done and env.success):
        raise AssertionError(f"babyai transcript {index}: the oracle's actions did not succeed in {level} seed "
                             f"{world_seed} when replayed through BabyAIEnv")
    env.close()
    return transcript_row(messages, name=f"babyai_sft_s{seed}_{index:06d}",
                          params={"level": level, "seed": world_seed, "actions": actions, "reward": env.verdict()})


def make_sft_dataset(out_path: str, num_rows: int, seed: int = 0, image_size: int = DEFAULT_IMAGE_SIZE,
                     level: str = DEFAULT_LEVEL) -> str:
    return write_transcripts(out_path, [generate_transcript(i, seed, image_size, level) for i in range(num_rows)])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m envs.babyai.synthetic", description=__doc__.split("\n")[0])
    p.add_argument("out")
    p.add_argument("--rows", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--image-size", type=int, default=DEFAULT_IMAGE_SIZE)
    p.add_argument("--level", choices=LEVELS, default=DEFAULT_LEVEL)
    p.add_argument("--sft", action="store_true", help="SFT transcripts of the oracle bot instead of prompt rows")
    ns = p.parse_args(argv)
    make = make_sft_dataset if ns.sft else make_dataset
    print(f"wrote {make(ns.out, ns.rows, ns.seed, ns.image_size, ns.level)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
