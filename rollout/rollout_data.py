"""Saved rollouts: every step's rollout result, written losslessly and read back for training without an engine.

slime's `--save-debug-rollout-data PATH` / `--load-debug-rollout-data PATH`, with its meaning: PATH holds
`{rollout_id}` and step k's file is `PATH.format(rollout_id=k)`; a run that loads them trains on them instead of
rolling out, and starts no engine. slime pickles `Sample.to_dict()` lists with torch; this is our own format,
versioned and checked, readable without torch or jax.

One file per step, JSON lines (gzip-compressed when the path ends in `.gz`):

1. a header `{"format": "jaxrl-vlm-rollout-data", "version": 1, "rollout_id": k, "groups": [sizes], "failed": m,
   "accounting": {...}, "settings": {...}, "created": unix time}`: `accounting` is the driver's bookkeeping of the
   step (drop counts, groups submitted, episodes, prompts skipped, what a rollout log hook said), so the rollout
   metrics of the step can be recomputed exactly; `settings` are the writer's (the job's) notes about the run that
   made the samples (temperature, model, weight version), checked by the reader's caller;
2. one line per kept sample, group after group in training order: `{"sample": Sample.to_dict()}`. Arrays
   (`multimodal_train_inputs`: the pixel patches and grids the trainer consumes) are base64 of their raw bytes with
   dtype and shape; floats are written as `repr` (exact for float64); images also travel as the PNG data URLs the
   engine saw; nothing is re-derived on load;
3. one line per FAILED episode of the step: `{"failed": Sample.to_dict()}`, or `{"failed_same_as": i}` when it is
   the i-th kept sample object;
4. an end record `{"end": {"lines": n, "sha256": hex}}` over the bytes of lines 2-3, so a truncated or altered file
   is an error, never a silently different batch.

Lists stay lists, tuples become lists and mapping keys strings (JSON); a value JSON cannot hold (an object a custom
hook put in `metadata`) is an error naming the sample and the field. Files are written to a temporary name and renamed, so a
killed run never leaves a half-written step under the final name.

The flags are declared with the other rollout options (`rollout/options.py`, `DebugOptions`); the main job saves
and replays (`jaxrl_vlm/job/replay.py`). This module never imports jax.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gzip
import hashlib
import json
import os
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from rollout.driver import RolloutResult
from rollout.options import PLACEHOLDER
from rollout.sample import Sample, SampleError

FORMAT = "jaxrl-vlm-rollout-data"
VERSION = 1
READABLE_VERSIONS = (1,)

_GZIP_MAGIC = b"\x1f\x8b"
_ZIP_MAGIC = b"PK\x03\x04"  # torch.save's container: a slime .pt file


class RolloutDataError(ValueError):
    """A saved-rollout file that cannot be used: missing, not ours, of another version, truncated or corrupt.
    The message names the file (and the line)."""


# ----------------------------------------------------------------------------- paths
def step_path(template: str, rollout_id: int | str) -> Path:
    """Step `rollout_id`'s file (slime's `template.format(rollout_id=...)`)."""
    return Path(template.format(**{PLACEHOLDER: rollout_id}))


# ----------------------------------------------------------------------------- the step's content
@dataclass
class SavedRollout:
    """One step as read back: its rollout result (groups, FAILED episodes, accounting), id and the writer's notes."""

    rollout_id: int
    result: RolloutResult
    settings: dict[str, Any] = field(default_factory=dict)
    created: float | None = None
    path: Path | None = None


def _accounting(result: RolloutResult) -> dict[str, Any]:
    """Everything of a RolloutResult but its samples (new fields are saved too, as JSON)."""
    out = {}
    for f in dataclasses.fields(result):
        if f.name in ("groups", "failed"):
            continue
        value = getattr(result, f.name)
        out[f.name] = dict(value) if isinstance(value, Counter) else value
    return out


def _result_from(groups: list[list[Sample]], failed: list[Sample], accounting: dict[str, Any], where: str) -> RolloutResult:
    known = {f.name: f for f in dataclasses.fields(RolloutResult)}
    unknown = sorted(set(accounting) - set(known))
    if unknown:
        raise RolloutDataError(f"{where}: header key 'accounting' has entries this version does not know: {unknown}")
    kwargs = dict(accounting)
    if "dropped" in kwargs:
        kwargs["dropped"] = Counter(kwargs["dropped"])
    return RolloutResult(groups=groups, failed=failed, **kwargs)


def _sample_line(kind: str, sample: Sample, where: str) -> bytes:
    """`{kind: sample}` as one line; a field JSON cannot hold is an error naming the sample and the field."""
    data = sample.to_dict()
    try:
        return _line({kind: data})
    except (TypeError, ValueError):
        for key, value in data.items():
            try:
                json.dumps(value, allow_nan=True)
            except (TypeError, ValueError) as e:
                raise RolloutDataError(f"{where}: {sample.name} field {key!r} cannot be saved: {e} (save only "
                                       "JSON data, numbers, strings, lists, dicts and numpy arrays in samples)") from None
        raise


# ----------------------------------------------------------------------------- writing
def write_rollout_data(path: str | Path, rollout_id: int, result: RolloutResult, *,
                       settings: dict[str, Any] | None = None) -> Path:
    """Write step `rollout_id`'s `result` to `path` (parents created; atomic rename); returns the path."""
    path = Path(path)
    where = str(path)
    groups = [list(g) for g in result.groups]
    kept = [s for g in groups for s in g]
    position = {id(s): i for i, s in enumerate(kept)}
    body: list[bytes] = []
    for s in kept:
        body.append(_sample_line("sample", s, where))
    for s in result.failed:
        if id(s) in position:
            body.append(_line({"failed_same_as": position[id(s)]}))
        else:
            body.append(_sample_line("failed", s, where))
    digest = hashlib.sha256()
    for line in body:
        digest.update(line)
    header = {
        "format": FORMAT, "version": VERSION, "rollout_id": int(rollout_id), "created": time.time(),
        "groups": [len(g) for g in groups], "failed": len(result.failed), "accounting": _accounting(result),
        "settings": dict(settings or {}),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with tmp.open("wb") as raw:
            # No name and no time in a gzip header: the same step gives the same bytes.
            with (gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) if path.suffix == ".gz"
                  else contextlib.nullcontext(raw)) as f:
                f.write(_line(header))
                for line in body:
                    f.write(line)
                f.write(_line({"end": {"lines": len(body), "sha256": digest.hexdigest()}}))
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def _line(obj: dict[str, Any]) -> bytes:
    return (json.dumps(obj, allow_nan=True, separators=(",", ":")) + "\n").encode("utf-8")


# ----------------------------------------------------------------------------- reading
def _lines(path: Path) -> Iterator[bytes]:
    with path.open("rb") as raw:
        magic = raw.read(4)
        raw.seek(0)
        if magic == _ZIP_MAGIC:
            raise RolloutDataError(
                f"{path}: a zip/torch file (slime's --save-debug-rollout-data writes torch .pt files); this reads only "
                f"the files jaxrl-vlm's --save-debug-rollout-data writes ({FORMAT})")
        stream: IO[bytes] = gzip.GzipFile(fileobj=raw) if magic[:2] == _GZIP_MAGIC else raw
        try:
            yield from stream
        except (OSError, EOFError) as e:  # a damaged gzip stream
            raise RolloutDataError(f"{path}: corrupt compressed data ({e})") from None


def read_rollout_data(path: str | Path, *, rollout_id: int | None = None) -> SavedRollout:
    """Read one step's file back. With `rollout_id`, the file must be that step's. Raises RolloutDataError naming
    the file and line for a missing, foreign, newer, truncated or altered file."""
    path = Path(path)
    if not path.is_file():
        raise RolloutDataError(f"{path}: no saved rollout here" + (f" for step {rollout_id}" if rollout_id is not None else ""))
    lines = _lines(path)
    header = _header(path, next(lines, b""))
    if rollout_id is not None and header["rollout_id"] != rollout_id:
        raise RolloutDataError(f"{path}: holds step {header['rollout_id']}, not step {rollout_id}")
    sizes, n_failed = header["groups"], header["failed"]
    kept: list[Sample] = []
    failed: list[Sample] = []
    digest = hashlib.sha256()
    end: dict[str, Any] | None = None
    line_no = 1
    for line in lines:
        line_no += 1
        where = f"{path}:{line_no}"
        if end is not None:
            raise RolloutDataError(f"{where}: data after the end record")
        record = _json(line, where)
        if "end" in record:
            end = record["end"]
            continue
        digest.update(line)
        if "sample" in record:
            if failed:
                raise RolloutDataError(f"{where}: a kept sample after the FAILED ones")
            kept.append(_sample(record["sample"], where, validate=True))
        elif "failed" in record:
            failed.append(_sample(record["failed"], where, validate=False))
        elif "failed_same_as" in record and isinstance(record["failed_same_as"], int) \
                and 0 <= record["failed_same_as"] < len(kept):
            failed.append(kept[record["failed_same_as"]])
        else:
            raise RolloutDataError(f"{where}: expected a 'sample', 'failed' or 'end' record, got keys {sorted(record)}")
    if end is None:
        raise RolloutDataError(f"{path}: truncated after line {line_no} (no end record): the file was not written "
                               "to the end")
    if not isinstance(end, dict) or end.get("lines") != len(kept) + len(failed) or end.get("sha256") != digest.hexdigest():
        raise RolloutDataError(f"{path}: corrupt: the end record {end} does not match the {len(kept) + len(failed)} "
                               f"sample lines read (checksum {digest.hexdigest()[:12]}...)")
    if sum(sizes) != len(kept) or n_failed != len(failed):
        raise RolloutDataError(f"{path}: the header announces groups {sizes} and {n_failed} FAILED episodes, the file "
                               f"holds {len(kept)} kept samples and {len(failed)} FAILED")
    groups, start = [], 0
    for size in sizes:
        groups.append(kept[start : start + size])
        start += size
    result = _result_from(groups, failed, header["accounting"], f"{path}:1")
    return SavedRollout(header["rollout_id"], result, header["settings"], header.get("created"), path)


_HEADER_TYPES: dict[str, type | tuple[type, ...]] = {"rollout_id": int, "groups": list, "failed": int,
                                                     "accounting": dict, "settings": dict}


def _header(path: Path, line: bytes) -> dict[str, Any]:
    where = f"{path}:1"
    try:
        header = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError):
        header = None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise RolloutDataError(f"{where}: not a jaxrl-vlm rollout data file (the first line is not a {FORMAT!r} "
                               "header); write one with --save-debug-rollout-data")
    version = header.get("version")
    if version not in READABLE_VERSIONS:
        raise RolloutDataError(f"{where}: format version {version!r}; this jaxrl-vlm reads versions "
                               f"{list(READABLE_VERSIONS)} (a newer jaxrl-vlm wrote it?)")
    for key, kind in _HEADER_TYPES.items():
        if not isinstance(header.get(key), kind) or isinstance(header.get(key), bool):
            raise RolloutDataError(f"{where}: header key {key!r} is {header.get(key)!r}, expected a {kind.__name__}")
    if not all(isinstance(n, int) and n >= 0 for n in header["groups"]):
        raise RolloutDataError(f"{where}: header key 'groups' must list group sizes, got {header['groups']}")
    return header


def _json(line: bytes, where: str) -> dict[str, Any]:
    try:
        record = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RolloutDataError(f"{where}: not valid JSON ({e})") from None
    if not isinstance(record, dict):
        raise RolloutDataError(f"{where}: a line must be a JSON object, got {type(record).__name__}")
    return record


def _sample(data: Any, where: str, *, validate: bool) -> Sample:
    """A sample line back as a Sample; a kept one (training input) must pass `Sample.validate()`."""
    if not isinstance(data, dict):
        raise RolloutDataError(f"{where}: a sample must be a JSON object, got {type(data).__name__}")
    try:
        sample = Sample.from_dict(data)
        if validate:
            sample.validate()
    except (SampleError, ValueError, TypeError, KeyError) as e:
        raise RolloutDataError(f"{where}: not a valid sample: {e}") from None
    return sample
