"""The pictures of the color-reveal task (PIL): a card beside a decoy, the card alone, and the blank picture.

No jax; numpy and PIL only.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Sequence

import numpy as np
from PIL import Image

from envs.color_reveal.answers import COLORS, RGB

#: The one picture every image becomes in the blind ablation (`blind: true`): a uniform mid-gray.
BLANK_RGB: tuple[int, int, int] = (128, 128, 128)
#: Side of the pictures in pixels: 64x64 is 4 image tokens for Qwen3-VL (patch 16, merge 2).
DEFAULT_IMAGE_SIZE = 64
MIN_IMAGE_SIZE = 32


def _check_size(size: int) -> None:
    if not isinstance(size, int) or isinstance(size, bool) or size < MIN_IMAGE_SIZE:
        raise ValueError(f"image size must be an int >= {MIN_IMAGE_SIZE} pixels, got {size!r}")


def shade(color: str, rng: np.random.Generator | None = None, jitter: int = 0) -> tuple[int, int, int]:
    """The RGB of `color`, each channel moved by a uniform integer in [-jitter, jitter] (clipped to 0..255)."""
    if color not in RGB:
        raise ValueError(f"unknown color {color!r}: one of {COLORS}")
    base = np.array(RGB[color], dtype=np.int64)
    if rng is not None and jitter > 0:
        base = base + rng.integers(-jitter, jitter + 1, size=3)
    r, g, b = (int(v) for v in np.clip(base, 0, 255))
    return r, g, b


def stripes_image(shades: Sequence[tuple[int, int, int]], size: int = DEFAULT_IMAGE_SIZE) -> Image.Image:
    """A square RGB picture split into equal vertical stripes, left to right, of the given shades."""
    _check_size(size)
    if not shades:
        raise ValueError("stripes_image needs at least one shade")
    pixels = np.zeros((size, size, 3), dtype=np.uint8)
    edges = np.linspace(0, size, len(shades) + 1).round().astype(int)
    for k, rgb in enumerate(shades):
        pixels[:, edges[k] : edges[k + 1]] = rgb
    return Image.fromarray(pixels, "RGB")


def blank_image(size: int = DEFAULT_IMAGE_SIZE) -> Image.Image:
    """The blind ablation's picture: uniform `BLANK_RGB`."""
    _check_size(size)
    return Image.new("RGB", (size, size), BLANK_RGB)


def is_blank(image: Image.Image) -> bool:
    """Whether every pixel of `image` is `BLANK_RGB`."""
    arr = np.asarray(image.convert("RGB"))
    return bool((arr == np.array(BLANK_RGB, dtype=np.uint8)).all())


def png_bytes(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def decode_data_url(url: str) -> Image.Image:
    """A `data:image/...;base64,` URL (as the rollout keeps prompt images) as a loaded PIL image."""
    if not isinstance(url, str) or not url.startswith("data:image/") or ";base64," not in url:
        raise ValueError(f"not a base64 image data URL: {str(url)[:40]!r}")
    image = Image.open(io.BytesIO(base64.b64decode(url.split(";base64,", 1)[1], validate=True)))
    image.load()
    return image
