"""Synthetic geo3k generator: answers recomputed from the drawn geometry, legible labels,
determinism, and loading through the same loader as a user's parquet/jsonl.

Answers are checked with independent numpy geometry on the stored coordinates
(distances, angles between rays) and an independent parser of the answer strings;
nothing is taken from the generator's own answer arithmetic.
"""

from __future__ import annotations

import base64
import io
import json
import math
import re
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from PIL import Image

from envs.geo3k.synthetic import FAMILIES, format_radical, format_tenth, generate_rows, make_dataset, simplify_sqrt
from jaxrl_vlm.data import load_prompt_dataset

N_ROWS = 200


@pytest.fixture(scope="module")
def rows():
    start = time.perf_counter()
    out = generate_rows(N_ROWS, seed=7, image_size=224)
    elapsed = time.perf_counter() - start
    assert elapsed < 20, f"{N_ROWS} rows took {elapsed:.1f}s"  # ~1 s here; loose for a shared CPU
    return out


# ------------------------------------------------------------- independent checks
def parse_answer(answer: str) -> tuple[float, str]:
    """(value, form) of an answer string; form is int | tenth | radical | pi."""
    if m := re.fullmatch(r"(\d*)\\sqrt\{(\d+)\}", answer):
        coef, n = int(m.group(1) or 1), int(m.group(2))
        assert n > 1 and all(n % (f * f) for f in range(2, int(n**0.5) + 1)), f"{answer} is not simplest radical form"
        return coef * math.sqrt(n), "radical"
    if m := re.fullmatch(r"(\d*)\\pi", answer):
        return int(m.group(1) or 1) * math.pi, "pi"
    if re.fullmatch(r"\d+\.\d", answer):
        return float(answer), "tenth"
    assert re.fullmatch(r"[1-9]\d*", answer), f"unexpected answer format {answer!r}"
    return float(answer), "int"


def check_value(question: str, answer: str, truth: float) -> None:
    value, form = parse_answer(answer)
    if "nearest tenth" in question:
        assert form == "tenth" and abs(value - truth) <= 0.05 + 1e-9, (question, answer, truth)
    else:
        assert form in ("int", "radical", "pi"), (question, answer)
        assert abs(value - truth) < 1e-6 * max(1.0, truth), (question, answer, truth)
    assert ("simplest radical form" in question) == (form == "radical"), (question, answer)
    assert ("in terms of \\pi" in question) == (form == "pi"), (question, answer)


def deg(value: str) -> float:
    assert value.endswith("\u00b0"), value
    return float(value[:-1])


def angle_between(u: np.ndarray, v: np.ndarray) -> float:
    return float(np.degrees(np.arccos(np.clip(u @ v / (np.linalg.norm(u) * np.linalg.norm(v)), -1, 1))))


def check_triangle(p: dict, question: str, answer: str) -> None:
    pts = {k: np.array(v) for k, v in p["points"].items()}
    assert len(pts) == 3
    dist = lambda key: float(np.linalg.norm(pts[key[0]] - pts[key[1]]))  # noqa: E731

    def angle(v: str) -> float:
        a, b = [pts[k] for k in pts if k != v]
        return angle_between(a - pts[v], b - pts[v])

    assert abs(sum(angle(v) for v in pts) - 180) < 1e-6
    if p["right_angle"] is not None:
        assert abs(angle(p["right_angle"]) - 90) < 1e-6
    unknowns = []
    for key, text in p["sides"].items():  # drawn to scale: a labelled side has its labelled length
        if text == "x":
            unknowns.append(dist(key))
        else:
            assert abs(dist(key) - float(text)) < 1e-9 * max(1.0, float(text)), (key, text, dist(key))
    for key, text in p["angles"].items():
        if text == "x\u00b0":
            unknowns.append(angle(key))
        else:
            assert abs(angle(key) - deg(text)) < 1e-6, (key, text, angle(key))
    assert len(unknowns) == 1 and question.startswith("Find x.")
    check_value(question, answer, unknowns[0])


def check_circle(p: dict, question: str, answer: str) -> None:
    center, (e0, e1) = np.array(p["center"]), [np.array(e) for e in p["segment"]["ends"]]
    length = float(np.linalg.norm(e1 - e0))
    assert abs(length - float(p["segment"]["label"])) < 1e-9
    if p["segment"]["kind"] == "radius":
        assert np.allclose(e0, center)
        r = length
    else:
        assert np.allclose((e0 + e1) / 2, center)
        r = length / 2
    assert abs(np.linalg.norm(e1 - center) - p["radius"]) < 1e-9  # the segment really ends on the circle
    truth = math.pi * r * r if "area" in question else 2 * math.pi * r
    assert ("area" in question) != ("circumference" in question)
    check_value(question, answer, truth)


def parse_expr(label: str) -> tuple[int, int]:
    """'x°' -> (1, 0); '(3x + 12)°' -> (3, 12); '(2x - 8)°' -> (2, -8)."""
    if label == "x\u00b0":
        return 1, 0
    m = re.fullmatch(r"\((\d*)x(?: ([+-]) (\d+))?\)\u00b0", label)
    assert m, label
    a = int(m.group(1) or 1)
    b = 0 if m.group(2) is None else int(m.group(3)) * (1 if m.group(2) == "+" else -1)
    return a, b


def check_parallel(p: dict, question: str, answer: str) -> None:
    (a1, b1), (a2, b2) = [[np.array(e) for e in line] for line in p["lines"]]
    t0, t1 = [np.array(e) for e in p["transversal"]]
    u1, u2, t = b1 - a1, b2 - a2, t1 - t0
    cross = lambda a, b: float(a[0] * b[1] - a[1] * b[0])  # noqa: E731
    assert abs(cross(u1, u2)) < 1e-9 * np.linalg.norm(u1) * np.linalg.norm(u2)  # the lines are parallel
    assert abs(cross(u1, t)) > 0.1 * np.linalg.norm(u1) * np.linalg.norm(t)  # and really cut
    inter = [np.array(q) for q in p["intersections"]]
    for q, (a, b) in zip(inter, ((a1, b1), (a2, b2))):
        assert abs(cross(b - a, q - a)) < 1e-9 and abs(cross(t, q - t0)) < 1e-9  # on the line and on the transversal

    def region(spec: dict) -> float:
        sl, st = spec["rays"]
        return angle_between(sl * u1, st * t)  # u1 == u2 up to scale, so either line's direction works

    known = region(p["known"])
    assert abs(known - round(known)) < 1e-6 and p["known"]["label"] == f"{round(known)}\u00b0"
    a, b = parse_expr(p["unknown"]["label"])  # read the label the model sees, not the generator's a, b
    truth = (region(p["unknown"]) - b) / a
    assert question == "Find x."
    check_value(question, answer, truth)


def check_rectangle(p: dict, question: str, answer: str) -> None:
    names = p["order"]
    assert sorted(names) == sorted(p["points"])
    pts = [np.array(p["points"][k]) for k in names]
    for k in range(4):
        assert abs(angle_between(pts[k - 1] - pts[k], pts[(k + 1) % 4] - pts[k]) - 90) < 1e-6
    w, h = float(np.linalg.norm(pts[1] - pts[0])), float(np.linalg.norm(pts[2] - pts[1]))
    assert p["sides"][names[0] + names[1]] == str(round(w)) and abs(w - round(w)) < 1e-9
    assert p["sides"][names[1] + names[2]] == str(round(h)) and abs(h - round(h)) < 1e-9
    if "perimeter" in question:
        truth = 2 * (w + h)
    elif "area" in question:
        truth = w * h
    else:
        assert p["sides"][names[0] + names[2]] == "x"
        truth = float(np.linalg.norm(pts[2] - pts[0]))
    if "rectangle" in question:
        assert "rectangle " + "".join(names) in question
    check_value(question, answer, truth)


CHECKERS = {
    "triangle_angle_sum": check_triangle,
    "law_of_cosines": check_triangle,
    "pythagoras": check_triangle,
    "right_trig": check_triangle,
    "special_right": check_triangle,
    "circle": check_circle,
    "parallel_lines": check_parallel,
    "rectangle": check_rectangle,
}


# ---------------------------------------------------------------------------- tests
def test_answers_match_the_drawn_geometry(rows):
    seen = set()
    for i, row in enumerate(rows):
        p = json.loads(row["params"])
        assert row["problem"].startswith("<image>") and row["problem"].count("<image>") == 1 == len(row["images"])
        try:
            CHECKERS[p["family"]](p, row["problem"][len("<image>") :], row["answer"])
        except AssertionError as exc:
            raise AssertionError(f"row {i} ({p['family']}): {exc}") from exc
        seen.add(p["family"])
    assert seen == set(FAMILIES)


def test_images_have_legible_in_bounds_labels_for_every_given(rows):
    size = 224
    for i, row in enumerate(rows):
        p = json.loads(row["params"])
        image = Image.open(io.BytesIO(row["images"][0]["bytes"]))
        assert image.format == "PNG" and image.mode == "RGB" and image.size == (size, size)
        ink = np.asarray(image).min(axis=2) < 128
        assert 0.005 < ink.mean() < 0.25, f"row {i}: {ink.mean():.3f} of pixels dark"
        boxes = [lab["box"] for lab in p["labels"]]
        for lab in p["labels"]:
            x0, y0, x1, y1 = lab["box"]
            assert 0 <= x0 < x1 <= size and 0 <= y0 < y1 <= size, (i, lab)
            assert y1 - y0 >= 8, (i, lab)  # text at least 8 px tall (font scales with size)
            assert ink[y0:y1, x0:x1].sum() >= 8, (i, lab)  # the text was actually drawn
        for j in range(len(boxes)):  # no label covers another
            for k in range(j):
                a, b = boxes[j], boxes[k]
                assert a[2] <= b[0] or b[2] <= a[0] or a[3] <= b[1] or b[3] <= a[1], (i, p["labels"][j], p["labels"][k])
        # Every value the question needs is visible on the diagram.
        texts = [lab["text"] for lab in p["labels"]]
        needed = []
        if "sides" in p:
            needed += list(p["sides"].values())
        if "angles" in p:
            needed += list(p["angles"].values())
        if p["family"] == "circle":
            needed.append(p["segment"]["label"])
        if p["family"] == "parallel_lines":
            needed += [p["known"]["label"], p["unknown"]["label"]]
        if "points" in p:
            needed += list(p["points"])
        assert sorted(needed) == sorted(t for t in texts if t in needed) and set(needed) <= set(texts), (i, needed, texts)


def test_same_seed_gives_byte_identical_parquet(tmp_path):
    a = make_dataset(str(tmp_path / "a.parquet"), 12, seed=3, image_size=160)
    b = make_dataset(str(tmp_path / "sub" / "b.parquet"), 12, seed=3, image_size=160)
    c = make_dataset(str(tmp_path / "c.parquet"), 12, seed=4, image_size=160)
    assert Path(a).read_bytes() == Path(b).read_bytes()
    assert pq.read_table(a).to_pylist() != pq.read_table(c).to_pylist()
    # A row depends only on (seed, index): a shorter run is a prefix of a longer one.
    assert generate_rows(5, seed=3, image_size=160) == pq.read_table(a).to_pylist()[:5]


def test_synthetic_parquet_loads_with_the_user_loader(tmp_path):
    path = make_dataset(str(tmp_path / "train.parquet"), 16, seed=1)
    table = pq.read_table(path)
    assert table.column_names == ["problem", "answer", "images", "params"]
    assert str(table.schema.field("images").type) == "list<element: struct<bytes: binary, path: string>>"
    ds = load_prompt_dataset(path)
    raw = table.to_pylist()
    assert len(ds) == 16 and ds.skipped == []
    for i, row in enumerate(raw):
        s = ds[i]
        assert s.label == row["answer"] and s.metadata["row"] == i
        (image_item, text_item) = s.prompt[-1]["content"]
        assert text_item == {"type": "text", "text": row["problem"][len("<image>") :]}
        url_pixels = np.asarray(Image.open(io.BytesIO(base64.b64decode(image_item["image"].split(",")[1]))))
        np.testing.assert_array_equal(url_pixels, np.asarray(Image.open(io.BytesIO(row["images"][0]["bytes"]))))


def test_jsonl_variant_with_image_files_loads_identically(tmp_path):
    parquet = make_dataset(str(tmp_path / "d.parquet"), 6, seed=2)
    rows = pq.read_table(parquet).to_pylist()
    (tmp_path / "images").mkdir()
    with open(tmp_path / "d.jsonl", "w") as f:
        for row in rows:
            name = f"images/{row['images'][0]['path']}"
            (tmp_path / name).write_bytes(row["images"][0]["bytes"])
            f.write(json.dumps({"problem": row["problem"], "answer": row["answer"], "images": [name]}) + "\n")
    from_parquet = load_prompt_dataset(parquet)
    from_jsonl = load_prompt_dataset(str(tmp_path / "d.jsonl"))
    assert len(from_jsonl) == len(from_parquet) == 6
    for i in range(6):
        assert from_jsonl[i].prompt == from_parquet[i].prompt
        assert from_jsonl[i].label == from_parquet[i].label


def test_answer_formatting_helpers():
    for n in range(0, 500):
        k, m = simplify_sqrt(n)
        assert k * k * m == n
        assert all(m % (f * f) for f in range(2, int(m**0.5) + 1))  # square-free
    assert format_radical(1, 48) == "4\\sqrt{3}" and format_radical(2, 8) == "4\\sqrt{2}"
    assert format_radical(1, 49) == "7" and format_radical(1, 5) == "\\sqrt{5}"
    assert format_tenth(7.25) == "7.3" and format_tenth(7.249) == "7.2" and format_tenth(12) == "12.0"


def test_bad_arguments():
    with pytest.raises(ValueError, match="image_size"):
        generate_rows(1, image_size=32)
    with pytest.raises(ValueError, match="parquet"):
        make_dataset("/tmp/out.jsonl", 1)
