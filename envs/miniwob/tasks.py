"""The MiniWoB++ tasks this env plays, the Qwen-VL coordinate mapping, and the scripted solutions read from the DOM.

Tasks (each one click on the right button; the page's own JavaScript decides the reward):
- `click-test`: one button ("Click Me!", 35-100 px square) somewhere in the area; a miss does nothing.
- `click-test-2`: buttons ONE and TWO (40 px); ONE gives 1, TWO gives -1.
- `click-button`: "Click on the "ok" button." among up to 6 buttons, text fields and lorem ipsum; another button
  gives -1.

Coordinates: the model clicks at Qwen-VL's normalized (x, y), integers 0-1000 relative to the 160x210 screenshot;
`to_pixels` maps them to task-area pixels (x * 160 / 1000, y * 210 / 1000) and `to_normalized` back (rounded).

No jax, no browser.
"""

from __future__ import annotations

import re

from envs.miniwob.browser import TASK_HEIGHT, TASK_WIDTH, Element, Screen

TASKS: tuple[str, ...] = ("click-test", "click-test-2", "click-button")
DEFAULT_TASK = TASKS[0]
#: Qwen-VL's normalized coordinate range: 0..COORD_MAX on each axis.
COORD_MAX = 1000
_QUOTED = re.compile(r'"([^"]*)"')


def check_task(task: object, where: str) -> str:
    if task not in TASKS:
        raise ValueError(f"{where}: task {task!r} is not one of {', '.join(TASKS)}")
    return str(task)


def to_pixels(x: int, y: int) -> tuple[float, float]:
    """Task-area pixels of normalized (x, y) in 0..1000; the far edge maps just inside the screenshot."""
    return min(x * TASK_WIDTH / COORD_MAX, TASK_WIDTH - 0.5), min(y * TASK_HEIGHT / COORD_MAX, TASK_HEIGHT - 0.5)


def to_normalized(x_px: float, y_px: float) -> tuple[int, int]:
    """Normalized (x, y) of a task-area pixel, rounded and clipped to 0..1000."""
    return (min(COORD_MAX, max(0, round(x_px * COORD_MAX / TASK_WIDTH))),
            min(COORD_MAX, max(0, round(y_px * COORD_MAX / TASK_HEIGHT))))


def target(task: str, screen: Screen) -> Element:
    """The element a scripted solution clicks, read from the DOM (raises if the page is not as expected)."""
    buttons = [e for e in screen.elements if e.tag == "button"]
    if task == "click-test":
        found = [e for e in buttons if e.id == "subbtn"]
    elif task == "click-test-2":
        found = [e for e in buttons if e.text.strip() == "ONE"]
    elif task == "click-button":
        quoted = _QUOTED.search(screen.utterance)
        found = [e for e in buttons if quoted is not None and e.text.strip() == quoted.group(1)]
    else:
        raise ValueError(f"miniwob: no scripted solution for task {task!r}")
    if not found:
        raise ValueError(f"miniwob {task}: no target button in the DOM for {screen.utterance!r}")
    return found[0]


def click_point(task: str, screen: Screen) -> tuple[float, float]:
    """Where a scripted solution clicks, in task pixels: the target's centre, or when another button lies over it
    (click-test-2 places its two buttons independently, so TWO may cover ONE's centre), the point of the target
    nearest its centre that no other button covers (later elements are drawn on top)."""
    goal = target(task, screen)
    others = [e for e in screen.elements if e.tag == "button" and e.ref != goal.ref]

    def covered(x: float, y: float) -> bool:
        return any(o.left <= x <= o.left + o.width and o.top <= y <= o.top + o.height for o in others)

    cx, cy = goal.center
    points = [(goal.left + goal.width * (i + 0.5) / 8, goal.top + goal.height * (j + 0.5) / 8)
              for i in range(8) for j in range(8)]
    free = [(x, y) for x, y in [(cx, cy), *sorted(points, key=lambda p: (p[0] - cx) ** 2 + (p[1] - cy) ** 2)]
            if not covered(x, y)]
    if not free:
        raise ValueError(f"miniwob {task}: the target button is wholly covered for {screen.utterance!r}")
    return free[0]


def scripted_reply(task: str, screen: Screen) -> str:
    """The demonstration's reply: `click(x, y)` at `click_point`, in normalized coordinates."""
    x, y = to_normalized(*click_point(task, screen))
    return f"click({x}, {y})"
