"""Synthetic zoom-task prompts: a large scene with one small digit, the question, the scene params as the answer.

Rows have the Geometry3K layout (`problem`, `answer` = JSON scene params incl. the digit, `images`, `params`). Row i
depends only on (seed, i); every block of 10 consecutive rows has each digit once. `image_size` is the scene's
side in pixels (the model sees it shrunk by its image processor).

SFT transcripts (`make_sft_dataset`): the system prompt configs/zoom_tiny.yaml sets, then the good policy: zoom on the
digit box (a random margin), read the crop, answer with the `answer` tool; played through `ZoomEnv`, which must grade
it right.
Run `python -m envs.zoom.synthetic OUT --rows N --seed S [--sft]`. No jax.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from envs.color_reveal.images import png_bytes
from envs.rows import synthetic_main, write_rows
from envs.transcripts import transcript_row, write_transcripts
from envs.zoom.env import ZoomEnv
from envs.zoom.prompts import QUESTION, SYSTEM_PROMPT
from envs.zoom.scene import digit_bbox, render_scene, scene_params

DEFAULT_IMAGE_SIZE = 384


def _params(index: int, seed: int, image_size: int) -> dict[str, Any]:
    block = np.random.default_rng([seed, index // 10, 3]).permutation(10)
    return scene_params(seed, index, image_size, int(block[index % 10]))


def generate_row(index: int, seed: int = 0, image_size: int = DEFAULT_IMAGE_SIZE) -> dict[str, Any]:
    params = _params(index, seed, image_size)
    return {"problem": "<image>" + QUESTION, "answer": json.dumps(params, sort_keys=True),
            "images": [{"bytes": png_bytes(render_scene(params)), "path": f"zoom_s{seed}_{index:06d}.png"}],
            "params": json.dumps({"digit": params["digit"], "digit_box": params["digit_box"]})}


def make_dataset(out_path: str, num_rows: int, seed: int = 0, image_size: int = DEFAULT_IMAGE_SIZE) -> str:
    return write_rows(out_path, [generate_row(i, seed, image_size) for i in range(num_rows)])


def generate_transcript(index: int, seed: int = 0, image_size: int = DEFAULT_IMAGE_SIZE) -> dict[str, Any]:
    params = _params(index, seed, image_size)
    margin = float(np.random.default_rng([seed, index, 5]).uniform(0.5, 2.0))
    env = ZoomEnv(params, max_turns=2)
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": [
        {"type": "image", "image": render_scene(params)}, {"type": "text", "text": QUESTION}]}]
    zoom = f'<tool_call>{json.dumps({"name": "zoom", "arguments": {"bbox_2d": digit_bbox(params, margin)}})}</tool_call>'
    messages.append({"role": "assistant", "content": zoom})
    observation, done, _ = env.step(zoom)
    messages.append(env.format_observation(observation))
    answer = f'<tool_call>{json.dumps({"name": "answer", "arguments": {"answer": str(params["digit"])}})}</tool_call>'
    messages.append({"role": "assistant", "content": answer})
    _, done, info = env.step(answer)
    if not (done and info["correct"]):
        raise AssertionError(f"zoom transcript {index}: the env did not grade the digit right")
    return transcript_row(messages, name=f"zoom_sft_s{seed}_{index:06d}",
                          params={"digit": params["digit"], "reward": env.verdict()})


def make_sft_dataset(out_path: str, num_rows: int, seed: int = 0, image_size: int = DEFAULT_IMAGE_SIZE) -> str:
    return write_transcripts(out_path, [generate_transcript(i, seed, image_size) for i in range(num_rows)])


def main(argv: list[str] | None = None) -> int:
    return synthetic_main("python -m envs.zoom.synthetic", __doc__.split("\n")[0], make_dataset, make_sft_dataset,
                          DEFAULT_IMAGE_SIZE, argv)


if __name__ == "__main__":
    raise SystemExit(main())
