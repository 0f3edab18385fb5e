"""Debug dumps of rollout samples: one JSON line per episode, with the conversation split into turns.

`dump_samples(samples, path, tokenizer)` is what `jaxrl-vlm rollout CONFIG --dump FILE.jsonl` writes: per sample
its identity, status and termination, reward and label, token counts, a summary of the loss mask as runs, the
weight versions that sampled it, its errors, and per turn the decoded text of the model's tokens and of the
observation tokens that followed them. `validate_dump(path)` re-reads a dump and checks its invariants.

The turn split comes from the sample's own token stream, never from re-rendering text: a model turn is a maximal
run of model tokens (loss mask 1, or model tokens masked off-policy by partial rollout, which the driver records
in `metadata["offpolicy_masked_runs"]`), and the observation of that turn is the run of mask-0 tokens after it.
When the episode loop's `TurnRecord`s line up with that split (they do for every non-FAILED episode of the
default loop), each turn also carries its record's finish reason, latencies, retries and weight version.

Image pads are shown compacted (one `<|image_pad|>` per image) in decoded text, and so are clips: each clip as the
chat template wrote it, one `<|video_pad|>` between the template's vision markers; the timestamps (`<0.5 seconds>`)
and inner vision markers of its frame groups are dropped from the text (the clip's frame count and fps are in its
reference, and the `tokens` rows keep every token). Token counts are always in the training view (pads expanded).

For the trajectory viewer (`jaxrl-vlm view`, `jaxrl_vlm/viewer/`), `dump_samples` (unless `images=False`) also writes
every picture the engine received (`Sample.image_data`: already at the image processor's size) as a PNG next to
the dump, in `<dump stem>_images/`, shrunk to at most `thumbnail_px` on its longer side, and references them from
the record (`prompt_images`, per turn `images`, each `{"file", "width", "height", "sent_width", "sent_height"}`,
the file relative to the dump's directory); and, per turn, `tokens`: `[text, loss_mask, log_prob, count]` per
response token (a run of image pads, or of video pads, is one entry with its count), so the viewer colours tokens
by mask and shows log-probs; with on-policy distillation (a sample with `teacher_log_probs`) also
`teacher_logprobs`, the teacher's log-prob of each `tokens` row (null on observation rows and image pads), shown
beside the student's.

Clips (`Sample.video_data`, every frame the engine received, in order) are written the same way, one PNG per frame
(`g<group>_i<index>_clip<k>_f<j>.png`, shrunk like pictures), and referenced as `prompt_clips` and per turn `clips`,
each `{"frames": [file, ...], "fps", "width", "height", "sent_width", "sent_height"}` (a turn's also `"row"`: the
index in its `tokens` of the clip's first video-pad row, where the viewer puts the player). A clip belongs to the
prompt or to the turn whose tokens hold its first pad. Which pads are one clip's: with the sample's
`video_grid_thw` (one row per clip), `t*h*w / VIDEO_MERGE_SIZE**2` pads each, taken in order over the runs of
video pads (a clip is several runs for Qwen3-VL-style models: one per frame group, each after its timestamp text
and between vision markers); without grids, or when they do not fit the runs, from the token structure: a run
continues the clip before it exactly when it follows that clip's last `<|vision_end|>` with only a timestamp and a
`<|vision_start|>` between (Qwen2.5-VL's clips are one run each). The record's `num_clips` counts the sample's clips.

`validate_dump` checks both when present: files exist (every frame of every clip), counts add up to the turn's
tokens, a clip has at least one frame and a positive fps, a turn's clip `row` points at a video-pad row.

This module never imports jax.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import enum
import io
import json
import math
import re
from bisect import bisect_right
from collections import defaultdict
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from PIL import Image

from rollout.sample import Sample, Status, Termination, TerminationKind, TurnRecord
from rollout.video import ClipError
from rollout.video_io import load_clip

DUMP_FORMAT = "jaxrl-vlm-rollout-dump/1"
IMAGE_PAD_TOKEN = "<|image_pad|>"
VIDEO_PAD_TOKEN = "<|video_pad|>"
VISION_START_TOKEN = "<|vision_start|>"
VISION_END_TOKEN = "<|vision_end|>"
#: A clip's pads are t*h*w / VIDEO_MERGE_SIZE**2 of its `video_grid_thw` row (2: every shipped family's merge size).
VIDEO_MERGE_SIZE = 2
#: A frame group's timestamp text in a Qwen3-VL-style clip.
_TIMESTAMP = re.compile(r"\s*<\d+(?:\.\d+)? seconds>\s*")
#: Longest run of tokens searched for a timestamp before a frame group's `<|vision_start|>`.
_TIMESTAMP_MAX_TOKENS = 24
#: Longest side, in pixels, of a picture written next to a dump for the viewer (a larger one is shrunk).
THUMBNAIL_PX = 256

# Per-turn fields copied from the episode loop's TurnRecords (summed or taken from the last record of a turn).
_RECORD_FIELDS = ("finish_reason", "engine_latency_s", "env_latency_s", "env_retries", "truncation_cause", "error",
                  "weight_version")
_REQUIRED_KEYS: dict[str, type] = {
    "format": str, "group_index": int, "index": int, "status": str, "prompt_tokens": int, "response_length": int,
    "model_tokens": int, "trained_tokens": int, "observation_tokens": int, "offpolicy_masked_tokens": int,
    "mask_runs": list, "turns": list, "turn_records": list, "records_aligned": bool, "weight_versions": list,
    "errors": list,
}
_TURN_KEYS: dict[str, type] = {
    "turn": int, "model_text": str, "model_tokens": int, "offpolicy_masked_tokens": int, "observation_text": str,
    "observation_tokens": int,
}


class DumpError(ValueError):
    """A dump file breaks an invariant; the message names the file, the line and the key."""


@dataclasses.dataclass(frozen=True)
class TurnSpan:
    """Token ranges of one turn, as offsets into the response: model tokens [model_start, obs_start), then the
    observation [obs_start, end). `masked` counts model tokens masked off-policy (they come first in the turn)."""

    model_start: int
    obs_start: int
    end: int
    masked: int


# ----------------------------------------------------------------------------- pure helpers
def mask_runs(mask: Sequence[int]) -> list[list[int]]:
    """Run-length summary of a loss mask: `[[value, length], ...]`, e.g. [1,1,0,0,0,1] -> [[1,2],[0,3],[1,1]]."""
    runs: list[list[int]] = []
    for m in mask:
        m = int(m)
        if runs and runs[-1][0] == m:
            runs[-1][1] += 1
        else:
            runs.append([m, 1])
    return runs


def model_token_flags(sample: Sample) -> list[bool]:
    """Per response token: True where the model sampled it (mask 1, or masked off-policy by the driver)."""
    flags = [m == 1 for m in sample.loss_mask]
    for start, length in sample.metadata.get("offpolicy_masked_runs", ()):
        start, length = int(start), int(length)
        if start < 0 or start + length > len(flags):
            raise DumpError(f"{sample.name}: offpolicy_masked_runs [{start}, {length}] outside the response "
                            f"of {len(flags)} tokens")
        flags[start : start + length] = [True] * length
    return flags


def split_turns(sample: Sample) -> list[TurnSpan]:
    """The turns of a response from its token flags: each model run opens a turn, the following observation closes it.

    A response that starts with observation tokens (possible in custom episode functions) gets a first turn
    with no model tokens.
    """
    flags = model_token_flags(sample)
    masked = set()
    for start, length in sample.metadata.get("offpolicy_masked_runs", ()):
        masked.update(range(int(start), int(start) + int(length)))
    spans: list[TurnSpan] = []
    i, n = 0, len(flags)
    while i < n:
        model_start = i
        while i < n and flags[i]:
            i += 1
        obs_start = i
        while i < n and not flags[i]:
            i += 1
        spans.append(TurnSpan(model_start, obs_start, i, sum(1 for k in range(model_start, obs_start) if k in masked)))
    return spans


def _records_by_turn(records: Sequence[TurnRecord]) -> list[dict[str, Any]]:
    """TurnRecords merged per turn index (a resumed turn has several), keeping turns that generated tokens."""
    merged: dict[int, dict[str, Any]] = {}
    generated: dict[int, int] = defaultdict(int)
    for r in records:
        generated[r.turn] += r.generated_tokens
        entry = merged.setdefault(r.turn, {"engine_latency_s": 0.0, "env_latency_s": 0.0, "env_retries": 0})
        entry["engine_latency_s"] += r.engine_latency_s
        entry["env_latency_s"] += r.env_latency_s
        entry["env_retries"] += r.env_retries
        for key in ("finish_reason", "truncation_cause", "error", "weight_version"):
            if getattr(r, key) is not None:
                entry[key] = getattr(r, key)
    out = []
    for turn in sorted(merged):
        if generated[turn] > 0:
            out.append({"turn": turn, "generated_tokens": generated[turn], **merged[turn]})
    return out


def _json_value(value: Any) -> Any:
    if isinstance(value, enum.Enum):  # a typed outcome (e.g. a TruncationCause) is written as its readable value
        return _json_value(value.value)
    if value is None or isinstance(value, (str, bool, int)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else repr(value)
    if isinstance(value, (list, tuple)):
        return [_json_value(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _json_value(v) for k, v in value.items()}
    return repr(value)


@dataclasses.dataclass(frozen=True)
class _Group:
    """One run of video pads [start, end) and its frame group's span [span_start, span_end): with a timestamp, from
    the timestamp through the group's `<|vision_end|>`; without, the pads alone."""

    start: int
    end: int
    span_start: int
    span_end: int
    timestamped: bool


@dataclasses.dataclass(frozen=True)
class _ClipLayout:
    """Where a sample's clips lie in its tokens: per clip (in order) the position of its first pad, and per token
    whether decoded text keeps it (a clip's span collapses to its first pad)."""

    first_pads: list[int]
    keep: list[bool]


def _runs(ids: Sequence[int], token: int | None) -> list[tuple[int, int]]:
    """Maximal runs [start, end) of `token` in `ids`."""
    if token is None:
        return []
    out: list[tuple[int, int]] = []
    for k, t in enumerate(ids):
        if t == token:
            if out and out[-1][1] == k:
                out[-1] = (out[-1][0], k + 1)
            else:
                out.append((k, k + 1))
    return out


class _Decoder:
    """Decodes token ids for display, collapsing each run of image pads to one pad and each clip to one video pad."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.image_pad = self._token_id(IMAGE_PAD_TOKEN)
        self.video_pad = self._token_id(VIDEO_PAD_TOKEN)
        self.vision_start = self._token_id(VISION_START_TOKEN)
        self.vision_end = self._token_id(VISION_END_TOKEN)

    def _token_id(self, token: str) -> int | None:
        tokenizer = self.tokenizer
        found = tokenizer.convert_tokens_to_ids(token) if hasattr(tokenizer, "convert_tokens_to_ids") else None
        unk = getattr(tokenizer, "unk_token_id", None)
        return found if isinstance(found, int) and found != unk else None

    def count_images(self, ids: Sequence[int]) -> int:
        """Pictures in a token run: its runs of image pads (a picture is one run; a clip's vision markers are not
        pictures)."""
        return len(_runs(ids, self.image_pad))

    # ------------------------------------------------------------------ clips
    def _timestamp_start(self, ids: Sequence[int], vision_start: int) -> int | None:
        """Where the timestamp text before the `<|vision_start|>` at `vision_start` begins, when that text is a
        timestamp (`<0.5 seconds>`) right after another vision marker; else None."""
        if self.vision_start is None or self.vision_end is None:
            return None
        markers = (self.vision_start, self.vision_end)
        k = vision_start - 1
        while k >= 0 and ids[k] not in markers and vision_start - k <= _TIMESTAMP_MAX_TOKENS:
            k -= 1
        if k < 0 or ids[k] not in markers or k + 1 == vision_start:
            return None
        text = self.tokenizer.decode([int(t) for t in ids[k + 1 : vision_start]], skip_special_tokens=False)
        return k + 1 if _TIMESTAMP.fullmatch(text) else None

    def _groups(self, ids: Sequence[int]) -> list[_Group]:
        groups = []
        for start, end in _runs(ids, self.video_pad):
            ts = (self._timestamp_start(ids, start - 1)
                  if start > 0 and self.vision_start is not None and ids[start - 1] == self.vision_start else None)
            if ts is None:
                groups.append(_Group(start, end, start, end, False))
            else:
                close = end + 1 if end < len(ids) and ids[end] == self.vision_end else end
                groups.append(_Group(start, end, ts, close, True))
        return groups

    def clip_layout(self, ids: Sequence[int], grid_thw: Any = None, n_clips: int | None = None) -> _ClipLayout:
        """The clips in `ids` (a sample's whole token list): by `grid_thw` (one row per clip) when it has `n_clips`
        rows and fits the runs of video pads, else by the token structure (module docstring)."""
        ids = [int(t) for t in ids]
        groups = self._groups(ids)
        clips = self._clips_by_grid(groups, grid_thw, n_clips) if grid_thw is not None else None
        if clips is None:
            clips = []
            for g in groups:
                if clips and g.timestamped and g.span_start == clips[-1][-1].span_end:
                    clips[-1].append(g)
                else:
                    clips.append([g])
        keep = [True] * len(ids)
        for clip in clips:
            for k in range(clip[0].span_start, clip[-1].span_end):
                keep[k] = k == clip[0].start
        return _ClipLayout([clip[0].start for clip in clips], keep)

    @staticmethod
    def _clips_by_grid(groups: list[_Group], grid_thw: Any, n_clips: int | None) -> list[list[_Group]] | None:
        try:
            rows = [tuple(int(x) for x in row) for row in grid_thw]
        except (TypeError, ValueError):
            return None
        if (n_clips is not None and len(rows) != n_clips) or any(len(r) != 3 for r in rows):
            return None
        merge2 = VIDEO_MERGE_SIZE**2
        clips: list[list[_Group]] = []
        at = 0
        for t, h, w in rows:
            if at == len(groups):  # clips whose pads are not in the tokens (an episode cut short)
                break
            need, clip = t * h * w, []
            if need <= 0 or need % merge2:
                return None
            need //= merge2
            while need > 0 and at < len(groups):
                clip.append(groups[at])
                need -= groups[at].end - groups[at].start
                at += 1
            if need != 0:  # a clip's pads end inside a run, or the tokens end inside a clip
                return None
            clips.append(clip)
        return clips if at == len(groups) else None

    def token_rows(self, ids: Sequence[int], mask: Sequence[int], logprobs: Sequence[float]) -> list[list[Any]]:
        """`[text, loss_mask, log_prob, count]` per token, a run of image (or video) pads as one entry with its
        count."""
        return self.token_rows_at(ids, mask, logprobs)[0]

    def token_rows_at(self, ids: Sequence[int], mask: Sequence[int], logprobs: Sequence[float]
                      ) -> tuple[list[list[Any]], list[int]]:
        """The rows and, per row, the offset of its first token."""
        rows: list[list[Any]] = []
        starts: list[int] = []
        ids = [int(t) for t in ids]
        texts = self.tokenizer.batch_decode([[t] for t in ids], skip_special_tokens=False) if ids else []
        pads = {self.image_pad: IMAGE_PAD_TOKEN, self.video_pad: VIDEO_PAD_TOKEN}
        pads.pop(None, None)
        for k, (t, m, lp, text) in enumerate(zip(ids, mask, logprobs, texts)):
            pad = pads.get(t)
            if pad is not None and rows and rows[-1][0] == pad and rows[-1][1] == int(m) and ids[k - 1] == t:
                rows[-1][3] += 1
                continue
            text = pad if pad is not None else text
            rows.append([text, int(m), round(float(lp), 4) if math.isfinite(float(lp)) else None, 1])
            starts.append(k)
        return rows, starts

    def __call__(self, ids: Sequence[int], keep: Sequence[bool] | None = None) -> str:
        """The text of `ids`, image pad runs compacted; `keep` (from `clip_layout`) drops the rest of each clip."""
        if keep is not None:
            ids = [t for t, k in zip(ids, keep) if k]
        if self.image_pad is not None:
            compact: list[int] = []
            for t in ids:
                if not (t == self.image_pad and compact and compact[-1] == self.image_pad):
                    compact.append(int(t))
            ids = compact
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)


# ----------------------------------------------------------------------------- writing
class _ImageWriter:
    """Writes a sample's pictures (PNG data URLs, as sent to the engine) and its clips' frames into
    `<dump stem>_images/`."""

    def __init__(self, dump_path: Path, thumbnail_px: int):
        self.root = dump_path.parent
        self.folder = dump_path.parent / f"{dump_path.stem}_images"
        self.thumbnail_px = thumbnail_px

    def write(self, sample: Sample, k: int) -> dict[str, Any]:
        url = sample.image_data[k]
        if not isinstance(url, str) or ";base64," not in url:
            raise DumpError(f"{sample.name}: image_data[{k}] is not a base64 data URL")
        try:
            image = Image.open(io.BytesIO(base64.b64decode(url.split(";base64,", 1)[1], validate=True)))
            image.load()
        except (binascii.Error, OSError, ValueError) as e:
            raise DumpError(f"{sample.name}: image_data[{k}] does not decode ({e})") from None
        sent = image.size
        image = self._shrink(image)
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / f"g{int(sample.group_index)}_i{int(sample.index)}_{k}.png"
        image.convert("RGB").save(path, format="PNG")
        return {"file": path.relative_to(self.root).as_posix(), "width": image.width, "height": image.height,
                "sent_width": sent[0], "sent_height": sent[1]}

    def _shrink(self, image: Image.Image) -> Image.Image:
        """At most `thumbnail_px` on the longer side (PIL's `thumbnail`); a smaller picture as it is."""
        if max(image.size) > self.thumbnail_px:
            image = image.copy()
            image.thumbnail((self.thumbnail_px, self.thumbnail_px))
        return image

    def write_clip(self, sample: Sample, k: int) -> dict[str, Any]:
        """Clip `k` of `sample.video_data` as one PNG per frame, in order; its reference (module docstring)."""
        try:
            clip = load_clip(sample.video_data[k])
        except (ClipError, OSError, ValueError, TypeError) as e:
            raise DumpError(f"{sample.name}: video_data[{k}] does not decode ({e})") from None
        self.folder.mkdir(parents=True, exist_ok=True)
        files = []
        size = (0, 0)
        for j, frame in enumerate(clip.frames):
            image = self._shrink(Image.fromarray(frame))
            size = image.size
            path = self.folder / f"g{int(sample.group_index)}_i{int(sample.index)}_clip{k}_f{j}.png"
            image.save(path, format="PNG")
            files.append(path.relative_to(self.root).as_posix())
        sent_h, sent_w = clip.frames.shape[1:3]
        return {"frames": files, "fps": float(clip.fps), "width": size[0], "height": size[1],
                "sent_width": int(sent_w), "sent_height": int(sent_h)}


def _video_grid(sample: Sample) -> Any:
    return (sample.multimodal_train_inputs or {}).get("video_grid_thw")


def _dump_record(sample: Sample, decode: _Decoder, images: _ImageWriter | None = None) -> dict[str, Any]:
    """The JSON-safe debug record of one sample (one line of a dump)."""
    prompt_len = sample.prompt_length
    response = sample.tokens[prompt_len:]
    spans = split_turns(sample)
    records = _records_by_turn(sample.turns)
    model_spans = [s for s in spans if s.obs_start > s.model_start]
    aligned = len(records) == len(model_spans) and all(
        r["generated_tokens"] == s.obs_start - s.model_start for r, s in zip(records, model_spans)
    )
    record_of = dict(zip(model_spans, records)) if aligned else {}
    layout = decode.clip_layout(sample.tokens, _video_grid(sample), len(sample.video_data))
    keep = layout.keep[prompt_len:]
    turns = []
    for k, span in enumerate(spans):
        turn: dict[str, Any] = {
            "turn": k,
            "model_text": decode(response[span.model_start : span.obs_start], keep[span.model_start : span.obs_start]),
            "model_tokens": span.obs_start - span.model_start,
            "offpolicy_masked_tokens": span.masked,
            "observation_text": decode(response[span.obs_start : span.end], keep[span.obs_start : span.end]),
            "observation_tokens": span.end - span.obs_start,
        }
        rec = record_of.get(span)
        for key in _RECORD_FIELDS:
            turn[key] = _json_value(rec.get(key)) if rec is not None else None
        if images is not None:
            turn["num_images"] = decode.count_images(response[span.obs_start : span.end])
            turn["tokens"], turn["row_starts"] = decode.token_rows_at(
                response[span.model_start : span.end], sample.loss_mask[span.model_start : span.end],
                sample.rollout_log_probs[span.model_start : span.end])
            if sample.teacher_log_probs is not None:  # on-policy distillation: the teacher's, row by row
                teacher = decode.token_rows(response[span.model_start : span.end],
                                            sample.loss_mask[span.model_start : span.end],
                                            sample.teacher_log_probs[span.model_start : span.end])
                turn["teacher_logprobs"] = [row[2] if row[1] == 1 else None for row in teacher]
        turns.append(turn)
    extra: dict[str, Any] = {}
    if images is not None:
        files = [images.write(sample, k) for k in range(len(sample.image_data))]
        n_prompt = decode.count_images(sample.tokens[:prompt_len])
        extra["prompt_images"] = files[:n_prompt]
        at = n_prompt
        for turn in turns:
            n = turn.pop("num_images")
            turn["images"] = files[at : at + n]
            at += n
        # Clips: each to the prompt or to the turn whose tokens hold its first pad (clips past the last one in the
        # tokens, of an episode cut short, are written but not referenced, like pictures).
        clips = [images.write_clip(sample, k) for k in range(len(sample.video_data))]
        extra["prompt_clips"] = []
        for turn in turns:
            turn["clips"] = []
        for clip, pad in zip(clips, layout.first_pads):
            if pad < prompt_len:
                extra["prompt_clips"].append(clip)
                continue
            offset = pad - prompt_len
            for turn, span in zip(turns, spans):
                if span.model_start <= offset < span.end:
                    row = bisect_right(turn["row_starts"], offset - span.model_start) - 1
                    turn["clips"].append({**clip, "row": row})
                    break
        for turn in turns:
            del turn["row_starts"]
    meta = sample.metadata
    errors = [str(e) for e in meta.get("errors", ())] + [f"env: {e}" for e in meta.get("env_errors", ())]
    return {
        "format": DUMP_FORMAT,
        "group_index": int(sample.group_index),
        "index": int(sample.index),
        "rollout_id": _json_value(meta.get("rollout_id")),
        "status": Status(sample.status).value,
        "termination": None if sample.termination is None else str(sample.termination),
        "reward": _json_value(None if sample.reward is None else float(sample.reward)),
        "label": _json_value(sample.label),
        "prompt_tokens": prompt_len,
        "response_length": sample.response_length,
        "model_tokens": sum(t["model_tokens"] for t in turns),
        "trained_tokens": int(sum(sample.loss_mask)),
        "observation_tokens": sum(t["observation_tokens"] for t in turns),
        "offpolicy_masked_tokens": sum(t["offpolicy_masked_tokens"] for t in turns),
        "num_images": len(sample.image_data),
        "num_clips": len(sample.video_data),
        "prompt_text": decode(sample.tokens[:prompt_len], layout.keep[:prompt_len]),
        "mask_runs": mask_runs(sample.loss_mask),
        "turns": turns,
        "turn_records": [_json_value(r.to_dict()) for r in sample.turns],
        "records_aligned": aligned,
        "weight_versions": [str(v) for v in sample.weight_versions],
        "error": _json_value(meta.get("error")),
        "errors": errors,
        **extra,
    }


def dump_samples(samples: Iterable[Sample], path: str | Path, tokenizer: Any, *, images: bool = True,
                 thumbnail_px: int = THUMBNAIL_PX, max_samples: int | None = None) -> int:
    """Write one JSON line per sample to `path` (parents created); returns the number of lines written.

    `images`: also the pictures (next to the dump) and the per-token rows the viewer reads (module docstring).
    `max_samples`: write only the first that many (a bounded dump per training step)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    decode = _Decoder(tokenizer)
    writer = _ImageWriter(path, thumbnail_px) if images else None
    n = 0
    with path.open("w", encoding="utf-8") as f:
        for sample in samples:
            if max_samples is not None and n >= max_samples:
                break
            f.write(json.dumps(_dump_record(sample, decode, writer), ensure_ascii=False, allow_nan=False) + "\n")
            n += 1
    return n


# ----------------------------------------------------------------------------- validation
def validate_dump(path: str | Path) -> list[dict[str, Any]]:
    """Re-read a dump and check every invariant; return its records. Raises DumpError naming file, line and key.

    Checked per line: the JSON shape and types; a known status; mask runs that alternate and cover the response;
    turn token counts that add up to the response and rebuild exactly the mask runs (masked off-policy tokens
    first in their turn); totals that match the turns; unique (group_index, index); a finite or null reward;
    FAILED episodes carry an error message; TRUNCATED/ABORTED terminations agree with the status; per-turn weight
    versions belong to the sample's; the loop's turn records line up with the token split for every episode
    that did not fail.
    """
    path = Path(path)
    if not path.is_file():
        raise DumpError(f"{path}: no such dump file")
    records: list[dict[str, Any]] = []
    seen: dict[tuple[int, int], int] = {}
    with path.open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            where = f"{path}:{line_no}"
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise DumpError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from e
            _validate_record(rec, where, path.parent)
            key = (rec["group_index"], rec["index"])
            if key in seen:
                raise DumpError(f"{where}: sample (group_index={key[0]}, index={key[1]}) already on line {seen[key]}")
            seen[key] = line_no
            records.append(rec)
    return records


def _check_types(obj: dict[str, Any], spec: dict[str, type], where: str) -> None:
    for key, kind in spec.items():
        if key not in obj:
            raise DumpError(f"{where}: missing key {key!r}")
        value = obj[key]
        if isinstance(value, bool) and kind is not bool:
            raise DumpError(f"{where}: key {key!r} is a bool, expected {kind.__name__}")
        if not isinstance(value, kind):
            raise DumpError(f"{where}: key {key!r} is {type(value).__name__}, expected {kind.__name__}")
        if kind is int and value < 0:
            raise DumpError(f"{where}: key {key!r} is negative ({value})")


def _check_image_refs(refs: Any, where: str, root: Path | None) -> None:
    if not isinstance(refs, list):
        raise DumpError(f"{where} must be a list of image references")
    for k, ref in enumerate(refs):
        if not (isinstance(ref, dict) and isinstance(ref.get("file"), str)):
            raise DumpError(f"{where}[{k}] must be an object with a 'file'")
        if root is not None and not (root / ref["file"]).is_file():
            raise DumpError(f"{where}[{k}]: image file {ref['file']!r} is missing (next to the dump, in {root})")


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _check_clip_refs(refs: Any, where: str, root: Path | None, tokens: list[Any] | None = None) -> None:
    """Clip references: frames (at least one, each file next to the dump), a positive finite fps, sizes; a turn's
    (`tokens` given) also its `row`, a video-pad row of `tokens`, in order."""
    if not isinstance(refs, list):
        raise DumpError(f"{where} must be a list of clip references")
    last_row = -1
    for k, ref in enumerate(refs):
        cwhere = f"{where}[{k}]"
        if not isinstance(ref, dict):
            raise DumpError(f"{cwhere} must be an object with 'frames' and 'fps'")
        frames = ref.get("frames")
        if not (isinstance(frames, list) and frames and all(isinstance(f, str) for f in frames)):
            raise DumpError(f"{cwhere}: key 'frames' must be a non-empty list of files, got {frames!r}")
        if len(set(frames)) != len(frames):
            raise DumpError(f"{cwhere}: key 'frames' names a file twice")
        fps = ref.get("fps")
        if isinstance(fps, bool) or not isinstance(fps, (int, float)) or not (math.isfinite(fps) and fps > 0):
            raise DumpError(f"{cwhere}: key 'fps' is {fps!r}, expected a positive number")
        for key in ("width", "height"):
            if not _positive_int(ref.get(key)):
                raise DumpError(f"{cwhere}: key {key!r} is {ref.get(key)!r}, expected a positive integer")
        if root is not None:
            for j, frame in enumerate(frames):
                if not (root / frame).is_file():
                    raise DumpError(f"{cwhere}: frame {j} of {len(frames)}, file {frame!r}, is missing (next to "
                                    f"the dump, in {root})")
        if tokens is not None:
            row = ref.get("row")
            if not (isinstance(row, int) and not isinstance(row, bool) and last_row < row < len(tokens)
                    and tokens[row][0] == VIDEO_PAD_TOKEN):
                raise DumpError(f"{cwhere}: key 'row' is {row!r}, expected the index of a {VIDEO_PAD_TOKEN} row of "
                                "'tokens' (after the previous clip's)")
            last_row = row


def _validate_viewer_keys(rec: dict[str, Any], where: str, root: Path | None) -> None:
    """The optional keys of a dump written with `images=True`."""
    if "prompt_images" not in rec:
        return
    _check_image_refs(rec["prompt_images"], f"{where}: key 'prompt_images'", root)
    total = len(rec["prompt_images"])
    has_clips = "prompt_clips" in rec  # dumps written before clips have none of their keys
    if has_clips:
        _check_clip_refs(rec["prompt_clips"], f"{where}: key 'prompt_clips'", root)
    clips = len(rec.get("prompt_clips") or ())
    for k, turn in enumerate(rec["turns"]):
        twhere = f"{where}: turns[{k}]"
        _check_image_refs(turn.get("images"), f"{twhere} key 'images'", root)
        total += len(turn["images"])
        tokens = turn.get("tokens")
        if not isinstance(tokens, list):
            raise DumpError(f"{twhere}: key 'tokens' must be a list")
        for j, row in enumerate(tokens):
            if not (isinstance(row, list) and len(row) == 4 and isinstance(row[0], str) and row[1] in (0, 1)
                    and (row[2] is None or isinstance(row[2], (int, float))) and isinstance(row[3], int) and row[3] > 0):
                raise DumpError(f"{twhere}: tokens[{j}] is {row!r}, expected [text, 0 or 1, log-prob or null, count]")
        if has_clips:
            _check_clip_refs(turn.get("clips"), f"{twhere} key 'clips'", root, tokens)
            clips += len(turn["clips"])
        teacher = turn.get("teacher_logprobs")
        if teacher is not None and (not isinstance(teacher, list) or len(teacher) != len(tokens) or not all(
                v is None or (isinstance(v, (int, float)) and not isinstance(v, bool)) for v in teacher)):
            raise DumpError(f"{twhere}: key 'teacher_logprobs' must be a list of one log-prob or null per 'tokens' "
                            f"row ({len(tokens)})")
        n = sum(row[3] for row in tokens)
        if n != turn["model_tokens"] + turn["observation_tokens"]:
            raise DumpError(f"{twhere}: key 'tokens' counts {n} tokens, the turn has "
                            f"{turn['model_tokens'] + turn['observation_tokens']}")
        trained = sum(row[3] for row in tokens if row[1] == 1)
        if trained != turn["model_tokens"] - turn["offpolicy_masked_tokens"]:
            raise DumpError(f"{twhere}: key 'tokens' has {trained} tokens with loss mask 1, the turn trains "
                            f"{turn['model_tokens'] - turn['offpolicy_masked_tokens']}")
    # Fewer references than pictures is possible for a FAILED episode cut between its pictures and their tokens.
    if "num_images" in rec and total > rec["num_images"]:
        raise DumpError(f"{where}: {total} image references, key 'num_images' is only {rec['num_images']}")
    n_clips = rec.get("num_clips")
    if has_clips and not (isinstance(n_clips, int) and not isinstance(n_clips, bool) and n_clips >= 0):
        raise DumpError(f"{where}: key 'num_clips' is {n_clips!r}, expected a count")
    if has_clips and clips > rec["num_clips"]:
        raise DumpError(f"{where}: {clips} clip references, key 'num_clips' is only {rec['num_clips']}")


def _validate_record(rec: Any, where: str, path_root: Path | None = None) -> None:
    if not isinstance(rec, dict):
        raise DumpError(f"{where}: a line must be a JSON object, got {type(rec).__name__}")
    _check_types(rec, _REQUIRED_KEYS, where)
    if rec["format"] != DUMP_FORMAT:
        raise DumpError(f"{where}: key 'format' is {rec['format']!r}, expected {DUMP_FORMAT!r}")
    try:
        status = Status(rec["status"])
    except ValueError:
        raise DumpError(f"{where}: key 'status' has unknown value {rec['status']!r}") from None
    n = rec["response_length"]

    runs = rec["mask_runs"]
    for k, run in enumerate(runs):
        if not (isinstance(run, list) and len(run) == 2 and run[0] in (0, 1) and isinstance(run[1], int) and run[1] > 0):
            raise DumpError(f"{where}: mask_runs[{k}] is {run!r}, expected [0 or 1, positive length]")
        if k and runs[k - 1][0] == run[0]:
            raise DumpError(f"{where}: mask_runs[{k - 1}] and mask_runs[{k}] have the same value (runs must alternate)")
    if sum(r[1] for r in runs) != n:
        raise DumpError(f"{where}: mask_runs cover {sum(r[1] for r in runs)} tokens, response_length is {n}")

    rebuilt: list[int] = []
    for k, turn in enumerate(rec["turns"]):
        twhere = f"{where}: turns[{k}]"
        if not isinstance(turn, dict):
            raise DumpError(f"{twhere} is not an object")
        _check_types(turn, _TURN_KEYS, twhere)
        if turn["offpolicy_masked_tokens"] > turn["model_tokens"]:
            raise DumpError(f"{twhere}: offpolicy_masked_tokens {turn['offpolicy_masked_tokens']} > model_tokens "
                            f"{turn['model_tokens']}")
        masked = turn["offpolicy_masked_tokens"]
        rebuilt += [0] * masked + [1] * (turn["model_tokens"] - masked) + [0] * turn["observation_tokens"]
        version = turn.get("weight_version")
        if version is not None and version not in rec["weight_versions"]:
            raise DumpError(f"{twhere}: weight_version {version!r} not in the sample's weight_versions "
                            f"{rec['weight_versions']}")
    if mask_runs(rebuilt) != runs:
        raise DumpError(f"{where}: key 'turns': token counts rebuild the mask runs {mask_runs(rebuilt)}, "
                        f"but mask_runs is {runs}")
    totals = {
        "model_tokens": sum(t["model_tokens"] for t in rec["turns"]),
        "observation_tokens": sum(t["observation_tokens"] for t in rec["turns"]),
        "offpolicy_masked_tokens": sum(t["offpolicy_masked_tokens"] for t in rec["turns"]),
        "trained_tokens": sum(r[1] for r in runs if r[0] == 1),
    }
    for key, expected in totals.items():
        if rec[key] != expected:
            raise DumpError(f"{where}: key {key!r} is {rec[key]}, the turns and mask runs give {expected}")

    reward = rec.get("reward")
    if reward is not None and (isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward)):
        raise DumpError(f"{where}: key 'reward' is {reward!r}, expected a finite number or null")
    if not all(isinstance(v, str) for v in rec["weight_versions"]):
        raise DumpError(f"{where}: key 'weight_versions' must be a list of strings")
    if status is Status.FAILED and not (rec.get("error") or rec["errors"]):
        raise DumpError(f"{where}: status failed but keys 'error' and 'errors' are empty")
    if rec.get("termination") is not None:
        try:
            termination = Termination.parse(rec["termination"])
        except ValueError as e:
            raise DumpError(f"{where}: key 'termination': {e}") from None
        if status is Status.TRUNCATED and termination.kind is not TerminationKind.TRUNCATED:
            raise DumpError(f"{where}: status truncated but termination is {rec['termination']!r}")
        if status is Status.ABORTED and termination.kind is not TerminationKind.ABORT:
            raise DumpError(f"{where}: status aborted but termination is {rec['termination']!r}")
    _validate_viewer_keys(rec, where, path_root)
    if rec["turn_records"] and status is not Status.FAILED and not rec["records_aligned"]:
        raise DumpError(f"{where}: key 'records_aligned' is false: the episode's turn records do not match the "
                        "model-token runs of its response")
