"""Messages to the scheduler thread. Other threads never touch the scheduler's state: they post one of these,
and the scheduler applies it between two steps; a control message's `reply` receives its answer there."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from jaxrl_vlm.engine.protocol import GenerateOutput, GenerateRequest
from rollout.sglang_wire import PauseMode, UpdateWeightsRequest

Reply = Callable[[Any], None]


@dataclass(frozen=True)
class GenerateMsg:
    """A new request; `on_finish` is called once, from the scheduler thread."""

    request: GenerateRequest
    on_finish: Callable[[GenerateOutput], None]


@dataclass(frozen=True)
class AbortMsg:
    """Abort the request(s) with this rid, or every request when rid is None."""

    rid: str | None
    message: str


@dataclass(frozen=True)
class PauseMsg:
    mode: PauseMode
    reply: Reply


@dataclass(frozen=True)
class ContinueMsg:
    reply: Reply


@dataclass(frozen=True)
class FlushMsg:
    """Answered True once flushed, False while requests run or wait."""

    reply: Reply


@dataclass(frozen=True)
class LoadsMsg:
    """Answered with the scheduler's counts (running, waiting, tokens, paused mode)."""

    reply: Reply


@dataclass(frozen=True)
class UpdateWeightsMsg:
    """Queued until it may run (SGLang's writer lock); answered with the `/update_weights_from_disk` body.
    `deadline` (time.monotonic()): past it the caller has given up, so an update that has not started is dropped."""

    update: UpdateWeightsRequest
    reply: Reply
    deadline: float | None = None


@dataclass(frozen=True)
class MemoryMsg:
    """`/release_memory_occupation` (release=True) or `/resume_memory_occupation` of `tags` ("weights",
    "kv_cache"; None: both); answered with None, or an error message when it cannot be applied now."""

    release: bool
    tags: tuple[str, ...] | None
    reply: Reply


@dataclass(frozen=True)
class StopMsg:
    """End the scheduler thread (everything still held is answered with abort)."""


ControlMsg = PauseMsg | ContinueMsg | FlushMsg | LoadsMsg | UpdateWeightsMsg | MemoryMsg
Message = GenerateMsg | AbortMsg | ControlMsg | StopMsg
