"""Synthetic GUI tasks: the desktop screenshot, the task as the question, layout and task as the answer (JSON).

Rows have the Geometry3K layout (`problem` = "<image>" + task, `answer` = JSON {"layout", "task"}, `images`,
`params`). Row i depends only on (seed, i): even rows ask to turn on a toggle, odd rows to set the name.
`image_size` is the screenshot's width (height 3/4 of it).

SFT transcripts (`make_sft_dataset`): the system prompt configs/gui_tiny.yaml sets, the task, then the scripted
solution (click Settings, click the toggle; or click Settings, click the field, type the name), each action
answered by the env's own screenshot; the env must end in success.
Run `python -m envs.gui.synthetic OUT --rows N --seed S [--sft]`. No jax.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from envs.color_reveal.images import png_bytes
from envs.gui.env import GuiEnv
from envs.gui.prompts import SYSTEM_PROMPT, rename_task, toggle_task
from envs.gui.screen import TOGGLES, initial_state, layout_params, render, to_relative
from envs.rows import synthetic_main, write_rows
from envs.transcripts import transcript_row, write_transcripts

DEFAULT_IMAGE_SIZE = 256
NAMES = ("kiwi", "lark", "moss", "reed", "sage", "wren")


def task_for(index: int, seed: int = 0, image_size: int = DEFAULT_IMAGE_SIZE) -> tuple[dict[str, Any], dict[str, str], str]:
    """(layout, task, task words) of row `index`."""
    layout = layout_params(seed, index, image_size, image_size * 3 // 4)
    rng = np.random.default_rng([seed, index, 17])
    if index % 2 == 0:
        task = {"kind": "toggle", "target": TOGGLES[int(rng.integers(len(TOGGLES)))]}
        words = toggle_task(task["target"])
    else:
        task = {"kind": "rename", "text": NAMES[int(rng.integers(len(NAMES)))]}
        words = rename_task(task["text"])
    return layout, task, words


def generate_row(index: int, seed: int = 0, image_size: int = DEFAULT_IMAGE_SIZE) -> dict[str, Any]:
    layout, task, words = task_for(index, seed, image_size)
    screenshot = render(initial_state(layout))
    return {"problem": "<image>" + words, "answer": json.dumps({"layout": layout, "task": task}, sort_keys=True),
            "images": [{"bytes": png_bytes(screenshot), "path": f"gui_s{seed}_{index:06d}.png"}],
            "params": json.dumps(task)}


def make_dataset(out_path: str, num_rows: int, seed: int = 0, image_size: int = DEFAULT_IMAGE_SIZE) -> str:
    return write_rows(out_path, [generate_row(i, seed, image_size) for i in range(num_rows)])


def solution(env: GuiEnv) -> list[str]:
    """The scripted actions that solve the env's task from its initial state."""
    state = env.state
    actions = ["click({}, {})".format(*to_relative(state, state.app_boxes["Settings"]))]
    state.settings_open = True  # to read the window's geometry; reset below
    if env.task["kind"] == "toggle":
        actions.append("click({}, {})".format(*to_relative(state, state.toggle_box(env.task["target"]))))
    else:
        actions += ["click({}, {})".format(*to_relative(state, state.field_box())), f'type("{env.task["text"]}")']
    env.reset()
    return actions


def generate_transcript(index: int, seed: int = 0, image_size: int = DEFAULT_IMAGE_SIZE) -> dict[str, Any]:
    layout, task, words = task_for(index, seed, image_size)
    env = GuiEnv(layout, task, max_turns=3)
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": [
        {"type": "image", "image": render(env.state)}, {"type": "text", "text": words}]}]
    done = False
    for action in solution(env):
        messages.append({"role": "assistant", "content": action})
        observation, done, _ = env.step(action)
        if not done:
            messages.append(env.format_observation(observation))
    if not (done and env.success):
        raise AssertionError(f"gui transcript {index}: the scripted solution did not complete the task")
    return transcript_row(messages, name=f"gui_sft_s{seed}_{index:06d}", params={**task, "reward": env.verdict()})


def make_sft_dataset(out_path: str, num_rows: int, seed: int = 0, image_size: int = DEFAULT_IMAGE_SIZE) -> str:
    return write_transcripts(out_path, [generate_transcript(i, seed, image_size) for i in range(num_rows)])


def main(argv: list[str] | None = None) -> int:
    return synthetic_main("python -m envs.gui.synthetic", __doc__.split("\n")[0], make_dataset, make_sft_dataset,
                          DEFAULT_IMAGE_SIZE, argv)


if __name__ == "__main__":
    raise SystemExit(main())
