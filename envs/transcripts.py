"""SFT transcripts on disk: the conversation rows that `jaxrl_vlm/data/sft.py` reads (`--loss-type sft_loss`).

A row is `messages` (a list of `{"role", "content"}` whose content is a string with one `<image>` marker per
image), `images` (the row's pictures in marker order, `{"bytes": PNG, "path": name}`), `tools` (the JSON of the
tool schemas the chat template renders, or null) and `params` (JSON about how the row was made, ignored by the
loader). A task's generator (`make_sft_dataset` in `envs/<task>/synthetic.py`) builds each conversation as chat
messages, with PIL images in content items the way an environment's `format_observation` returns them, and
`transcript_row` flattens it into that layout. Written as `.parquet`, or `.jsonl` with base64 image bytes.

No jax; PIL and pyarrow.
"""

from __future__ import annotations

import base64
import io
import json
import os
from collections.abc import Sequence
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image

IMAGE_MARKER = "<image>"

SCHEMA = pa.schema([
    ("messages", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
    ("images", pa.list_(pa.struct([("bytes", pa.binary()), ("path", pa.string())]))),
    ("tools", pa.string()),
    ("params", pa.string()),
])


def _png(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def _flatten_content(content: Any, images: list[bytes], where: str) -> str:
    """Text of a message's content with each image item replaced by `<image>` (its PNG appended to `images`)."""
    if isinstance(content, str):
        if IMAGE_MARKER in content:
            raise ValueError(f"{where}: text contains the image marker {IMAGE_MARKER!r}")
        return content
    parts = []
    for item in content:
        if item.get("type") == "image":
            image = item["image"]
            if not isinstance(image, Image.Image):
                raise ValueError(f"{where}: an image item must hold a PIL image, got {type(image).__name__}")
            images.append(_png(image))
            parts.append(IMAGE_MARKER)
        elif item.get("type") == "text":
            parts.append(_flatten_content(item["text"], images, where))
        else:
            raise ValueError(f"{where}: unsupported content item {item!r}")
    return "".join(parts)


def transcript_row(messages: Sequence[dict[str, Any]], *, name: str, tools: list[dict] | None = None,
                   params: dict[str, Any] | None = None) -> dict[str, Any]:
    """One row of the SFT layout from chat messages (content: a string, or text and PIL-image items); `name`
    prefixes the images' file names."""
    images: list[bytes] = []
    flat = [{"role": m["role"], "content": _flatten_content(m["content"], images, f"{name} message {i}")}
            for i, m in enumerate(messages)]
    return {
        "messages": flat,
        "images": [{"bytes": data, "path": f"{name}_{k}.png"} for k, data in enumerate(images)],
        "tools": None if tools is None else json.dumps(tools),
        "params": None if params is None else json.dumps(params, sort_keys=True),
    }


def write_transcripts(out_path: str, rows: list[dict[str, Any]]) -> str:
    """Write `transcript_row` rows to `.parquet` or `.jsonl` (images as base64 bytes); return the path."""
    lower = str(out_path).lower()
    if not lower.endswith((".parquet", ".jsonl")):
        raise ValueError(f"{out_path}: SFT transcripts are written as .parquet or .jsonl")
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    if lower.endswith(".parquet"):
        pq.write_table(pa.Table.from_pylist(rows, schema=SCHEMA), out_path)
        return str(out_path)
    with open(out_path, "w", encoding="utf-8") as f:
        for row in rows:
            images = [{"bytes": base64.b64encode(im["bytes"]).decode("ascii"), "path": im["path"]} for im in row["images"]]
            f.write(json.dumps({**row, "images": images}) + "\n")
    return str(out_path)
