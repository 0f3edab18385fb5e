"""Synthetic Geometry3K-style problems: PIL-drawn diagrams with exactly computed answers.

Each row has the columns of HF `hiyouga/geometry3k` (`problem` = "<image>" + question,
`answer`, `images` = [{"bytes": PNG, "path": name}]) so the same loader reads it,
plus a `params` JSON column (ignored by the loader) with the diagram's geometry:
model-space coordinates, which values are labelled, and the pixel box of every
label. Diagrams are drawn to scale, so a test can recompute each answer from the
coordinates alone (lengths, angles between rays) instead of trusting the generator.

Families: triangle angle sum, law of cosines, Pythagoras, right-triangle trig,
30-60-90 / 45-45-90 triangles, circles (area/circumference, decimal or in pi),
parallel lines cut by a transversal (possibly with a linear expression in x),
rectangles (perimeter/area/diagonal).

Row i depends only on (seed, i): `generate_rows(n, s)[:k] == generate_rows(k, s)`.

SFT transcripts (`make_sft_dataset`; the layout of `envs/transcripts.py`): transcript i is prompt row i as
`--prompt-style geo3k` renders it (the task's system prompt and `calc_geo3k_reward` tool schema, the diagram and
the question), then one assistant turn with the right value: a `calc_geo3k_reward` tool call (which ends a
geo3k episode when correct), or in the other rows (`tool_call_share`, drawn from (seed, i)) a final answer in
`\boxed{}`. Each turn is played through `Geo3kEnv`, which must grade it correct and end the episode.
No jax; only numpy, PIL and pyarrow.
"""

from __future__ import annotations

import asyncio
import io
import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from decimal import ROUND_HALF_UP, Decimal
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image, ImageDraw, ImageFont

from envs.geo3k.env import Geo3kEnv
from envs.geo3k.prompts import GEO3K_SYSTEM_PROMPT, GEO3K_TOOL_NAME, GEO3K_TOOLS
from envs.transcripts import transcript_row, write_transcripts

FAMILIES = (
    "triangle_angle_sum",
    "law_of_cosines",
    "pythagoras",
    "right_trig",
    "special_right",
    "circle",
    "parallel_lines",
    "rectangle",
)
_LETTERS = "ABCDEFGHJKLMNPQRSTUVWYZ"  # no I/O (look like 1/0) and no X (the unknown is x)
_MAX_LAYOUT_ATTEMPTS = 40
DEG = "\u00b0"


class _LayoutError(Exception):
    """A label could not be placed legibly; the row is redrawn with fresh parameters."""


# --------------------------------------------------------------------- answer formats
def simplify_sqrt(n: int) -> tuple[int, int]:
    """(k, m) with k*sqrt(m) == sqrt(n) and m square-free (exact integer arithmetic)."""
    if n < 0:
        raise ValueError(f"sqrt of negative {n}")
    k, m, f = 1, n, 2
    while f * f <= m:
        while m % (f * f) == 0:
            m //= f * f
            k *= f
        f += 1
    return k, m


def format_radical(coef: int, n: int) -> str:
    """coef*sqrt(n) in simplest radical form: "12", "\\sqrt{5}", "4\\sqrt{3}"."""
    k, m = simplify_sqrt(n)
    k *= coef
    if m == 1:
        return str(k)
    return (f"{k}" if k != 1 else "") + f"\\sqrt{{{m}}}"


def format_tenth(value: float) -> str:
    """Round half-up to one decimal place: 7.25 -> "7.3" (values here are irrational or exact)."""
    return str(Decimal(repr(float(value))).quantize(Decimal("0.1"), rounding=ROUND_HALF_UP))


def format_pi(coef: int) -> str:
    return "\\pi" if coef == 1 else f"{coef}\\pi"


# ----------------------------------------------------------------------- vector helpers
def _v(x: float, y: float) -> np.ndarray:
    return np.array([x, y], dtype=np.float64)


def _unit(v: np.ndarray) -> np.ndarray:
    return v / float(np.hypot(v[0], v[1]))


def _rotation(deg: float) -> np.ndarray:
    t = math.radians(deg)
    return np.array([[math.cos(t), -math.sin(t)], [math.sin(t), math.cos(t)]])


def _perp(v: np.ndarray) -> np.ndarray:
    return _v(-v[1], v[0])


def _pt(p: np.ndarray) -> list[float]:
    return [float(p[0]), float(p[1])]


# ------------------------------------------------------------------------------ diagram
@dataclass
class _Label:
    text: str
    anchor: np.ndarray  # model coordinates
    direction: np.ndarray  # model-space unit vector: the side of the anchor the text goes on
    gap: float  # pixels between anchor and the nearest edge of the text (first try)
    slack: float  # how much farther (pixels) the text may be pushed to clear lines and other labels


@dataclass
class _Diagram:
    """Geometry in model coordinates (y up), fitted into a square image at render time."""

    size: int
    segments: list[tuple[np.ndarray, np.ndarray]] = field(default_factory=list)
    circles: list[tuple[np.ndarray, float]] = field(default_factory=list)
    dots: list[np.ndarray] = field(default_factory=list)
    arcs: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = field(default_factory=list)  # vertex, dir1, dir2
    right_angles: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = field(default_factory=list)
    arrows: list[tuple[np.ndarray, np.ndarray]] = field(default_factory=list)  # point, direction
    labels: list[_Label] = field(default_factory=list)

    @property
    def font_px(self) -> int:
        return max(10, round(self.size / 15))

    @property
    def line_px(self) -> int:
        return max(1, round(self.size / 112))

    # -- building
    def segment(self, p: np.ndarray, q: np.ndarray) -> None:
        self.segments.append((p, q))

    def polygon(self, pts: list[np.ndarray]) -> None:
        for k, p in enumerate(pts):
            self.segment(p, pts[(k + 1) % len(pts)])

    def label(
        self, text: str, anchor: np.ndarray, direction: np.ndarray, gap: float = 3.0, slack: float | None = None
    ) -> None:
        slack = self.font_px * 1.5 if slack is None else slack
        self.labels.append(_Label(text, anchor, _unit(direction), gap, slack))

    def side_label(self, text: str, p: np.ndarray, q: np.ndarray, inside: np.ndarray) -> None:
        """Label segment pq at its midpoint, on the side away from the point `inside`."""
        mid = (p + q) / 2
        n = _perp(q - p)
        if float(np.dot(n, mid - inside)) < 0:
            n = -n
        self.label(text, mid, n, gap=3.0, slack=self.font_px * 2.0)

    def angle_label(self, text: str, vertex: np.ndarray, p: np.ndarray, q: np.ndarray, arc: bool = True) -> None:
        """Label the angle p-vertex-q inside it, beyond an arc marking it."""
        d1, d2 = _unit(p - vertex), _unit(q - vertex)
        if arc:
            self.arcs.append((vertex, d1, d2))
        # Never far from the vertex: a label pushed away would name the wrong angle.
        self.label(text, vertex, d1 + d2, gap=self.font_px * 1.0 + 3, slack=self.font_px * 2.0)

    def right_angle(self, vertex: np.ndarray, p: np.ndarray, q: np.ndarray) -> None:
        self.right_angles.append((vertex, _unit(p - vertex), _unit(q - vertex)))

    # -- rendering
    def _transform(self) -> Callable[[np.ndarray], np.ndarray]:
        pts = [p for s in self.segments for p in s] + self.dots
        for c, r in self.circles:
            pts += [c - r, c + r]
        arr = np.array(pts)
        lo, hi = arr.min(axis=0), arr.max(axis=0)
        margin = 2.6 * self.font_px
        extent = max(float((hi - lo).max()), 1e-9)
        scale = (self.size - 2 * margin) / extent
        center = (lo + hi) / 2
        half = self.size / 2

        def to_px(p: np.ndarray) -> np.ndarray:
            return _v(half + (p[0] - center[0]) * scale, half - (p[1] - center[1]) * scale)

        return to_px

    def render(self) -> tuple[bytes, list[dict[str, Any]]]:
        """PNG bytes and the placed labels [{"text", "box": [x0, y0, x1, y1]}] (pixel ink boxes)."""
        size, lw, fs = self.size, self.line_px, self.font_px
        to_px = self._transform()
        image = Image.new("RGB", (size, size), "white")
        draw = ImageDraw.Draw(image)
        font = _font(fs)

        seg_px = [(to_px(p), to_px(q)) for p, q in self.segments]
        for v, d1, d2 in self.right_angles:
            s = fs * 0.6
            a, c = to_px(v) + _flip(d1) * s, to_px(v) + _flip(d2) * s
            b = a + _flip(d2) * s
            seg_px += [(a, b), (b, c)]
        for p, d in self.arrows:
            c, dd = to_px(p), _flip(d)
            n, s = _perp(dd), fs * 0.35
            tip = c + dd * s
            seg_px += [(c - dd * s + n * s, tip), (c - dd * s - n * s, tip)]
        circ_px = [(to_px(c), r * float(np.hypot(*(to_px(c + _v(1, 0)) - to_px(c))))) for c, r in self.circles]

        for a, b in seg_px:
            draw.line([tuple(a), tuple(b)], fill="black", width=lw)
        for c, r in circ_px:
            draw.ellipse([c[0] - r, c[1] - r, c[0] + r, c[1] + r], outline="black", width=lw)
        for p in self.dots:
            c, r = to_px(p), lw + 1.5
            draw.ellipse([c[0] - r, c[1] - r, c[0] + r, c[1] + r], fill="black")
        for v, d1, d2 in self.arcs:
            c, r = to_px(v), fs * 0.8
            a1 = math.degrees(math.atan2(*_flip(d1)[::-1]))
            a2 = math.degrees(math.atan2(*_flip(d2)[::-1]))
            if (a2 - a1) % 360 > 180:
                a1, a2 = a2, a1
            draw.arc([c[0] - r, c[1] - r, c[0] + r, c[1] + r], a1, a1 + (a2 - a1) % 360, fill="black", width=1)

        placed: list[tuple[float, float, float, float]] = []
        out: list[dict[str, Any]] = []
        for lab in self.labels:
            l, t, r, b = font.getbbox(lab.text)
            w, h = r - l, b - t
            anchor, d = to_px(lab.anchor), _flip(lab.direction)
            reach = abs(d[0]) * w / 2 + abs(d[1]) * h / 2
            steps = int(lab.slack // (fs * 0.25)) + 1
            for k in range(steps):
                cx, cy = anchor + d * (lab.gap + k * fs * 0.25 + reach)
                box = (cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2)
                if _fits(box, size, placed, seg_px, circ_px, pad=2.0):
                    break
            else:
                raise _LayoutError(f"no room for label {lab.text!r}")
            x, y = round(box[0] - l), round(box[1] - t)
            draw.text((x, y), lab.text, fill="black", font=font)
            ink = draw.textbbox((x, y), lab.text, font=font)
            placed.append(box)
            out.append({"text": lab.text, "box": [int(v) for v in ink]})

        buf = io.BytesIO()
        image.save(buf, format="PNG")
        return buf.getvalue(), out


def _flip(d: np.ndarray) -> np.ndarray:
    """Model direction (y up) -> pixel direction (y down)."""
    return _v(d[0], -d[1])


_FONTS: dict[int, ImageFont.FreeTypeFont | ImageFont.ImageFont] = {}


def _font(px: int) -> ImageFont.FreeTypeFont | ImageFont.ImageFont:
    """PIL's bundled default font at `px` pixels (no font files are downloaded)."""
    if px not in _FONTS:
        _FONTS[px] = ImageFont.load_default(size=px)
    return _FONTS[px]


def _fits(box, size, placed, segs, circles, pad: float) -> bool:
    x0, y0, x1, y1 = box[0] - pad, box[1] - pad, box[2] + pad, box[3] + pad
    if x0 < 1 or y0 < 1 or x1 > size - 1 or y1 > size - 1:
        return False
    for p in placed:
        if x0 < p[2] + pad and p[0] - pad < x1 and y0 < p[3] + pad and p[1] - pad < y1:
            return False
    for a, b in segs:
        if _segment_hits_box(a, b, (x0, y0, x1, y1)):
            return False
    for c, r in circles:
        nearest = math.hypot(c[0] - min(max(c[0], x0), x1), c[1] - min(max(c[1], y0), y1))
        farthest = max(math.hypot(c[0] - x, c[1] - y) for x in (x0, x1) for y in (y0, y1))
        if nearest <= r + 1 and farthest >= r - 1:
            return False
    return True


def _segment_hits_box(a: np.ndarray, b: np.ndarray, box: tuple[float, float, float, float]) -> bool:
    """Liang-Barsky: does segment ab intersect the axis-aligned box?"""
    x0, y0, x1, y1 = box
    t0, t1 = 0.0, 1.0
    dx, dy = b[0] - a[0], b[1] - a[1]
    for p, q in ((-dx, a[0] - x0), (dx, x1 - a[0]), (-dy, a[1] - y0), (dy, y1 - a[1])):
        if p == 0:
            if q < 0:
                return False
        else:
            t = q / p
            if p < 0:
                t0 = max(t0, t)
            else:
                t1 = min(t1, t)
            if t0 > t1:
                return False
    return True


# ---------------------------------------------------------------------------- families
@dataclass
class _Problem:
    question: str
    answer: str
    params: dict[str, Any]
    diagram: _Diagram


def _letters(rng: np.random.Generator, n: int) -> list[str]:
    return [str(c) for c in rng.choice(list(_LETTERS), size=n, replace=False)]


def _angle_at(v: np.ndarray, p: np.ndarray, q: np.ndarray) -> float:
    c = float(np.dot(_unit(p - v), _unit(q - v)))
    return math.degrees(math.acos(max(-1.0, min(1.0, c))))


def _place(pts: list[np.ndarray], rng: np.random.Generator, max_turn: float = 180.0) -> list[np.ndarray]:
    """Rotate a figure by a random angle (and mirror it half the time) for variety."""
    rot = _rotation(float(rng.uniform(-max_turn, max_turn)))
    mirror = np.diag([-1.0, 1.0]) if rng.random() < 0.5 else np.eye(2)
    return [rot @ (mirror @ p) for p in pts]


def _triangle(
    rng: np.random.Generator,
    size: int,
    pts: list[np.ndarray],
    letters: list[str],
    sides: dict[str, str],
    angles: dict[str, str],
    right: str | None = None,
) -> tuple[_Diagram, dict[str, Any]]:
    """Draw a triangle with side labels (keys "PQ"), angle labels (keys "P") and vertex letters."""
    pts = _place(pts, rng)
    P = dict(zip(letters, pts))
    centroid = sum(pts) / 3
    d = _Diagram(size)
    d.polygon(pts)
    for key, text in sides.items():
        d.side_label(text, P[key[0]], P[key[1]], centroid)
    for key, text in angles.items():
        others = [P[o] for o in letters if o != key]
        d.angle_label(text, P[key], others[0], others[1])
    if right is not None:
        others = [P[o] for o in letters if o != right]
        d.right_angle(P[right], others[0], others[1])
    for name, p in P.items():
        d.label(name, p, p - centroid, gap=2.0)
    params = {
        "points": {k: _pt(p) for k, p in P.items()},
        "sides": sides,
        "angles": angles,
        "right_angle": right,
    }
    return d, params


def _fam_triangle_angle_sum(rng: np.random.Generator, size: int) -> _Problem:
    while True:
        a, b = int(rng.integers(30, 101)), int(rng.integers(30, 101))
        if 180 - a - b >= 30:
            break
    c = 180 - a - b
    ra, rb, rc = map(math.radians, (a, b, c))
    A, B = _v(0, 0), _v(10, 0)
    C = _v(math.cos(ra), math.sin(ra)) * (10 * math.sin(rb) / math.sin(rc))
    L = _letters(rng, 3)
    unknown = int(rng.integers(3))
    degs = [a, b, c]
    angles = {L[k]: ("x" if k == unknown else str(degs[k])) + DEG for k in range(3)}
    d, params = _triangle(rng, size, [A, B, C], L, {}, angles)
    return _Problem("Find x.", str(degs[unknown]), params, d)


def _fam_law_of_cosines(rng: np.random.Generator, size: int) -> _Problem:
    while True:
        a, b = int(rng.integers(4, 21)), int(rng.integers(4, 21))
        C = int(rng.integers(30, 151))
        if C == 90 or max(a, b) / min(a, b) > 2.5:
            continue
        P_C, P_B = _v(0, 0), _v(a, 0)
        P_A = _v(math.cos(math.radians(C)), math.sin(math.radians(C))) * b
        if min(_angle_at(P_A, P_B, P_C), _angle_at(P_B, P_A, P_C)) >= 20:
            break
    x = math.sqrt(a * a + b * b - 2 * a * b * math.cos(math.radians(C)))
    L = _letters(rng, 3)  # L[0] at A, L[1] at B, L[2] at C
    sides = {L[2] + L[1]: str(a), L[2] + L[0]: str(b), L[0] + L[1]: "x"}
    d, params = _triangle(rng, size, [P_A, P_B, P_C], L, sides, {L[2]: f"{C}{DEG}"})
    return _Problem("Find x. Round to the nearest tenth.", format_tenth(x), params, d)


_TRIPLES = ((3, 4, 5), (5, 12, 13), (8, 15, 17), (20, 21, 29))  # primitive, legs within ratio 3


def _fam_pythagoras(rng: np.random.Generator, size: int) -> _Problem:
    L = _letters(rng, 3)  # right angle at L[2]; legs L[2]L[1] (a) and L[2]L[0] (b)
    triple = rng.random() < 0.4  # a Pythagorean triple gives an integer answer
    if triple:
        p, q, r = _TRIPLES[int(rng.integers(len(_TRIPLES)))]
        k = int(rng.integers(1, 30 // r + 1))
        a, b, c = (k * p, k * q, k * r) if rng.random() < 0.5 else (k * q, k * p, k * r)
    if rng.random() < 0.5:  # legs given, hypotenuse unknown
        while not triple:
            a, b = int(rng.integers(2, 21)), int(rng.integers(2, 21))
            if max(a, b) / min(a, b) <= 3:
                break
        sides = {L[2] + L[1]: str(a), L[2] + L[0]: str(b), L[0] + L[1]: "x"}
        n, la, lb = a * a + b * b, float(a), float(b)
    else:  # hypotenuse and one leg given, other leg unknown
        while not triple:
            c, a = int(rng.integers(5, 26)), int(rng.integers(2, 25))
            if a < c and 1 / 3 <= math.sqrt(c * c - a * a) / a <= 3:
                break
        sides = {L[0] + L[1]: str(c), L[2] + L[1]: str(a), L[2] + L[0]: "x"}
        n, la, lb = c * c - a * a, float(a), math.sqrt(c * c - a * a)
    pts = [_v(0, lb), _v(la, 0), _v(0, 0)]
    d, params = _triangle(rng, size, pts, L, sides, {}, right=L[2])
    question = "Find x." + (" Express your answer in simplest radical form." if simplify_sqrt(n)[1] != 1 else "")
    return _Problem(question, format_radical(1, n), params, d)


def _fam_right_trig(rng: np.random.Generator, size: int) -> _Problem:
    theta = int(rng.choice([t for t in range(20, 71) if t not in (30, 45, 60)]))
    known = str(rng.choice(["hyp", "adj", "opp"]))
    value = int(rng.integers(4, 26))
    t = math.radians(theta)
    if known == "hyp":
        hyp, adj, opp = value, value * math.cos(t), value * math.sin(t)
    elif known == "adj":
        hyp, adj, opp = value / math.cos(t), value, value * math.tan(t)
    else:
        hyp, adj, opp = value / math.sin(t), value / math.tan(t), value
    unknown = str(rng.choice([s for s in ("hyp", "adj", "opp") if s != known]))
    L = _letters(rng, 3)  # angle theta at L[0]; right angle at L[2]; L[1] opposite L[0]
    names = {"hyp": L[0] + L[1], "adj": L[0] + L[2], "opp": L[2] + L[1]}
    sides = {names[known]: str(value), names[unknown]: "x"}
    pts = [_v(adj, 0), _v(0, opp), _v(0, 0)]
    d, params = _triangle(rng, size, pts, L, sides, {L[0]: f"{theta}{DEG}"}, right=L[2])
    x = {"hyp": hyp, "adj": adj, "opp": opp}[unknown]
    return _Problem("Find x. Round to the nearest tenth.", format_tenth(x), params, d)


def _fam_special_right(rng: np.random.Generator, size: int) -> _Problem:
    L = _letters(rng, 3)  # acute angles at L[0], L[1]; right angle at L[2]
    hyp_k, adj_k, opp_k = L[0] + L[1], L[0] + L[2], L[2] + L[1]
    if rng.random() < 0.4:  # 45-45-90
        if rng.random() < 0.5:
            a = int(rng.integers(2, 16))
            sides, answer, leg = {adj_k: str(a), hyp_k: "x"}, format_radical(a, 2), float(a)
        else:
            c = 2 * int(rng.integers(2, 13))
            sides, answer, leg = {hyp_k: str(c), adj_k: "x"}, format_radical(c // 2, 2), c / math.sqrt(2)
        pts, angle = [_v(leg, 0), _v(0, leg), _v(0, 0)], 45
    else:  # 30-60-90 with the 30 degree angle at L[0]: opp = short leg s, adj = s*sqrt(3), hyp = 2s
        case = int(rng.integers(5))
        if case == 0:
            s = int(rng.integers(2, 13))
            sides, answer = {opp_k: str(s), adj_k: "x"}, format_radical(s, 3)
        elif case == 1:
            s = int(rng.integers(2, 13))
            sides, answer = {opp_k: str(s), hyp_k: "x"}, str(2 * s)
        elif case == 2:
            s = int(rng.integers(2, 13))
            sides, answer = {hyp_k: str(2 * s), adj_k: "x"}, format_radical(s, 3)
        elif case == 3:
            k = int(rng.integers(1, 9))
            s = k * math.sqrt(3)  # long leg 3k
            sides, answer = {adj_k: str(3 * k), opp_k: "x"}, format_radical(k, 3)
        else:
            k = int(rng.integers(1, 9))
            s = k * math.sqrt(3)
            sides, answer = {adj_k: str(3 * k), hyp_k: "x"}, format_radical(2 * k, 3)
        pts, angle = [_v(s * math.sqrt(3), 0), _v(0, s), _v(0, 0)], 30
    label_at = 0 if angle == 45 or rng.random() < 0.5 else 1
    angles = {L[label_at]: f"{angle if label_at == 0 else 90 - angle}{DEG}"}
    d, params = _triangle(rng, size, pts, L, sides, angles, right=L[2])
    question = "Find x." + (" Express your answer in simplest radical form." if "sqrt" in answer else "")
    return _Problem(question, answer, params, d)


def _fam_circle(rng: np.random.Generator, size: int) -> _Problem:
    r = int(rng.integers(2, 16))
    kind = str(rng.choice(["radius", "diameter"]))
    quantity = str(rng.choice(["area", "circumference"]))
    form = str(rng.choice(["tenth", "pi"]))
    name = _letters(rng, 1)[0]
    O = _v(0, 0)
    u = _v(math.cos(t := float(rng.uniform(0, 2 * math.pi))), math.sin(t))
    d = _Diagram(size)
    d.circles.append((O, float(r)))
    d.dots.append(O)
    ends = [O, O + u * r] if kind == "radius" else [O - u * r, O + u * r]
    d.segment(ends[0], ends[1])
    value = r if kind == "radius" else 2 * r
    # The number goes beside the radius (or one half of the diameter), on the +perp side.
    d.side_label(str(value), O if kind == "diameter" else ends[0], ends[1], O - _perp(u))
    d.label(name, O, -u if kind == "radius" else -_perp(u), gap=3.0)  # centre letter clear of the segment
    if quantity == "area":
        exact, coef = math.pi * r * r, r * r
    else:
        exact, coef = 2 * math.pi * r, 2 * r
    if form == "tenth":
        question, answer = f"Find the {quantity} of circle {name}. Round to the nearest tenth.", format_tenth(exact)
    else:
        question, answer = f"Find the {quantity} of circle {name}. Express your answer in terms of \\pi.", format_pi(coef)
    params = {
        "center": _pt(O),
        "radius": float(r),
        "segment": {"kind": kind, "ends": [_pt(p) for p in ends], "label": str(value)},
        "quantity": quantity,
        "form": form,
    }
    return _Problem(question, answer, params, d)


def _expr(a: int, b: int) -> str:
    """Angle expression in x: "x°", "(3x + 12)°", "(2x - 8)°"."""
    if a == 1 and b == 0:
        return "x" + DEG
    lin = ("" if a == 1 else str(a)) + "x"
    if b:
        lin += f" + {b}" if b > 0 else f" - {-b}"
    return f"({lin}){DEG}"


def _fam_parallel_lines(rng: np.random.Generator, size: int) -> _Problem:
    phi = int(rng.choice([p for p in range(35, 146) if p != 90]))
    u, t = _v(1, 0), _v(math.cos(math.radians(phi)), math.sin(math.radians(phi)))
    P1 = _v(0, 0)
    P2 = t * (1.0 / t[1])  # where the transversal meets y = 1
    lo, hi = min(P1[0], P2[0]) - 1.1, max(P1[0], P2[0]) + 1.1
    ends = [_v(lo, 0), _v(hi, 0), _v(lo, 1), _v(hi, 1), P1 - t * 0.75, P2 + t * 0.75, P1, P2]
    ends = _place(ends, rng)
    line1, line2, trans, (Q1, Q2) = ends[0:2], ends[2:4], ends[4:6], ends[6:8]
    u, t = _unit(line1[1] - line1[0]), _unit(trans[1] - trans[0])

    regions = [(i, sl, st) for i in (0, 1) for sl in (1, -1) for st in (1, -1)]
    known, unknown = (regions[j] for j in rng.choice(len(regions), size=2, replace=False))

    def measure(region: tuple[int, int, int]) -> int:
        return phi if region[1] * region[2] == 1 else 180 - phi

    k_val, x_measure = measure(known), measure(unknown)
    if rng.random() < 0.4:
        a, b, x = 1, 0, x_measure
    else:
        a = int(rng.integers(2, 6))
        choices = [b for b in range(-40, 41) if b != 0 and (x_measure - b) % a == 0 and (x_measure - b) // a > 0]
        b = int(rng.choice(choices))
        x = (x_measure - b) // a
    d = _Diagram(size)
    for seg in (line1, line2, trans):
        d.segment(seg[0], seg[1])
    for line in (line1, line2):  # matching arrowheads mark the lines as parallel
        d.arrows.append((line[0] + (line[1] - line[0]) * 0.12, u))
    points = (Q1, Q2)
    for region, text in ((known, f"{k_val}{DEG}"), (unknown, _expr(a, b))):
        i, sl, st = region
        d.angle_label(text, points[i], points[i] + sl * u, points[i] + st * t)
    params = {
        "lines": [[_pt(p) for p in line1], [_pt(p) for p in line2]],
        "transversal": [_pt(p) for p in trans],
        "intersections": [_pt(Q1), _pt(Q2)],
        "known": {"at": known[0], "rays": [known[1], known[2]], "label": f"{k_val}{DEG}"},
        "unknown": {"at": unknown[0], "rays": [unknown[1], unknown[2]], "a": a, "b": b, "label": _expr(a, b)},
    }
    return _Problem("Find x.", str(x), params, d)


def _fam_rectangle(rng: np.random.Generator, size: int) -> _Problem:
    while True:
        w, h = int(rng.integers(3, 21)), int(rng.integers(3, 21))
        if max(w, h) / min(w, h) <= 3:
            break
    L = _letters(rng, 4)
    quantity = str(rng.choice(["perimeter", "area", "diagonal"]))
    pts = _place([_v(0, 0), _v(w, 0), _v(w, h), _v(0, h)], rng, max_turn=20.0)
    P = dict(zip(L, pts))
    center = sum(pts) / 4
    d = _Diagram(size)
    d.polygon(pts)
    for k in range(4):
        d.right_angle(pts[k], pts[(k + 1) % 4], pts[k - 1])
    sides = {L[0] + L[1]: str(w), L[1] + L[2]: str(h)}
    d.side_label(str(w), pts[0], pts[1], center)
    d.side_label(str(h), pts[1], pts[2], center)
    if quantity == "diagonal":
        d.segment(pts[0], pts[2])
        sides[L[0] + L[2]] = "x"
        d.side_label("x", pts[0], pts[2], pts[1])
        n = w * w + h * h
        question = "Find x." + (" Express your answer in simplest radical form." if simplify_sqrt(n)[1] != 1 else "")
        answer = format_radical(1, n)
    else:
        name = "".join(L)
        question = f"Find the {quantity} of rectangle {name}."
        answer = str(2 * (w + h) if quantity == "perimeter" else w * h)
    for name_, p in P.items():
        d.label(name_, p, p - center, gap=2.0)
    # "order" keeps the vertex sequence (the JSON column sorts keys).
    params = {"points": {k: _pt(p) for k, p in P.items()}, "order": L, "sides": sides, "quantity": quantity}
    return _Problem(question, answer, params, d)


_GENERATORS: dict[str, Callable[[np.random.Generator, int], _Problem]] = {
    "triangle_angle_sum": _fam_triangle_angle_sum,
    "law_of_cosines": _fam_law_of_cosines,
    "pythagoras": _fam_pythagoras,
    "right_trig": _fam_right_trig,
    "special_right": _fam_special_right,
    "circle": _fam_circle,
    "parallel_lines": _fam_parallel_lines,
    "rectangle": _fam_rectangle,
}


# --------------------------------------------------------------------------------- API
def generate_row(index: int, seed: int = 0, image_size: int = 224) -> dict[str, Any]:
    """Row `index` of the dataset for `seed` (depends only on the pair, not on the row count)."""
    rng = np.random.default_rng([seed, index])
    family = FAMILIES[int(rng.integers(len(FAMILIES)))]
    for _ in range(_MAX_LAYOUT_ATTEMPTS):
        problem = _GENERATORS[family](rng, image_size)
        try:
            png, labels = problem.diagram.render()
        except _LayoutError:
            continue  # redraw with the next parameters from the same stream (still deterministic)
        params = {"family": family, **problem.params, "labels": labels, "image_size": image_size}
        return {
            "problem": "<image>" + problem.question,
            "answer": problem.answer,
            "images": [{"bytes": png, "path": f"geo3k_synth_s{seed}_{index:06d}.png"}],
            "params": json.dumps(params, sort_keys=True, ensure_ascii=False),
        }
    raise RuntimeError(
        f"could not lay out a legible {family} diagram for row {index} (seed {seed}) at {image_size}px "
        f"in {_MAX_LAYOUT_ATTEMPTS} attempts; use a larger image_size"
    )


def generate_rows(num_rows: int, seed: int = 0, image_size: int = 224) -> list[dict[str, Any]]:
    """`num_rows` rows with columns problem, answer, images [{bytes, path}], params (JSON)."""
    if num_rows < 0:
        raise ValueError(f"num_rows must be >= 0, got {num_rows}")
    if seed < 0:
        raise ValueError(f"seed must be >= 0, got {seed}")
    if image_size < 96:
        raise ValueError(f"image_size must be >= 96 pixels for legible labels, got {image_size}")
    return [generate_row(i, seed, image_size) for i in range(num_rows)]


SCHEMA = pa.schema(
    [
        ("problem", pa.string()),
        ("answer", pa.string()),
        ("images", pa.list_(pa.struct([("bytes", pa.binary()), ("path", pa.string())]))),
        ("params", pa.string()),
    ]
)


def make_dataset(out_path: str, num_rows: int, seed: int = 0, image_size: int = 224) -> str:
    """Write `num_rows` synthetic rows to the parquet file `out_path`; return the path."""
    if not out_path.lower().endswith(".parquet"):
        raise ValueError(f"{out_path}: make_dataset writes parquet; the path must end in .parquet")
    rows = generate_rows(num_rows, seed, image_size)
    table = pa.Table.from_pylist(rows, schema=SCHEMA)
    parent = os.path.dirname(os.path.abspath(out_path))
    os.makedirs(parent, exist_ok=True)
    pq.write_table(table, out_path)
    return out_path


#: Share of SFT transcripts that answer with a `calc_geo3k_reward` tool call (the others end with `\boxed{}`).
TOOL_CALL_SHARE = 0.5


def answer_turn(answer: str, tool_call: bool) -> str:
    """An assistant turn giving `answer`: the tool call as the chat template renders a structured call, or a
    final boxed answer."""
    if tool_call:
        call = json.dumps({"name": GEO3K_TOOL_NAME, "arguments": {"answer": answer}})
        return f"<tool_call>\n{call}\n</tool_call>"
    return f"The answer is \\boxed{{{answer}}}."


def generate_transcript(index: int, seed: int = 0, image_size: int = 224,
                        tool_call_share: float = TOOL_CALL_SHARE) -> dict[str, Any]:
    """SFT transcript `index` for `seed` (module docstring)."""
    if not 0.0 <= tool_call_share <= 1.0:
        raise ValueError(f"tool_call_share must be in [0, 1], got {tool_call_share!r}")
    row = generate_row(index, seed, image_size)
    diagram = Image.open(io.BytesIO(row["images"][0]["bytes"]))
    diagram.load()
    tool_call = bool(np.random.default_rng([seed, index, 1]).random() < tool_call_share)
    reply = answer_turn(row["answer"], tool_call)
    _, done, info = asyncio.run(Geo3kEnv(row["answer"], max_turns=3).step(reply))
    if not (done and info["correct"]):
        raise AssertionError(f"transcript {index}: the env did not grade {reply!r} as a correct final answer")
    question = row["problem"].removeprefix("<image>")
    messages = [
        {"role": "system", "content": GEO3K_SYSTEM_PROMPT},
        {"role": "user", "content": [{"type": "image", "image": diagram}, {"type": "text", "text": question}]},
        {"role": "assistant", "content": reply},
    ]
    params = {**json.loads(row["params"]), "answer": row["answer"], "answer_source": "tool" if tool_call else "boxed"}
    return transcript_row(messages, name=f"geo3k_sft_s{seed}_{index:06d}", tools=GEO3K_TOOLS, params=params)


def make_sft_dataset(out_path: str, num_rows: int, seed: int = 0, image_size: int = 224,
                     tool_call_share: float = TOOL_CALL_SHARE) -> str:
    """Write `num_rows` SFT transcripts (module docstring) to `out_path` (.parquet or .jsonl); return the path."""
    if not isinstance(num_rows, int) or num_rows < 0:
        raise ValueError(f"num_rows must be an int >= 0, got {num_rows!r}")
    if image_size < 96:
        raise ValueError(f"image_size must be >= 96 pixels for legible labels, got {image_size}")
    rows = [generate_transcript(i, seed, image_size, tool_call_share) for i in range(num_rows)]
    return write_transcripts(out_path, rows)
