"""The synthetic GUI: a desktop with app buttons, a settings window with toggles and a name field, drawn with PIL.

State (`GuiState`) is a small dataclass; `render(state)` paints a screenshot and `hit(state, x, y)` says which
widget a click at (x, y) lands on. Layout (`layout_params`) depends only on (seed, index): the desktop buttons and
the order of the toggles are shuffled per level, so only the screenshot says where to click.

Coordinates in actions are Qwen3-VL's: integers in [0, 1000] relative to the screenshot's width and height.

No jax; numpy and PIL.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
from PIL import Image, ImageDraw, ImageFont

APPS = ("Settings", "Mail", "Files", "Music")
TOGGLES = ("Wi-Fi", "Bluetooth", "Dark mode", "Sounds")
COORD_MAX = 1000
Box = tuple[int, int, int, int]  # x0, y0, x1, y1 in pixels


@dataclasses.dataclass
class GuiState:
    width: int
    height: int
    app_boxes: dict[str, Box]
    toggle_order: list[str]
    settings_open: bool = False
    toggles: dict[str, bool] = dataclasses.field(default_factory=dict)
    name: str = ""
    focused: bool = False

    # ---- the settings window's widgets (fixed frame, shuffled rows)
    def window_box(self) -> Box:
        return (self.width // 8, self.height // 8, self.width * 7 // 8, self.height * 7 // 8)

    def close_box(self) -> Box:
        x0, y0, x1, _ = self.window_box()
        return (x1 - 18, y0 + 2, x1 - 2, y0 + 16)

    def toggle_box(self, name: str) -> Box:
        x0, y0, x1, _ = self.window_box()
        row = self.toggle_order.index(name)
        top = y0 + 22 + row * 18
        return (x1 - 40, top, x1 - 10, top + 14)

    def field_box(self) -> Box:
        x0, y0, x1, _ = self.window_box()
        top = y0 + 22 + len(self.toggle_order) * 18 + 4
        return (x0 + 50, top, x1 - 10, top + 16)


def layout_params(seed: int, index: int, width: int, height: int) -> dict[str, Any]:
    """Where the desktop buttons are and the toggles' order (JSON-safe), from (seed, index)."""
    rng = np.random.default_rng([seed, index, 13])
    cols, rows = 3, 3
    cells = rng.permutation(cols * rows)[: len(APPS)]
    bw, bh = width // cols, height // rows
    boxes = {}
    for app, cell in zip(APPS, cells):
        cx, cy = int(cell) % cols, int(cell) // cols
        boxes[app] = [cx * bw + 6, cy * bh + 6, cx * bw + bw - 6, cy * bh + bh // 2]
    return {"width": width, "height": height, "app_boxes": boxes,
            "toggle_order": [TOGGLES[k] for k in rng.permutation(len(TOGGLES))]}


def initial_state(layout: dict[str, Any]) -> GuiState:
    return GuiState(int(layout["width"]), int(layout["height"]),
                    {k: tuple(v) for k, v in layout["app_boxes"].items()}, list(layout["toggle_order"]),
                    toggles={t: False for t in layout["toggle_order"]})


def to_pixels(state: GuiState, x: int, y: int) -> tuple[int, int]:
    """A 0..1000 relative point in the screenshot's pixels."""
    return x * state.width // COORD_MAX, y * state.height // COORD_MAX


def to_relative(state: GuiState, box: Box) -> tuple[int, int]:
    """The 0..1000 relative centre of a pixel box (what a good click sends)."""
    return ((box[0] + box[2]) * COORD_MAX // (2 * state.width), (box[1] + box[3]) * COORD_MAX // (2 * state.height))


def _inside(box: Box, px: int, py: int) -> bool:
    return box[0] <= px <= box[2] and box[1] <= py <= box[3]


def hit(state: GuiState, x: int, y: int) -> str | None:
    """The widget under a click at relative (x, y): "app:<name>", "toggle:<name>", "field", "close", or None."""
    px, py = to_pixels(state, x, y)
    if state.settings_open:
        if _inside(state.close_box(), px, py):
            return "close"
        for name in state.toggle_order:
            if _inside(state.toggle_box(name), px, py):
                return f"toggle:{name}"
        if _inside(state.field_box(), px, py):
            return "field"
        return None
    for app, box in state.app_boxes.items():
        if _inside(box, px, py):
            return f"app:{app}"
    return None


def render(state: GuiState) -> Image.Image:
    """The screenshot of `state`."""
    image = Image.new("RGB", (state.width, state.height), (60, 110, 160))
    draw = ImageDraw.Draw(image)
    font = ImageFont.load_default()
    for app, box in state.app_boxes.items():
        fill = (250, 210, 80) if app == "Settings" else (230, 230, 230)
        draw.rectangle(box, fill=fill, outline=(20, 20, 20))
        draw.text((box[0] + 3, box[1] + 3), app, fill=(0, 0, 0), font=font)
    if state.settings_open:
        win = state.window_box()
        draw.rectangle(win, fill=(245, 245, 245), outline=(0, 0, 0))
        draw.rectangle((win[0], win[1], win[2], win[1] + 18), fill=(90, 90, 120))
        draw.text((win[0] + 4, win[1] + 3), "Settings", fill=(255, 255, 255), font=font)
        draw.rectangle(state.close_box(), fill=(220, 60, 60))
        for name in state.toggle_order:
            box = state.toggle_box(name)
            draw.text((win[0] + 6, box[1] + 1), name, fill=(0, 0, 0), font=font)
            on = state.toggles[name]
            draw.rounded_rectangle(box, radius=6, fill=(60, 180, 80) if on else (170, 170, 170))
            left = box[2] - 14 if on else box[0] + 1
            knob = (left, box[1] + 1, left + 13, box[3] - 1)
            draw.ellipse(knob, fill=(255, 255, 255))
        field = state.field_box()
        draw.text((win[0] + 6, field[1] + 2), "Name", fill=(0, 0, 0), font=font)
        draw.rectangle(field, fill=(255, 255, 255), outline=(40, 90, 230) if state.focused else (120, 120, 120),
                       width=2 if state.focused else 1)
        draw.text((field[0] + 3, field[1] + 2), state.name, fill=(0, 0, 0), font=font)
    return image
