"""The one home of OpenEnv's WebSocket protocol (`WS /ws`), shared by the client env (`envs/remote.py`) and
`jaxrl-vlm env-serve` (`envs/env_server.py`). No jax, no pydantic: typed dataclasses with parse/serialize.

Read from openenv-core 0.3.0 (`openenv/core/env_server/types.py`, `http_server.py` `websocket_endpoint`,
`serialization.serialize_observation`, `env_client.py`). One env per connection; every client message is one
JSON text frame and gets exactly one answer, except `close`, which ends the session:

    client -> server                              server -> client
    {"type": "reset", "data": {...}}              {"type": "observation", "data": {"observation": {...},
    {"type": "step",  "data": <action>}                                            "reward": float|null, "done": bool}}
    {"type": "state"}                             {"type": "state", "data": {"episode_id": ..., "step_count": n, ...}}
    {"type": "close"}                             {"type": "error", "data": {"message": str, "code": ErrorCode, ...}}

A server at its session cap answers CAPACITY_REACHED right after the upgrade and closes. Reset `data` keys the env
does not declare are dropped by openenv-core's servers; ours reads `seed` (a task from the env's synthetic
generator) or `sample` (the trainer's whole sample, `Sample.to_dict()` without its token streams).

Our envs' observation (what `env-serve` sends, `/schema` describes, and `remote.DefaultAdapter` reads first):
`{"text": str, "images": [data URL, ...], "role": "user"|"tool", "verdict": float|null, "info": {...}}`.
Our action: `{"text": <the model's text of the turn>}`.
"""

from __future__ import annotations

import enum
import json
import math
from dataclasses import dataclass, field
from typing import Any

#: Paths of an OpenEnv server.
WS_PATH = "/ws"
HEALTH_PATH = "/health"
SCHEMA_PATH = "/schema"

#: A frame larger than this is refused (openenv-core's client default is 100 MB; our pictures are small).
DEFAULT_MAX_MESSAGE_BYTES = 16 * 1024 * 1024


class WireError(ValueError):
    """A message that does not follow the protocol; `code` is the error code a server answers it with."""

    def __init__(self, message: str, code: "ErrorCode") -> None:
        super().__init__(message)
        self.code = code


class ErrorCode(str, enum.Enum):
    """openenv-core's `WSErrorCode`."""

    INVALID_JSON = "INVALID_JSON"
    UNKNOWN_TYPE = "UNKNOWN_TYPE"
    VALIDATION_ERROR = "VALIDATION_ERROR"
    EXECUTION_ERROR = "EXECUTION_ERROR"
    CAPACITY_REACHED = "CAPACITY_REACHED"
    FACTORY_ERROR = "FACTORY_ERROR"
    SESSION_ERROR = "SESSION_ERROR"


# ------------------------------------------------------------------------------------------ client messages
@dataclass(frozen=True)
class Reset:
    data: dict[str, Any] = field(default_factory=dict)
    type = "reset"


@dataclass(frozen=True)
class Step:
    data: dict[str, Any]
    type = "step"


@dataclass(frozen=True)
class StateRequest:
    type = "state"


@dataclass(frozen=True)
class Close:
    type = "close"


ClientMessage = Reset | Step | StateRequest | Close


# ------------------------------------------------------------------------------------------ server messages
@dataclass(frozen=True)
class ObservationMessage:
    """`observation` is the env's own fields (openenv-core leaves out reward, done and metadata)."""

    observation: dict[str, Any]
    reward: float | None = None
    done: bool = False
    type = "observation"


@dataclass(frozen=True)
class StateMessage:
    data: dict[str, Any]
    type = "state"


@dataclass(frozen=True)
class ErrorMessage:
    message: str
    code: ErrorCode
    extra: dict[str, Any] = field(default_factory=dict)
    type = "error"


ServerMessage = ObservationMessage | StateMessage | ErrorMessage


# ------------------------------------------------------------------------------------------ serialize / parse
def serialize(message: ClientMessage | ServerMessage) -> str:
    """The JSON text frame of `message` (NaN and infinities refused: JSON has none)."""
    if isinstance(message, (Reset, Step)):
        body: dict[str, Any] = {"type": message.type, "data": message.data}
    elif isinstance(message, (StateRequest, Close)):
        body = {"type": message.type}
    elif isinstance(message, ObservationMessage):
        body = {"type": message.type, "data": {"observation": message.observation, "reward": message.reward,
                                               "done": message.done}}
    elif isinstance(message, StateMessage):
        body = {"type": message.type, "data": message.data}
    elif isinstance(message, ErrorMessage):
        body = {"type": message.type, "data": {**message.extra, "message": message.message, "code": message.code.value}}
    else:
        raise TypeError(f"not an OpenEnv message: {type(message).__name__}")
    return json.dumps(body, allow_nan=False)


def _load(frame: str | bytes, max_bytes: int) -> dict[str, Any]:
    if len(frame) > max_bytes:
        raise WireError(f"message of {len(frame)} bytes is over the {max_bytes}-byte cap", ErrorCode.VALIDATION_ERROR)
    try:
        body = json.loads(frame)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise WireError(f"Invalid JSON: {e}", ErrorCode.INVALID_JSON) from e
    if not isinstance(body, dict):
        raise WireError(f"a message is a JSON object, got {type(body).__name__}", ErrorCode.VALIDATION_ERROR)
    return body


def _only(body: dict[str, Any], allowed: set[str], what: str) -> None:
    extra = set(body) - allowed
    if extra:  # openenv-core's messages forbid extra fields
        raise WireError(f"{what} message has unknown fields {sorted(extra)}", ErrorCode.VALIDATION_ERROR)


def parse_client(frame: str | bytes, max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> ClientMessage:
    """A client frame as a typed message; WireError (with the code to answer) if it is not one."""
    body = _load(frame, max_bytes)
    kind = body.get("type", "")
    if kind == "reset":
        _only(body, {"type", "data"}, "reset")
        data = body.get("data", {})
        if not isinstance(data, dict):
            raise WireError("reset data must be an object", ErrorCode.VALIDATION_ERROR)
        seed = data.get("seed")
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool) or seed < 0):
            raise WireError(f"reset seed must be an int >= 0, got {seed!r}", ErrorCode.VALIDATION_ERROR)
        return Reset(data)
    if kind == "step":
        _only(body, {"type", "data"}, "step")
        if not isinstance(body.get("data"), dict):
            raise WireError("step data (the action) must be an object", ErrorCode.VALIDATION_ERROR)
        return Step(body["data"])
    if kind in ("state", "close"):
        _only(body, {"type"}, kind)
        return StateRequest() if kind == "state" else Close()
    raise WireError(f"Unknown message type: {kind}", ErrorCode.UNKNOWN_TYPE)


def parse_server(frame: str | bytes, max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> ServerMessage:
    """A server frame as a typed message; WireError if it is not one."""
    body = _load(frame, max_bytes)
    kind, data = body.get("type"), body.get("data")
    if not isinstance(data, dict):
        raise WireError(f"server message {kind!r} without a data object", ErrorCode.VALIDATION_ERROR)
    if kind == "observation":
        observation, reward, done = data.get("observation"), data.get("reward"), data.get("done", False)
        if not isinstance(observation, dict):
            raise WireError("observation data.observation must be an object", ErrorCode.VALIDATION_ERROR)
        if reward is not None:
            if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
                raise WireError(f"observation reward must be a finite number or null, got {reward!r}",
                                ErrorCode.VALIDATION_ERROR)
            reward = float(reward)
        if not isinstance(done, bool):
            raise WireError(f"observation done must be a bool, got {done!r}", ErrorCode.VALIDATION_ERROR)
        return ObservationMessage(observation, reward, done)
    if kind == "state":
        return StateMessage(data)
    if kind == "error":
        try:
            code = ErrorCode(data.get("code"))
        except ValueError as e:
            raise WireError(f"error message with unknown code {data.get('code')!r}", ErrorCode.VALIDATION_ERROR) from e
        extra = {k: v for k, v in data.items() if k not in ("message", "code")}
        return ErrorMessage(str(data.get("message", "")), code, extra)
    raise WireError(f"unknown server message type {kind!r}", ErrorCode.UNKNOWN_TYPE)


# ------------------------------------------------------------------------------------------ our envs' shapes
ACTION_SCHEMA: dict[str, Any] = {
    "title": "TextAction", "type": "object", "additionalProperties": False, "required": ["text"],
    "properties": {"text": {"type": "string", "description": "The model's text of one turn."}},
}
OBSERVATION_SCHEMA: dict[str, Any] = {
    "title": "TextImageObservation", "type": "object",
    "properties": {
        "text": {"type": "string", "description": "The observation's text (at reset: the task's question)."},
        "images": {"type": "array", "items": {"type": "string"},
                   "description": "Pictures as PNG data URLs (data:image/png;base64,...), in placeholder order."},
        "role": {"type": "string", "enum": ["user", "tool"], "description": "Chat role of the feedback."},
        "verdict": {"type": ["number", "null"], "description": "The env's reward for the episode so far."},
        "info": {"type": "object", "description": "The env's step info."},
        "done": {"type": "boolean"}, "reward": {"type": ["number", "null"]},
    },
}
STATE_SCHEMA: dict[str, Any] = {
    "title": "State", "type": "object",
    "properties": {"episode_id": {"type": ["string", "null"]}, "step_count": {"type": "integer", "minimum": 0}},
}
