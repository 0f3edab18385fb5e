"""Load a Geometry3K-style prompt dataset (parquet or jsonl) into prompt `Sample`s.

Row layout (HF `hiyouga/geometry3k`): `problem` is text with one `<image>` marker
per image, `answer` a non-empty string, `images` a list of images. In parquet an
image is `{"bytes": <png/jpeg bytes>, "path": ...}` (bytes win; a path alone is
read relative to the file's directory). In jsonl an image is a path (relative to
the file's directory), a `data:` URL, a base64 string, or a `{"bytes", "path"}` dict
with base64 bytes. Unknown columns/keys are ignored.

Every image is checked against byte and pixel caps (`max_image_bytes`, `max_image_pixels`: its size
before it is read, its width x height from its header before any pixel is decoded), then verified and
fully decoded with PIL, converted to RGB (alpha is
composited onto white, so transparent diagrams do not turn black) and re-encoded
losslessly as a PNG data URL: the Sample stays JSON-serialisable and the engine
decodes exactly the pixels the trainer's processor sees.

A bad row (missing field, broken image, ...) is an error or skipped (`on_bad_row`). A damaged file is
always an error: a parquet row group that cannot be read (a corrupt page; page CRCs are verified where
the writer stored them) raises DatasetError naming the file and the row group, under either policy. So is
a file without a column that every row needs (its prompt column, say): the error names the file, the column
and the columns the file has.

What a task adds to each prompt (system prompt, tool schema, instruction) is not defined here: it is
the `TASK_PROMPT` of the task module (e.g. `envs.geo3k`), imported by path like the env
(`load_task_dataset`, `load_styled_dataset` for `--prompt-style`).

This module never imports jax: rollout hosts load datasets too.
"""

from __future__ import annotations

import base64
import binascii
import copy
import io
import json
import logging
import os
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image

from envs.base import TaskPrompt
from jaxrl_vlm.errors import ConfigError
from rollout.loading import LoadError, load_module
from rollout.processing import (
    DEFAULT_MAX_IMAGE_BYTES,
    DEFAULT_MAX_IMAGE_PIXELS,
    ImageReadPolicy,
    ImageTooLarge,
    check_image_pixels,
)
from rollout.sample import Sample

logger = logging.getLogger(__name__)

IMAGE_MARKER = "<image>"
BAD_ROW_POLICIES = ("error", "skip")
_DATA_URL_RE = re.compile(r"^data:(?P<mime>[\w/+.-]*)(?P<params>(;[^,;]*)*?);base64,(?P<data>.*)$", re.DOTALL)
# Leading bytes of PNG, JPEG, GIF, BMP, WEBP (RIFF) and TIFF files.
_IMAGE_MAGIC = (b"\x89PNG", b"\xff\xd8\xff", b"GIF8", b"BM", b"RIFF", b"II*\x00", b"MM\x00*")
_IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".gif", ".bmp", ".webp", ".tif", ".tiff")


class DatasetError(ConfigError):
    """A dataset file or row is unusable; the message names the file, the row and the cause."""


class BadRow(Exception):
    """The cause of one bad row (raised by the row parsers here and in `data/sft.py`), turned into DatasetError or a
    skip record by the loader (`on_bad_row`)."""


class MissingField(BadRow):
    """A row without the required field `key`: a bad row, unless no row of the file has it (`check_jsonl_column`)."""

    def __init__(self, key: str) -> None:
        super().__init__(f"missing field {key!r}")
        self.key = key


# ----------------------------------------------------------------------------- images
def image_to_data_url(image: Image.Image) -> str:
    """Encode a PIL image as a lossless `data:image/png;base64,...` URL (RGB, alpha over white)."""
    rgb = to_rgb(image)
    buf = io.BytesIO()
    rgb.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def data_url_to_image(url: str) -> Image.Image:
    """Decode a base64 `data:` URL into a loaded PIL image (raises ValueError if it is not one)."""
    match = _DATA_URL_RE.match(url)
    if match is None:
        raise ValueError(f"not a base64 data URL: {url[:40]!r}")
    raw = base64.b64decode(match.group("data"), validate=True)
    image = Image.open(io.BytesIO(raw))
    image.load()
    return image


def to_rgb(image: Image.Image) -> Image.Image:
    """8-bit RGB view of `image`.

    Transparency is composited onto white (diagram backgrounds are often transparent,
    and dropping alpha would turn them black). 16-bit grayscale is scaled to 8 bits
    (PIL's own conversion clips every value above 255 to white).
    """
    if image.mode.startswith("I;16"):
        wide = np.asarray(image, dtype=np.float64)
        image = Image.fromarray(np.round(wide / 257.0).astype(np.uint8))  # 2-D uint8 -> mode "L"
    has_alpha = image.mode in ("RGBA", "LA", "PA", "RGBa", "La") or "transparency" in image.info
    if has_alpha:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return image.convert("RGB") if image.mode != "RGB" else image


def _too_many_bytes(n: int, caps: ImageReadPolicy, what: str) -> BadRow:
    return BadRow(f"{what}: {n} bytes, more than the cap of {caps.max_bytes} bytes (max_image_bytes)")


def _decode_image_bytes(raw: bytes, what: str, caps: ImageReadPolicy) -> Image.Image:
    """Verify and fully decode image bytes within `caps`; `what` names the image in the error."""
    if len(raw) > caps.max_bytes:
        raise _too_many_bytes(len(raw), caps, what)
    try:
        with Image.open(io.BytesIO(raw)) as probe:
            check_image_pixels(probe.size, caps.max_pixels, what)  # from the header, before any pixel is decoded
            probe.verify()  # checks structure/CRCs without decoding pixels
        image = Image.open(io.BytesIO(raw))
        image.load()  # decodes every pixel: catches corrupt data that verify() misses
        image = to_rgb(image)
    # PIL's decoders raise many unrelated types (OSError, SyntaxError, ValueError,
    # struct.error, EOFError, DecompressionBombError, ...); each is a bad image here,
    # reported with its type and message, never swallowed.
    except ImageTooLarge as exc:
        raise BadRow(str(exc)) from exc
    except Exception as exc:  # noqa: BLE001
        raise BadRow(f"{what}: undecodable image ({type(exc).__name__}: {exc})") from exc
    return image


def _read_image_file(path: str, base_dir: str, what: str, caps: ImageReadPolicy) -> Image.Image:
    full = path if os.path.isabs(path) else os.path.join(base_dir, path)
    if not os.path.isfile(full):
        raise BadRow(f"{what}: image file not found: {full}")
    size = os.path.getsize(full)
    if size > caps.max_bytes:
        raise _too_many_bytes(size, caps, f"{what} ({full})")
    with open(full, "rb") as f:
        raw = f.read(caps.max_bytes + 1)  # capped even if the file grows meanwhile
    return _decode_image_bytes(raw, f"{what} ({full})", caps)


def _b64decode(text: str, what: str, caps: ImageReadPolicy) -> bytes:
    if len(text) // 4 * 3 > caps.max_bytes + 3:  # before decoding: base64 carries 3 bytes per 4 chars
        raise _too_many_bytes(len(text) // 4 * 3, caps, what)
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise BadRow(f"{what}: invalid base64 ({exc})") from exc


def load_row_image(item: Any, base_dir: str, k: int, fmt: str, caps: ImageReadPolicy) -> Image.Image:
    """Resolve one entry of the `images` list to a decoded PIL image (within the byte and pixel `caps`)."""
    what = f"image {k}"
    if isinstance(item, dict):
        raw, path = item.get("bytes"), item.get("path")
        if raw is not None:
            if isinstance(raw, str) and fmt == "jsonl":
                raw = _b64decode(raw, what, caps)
            if not isinstance(raw, (bytes, bytearray)):
                raise BadRow(f"{what}: 'bytes' has type {type(raw).__name__}, expected bytes")
            return _decode_image_bytes(bytes(raw), what, caps)
        if isinstance(path, str) and path:
            return _read_image_file(path, base_dir, what, caps)
        raise BadRow(f"{what}: has neither 'bytes' nor 'path'")
    if isinstance(item, (bytes, bytearray)):
        return _decode_image_bytes(bytes(item), what, caps)
    if isinstance(item, str) and fmt == "jsonl":
        if item.startswith("data:"):
            match = _DATA_URL_RE.match(item)
            if match is None:
                raise BadRow(f"{what}: malformed data URL (expected data:<mime>;base64,<data>)")
            return _decode_image_bytes(_b64decode(match.group("data"), what, caps), what, caps)
        full = item if os.path.isabs(item) else os.path.join(base_dir, item)
        if os.path.isfile(full) or item.lower().endswith(_IMAGE_SUFFIXES):
            return _read_image_file(item, base_dir, what, caps)
        # Not an existing file and not named like one: a bare base64 payload, recognised by
        # its image signature (otherwise a mistyped path would be reported as a broken image).
        if len(item) // 4 * 3 > caps.max_bytes + 3:
            raise _too_many_bytes(len(item) // 4 * 3, caps, what)
        try:
            raw = base64.b64decode(item, validate=True)
        except (binascii.Error, ValueError):
            raw = b""
        if not raw.startswith(_IMAGE_MAGIC):
            raise BadRow(f"{what}: {item[:60]!r} is neither an existing file ({full}) nor base64 image data")
        return _decode_image_bytes(raw, what, caps)
    raise BadRow(f"{what}: has type {type(item).__name__}, expected a path, data URL, base64 string or bytes dict")


# ------------------------------------------------------------------------------- rows
@dataclass(frozen=True)
class _Prompt:
    row: int
    messages: list[dict[str, Any]]
    label: str


def require_field(record: dict[str, Any], key: str, kind: type | tuple[type, ...], kind_name: str) -> Any:
    if key not in record or record[key] is None:
        raise MissingField(key)
    value = record[key]
    if not isinstance(value, kind):
        raise BadRow(f"field {key!r} has type {type(value).__name__}, expected {kind_name}")
    return value


def build_messages(
    problem: str,
    image_urls: list[str],
    *,
    system_prompt: str | None = None,
    instruction: str | None = None,
) -> list[dict[str, Any]]:
    """Chat messages: optional system message, then one user message.

    The user content lists text and image items in order; each `<image>` marker
    of `problem` is replaced by the matching image item and empty text pieces are
    dropped. `instruction`, if given, is appended to the user text after a blank line.
    """
    text = problem if instruction is None else f"{problem.rstrip()}\n\n{instruction}"
    pieces = text.split(IMAGE_MARKER)
    if len(pieces) - 1 != len(image_urls):
        raise ValueError(f"{len(pieces) - 1} {IMAGE_MARKER} markers but {len(image_urls)} images")
    content: list[dict[str, Any]] = []
    for k, piece in enumerate(pieces):
        if piece:
            content.append({"type": "text", "text": piece})
        if k < len(image_urls):
            content.append({"type": "image", "image": image_urls[k]})
    messages: list[dict[str, Any]] = []
    if system_prompt is not None:
        messages.append({"role": "system", "content": system_prompt})
    messages.append({"role": "user", "content": content})
    return messages


def _parse_row(
    record: Any,
    *,
    fmt: str,
    base_dir: str,
    input_key: str,
    label_key: str,
    image_key: str,
    system_prompt: str | None,
    instruction: str | None,
    caps: ImageReadPolicy,
) -> tuple[list[dict[str, Any]], str]:
    if not isinstance(record, dict):
        raise BadRow(f"row is a {type(record).__name__}, expected an object")
    problem = require_field(record, input_key, str, "str")
    answer = require_field(record, label_key, str, "str")
    images = require_field(record, image_key, (list, tuple), "list")
    if not answer.strip():
        raise BadRow(f"empty answer in field {label_key!r}")
    n_markers = problem.count(IMAGE_MARKER)
    if n_markers != len(images):
        raise BadRow(f"field {input_key!r} has {n_markers} {IMAGE_MARKER} markers but {len(images)} images")
    urls = [image_to_data_url(load_row_image(item, base_dir, k, fmt, caps)) for k, item in enumerate(images)]
    return build_messages(problem, urls, system_prompt=system_prompt, instruction=instruction), answer.strip()


def iter_jsonl(path: str) -> Iterator[tuple[int, Any]]:
    """(row, record) per line; row = line number - 1. A line that is not JSON yields a BadRow."""
    with open(path, encoding="utf-8") as f:
        for row, line in enumerate(f):
            if not line.strip():
                yield row, BadRow("empty line")
                continue
            try:
                yield row, json.loads(line)
            except json.JSONDecodeError as exc:
                yield row, BadRow(f"invalid JSON ({exc})")


def check_jsonl_column(path: str, key: str) -> None:
    """Raise DatasetError when no row of the jsonl file at `path` has the field `key` (a file without its prompt
    column, or an `--input-key` naming another one). Every row would be bad, so it is the file's error under
    either bad-row policy, as a parquet file without the column is (`iter_parquet`), never a run of skips. Reads
    until a row has the field: a loader calls it at the first row without it."""
    keys: set[str] = set()
    for _, record in iter_jsonl(path):
        if isinstance(record, dict):
            if key in record:
                return
            keys.update(record)
    raise DatasetError(f"{path}: missing column(s) {[key]} (no row has it); the rows have {sorted(keys)}")


# What pyarrow raises for damaged parquet data: a bad page or a failed decompression is a bare OSError, a bad
# encoding an ArrowInvalid (a ValueError), bad UTF-8 a UnicodeDecodeError (a ValueError too).
_PARQUET_READ_ERRORS = (pa.ArrowException, OSError, ValueError)


def iter_parquet(path: str, columns: list[str], optional: Sequence[str] = ()) -> Iterator[tuple[int, Any]]:
    """(row, record) per row, read one row group at a time so that a damaged one is named. `columns` must exist;
    the `optional` ones are read where the file has them.

    Pages are checked against their CRC where the writer stored one (`page_checksum_verification`). A row group
    that cannot be read (a corrupt page, failed decompression, bad encoding) raises DatasetError naming the file,
    the row group and its rows, under either bad-row policy: it is damage to the file, not a bad sample. The
    loader reads the whole file before training starts, so this stops a run at startup, never midway; and
    silently training on whatever part of a damaged file still reads would change the dataset (and its size,
    which a resumed data cursor checks) without anyone deciding to. Re-download or repair the file.
    """
    try:
        pf = pq.ParquetFile(path, page_checksum_verification=True)
    except _PARQUET_READ_ERRORS as exc:
        raise DatasetError(f"{path}: cannot read parquet file ({type(exc).__name__}: {exc})") from exc
    names = pf.schema_arrow.names
    missing = [c for c in columns if c not in names]
    if missing:
        # A missing column makes every row bad: a file-level error under either policy.
        raise DatasetError(f"{path}: missing column(s) {missing}; the file has {names}")
    columns = [*columns, *(c for c in optional if c in names and c not in columns)]
    row = 0
    n_groups = pf.metadata.num_row_groups
    for group in range(n_groups):
        first, size = row, pf.metadata.row_group(group).num_rows
        batches = pf.iter_batches(batch_size=256, row_groups=[group], columns=columns)
        while True:
            try:
                batch = next(batches, None)
                records = None if batch is None else batch.to_pylist()
            except _PARQUET_READ_ERRORS as exc:
                raise DatasetError(
                    f"{path}: row group {group} of {n_groups} (rows {first}..{first + size - 1}) is unreadable "
                    f"({type(exc).__name__}: {exc}); the file is damaged: re-download or repair it "
                    "(on_bad_row='skip' skips bad rows, not unreadable parts of a file)"
                ) from exc
            if records is None:
                break
            for record in records:
                yield row, record
                row += 1


# ---------------------------------------------------------------------------- dataset
class PromptDataset:
    """The usable prompts of one file. `dataset[i]` builds a fresh prompt Sample each call.

    `skipped` lists `(row, reason)` of rows dropped under `on_bad_row="skip"`.
    """

    def __init__(
        self,
        prompts: list[_Prompt],
        *,
        source: str,
        tools: list[dict] | None = None,
        skipped: list[tuple[int, str]] | None = None,
    ) -> None:
        self._prompts = prompts
        self.source = source
        self.tools = copy.deepcopy(tools)
        self.skipped: list[tuple[int, str]] = list(skipped or [])

    @property
    def num_skipped(self) -> int:
        return len(self.skipped)

    @property
    def rows(self) -> list[int]:
        """File row number of each dataset item, in order."""
        return [p.row for p in self._prompts]

    def __len__(self) -> int:
        return len(self._prompts)

    def __getitem__(self, i: int) -> Sample:
        if not isinstance(i, (int, np.integer)):
            raise TypeError(f"PromptDataset index must be an int, got {type(i).__name__}")
        n = len(self._prompts)
        if not -n <= i < n:
            raise IndexError(f"index {i} out of range for dataset of {n} prompts ({self.source})")
        p = self._prompts[int(i)]
        metadata: dict[str, Any] = {"row": p.row, "source": self.source}
        if self.tools is not None:
            metadata["tools"] = copy.deepcopy(self.tools)
        return Sample(prompt=copy.deepcopy(p.messages), label=p.label, index=p.row, metadata=metadata)

    def __iter__(self) -> Iterator[Sample]:
        for i in range(len(self)):
            yield self[i]


def load_prompt_dataset(
    path: str,
    *,
    input_key: str = "problem",
    label_key: str = "answer",
    image_key: str = "images",
    on_bad_row: str = "error",
    system_prompt: str | None = None,
    tools: list[dict] | None = None,
    max_rows: int | None = None,
    instruction: str | None = None,
    max_image_bytes: int = DEFAULT_MAX_IMAGE_BYTES,
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
) -> PromptDataset:
    """Load a `.parquet` or `.jsonl` prompt file (see the module docstring for the layout).

    on_bad_row: "error" raises DatasetError at the first bad row (naming file, row
    and cause); "skip" drops bad rows, records them in `dataset.skipped` and logs
    one warning. A damaged file is an error under either policy: a parquet row group
    that cannot be read (corrupt page) raises DatasetError naming the file and the row
    group (`iter_parquet`), as does a column that no row has (parquet: the schema; jsonl:
    `check_jsonl_column`). max_rows: keep at most this many usable rows (None = all).
    instruction: optional text appended to each user message (e.g. envs.geo3k's GEO3K_USER_INSTRUCTION).
    max_image_bytes / max_image_pixels: caps of one image (a row with a larger one is a bad row), checked
    before the image is read or decoded.
    """
    if on_bad_row not in BAD_ROW_POLICIES:
        raise DatasetError(f"on_bad_row must be one of {BAD_ROW_POLICIES}, got {on_bad_row!r}")
    if max_rows is not None and (not isinstance(max_rows, int) or max_rows < 1):
        raise DatasetError(f"max_rows must be a positive int or None, got {max_rows!r}")
    if instruction is not None and IMAGE_MARKER in instruction:
        raise DatasetError(f"instruction must not contain {IMAGE_MARKER!r}")
    try:
        caps = ImageReadPolicy(max_bytes=max_image_bytes, max_pixels=max_image_pixels)
    except ValueError as exc:
        raise DatasetError(str(exc)) from exc
    if not os.path.isfile(path):
        raise DatasetError(f"{path}: dataset file not found")
    lower = path.lower()
    if lower.endswith(".parquet"):
        fmt, rows = "parquet", iter_parquet(path, [input_key, label_key, image_key])
    elif lower.endswith(".jsonl"):
        fmt, rows = "jsonl", iter_jsonl(path)
    else:
        raise DatasetError(f"{path}: unsupported dataset format (expected .parquet or .jsonl)")

    base_dir = os.path.dirname(os.path.abspath(path))
    prompts: list[_Prompt] = []
    skipped: list[tuple[int, str]] = []
    checked: set[str] = set()  # jsonl fields found in some row (`check_jsonl_column`)
    total = 0
    for row, record in rows:
        total += 1
        try:
            if isinstance(record, BadRow):
                raise record
            messages, label = _parse_row(
                record,
                fmt=fmt,
                base_dir=base_dir,
                input_key=input_key,
                label_key=label_key,
                image_key=image_key,
                system_prompt=system_prompt,
                instruction=instruction,
                caps=caps,
            )
        except BadRow as bad:
            if isinstance(bad, MissingField) and fmt == "jsonl" and bad.key not in checked:
                check_jsonl_column(path, bad.key)
                checked.add(bad.key)
            where = f"{path}: row {row}" + (f" (line {row + 1})" if fmt == "jsonl" else "")
            if on_bad_row == "error":
                raise DatasetError(f"{where}: {bad}") from bad.__cause__
            skipped.append((row, str(bad)))
            continue
        prompts.append(_Prompt(row=row, messages=messages, label=label))
        if max_rows is not None and len(prompts) >= max_rows:
            break

    if skipped:
        shown = "; ".join(f"row {r}: {why}" for r, why in skipped[:5])
        more = f"; ... and {len(skipped) - 5} more" if len(skipped) > 5 else ""
        logger.warning("%s: skipped %d of %d rows (on_bad_row='skip'): %s%s", path, len(skipped), total, shown, more)
    if not prompts:
        raise DatasetError(f"{path}: no usable rows ({total} read, {len(skipped)} skipped)")
    return PromptDataset(prompts, source=path, tools=tools, skipped=skipped)


# ------------------------------------------------------------------------------ tasks
#: `--prompt-style` -> the task module (loaded by path, like the env) whose `TASK_PROMPT` shapes each
#: prompt; None: the bare problem (and the configured system prompt, if any).
GEO3K_TASK = "envs.geo3k"
PROMPT_STYLES: dict[str, str | None] = {"geo3k": GEO3K_TASK, "plain": None}


def load_task_prompt(task: str) -> TaskPrompt:
    """The `TASK_PROMPT` of the task module `task` (a dotted module name or a `.py` file)."""
    try:
        module = load_module(task, "--prompt-style")
    except LoadError as exc:
        raise DatasetError(str(exc)) from exc
    prompt = getattr(module, "TASK_PROMPT", None)
    if not isinstance(prompt, TaskPrompt):
        raise DatasetError(f"task module {task!r} has no TASK_PROMPT (an envs.base.TaskPrompt), got {type(prompt).__name__}")
    return prompt


def load_task_dataset(path: str, task: str, **overrides: Any) -> PromptDataset:
    """`load_prompt_dataset` with the task's `TASK_PROMPT` (system prompt, tools, instruction); `overrides` win."""
    prompt = load_task_prompt(task)
    kwargs: dict[str, Any] = {
        "system_prompt": prompt.system_prompt, "tools": prompt.tools, "instruction": prompt.instruction,
    }
    kwargs.update(overrides)
    return load_prompt_dataset(path, **kwargs)


def load_geo3k_dataset(path: str, **overrides: Any) -> PromptDataset:
    """`load_task_dataset` of the Geometry3K task (`envs.geo3k`): tool-calling system prompt and tool schema."""
    return load_task_dataset(path, GEO3K_TASK, **overrides)


def load_styled_dataset(path: str, prompt_style: str, *, system_prompt: str | None = None,
                        **kwargs: Any) -> PromptDataset:
    """The dataset as `--prompt-style` and `--system-prompt` configure it.

    "plain": the bare problem, with `system_prompt` as the system message when it is not None. A task
    style (a `PROMPT_STYLES` name, or a task module path): the task's `TASK_PROMPT`, with a non-empty
    `system_prompt` replacing the task's own.
    """
    if prompt_style not in PROMPT_STYLES and "." not in prompt_style:  # a module path has a dot (or ends in .py)
        raise DatasetError(f"unknown prompt style {prompt_style!r}: one of {sorted(PROMPT_STYLES)} or a task module path")
    task = PROMPT_STYLES.get(prompt_style, prompt_style)
    if task is None:
        return load_prompt_dataset(path, system_prompt=system_prompt, **kwargs)
    return load_task_dataset(path, task, **kwargs, **({"system_prompt": system_prompt} if system_prompt else {}))


# --------------------------------------------------------------------------- iterator
class PromptIterator:
    """Endless batches of prompt Samples, epoch after epoch, deterministic by seed.

    Epoch `e` visits the dataset in the order `default_rng([seed, e]).permutation(n)`
    (or 0..n-1 without shuffle), so the order depends only on (seed, epoch) and a
    run resumed from `state_dict()` sees exactly the same next batch. A batch that
    reaches the end of an epoch continues into the next one, so every prompt is
    used equally often and `batch_size` may exceed the dataset size.
    """

    def __init__(self, dataset: PromptDataset, batch_size: int, *, shuffle: bool = True, seed: int = 0) -> None:
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        if not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seed must be a non-negative int, got {seed!r}")
        if len(dataset) == 0:
            raise ValueError("PromptIterator needs a non-empty dataset")
        self.dataset = dataset
        self.batch_size = batch_size
        self.shuffle = bool(shuffle)
        self.seed = seed
        self.epoch = 0
        self.position = 0  # next index into the current epoch's order
        self._order_epoch: int | None = None
        self._order: np.ndarray | None = None

    def _epoch_order(self) -> np.ndarray:
        if self._order_epoch != self.epoch:
            n = len(self.dataset)
            if self.shuffle:
                self._order = np.random.default_rng([self.seed, self.epoch]).permutation(n)
            else:
                self._order = np.arange(n)
            self._order_epoch = self.epoch
        assert self._order is not None
        return self._order

    def __iter__(self) -> "PromptIterator":
        return self

    def __next__(self) -> list[Sample]:
        return self.next_batch()

    def next_batch(self) -> list[Sample]:
        batch: list[Sample] = []
        n = len(self.dataset)
        while len(batch) < self.batch_size:
            order = self._epoch_order()
            take = min(self.batch_size - len(batch), n - self.position)
            batch.extend(self.dataset[int(i)] for i in order[self.position : self.position + take])
            self.position += take
            if self.position == n:
                self.epoch += 1
                self.position = 0
        return batch

    def state_dict(self) -> dict[str, Any]:
        """JSON-safe cursor: epoch, position, seed (+ shuffle and num_rows, checked on load)."""
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "num_rows": len(self.dataset),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a cursor from `state_dict()`; the seed in `state` replaces this iterator's."""
        for key in ("epoch", "position", "seed"):
            if key not in state:
                raise ValueError(f"PromptIterator state is missing {key!r}: {state!r}")
            if not isinstance(state[key], (int, np.integer)) or int(state[key]) < 0:
                raise ValueError(f"PromptIterator state {key}={state[key]!r} must be a non-negative int")
        n = len(self.dataset)
        if "num_rows" in state and int(state["num_rows"]) != n:
            raise ValueError(
                f"PromptIterator state was saved for {state['num_rows']} rows, but {self.dataset.source} has {n}"
            )
        if "shuffle" in state and bool(state["shuffle"]) != self.shuffle:
            raise ValueError(f"PromptIterator state has shuffle={state['shuffle']}, iterator has {self.shuffle}")
        if int(state["position"]) >= n:
            raise ValueError(f"PromptIterator state position {state['position']} >= dataset size {n}")
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
        self.seed = int(state["seed"])
        self._order_epoch = None
