"""A scripted fake SGLang server: a real aiohttp HTTP server on 127.0.0.1 speaking SGLang's wire format.

It exists for fault-injection tests and the rollout-overhead benchmark (zero-latency engine), so it
answers with exactly the JSON shapes of `reference/sglang_api.md` §1-2 and can be told, per request,
to fail: HTTP 5xx/4xx, hang until aborted, drop the connection, finish with `abort`, or return given
tokens. Every request is recorded (path, JSON body, headers, peer socket) for assertions.

    async with FakeSGLangServer(script=[Respond(503), Respond(503)]) as srv:
        client = SGLangClient(srv.url)   # two 503s, then default generation

Run standalone (for benchmarks): `python -m rollout.fake_engine --port 30000`.

Never imports jax: it lives in the rollout package so rollout-only hosts can use it.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import signal
import socket
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from rollout.sglang_wire import (
    DEFAULT_MAX_N,
    FLUSH_BUSY,
    FLUSH_OK,
    FREEZE_GC_OK,
    UNAUTHORIZED_BODY,
    AbortRequest,
    FinishReason,
    PauseMode,
    MEMORY_TAGS,
    RequestError,
    SamplingParams,
    UpdateWeightsRequest,
    check_generate_keys,
    continued_answer,
    error_body,
    refusal_body,
    require_body,
    generate_response,
    is_authorized,
    loads_response,
    parse_json_body,
    parse_memory_tags,
    parse_pause,
    paused_answer,
    prompt_field,
    queued_abort_response,
    route_handlers,
    update_weights_answer,
)

DEFAULT_EOS_TOKEN_ID = 151645  # Qwen's <|im_end|>
DEFAULT_IMAGE_TOKEN_ID = 151655  # Qwen-VL's <|image_pad|>
FAKE_SGLANG_VERSION = "0.5.23"


# --------------------------------------------------------------------------------------------
# Scripted actions
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Respond:
    """Answer with this HTTP status and body (dict/list -> JSON, str -> text) instead of the normal one."""

    status: int
    body: Any = None


@dataclass(frozen=True)
class Hang:
    """Never answer until the request is aborted (/abort_request, pause in abort mode, server stop) or
    the client goes away. On /generate an abort answers finish `abort` like SGLang does."""


@dataclass(frozen=True)
class Queue:
    """(/generate only) stay in the waiting queue, never scheduled, until aborted; then answer as SGLang 0.5.23 does
    for a queued abort (no prompt_tokens or cached_tokens: `sglang_wire.queued_abort_response`)."""


@dataclass(frozen=True)
class Drop:
    """Close the TCP connection without sending any response."""


@dataclass(frozen=True)
class Delay:
    """Wait `seconds` (interruptible by abort on /generate), then behave as `then` (None = normally)."""

    seconds: float
    then: Action | None = None


@dataclass(frozen=True)
class Abort:
    """(/generate only) finish with type abort after emitting `output_ids` (partial output)."""

    message: str = "Abort by scripted action"
    output_ids: tuple[int, ...] = ()
    status_code: int | None = None


@dataclass(frozen=True)
class Tokens:
    """(/generate only) emit these ids. `log_probs` defaults to -0.5 each. With `finish_reason` None
    the server infers it like the engine: cut at max_new_tokens -> length, last id a stop id -> stop."""

    output_ids: tuple[int, ...]
    log_probs: tuple[float, ...] | None = None
    finish_reason: Mapping[str, Any] | None = None
    text: str | None = None


Action = Respond | Hang | Queue | Drop | Delay | Abort | Tokens
GENERATE_ONLY = (Abort, Tokens, Queue)


def bad_request(message: str) -> Respond:
    """A 400 with SGLang's error object shape."""
    return Respond(400, error_body(message))


@dataclass
class RecordedRequest:
    """One request as the server saw it. `peer` is the client socket (host, port): requests with
    the same peer travelled on the same pooled connection."""

    method: str
    path: str
    query: dict[str, str]
    body: Any
    headers: dict[str, str]
    peer: tuple[str, int] | None
    time: float


GenerateFn = Callable[[Mapping[str, Any]], Tokens]


def default_generate_fn(response_ids: Sequence[int] = (1001, 1002, 1003), eos_token_id: int = DEFAULT_EOS_TOKEN_ID,
                        log_prob: float = -0.5) -> GenerateFn:
    """Deterministic engine: `response_ids` then one stop id (the first of `stop_token_ids`, else EOS)."""

    def generate(body: Mapping[str, Any]) -> Tokens:
        params = body.get("sampling_params") or {}
        stops = params.get("stop_token_ids") or [eos_token_id]
        ids = (*response_ids, int(stops[0]))
        return Tokens(output_ids=ids, log_probs=(log_prob,) * len(ids))

    return generate


def _default_detokenize(ids: Sequence[int]) -> str:
    return "".join(f"<{i}>" for i in ids)


_RECORD = web.RequestKey("fake_sglang_record", RecordedRequest)
_ACTION: web.RequestKey[Any] = web.RequestKey("fake_sglang_action", object)


@dataclass(eq=False)  # identity hash: jobs live in a set
class _InFlight:
    rid: str
    aborted: asyncio.Event = field(default_factory=asyncio.Event)
    abort_message: str = ""
    waiting: bool = False  # parked by a pause (counts as waiting in /v1/loads)


# --------------------------------------------------------------------------------------------
# Server
# --------------------------------------------------------------------------------------------


class FakeSGLangServer:
    """Real HTTP server on 127.0.0.1 (`port=0` picks a free port) answering like SGLang.

    `script`: actions for successive `/generate` requests (a sequence), or a callback
    `(RecordedRequest) -> Action | None` consulted when the queue is empty; None means normal
    behaviour. `enqueue(*actions, path=...)` queues actions for any endpoint.
    `generate_fn(body) -> Tokens` is the normal generation; `latency_s` delays each one.
    `tokens_per_image` (int, or a function of the image string) enables pad expansion: each
    `<|image_pad|>` in `input_ids` counts as that many prompt tokens, and the number of pads must
    equal the number of images (else 400, as SGLang's token-preserving path requires).
    `flush_busy_calls`: that many `/flush_cache` calls answer 400 before the normal rule applies.
    `disabled_paths`: endpoints that answer 404 (to emulate older or newer SGLang versions).
    `api_key`: like SGLang's `--api-key`, every path but the health probes then needs
    `Authorization: Bearer <key>` (401 otherwise; such a request is recorded, never scripted).
    `max_n`: the largest `sampling_params.n` accepted (validated as the engines do, `rollout.sglang_wire`).
    """

    def __init__(
        self,
        script: Sequence[Action] | Callable[[RecordedRequest], Action | None] | None = None,
        *,
        port: int = 0,
        host: str = "127.0.0.1",
        generate_fn: GenerateFn | None = None,
        latency_s: float = 0.0,
        weight_version: str = "default",
        model_path: str = "fake/Qwen3-VL-2B-Instruct",
        eos_token_id: int = DEFAULT_EOS_TOKEN_ID,
        image_token_id: int = DEFAULT_IMAGE_TOKEN_ID,
        tokens_per_image: int | Callable[[str], int] | None = None,
        detokenize: Callable[[Sequence[int]], str] = _default_detokenize,
        flush_busy_calls: int = 0,
        disabled_paths: Iterable[str] = (),
        max_running_requests: int = 1024,
        api_key: str | None = None,
        max_n: int = DEFAULT_MAX_N,
    ) -> None:
        self.host = host
        self.api_key = api_key
        self.max_n = max_n
        self.requested_port = port
        self.generate_fn = generate_fn or default_generate_fn(eos_token_id=eos_token_id)
        self.latency_s = latency_s
        self.weight_version = weight_version
        self.model_path = model_path
        self.eos_token_id = eos_token_id
        self.image_token_id = image_token_id
        self.tokens_per_image = tokens_per_image
        self.detokenize = detokenize
        self.flush_busy_calls = flush_busy_calls
        self.disabled_paths = set(disabled_paths)
        self.max_running_requests = max_running_requests
        self.healthy = True
        # While True every request (health probes included) is recorded and its connection closed unanswered, as a
        # crashed engine's would be: `take_down()` / `bring_back()`.
        self.unreachable = False
        self.paused: PauseMode | None = None  # the pause mode while paused
        self.released: set[str] = set()  # memory tags released by /release_memory_occupation
        self.freeze_gc_calls = 0  # /freeze_gc calls answered
        self.requests: list[RecordedRequest] = []
        self.disconnected_rids: list[str] = []  # /generate requests whose client went away mid-request
        self._queues: dict[str, collections.deque[Action]] = collections.defaultdict(collections.deque)
        self._selector: Callable[[RecordedRequest], Action | None] | None = None
        if callable(script):
            self._selector = script
        elif script is not None:
            self.enqueue(*script, path="/generate")
        self._in_flight: set[_InFlight] = set()
        self._unpaused = asyncio.Event()
        self._unpaused.set()
        self._stopping = asyncio.Event()
        self._runner: web.AppRunner | None = None
        self.port: int | None = None

    # ---- lifecycle -------------------------------------------------------------------------

    @property
    def url(self) -> str:
        if self.port is None:
            raise RuntimeError("FakeSGLangServer is not started; use `async with` or await start()")
        return f"http://{self.host}:{self.port}"

    async def start(self) -> FakeSGLangServer:
        app = web.Application(middlewares=[self._middleware], client_max_size=1 << 30)
        handlers = {
            "generate": self._generate, "health": self._health, "health_generate": self._health,
            "model_info": self._model_info, "server_info": self._server_info,
            "ready": self._ready, "flush_cache": self._flush_cache, "freeze_gc": self._freeze_gc,
            "pause_generation": self._pause_generation, "continue_generation": self._continue_generation,
            "abort_request": self._abort_request, "update_weights_from_disk": self._update_weights_from_disk,
            "loads": self._loads, "release_memory_occupation": self._release_memory,
            "resume_memory_occupation": self._resume_memory,
        }
        for method, path, handler in route_handlers(handlers):
            app.router.add_route(method, path, handler)
        # handler_cancellation: a client that goes away cancels its handler, as SGLang aborts a
        # request whose connection closed.
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=1.0)
        await self._runner.setup()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.requested_port))
        self.port = sock.getsockname()[1]
        await web.SockSite(self._runner, sock, backlog=1024).start()
        return self

    async def stop(self) -> None:
        """Abort whatever is in flight (hanging requests answer abort), then close the server."""
        self._stopping.set()
        for job in list(self._in_flight):
            self._abort(job, "Server is shutting down")
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def __aenter__(self) -> FakeSGLangServer:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # ---- scripting and inspection ----------------------------------------------------------

    def enqueue(self, *actions: Action, path: str = "/generate") -> None:
        """Queue actions for successive requests to `path` (consumed first-in first-out)."""
        for action in actions:
            inner = action
            while isinstance(inner, Delay):
                inner = inner.then
            if isinstance(inner, GENERATE_ONLY) and path != "/generate":
                raise ValueError(f"{type(inner).__name__} only applies to /generate, not {path}")
            self._queues[path].append(action)

    def take_down(self) -> None:
        """Behave as a crashed engine: drop every connection, also those of requests in flight (they see a reset)."""
        self.unreachable = True
        for job in list(self._in_flight):
            self._abort(job, "engine crashed")

    def bring_back(self, weight_version: str = "default") -> None:
        """Serve again as a restarted engine: its initial weights (`weight_version`), unpaused."""
        self.weight_version = weight_version
        self.paused = None
        self._unpaused.set()
        self.unreachable = False

    def requests_to(self, path: str) -> list[RecordedRequest]:
        return [r for r in self.requests if r.path == path]

    @property
    def paths(self) -> list[str]:
        """Paths of every request received, in order."""
        return [r.path for r in self.requests]

    @property
    def num_in_flight(self) -> int:
        return len(self._in_flight)

    # ---- plumbing --------------------------------------------------------------------------

    @web.middleware
    async def _middleware(self, request: web.Request, handler: Callable[..., Any]) -> web.StreamResponse:
        raw = await request.read()
        try:
            body = parse_json_body(raw, request.path) if raw else None
        except RequestError:  # recorded as text; the endpoint answers 400 (not a JSON object)
            body = raw.decode("utf-8", "replace")
        peer = request.transport.get_extra_info("peername") if request.transport is not None else None
        record = RecordedRequest(request.method, request.path, dict(request.query), body, dict(request.headers),
                                 tuple(peer[:2]) if peer else None, time.time())
        self.requests.append(record)
        request[_RECORD] = record
        if self.unreachable:
            return await _drop(request)
        if not is_authorized(request.path, request.headers.get("Authorization"), self.api_key):
            return web.json_response(UNAUTHORIZED_BODY, status=401)
        if request.path in self.disabled_paths:
            return web.json_response({"detail": "Not Found"}, status=404)

        action: Action | None = None
        queue = self._queues.get(request.path)
        if queue:
            action = queue.popleft()
        elif self._selector is not None and request.path == "/generate":
            action = self._selector(record)
        if request.path == "/generate":
            request[_ACTION] = action
            return await handler(request)  # /generate applies every action itself (abortable waits)
        while isinstance(action, Delay):
            await asyncio.sleep(action.seconds)
            action = action.then
        if isinstance(action, Respond):
            return _respond(action)
        if isinstance(action, Drop):
            return await _drop(request)
        if isinstance(action, Hang):
            await self._stopping.wait()
            return web.Response(status=503, text="server stopping")
        return await handler(request)

    def _abort(self, job: _InFlight, message: str) -> None:
        if not job.aborted.is_set():
            job.abort_message = message
            job.aborted.set()

    def _error(self, message: str, status: int = 400) -> web.Response:
        return web.json_response(error_body(message), status=status)

    def _refused(self, error: RequestError) -> web.Response:
        """A refused request, with SGLang's body for its kind (`sglang_wire.refusal_body`)."""
        return web.json_response(refusal_body(error), status=400)

    # ---- /generate -------------------------------------------------------------------------

    def _validate_generate(self, body: Any) -> SamplingParams:
        """SGLang's checks of fields and sampling parameters (an unknown field is a 400, so a typo in our client
        fails the tests instead of being ignored), then the fake's own limits; RequestError if refused."""
        check_generate_keys(body)
        if prompt_field(body) != "input_ids":
            raise RequestError("the fake engine only serves input_ids prompts (no tokenizer)")
        ids = body["input_ids"]
        if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise RequestError("input_ids must be a non-empty list of ints (batch requests are not supported by the fake)")
        if body.get("stream"):
            raise RequestError("the fake engine does not stream")
        if body.get("video_data"):
            raise RequestError("the fake engine does not serve clips (video_data): use the embedded engine")
        params = SamplingParams.from_json(body.get("sampling_params"), max_n=self.max_n)
        images = body.get("image_data")
        if images is not None and isinstance(images, str):
            images = [images]
        if images is not None and not (isinstance(images, list) and all(isinstance(i, str) for i in images)):
            raise RequestError("image_data must be a string or a list of strings for one request")
        if self.tokens_per_image is not None:
            pads = sum(1 for t in ids if t == self.image_token_id)
            n_images = len(images or [])
            if pads != n_images:
                raise RequestError(f"image count mismatch: {pads} <|image_pad|> token(s) in input_ids but {n_images} "
                                   "image(s) in image_data (send one compact pad per image)")
        return params

    def _prompt_tokens(self, body: Mapping[str, Any]) -> int:
        ids: list[int] = body["input_ids"]
        if self.tokens_per_image is None:
            return len(ids)
        images = body.get("image_data") or []
        images = [images] if isinstance(images, str) else images
        per = self.tokens_per_image
        expanded = sum(per(img) if callable(per) else per for img in images)
        return len(ids) - sum(1 for t in ids if t == self.image_token_id) + expanded

    def _finish(self, out: Tokens, params: SamplingParams) -> tuple[list[int], list[float], FinishReason | dict[str, Any]]:
        ids = [int(t) for t in out.output_ids]
        lps = [float(x) for x in out.log_probs] if out.log_probs is not None else [-0.5] * len(ids)
        if len(lps) != len(ids):
            raise ValueError(f"scripted Tokens has {len(ids)} ids but {len(lps)} log_probs")
        if out.finish_reason is not None:
            return ids, lps, dict(out.finish_reason)  # scripted verbatim, malformed ones included
        max_new = params.max_new_tokens
        if len(ids) > max_new:
            return ids[:max_new], lps[:max_new], FinishReason.at_length(max_new)
        stops = set(params.stop_token_ids)
        if not params.ignore_eos:
            stops.add(self.eos_token_id)
        if ids and ids[-1] in stops:
            return ids, lps, FinishReason.stopped(ids[-1])
        return ids, lps, FinishReason.at_length(max_new)

    def _generate_answer(self, body: Mapping[str, Any], rid: str, ids: list[int], lps: list[float],
                         finish: FinishReason | Mapping[str, Any], started: float, text: str | None = None) -> web.Response:
        return web.json_response(generate_response(
            rid=rid, text=text if text is not None else self.detokenize(ids), output_ids=ids, output_logprobs=lps,
            finish=finish, prompt_tokens=self._prompt_tokens(body), weight_version=self.weight_version,
            e2e_latency=time.monotonic() - started, return_logprob=bool(body.get("return_logprob")),
            token_text=(lambda t: self.detokenize([t])) if body.get("return_text_in_logprobs") else None,
        ))

    def _queued_abort_answer(self, body: Mapping[str, Any], rid: str, started: float) -> web.Response:
        return web.json_response(queued_abort_response(
            rid=rid, text="", output_ids=[], output_logprobs=[], weight_version=self.weight_version,
            e2e_latency=time.monotonic() - started, return_logprob=bool(body.get("return_logprob"))))

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        started = time.monotonic()
        body = request[_RECORD].body
        action: Action | None = request[_ACTION]
        try:
            params = self._validate_generate(body)
        except RequestError as exc:
            return self._refused(exc)
        rid = str(body.get("rid") or uuid.uuid4().hex)
        job = _InFlight(rid)
        self._in_flight.add(job)
        try:
            # Requests that arrive while paused wait in the queue until continue (or an abort).
            if not self._unpaused.is_set() or isinstance(action, Queue):
                job.waiting = True
                await (job.aborted.wait() if isinstance(action, Queue) else _first_of(self._unpaused, job.aborted))
                job.waiting = False
                if job.aborted.is_set() and self.unreachable:  # the engine "crashed" under it
                    return await _drop(request)
                if job.aborted.is_set():
                    return self._queued_abort_answer(body, rid, started)
            while not job.aborted.is_set():
                if isinstance(action, Delay):
                    await _first_of(job.aborted, timeout=action.seconds)
                    action = action.then
                    continue
                if isinstance(action, Respond):
                    return _respond(action)
                if isinstance(action, Drop):
                    return await _drop(request)
                if isinstance(action, Hang):
                    await job.aborted.wait()
                    break
                if isinstance(action, Abort):
                    self._abort(job, action.message)
                    ids = list(action.output_ids)
                    finish = FinishReason.aborted(action.message, action.status_code)
                    return self._generate_answer(body, rid, ids, [-0.5] * len(ids), finish, started)
                if action is None and self.latency_s > 0:
                    await _first_of(job.aborted, timeout=self.latency_s)
                    if job.aborted.is_set():
                        break
                out = action if isinstance(action, Tokens) else self.generate_fn(body)
                try:
                    ids, lps, finish = self._finish(out, params)
                except ValueError as exc:
                    return self._error(str(exc), status=500)
                return self._generate_answer(body, rid, ids, lps, finish, started, text=out.text)
            if self.unreachable:  # the engine "crashed" under it
                return await _drop(request)
            return self._generate_answer(body, rid, [], [], FinishReason.aborted(job.abort_message), started)
        except asyncio.CancelledError:
            self.disconnected_rids.append(rid)
            raise
        finally:
            self._in_flight.discard(job)

    # ---- control endpoints -----------------------------------------------------------------

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=200) if self.healthy else web.Response(status=503)

    async def _model_info(self, request: web.Request) -> web.Response:
        return web.json_response({
            "model_path": self.model_path,
            "tokenizer_path": self.model_path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": self.weight_version,
            "has_image_understanding": True,
            "has_audio_understanding": False,
            "model_type": "qwen3_vl",
            "architectures": ["Qwen3VLForConditionalGeneration"],
        })

    async def _server_info(self, request: web.Request) -> web.Response:
        return web.json_response({
            "model_path": self.model_path,
            "host": self.host,
            "port": self.port,
            "weight_version": self.weight_version,
            "max_running_requests": self.max_running_requests,
            "internal_states": [{"max_req_input_len": 262143, "max_total_num_tokens": 1 << 20}],
            "version": FAKE_SGLANG_VERSION,
            "fake_engine": True,
        })

    async def _ready(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if self.healthy and self.paused is None else 503)

    def _counted_in_flight(self) -> int:
        # After a retract-mode pause SGLang moves running requests back to the queue and can flush.
        if self.paused is PauseMode.RETRACT:
            return 0
        return len(self._in_flight)

    async def _flush_cache(self, request: web.Request) -> web.Response:
        busy = self._counted_in_flight()
        if self.flush_busy_calls > 0 or busy:
            self.flush_busy_calls = max(0, self.flush_busy_calls - 1)
            return web.Response(status=400, text=FLUSH_BUSY)
        return web.Response(status=200, text=FLUSH_OK)

    async def _freeze_gc(self, request: web.Request) -> web.Response:
        self.freeze_gc_calls += 1  # a test double: the fake's process is the test's, whose heap it leaves alone
        return web.Response(status=200, text=FREEZE_GC_OK)

    async def _release_memory(self, request: web.Request) -> web.Response:
        return self._memory(request, release=True)

    async def _resume_memory(self, request: web.Request) -> web.Response:
        return self._memory(request, release=False)

    def _memory(self, request: web.Request, *, release: bool) -> web.Response:
        try:
            tags = set(parse_memory_tags(require_body(request[_RECORD].body, request.path)) or MEMORY_TAGS)
        except RequestError as exc:
            return self._refused(exc)
        if release and self._counted_in_flight():
            return self._error("cannot release memory while requests run")
        self.released = self.released | tags if release else self.released - tags
        return web.json_response(None)

    async def _pause_generation(self, request: web.Request) -> web.Response:
        try:
            mode = parse_pause(require_body(request[_RECORD].body, request.path))
        except RequestError as exc:
            return self._refused(exc)
        self.paused = mode
        self._unpaused.clear()
        if mode is PauseMode.ABORT:
            for job in list(self._in_flight):
                self._abort(job, "Abort by pause_generation")
        return web.json_response(paused_answer())

    async def _continue_generation(self, request: web.Request) -> web.Response:
        try:
            require_body(request[_RECORD].body, request.path)
        except RequestError as exc:
            return self._refused(exc)
        self.paused = None
        self._unpaused.set()
        return web.json_response(continued_answer())

    async def _abort_request(self, request: web.Request) -> web.Response:
        try:
            abort = AbortRequest.from_json(request[_RECORD].body)
        except RequestError as exc:
            return self._refused(exc)
        if abort is None:  # `{}`: SGLang's no-op
            return web.Response(status=200)
        for job in list(self._in_flight):
            if abort.rid is None or job.rid.startswith(abort.rid):  # SGLang matches rid prefixes
                self._abort(job, "Abort by /abort_request")
        return web.Response(status=200)

    async def _update_weights_from_disk(self, request: web.Request) -> web.Response:
        try:
            update = UpdateWeightsRequest.from_json(request[_RECORD].body)
        except RequestError as exc:
            return self._refused(exc)
        path = update.model_path
        if not os.path.exists(path):
            message = f"Failed to get weights iterator: {path} (repo id: {path}). No such file or directory"
            return web.json_response(update_weights_answer(False, message, 0), status=400)
        self.model_path = path
        if update.weight_version is not None:
            self.weight_version = update.weight_version
        paused_count = sum(1 for job in self._in_flight if job.waiting)
        return web.json_response(update_weights_answer(True, "Succeeded to update model weights.", paused_count))

    async def _loads(self, request: web.Request) -> web.Response:
        waiting = sum(1 for job in self._in_flight if job.waiting)
        running = len(self._in_flight) - waiting
        return web.json_response(loads_response(
            version=FAKE_SGLANG_VERSION, running=running, waiting=waiting, used_tokens=0,
            max_total_tokens=1 << 20, max_running_requests=self.max_running_requests,
        ))


def _respond(action: Respond) -> web.Response:
    if isinstance(action.body, (dict, list)):
        return web.json_response(action.body, status=action.status)
    return web.Response(status=action.status, text="" if action.body is None else str(action.body))


async def _drop(request: web.Request) -> web.StreamResponse:
    """Close the connection without a response; the handler is then cancelled by connection_lost."""
    if request.transport is not None:
        request.transport.close()
    await asyncio.Event().wait()  # cancelled once aiohttp notices the closed connection
    raise AssertionError("unreachable")


async def _first_of(*events: asyncio.Event, timeout: float | None = None) -> None:
    """Wait until any of `events` is set (or `timeout` seconds pass)."""
    waiters = [asyncio.ensure_future(e.wait()) for e in events]
    try:
        await asyncio.wait(waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waiters:
            w.cancel()


# --------------------------------------------------------------------------------------------
# Standalone
# --------------------------------------------------------------------------------------------


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m rollout.fake_engine",
                                description="Scripted fake SGLang server (zero-latency deterministic engine).")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000, help="0 picks a free port (printed on start)")
    p.add_argument("--latency-s", type=float, default=0.0, help="delay before each generation answer")
    p.add_argument("--response-ids", type=int, nargs="+", default=[1001, 1002, 1003],
                   help="ids emitted before the stop id")
    p.add_argument("--eos-token-id", type=int, default=DEFAULT_EOS_TOKEN_ID)
    p.add_argument("--tokens-per-image", type=int, default=None, help="expand each <|image_pad|> to this many")
    p.add_argument("--weight-version", default="default")
    return p.parse_args(argv)


async def _serve(args: argparse.Namespace) -> None:
    server = FakeSGLangServer(
        port=args.port, host=args.host, latency_s=args.latency_s, weight_version=args.weight_version,
        eos_token_id=args.eos_token_id, tokens_per_image=args.tokens_per_image,
        generate_fn=default_generate_fn(args.response_ids, args.eos_token_id),
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with server:
        print(f"fake SGLang server listening on {server.url}", flush=True)
        await stop.wait()


def main(argv: Sequence[str] | None = None) -> None:
    asyncio.run(_serve(_parse_args(argv)))


if __name__ == "__main__":
    main()
