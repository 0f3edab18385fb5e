"""What the trajectory viewer reads: the dumps of a run directory, as typed records.

A run directory (`--output-dir` of `jaxrl-vlm train`) holds training-step dumps `rollout/step_<k>.jsonl`
(`--dump-rollout-interval`) and eval dumps `eval/<set>/step_<k>.jsonl`; a single dump file (`jaxrl-vlm rollout
--dump FILE.jsonl`) is a run of one source. Every dump is checked by `rollout.dump.validate_dump` as it is read, so
the viewer never shows a record that breaks the dump's invariants. Pictures, and every frame of each clip, are files
next to each dump.

No jax.
"""

from __future__ import annotations

import dataclasses
import enum
import re
from pathlib import Path
from typing import Any

from rollout.dump import DUMP_FORMAT, validate_dump

_STEP = re.compile(r"step_(\d+)\.jsonl$")


class SourceKind(str, enum.Enum):
    TRAIN = "train"
    EVAL = "eval"
    DUMP = "dump"


@dataclasses.dataclass(frozen=True)
class Source:
    """One dump file of a run: a training step, an eval round of one set, or a lone dump."""

    kind: SourceKind
    path: Path  # relative to the run's root
    step: int | None
    eval_set: str | None = None

    @property
    def key(self) -> str:
        return self.path.as_posix()

    @property
    def title(self) -> str:
        if self.kind is SourceKind.TRAIN:
            return f"training step {self.step}"
        if self.kind is SourceKind.EVAL:
            return f"eval {self.eval_set} after step {self.step}"
        return self.path.name


@dataclasses.dataclass(frozen=True)
class ImageRef:
    file: str  # relative to the run's root
    width: int
    height: int
    sent_width: int
    sent_height: int


@dataclasses.dataclass(frozen=True)
class ClipRef:
    """A clip as the engine received it: its frames in order (files, thumbnails like pictures) and frame rate."""

    frames: tuple[str, ...]  # each relative to the run's root
    fps: float
    width: int  # of the frame files
    height: int
    sent_width: int  # of the frames the engine received
    sent_height: int
    row: int | None = None  # a turn's clip: the index in `Turn.tokens` of its first video-pad row


@dataclasses.dataclass(frozen=True)
class Turn:
    index: int
    model_text: str
    observation_text: str
    model_tokens: int
    observation_tokens: int
    images: tuple[ImageRef, ...]
    tokens: tuple[tuple[str, int, float | None, int], ...]  # text, loss mask, log-prob, count
    finish_reason: str | None
    engine_latency_s: float | None
    env_latency_s: float | None
    env_retries: int | None
    weight_version: str | None
    truncation_cause: str | None
    error: str | None
    # On-policy distillation: the teacher's log-prob of each `tokens` row (None: observation, image pads), or ().
    teacher_logprobs: tuple[float | None, ...] = ()
    clips: tuple[ClipRef, ...] = ()  # the observation's clips, in order


@dataclasses.dataclass(frozen=True)
class Episode:
    group_index: int
    index: int
    status: str
    termination: str | None
    reward: float | None
    label: Any
    prompt_text: str
    prompt_images: tuple[ImageRef, ...]
    turns: tuple[Turn, ...]
    weight_versions: tuple[str, ...]
    errors: tuple[str, ...]
    prompt_clips: tuple[ClipRef, ...] = ()

    @property
    def failed(self) -> bool:
        return self.status == "failed"

    @property
    def truncated(self) -> bool:
        return self.status == "truncated"

    @property
    def zero_reward(self) -> bool:
        """No positive reward (none at all for a FAILED episode): what the "zero reward" filter shows."""
        return self.reward is None or self.reward <= 0

    @property
    def retries(self) -> int:
        return sum(t.env_retries or 0 for t in self.turns)

    @property
    def final_answer(self) -> str:
        """The model's text of its last turn (what side-by-side comparison shows)."""
        texts = [t.model_text for t in self.turns if t.model_tokens]
        return texts[-1] if texts else ""


def _images(refs: list[dict[str, Any]] | None, prefix: Path) -> tuple[ImageRef, ...]:
    return tuple(ImageRef((prefix / r["file"]).as_posix(), int(r.get("width", 0)), int(r.get("height", 0)),
                          int(r.get("sent_width", r.get("width", 0))), int(r.get("sent_height", r.get("height", 0))))
                 for r in refs or ())


def _clips(refs: list[dict[str, Any]] | None, prefix: Path) -> tuple[ClipRef, ...]:
    return tuple(ClipRef(tuple((prefix / f).as_posix() for f in r["frames"]), float(r["fps"]), int(r["width"]),
                         int(r["height"]), int(r.get("sent_width", r["width"])), int(r.get("sent_height", r["height"])),
                         r.get("row"))
                 for r in refs or ())


def _turn(t: dict[str, Any], prefix: Path) -> Turn:
    return Turn(t["turn"], t["model_text"], t["observation_text"], t["model_tokens"], t["observation_tokens"],
                _images(t.get("images"), prefix), tuple(tuple(row) for row in t.get("tokens") or ()),
                t.get("finish_reason"), t.get("engine_latency_s"), t.get("env_latency_s"), t.get("env_retries"),
                t.get("weight_version"), t.get("truncation_cause"), t.get("error"),
                tuple(t.get("teacher_logprobs") or ()), _clips(t.get("clips"), prefix))


def load_episodes(root: Path, source: Source) -> list[Episode]:
    """The episodes of one source, validated (`rollout.dump.DumpError` names the file, line and key)."""
    prefix = source.path.parent
    out = []
    for rec in validate_dump(root / source.path):
        errors = [e for e in [rec.get("error"), *rec["errors"]] if e]
        out.append(Episode(rec["group_index"], rec["index"], rec["status"], rec.get("termination"), rec.get("reward"),
                           rec.get("label"), rec.get("prompt_text", ""), _images(rec.get("prompt_images"), prefix),
                           tuple(_turn(t, prefix) for t in rec["turns"]), tuple(rec["weight_versions"]), tuple(errors),
                           _clips(rec.get("prompt_clips"), prefix)))
    return out


@dataclasses.dataclass(frozen=True)
class RunIndex:
    """The sources of a run directory (or of one dump file), training steps first, then eval rounds, by step."""

    root: Path
    sources: tuple[Source, ...]

    def get(self, key: str) -> Source:
        for source in self.sources:
            if source.key == key:
                return source
        raise KeyError(f"{self.root}: no dump {key!r} (have {', '.join(s.key for s in self.sources) or 'none'})")

    @property
    def train(self) -> list[Source]:
        return [s for s in self.sources if s.kind is not SourceKind.EVAL]

    @property
    def evals(self) -> list[Source]:
        return [s for s in self.sources if s.kind is SourceKind.EVAL]


def _is_dump(path: Path) -> bool:
    """Whether a top-level .jsonl is a rollout dump (its first line names the dump format), not e.g. metrics.jsonl."""
    with path.open(encoding="utf-8") as f:
        first = f.readline(4096)
    return f'"format": "{DUMP_FORMAT}"' in first


def index_run(path: str | Path) -> RunIndex:
    """The dumps under run directory `path`, or `path` itself when it is one dump file; a ValueError when none."""
    path = Path(path)
    if path.is_file():
        return RunIndex(path.parent, (Source(SourceKind.DUMP, Path(path.name), None),))
    if not path.is_dir():
        raise ValueError(f"{path}: not a run directory or a dump file")
    sources: list[Source] = []
    for f in sorted((path / "rollout").glob("step_*.jsonl")):
        m = _STEP.search(f.name)
        if m:
            sources.append(Source(SourceKind.TRAIN, f.relative_to(path), int(m.group(1))))
    sources.sort(key=lambda s: s.step)
    evals: list[Source] = []
    for f in sorted((path / "eval").glob("*/step_*.jsonl")):
        m = _STEP.search(f.name)
        if m:
            evals.append(Source(SourceKind.EVAL, f.relative_to(path), int(m.group(1)), f.parent.name))
    evals.sort(key=lambda s: (s.eval_set, s.step))
    dumps = [Source(SourceKind.DUMP, f.relative_to(path), None) for f in sorted(path.glob("*.jsonl")) if _is_dump(f)]
    if not sources and not evals and not dumps:
        raise ValueError(f"{path}: no dumps (rollout/step_<k>.jsonl from --dump-rollout-interval, "
                         "eval/<set>/step_<k>.jsonl, or a FILE.jsonl from `jaxrl-vlm rollout --dump`)")
    return RunIndex(path, tuple(sources + evals + dumps))
