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

This module never imports jax.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from rollout.sample import Sample, Status, Termination, TerminationKind, TurnRecord

DUMP_FORMAT = "jaxrl-vlm-rollout-dump/1"
IMAGE_PAD_TOKEN = "<|image_pad|>"

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
        pad = tokenizer.convert_tokens_to_ids(IMAGE_PAD_TOKEN) if hasattr(tokenizer, "convert_tokens_to_ids") else None
        unk = getattr(tokenizer, "unk_token_id", None)
        self.image_pad = pad if isinstance(pad, int) and pad != unk else None

    def __call__(self, ids: Sequence[int]) -> str:
        if self.image_pad is not None:
            compact: list[int] = []
            for t in ids:
                if not (t == self.image_pad and compact and compact[-1] == self.image_pad):
                    compact.append(int(t))
            ids = compact
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)


# ----------------------------------------------------------------------------- writing
def _dump_record(sample: Sample, decode: _Decoder) -> dict[str, Any]:
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
        turns.append(turn)
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
    }


def dump_samples(samples: Iterable[Sample], path: str | Path, tokenizer: Any) -> int:
    """Write one JSON line per sample to `path` (parents created); returns the number of lines written."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    decode = _Decoder(tokenizer)
    n = 0
    with path.open("w", encoding="utf-8") as f:
        for sample in samples:
            f.write(json.dumps(_dump_record(sample, decode), ensure_ascii=False, allow_nan=False) + "\n")
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
            _validate_record(rec, where)
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


def _validate_record(rec: Any, where: str) -> None:
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
    if rec["turn_records"] and status is not Status.FAILED and not rec["records_aligned"]:
        raise DumpError(f"{where}: key 'records_aligned' is false: the episode's turn records do not match the "
                        "model-token runs of its response")
