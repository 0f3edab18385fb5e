"""Issue 17 row 13 (part): a damaged parquet file gives a DatasetError naming the file and the row group.

A small Geometry3K-layout parquet file with several row groups is damaged inside one row group's data page (the
byte range comes from the file's own metadata: `data_page_offset` and `total_compressed_size`). pyarrow alone
raises a bare OSError without the file or the row group. The loader reads row group by row group and names the
damaged one, under both bad-row policies: an unreadable part of a file is damage, not a bad sample (see
`jaxrl_vlm.data.geo3k.iter_parquet`).
"""

from __future__ import annotations

import io
import re
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from jaxrl_vlm.data import DatasetError, load_prompt_dataset

ROWS_PER_GROUP = 3
GROUPS = 3
IMAGES_TYPE = pa.list_(pa.struct([("bytes", pa.binary()), ("path", pa.string())]))


def _png(seed: int) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (10, 12, 3), dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def write_groups(path: Path, **write_kw) -> str:
    """GROUPS row groups of ROWS_PER_GROUP good rows each (answer k for row k)."""
    n = ROWS_PER_GROUP * GROUPS
    table = pa.table({
        "problem": pa.array([f"<image>Find x in figure {k}." for k in range(n)], pa.string()),
        "answer": pa.array([str(k) for k in range(n)], pa.string()),
        "images": pa.array([[{"bytes": _png(k), "path": None}] for k in range(n)], IMAGES_TYPE),
    })
    pq.write_table(table, path, row_group_size=ROWS_PER_GROUP, **write_kw)
    assert pq.ParquetFile(path).metadata.num_row_groups == GROUPS
    return str(path)


def data_page_range(path: str, group: int, column: str) -> tuple[int, int]:
    """[start, end) of the data pages of `column` in row group `group`, from the file's metadata.

    The column chunk spans `total_compressed_size` bytes from its first page (the dictionary page if there is
    one); its data pages start at `data_page_offset`.
    """
    md = pq.ParquetFile(path).metadata.row_group(group)
    for j in range(md.num_columns):
        chunk = md.column(j)
        if chunk.path_in_schema == column:
            first = chunk.dictionary_page_offset if chunk.has_dictionary_page else chunk.data_page_offset
            return chunk.data_page_offset, first + chunk.total_compressed_size
    raise AssertionError(f"no column {column!r} in row group {group}")


def damage(path: str, group: int, column: str, how: str) -> None:
    start, end = data_page_range(path, group, column)
    data = bytearray(Path(path).read_bytes())
    if how == "zero_middle":  # 8 zero bytes in the middle of the data pages (header or values)
        mid = (start + end) // 2 - 4
        data[mid : mid + 8] = bytes(8)
    elif how == "flip_value_byte":  # one bit in the middle of the values: only a page checksum can notice
        data[(start + end) // 2] ^= 0x01
    else:
        raise AssertionError(how)
    Path(path).write_bytes(bytes(data))


CASES = [
    # (what, writer options, row group, column, damage)
    ("snappy page, problem column", {}, 1, "problem", "zero_middle"),
    ("zstd page, image bytes", {"compression": "zstd"}, 1, "images.list.element.bytes", "zero_middle"),
    # Plain values and no statistics, so the page is mostly the image bytes (the CRC covers them, not the header).
    ("uncompressed page with CRC", {"compression": "none", "write_page_checksum": True, "use_dictionary": False,
                                    "write_statistics": False}, 2, "images.list.element.bytes", "flip_value_byte"),
]


@pytest.mark.parametrize("policy", ["error", "skip"])
@pytest.mark.parametrize(("what", "write_kw", "group", "column", "how"), CASES, ids=[c[0] for c in CASES])
def test_a_corrupt_page_names_the_file_and_row_group(tmp_path, policy, what, write_kw, group, column, how):
    path = write_groups(tmp_path / "train.parquet", **write_kw)
    assert len(load_prompt_dataset(path, on_bad_row=policy)) == ROWS_PER_GROUP * GROUPS  # intact: every row
    # pyarrow alone: a bare error naming neither the file nor the row group (the fault of issue 17).
    damage(path, group, column, how)
    with pytest.raises((OSError, pa.ArrowException)) as raw:
        pq.ParquetFile(path, page_checksum_verification=True).read()
    assert path not in str(raw.value) and "row group" not in str(raw.value)

    first = group * ROWS_PER_GROUP
    with pytest.raises(DatasetError) as e:
        load_prompt_dataset(path, on_bad_row=policy)
    message = str(e.value)
    assert message.startswith(f"{path}: row group {group} of {GROUPS} (rows {first}..{first + ROWS_PER_GROUP - 1})")
    assert "is unreadable" in message and "re-download or repair" in message
    assert type(e.value.__cause__) is type(raw.value)  # pyarrow's own error is kept as the cause, and named
    assert f"({type(raw.value).__name__}: " in message


def test_skip_policy_still_skips_bad_rows_but_never_an_unreadable_row_group(tmp_path):
    """The line between the two: a row whose image is broken is a bad sample (skipped and counted under
    'skip'); a row group that cannot be read at all is file damage (always an error)."""
    n = ROWS_PER_GROUP * GROUPS
    images = [[{"bytes": _png(k) if k != 4 else b"not an image", "path": None}] for k in range(n)]
    table = pa.table({
        "problem": pa.array(["<image>Find x."] * n, pa.string()),
        "answer": pa.array([str(k) for k in range(n)], pa.string()),
        "images": pa.array(images, IMAGES_TYPE),
    })
    path = str(tmp_path / "rows.parquet")
    pq.write_table(table, path, row_group_size=ROWS_PER_GROUP)
    ds = load_prompt_dataset(path, on_bad_row="skip")
    assert len(ds) == n - 1 and [r for r, _ in ds.skipped] == [4] and ds.rows == [k for k in range(n) if k != 4]
    with pytest.raises(DatasetError, match=re.escape(f"{path}: row 4: image 0: undecodable image")):
        load_prompt_dataset(path, on_bad_row="error")

    damage(path, 2, "problem", "zero_middle")
    with pytest.raises(DatasetError, match=re.escape(f"{path}: row group 2 of {GROUPS} (rows 6..8) is unreadable")):
        load_prompt_dataset(path, on_bad_row="skip")
