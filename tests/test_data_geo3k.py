"""Geometry3K loader: layouts (parquet/jsonl), messages, image fidelity, bad rows, iterator resume.

Fixtures are built here: random-noise images (so any pixel change shows), written
with PIL/pyarrow in the layout of HF `hiyouga/geometry3k`.
"""

from __future__ import annotations

import base64
import io
import json
import logging
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

import envs.geo3k as envs_geo3k
from envs.base import TaskPrompt
from envs.geo3k.prompts import GEO3K_SYSTEM_PROMPT, GEO3K_TOOL_NAME, GEO3K_TOOLS, GEO3K_USER_INSTRUCTION
from jaxrl_vlm.data import (
    PROMPT_STYLES,
    DatasetError,
    PromptIterator,
    data_url_to_image,
    load_geo3k_dataset,
    load_prompt_dataset,
    load_styled_dataset,
    load_task_prompt,
)
from rollout.sample import Sample

REPO = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------ fixtures
def noise(seed: int, shape=(10, 12, 3)) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)


def encode(array: np.ndarray, fmt: str = "PNG", **kw) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(array).save(buf, format=fmt, **kw)
    return buf.getvalue()


def pixels_of_url(url: str) -> np.ndarray:
    assert url.startswith("data:image/png;base64,")
    image = Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1])))
    assert image.format == "PNG" and image.mode == "RGB"
    return np.asarray(image)


def png_chunk(png: bytes, kind: bytes) -> tuple[int, int]:
    """(offset, length) of the first chunk of `kind` in a PNG file."""
    i = 8
    while i < len(png):
        (n,) = struct.unpack(">I", png[i : i + 4])
        if png[i + 4 : i + 8] == kind:
            return i, n
        i += 12 + n
    raise AssertionError(f"no {kind!r} chunk")


def bad_crc_png(png: bytes) -> bytes:
    """Valid pixel data, wrong IDAT checksum: only PIL's verify() notices."""
    i, n = png_chunk(png, b"IDAT")
    out = bytearray(png)
    out[i + 8 + n] ^= 0xFF
    return bytes(out)


def bad_zlib_png(png: bytes) -> bytes:
    """Corrupt compressed data with a correct checksum: verify() passes, only load() notices."""
    i, n = png_chunk(png, b"IDAT")
    data = bytearray(png[i + 8 : i + 8 + n])
    for j in range(10, len(data) - 10, 7):
        data[j] ^= 0x55
    out = bytearray(png)
    out[i + 8 : i + 8 + n] = data
    out[i + 8 + n : i + 12 + n] = struct.pack(">I", zlib.crc32(b"IDAT" + bytes(data)) & 0xFFFFFFFF)
    return bytes(out)


IMAGES_TYPE = pa.list_(pa.struct([("bytes", pa.binary()), ("path", pa.string())]))


def write_parquet(path: Path, rows: list[dict]) -> str:
    """HF geometry3k layout; extra columns (here `id`) must be ignored by the loader."""
    table = pa.table(
        {
            "problem": pa.array([r.get("problem") for r in rows], pa.string()),
            "answer": pa.array([r.get("answer") for r in rows], pa.string()),
            "images": pa.array([r.get("images") for r in rows], IMAGES_TYPE),
            "id": pa.array(list(range(len(rows))), pa.int64()),
        }
    )
    pq.write_table(table, path)
    return str(path)


def write_jsonl(path: Path, rows: list) -> str:
    with open(path, "w") as f:
        for r in rows:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return str(path)


def good_row(seed: int, answer: str = "12") -> dict:
    return {"problem": "<image>Find x.", "answer": answer, "images": [{"bytes": encode(noise(seed)), "path": None}]}


# -------------------------------------------------------------------- happy paths
def test_parquet_rows_become_chat_messages_with_exact_pixels(tmp_path):
    a, b, c = noise(1), noise(2, (7, 5, 3)), noise(3)
    rows = [
        {"problem": "<image>Find x.", "answer": " 12 ", "images": [{"bytes": encode(a), "path": "a.png"}]},
        {
            "problem": "Compare <image> with<image>. Which is larger?",
            "answer": "5\\sqrt{3}",
            "images": [{"bytes": encode(b), "path": None}, {"bytes": encode(c), "path": None}],
        },
    ]
    path = write_parquet(tmp_path / "train.parquet", rows)
    ds = load_prompt_dataset(path, system_prompt="SYS", tools=GEO3K_TOOLS)
    assert len(ds) == 2 and ds.skipped == [] and ds.num_skipped == 0

    s0, s1 = ds[0], ds[1]
    assert isinstance(s0, Sample)
    assert (s0.index, s1.index) == (0, 1)
    assert s0.label == "12" and s1.label == "5\\sqrt{3}"
    assert s0.metadata == {"row": 0, "source": path, "tools": GEO3K_TOOLS}

    assert s0.prompt[0] == {"role": "system", "content": "SYS"}
    assert [m["role"] for m in s0.prompt] == ["system", "user"]
    content0 = s0.prompt[1]["content"]
    assert [item["type"] for item in content0] == ["image", "text"]  # leading empty text dropped
    assert content0[1] == {"type": "text", "text": "Find x."}
    np.testing.assert_array_equal(pixels_of_url(content0[0]["image"]), a)

    content1 = s1.prompt[1]["content"]
    assert [item["type"] for item in content1] == ["text", "image", "text", "image", "text"]
    assert [item.get("text") for item in content1 if item["type"] == "text"] == [
        "Compare ",
        " with",
        ". Which is larger?",
    ]
    np.testing.assert_array_equal(pixels_of_url(content1[1]["image"]), b)
    np.testing.assert_array_equal(pixels_of_url(content1[3]["image"]), c)


def test_image_modes_are_converted_like_an_independent_reference(tmp_path):
    rgb = noise(4)
    jpeg = encode(rgb, "JPEG", quality=80)
    gray = noise(5, (10, 12))
    rgba = np.concatenate([np.zeros((10, 12, 3), np.uint8), np.zeros((10, 12, 1), np.uint8)], axis=2)
    rgba[:5, :, 3] = 255  # top half opaque black, bottom half fully transparent (stored as black)
    rgba[:5, :, :3] = noise(6, (5, 12, 3))
    wide = (np.arange(120, dtype=np.uint16).reshape(10, 12) * 550).astype(np.uint16)  # 16-bit gray
    rows = [
        {"problem": "<image>", "answer": "1", "images": [{"bytes": jpeg, "path": None}]},
        {"problem": "<image>", "answer": "2", "images": [{"bytes": encode(gray), "path": None}]},
        {"problem": "<image>", "answer": "3", "images": [{"bytes": encode(rgba), "path": None}]},
        {"problem": "<image>", "answer": "4", "images": [{"bytes": encode(wide), "path": None}]},
    ]
    ds = load_prompt_dataset(write_parquet(tmp_path / "m.parquet", rows))
    url = lambda i: ds[i].prompt[-1]["content"][0]["image"]  # noqa: E731

    # JPEG: the lossless re-encode keeps exactly what a plain decode of the source gives.
    np.testing.assert_array_equal(pixels_of_url(url(0)), np.asarray(Image.open(io.BytesIO(jpeg)).convert("RGB")))
    # Gray: replicated into three channels.
    np.testing.assert_array_equal(pixels_of_url(url(1)), np.repeat(gray[:, :, None], 3, axis=2))
    # Alpha: blended onto white (numpy), so a transparent diagram background is white, not black.
    alpha = rgba[:, :, 3:].astype(np.float64) / 255
    expected = np.round(rgba[:, :, :3] * alpha + 255 * (1 - alpha)).astype(np.uint8)
    np.testing.assert_array_equal(pixels_of_url(url(2)), expected)
    assert (pixels_of_url(url(2))[5:] == 255).all()
    # 16-bit gray: scaled to 8 bits (65535 -> 255), not clipped.
    np.testing.assert_array_equal(pixels_of_url(url(3)), np.repeat(np.round(wide / 257.0).astype(np.uint8)[:, :, None], 3, axis=2))


def test_jsonl_with_relative_paths_data_urls_and_base64(tmp_path):
    imgs = [noise(10 + k) for k in range(6)]
    (tmp_path / "img").mkdir()
    for k in (0, 1, 5):
        (tmp_path / "img" / f"{k}.png").write_bytes(encode(imgs[k]))
    abs_path = str(tmp_path / "img" / "1.png")
    data_url = "data:image/png;base64," + base64.b64encode(encode(imgs[2])).decode()
    bare_b64 = base64.b64encode(encode(imgs[3])).decode()
    dict_b64 = {"bytes": base64.b64encode(encode(imgs[4])).decode(), "path": None}
    rows = [
        {"problem": "<image>Find x.", "answer": "3", "images": ["img/0.png"]},
        {"problem": "<image> and <image>", "answer": "4", "images": [abs_path, data_url]},
        {"problem": "<image><image><image>", "answer": "5", "images": [bare_b64, dict_b64, {"path": "img/5.png"}]},
    ]
    ds = load_prompt_dataset(write_jsonl(tmp_path / "d.jsonl", rows))
    got = [
        pixels_of_url(item["image"])
        for i in range(3)
        for item in ds[i].prompt[-1]["content"]
        if item["type"] == "image"
    ]
    assert len(got) == 6
    for k in range(6):
        np.testing.assert_array_equal(got[k], imgs[k])
    assert [ds[i].label for i in range(3)] == ["3", "4", "5"]
    assert ds[1].prompt[-1]["content"][1] == {"type": "text", "text": " and "}


def test_parquet_path_only_image_is_read_relative_to_the_file(tmp_path):
    img = noise(20)
    (tmp_path / "p.png").write_bytes(encode(img))
    rows = [{"problem": "<image>", "answer": "1", "images": [{"bytes": None, "path": "p.png"}]}]
    ds = load_prompt_dataset(write_parquet(tmp_path / "p.parquet", rows))
    np.testing.assert_array_equal(pixels_of_url(ds[0].prompt[-1]["content"][0]["image"]), img)


def test_sample_round_trip_keeps_prompt_and_pixels(tmp_path):
    img = noise(30)
    path = write_parquet(tmp_path / "r.parquet", [{"problem": "<image>Find x.", "answer": "7.5", "images": [{"bytes": encode(img), "path": None}]}])
    sample = load_geo3k_dataset(path)[0]
    wire = json.dumps(sample.to_dict())  # must be JSON-serialisable as is
    back = Sample.from_dict(json.loads(wire))
    assert back.prompt == sample.prompt and back.label == "7.5" and back.metadata == sample.metadata
    assert back.metadata["tools"] == GEO3K_TOOLS
    url = back.prompt[-1]["content"][0]["image"]
    np.testing.assert_array_equal(np.asarray(data_url_to_image(url)), img)


def test_getitem_returns_fresh_copies(tmp_path):
    ds = load_prompt_dataset(write_parquet(tmp_path / "f.parquet", [good_row(1)]), tools=GEO3K_TOOLS)
    first = ds[0]
    first.prompt[-1]["content"].clear()
    first.metadata["tools"][0]["function"]["name"] = "changed"
    first.label = "changed"
    again = ds[0]
    assert len(again.prompt[-1]["content"]) == 2 and again.label == "12"
    assert again.metadata["tools"][0]["function"]["name"] == GEO3K_TOOL_NAME
    assert GEO3K_TOOLS[0]["function"]["name"] == GEO3K_TOOL_NAME
    with pytest.raises(IndexError):
        ds[1]


def test_geo3k_defaults_and_user_instruction(tmp_path):
    path = write_parquet(tmp_path / "g.parquet", [good_row(1)])
    s = load_geo3k_dataset(path, instruction=GEO3K_USER_INSTRUCTION)[0]
    assert s.prompt[0] == {"role": "system", "content": GEO3K_SYSTEM_PROMPT}
    assert s.prompt[1]["content"][-1] == {"type": "text", "text": "Find x.\n\n" + GEO3K_USER_INSTRUCTION}
    with pytest.raises(DatasetError, match="instruction"):
        load_prompt_dataset(path, instruction="see <image>")


def test_prompt_tool_example_matches_the_tool_schema():
    """The system prompt's example call must parse and use only the schema's arguments."""
    assert "\\boxed{}" in GEO3K_SYSTEM_PROMPT
    start = GEO3K_SYSTEM_PROMPT.index("<tool_call>") + len("<tool_call>")
    call = json.loads(GEO3K_SYSTEM_PROMPT[start : GEO3K_SYSTEM_PROMPT.index("</tool_call>")])
    (tool,) = GEO3K_TOOLS
    fn = tool["function"]
    assert tool["type"] == "function" and call["name"] == fn["name"] == GEO3K_TOOL_NAME
    assert set(call["arguments"]) == set(fn["parameters"]["properties"]) == set(fn["parameters"]["required"])
    json.dumps(GEO3K_TOOLS)


def test_prompt_style_takes_the_task_prompt_from_the_task_module_loaded_by_path(tmp_path):
    path = write_parquet(tmp_path / "s.parquet", [good_row(1)])
    assert PROMPT_STYLES == {"geo3k": "envs.geo3k", "plain": None}
    assert load_task_prompt("envs.geo3k") == envs_geo3k.TASK_PROMPT
    assert envs_geo3k.TASK_PROMPT == TaskPrompt(system_prompt=GEO3K_SYSTEM_PROMPT, tools=GEO3K_TOOLS)
    geo3k = load_styled_dataset(path, "geo3k")[0]
    assert geo3k.prompt[0] == {"role": "system", "content": GEO3K_SYSTEM_PROMPT}
    assert geo3k.metadata["tools"] == GEO3K_TOOLS
    assert load_styled_dataset(path, "geo3k", system_prompt="")[0].prompt == geo3k.prompt  # empty: the task's own
    assert load_styled_dataset(path, "geo3k", system_prompt="S")[0].prompt[0] == {"role": "system", "content": "S"}
    plain = load_styled_dataset(path, "plain")[0]
    assert plain.prompt[0]["role"] == "user" and "tools" not in plain.metadata
    assert load_styled_dataset(path, "plain", system_prompt="S")[0].prompt[0] == {"role": "system", "content": "S"}
    # A task module given by file path, like an env.
    task = tmp_path / "my_task.py"
    task.write_text("from envs.base import TaskPrompt\nTASK_PROMPT = TaskPrompt(instruction='Be brief.')\n")
    mine = load_styled_dataset(path, str(task))[0]
    assert mine.prompt == [{"role": "user", "content": [*plain.prompt[0]["content"][:-1],
                                                        {"type": "text", "text": "Find x.\n\nBe brief."}]}]
    with pytest.raises(DatasetError, match="unknown prompt style 'fancy'"):
        load_styled_dataset(path, "fancy")
    with pytest.raises(DatasetError, match="envs.letter_game.*has no TASK_PROMPT"):
        load_styled_dataset(path, "envs.letter_game")
    with pytest.raises(DatasetError, match="cannot import 'envs.nope'"):
        load_styled_dataset(path, "envs.nope")


def test_max_rows_keeps_the_first_usable_rows(tmp_path):
    rows = [good_row(k, answer=str(k)) for k in range(5)]
    ds = load_prompt_dataset(write_parquet(tmp_path / "m.parquet", rows), max_rows=3)
    assert [ds[i].label for i in range(len(ds))] == ["0", "1", "2"]


# ---------------------------------------------------------------------- bad rows
PNG = encode(noise(99))


def _img(raw: bytes) -> list[dict]:
    return [{"bytes": raw, "path": None}]


# (name, format, bad row, expected cause fragment)
BAD_ROWS = [
    ("missing_problem", "jsonl", {"answer": "1", "images": []}, "missing field 'problem'"),
    ("null_answer", "parquet", {"problem": "<image>", "answer": None, "images": _img(PNG)}, "missing field 'answer'"),
    ("answer_wrong_type", "jsonl", {"problem": "x", "answer": 12, "images": []}, "field 'answer' has type int"),
    ("images_wrong_type", "jsonl", {"problem": "<image>", "answer": "1", "images": "a.png"}, "field 'images' has type str"),
    ("empty_answer", "parquet", {"problem": "<image>", "answer": "  ", "images": _img(PNG)}, "empty answer"),
    ("marker_mismatch", "parquet", {"problem": "<image><image>Find x.", "answer": "1", "images": _img(PNG)}, "2 <image> markers but 1 images"),
    ("truncated_png", "parquet", {"problem": "<image>", "answer": "1", "images": _img(PNG[: len(PNG) // 2])}, "undecodable image"),
    ("garbage_bytes", "parquet", {"problem": "<image>", "answer": "1", "images": _img(b"not an image at all")}, "undecodable image"),
    ("bad_checksum", "parquet", {"problem": "<image>", "answer": "1", "images": _img(bad_crc_png(PNG))}, "undecodable image"),
    ("bad_pixel_data", "parquet", {"problem": "<image>", "answer": "1", "images": _img(bad_zlib_png(PNG))}, "undecodable image"),
    ("missing_file", "jsonl", {"problem": "<image>", "answer": "1", "images": ["nope/missing.png"]}, "image file not found"),
    ("not_path_nor_b64", "jsonl", {"problem": "<image>", "answer": "1", "images": ["nope/missing"]}, "neither an existing file"),
    ("invalid_json", "jsonl", '{"problem": "<image>", "answer": ', "invalid JSON"),
    ("not_an_object", "jsonl", "[1, 2]", "row is a list"),
    ("empty_line", "jsonl", "", "empty line"),
]


def _write_with_bad_middle_row(tmp_path: Path, fmt: str, bad) -> str:
    if fmt == "parquet":
        return write_parquet(tmp_path / "bad.parquet", [good_row(1, "a"), bad, good_row(2, "b")])
    good = [{"problem": "<image>Find x.", "answer": ans, "images": ["ok.png"]} for ans in ("a", "b")]
    (tmp_path / "ok.png").write_bytes(PNG)
    return write_jsonl(tmp_path / "bad.jsonl", [good[0], bad, good[1]])


@pytest.mark.parametrize("name,fmt,bad,cause", BAD_ROWS, ids=[b[0] for b in BAD_ROWS])
def test_bad_row_raises_naming_file_row_and_cause(tmp_path, name, fmt, bad, cause):
    path = _write_with_bad_middle_row(tmp_path, fmt, bad)
    with pytest.raises(DatasetError) as info:
        load_prompt_dataset(path)
    message = str(info.value)
    assert path in message and "row 1" in message and cause in message, message


@pytest.mark.parametrize("name,fmt,bad,cause", BAD_ROWS, ids=[b[0] for b in BAD_ROWS])
def test_bad_row_is_skipped_recorded_and_logged(tmp_path, caplog, name, fmt, bad, cause):
    path = _write_with_bad_middle_row(tmp_path, fmt, bad)
    with caplog.at_level(logging.WARNING, logger="jaxrl_vlm.data.geo3k"):
        ds = load_prompt_dataset(path, on_bad_row="skip")
    assert [ds[i].label for i in range(len(ds))] == ["a", "b"]
    assert [ds[i].metadata["row"] for i in range(len(ds))] == [0, 2]
    assert ds.num_skipped == 1 and ds.skipped[0][0] == 1 and cause in ds.skipped[0][1]
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "skipped 1 of 3 rows" in warnings[0].getMessage()


def test_file_level_errors(tmp_path):
    good = write_parquet(tmp_path / "ok.parquet", [good_row(1)])
    with pytest.raises(DatasetError, match="on_bad_row"):
        load_prompt_dataset(good, on_bad_row="ignore")
    with pytest.raises(DatasetError, match="not found"):
        load_prompt_dataset(str(tmp_path / "absent.parquet"))
    (tmp_path / "x.csv").write_text("problem,answer\n")
    with pytest.raises(DatasetError, match="unsupported dataset format"):
        load_prompt_dataset(str(tmp_path / "x.csv"))
    with pytest.raises(DatasetError, match=r"missing column\(s\) \['question'\]"):
        load_prompt_dataset(good, input_key="question")
    # A jsonl file in which no row has the column is the file's error too, under either policy (a column that
    # only some rows lack is theirs: BAD_ROWS' missing_problem).
    rows = write_jsonl(tmp_path / "rows.jsonl", [{"question": "<image>", "answer": "1", "images": []}] * 2)
    for policy in ("error", "skip"):
        with pytest.raises(DatasetError, match=r"rows.jsonl: missing column\(s\) \['problem'\] \(no row has it\); "
                                               r"the rows have \['answer', 'images', 'question'\]"):
            load_prompt_dataset(rows, on_bad_row=policy)
    (tmp_path / "junk.parquet").write_bytes(b"PAR1 this is not parquet")
    with pytest.raises(DatasetError, match="cannot read parquet"):
        load_prompt_dataset(str(tmp_path / "junk.parquet"))
    all_bad = write_parquet(tmp_path / "all_bad.parquet", [{"problem": "<image>", "answer": "", "images": _img(PNG)}])
    with pytest.raises(DatasetError, match="no usable rows"):
        load_prompt_dataset(all_bad, on_bad_row="skip")


def test_custom_keys(tmp_path):
    path = write_jsonl(tmp_path / "k.jsonl", [{"q": "Find x.", "gold": "9", "pics": []}])
    s = load_prompt_dataset(path, input_key="q", label_key="gold", image_key="pics")[0]
    assert s.label == "9" and s.prompt == [{"role": "user", "content": [{"type": "text", "text": "Find x."}]}]


# ---------------------------------------------------------------------- iterator
@pytest.fixture(scope="module")
def seven(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("seven")
    return load_prompt_dataset(write_parquet(tmp / "s.parquet", [good_row(k, str(k)) for k in range(7)]))


def rows_of(batch: list[Sample]) -> list[int]:
    return [s.metadata["row"] for s in batch]


def test_iterator_epochs_are_permutations_and_deterministic(seven):
    it = PromptIterator(seven, batch_size=3, shuffle=True, seed=5)
    stream = [r for _ in range(7) for r in rows_of(next(it))]  # 21 rows = exactly 3 epochs
    epochs = [stream[0:7], stream[7:14], stream[14:21]]
    for e in epochs:
        assert sorted(e) == list(range(7))
    assert len({tuple(e) for e in epochs}) > 1  # reshuffled between epochs
    assert it.state_dict()["epoch"] == 3 and it.state_dict()["position"] == 0

    same = PromptIterator(seven, batch_size=3, shuffle=True, seed=5)
    assert [r for _ in range(7) for r in rows_of(next(same))] == stream
    other = PromptIterator(seven, batch_size=3, shuffle=True, seed=6)
    assert [r for _ in range(7) for r in rows_of(next(other))] != stream

    ordered = PromptIterator(seven, batch_size=4, shuffle=False)
    assert rows_of(next(ordered)) == [0, 1, 2, 3]
    assert rows_of(next(ordered)) == [4, 5, 6, 0]  # a batch runs on into the next epoch
    assert rows_of(PromptIterator(seven, batch_size=9, shuffle=False).next_batch()) == [0, 1, 2, 3, 4, 5, 6, 0, 1]


def test_iterator_resume_gives_exactly_the_same_next_batches(seven):
    run = PromptIterator(seven, batch_size=3, seed=11)
    for _ in range(5):  # stop mid-epoch (15 rows = epoch 2, position 1)
        next(run)
    state = json.loads(json.dumps(run.state_dict()))
    assert (state["epoch"], state["position"], state["seed"]) == (2, 1, 11)
    expected = [rows_of(next(run)) for _ in range(4)]

    resumed = PromptIterator(seven, batch_size=3, seed=0)  # the saved seed wins
    resumed.load_state_dict(state)
    assert [rows_of(next(resumed)) for _ in range(4)] == expected

    with pytest.raises(ValueError, match="saved for 8 rows"):
        resumed.load_state_dict({**state, "num_rows": 8})
    with pytest.raises(ValueError, match="missing 'epoch'"):
        resumed.load_state_dict({"position": 0, "seed": 1})
    with pytest.raises(ValueError, match="position 7"):
        resumed.load_state_dict({**state, "position": 7})
    with pytest.raises(ValueError, match="batch_size"):
        PromptIterator(seven, batch_size=0)


# ---------------------------------------------------------------------- boundary
def test_data_package_does_not_import_jax():
    code = "import sys, jaxrl_vlm.data; assert 'jax' not in sys.modules and 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True)
