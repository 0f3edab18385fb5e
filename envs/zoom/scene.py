"""The zoom task's pictures: a large busy scene with one small digit in a white box, and the crop tool.

A scene depends only on (seed, index): `scene_params` draws its shapes and the digit's box, `render_scene` paints
them. The digit is drawn as seven segments (no font needed) only a few pixels tall, so at the size the model sees
the whole scene (the image processor shrinks it) it is unreadable, and a crop around the box shows it plainly.

Coordinates are Qwen3-VL's: integers in [0, 1000] relative to the picture's width and height.

No jax; numpy and PIL.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from PIL import Image, ImageDraw

#: Which of the segments a b c d e f g each digit lights (a top, b top-right, c bottom-right, d bottom, e bottom-left,
#: f top-left, g middle).
SEGMENTS = {0: "abcdef", 1: "bc", 2: "abdeg", 3: "abcdg", 4: "bcfg", 5: "acdfg", 6: "acdefg", 7: "abc", 8: "abcdefg",
            9: "abcdfg"}
COORD_MAX = 1000


def scene_params(seed: int, index: int, size: int, digit: int) -> dict[str, Any]:
    """Shapes and the digit box of scene `index` (JSON-safe); the digit is given (the dataset balances it)."""
    rng = np.random.default_rng([seed, index, 11])
    shapes = []
    for _ in range(24):
        w, h = (int(v) for v in rng.integers(size // 16, size // 5, size=2))
        x, y = int(rng.integers(0, size - w)), int(rng.integers(0, size - h))
        shapes.append({"box": [x, y, x + w, y + h], "rgb": [int(v) for v in rng.integers(40, 200, size=3)],
                       "ellipse": bool(rng.integers(2))})
    box_w, box_h = max(size // 28, 8), max(size // 20, 12)
    bx = int(rng.integers(size // 10, size - size // 10 - box_w))
    by = int(rng.integers(size // 10, size - size // 10 - box_h))
    return {"size": size, "digit": int(digit), "digit_box": [bx, by, bx + box_w, by + box_h], "shapes": shapes}


def _draw_digit(draw: ImageDraw.ImageDraw, box: list[int], digit: int) -> None:
    x0, y0, x1, y1 = box
    pad = max(1, (x1 - x0) // 5)
    l, r, t, b = x0 + pad, x1 - pad, y0 + pad, y1 - pad
    m = (t + b) // 2
    lines = {"a": (l, t, r, t), "b": (r, t, r, m), "c": (r, m, r, b), "d": (l, b, r, b), "e": (l, m, l, b),
             "f": (l, t, l, m), "g": (l, m, r, m)}
    for seg in SEGMENTS[digit]:
        draw.line(lines[seg], fill=(0, 0, 0), width=1)


def render_scene(params: dict[str, Any]) -> Image.Image:
    size = params["size"]
    image = Image.new("RGB", (size, size), (150, 170, 150))
    draw = ImageDraw.Draw(image)
    for shape in params["shapes"]:
        (draw.ellipse if shape["ellipse"] else draw.rectangle)(shape["box"], fill=tuple(shape["rgb"]))
    draw.rectangle(params["digit_box"], fill=(255, 255, 255), outline=(0, 0, 0))
    _draw_digit(draw, params["digit_box"], params["digit"])
    return image


def crop(image: Image.Image, bbox: list[int], out_px: int) -> Image.Image:
    """The region `bbox` = [x1, y1, x2, y2] (0..1000 relative, x1 < x2, y1 < y2) of `image`, enlarged (nearest
    neighbour, so the pixels stay sharp) until its longer side is `out_px`."""
    x1, y1, x2, y2 = bbox
    w, h = image.size
    box = (x1 * w // COORD_MAX, y1 * h // COORD_MAX, max(x2 * w // COORD_MAX, x1 * w // COORD_MAX + 1),
           max(y2 * h // COORD_MAX, y1 * h // COORD_MAX + 1))
    region = image.crop(box)
    scale = out_px / max(region.size)
    return region.resize((max(1, round(region.width * scale)), max(1, round(region.height * scale))), Image.NEAREST)


def digit_bbox(params: dict[str, Any], margin: float = 1.0) -> list[int]:
    """A 0..1000 box around the digit, `margin` box-sizes wider on each side (what a good zoom asks for)."""
    size = params["size"]
    x0, y0, x1, y1 = params["digit_box"]
    mx, my = (x1 - x0) * margin, (y1 - y0) * margin
    to = lambda v: int(min(max(v * COORD_MAX / size, 0), COORD_MAX))  # noqa: E731
    return [to(x0 - mx), to(y0 - my), to(x1 + mx), to(y1 + my)]
