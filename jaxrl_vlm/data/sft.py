"""Conversation datasets for supervised fine-tuning (`--loss-type sft_loss`): parquet or jsonl transcripts with
images, laid out as training Samples whose loss mask covers exactly the assistant turns.

Row layout (slime's SFT rows, `--input-key messages`, with its `--multimodal-keys '{"image": "images"}'`):

- `messages` (`--input-key`; default `messages` for SFT): the conversation, a list of `{"role", "content"}` in
  OpenAI / HF chat style. Roles: `system` (first message only), `user`, `assistant`, `tool`. `content` is a
  string in which each `<image>` marker stands for the next image of the row, or a list of
  `{"type": "text", "text": ...}` and `{"type": "image"}` items (each image item takes the next image). An
  optional `step_loss_mask` (slime's key) of 0 keeps an assistant message as context but out of the loss. Keys the
  chat template reads besides (`tool_calls`, `reasoning_content`, `name`) are passed to it as they are; a key set
  to None counts as absent (parquet gives every message every field of its struct); any other key is a bad row.
- `images` (`--image-key`, optional): the row's images in marker order over the whole conversation, in any form
  the prompt loader reads (parquet `{"bytes", "path"}`; jsonl paths, data URLs, base64 or base64 `{"bytes",
  "path"}`), under the same byte and pixel caps, decoded, checked and re-encoded as lossless PNG data URLs.
- `tools` (`--tool-key`, optional): tool schemas (a list, or its JSON string) that the chat template renders, as
  a task's tools are rendered in rollout (geo3k's `calc_geo3k_reward`).

Unknown columns are ignored. `envs/transcripts.py` writes this layout (`jaxrl-vlm make-dataset --sft`).

Each row is rendered and tokenized when the file is loaded (`rollout.encoding.encode_transcript`: the pieces a
rollout would have, assistant turns standing for the model's tokens; mask 1 on each trained assistant turn's
content and `<|im_end|>`), so a row the template cannot lay out is a bad row at startup, under `on_bad_row` like
the prompt loader's bad rows. Images are processed (pixel values, pads expanded as the engine expands them) only
when a Sample is built (`dataset[i]`), so a large dataset does not hold every image's patches.

This module never imports jax.
"""

from __future__ import annotations

import copy
import json
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
from jinja2.exceptions import TemplateError

from jaxrl_vlm.data.geo3k import (
    BAD_ROW_POLICIES,
    IMAGE_MARKER,
    BadRow,
    DatasetError,
    MissingField,
    check_jsonl_column,
    image_to_data_url,
    iter_jsonl,
    iter_parquet,
    load_row_image,
    require_field,
)
from rollout.encoding import ChatEncoder, EncodedTranscript, TranscriptError, encode_transcript
from rollout.processing import DEFAULT_MAX_IMAGE_BYTES, DEFAULT_MAX_IMAGE_PIXELS, ImageReadPolicy
from rollout.sample import Sample, Status

logger = logging.getLogger(__name__)

ROLES = ("system", "user", "assistant", "tool")
# Message keys passed to the chat template unchanged (besides role and content).
TEMPLATE_KEYS = ("tool_calls", "reasoning_content", "name")
STEP_LOSS_MASK = "step_loss_mask"


@dataclass(frozen=True)
class _Conversation:
    row: int
    messages: list[dict[str, Any]]  # chat messages; image items carry PNG data URLs
    tools: list[dict] | None
    transcript: EncodedTranscript


def _content_items(content: Any, where: str, images: list[str], next_image: int) -> tuple[list[dict[str, Any]] | str, int]:
    """A message's content with its images filled in: (content, index of the next unused image)."""
    if isinstance(content, str):
        if IMAGE_MARKER not in content:
            return content, next_image
        items: list[dict[str, Any]] = []
        pieces = content.split(IMAGE_MARKER)
        for k, piece in enumerate(pieces):
            if piece:
                items.append({"type": "text", "text": piece})
            if k < len(pieces) - 1:
                if next_image >= len(images):
                    raise BadRow(f"{where}: more {IMAGE_MARKER} markers than the row's {len(images)} images")
                items.append({"type": "image", "image": images[next_image]})
                next_image += 1
        return items, next_image
    if isinstance(content, (list, tuple)):
        items = []
        for j, item in enumerate(content):
            kind = item.get("type") if isinstance(item, dict) else None
            if kind == "text" and isinstance(item.get("text"), str):
                items.append({"type": "text", "text": item["text"]})
            elif kind == "image":
                if next_image >= len(images):
                    raise BadRow(f"{where}: more image items than the row's {len(images)} images")
                items.append({"type": "image", "image": images[next_image]})
                next_image += 1
            else:
                raise BadRow(f"{where}: content item {j} is {item!r}, expected {{'type': 'text', 'text': str}} or "
                             "{'type': 'image'}")
        return items, next_image
    raise BadRow(f"{where}: content has type {type(content).__name__}, expected a string or a list of items")


def _parse_tools(value: Any, tool_key: str) -> list[dict] | None:
    if value is None:
        return None
    if isinstance(value, str):
        if not value.strip():
            return None
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise BadRow(f"field {tool_key!r} is not JSON ({exc})") from exc
    if not isinstance(value, list) or not all(isinstance(t, dict) for t in value):
        raise BadRow(f"field {tool_key!r} must be a list of tool schemas (objects), got {type(value).__name__}")
    return value or None


def parse_conversation(record: Any, *, fmt: str, base_dir: str, input_key: str, image_key: str, tool_key: str,
                       caps: ImageReadPolicy) -> tuple[list[dict[str, Any]], list[bool], list[dict] | None]:
    """(chat messages with PNG data-URL image items, trained flag per assistant message, tools) of one row;
    raises BadRow naming the message and the cause."""
    if not isinstance(record, dict):
        raise BadRow(f"row is a {type(record).__name__}, expected an object")
    raw_messages = require_field(record, input_key, (list, tuple), "list of messages")
    raw_images = record.get(image_key)
    if raw_images is None:
        raw_images = []
    if not isinstance(raw_images, (list, tuple)):
        raise BadRow(f"field {image_key!r} has type {type(raw_images).__name__}, expected list")
    images = [image_to_data_url(load_row_image(item, base_dir, k, fmt, caps)) for k, item in enumerate(raw_images)]
    tools = _parse_tools(record.get(tool_key), tool_key)
    messages: list[dict[str, Any]] = []
    trained: list[bool] = []
    next_image = 0
    for i, raw in enumerate(raw_messages):
        where = f"field {input_key!r} message {i}"
        if not isinstance(raw, dict):
            raise BadRow(f"{where} is a {type(raw).__name__}, expected an object with role and content")
        present = {k: v for k, v in raw.items() if v is not None}
        unknown = sorted(set(present) - {"role", "content", STEP_LOSS_MASK, *TEMPLATE_KEYS})
        if unknown:
            raise BadRow(f"{where} has unknown key(s) {unknown} (known: role, content, {STEP_LOSS_MASK}, "
                         f"{', '.join(TEMPLATE_KEYS)})")
        role = present.get("role")
        if role not in ROLES:
            raise BadRow(f"{where}: role {role!r} is not one of {list(ROLES)}")
        if role == "system" and i > 0:
            raise BadRow(f"{where}: a system message must come first")
        content, next_image = _content_items(present.get("content", ""), where, images, next_image)
        message: dict[str, Any] = {"role": role, "content": content}
        message.update({k: present[k] for k in TEMPLATE_KEYS if k in present})
        step_mask = present.get(STEP_LOSS_MASK, 1)
        if step_mask not in (0, 1) or isinstance(step_mask, bool):
            raise BadRow(f"{where}: {STEP_LOSS_MASK} must be 0 or 1, got {step_mask!r}")
        if role == "assistant":
            trained.append(step_mask == 1)
        elif step_mask != 1:
            raise BadRow(f"{where}: {STEP_LOSS_MASK} applies to assistant messages only (a {role} message is never "
                         "trained)")
        messages.append(message)
    if next_image != len(images):
        raise BadRow(f"the messages place {next_image} images but field {image_key!r} has {len(images)}")
    return messages, trained, tools


class ConversationDataset:
    """The usable conversations of one file; `dataset[i]` builds a fresh training Sample each call.

    The interface of `PromptDataset` (len, indexing, `rows`, `skipped`, `source`), so `PromptIterator` batches it
    and eval sets slice it the same way.
    """

    def __init__(self, conversations: list[_Conversation], *, source: str, encoder: ChatEncoder,
                 skipped: list[tuple[int, str]] | None = None) -> None:
        self._conversations = conversations
        self.source = source
        self.encoder = encoder
        self.skipped: list[tuple[int, str]] = list(skipped or [])

    @property
    def num_skipped(self) -> int:
        return len(self.skipped)

    @property
    def rows(self) -> list[int]:
        """File row number of each dataset item, in order."""
        return [c.row for c in self._conversations]

    def __len__(self) -> int:
        return len(self._conversations)

    def transcript(self, i: int) -> EncodedTranscript:
        """Item `i`'s wire-view tokens and mask (no image processed)."""
        return self._conversations[i].transcript

    def __getitem__(self, i: int) -> Sample:
        """A finished Sample: `tokens` the whole conversation (pads expanded), the response from the first trained
        token on, `loss_mask` 1 on the assistant tokens, zero rollout log-probs (there was no rollout)."""
        if not isinstance(i, (int, np.integer)):
            raise TypeError(f"ConversationDataset index must be an int, got {type(i).__name__}")
        n = len(self._conversations)
        if not -n <= i < n:
            raise IndexError(f"index {i} out of range for dataset of {n} conversations ({self.source})")
        c = self._conversations[int(i)]
        ids, mask, urls, mm = c.transcript.training_view(self.encoder)
        first = mask.index(1)  # encode_transcript guarantees a trained token, never the first (a header precedes)
        response = len(ids) - first
        metadata: dict[str, Any] = {"row": c.row, "source": self.source}
        if c.tools is not None:
            metadata["tools"] = copy.deepcopy(c.tools)
        return Sample(
            index=c.row, prompt=copy.deepcopy(c.messages), tokens=ids, response_length=response,
            loss_mask=mask[first:], rollout_log_probs=[0.0] * response, image_data=urls, multimodal_train_inputs=mm,
            status=Status.COMPLETED, metadata=metadata,
        )

    def __iter__(self) -> Iterator[Sample]:
        for i in range(len(self)):
            yield self[i]


def load_conversation_dataset(
    path: str,
    encoder: ChatEncoder,
    *,
    input_key: str = "messages",
    image_key: str = "images",
    tool_key: str = "tools",
    on_bad_row: str = "error",
    max_image_bytes: int = DEFAULT_MAX_IMAGE_BYTES,
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
) -> ConversationDataset:
    """Load a `.parquet` or `.jsonl` conversation file (module docstring) and encode every row with `encoder`
    (the model's tokenizer, chat template and image processor).

    on_bad_row: "error" raises DatasetError at the first bad row (naming file, row and cause); "skip" drops it,
    records it in `dataset.skipped` and logs one warning. A bad row is one the layout above rejects, or whose
    conversation the chat template cannot lay out with an exact assistant mask (no assistant turn, images in an
    assistant turn, a template error). A damaged file or a missing `input_key` column is an error either way.
    """
    if on_bad_row not in BAD_ROW_POLICIES:
        raise DatasetError(f"on_bad_row must be one of {BAD_ROW_POLICIES}, got {on_bad_row!r}")
    try:
        caps = ImageReadPolicy(max_bytes=max_image_bytes, max_pixels=max_image_pixels)
    except ValueError as exc:
        raise DatasetError(str(exc)) from exc
    if not os.path.isfile(path):
        raise DatasetError(f"{path}: dataset file not found")
    lower = path.lower()
    if lower.endswith(".parquet"):
        fmt, rows = "parquet", iter_parquet(path, [input_key], optional=[image_key, tool_key])
    elif lower.endswith(".jsonl"):
        fmt, rows = "jsonl", iter_jsonl(path)
    else:
        raise DatasetError(f"{path}: unsupported dataset format (expected .parquet or .jsonl)")

    base_dir = os.path.dirname(os.path.abspath(path))
    conversations: list[_Conversation] = []
    skipped: list[tuple[int, str]] = []
    checked: set[str] = set()  # jsonl fields found in some row (`check_jsonl_column`)
    total = 0
    for row, record in rows:
        total += 1
        try:
            if isinstance(record, BadRow):
                raise record
            messages, trained, tools = parse_conversation(
                record, fmt=fmt, base_dir=base_dir, input_key=input_key, image_key=image_key, tool_key=tool_key,
                caps=caps)
            try:
                transcript = encode_transcript(encoder, messages, tools=tools, trained_turns=trained)
            # The template's own raise_exception (unknown role or content item) is jinja's TemplateError.
            except (TranscriptError, TemplateError) as exc:
                raise BadRow(f"chat template: {exc}") from exc
        except BadRow as bad:
            if isinstance(bad, MissingField) and fmt == "jsonl" and bad.key not in checked:
                check_jsonl_column(path, bad.key)
                checked.add(bad.key)
            where = f"{path}: row {row}" + (f" (line {row + 1})" if fmt == "jsonl" else "")
            if on_bad_row == "error":
                raise DatasetError(f"{where}: {bad}") from bad.__cause__
            skipped.append((row, str(bad)))
            continue
        conversations.append(_Conversation(row, messages, tools, transcript))

    if skipped:
        shown = "; ".join(f"row {r}: {why}" for r, why in skipped[:5])
        more = f"; ... and {len(skipped) - 5} more" if len(skipped) > 5 else ""
        logger.warning("%s: skipped %d of %d rows (on_bad_row='skip'): %s%s", path, len(skipped), total, shown, more)
    if not conversations:
        raise DatasetError(f"{path}: no usable conversations ({total} read, {len(skipped)} skipped)")
    return ConversationDataset(conversations, source=path, encoder=encoder, skipped=skipped)
