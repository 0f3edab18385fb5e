"""Synthetic Sokoban prompts and SFT transcripts.

Rows have the Geometry3K layout the prompt loader reads (`problem` = "<image>" + question, `answer`, `images`,
`params`): `answer` is the JSON `{"level": <Level.to_json()>, "min_moves": k}` the env is built from, the picture
is the board. Row i depends only on (seed, i). The board is `BOARD_ROWS` x `BOARD_COLS` cells; `image_size` is the
picture's side in pixels (one cell is image_size // BOARD_COLS).

SFT transcripts (`make_sft_dataset`): prompt row i, then the solver's shortest solution, one move per turn, each
answered by the env's own observation (text and new board); played through `SokobanEnv`, which must end solved.
Run `python -m envs.sokoban.synthetic OUT --rows N --seed S [--sft]`.

No jax; numpy, PIL, pyarrow.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import numpy as np

from envs.color_reveal.images import png_bytes
from envs.sokoban.env import SokobanEnv
from envs.sokoban.levels import DIRECTIONS, Level, generate_level, render, solve
from envs.sokoban.prompts import QUESTION
from envs.rows import write_rows
from envs.transcripts import transcript_row, write_transcripts

BOARD_ROWS = BOARD_COLS = 6
INNER_WALLS = 1
MIN_MOVES, MAX_MOVES = 1, 3
DEFAULT_IMAGE_SIZE = 96  # 16 px cells: 9 image tokens for Qwen3-VL (patch 16, merge 2)


def level_for(index: int, seed: int = 0) -> tuple[Level, int]:
    return generate_level(seed, index, BOARD_ROWS, BOARD_COLS, 1, INNER_WALLS, MIN_MOVES, MAX_MOVES)


def generate_row(index: int, seed: int = 0, image_size: int = DEFAULT_IMAGE_SIZE) -> dict[str, Any]:
    level, min_moves = level_for(index, seed)
    image = render(level, max(image_size // BOARD_COLS, 1))
    return {
        "problem": "<image>" + QUESTION,
        "answer": json.dumps({"level": level.to_json(), "min_moves": min_moves}, sort_keys=True),
        "images": [{"bytes": png_bytes(image), "path": f"sokoban_s{seed}_{index:06d}.png"}],
        "params": json.dumps({"min_moves": min_moves, "solution": solve(level), "image_size": image_size}),
    }


def make_dataset(out_path: str, num_rows: int, seed: int = 0, image_size: int = DEFAULT_IMAGE_SIZE) -> str:
    return write_rows(out_path, [generate_row(i, seed, image_size) for i in range(num_rows)])


#: The one-push levels (`make_push_dataset`): a 5x5 board, the box in the middle of its 3x3 floor, the player on
#: one side of it and the target on the other, and maybe one wall in a corner of the floor.
PUSH_BOARD = 5
PUSH_IMAGE_SIZE = 64


def push_level(index: int, seed: int = 0) -> tuple[Level, str]:
    """One-push level `index` and its solving move; every block of 4 consecutive rows has each move once."""
    moves = list(DIRECTIONS)
    block = np.random.default_rng([seed, index // 4, 21]).permutation(4)
    move = moves[int(block[index % 4])]
    dr, dc = DIRECTIONS[move]
    rng = np.random.default_rng([seed, index, 22])
    n = PUSH_BOARD
    walls = {(r, c) for r in range(n) for c in range(n) if r in (0, n - 1) or c in (0, n - 1)}
    corner = int(rng.integers(5))
    if corner < 4:
        walls.add(((1, 1), (1, 3), (3, 1), (3, 3))[corner])
    level = Level(n, n, frozenset(walls), frozenset({(2 + dr, 2 + dc)}), frozenset({(2, 2)}), (2 - dr, 2 - dc))
    return level, move


def make_push_dataset(out_path: str, num_rows: int, seed: int = 0, image_size: int = PUSH_IMAGE_SIZE) -> str:
    """`num_rows` one-push levels (`push_level`) in the prompt layout: the learning test's data, where the picture
    alone says which move solves (the moves are balanced, so no blind policy does better than 1 in 4)."""
    rows = []
    for i in range(num_rows):
        level, move = push_level(i, seed)
        image = render(level, max(image_size // PUSH_BOARD, 1))
        rows.append({"problem": "<image>" + QUESTION,
                     "answer": json.dumps({"level": level.to_json(), "min_moves": 1}, sort_keys=True),
                     "images": [{"bytes": png_bytes(image), "path": f"sokoban_push_s{seed}_{i:06d}.png"}],
                     "params": json.dumps({"min_moves": 1, "solution": [move], "image_size": image_size})})
    return write_rows(out_path, rows)


def generate_transcript(index: int, seed: int = 0, image_size: int = DEFAULT_IMAGE_SIZE) -> dict[str, Any]:
    """Transcript `index`: prompt row `index`'s board, then the shortest solution with the env's observations."""
    level, min_moves = level_for(index, seed)
    cell = max(image_size // BOARD_COLS, 1)
    env = SokobanEnv(level, max_turns=min_moves, min_moves=min_moves, cell_px=cell)
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": [{"type": "image", "image": render(level, cell)}, {"type": "text", "text": QUESTION}]}]
    done = False
    for move in solve(level):
        messages.append({"role": "assistant", "content": move})
        observation, done, _ = env.step(move)
        if not done:
            messages.append(env.format_observation(observation))
    if not (done and env.level.solved()):
        raise AssertionError(f"sokoban transcript {index}: the solver's moves did not solve the level")
    return transcript_row(messages, name=f"sokoban_sft_s{seed}_{index:06d}",
                          params={"min_moves": min_moves, "reward": env.verdict()})


def make_sft_dataset(out_path: str, num_rows: int, seed: int = 0, image_size: int = DEFAULT_IMAGE_SIZE) -> str:
    return write_transcripts(out_path, [generate_transcript(i, seed, image_size) for i in range(num_rows)])


def make_push_sft_dataset(out_path: str, num_rows: int, seed: int = 0, image_size: int = PUSH_IMAGE_SIZE) -> str:
    """SFT transcripts of the one-push levels: row i's board and question, then its solving move, played through
    `SokobanEnv` (which must end solved)."""
    rows = []
    for i in range(num_rows):
        level, move = push_level(i, seed)
        image = render(level, max(image_size // PUSH_BOARD, 1))
        env = SokobanEnv(level, max_turns=1, min_moves=1)
        _, done, info = env.step(move)
        if not (done and info["solved"]):
            raise AssertionError(f"sokoban push transcript {i}: {move} did not solve the level")
        messages = [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": QUESTION}]},
                    {"role": "assistant", "content": move}]
        rows.append(transcript_row(messages, name=f"sokoban_push_sft_s{seed}_{i:06d}", params={"move": move}))
    return write_transcripts(out_path, rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m envs.sokoban.synthetic", description=__doc__.split("\n")[0])
    p.add_argument("out")
    p.add_argument("--rows", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--image-size", type=int, default=DEFAULT_IMAGE_SIZE)
    p.add_argument("--sft", action="store_true")
    p.add_argument("--push", action="store_true", help="one-push 5x5 levels (make_push_dataset)")
    ns = p.parse_args(argv)
    if ns.push:
        make = make_push_sft_dataset if ns.sft else make_push_dataset
    else:
        make = make_sft_dataset if ns.sft else make_dataset
    print(f"wrote {make(ns.out, ns.rows, ns.seed, ns.image_size)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
