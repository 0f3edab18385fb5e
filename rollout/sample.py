"""The Sample contract shared by rollout, environments and the trainer.

A `Sample` is one episode of one prompt. It carries the *training view* of the
token stream (prompt then response, image pads expanded), the response-only
loss mask and rollout log-probs, the images of the whole episode, the per-turn
multimodal training tensors (concatenated once at finalize), per-turn records
and the outcome.

This module never imports jax: a rollout host runs without it.
"""

from __future__ import annotations

import base64
import dataclasses
import enum
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np


class Status(str, enum.Enum):
    PENDING = "pending"
    COMPLETED = "completed"
    TRUNCATED = "truncated"
    ABORTED = "aborted"
    FAILED = "failed"


TERMINAL_STATUSES = frozenset({Status.COMPLETED, Status.TRUNCATED, Status.ABORTED, Status.FAILED})

# A terminal sample may only go back to PENDING (partial rollout resumes an
# ABORTED episode, or a TRUNCATED one in a later step); terminal -> terminal is a bug.
_ALLOWED_TRANSITIONS: dict[Status, frozenset[Status]] = {
    Status.PENDING: frozenset(Status),
    Status.COMPLETED: frozenset({Status.COMPLETED}),
    Status.TRUNCATED: frozenset({Status.TRUNCATED, Status.PENDING}),
    Status.ABORTED: frozenset({Status.ABORTED, Status.PENDING}),
    Status.FAILED: frozenset({Status.FAILED}),
}

# SGLang's finish_reason "type" -> episode status (slime's mapping).
FINISH_REASON_STATUS = {"stop": Status.COMPLETED, "length": Status.TRUNCATED, "abort": Status.ABORTED}


class SampleError(ValueError):
    """A Sample invariant was violated; the message names the sample and the field."""


class TruncationCause(str, enum.Enum):
    """Why a turn was cut short. The first five end the episode as TRUNCATED; the aborts leave it ABORTED."""

    RESPONSE_BUDGET = "response_budget"  # the response budget (generated + observation tokens) ran out
    CONTEXT = "context"  # the context limit (prompt + response) ran out
    LENGTH = "length"  # the engine stopped at the turn's own max_new_tokens
    OBSERVATION_EXCEEDS_RESPONSE_BUDGET = "observation_exceeds_response_budget"
    OBSERVATION_EXCEEDS_CONTEXT = "observation_exceeds_context"
    ENGINE_ABORT = "engine_abort"  # the engine answered finish_reason abort
    ROLLOUT_ABORT = "rollout_abort"  # the driver was aborting stragglers before this turn's request
    # A weight update (asynchronous training) aborted this request; the turn continued, or the episode was rerun.
    WEIGHT_UPDATE = "weight_update"

    def by_observation(self) -> "TruncationCause":
        """The cause when an observation, not a generated turn, does not fit under this limit."""
        return _BY_OBSERVATION[self]


_BY_OBSERVATION = {
    TruncationCause.RESPONSE_BUDGET: TruncationCause.OBSERVATION_EXCEEDS_RESPONSE_BUDGET,
    TruncationCause.CONTEXT: TruncationCause.OBSERVATION_EXCEEDS_CONTEXT,
}


class TerminationKind(str, enum.Enum):
    """What ended an episode. The value is its name in metrics (`termination/<value>`) and dumps."""

    ENV_DONE = "env_done"
    MAX_TURNS = "max_turns"
    TRUNCATED = "truncated"  # with a TruncationCause
    ABORT = "abort"
    # Asynchronous training with --inflight-update-policy rerun: its tokens would have spanned two weight versions,
    # so the episode is discarded and run again from its prompt.
    WEIGHT_UPDATE_RERUN = "weight_update_rerun"
    # FAILED episodes, by cause.
    ENGINE_ERROR = "engine_error"
    # The engine became unreachable and did not come back within --engine-reconnect-timeout (rollout/engine_link.py).
    ENGINE_LOST = "engine_lost"
    BANNED_TOKEN = "banned_token"
    # env.reset raised, or env.step kept failing (raising or overrunning --env-step-timeout) through its retries.
    ENV_ERROR = "env_error"
    ENV_TIMEOUT = "env_timeout"  # env.reset/verdict/close or the module's reward_fn overran --env-hook-timeout
    EPISODE_TIMEOUT = "episode_timeout"
    EXCEPTION = "exception"
    FINALIZE_ERROR = "finalize_error"
    REWARD_ERROR = "reward_error"  # a reward that cannot be trained on (mapping without --reward-key, non-finite)
    GENERATE_EXCEPTION = "generate_exception"
    TEACHER_ERROR = "teacher_error"  # --use-opd: the teacher could not score the episode (unreachable, bad answer)

    @property
    def status(self) -> "Status":
        """The episode status this kind of ending gives."""
        return _KIND_STATUS.get(self, Status.FAILED)


_KIND_STATUS = {
    TerminationKind.ENV_DONE: Status.COMPLETED,
    TerminationKind.MAX_TURNS: Status.COMPLETED,
    TerminationKind.TRUNCATED: Status.TRUNCATED,
    TerminationKind.ABORT: Status.ABORTED,
    TerminationKind.WEIGHT_UPDATE_RERUN: Status.ABORTED,
}


@dataclass(frozen=True)
class Termination:
    """How an episode ended: typed, so metrics and dumps never parse strings.

    `str()` gives the readable form dumps and checkpoints store (`env_done`, `truncated:length`) and `parse`
    reads it back; `metric_name` is the metric key suffix (`truncated/length`).
    """

    kind: TerminationKind
    cause: TruncationCause | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", TerminationKind(self.kind))
        if self.cause is not None:
            object.__setattr__(self, "cause", TruncationCause(self.cause))
        if (self.kind is TerminationKind.TRUNCATED) != (self.cause is not None):
            raise SampleError(
                f"Termination {self.kind.value!r}: a truncation cause is required for, and only for, truncated"
            )

    @classmethod
    def truncated(cls, cause: TruncationCause) -> "Termination":
        return cls(TerminationKind.TRUNCATED, cause)

    @property
    def status(self) -> "Status":
        return self.kind.status

    @property
    def metric_name(self) -> str:
        return self.kind.value if self.cause is None else f"{self.kind.value}/{self.cause.value}"

    def __str__(self) -> str:
        return self.kind.value if self.cause is None else f"{self.kind.value}:{self.cause.value}"

    @classmethod
    def parse(cls, text: str) -> "Termination":
        """The inverse of `str()`; raises ValueError naming the text when it is not a known termination."""
        kind, _, cause = str(text).partition(":")
        try:
            return cls(TerminationKind(kind), TruncationCause(cause) if cause else None)
        except ValueError as e:  # SampleError is a ValueError
            raise ValueError(f"unknown termination {text!r}: {e}") from None


@dataclass
class TurnRecord:
    """What happened in one turn of an episode (for turn-level metrics and debug dumps)."""

    turn: int
    generated_tokens: int = 0
    finish_reason: str | None = None
    engine_latency_s: float = 0.0
    env_latency_s: float = 0.0
    env_retries: int = 0
    observation_tokens: int = 0
    observation_images: int = 0
    observation_clips: int = 0
    truncation_cause: TruncationCause | None = None
    error: str | None = None
    weight_version: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """A JSON-safe dict (the truncation cause as its string value)."""
        out = dataclasses.asdict(self)
        if self.truncation_cause is not None:
            out["truncation_cause"] = TruncationCause(self.truncation_cause).value
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "TurnRecord":
        kwargs = dict(data)
        if kwargs.get("truncation_cause") is not None:
            kwargs["truncation_cause"] = TruncationCause(kwargs["truncation_cause"])
        return cls(**kwargs)


@dataclass
class Sample:
    """One episode. See DESIGN.md §4 for the contract; `validate()` enforces it."""

    group_index: int = 0
    index: int = 0
    prompt: list[dict[str, Any]] | str = field(default_factory=list)
    label: Any = None
    # Training view: prompt + response ids, image pads expanded.
    tokens: list[int] = field(default_factory=list)
    response_length: int = 0
    loss_mask: list[int] = field(default_factory=list)
    rollout_log_probs: list[float] = field(default_factory=list)
    response: str = ""
    reward: float | None = None
    status: Status = Status.PENDING
    # How the episode ended (None while it runs); set together with `status`.
    termination: Termination | None = None
    # Every image of the episode, in placeholder order, as PNG data URLs (engine view).
    image_data: list[str] = field(default_factory=list)
    # Every clip of the episode, in placeholder order, as lossless video data URLs (engine view).
    video_data: list[str] = field(default_factory=list)
    # e.g. pixel_values [patches, C*T*P*P], image_grid_thw [images, 3]; merged once at finalize.
    multimodal_train_inputs: dict[str, np.ndarray] | None = None
    turns: list[TurnRecord] = field(default_factory=list)
    weight_versions: list[str] = field(default_factory=list)
    metadata: dict[str, Any] = field(default_factory=dict)
    # slime's `remove_sample`: set by a `--rollout-sample-filter-path` hook to leave the sample out of the loss
    # (the batch gives it no trainable token); it still counts in its group's advantage statistics.
    remove_sample: bool = False
    # MoE routing replay (slime's name; SGLang's ids): int32 [positions, num_hidden_layers * top_k], row i the
    # experts the engine routed token i to, layer-major (-1 in a dense layer; the rollout does not know the
    # model's shape, the trainer reshapes), for the first positions of `tokens` (at most len(tokens) - 1: the last
    # token is never forwarded). Set from the latest request's
    # `meta_info.routed_experts`, which covers its whole input (prompt, earlier turns, observations) and its
    # output; None when the engine was not asked (--use-rollout-routing-replay off).
    rollout_routed_experts: np.ndarray | None = None
    # On-policy distillation (--use-opd): the teacher's log-prob of each response token, length = response_length,
    # 0.0 where loss_mask is 0 (as rollout_log_probs); None until a teacher scored the episode.
    teacher_log_probs: list[float] | None = None
    # On-policy self-distillation (--opd-type self): the episode's prompt tokens rendered again with the privileged
    # text at the end of its first user turn (image pads expanded, like `tokens`). The teacher reads these followed by
    # `tokens[prompt_length:]`; None without it (rollout/privileged.py).
    privileged_prompt_tokens: list[int] | None = None

    # ------------------------------------------------------------------ views
    @property
    def prompt_length(self) -> int:
        return len(self.tokens) - self.response_length

    @property
    def name(self) -> str:
        return f"sample(group={self.group_index}, index={self.index})"

    # ---------------------------------------------------------------- appends
    def set_prompt_tokens(self, ids: list[int]) -> None:
        """Set the prompt ids (training view). Only valid before any response token."""
        if self.response_length:
            raise SampleError(f"{self.name}: prompt tokens set after {self.response_length} response tokens")
        self.tokens = [int(t) for t in ids]

    def append_model_tokens(self, ids: list[int], log_probs: list[float]) -> None:
        """Append tokens sampled by the engine: loss mask 1, their rollout log-probs required."""
        if log_probs is None or len(ids) != len(log_probs):
            n_lp = None if log_probs is None else len(log_probs)
            raise SampleError(f"{self.name}: {len(ids)} model tokens but {n_lp} log-probs")
        for lp in log_probs:
            if not np.isfinite(lp) or lp > 1e-6:
                raise SampleError(f"{self.name}: invalid model-token log-prob {lp!r} (must be finite and <= 0)")
        self._append(ids, [1] * len(ids), [float(x) for x in log_probs])

    def append_observation_tokens(self, ids: list[int]) -> None:
        """Append environment/template tokens: loss mask 0, log-prob 0.0. They take no log-probs."""
        self._append(ids, [0] * len(ids), [0.0] * len(ids))

    def _append(self, ids: list[int], mask: list[int], log_probs: list[float]) -> None:
        if self.status in TERMINAL_STATUSES:
            raise SampleError(f"{self.name}: append to a finished episode (status {self.status.value})")
        if len(self.loss_mask) != self.response_length or len(self.rollout_log_probs) != self.response_length:
            raise SampleError(f"{self.name}: response arrays out of sync before append")
        self.tokens.extend(int(t) for t in ids)
        self.loss_mask.extend(mask)
        self.rollout_log_probs.extend(log_probs)
        self.response_length += len(ids)

    def set_status(self, status: Status) -> None:
        """Move to `status` along the allowed transitions; going back to PENDING (a resume) clears `termination`."""
        status = Status(status)
        if status not in _ALLOWED_TRANSITIONS[self.status]:
            raise SampleError(f"{self.name}: illegal status transition {self.status.value} -> {status.value}")
        self.status = status
        if status is Status.PENDING:
            self.termination = None

    # -------------------------------------------------------------- validation
    def validate(
        self,
        *,
        image_token_id: int | None = None,
        vision_start_token_id: int | None = None,
        merge_size: int = 2,
    ) -> None:
        """Assert every invariant of the contract; raise SampleError naming the first one broken.

        With `image_token_id`/`vision_start_token_id`, also checks that the number of
        image placeholders in `tokens` equals the number of images, and (when
        `image_grid_thw` is present) that each expanded run has t*h*w/merge^2 pads.
        """
        n = self.response_length
        if n < 0 or n > len(self.tokens):
            raise SampleError(f"{self.name}: response_length {n} outside [0, {len(self.tokens)}]")
        if len(self.loss_mask) != n:
            raise SampleError(f"{self.name}: len(loss_mask)={len(self.loss_mask)} != response_length={n}")
        if len(self.rollout_log_probs) != n:
            raise SampleError(f"{self.name}: len(rollout_log_probs)={len(self.rollout_log_probs)} != response_length={n}")
        for i, (m, lp) in enumerate(zip(self.loss_mask, self.rollout_log_probs)):
            if m not in (0, 1):
                raise SampleError(f"{self.name}: loss_mask[{i}]={m!r} is not 0/1")
            if m == 0 and lp != 0.0:
                raise SampleError(f"{self.name}: rollout_log_probs[{i}]={lp} where loss_mask is 0")
        if self.teacher_log_probs is not None:
            if len(self.teacher_log_probs) != n:
                raise SampleError(f"{self.name}: len(teacher_log_probs)={len(self.teacher_log_probs)} != "
                                  f"response_length={n}")
            for i, (m, lp) in enumerate(zip(self.loss_mask, self.teacher_log_probs)):
                if m == 0 and lp != 0.0:
                    raise SampleError(f"{self.name}: teacher_log_probs[{i}]={lp} where loss_mask is 0")
                if m == 1 and not (math.isfinite(lp) and lp <= 1e-6):
                    raise SampleError(f"{self.name}: teacher_log_probs[{i}]={lp} is not a log-prob (finite, <= 0)")
        privileged = self.privileged_prompt_tokens
        if privileged is not None and not (isinstance(privileged, list) and privileged
                                           and all(isinstance(t, int) and t >= 0 for t in privileged)):
            raise SampleError(f"{self.name}: privileged_prompt_tokens must be a non-empty list of token ids")
        if not isinstance(self.status, Status):
            raise SampleError(f"{self.name}: status {self.status!r} is not a Status")
        if not isinstance(self.remove_sample, bool):
            raise SampleError(f"{self.name}: remove_sample {self.remove_sample!r} is not a bool")
        if self.termination is not None:
            if not isinstance(self.termination, Termination):
                raise SampleError(f"{self.name}: termination {self.termination!r} is not a Termination")
            if self.termination.status is not self.status:
                raise SampleError(f"{self.name}: termination {self.termination} gives status "
                                  f"{self.termination.status.value}, but the status is {self.status.value}")
        routed = self.rollout_routed_experts
        if routed is not None and (not isinstance(routed, np.ndarray) or routed.ndim != 2
                                   or routed.shape[0] > max(len(self.tokens) - 1, 0)):
            raise SampleError(f"{self.name}: rollout_routed_experts must be an ndarray [positions <= len(tokens) - 1 = "
                              f"{len(self.tokens) - 1}, layers * top_k], got {getattr(routed, 'shape', routed)!r}")
        for key, value in (self.multimodal_train_inputs or {}).items():
            if not isinstance(value, np.ndarray):
                raise SampleError(f"{self.name}: multimodal_train_inputs[{key!r}] is {type(value).__name__}, not ndarray")
        if image_token_id is not None:
            self._validate_images(image_token_id, vision_start_token_id, merge_size)

    def _validate_images(self, image_token_id: int, vision_start_token_id: int | None, merge_size: int) -> None:
        runs = image_pad_runs(self.tokens, image_token_id)
        if len(runs) != len(self.image_data):
            raise SampleError(f"{self.name}: {len(runs)} image placeholders in tokens but {len(self.image_data)} images")
        if vision_start_token_id is not None:
            for start, _ in runs:
                if start == 0 or self.tokens[start - 1] != vision_start_token_id:
                    raise SampleError(f"{self.name}: image pad run at {start} not preceded by vision_start")
        grid = (self.multimodal_train_inputs or {}).get("image_grid_thw")
        if grid is not None:
            grid = np.asarray(grid)
            if grid.shape != (len(runs), 3):
                raise SampleError(f"{self.name}: image_grid_thw shape {grid.shape} != ({len(runs)}, 3)")
            for k, ((_, length), thw) in enumerate(zip(runs, grid)):
                expected = int(np.prod(thw)) // (merge_size**2)
                if length != expected:
                    raise SampleError(f"{self.name}: image {k} has {length} pads, grid {thw.tolist()} needs {expected}")
            pixel_values = self.multimodal_train_inputs.get("pixel_values")
            if pixel_values is not None and pixel_values.shape[0] != int(np.prod(grid, axis=1).sum()):
                raise SampleError(
                    f"{self.name}: pixel_values has {pixel_values.shape[0]} patch rows, grid needs {int(np.prod(grid, axis=1).sum())}"
                )

    # ------------------------------------------------------------ serialization
    def to_dict(self) -> dict[str, Any]:
        """A JSON-safe dict (numpy arrays as base64 with dtype and shape)."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "status":
                value = value.value
            elif f.name == "termination":
                value = None if value is None else str(value)
            elif f.name == "turns":
                value = [t.to_dict() for t in value]
            elif f.name == "multimodal_train_inputs" and value is not None:
                value = {k: encode_array(v) for k, v in value.items()}
            out[f.name] = _json_safe(value)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Sample":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise SampleError(f"Sample.from_dict: unknown keys {sorted(unknown)}")
        kwargs = dict(data)
        if "status" in kwargs:
            kwargs["status"] = Status(kwargs["status"])
        if "turns" in kwargs:
            kwargs["turns"] = [TurnRecord.from_dict(t) for t in kwargs["turns"]]
        mm = kwargs.get("multimodal_train_inputs")
        if mm is not None:
            kwargs["multimodal_train_inputs"] = {k: decode_array(v) for k, v in mm.items()}
        if kwargs.get("rollout_routed_experts") is not None:
            kwargs["rollout_routed_experts"] = decode_array(kwargs["rollout_routed_experts"])
        if "metadata" in kwargs:
            kwargs["metadata"] = _from_json_safe(kwargs["metadata"])
            if "termination" not in kwargs:
                kwargs["termination"] = _legacy_termination(kwargs["metadata"])
        if kwargs.get("termination") is not None:
            kwargs["termination"] = Termination.parse(kwargs["termination"])
        return cls(**kwargs)


def _legacy_termination(metadata: dict[str, Any]) -> Termination | None:
    """Dicts written before `termination` was a field kept it as a string in the metadata: move it over (a string
    no Termination reads, from a custom episode function, stays in the metadata)."""
    text = metadata.get("termination")
    if not isinstance(text, str):
        return None
    try:
        termination = Termination.parse(text)
    except ValueError:
        return None
    del metadata["termination"]
    return termination


def image_pad_runs(tokens: list[int], image_token_id: int) -> list[tuple[int, int]]:
    """(start, length) of each maximal run of `image_token_id` in `tokens`."""
    runs: list[tuple[int, int]] = []
    i, n = 0, len(tokens)
    while i < n:
        if tokens[i] == image_token_id:
            j = i
            while j < n and tokens[j] == image_token_id:
                j += 1
            runs.append((i, j - i))
            i = j
        else:
            i += 1
    return runs


def encode_array(array: np.ndarray) -> dict[str, Any]:
    array = np.ascontiguousarray(array)
    return {
        "__ndarray__": base64.b64encode(array.tobytes()).decode("ascii"),
        "dtype": array.dtype.str,
        "shape": list(array.shape),
    }


def decode_array(data: dict[str, Any]) -> np.ndarray:
    if not isinstance(data, dict) or "__ndarray__" not in data:
        raise SampleError(f"expected an encoded ndarray, got {type(data).__name__}")
    raw = base64.b64decode(data["__ndarray__"])
    return np.frombuffer(raw, dtype=np.dtype(data["dtype"])).reshape(data["shape"]).copy()


def _json_safe(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return encode_array(value)
    if isinstance(value, (np.integer,)):
        return int(value)
    if isinstance(value, (np.floating,)):
        return float(value)
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def _from_json_safe(value: Any) -> Any:
    if isinstance(value, dict):
        if "__ndarray__" in value:
            return decode_array(value)
        return {k: _from_json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_from_json_safe(v) for v in value]
    return value
