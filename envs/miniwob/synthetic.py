"""MiniWoB prompt rows, and SFT transcripts of the scripted solution (read from the DOM, played in real Chromium).

Rows have the Geometry3K layout the prompt loader reads (`problem`, `answer`, `images`, `params`): `problem` is the
question (no picture: the env's reset observation brings the screenshot and the instruction), `answer` the JSON
`{"task": ..., "seed": s}` the env is built from. Row i's page seed is `page_seed(seed, i)`, so a row always plays
the same page, and datasets of different seeds (training 1234, held-out 1235) play different pages. Making rows needs
no browser.

SFT transcripts (`make_sft_dataset`, needs Chromium): row i's opening (question, first screenshot, instruction,
joined as the rollout joins a reset observation to the prompt), then the scripted reply `click(x, y)` at the target
button's centre (`tasks.scripted_reply`, from the DOM); played through `MiniWoBEnv`, which must end in success.
`image_size` is accepted for the generator signature and ignored: MiniWoB's screenshot is 160x210.
Run `python -m envs.miniwob.synthetic OUT --rows N --seed S [--task T] [--sft]`.

No jax; numpy, PIL, pyarrow (and miniwob for --sft).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import numpy as np

from envs.miniwob.browser import BrowserPool
from envs.miniwob.env import MiniWoBEnv
from envs.miniwob.prompts import QUESTION
from envs.miniwob.tasks import DEFAULT_TASK, TASKS, check_task, scripted_reply
from envs.rows import write_rows
from envs.transcripts import transcript_row, write_transcripts


def page_seed(seed: int, index: int) -> int:
    """The page seed of row `index` of a dataset made with `seed` (distinct datasets' seeds do not collide)."""
    return int(np.random.SeedSequence([int(seed), int(index), 5353]).generate_state(1)[0] & 0x7FFFFFFF)


def generate_row(index: int, seed: int = 0, image_size: int | None = None, task: str = DEFAULT_TASK) -> dict[str, Any]:
    label = {"task": check_task(task, "miniwob make_dataset"), "seed": page_seed(seed, index)}
    return {"problem": QUESTION, "answer": json.dumps(label, sort_keys=True), "images": [],
            "params": json.dumps({"dataset_seed": seed, "index": index}, sort_keys=True)}


def make_dataset(out_path: str, num_rows: int, seed: int = 0, image_size: int | None = None,
                 task: str = DEFAULT_TASK) -> str:
    return write_rows(out_path, [generate_row(i, seed, image_size, task) for i in range(num_rows)])


def opening_message(question: str, opening: dict[str, Any]) -> dict[str, Any]:
    """The first user message of an episode: the prompt's question, then the reset observation's content (pictures,
    then its text on a line of its own), as the rollout joins them (`rollout.multiturn.prompt_with_opening`)."""
    items = list(opening["content"])
    if items and items[-1].get("type") == "text":
        items[-1] = {**items[-1], "text": "\n" + items[-1]["text"]}
    return {"role": "user", "content": [{"type": "text", "text": question}, *items]}


def generate_transcript(index: int, seed: int, pool: BrowserPool, task: str = DEFAULT_TASK) -> dict[str, Any]:
    """Transcript `index`: row `index`'s opening, then the scripted click, played in Chromium (must succeed)."""
    env = MiniWoBEnv(task, page_seed(seed, index), max_turns=1, pool=pool)
    try:
        messages: list[dict[str, Any]] = [opening_message(QUESTION, env.format_observation(env.reset()))]
        assert env.screen is not None
        reply = scripted_reply(task, env.screen)
        messages.append({"role": "assistant", "content": reply})
        env.step(reply)
        if not (env.done and env.success):
            raise AssertionError(f"miniwob transcript {index}: the scripted {reply} did not succeed in {task} seed "
                                 f"{env.seed} (raw reward {env.raw_reward})")
    finally:
        env.close()
    return transcript_row(messages, name=f"miniwob_sft_s{seed}_{index:06d}",
                          params={"task": task, "seed": env.seed, "reply": reply, "reward": env.verdict()})


def make_sft_dataset(out_path: str, num_rows: int, seed: int = 0, image_size: int | None = None,
                     task: str = DEFAULT_TASK) -> str:
    pool = BrowserPool(1)
    try:
        rows = [generate_transcript(i, seed, pool, task) for i in range(num_rows)]
    finally:
        pool.close()
    return write_transcripts(out_path, rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m envs.miniwob.synthetic", description=__doc__.split("\n")[0])
    p.add_argument("out")
    p.add_argument("--rows", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--task", choices=TASKS, default=DEFAULT_TASK)
    p.add_argument("--sft", action="store_true", help="SFT transcripts of the scripted solution instead of prompt rows")
    ns = p.parse_args(argv)
    make = make_sft_dataset if ns.sft else make_dataset
    print(f"wrote {make(ns.out, ns.rows, ns.seed, None, ns.task)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
