"""Export a LoRA run's checkpoint: a PEFT adapter directory and the merged HF model (`jaxrl-vlm export-lora`).

    python scripts/export_lora.py configs/color_reveal_lora_tiny.yaml [--checkpoint DIR] [--out DIR] [--step N] \
        [--no-merged] [--flag value ...]

The same as `jaxrl-vlm export-lora ...` (jaxrl_vlm/job/export_lora.py), kept for the commands written before it.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jaxrl_vlm.cli import main as cli_main  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    return cli_main(["export-lora", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    raise SystemExit(main())
