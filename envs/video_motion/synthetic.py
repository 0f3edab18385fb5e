"""Synthetic video-motion prompts: an empty prompt (the clip comes with reset's observation) and, as the answer, the
episode's hidden direction and seed.

Rows have the Geometry3K layout the prompt loader reads (`problem`, `answer`, `images`, plus a `params` column it
ignores), written by `envs.rows.write_rows`: `problem` is empty and `images` is an empty list, since the env makes
the clips at reset (`envs.video_motion.clips`), and `answer` is the JSON label `{"direction": "left" | "right",
"seed": S}` that `build_env` reads; the seed draws the square's row (top row uniform over 0..frame_size - side) and,
for the `shuffle_frames` ablation, the frame orders. `params` repeats the label with the row index. The frames'
size, count and rate are env options, not data, so the same file serves every clip setting and both arms of the
ablation.

Row i depends only on (seed, i): `generate_rows(n, s)[:k] == generate_rows(k, s)`. Each block of 2 consecutive rows
has each direction once (in a random order), so an unshuffled batch of an even number of prompts is balanced. The
training and held-out files are two calls with different seeds (`--make-data` uses --seed and --seed + 1); they
share the distribution, not the rows (there are only 2 x (frame_size - side + 1) distinct first clips, 50 at 32x32,
so a held-out set measures the policy off the training rows' batches, not generalization to unseen motions).

Run `python -m envs.video_motion.synthetic OUT --rows N --seed S`. No jax; numpy and pyarrow.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import numpy as np

from envs.rows import write_rows
from envs.video_motion.answers import DIRECTIONS

#: Episode seeds are drawn below this bound (non-negative int32, safe in every JSON and parquet reader).
SEED_BOUND = 2**31 - 1


def generate_row(index: int, seed: int = 0) -> dict[str, Any]:
    """Row `index` of the dataset for `seed` (depends only on the pair)."""
    block = np.random.default_rng([seed, index // len(DIRECTIONS), 0]).permutation(len(DIRECTIONS))
    direction = DIRECTIONS[int(block[index % len(DIRECTIONS)])]
    episode_seed = int(np.random.default_rng([seed, index, 1]).integers(SEED_BOUND))
    label = {"direction": direction, "seed": episode_seed}
    return {
        "problem": "",
        "answer": json.dumps(label, sort_keys=True),
        "images": [],
        "params": json.dumps({**label, "index": index, "dataset_seed": seed}, sort_keys=True),
    }


def generate_rows(num_rows: int, seed: int = 0) -> list[dict[str, Any]]:
    if not isinstance(num_rows, int) or isinstance(num_rows, bool) or num_rows < 0:
        raise ValueError(f"num_rows must be an int >= 0, got {num_rows!r}")
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise ValueError(f"seed must be an int >= 0, got {seed!r}")
    return [generate_row(i, seed) for i in range(num_rows)]


def make_dataset(out_path: str, num_rows: int, seed: int = 0, image_size: int | None = None) -> str:
    """Write `num_rows` rows to `out_path` (.parquet or .jsonl); return the path.

    `image_size` is accepted for `--make-data`'s call (`make_dataset(path, num_rows, seed=, image_size=)`) and not
    used: the rows carry no pictures, and the frames' size is the env's `frame_size` option.
    """
    del image_size
    return write_rows(out_path, generate_rows(num_rows, seed))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m envs.video_motion.synthetic", description=__doc__.split("\n")[0])
    p.add_argument("out", help="output .parquet or .jsonl")
    p.add_argument("--rows", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    ns = p.parse_args(argv)
    path = make_dataset(ns.out, ns.rows, ns.seed)
    print(f"wrote {ns.rows} video-motion rows to {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
