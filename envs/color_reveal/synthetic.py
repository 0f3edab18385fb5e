"""Synthetic color-reveal prompts: a PIL picture of the card beside a decoy, and the card's color as the answer.

Rows have the Geometry3K layout the prompt loader reads (`problem` = "<image>" + question, `answer`,
`images` = [{"bytes": PNG, "path": name}]) plus a `params` JSON column (ignored by the loader) with what the
picture shows: `card`, `decoy`, `card_side` (0 left, 1 right), the two RGB shades, `image_size`, `blind`.

Row i depends only on (seed, i): `generate_rows(n, s)[:k] == generate_rows(k, s)`, and the blind rows are the
same rows (same answers, same params) with a blank picture. `make_dataset` writes `.parquet` or `.jsonl`
(images as base64 bytes). Run `python -m envs.color_reveal.synthetic OUT --rows N --seed S [--blind]`.

SFT transcripts (`make_sft_dataset`, `--sft`; the layout of `envs/transcripts.py`): transcript i shows prompt
row i's picture and question, as the prompt loader renders them with `--prompt-style plain`, then what the best
policy does: it names the card's color; or, in a share `multi_turn_share` of the rows (drawn from (seed, i)), it
names the decoy first, gets the env's own reveal observation (its text and the picture of the card alone), and
names the card. Each transcript is played through `ColorRevealEnv`, which must grade its last answer right. Half
and half is what the best policy does, since the first picture cannot tell the card from the decoy.
No jax; numpy, PIL and pyarrow.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from PIL import Image

from envs.color_reveal.answers import COLORS
from envs.color_reveal.env import ColorRevealEnv
from envs.color_reveal.images import DEFAULT_IMAGE_SIZE, blank_image, png_bytes, shade, stripes_image
from envs.color_reveal.prompts import QUESTION
from envs.transcripts import transcript_row, write_transcripts

#: How far (per channel) a picture's shades may stray from the canonical RGB of their colors.
SHADE_JITTER = 24


def generate_row(index: int, seed: int = 0, image_size: int = DEFAULT_IMAGE_SIZE, blind: bool = False) -> dict[str, Any]:
    """Row `index` of the dataset for `seed` (depends only on the pair and the picture settings)."""
    # Each block of len(COLORS) consecutive rows has every card color once (in a random order), so an unshuffled
    # batch of a multiple of that many prompts is balanced: no color is right more often than another.
    block = np.random.default_rng([seed, index // len(COLORS), 0]).permutation(len(COLORS))
    card_k = int(block[index % len(COLORS)])
    rng = np.random.default_rng([seed, index])
    decoy_k = (card_k + 1 + int(rng.integers(len(COLORS) - 1))) % len(COLORS)
    card, decoy = COLORS[card_k], COLORS[decoy_k]
    side = int(rng.integers(2))
    card_rgb, decoy_rgb = shade(card, rng, SHADE_JITTER), shade(decoy, rng, SHADE_JITTER)
    stripes = [card_rgb, decoy_rgb] if side == 0 else [decoy_rgb, card_rgb]
    image = blank_image(image_size) if blind else stripes_image(stripes, image_size)
    params = {"card": card, "decoy": decoy, "card_side": side, "card_rgb": list(card_rgb),
              "decoy_rgb": list(decoy_rgb), "image_size": image_size, "blind": blind}
    name = f"color_reveal_s{seed}_{index:06d}{'_blind' if blind else ''}.png"
    return {
        "problem": "<image>" + QUESTION,
        "answer": card,
        "images": [{"bytes": png_bytes(image), "path": name}],
        "params": json.dumps(params, sort_keys=True),
    }


def generate_rows(num_rows: int, seed: int = 0, image_size: int = DEFAULT_IMAGE_SIZE,
                  blind: bool = False) -> list[dict[str, Any]]:
    if not isinstance(num_rows, int) or num_rows < 0:
        raise ValueError(f"num_rows must be an int >= 0, got {num_rows!r}")
    if not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be an int >= 0, got {seed!r}")
    return [generate_row(i, seed, image_size, blind) for i in range(num_rows)]


SCHEMA = pa.schema([
    ("problem", pa.string()),
    ("answer", pa.string()),
    ("images", pa.list_(pa.struct([("bytes", pa.binary()), ("path", pa.string())]))),
    ("params", pa.string()),
])


def make_dataset(out_path: str, num_rows: int, seed: int = 0, image_size: int = DEFAULT_IMAGE_SIZE,
                 blind: bool = False) -> str:
    """Write `num_rows` rows to `out_path` (.parquet, or .jsonl with base64 image bytes); return the path."""
    lower = str(out_path).lower()
    if not lower.endswith((".parquet", ".jsonl")):
        raise ValueError(f"{out_path}: make_dataset writes .parquet or .jsonl")
    rows = generate_rows(num_rows, seed, image_size, blind)
    parent = os.path.dirname(os.path.abspath(out_path))
    os.makedirs(parent, exist_ok=True)
    if lower.endswith(".parquet"):
        pq.write_table(pa.Table.from_pylist(rows, schema=SCHEMA), out_path)
    else:
        with open(out_path, "w", encoding="utf-8") as f:
            for row in rows:
                images = [{"bytes": base64.b64encode(im["bytes"]).decode("ascii"), "path": im["path"]} for im in row["images"]]
                f.write(json.dumps({**row, "images": images}) + "\n")
    return str(out_path)


#: Share of SFT transcripts whose first guess is the decoy (the best policy's first guess is right half of the time).
MULTI_TURN_SHARE = 0.5


def generate_transcript(index: int, seed: int = 0, image_size: int = DEFAULT_IMAGE_SIZE,
                        multi_turn_share: float = MULTI_TURN_SHARE) -> dict[str, Any]:
    """SFT transcript `index` for `seed` (module docstring): prompt row `index`'s picture, then the right answer, or
    the decoy, the env's reveal and the right answer."""
    if not 0.0 <= multi_turn_share <= 1.0:
        raise ValueError(f"multi_turn_share must be in [0, 1], got {multi_turn_share!r}")
    row = generate_row(index, seed, image_size)
    params = json.loads(row["params"])
    card, decoy = params["card"], params["decoy"]
    picture = Image.open(io.BytesIO(row["images"][0]["bytes"]))
    picture.load()
    two_turns = bool(np.random.default_rng([seed, index, 1]).random() < multi_turn_share)
    env = ColorRevealEnv(card, max_turns=2, image_size=image_size)
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": [{"type": "image", "image": picture}, {"type": "text", "text": QUESTION}]}]
    if two_turns:
        messages.append({"role": "assistant", "content": decoy})
        observation, done, _ = env.step(decoy)
        if done:
            raise AssertionError(f"transcript {index}: the env ended the episode on the decoy")
        messages.append(env.format_observation(observation))
    messages.append({"role": "assistant", "content": card})
    _, done, info = env.step(card)
    if not (done and info["correct"]):
        raise AssertionError(f"transcript {index}: the env did not grade the card's color right")
    name = f"color_reveal_sft_s{seed}_{index:06d}"
    return transcript_row(messages, name=name, params={**params, "turns": 1 + two_turns, "reward": env.verdict()})


def make_sft_dataset(out_path: str, num_rows: int, seed: int = 0, image_size: int = DEFAULT_IMAGE_SIZE,
                     multi_turn_share: float = MULTI_TURN_SHARE) -> str:
    """Write `num_rows` SFT transcripts (module docstring) to `out_path` (.parquet or .jsonl); return the path."""
    if not isinstance(num_rows, int) or num_rows < 0:
        raise ValueError(f"num_rows must be an int >= 0, got {num_rows!r}")
    rows = [generate_transcript(i, seed, image_size, multi_turn_share) for i in range(num_rows)]
    return write_transcripts(out_path, rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m envs.color_reveal.synthetic", description=__doc__.split("\n")[0])
    p.add_argument("out", help="output .parquet or .jsonl")
    p.add_argument("--rows", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--image-size", type=int, default=DEFAULT_IMAGE_SIZE)
    p.add_argument("--blind", action="store_true", help="blank pictures (the blind ablation's data)")
    p.add_argument("--sft", action="store_true", help="SFT transcripts instead of prompts")
    ns = p.parse_args(argv)
    if ns.sft:
        path = make_sft_dataset(ns.out, ns.rows, ns.seed, ns.image_size)
        print(f"wrote {ns.rows} color-reveal SFT transcripts to {path}")
        return 0
    path = make_dataset(ns.out, ns.rows, ns.seed, ns.image_size, ns.blind)
    print(f"wrote {ns.rows} color-reveal rows to {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
