"""Async HTTP client for SGLang's native API (`/generate` plus control and weight endpoints).

The wire contract is `reference/sglang_api.md` §1-2 and §4. What this client adds over slime's
httpx helpers (60 blind retries, no timeouts):

- one shared aiohttp connection pool per client, created lazily inside the running loop;
- a total and a connect timeout on every request;
- bounded retries with exponential backoff and jitter, only on connection errors, timeouts and
  HTTP 5xx; a 4xx is a caller bug and raises at once with the server's error body;
- every retry is recorded on the result (`retries`, `retry_errors`);
- router mode: `/generate` goes to the router (optionally with sgl-router's consistent-hashing
  header), control calls go to each worker's own URL;
- `sync_weights_from_disk`: pause -> flush (retried while busy, bounded by time) -> update ->
  continue, where continue is attempted whatever happened before, so no engine is left paused; with an engine in
  this process (`local_engine`), the same sequence calls its methods (the ones its HTTP handlers call) directly;
- `api_key`: sent as `Authorization: Bearer <key>` to servers started with SGLang's `--api-key`;
- `vocab_size`: every token id an engine returns is checked against it, so an id the tokenizer cannot
  know fails that request with a named cause instead of surfacing later in batching;
- `reconnect_timeout_s` (`--engine-reconnect-timeout`): an engine lost to a connection-level failure is waited for
  by its `link` (rollout/engine_link.py): `/generate` requests are held, not sent, until it is back and its weights
  are restored, and the requests it cut are re-sent;
- router worker loss (`allow_worker_loss`, `--allow-worker-loss`): a worker that a fleet control call (weight sync,
  version check) cannot reach is dropped from `worker_urls` and recorded in `lost_workers`, or stops the run with
  `WorkerLost` naming it.

This module never imports jax: a rollout host runs without it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import random
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import aiohttp

from rollout.engine_link import MAX_OUTAGES_PER_REQUEST, EngineLink, EngineLost, LinkState
from rollout.sglang_wire import (
    AbortRequest,
    FinishReason,
    FinishType,
    PauseMode,
    UpdateWeightsRequest,
    WeightVersionSpan,
    as_pause_mode,
    authorization_header,
    parse_weight_version_spans,
)

logger = logging.getLogger(__name__)

# sgl-router's consistent_hashing policy reads this header; slime sends the episode's session id.
ROUTING_KEY_HEADER = "X-SMG-Routing-Key"
_BODY_SNIPPET_CHARS = 500


# --------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------


def _snippet(text: str, limit: int = _BODY_SNIPPET_CHARS) -> str:
    text = text.strip()
    return text if len(text) <= limit else text[:limit] + f"... [{len(text) - limit} more chars]"


class EngineError(RuntimeError):
    """A request to an engine endpoint failed.

    `endpoint` is the full URL, `status` the last HTTP status (None when no response came back),
    `body` the last response body or transport error text (truncated in the message), `attempts`
    how many times the request was sent, `errors` one line per failed attempt.
    """

    def __init__(
        self,
        endpoint: str,
        status: int | None,
        body: str,
        attempts: int,
        errors: Sequence[str] = (),
        reason: str = "request failed",
    ) -> None:
        self.endpoint = endpoint
        self.status = status
        self.body = body
        self.attempts = attempts
        self.errors = list(errors)
        status_text = f"HTTP {status}" if status is not None else "no HTTP response"
        super().__init__(
            f"{endpoint}: {reason} ({status_text}, {attempts} attempt{'s' if attempts != 1 else ''}): "
            f"{_snippet(body)}"
        )


class EngineUnavailable(EngineError):
    """The engine could not be reached, or kept failing (5xx, timeouts) until retries ran out."""


class EngineRequestError(EngineError):
    """The engine rejected the request (HTTP 4xx). Never retried: the request itself is wrong."""


class EngineResponseError(EngineError):
    """The engine answered 2xx but the body breaks the wire contract (missing keys, ids disagree)."""


class InProcessEngine(Protocol):
    """The weight-update and control calls of an engine in this process (`SGLangClient.local_engine`, our embedded engine's
    `Engine`): the methods its HTTP handlers call, with the same answers, so the client skips HTTP. A scheduler that
    does not answer raises an EngineUnavailable, as an unreachable server does."""

    @property
    def weight_version(self) -> str: ...

    async def pause_generation(self, mode: PauseMode) -> dict[str, Any]: ...

    async def flush_cache(self) -> bool: ...

    async def update_weights_from_disk(self, update: UpdateWeightsRequest) -> dict[str, Any]: ...

    async def continue_generation(self) -> dict[str, Any]: ...

    def freeze_gc(self) -> int: ...


class WorkerLost(RuntimeError):
    """A worker behind the router could not be reached by a control call, and the policy is to stop
    (`--allow-worker-loss` unset, or it was the last worker). Not an EngineError: no caller retries it."""

    def __init__(self, url: str, message: str) -> None:
        self.url = url
        super().__init__(message)


class EngineRefused(RuntimeError):
    """The engine answers, but cannot serve this run as it was started (a vLLM from a checkpoint with tied
    embeddings, whose in-place reload leaves the head on the first weights). Bad input: the user restarts it the
    way the message says, so the command line reports it in one line and exits 2, as it does a config error. Not
    an EngineError: nothing retries it or counts it as a failed sample."""

    def __init__(self, url: str, message: str) -> None:
        self.url = url
        super().__init__(f"{url}: {message}")


@dataclass(frozen=True)
class WorkerLoss:
    """A worker dropped from `worker_urls` under `--allow-worker-loss`: which, during what call, why, when."""

    url: str
    during: str
    error: str
    at: float  # time.time()


def _unreachable(exc: BaseException) -> bool:
    """No HTTP answer at all after the retries (refused, reset, timed out): the worker is gone, not just busy."""
    return isinstance(exc, EngineUnavailable) and exc.status is None


class WeightSyncError(RuntimeError):
    """`sync_weights_from_disk` failed on at least one worker; `failures` maps worker URL -> reason."""

    def __init__(self, failures: Mapping[str, str]) -> None:
        self.failures = dict(failures)
        detail = "; ".join(f"{url}: {why}" for url, why in self.failures.items())
        super().__init__(f"weight sync failed on {len(self.failures)} worker(s): {detail}")


# --------------------------------------------------------------------------------------------
# Retry policy
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RetryPolicy:
    """Bounded retries: at most `max_retries` re-sends after the first attempt.

    The delay before retry k (k = 0, 1, ...) is `min(backoff_max_s, backoff_base_s * 2**k)`, scaled
    by a uniform factor in `[1 - jitter, 1]` so that many clients retrying at once spread out.
    """

    max_retries: int = 3
    backoff_base_s: float = 0.5
    backoff_max_s: float = 8.0
    jitter: float = 0.5

    def __post_init__(self) -> None:
        if self.max_retries < 0:
            raise ValueError(f"RetryPolicy.max_retries must be >= 0, got {self.max_retries}")
        if self.backoff_base_s < 0 or self.backoff_max_s < 0:
            raise ValueError("RetryPolicy backoff times must be >= 0")
        if not 0.0 <= self.jitter <= 1.0:
            raise ValueError(f"RetryPolicy.jitter must be in [0, 1], got {self.jitter}")


def backoff_delay(policy: RetryPolicy, retry_index: int, rng: random.Random) -> float:
    """Seconds to sleep before retry number `retry_index` (0-based). Pure apart from `rng`."""
    cap = min(policy.backoff_max_s, policy.backoff_base_s * (2.0**retry_index))
    return cap * (1.0 - policy.jitter * rng.random())


# --------------------------------------------------------------------------------------------
# Results
# --------------------------------------------------------------------------------------------


@dataclass
class GenerateResult:
    """One `/generate` answer, parsed and checked.

    `output_ids` / `output_log_probs` come from `meta_info.output_token_logprobs` (entries
    `[logprob, token_id, text|null]`) and include the final stop token; `output_log_probs` is None
    when the request did not ask for logprobs. `finish` is the parsed `meta_info.finish_reason`.
    `prompt_tokens` counts the prompt after image-pad expansion; it is None only on an abort of a request that
    never left SGLang's waiting queue, whose answer has no `prompt_tokens` or `cached_tokens`
    (`TokenizerManager._handle_abort_req`). `weight_version_spans` say which weights sampled which output tokens
    (several spans when weights changed while the request was alive). `rid` is the id the engine answered for (it
    differs from the caller's rid after a retry, see `SGLangClient.generate`).
    """

    output_ids: list[int]
    output_log_probs: list[float] | None
    text: str
    finish: FinishReason
    prompt_tokens: int | None
    cached_tokens: int
    weight_version: str | None
    e2e_latency: float | None
    rid: str | None
    meta_info: dict[str, Any]
    weight_version_spans: tuple[WeightVersionSpan, ...] = ()
    retries: int = 0
    retry_errors: list[str] = field(default_factory=list)
    # An abort caused by this client's own weight update (its /pause_generation), not by the engine or a caller.
    aborted_by_weight_update: bool = False

    @property
    def finish_reason(self) -> FinishType:
        """stop, length or abort (a str enum: it equals the wire text)."""
        return self.finish.type

    @property
    def finish_matched(self) -> int | str | None:
        """The matched stop id (int) or stop string (str) for stop, else None."""
        return self.finish.matched

    @property
    def finish_message(self) -> str | None:
        """The abort message, if the engine gave one."""
        return self.finish.message

    @property
    def token_weight_versions(self) -> list[str]:
        """The versions that sampled this answer's tokens, oldest first, each once (empty: no version named)."""
        versions: list[str] = []
        for span in self.weight_version_spans:
            if span.end > span.start and (not versions or versions[-1] != span.version):
                versions.append(span.version)
        return versions


class WeightUpdateGate:
    """Holds this client's `/generate` requests back while it updates the engines' weights.

    Asynchronous training generates while the trainer works, so a weight update meets requests in flight. Its
    `/pause_generation` (abort mode) ends them as aborted, and `/flush_cache` answers 400 while any request runs or
    waits: a request sent during the update would stall it. So the update closes the gate first, requests wait for
    it to open before each attempt, and every close starts a new epoch: an abort answer to a request sent in an
    earlier epoch was caused by the update (`GenerateResult.aborted_by_weight_update`). In the synchronous loop
    nothing generates during an update and the gate is never waited on.
    """

    def __init__(self) -> None:
        self._open = asyncio.Event()
        self._open.set()
        self.epoch = 0

    @property
    def is_open(self) -> bool:
        return self._open.is_set()

    def close(self) -> None:
        self.epoch += 1
        self._open.clear()

    def open(self) -> None:
        self._open.set()

    async def wait_open(self) -> int:
        """Wait until no update runs; the epoch the caller's request then belongs to."""
        while not self._open.is_set():
            await self._open.wait()
        return self.epoch


@dataclass
class _Reply:
    status: int
    text: str
    data: Any  # parsed JSON, or None when the body is empty or not JSON
    attempts: int
    errors: list[str]


def _parse_body(text: str, content_type: str) -> Any:
    if not text.strip():
        return None
    if "json" in content_type or text.lstrip()[:1] in ("{", "["):
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            return None
    return None


def parse_generate_response(
    data: Any, *, endpoint: str, return_logprob: bool, attempts: int = 1, raw_text: str = "",
    vocab_size: int | None = None,
) -> GenerateResult:
    """Check one `/generate` JSON answer against the wire contract and turn it into a result.

    Raises `EngineResponseError` naming the endpoint and the offending key when the answer is a
    batch list, lacks `meta_info`/`finish_reason`/`text`, has malformed logprob entries, when
    `output_ids` disagrees with the ids inside `output_token_logprobs`, or (with `vocab_size`, the
    tokenizer's) when a token id lies outside `[0, vocab_size)`.
    """

    def bad(why: str) -> EngineResponseError:
        return EngineResponseError(endpoint, 200, raw_text or repr(data), attempts, reason=why)

    if isinstance(data, list):
        raise bad("got a batch (list) response to a single-prompt request")
    if not isinstance(data, dict):
        raise bad("response is not a JSON object")
    meta = data.get("meta_info")
    if not isinstance(meta, dict):
        raise bad("response has no 'meta_info' object")
    text = data.get("text")
    if not isinstance(text, str):
        raise bad("response has no string 'text'")

    try:
        finish = FinishReason.from_json(meta.get("finish_reason"))
    except ValueError as exc:
        raise bad(str(exc)) from None

    raw_ids = data.get("output_ids")
    log_probs: list[float] | None
    if return_logprob:
        entries = meta.get("output_token_logprobs")
        if not isinstance(entries, list):
            raise bad("meta_info.output_token_logprobs missing although return_logprob was true")
        ids: list[int] = []
        log_probs = []
        for i, entry in enumerate(entries):
            if (
                not isinstance(entry, (list, tuple))
                or len(entry) < 2
                or isinstance(entry[1], bool)
                or not isinstance(entry[1], int)
                or isinstance(entry[0], bool)
                or not isinstance(entry[0], (int, float))
            ):
                raise bad(f"meta_info.output_token_logprobs[{i}] is not [logprob, token_id, text], got {entry!r}")
            log_probs.append(float(entry[0]))
            ids.append(int(entry[1]))
        if raw_ids is not None and list(raw_ids) != ids:
            raise bad(
                f"output_ids ({len(raw_ids)} ids) disagree with the ids in meta_info.output_token_logprobs "
                f"({len(ids)} ids); first mismatch at index "
                f"{next((k for k, (a, b) in enumerate(zip(raw_ids, ids)) if a != b), min(len(raw_ids), len(ids)))}"
            )
    else:
        if not isinstance(raw_ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in raw_ids):
            raise bad("response has no integer list 'output_ids' (and no logprobs were requested)")
        ids, log_probs = list(raw_ids), None

    if vocab_size is not None:
        bad_ids = [(k, t) for k, t in enumerate(ids) if not 0 <= t < vocab_size]
        if bad_ids:
            k, t = bad_ids[0]
            raise bad(f"output token id {t} at position {k} is outside the tokenizer's vocabulary [0, {vocab_size}) "
                      f"({len(bad_ids)} such id(s))")

    prompt_tokens = meta.get("prompt_tokens")
    # SGLang answers a request aborted in its waiting queue without prompt_tokens (never prefilled): still an abort.
    queued_abort = prompt_tokens is None and finish.type is FinishType.ABORT
    if not queued_abort and (not isinstance(prompt_tokens, int) or isinstance(prompt_tokens, bool)):
        raise bad(f"meta_info.prompt_tokens must be an int, got {prompt_tokens!r}")
    try:
        spans = parse_weight_version_spans(meta, len(ids))
    except ValueError as exc:
        raise bad(str(exc)) from None
    weight_version = meta.get("weight_version")
    e2e = meta.get("e2e_latency")
    rid = meta.get("id")
    return GenerateResult(
        output_ids=ids,
        output_log_probs=log_probs,
        text=text,
        finish=finish,
        prompt_tokens=prompt_tokens,
        cached_tokens=int(meta.get("cached_tokens") or 0),
        weight_version=None if weight_version is None else str(weight_version),
        e2e_latency=None if e2e is None else float(e2e),
        rid=None if rid is None else str(rid),
        meta_info=meta,
        weight_version_spans=spans,
    )


def parse_prompt_logprobs(data: Any, *, endpoint: str, attempts: int = 1, raw_text: str = "") -> list[float]:
    """The prompt log-probs of a `/generate` answer to `logprob_start_len: 0`: `meta_info.input_token_logprobs`
    entries `[logprob, token_id, text]`, one per prompt position after image expansion, the first with a null
    log-prob; returns the log-probs of positions 1.. (len = prompt_tokens - 1). EngineResponseError otherwise."""

    def bad(why: str) -> EngineResponseError:
        return EngineResponseError(endpoint, 200, raw_text or repr(data), attempts, reason=why)

    meta = data.get("meta_info") if isinstance(data, dict) else None
    if not isinstance(meta, dict):
        raise bad("response has no 'meta_info' object")
    entries = meta.get("input_token_logprobs")
    if not isinstance(entries, list) or not entries:
        raise bad("meta_info.input_token_logprobs is missing or empty although logprob_start_len was 0")
    prompt_tokens = meta.get("prompt_tokens")
    if isinstance(prompt_tokens, int) and not isinstance(prompt_tokens, bool) and prompt_tokens != len(entries):
        raise bad(f"meta_info.input_token_logprobs has {len(entries)} entries for prompt_tokens={prompt_tokens}")
    out: list[float] = []
    for i, entry in enumerate(entries[1:], start=1):
        if (not isinstance(entry, (list, tuple)) or len(entry) < 2 or isinstance(entry[0], bool)
                or not isinstance(entry[0], (int, float)) or not math.isfinite(entry[0])):
            raise bad(f"meta_info.input_token_logprobs[{i}] is not [finite logprob, token_id, text], got {entry!r}")
        out.append(float(entry[0]))
    return out


def count_requests_in_loads(data: Any, *, endpoint: str) -> int:
    """Running + waiting requests over all DP ranks of a `/v1/loads` answer (`{"loads": [...]}`)."""
    loads = data.get("loads") if isinstance(data, dict) else None
    if not isinstance(loads, list):
        raise EngineResponseError(endpoint, 200, repr(data), 1, reason="/v1/loads answer has no 'loads' list")
    total = 0
    for i, rank in enumerate(loads):
        if not isinstance(rank, dict):
            raise EngineResponseError(endpoint, 200, repr(data), 1, reason=f"loads[{i}] is not an object")
        for key in ("num_running_reqs", "num_waiting_reqs"):
            value = rank.get(key, 0)
            if not isinstance(value, int) or isinstance(value, bool):
                raise EngineResponseError(endpoint, 200, repr(data), 1, reason=f"loads[{i}].{key} is not an int")
            total += value
    return total


# --------------------------------------------------------------------------------------------
# Client
# --------------------------------------------------------------------------------------------


def _strip_url(url: str) -> str:
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"engine URL must start with http:// or https://, got {url!r}")
    return url.rstrip("/")


class SGLangClient:
    """Async client for one SGLang server, or for sgl-router in front of several workers.

    `url` receives `/generate` (a server, or the router). `worker_urls` (router mode) lists the
    servers that receive control calls directly; by default it is `[url]`. Per-worker control
    methods take `url=`; it may be omitted only when there is exactly one worker. Fleet methods
    (`wait_healthy`, `abort_all`, `sync_weights_from_disk`, `get_weight_versions`) cover every
    worker concurrently.

    Timeouts are seconds. `timeout_s` bounds a whole `/generate` attempt, including the wait for a
    free pooled connection, so keep `max_connections` >= the number of concurrent requests.

    `api_key`: sent as `Authorization: Bearer <key>` on every request (SGLang's `--api-key`); it never
    appears in error messages. `vocab_size` (the tokenizer's `len(tokenizer)`; settable later as an
    attribute): `/generate` answers with a token id outside `[0, vocab_size)` raise `EngineResponseError`.
    """

    def __init__(
        self,
        url: str,
        *,
        worker_urls: Sequence[str] | None = None,
        max_connections: int = 512,
        timeout_s: float = 600.0,
        connect_timeout_s: float = 10.0,
        control_timeout_s: float = 60.0,
        health_timeout_s: float = 30.0,
        weight_update_timeout_s: float = 1800.0,
        retry: RetryPolicy | None = None,
        keepalive_timeout_s: float = 4.0,
        trust_env: bool = False,
        seed: int | None = None,
        api_key: str | None = None,
        vocab_size: int | None = None,
        reconnect_timeout_s: float = 0.0,
        allow_worker_loss: bool = False,
    ) -> None:
        self.url = _strip_url(url)
        self.worker_urls = [_strip_url(u) for u in worker_urls] if worker_urls is not None else [self.url]
        if not self.worker_urls:
            raise ValueError("worker_urls is empty: router mode needs at least one worker URL")
        if max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {max_connections}")
        for name, value in (
            ("timeout_s", timeout_s),
            ("connect_timeout_s", connect_timeout_s),
            ("control_timeout_s", control_timeout_s),
            ("health_timeout_s", health_timeout_s),
            ("weight_update_timeout_s", weight_update_timeout_s),
        ):
            if value <= 0:
                raise ValueError(f"{name} must be > 0 seconds, got {value}")
        if api_key is not None and (not isinstance(api_key, str) or not api_key):
            raise ValueError("api_key must be a non-empty string (or None)")
        if vocab_size is not None and (isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1):
            raise ValueError(f"vocab_size must be a positive int (or None), got {vocab_size!r}")
        self._auth_headers = authorization_header(api_key) if api_key is not None else {}
        self.vocab_size = vocab_size
        # The engine object serving `url` from this very process (our embedded engine), if any: a trainer in the
        # same process may then stage new weights in memory (`load_format` IN_MEMORY_LOAD_FORMAT) instead of on disk,
        # and the weight-update calls go to its methods (`InProcessEngine`) without an HTTP round trip.
        self.local_engine: Any = None
        # LoRA served by the engine (`load_lora_adapter`): the adapter every later /generate selects, or None (base).
        self.lora_name: str | None = None
        self.is_router = worker_urls is not None
        self.max_connections = max_connections
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.control_timeout_s = control_timeout_s
        self.health_timeout_s = health_timeout_s
        self.weight_update_timeout_s = weight_update_timeout_s
        self.retry = retry or RetryPolicy()
        # SGLang serves through uvicorn, whose idle keep-alive timeout is 5 s; reusing a socket the
        # server is closing yields a spurious disconnect, so drop idle sockets a little earlier.
        self.keepalive_timeout_s = keepalive_timeout_s
        self.trust_env = trust_env
        self._rng = random.Random(seed)
        self.update_gate = WeightUpdateGate()
        # The engine that serves /generate may die and come back (rollout/engine_link.py); None: no waiting.
        if reconnect_timeout_s < 0:
            raise ValueError(f"reconnect_timeout_s must be >= 0, got {reconnect_timeout_s}")
        self.link: EngineLink | None = None
        if reconnect_timeout_s > 0:
            self.link = EngineLink(self.url, lambda t: self._probe_health(self.url, t), reconnect_timeout_s,
                                   probe_timeout_s=min(self.health_timeout_s, 5.0))
        # Router mode: a worker no control call can reach is dropped (allowed) or stops the run (WorkerLost).
        self.allow_worker_loss = allow_worker_loss
        self.lost_workers: list[WorkerLoss] = []
        self._session: aiohttp.ClientSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.sessions_created = 0

    # ---- lifecycle -------------------------------------------------------------------------

    async def __aenter__(self) -> SGLangClient:
        self._get_session()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the pooled connections. The client may be used again afterwards (new pool)."""
        if self.link is not None:
            await self.link.close()
        session, self._session, self._loop = self._session, None, None
        if session is not None and not session.closed:
            await session.close()

    def _get_session(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        if self._session is not None and not self._session.closed:
            if self._loop is not loop:
                raise RuntimeError(
                    "SGLangClient is bound to the event loop it was first used in; "
                    "create one client per loop (or close() it before switching loops)"
                )
            return self._session
        connector = aiohttp.TCPConnector(
            limit=self.max_connections, limit_per_host=0, keepalive_timeout=self.keepalive_timeout_s
        )
        self._session = aiohttp.ClientSession(connector=connector, trust_env=self.trust_env)
        self._loop = loop
        self.sessions_created += 1
        return self._session

    def _in_process(self, url: str | None) -> InProcessEngine | None:
        """`local_engine` when `url` (None: the one worker) is the engine in this process, else None."""
        if self.local_engine is None or self.is_router or self._worker(url) != self.url:
            return None
        return self.local_engine

    def _worker(self, url: str | None) -> str:
        if url is not None:
            return _strip_url(url)
        if len(self.worker_urls) == 1:
            return self.worker_urls[0]
        raise ValueError(
            f"this client has {len(self.worker_urls)} workers {self.worker_urls}; pass url= to pick one "
            "(or use the fleet methods wait_healthy / abort_all / sync_weights_from_disk / get_weight_versions)"
        )

    # ---- transport -------------------------------------------------------------------------

    async def _request(
        self,
        method: str,
        base_url: str,
        path: str,
        *,
        json_body: Any = None,
        body_for_attempt: Callable[[int], Any] | None = None,
        params: Mapping[str, str] | None = None,
        headers: Mapping[str, str] | None = None,
        timeout_s: float,
        retries: bool = True,
        answer_statuses: frozenset[int] = frozenset(),
        before_attempt: Callable[[], Awaitable[Any]] | None = None,
        wait_for_engine: bool = False,
        bypass_link: bool = False,
    ) -> _Reply:
        """Send one HTTP request with bounded retries; return the first 2xx (or `answer_statuses`) reply.

        Retried: connection errors, dropped connections, timeouts, HTTP >= 500. A 4xx not listed in
        `answer_statuses` raises `EngineRequestError` at once. `body_for_attempt(k)` (k = 1, 2, ...)
        overrides `json_body` when each attempt needs its own body. `before_attempt` is awaited before each
        attempt (the weight-update gate of `/generate`).

        Engine loss (`self.link`, a request to `self.url`): a connection-level failure (refused, reset, disconnected;
        not a timeout) marks the link down. A `wait_for_engine` request (`/generate`) then waits until the engine is
        back and re-sends, without spending a retry (at most MAX_OUTAGES_PER_REQUEST outages; `EngineLost` past
        them or when the engine does not return); any other request to the lost engine fails at once.
        """
        endpoint = base_url + path
        session = self._get_session()
        if self._auth_headers:
            headers = {**self._auth_headers, **(headers or {})}
        timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=min(self.connect_timeout_s, timeout_s))
        max_attempts = 1 + (self.retry.max_retries if retries else 0)
        errors: list[str] = []
        last_status: int | None = None
        last_body = ""
        link = self.link if (self.link is not None and base_url == self.url and self.link.armed
                             and not bypass_link) else None
        outages = 0
        attempt = sends = 0
        while attempt < max_attempts:
            attempt += 1
            sends += 1
            if link is not None and wait_for_engine:
                await link.wait_up()
            elif link is not None and link.is_down:
                raise EngineUnavailable(endpoint, None, f"engine unreachable since {link.outages[-1].cause}",
                                        attempt - 1, errors, reason="engine lost, waiting for it to come back")
            if before_attempt is not None:
                await before_attempt()
            # Numbered by sends, not attempts: a request re-sent after an outage gets a rid of its own too.
            body = body_for_attempt(sends) if body_for_attempt is not None else json_body
            try:
                async with session.request(
                    method, endpoint, json=body, params=params, headers=headers, timeout=timeout
                ) as resp:
                    text = await resp.text()
                    status = resp.status
                    content_type = resp.headers.get("Content-Type", "")
            except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, asyncio.TimeoutError) as exc:
                if isinstance(exc, asyncio.TimeoutError):
                    detail = f"timeout after {timeout_s:g} s"
                else:
                    detail = f"{type(exc).__name__}: {exc}"
                errors.append(f"attempt {attempt}: {detail}")
                last_status, last_body = None, detail
                if link is not None and not isinstance(exc, asyncio.TimeoutError):
                    link.lost(f"{method} {endpoint}: {detail}")
                    if wait_for_engine and link.state is not LinkState.UP:
                        outages += 1
                        if outages > MAX_OUTAGES_PER_REQUEST:
                            raise EngineLost(self.url, f"{endpoint}: engine at {self.url} lost {outages} times "
                                                       f"while this request was in flight; errors: {errors}")
                        # This attempt is the outage's, not the request's: re-sent once the engine is back.
                        attempt -= 1
                        await link.wait_up()
                        link.requests_resent += 1
                        continue
            except aiohttp.ClientError as exc:  # malformed URL, bad headers...: not transient
                raise EngineError(endpoint, None, f"{type(exc).__name__}: {exc}", attempt, errors) from exc
            else:
                if 200 <= status < 300 or status in answer_statuses:
                    return _Reply(status, text, _parse_body(text, content_type), attempt, errors)
                if 400 <= status < 500:
                    raise EngineRequestError(endpoint, status, text, attempt, errors, reason="request rejected")
                errors.append(f"attempt {attempt}: HTTP {status}: {_snippet(text, 200)}")
                last_status, last_body = status, text
            if attempt < max_attempts:
                delay = backoff_delay(self.retry, attempt - 1, self._rng)
                logger.warning(
                    "%s %s failed (%s); retry %d/%d in %.2f s",
                    method, endpoint, errors[-1], attempt, max_attempts - 1, delay,
                )
                await asyncio.sleep(delay)
        raise EngineUnavailable(
            endpoint, last_status, last_body, max_attempts, errors,
            reason=f"engine unavailable, last error: {errors[-1]}",
        )

    async def _get_json(self, url: str, path: str, *, timeout_s: float | None = None) -> Any:
        reply = await self._request("GET", url, path, timeout_s=timeout_s or self.control_timeout_s)
        return reply.data

    async def _post_json(self, url: str, path: str, body: Any, *, timeout_s: float | None = None) -> dict[str, Any]:
        reply = await self._request("POST", url, path, json_body=body, timeout_s=timeout_s or self.control_timeout_s)
        if isinstance(reply.data, dict):
            return reply.data
        # Some control endpoints answer an empty or plain-text body; keep it for the caller's logs.
        return {"text": reply.text}

    # ---- generation ------------------------------------------------------------------------

    async def generate(
        self,
        input_ids: Sequence[int],
        *,
        image_data: Sequence[str] | None = None,
        video_data: Sequence[str] | None = None,
        sampling_params: Mapping[str, Any],
        return_logprob: bool = True,
        rid: str | None = None,
        routing_key: str | None = None,
        timeout_s: float | None = None,
        return_routed_experts: bool = False,
    ) -> GenerateResult:
        """POST `/generate` with token ids (and every image and clip of the conversation so far).

        `input_ids`: the prompt with one compact `<|image_pad|>` per image and `<|video_pad|>` per clip.
        `image_data`: PNG data URLs, `video_data`: lossless video data URLs, each in placeholder order. `routing_key` sets sgl-router's consistent-hashing header so
        every turn of an episode reaches the same worker (and its KV prefix).

        A retried attempt is sent with rid `"<rid>.retry<k>"`: the engine aborts a request whose
        client went away, but may still hold the old rid for a moment.
        """
        base_rid = rid if rid is not None else uuid.uuid4().hex
        body = self._generate_body(input_ids, image_data, sampling_params, return_logprob, base_rid,
                                   video_data=video_data)
        if return_routed_experts:  # SGLang's field (an MoE engine answers with meta_info.routed_experts)
            body["return_routed_experts"] = True

        def body_for_attempt(attempt: int) -> dict[str, Any]:
            # The adapter is chosen when the attempt is sent (after the weight-update gate): a request that waited
            # out an adapter sync goes to the new adapter, never to the unloaded one.
            sent = body if attempt == 1 else self._with_rid(body, f"{base_rid}.retry{attempt - 1}")
            return self._with_adapter(sent)

        headers = {ROUTING_KEY_HEADER: routing_key} if routing_key is not None else None
        sent_in_epoch = self.update_gate.epoch

        async def wait_for_gate() -> None:
            nonlocal sent_in_epoch
            sent_in_epoch = await self.update_gate.wait_open()

        reply = await self._request(
            "POST", self.url, self.generate_path, body_for_attempt=body_for_attempt, headers=headers,
            timeout_s=timeout_s if timeout_s is not None else self.timeout_s, before_attempt=wait_for_gate,
            wait_for_engine=True,
        )
        result = self._parse_generate(reply, return_logprob)
        result.retries = reply.attempts - 1
        result.retry_errors = reply.errors
        result.aborted_by_weight_update = (result.finish_reason is FinishType.ABORT
                                           and sent_in_epoch != self.update_gate.epoch)
        return result

    async def prompt_logprobs(self, input_ids: Sequence[int], *, image_data: Sequence[str] | None = None,
                              temperature: float = 1.0, timeout_s: float | None = None) -> list[float]:
        """log p(input_ids[i] | input_ids[:i]) for every position i >= 1 of the prompt after image expansion, from
        SGLang's prompt log-probs: `/generate` with `max_new_tokens` 0, `return_logprob` and `logprob_start_len`
        0, read from `meta_info.input_token_logprobs` (entry 0, whose log-prob is null, is dropped). `input_ids`
        hold one compact pad per image, as for `generate`. This is how a teacher engine scores a student's
        trajectory (on-policy distillation). EngineResponseError names a malformed answer."""
        body = self._generate_body(input_ids, image_data, {"max_new_tokens": 0, "temperature": float(temperature)},
                                   True, uuid.uuid4().hex)
        body["logprob_start_len"] = 0
        reply = await self._request("POST", self.url, self.generate_path, body_for_attempt=lambda attempt: body,
                                    timeout_s=timeout_s if timeout_s is not None else self.timeout_s,
                                    wait_for_engine=True)
        return parse_prompt_logprobs(reply.data, endpoint=self.url + self.generate_path, attempts=reply.attempts,
                                     raw_text=reply.text)

    # The engine protocol's generate route, body and answer (`VLLMClient` says them in vLLM's protocol).
    generate_path = "/generate"

    def _generate_body(self, input_ids: Sequence[int], image_data: Sequence[str] | None,
                       sampling_params: Mapping[str, Any], return_logprob: bool, rid: str,
                       video_data: Sequence[str] | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {
            "rid": rid,
            "input_ids": [int(t) for t in input_ids],
            "sampling_params": dict(sampling_params),
            "return_logprob": bool(return_logprob),
        }
        if image_data:
            body["image_data"] = list(image_data)
        if video_data:
            body["video_data"] = list(video_data)
        if self.lora_name is not None:
            body["lora_path"] = self.lora_name  # SGLang selects a loaded adapter by its name in `lora_path`
        return body

    @staticmethod
    def _with_rid(body: dict[str, Any], rid: str) -> dict[str, Any]:
        return {**body, "rid": rid}

    def _with_adapter(self, body: dict[str, Any]) -> dict[str, Any]:
        """`body` selecting the adapter loaded now (`lora_name`), or none (the base)."""
        if body.get("lora_path") == self.lora_name:
            return body
        out = {k: v for k, v in body.items() if k != "lora_path"}
        if self.lora_name is not None:
            out["lora_path"] = self.lora_name
        return out

    def _parse_generate(self, reply: _Reply, return_logprob: bool) -> GenerateResult:
        return parse_generate_response(
            reply.data, endpoint=self.url + self.generate_path, return_logprob=return_logprob,
            attempts=reply.attempts, raw_text=reply.text, vocab_size=self.vocab_size,
        )

    # ---- health ----------------------------------------------------------------------------

    async def _probe_health(self, url: str, timeout_s: float) -> tuple[bool, str]:
        """One probe: GET /health_generate, falling back to /health on servers without it (404)."""
        last = ""
        for path in ("/health_generate", "/health"):
            try:
                reply = await self._request("GET", url, path, timeout_s=timeout_s, retries=False,
                                            answer_statuses=frozenset({404}), bypass_link=True)
            except EngineRequestError as exc:
                return False, str(exc)
            except EngineUnavailable as exc:
                return False, str(exc)
            if reply.status == 404:
                last = f"{url}{path}: HTTP 404"
                continue
            return True, ""
        return False, last

    async def health(self, url: str | None = None) -> bool:
        """True when the worker answers 200 on /health_generate (or /health). Never raises on 5xx or
        unreachable workers: those are the "not healthy" answers."""
        ok, _ = await self._probe_health(self._worker(url), self.health_timeout_s)
        return ok

    async def wait_healthy(self, timeout_s: float = 600.0, poll_interval_s: float = 1.0) -> None:
        """Poll every worker until each is healthy; raise `EngineUnavailable` naming the ones still
        unhealthy (and their last error) once `timeout_s` seconds have passed."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s

        async def wait_one(url: str) -> tuple[str, int, str] | None:
            attempts, last = 0, ""
            while True:
                remaining = deadline - loop.time()
                if remaining <= 0:
                    return url, attempts, last
                attempts += 1
                ok, last = await self._probe_health(url, min(self.health_timeout_s, max(remaining, 1e-3)))
                if ok:
                    return None
                remaining = deadline - loop.time()
                if remaining <= 0:
                    return url, attempts, last
                await asyncio.sleep(min(poll_interval_s, remaining))

        failures = [f for f in await asyncio.gather(*(wait_one(u) for u in self.worker_urls)) if f is not None]
        if failures:
            url, attempts, last = failures[0]
            others = ", ".join(f[0] for f in failures[1:])
            raise EngineUnavailable(
                url + "/health_generate", None, last, attempts,
                reason=f"not healthy within {timeout_s:g} s" + (f" (also unhealthy: {others})" if others else ""),
            )

    async def resume_and_wait_healthy(self, timeout_s: float = 600.0, poll_interval_s: float = 1.0) -> None:
        """Make every worker serve again after a trainer that may have died mid weight sync: `/continue_generation`
        first (retried while a worker is not yet reachable), then `wait_healthy`.

        The order matters: SGLang's `/health` sends a probe request that waits on the pause condition, so a paused
        SGLang answers 503 after its 20 s timeout and would never be found healthy, hence never resumed."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s

        async def resume(url: str) -> None:
            while True:
                try:
                    await self.continue_generation(url=url)
                    return
                except EngineUnavailable:
                    if loop.time() + poll_interval_s >= deadline:
                        raise
                await asyncio.sleep(poll_interval_s)

        await asyncio.gather(*(resume(u) for u in self.worker_urls))
        await self.wait_healthy(timeout_s=max(1e-3, deadline - loop.time()), poll_interval_s=poll_interval_s)

    # ---- info ------------------------------------------------------------------------------

    async def _get_with_fallback(self, url: str, paths: Sequence[str]) -> Any:
        """GET the first of `paths` the server knows (SGLang renamed several info endpoints)."""
        for path in paths:
            last = path == paths[-1]
            reply = await self._request("GET", url, path, timeout_s=self.control_timeout_s,
                                        answer_statuses=frozenset() if last else frozenset({404}))
            if reply.status == 404:
                continue
            if not isinstance(reply.data, dict):
                raise EngineResponseError(url + path, reply.status, reply.text, reply.attempts,
                                          reason="answer is not a JSON object")
            return reply.data
        raise AssertionError("unreachable: the last path raises on 404")

    async def get_model_info(self, url: str | None = None) -> dict[str, Any]:
        """`/model_info` (newer) or `/get_model_info`: model_path, weight_version, is_generation..."""
        return await self._get_with_fallback(self._worker(url), ("/model_info", "/get_model_info"))

    async def get_server_info(self, url: str | None = None) -> dict[str, Any]:
        """`/server_info` (newer) or `/get_server_info`: server args, internal_states, version."""
        return await self._get_with_fallback(self._worker(url), ("/server_info", "/get_server_info"))

    async def get_weight_version(self, url: str | None = None) -> str | None:
        """The worker's current weight version (set by the weight-update calls), from `/model_info`: SGLang 0.5.23
        has no `/get_weight_version` route."""
        if (engine := self._in_process(url)) is not None:
            return engine.weight_version
        worker = self._worker(url)
        data = await self.get_model_info(worker)
        if "weight_version" not in data:
            raise EngineResponseError(worker + "/model_info", 200, repr(data), 1, reason="answer has no 'weight_version'")
        version = data["weight_version"]
        return None if version is None else str(version)

    async def get_weight_versions(self) -> dict[str, str | None]:
        """Weight version of every worker, keyed by worker URL (router mode: a worker no call reaches is handled by
        the worker-loss policy, `_each_worker`)."""
        return await self._each_worker(self.get_weight_version, "the weight version check (/model_info)")

    async def _each_worker(self, call: Callable[[str], Awaitable[Any]], during: str) -> dict[str, Any]:
        """`call(url)` on every worker concurrently; their answers keyed by URL.

        Router mode: a worker that gives no HTTP answer at all (refused, reset, timed out after the retries) is
        lost. With `allow_worker_loss` it is dropped from `worker_urls` (logged, kept in `lost_workers`) and the
        others' answers are returned; otherwise, or when no worker would be left, `WorkerLost` names it. Any other
        failure is raised as it is.
        """
        urls = list(self.worker_urls)
        results = await asyncio.gather(*(call(u) for u in urls), return_exceptions=True)
        answers: dict[str, Any] = {}
        for url, res in zip(urls, results):
            if isinstance(res, BaseException) and not (self.is_router and _unreachable(res)):
                raise res
        for url, res in zip(urls, results):
            if isinstance(res, BaseException):
                self._lose_worker(url, during, res)
            else:
                answers[url] = res
        return answers

    def _lose_worker(self, url: str, during: str, error: BaseException) -> None:
        """The worker-loss policy for a worker no call reached (see `_each_worker`)."""
        others = [u for u in self.worker_urls if u != url]
        if not self.allow_worker_loss or not others:
            why = ("it is the last worker" if self.allow_worker_loss
                   else "pass --allow-worker-loss to carry on with the other workers")
            raise WorkerLost(url, f"router worker {url} is unreachable during {during} ({why}): {error}")
        self.worker_urls = others
        self.lost_workers.append(WorkerLoss(url, during, str(error), time.time()))
        logger.error("router worker %s unreachable during %s: dropped (--allow-worker-loss); carrying on with %d "
                     "worker(s) %s. Error: %s", url, during, len(others), others, error)

    async def get_loads(self, url: str | None = None) -> dict[str, Any]:
        """`/v1/loads?include=core`: running and waiting request counts per DP rank."""
        worker = self._worker(url)
        reply = await self._request("GET", worker, "/v1/loads", params={"include": "core"},
                                    timeout_s=self.control_timeout_s)
        if not isinstance(reply.data, dict):
            raise EngineResponseError(worker + "/v1/loads", reply.status, reply.text, reply.attempts,
                                      reason="answer is not a JSON object")
        return reply.data

    # ---- control ---------------------------------------------------------------------------

    # ---- LoRA adapters ---------------------------------------------------------------------

    # The engine protocol's adapter routes (SGLang's; `VLLMClient` says vLLM's).
    lora_load_path = "/load_lora_adapter"
    lora_unload_path = "/unload_lora_adapter"

    async def load_lora_adapter(self, name: str, path: str) -> None:
        """Load the PEFT adapter directory `path` (a path on the engine's host) under `name` on every worker; every
        later /generate selects it. Raises EngineError when a worker refuses."""
        body = {"lora_name": name, "lora_path": str(path)}

        async def one(url: str) -> None:
            answer = await self._post_json(url, self.lora_load_path, body, timeout_s=self.weight_update_timeout_s)
            if answer.get("success") is False:
                raise EngineResponseError(url + self.lora_load_path, 200, _snippet(repr(answer)), 1,
                                          reason=f"the engine refused LoRA adapter {name!r} from {path}")

        await self._each_worker(one, f"loading LoRA adapter {name!r}")
        self.lora_name = name

    # The route that labels the weights a worker serves (SGLang's and vLLM's alike: {"new_version": ...}).
    weight_version_path = "/update_weight_version"

    async def load_lora_version(self, path: str, weight_version: str | None = None, *, lora_name: str,
                                url: str | None = None) -> dict[str, Any]:
        """One worker: load the PEFT adapter directory `path` as `lora_name` (a new name per version, so no cached
        prefix of an older adapter is reused), then label the worker's weights `weight_version`. Returns SGLang's
        `{"success", "message"}` shape; a load the engine refuses (4xx) is `success: false` with its message."""
        worker = self._worker(url)
        reply = await self._request("POST", worker, self.lora_load_path, json_body={"lora_name": lora_name,
                                    "lora_path": str(path)}, timeout_s=self.weight_update_timeout_s,
                                    answer_statuses=frozenset({400, 404}))
        data = reply.data if isinstance(reply.data, dict) else {}
        refused = reply.status >= 400 or data.get("success") is False
        if refused:
            error = data.get("error")  # vLLM's ErrorResponse: {"error": {"message", "type", "code"}}
            why = (data.get("error_message") or data.get("message")
                   or (error.get("message") if isinstance(error, dict) else error) or reply.text)
            return {"success": False, "message": f"{self.lora_load_path} refused adapter {lora_name!r} from {path}: "
                                                 f"{_snippet(str(why))}"}
        loaded = data.get("loaded_adapters")  # SGLang lists the worker's adapters after the load
        if isinstance(loaded, dict) and lora_name not in loaded:
            return {"success": False, "message": f"{self.lora_load_path} answered success but lists adapters "
                                                 f"{sorted(loaded)}, not {lora_name!r}"}
        if weight_version is not None:
            await self._post_json(worker, self.weight_version_path, {"new_version": str(weight_version)})
        return {"success": True, "message": f"adapter {lora_name!r} loaded from {path}", "lora_name": lora_name}

    async def _unload_quietly(self, name: str) -> None:
        """Unload `name` from every worker that has it; a refusal (not loaded there) or an error is only logged: an
        adapter left loaded costs engine memory, not correctness (no request selects it)."""
        async def one(url: str) -> None:
            try:
                await self._request("POST", url, self.lora_unload_path, json_body={"lora_name": name},
                                    timeout_s=self.control_timeout_s, answer_statuses=frozenset({400, 404}))
            except EngineError as exc:
                logger.warning("could not unload LoRA adapter %r from %s: %s", name, url, exc)

        await asyncio.gather(*(one(u) for u in list(self.worker_urls)))

    async def unload_lora_adapter(self, name: str) -> None:
        """Unload the adapter `name` from every worker (requests then use the base unless another is selected)."""
        await self._each_worker(lambda url: self._post_json(url, self.lora_unload_path, {"lora_name": name}),
                                f"unloading LoRA adapter {name!r}")
        if self.lora_name == name:
            self.lora_name = None

    async def flush_cache(self, url: str | None = None) -> bool:
        """POST /flush_cache. False when the engine refuses because requests are running or waiting
        (HTTP 400: an expected state, the caller retries); True once flushed."""
        if (engine := self._in_process(url)) is not None:
            return await engine.flush_cache()
        reply = await self._request("POST", self._worker(url), "/flush_cache", timeout_s=self.control_timeout_s,
                                    answer_statuses=frozenset({400}))
        return reply.status != 400

    async def freeze_gc(self, url: str | None = None) -> None:
        """POST /freeze_gc (SGLang's): the engine freezes its interpreter's heap, so what its warm-up created is never
        walked by a full garbage collection in the middle of later rounds."""
        if (engine := self._in_process(url)) is not None:
            engine.freeze_gc()
            return
        await self._request("POST", self._worker(url), "/freeze_gc", timeout_s=self.control_timeout_s)

    async def pause_generation(self, mode: str = "abort", url: str | None = None) -> dict[str, Any]:
        """POST /pause_generation. `abort` returns in-flight requests at once as aborted; `retract`
        re-queues them; `in_place` keeps them in the batch (flush_cache then fails)."""
        if (engine := self._in_process(url)) is not None:
            return await engine.pause_generation(as_pause_mode(mode))
        return await self._post_json(self._worker(url), "/pause_generation", {"mode": as_pause_mode(mode).value})

    async def continue_generation(self, url: str | None = None) -> dict[str, Any]:
        """POST /continue_generation: resume a paused engine."""
        if (engine := self._in_process(url)) is not None:
            return await engine.continue_generation()
        return await self._post_json(self._worker(url), "/continue_generation", {})

    async def release_memory_occupation(self, tags: Sequence[str] | None = None, url: str | None = None, *,
                                        flush_timeout_s: float = 60.0, flush_poll_s: float = 1.0) -> None:
        """Free the device memory of `tags` ("weights", "kv_cache"; None: all) on one worker (`url`) or every worker
        while a colocated trainer runs: /flush_cache until idle (an engine releases only when nothing runs, and its
        prefix cache lives in the memory being freed), then POST /release_memory_occupation."""
        urls = [url] if url is not None else self.worker_urls
        await asyncio.gather(*(self._flush_until_idle(self._worker(u), flush_timeout_s, flush_poll_s) for u in urls))
        await self._memory_occupation("/release_memory_occupation", tags, url)

    async def resume_memory_occupation(self, tags: Sequence[str] | None = None, url: str | None = None) -> None:
        """POST /resume_memory_occupation on one worker (`url`) or every worker: take back what was released."""
        await self._memory_occupation("/resume_memory_occupation", tags, url)

    async def _memory_occupation(self, path: str, tags: Sequence[str] | None, url: str | None) -> None:
        body = {} if tags is None else {"tags": list(tags)}
        urls = [url] if url is not None else self.worker_urls
        await asyncio.gather(*(self._request("POST", self._worker(u), path, json_body=body,
                                             timeout_s=self.control_timeout_s) for u in urls))

    async def abort_request(self, rid: str | None = None, abort_all: bool = False, url: str | None = None) -> None:
        """POST /abort_request for one rid, or every request. Aborted requests finish with type abort."""
        if (rid is None) == (not abort_all):
            raise ValueError("abort_request needs exactly one of rid=... or abort_all=True")
        body = AbortRequest(None if abort_all else rid).to_json()
        await self._request("POST", self._worker(url), "/abort_request", json_body=body,
                            timeout_s=self.control_timeout_s)

    async def abort_all(self, *, timeout_s: float = 180.0, retry_interval_s: float = 3.0) -> None:
        """Abort everything on every worker and wait until `/v1/loads` shows none running or waiting.

        Re-sends the abort every `retry_interval_s` (requests can arrive while draining). Raises
        `EngineUnavailable` naming the workers that are still busy once `timeout_s` has passed.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s

        async def drain(url: str) -> tuple[str, int, str] | None:
            rounds, last = 0, ""
            while loop.time() < deadline:
                rounds += 1
                try:
                    await self.abort_request(abort_all=True, url=url)
                    loads_endpoint = url + "/v1/loads"
                    busy = count_requests_in_loads(await self.get_loads(url), endpoint=loads_endpoint)
                except EngineError as exc:
                    last = str(exc)
                else:
                    if busy == 0:
                        return None
                    last = f"{busy} request(s) still running or waiting"
                await asyncio.sleep(max(0.0, min(retry_interval_s, deadline - loop.time())))
            return url, rounds, last

        failures = [f for f in await asyncio.gather(*(drain(u) for u in self.worker_urls)) if f is not None]
        if failures:
            url, rounds, last = failures[0]
            raise EngineUnavailable(url + "/abort_request", None, last, rounds,
                                    reason=f"not idle within {timeout_s:g} s of aborting "
                                           f"({len(failures)} worker(s) busy)")

    # ---- weights ---------------------------------------------------------------------------

    async def update_weights_from_disk(
        self,
        model_path: str,
        weight_version: str | None = None,
        *,
        load_format: str | None = None,
        flush_cache: bool | None = None,
        abort_all_requests: bool | None = None,
        url: str | None = None,
    ) -> dict[str, Any]:
        """POST /update_weights_from_disk. Returns the engine's `{"success", "message", ...}` both on
        success (200) and on a failed load (400 with success false); other errors raise.

        Unset options are left out so the engine applies its own defaults.
        """
        update = UpdateWeightsRequest(str(model_path), None if weight_version is None else str(weight_version),
                                      load_format, flush_cache, abort_all_requests)
        if (engine := self._in_process(url)) is not None:
            return await engine.update_weights_from_disk(update)
        worker = self._worker(url)
        body = update.to_json()
        reply = await self._request("POST", worker, "/update_weights_from_disk", json_body=body,
                                    timeout_s=self.weight_update_timeout_s, answer_statuses=frozenset({400}))
        data = reply.data
        if not isinstance(data, dict) or "success" not in data:
            if reply.status == 400:
                raise EngineRequestError(worker + "/update_weights_from_disk", 400, reply.text, reply.attempts,
                                         reply.errors, reason="request rejected")
            raise EngineResponseError(worker + "/update_weights_from_disk", reply.status, reply.text,
                                      reply.attempts, reason="answer has no 'success' field")
        return data

    async def _flush_until_idle(self, url: str, flush_timeout_s: float, poll_s: float) -> int:
        """Retry /flush_cache while the engine answers busy (400), for at most `flush_timeout_s`."""
        loop = asyncio.get_running_loop()
        start = loop.time()
        attempts = 0
        while True:
            attempts += 1
            if await self.flush_cache(url):
                return attempts
            elapsed = loop.time() - start
            if elapsed >= flush_timeout_s:
                raise TimeoutError(
                    f"{url}/flush_cache still busy (HTTP 400: requests running or waiting) after "
                    f"{elapsed:.2f} s and {attempts} attempts"
                )
            await asyncio.sleep(min(poll_s, flush_timeout_s - elapsed))

    async def _continue_quietly(self, url: str) -> None:
        try:
            await self.continue_generation(url=url)
        except EngineError as exc:
            logger.error("could not resume %s after a cancelled weight sync: %s", url, exc)

    async def _sync_worker(
        self, url: str, model_path: str, weight_version: str, flush_timeout_s: float, poll_s: float,
        pause_mode: str, update_options: Mapping[str, Any],
    ) -> dict[str, Any] | EngineUnavailable:
        """One worker's pause -> flush -> update -> continue; its update answer, or (router mode) the error of a
        worker that no pause reached."""
        failure: str | None = None
        response: dict[str, Any] = {}
        try:
            try:
                await self.pause_generation(pause_mode, url=url)
            except EngineUnavailable as exc:
                if self.is_router and _unreachable(exc):
                    # A lost worker, left to the worker-loss policy (sync_weights_from_disk); nothing to continue.
                    return exc
                raise
            await self._flush_until_idle(url, flush_timeout_s, poll_s)
            if "lora_name" in update_options:  # an adapter version (LoRA), not a whole model
                response = await self.load_lora_version(model_path, weight_version, url=url, **update_options)
            else:
                response = await self.update_weights_from_disk(model_path, weight_version, url=url, **update_options)
            if not response.get("success"):
                call = "load_lora_version" if "lora_name" in update_options else "update_weights_from_disk"
                failure = f"{call}({model_path!r}) returned success=false: " \
                          f"{_snippet(str(response.get('message', response)))}"
        except (EngineError, TimeoutError) as exc:
            failure = str(exc)
        except asyncio.CancelledError:
            # Cancelled mid-sync (e.g. shutdown): still resume the engine, then let the cancel through.
            await asyncio.shield(self._continue_quietly(url))
            raise
        # Continue even after a failure: a paused engine would stall every later rollout.
        try:
            await self.continue_generation(url=url)
        except EngineError as exc:
            failure = (failure + "; then " if failure else "") + f"continue_generation failed: {exc}"
        if failure is not None:
            raise WeightSyncError({url: failure})
        return response

    async def sync_weights_from_disk(
        self,
        model_path: str,
        weight_version: str,
        *,
        flush_timeout_s: float = 60.0,
        flush_poll_s: float = 1.0,
        pause_mode: str = "abort",
        **update_options: Any,
    ) -> dict[str, dict[str, Any]]:
        """Load new weights on every worker: pause -> flush (retried while busy) -> update -> continue.

        Workers are synced concurrently; returns each worker's update answer keyed by URL. Raises
        `WeightSyncError` listing every failed worker; `continue_generation` has been attempted on
        all of them first. `update_options` go to `update_weights_from_disk` (load_format, ...); with
        `lora_name=NAME` the update is `load_lora_version` instead (`model_path` is a PEFT adapter directory): once
        every worker loaded it, every later request selects NAME and the adapter loaded before is unloaded.
        """
        pause_mode = as_pause_mode(pause_mode)
        if flush_timeout_s < 0 or flush_poll_s <= 0:
            raise ValueError("flush_timeout_s must be >= 0 and flush_poll_s > 0 seconds")
        lora_name = update_options.get("lora_name")
        previous = self.lora_name
        self.update_gate.close()  # this client's /generate calls wait until every worker continued
        urls = list(self.worker_urls)
        try:
            results = await asyncio.gather(
                *(self._sync_worker(u, model_path, weight_version, flush_timeout_s, flush_poll_s, pause_mode,
                                    update_options) for u in urls),
                return_exceptions=True,
            )
            adapter_loaded = lora_name is not None and not any(isinstance(r, WeightSyncError) for r in results)
            if adapter_loaded:
                self.lora_name = lora_name  # before the gate opens: no request goes out with the old adapter
        finally:
            self.update_gate.open()
        if lora_name is not None:
            # The old adapter after a success; after a failure the new one where it loaded, so a retry can load it.
            drop = previous if adapter_loaded else lora_name
            if drop is not None and drop != self.lora_name:
                await self._unload_quietly(drop)
        failures: dict[str, str] = {}
        answers: dict[str, dict[str, Any]] = {}
        for url, res in zip(urls, results):  # lost workers first: the policy may stop the run naming one
            if isinstance(res, EngineUnavailable) and self.is_router and _unreachable(res):
                self._lose_worker(url, "the weight update (/pause_generation)", res)
        for url, res in zip(urls, results):
            if url not in self.worker_urls:
                continue
            if isinstance(res, WeightSyncError):
                failures.update(res.failures)
            elif isinstance(res, BaseException):
                raise res
            else:
                answers[url] = res
        if failures:
            raise WeightSyncError(failures)
        return answers
