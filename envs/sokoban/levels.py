"""Sokoban levels: the board, its moves, a breadth-first solver (the level's known minimum), generation, pictures.

A board is a grid of `rows` x `cols` cells with a wall border, a few interior walls, boxes, as many targets and
the player. Moves are "up", "down", "left", "right": the player steps into a free cell, or pushes a box into a free
cell beyond it; anything else leaves the board as it is. Solved: every box on a target.

`generate_level(seed, index, ...)` draws boards from (seed, index) until the solver's minimum number of moves lies
in [min_moves, max_moves], so every level is solvable and its optimum is known.

No jax; numpy and PIL.
"""

from __future__ import annotations

import dataclasses
import json
from collections import deque
from typing import Any

import numpy as np
from PIL import Image, ImageDraw

DIRECTIONS: dict[str, tuple[int, int]] = {"up": (-1, 0), "down": (1, 0), "left": (0, -1), "right": (0, 1)}
#: Pixels per cell of the picture.
CELL_PX = 16

_WALL, _FLOOR, _TARGET = (70, 70, 80), (225, 225, 215), (230, 60, 60)
_BOX, _BOX_ON, _PLAYER = (200, 140, 40), (40, 180, 60), (40, 90, 230)

Cell = tuple[int, int]


@dataclasses.dataclass(frozen=True)
class Level:
    """An immutable board state. `walls` includes the border; positions are (row, col)."""

    rows: int
    cols: int
    walls: frozenset[Cell]
    targets: frozenset[Cell]
    boxes: frozenset[Cell]
    player: Cell

    def solved(self) -> bool:
        return self.boxes == self.targets

    def move(self, direction: str) -> tuple["Level", bool]:
        """The board after `direction`, and whether anything moved (a blocked move is a no-op)."""
        dr, dc = DIRECTIONS[direction]
        r, c = self.player
        step = (r + dr, c + dc)
        if step in self.walls:
            return self, False
        if step in self.boxes:
            beyond = (r + 2 * dr, c + 2 * dc)
            if beyond in self.walls or beyond in self.boxes:
                return self, False
            boxes = (self.boxes - {step}) | {beyond}
            return dataclasses.replace(self, boxes=frozenset(boxes), player=step), True
        return dataclasses.replace(self, player=step), True

    def to_json(self) -> str:
        return json.dumps({"rows": self.rows, "cols": self.cols, "walls": sorted(self.walls), "targets": sorted(self.targets),
                           "boxes": sorted(self.boxes), "player": list(self.player)}, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "Level":
        d = json.loads(text)
        cells = lambda key: frozenset(tuple(int(v) for v in p) for p in d[key])  # noqa: E731
        level = cls(int(d["rows"]), int(d["cols"]), cells("walls"), cells("targets"), cells("boxes"),
                    (int(d["player"][0]), int(d["player"][1])))
        if len(level.boxes) != len(level.targets) or not level.boxes:
            raise ValueError(f"sokoban level: {len(level.boxes)} boxes for {len(level.targets)} targets")
        return level


def solve(level: Level, limit: int = 64) -> list[str] | None:
    """A shortest move sequence that solves `level` (breadth-first over (player, boxes)); None if none within `limit`."""
    start = (level.player, level.boxes)
    parents: dict[Any, tuple[Any, str] | None] = {start: None}
    frontier = deque([(level, 0)])
    while frontier:
        state, depth = frontier.popleft()
        if state.solved():
            path: list[str] = []
            key = (state.player, state.boxes)
            while parents[key] is not None:
                key, move = parents[key]
                path.append(move)
            return path[::-1]
        if depth >= limit:
            continue
        for direction in DIRECTIONS:
            nxt, moved = state.move(direction)
            key = (nxt.player, nxt.boxes)
            if moved and key not in parents:
                parents[key] = ((state.player, state.boxes), direction)
                frontier.append((nxt, depth + 1))
    return None


def generate_level(seed: int, index: int, rows: int = 6, cols: int = 6, num_boxes: int = 1, inner_walls: int = 1,
                   min_moves: int = 1, max_moves: int = 4) -> tuple[Level, int]:
    """Level `index` for `seed` and its minimum number of moves (depends only on the arguments)."""
    if rows < 3 or cols < 3 or not 1 <= min_moves <= max_moves:
        raise ValueError(f"sokoban: need rows, cols >= 3 and 1 <= min_moves <= max_moves, got {rows}x{cols}, "
                         f"[{min_moves}, {max_moves}]")
    rng = np.random.default_rng([seed, index, 7])
    border = {(r, c) for r in range(rows) for c in range(cols) if r in (0, rows - 1) or c in (0, cols - 1)}
    interior = [(r, c) for r in range(1, rows - 1) for c in range(1, cols - 1)]
    for _attempt in range(10_000):
        cells = [interior[k] for k in rng.permutation(len(interior))[: inner_walls + 2 * num_boxes + 1]]
        walls = frozenset(border | set(cells[:inner_walls]))
        rest = cells[inner_walls:]
        boxes, targets, player = rest[:num_boxes], rest[num_boxes: 2 * num_boxes], rest[-1]
        level = Level(rows, cols, walls, frozenset(targets), frozenset(boxes), player)
        path = solve(level, limit=max_moves)
        if path is not None and min_moves <= len(path) <= max_moves:
            return level, len(path)
    raise ValueError(f"sokoban: no {rows}x{cols} level with a minimum in [{min_moves}, {max_moves}] moves")


def render(level: Level, cell_px: int = CELL_PX) -> Image.Image:
    """The board as an RGB picture: walls dark, targets red squares, boxes orange (green on a target), player blue."""
    image = Image.new("RGB", (level.cols * cell_px, level.rows * cell_px), _FLOOR)
    draw = ImageDraw.Draw(image)
    pad = max(1, cell_px // 8)
    for r in range(level.rows):
        for c in range(level.cols):
            x0, y0, x1, y1 = c * cell_px, r * cell_px, (c + 1) * cell_px - 1, (r + 1) * cell_px - 1
            cell = (r, c)
            if cell in level.walls:
                draw.rectangle((x0, y0, x1, y1), fill=_WALL)
                continue
            if cell in level.targets:
                draw.rectangle((x0 + pad, y0 + pad, x1 - pad, y1 - pad), outline=_TARGET, width=max(1, pad))
            if cell in level.boxes:
                draw.rectangle((x0 + pad, y0 + pad, x1 - pad, y1 - pad), fill=_BOX_ON if cell in level.targets else _BOX)
            if cell == level.player:
                draw.ellipse((x0 + pad, y0 + pad, x1 - pad, y1 - pad), fill=_PLAYER)
    return image
