"""The guides' commands run: every shell block a page marks runnable on CPU is executed, so a guide cannot drift
from the code.

A page marks a block by putting ``<!-- runnable: cpu -->`` on the line before its ```` ```bash ```` fence. Each
page's blocks run in order in one ``bash -euo pipefail`` (a later block may use what an earlier one wrote), in a
scratch directory that links every top-level entry of the repository except ``runs/``: the commands read
``configs/`` and ``docs/examples/`` as a user's fresh clone would, and whatever they write stays out of the
developer's ``runs/``.

Marked ``docs_commands``: the default run leaves them out (they train tiny models for minutes; pyproject addopts).
CI's docs step runs them: ``python -m pytest -q -n 0 -m docs_commands``. The parsing checks below run in the
default suite.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
MARK = "<!-- runnable: cpu -->"
FENCE_OPEN = re.compile(r"^```(bash|sh|shell)\s*$")
PAGE_TIMEOUT_S = 900  # a page's blocks together; each block is meant to take at most ~90 s on 2 cores


@dataclass(frozen=True)
class RunnableBlock:
    page: str  # relative to the repository root
    line: int  # 1-based line of the fence
    script: str


def runnable_blocks(page: Path) -> list[RunnableBlock]:
    """The blocks of `page` marked runnable, in order. A mark not followed by a bash fence is an error: a typo in
    the mark must not silently stop a block from being checked."""
    lines = page.read_text().splitlines()
    blocks: list[RunnableBlock] = []
    rel = str(page.relative_to(REPO)) if page.is_relative_to(REPO) else str(page)
    for i, line in enumerate(lines):
        if line.strip() != MARK:
            continue
        if i + 1 >= len(lines) or not FENCE_OPEN.match(lines[i + 1].strip()):
            raise ValueError(f"{rel}:{i + 1}: {MARK} must stand on the line right before a ```bash fence")
        body: list[str] = []
        for j in range(i + 2, len(lines)):
            if lines[j].strip() == "```":
                break
            body.append(lines[j])
        else:
            raise ValueError(f"{rel}:{i + 2}: the runnable block's fence is never closed")
        if not any(b.strip() and not b.lstrip().startswith("#") for b in body):
            raise ValueError(f"{rel}:{i + 2}: the runnable block has no command")
        blocks.append(RunnableBlock(rel, i + 2, "\n".join(body)))
    return blocks


def pages_with_blocks() -> dict[str, list[RunnableBlock]]:
    out: dict[str, list[RunnableBlock]] = {}
    for page in sorted(DOCS.rglob("*.md")):
        blocks = runnable_blocks(page)
        if blocks:
            out[str(page.relative_to(REPO))] = blocks
    return out


def user_environment() -> dict[str, str]:
    """The environment a user's shell would have: one CPU device (the suite's conftest simulates 8, which the
    guides do not assume) and no test compilation cache; XLA's optimisation level 0 is kept, for speed only."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("JAX_COMPILATION_CACHE", "JAX_PERSISTENT_CACHE", "JAXRL_TEST_", "PYTEST_"))}
    env["XLA_FLAGS"] = "--xla_backend_optimization_level=0"
    env["JAX_PLATFORMS"] = "cpu"
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"  # this venv's jaxrl-vlm
    return env


def scratch_checkout(tmp: Path) -> Path:
    for entry in REPO.iterdir():
        if entry.name in {"runs", ".git"} or entry.name.startswith((".venv", ".cache")):
            continue
        (tmp / entry.name).symlink_to(entry)
    return tmp


def test_runnable_marks_parse_and_cover_the_guides() -> None:
    """Cheap, in the default run: every mark is well formed, and the quickstart and the environment guide have
    runnable commands."""
    pages = pages_with_blocks()
    assert "docs/quickstart.md" in pages
    assert "docs/guides/custom-env.md" in pages
    assert sum(len(b) for b in pages.values()) >= 8, {p: len(b) for p, b in pages.items()}
    for blocks in pages.values():
        for block in blocks:
            assert "$ " not in block.script.splitlines()[0], f"{block.page}:{block.line}: commands only, no prompts"


def test_a_malformed_mark_is_an_error(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(f"text\n{MARK}\n\n```bash\necho hi\n```\n")
    with pytest.raises(ValueError, match="right before a ```bash fence"):
        runnable_blocks(page)
    page.write_text(f"{MARK}\n```bash\necho hi\n")
    with pytest.raises(ValueError, match="never closed"):
        runnable_blocks(page)
    page.write_text(f"{MARK}\n```bash\necho hi\n```\n")
    assert runnable_blocks(page) == [RunnableBlock(str(page), 2, "echo hi")]


@pytest.mark.docs_commands
@pytest.mark.parametrize("page", sorted(pages_with_blocks()))
def test_guide_commands_run(page: str, tmp_path: Path) -> None:
    blocks = pages_with_blocks()[page]
    cwd = scratch_checkout(tmp_path)
    for block in blocks:
        start = time.monotonic()
        proc = subprocess.run(["bash", "-euo", "pipefail", "-c", block.script], cwd=cwd, env=user_environment(),
                              capture_output=True, text=True, timeout=PAGE_TIMEOUT_S)
        took = time.monotonic() - start
        assert proc.returncode == 0, (
            f"{block.page}:{block.line}: the runnable block failed (exit {proc.returncode}, {took:.0f} s)\n"
            f"--- script\n{block.script}\n--- stdout (tail)\n{proc.stdout[-3000:]}\n--- stderr (tail)\n"
            f"{proc.stderr[-3000:]}")
        print(f"{block.page}:{block.line}: ok in {took:.0f} s")
