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

Image pads are shown compacted (one `<|image_pad|>` per image) in decoded text; token counts are always in the
training view (pads expanded).

For the trajectory viewer (`jaxrl-vlm view`, `jaxrl_vlm/viewer/`), `dump_samples` (unless `images=False`) also writes
every picture the engine received (`Sample.image_data`: already at the image processor's size) as a PNG next to
the dump, in `<dump stem>_images/`, shrunk to at most `thumbnail_px` on its longer side, and references them from
the record (`prompt_images`, per turn `images`, each `{"file", "width", "height", "sent_width", "sent_height"}`,
the file relative to the dump's directory); and, per turn, `tokens`: `[text, loss_mask, log_prob, count]` per
response token (a run of image pads is one entry with its count), so the viewer colours tokens by mask and shows
log-probs; with on-policy distillation (a sample with `teacher_log_probs`) also `teacher_logprobs`, the teacher's
log-prob of each `tokens` row (null on observation rows and image pads), shown beside the student's.
`validate_dump` checks both when present: files exist, counts add up to the turn's tokens.

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
from collections import defaultdict
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from PIL import Image

from rollout.sample import Sample, Status, Termination, TerminationKind, TurnRecord

DUMP_FORMAT = "jaxrl-vlm-rollout-dump/1"
IMAGE_PAD_TOKEN = "<|image_pad|>"
VISION_START_TOKEN = "<|vision_start|>"
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


class _Decoder:
    """Decodes token ids for display, collapsing each run of image pads to one pad."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.image_pad = self._token_id(IMAGE_PAD_TOKEN)
        self.vision_start = self._token_id(VISION_START_TOKEN)

    def _token_id(self, token: str) -> int | None:
        tokenizer = self.tokenizer
        found = tokenizer.convert_tokens_to_ids(token) if hasattr(tokenizer, "convert_tokens_to_ids") else None
        unk = getattr(tokenizer, "unk_token_id", None)
        return found if isinstance(found, int) and found != unk else None

    def count_images(self, ids: Sequence[int]) -> int:
        """Pictures in a token run: its `<|vision_start|>` tokens (else its runs of image pads)."""
        if self.vision_start is not None:
            return sum(1 for t in ids if t == self.vision_start)
        if self.image_pad is None:
            return 0
        return sum(1 for k, t in enumerate(ids) if t == self.image_pad and (k == 0 or ids[k - 1] != self.image_pad))

    def token_rows(self, ids: Sequence[int], mask: Sequence[int], logprobs: Sequence[float]) -> list[list[Any]]:
        """`[text, loss_mask, log_prob, count]` per token, a run of image pads as one entry with its count."""
        rows: list[list[Any]] = []
        ids = [int(t) for t in ids]
        texts = self.tokenizer.batch_decode([[t] for t in ids], skip_special_tokens=False) if ids else []
        for t, m, lp, text in zip(ids, mask, logprobs, texts):
            if t == self.image_pad and rows and rows[-1][0] == IMAGE_PAD_TOKEN and rows[-1][1] == int(m):
                rows[-1][3] += 1
                continue
            text = IMAGE_PAD_TOKEN if t == self.image_pad else text
            rows.append([text, int(m), round(float(lp), 4) if math.isfinite(float(lp)) else None, 1])
        return rows

    def __call__(self, ids: Sequence[int]) -> str:
        if self.image_pad is not None:
            compact: list[int] = []
            for t in ids:
                if not (t == self.image_pad and compact and compact[-1] == self.image_pad):
                    compact.append(int(t))
            ids = compact
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)


# ----------------------------------------------------------------------------- writing
class _ImageWriter:
    """Writes a sample's pictures (PNG data URLs, as sent to the engine) into `<dump stem>_images/`."""

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
        if max(sent) > self.thumbnail_px:
            image = image.copy()
            image.thumbnail((self.thumbnail_px, self.thumbnail_px))
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / f"g{int(sample.group_index)}_i{int(sample.index)}_{k}.png"
        image.convert("RGB").save(path, format="PNG")
        return {"file": path.relative_to(self.root).as_posix(), "width": image.width, "height": image.height,
                "sent_width": sent[0], "sent_height": sent[1]}


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
    turns = []
    for k, span in enumerate(spans):
        turn: dict[str, Any] = {
            "turn": k,
            "model_text": decode(response[span.model_start : span.obs_start]),
            "model_tokens": span.obs_start - span.model_start,
            "offpolicy_masked_tokens": span.masked,
            "observation_text": decode(response[span.obs_start : span.end]),
            "observation_tokens": span.end - span.obs_start,
        }
        rec = record_of.get(span)
        for key in _RECORD_FIELDS:
            turn[key] = _json_value(rec.get(key)) if rec is not None else None
        if images is not None:
            turn["num_images"] = decode.count_images(response[span.obs_start : span.end])
            turn["tokens"] = decode.token_rows(response[span.model_start : span.end],
                                               sample.loss_mask[span.model_start : span.end],
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
        "prompt_text": decode(sample.tokens[:prompt_len]),
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


def _validate_viewer_keys(rec: dict[str, Any], where: str, root: Path | None) -> None:
    """The optional keys of a dump written with `images=True`."""
    if "prompt_images" not in rec:
        return
    _check_image_refs(rec["prompt_images"], f"{where}: key 'prompt_images'", root)
    total = len(rec["prompt_images"])
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
