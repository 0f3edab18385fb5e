"""Prompt rows of the picture tasks, written in the layouts the prompt loader reads: `.parquet` (image bytes) or
`.jsonl` (base64 image bytes). One writer for every task's `make_dataset`."""

from __future__ import annotations

import argparse
import base64
import json
import os
from collections.abc import Callable
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

SCHEMA = pa.schema([
    ("problem", pa.string()), ("answer", pa.string()),
    ("images", pa.list_(pa.struct([("bytes", pa.binary()), ("path", pa.string())]))), ("params", pa.string()),
])


def write_rows(out_path: str, rows: list[dict[str, Any]]) -> str:
    """Rows to `.parquet` or `.jsonl` (base64 image bytes), the layouts the prompt loader reads."""
    lower = str(out_path).lower()
    if not lower.endswith((".parquet", ".jsonl")):
        raise ValueError(f"{out_path}: make_dataset writes .parquet or .jsonl")
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    if lower.endswith(".parquet"):
        pq.write_table(pa.Table.from_pylist(rows, schema=SCHEMA), out_path)
    else:
        with open(out_path, "w", encoding="utf-8") as f:
            for row in rows:
                images = [{"bytes": base64.b64encode(im["bytes"]).decode("ascii"), "path": im["path"]}
                          for im in row["images"]]
                f.write(json.dumps({**row, "images": images}) + "\n")
    return str(out_path)


def synthetic_main(prog: str, description: str, make_dataset: Callable[..., str], make_sft_dataset: Callable[..., str],
                   image_size: int, argv: list[str] | None = None) -> int:
    """The command line of a task's `synthetic` module: OUT [--rows N] [--seed S] [--image-size PX] [--sft]."""
    p = argparse.ArgumentParser(prog=prog, description=description)
    p.add_argument("out")
    p.add_argument("--rows", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--image-size", type=int, default=image_size)
    p.add_argument("--sft", action="store_true", help="SFT transcripts instead of prompt rows")
    ns = p.parse_args(argv)
    print(f"wrote {(make_sft_dataset if ns.sft else make_dataset)(ns.out, ns.rows, ns.seed, ns.image_size)}")
    return 0
