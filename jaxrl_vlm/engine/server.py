"""SGLang's native HTTP API over the embedded engine (aiohttp), and ways to run it.

* `build_app(engine)`: the aiohttp application (endpoints of `reference/sglang_api.md` §1-2).
* `EmbeddedEngine(model_dir, ...)`: in-process handle for the trainer and tests; `start()` loads the
  model, starts the scheduler thread and an HTTP server on its own event loop in a background thread
  and returns the URL; `stop()` aborts what is in flight and joins both threads.
* `serve(model_dir, host, port, ...)`: the blocking server behind `jaxrl-vlm serve`.

The server binds loopback by default. Malformed requests get HTTP 400 with SGLang's error object
`{"error": {"message": ...}}` and the server keeps serving.

Limits (`EngineOptions`): a body over `request_bytes_cap` is refused with 413 before it is read; a large
body is parsed off the event loop; `image_data` is read as `EngineOptions.image_policy` allows (data URLs
and base64, local image files only under `allowed_local_media_path`, capped bytes and pixels); a control
call the scheduler does not answer within `control_timeout_s` (`weight_update_timeout_s` for weight
updates) gets 503 with a message. With an API key (SGLang's `--api-key`) every path but the health probes
needs `Authorization: Bearer <key>`; binding a non-loopback address without one logs a warning.
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.metadata
import ipaddress
import logging
import signal
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Awaitable, Callable

from aiohttp import web

from jaxrl_vlm.engine.core import Engine, SchedulerUnavailable, threadsafe_setter
from jaxrl_vlm.engine.inbox import LoadsMsg, MemoryMsg
from jaxrl_vlm.engine.options import EngineOptions
from jaxrl_vlm.engine.protocol import EMBEDDED_UNSUPPORTED, GenerateOutput, GenerateRequest, response_body
from rollout.sglang_wire import (
    FLUSH_BUSY,
    FLUSH_OK,
    FREEZE_GC_OK,
    UNAUTHORIZED_BODY,
    AbortRequest,
    FinishType,
    RawGenerate,
    RequestError,
    SamplingParams,
    UpdateWeightsRequest,
    error_body,
    refusal_body,
    require_body,
    is_authorized,
    loads_response,
    parse_generate,
    parse_json_body,
    parse_memory_tags,
    parse_pause,
    route_handlers,
    update_weights_answer,
)

logger = logging.getLogger(__name__)


def _package_version() -> str:
    try:
        return importlib.metadata.version("jaxrl-vlm")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


VERSION = f"jaxrl-vlm-embedded-{_package_version()}"

HEALTH_TIMEOUT_S = 20.0  # SGLang's /health_generate waits this long for scheduler output
JSON_INLINE_BYTES = 256 << 10  # bodies above this are parsed in a worker thread, not on the event loop
_SERVER = web.AppKey("server_args", dict)
_EXECUTOR = web.AppKey("executor", ThreadPoolExecutor)


class _Served:
    """The engine an app serves, let go when the app is cleaned up: aiohttp keeps every app that served a request in
    a module-level cache of built middleware chains (`aiohttp.web_app._cached_build_middleware`, 1,024 entries), which
    must not keep a stopped engine's weights and KV cache alive in a process that goes on."""

    def __init__(self, engine: Engine) -> None:
        self.engine: Engine | None = engine


_SERVED = web.AppKey("served", _Served)


def _engine(request: web.Request) -> Engine:
    engine = request.app[_SERVED].engine
    if engine is None:
        raise web.HTTPServiceUnavailable(text="the engine has stopped")
    return engine


class BodyTooLarge(RequestError):
    """A request body over the server's cap (HTTP 413)."""


def _bad(message: str, status: int = 400) -> web.Response:
    return web.json_response(error_body(message), status=status)


def _refused(e: RequestError) -> web.Response:
    """A refused request, answered with SGLang's body for its kind (`sglang_wire.refusal_body`)."""
    return web.json_response(refusal_body(e), status=413 if isinstance(e, BodyTooLarge) else 400)


def is_loopback(host: str) -> bool:
    """Whether binding `host` keeps the server on this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


async def _json_body(request: web.Request, *, optional: bool = False) -> Any:
    """The request's JSON body. Over the cap: BodyTooLarge, before reading it when Content-Length says so;
    a large body is parsed in the app's worker threads so the event loop keeps serving."""
    cap = _engine(request).config.request_bytes_cap
    if request.content_length is not None and request.content_length > cap:
        raise BodyTooLarge(f"{request.path}: request body of {request.content_length} bytes is over the server's "
                           f"cap of {cap} bytes (max_request_bytes)")
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise BodyTooLarge(f"{request.path}: request body is over the server's cap of {cap} bytes "
                           "(max_request_bytes)") from None
    if not raw.strip():
        if optional:
            return {}
        return require_body(None, request.path)
    if len(raw) <= JSON_INLINE_BYTES:
        return parse_json_body(raw, request.path)
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(request.app[_EXECUTOR], parse_json_body, raw, request.path)


async def _run_request(engine: Engine, req: GenerateRequest) -> GenerateOutput:
    """Submit one request and wait for it; a cancelled handler (client gone) aborts it, as SGLang does."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[GenerateOutput] = loop.create_future()
    engine.scheduler.submit(req, threadsafe_setter(loop, future))
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        engine.scheduler.abort(req.rid, "Abort because the client disconnected")
        raise


# ---------------------------------------------------------------------------- handlers


async def generate(request: web.Request) -> web.Response:
    engine = _engine(request)
    try:
        body = await _json_body(request)
        raws, is_batch = parse_generate(body, engine.cfg.text.vocab_size, EMBEDDED_UNSUPPORTED, engine.config.max_n)
        loop = asyncio.get_running_loop()
        executor = request.app[_EXECUTOR]
        # Tokenizing and image preprocessing are CPU work: keep them off the event loop.
        prepared = await asyncio.gather(*(loop.run_in_executor(executor, engine.preparer.prepare, r) for r in raws))
        for req in prepared:
            if req.return_routed_experts and not engine.runner.records_experts:
                raise RequestError(f"return_routed_experts: the embedded engine records no routed experts for "
                                   f"{engine.cfg.model_type} (a dense model: only the mixture-of-experts families, "
                                   "qwen3_vl_moe and qwen3_5_moe, route tokens to experts)")
            if req.prompt.num_tokens >= engine.config.max_seq_len:
                raise RequestError(
                    f"The input ({req.prompt.num_tokens} tokens, image pads expanded) is longer than the model's "
                    f"context length ({engine.config.max_seq_len} tokens)."
                )
    except RequestError as e:
        return _refused(e)
    outputs = await asyncio.gather(*(_run_request(engine, req) for req in prepared))
    failed = [o.error for o in outputs if o.error is not None]
    if failed:
        return _bad(f"generation failed: {failed[0]}", status=500)
    bodies = [response_body(req, out, engine.tokenizer) for req, out in zip(prepared, outputs)]
    return web.json_response(bodies if is_batch else bodies[0])


async def health(request: web.Request) -> web.Response:
    engine = _engine(request)
    return web.Response(status=200 if engine.scheduler.alive else 503)


async def health_generate(request: web.Request) -> web.Response:
    """200 once the scheduler produces output: a busy engine counts as alive if it made progress in
    the last HEALTH_TIMEOUT_S, a paused one if its thread runs, an idle one must answer a 1-token probe."""
    engine = _engine(request)
    sched = engine.scheduler
    if not sched.alive:
        return web.Response(status=503, text="engine scheduler is not running")
    try:
        loads = await engine.control(LoadsMsg, min(HEALTH_TIMEOUT_S, engine.config.control_timeout_s))
    except SchedulerUnavailable as e:
        return web.Response(status=503, text=e.detail)
    if loads["paused"]:  # paused on purpose (weight sync): a probe would only wait for continue
        return web.Response(status=200)
    if loads["num_running_reqs"] or loads["num_waiting_reqs"]:
        recent = time.monotonic() - sched.last_progress < HEALTH_TIMEOUT_S
        return web.Response(status=200 if recent else 503)
    probe_id = engine.eos_ids[0] if engine.eos_ids else 0
    raw = RawGenerate(f"HEALTH_CHECK_{time.monotonic_ns()}", None, [probe_id], [],
                      SamplingParams(max_new_tokens=1, temperature=0.0), False, False)
    try:
        out = await asyncio.wait_for(_run_request(engine, engine.preparer.prepare(raw)), HEALTH_TIMEOUT_S)
    except asyncio.TimeoutError:
        return web.Response(status=503, text=f"no generation within {HEALTH_TIMEOUT_S:g} s")
    ok = out.error is None and out.finish_reason.type is not FinishType.ABORT
    return web.Response(status=200 if ok else 503)


async def model_info(request: web.Request) -> web.Response:
    engine = _engine(request)
    # SGLang 0.5.23's keys, all of them (tests/sglang_conformance compares the whole answer's shape).
    return web.json_response({
        "model_path": engine.model_path,
        "served_model_name": engine.model_path,
        "tokenizer_path": engine.model_path,
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": engine.scheduler.weight_version,
        "load_format": "safetensors",
        "reasoning_parser": None,
        "tool_call_parser": None,
        "disaggregation_mode": None,
        "has_image_understanding": engine.has_image_understanding,
        "has_audio_understanding": False,
        "model_type": engine.cfg.model_type,
        "architectures": engine.architectures,
    })


async def server_info(request: web.Request) -> web.Response:
    engine = _engine(request)
    cfg = engine.config
    loads = await engine.control(LoadsMsg)
    programs = compiled_programs(engine.runner)  # one snapshot for the count and the list
    return web.json_response({
        **request.app[_SERVER],
        "model_path": engine.model_path,
        "tokenizer_path": engine.model_path,
        "context_length": cfg.max_seq_len,
        "max_running_requests": cfg.max_batch,
        "dtype": cfg.param_dtype,
        "compute_dtype": cfg.compute_dtype,
        "disable_radix_cache": not cfg.prefix_cache,  # SGLang's name for its prefix cache switch
        "page_size": cfg.page_size,
        "weight_version": engine.scheduler.weight_version,
        "internal_states": [{
            "max_req_input_len": cfg.max_seq_len - 1,
            "max_total_num_tokens": loads["max_total_num_tokens"],
            "num_compiled_programs": len(programs),
            # Not SGLang's: the KV page accounting (a snapshot from the scheduler thread), the engine's counters and
            # each compiled program's key (kind, then its buckets) with whether the side thread compiled it (stalling
            # nothing) or the call that first needed it (stalling the running requests), for leak checks and the
            # soak test (scripts/soak_engine.py).
            "kv_pages": {
                "total": loads["kv_pages_total"],
                "free": loads["kv_pages_free"],
                "cached": loads["kv_pages_cached"],
                "held_by_requests": loads["kv_pages_held_by_requests"],
            },
            "engine_stats": dataclasses.asdict(engine.scheduler.stats),
            "compiled_programs": programs,
        }],
        "version": VERSION,
        "embedded_engine": True,
    })


def compiled_programs(runner: Any) -> list[dict[str, Any]]:
    """The runner's compiled programs, for `/get_server_info`: key as a list, and whether the side thread compiled
    it. The scheduler thread may add one meanwhile: `programs` is copied first, and the runner adds a key to
    `side_programs` before `programs`, so a listed key the side thread compiled is never shown as compiled in place."""
    programs = set(runner.programs)
    side = set(runner.side_programs)
    return [{"key": list(key), "side_thread": key in side} for key in sorted(programs, key=repr)]


async def ready(request: web.Request) -> web.Response:
    """SGLang's `/ready`: 200 while the engine takes new requests (running and not paused), else 503."""
    engine = _engine(request)
    if not engine.scheduler.alive:
        return web.Response(status=503)
    try:
        loads = await engine.control(LoadsMsg, min(HEALTH_TIMEOUT_S, engine.config.control_timeout_s))
    except SchedulerUnavailable:
        return web.Response(status=503)
    return web.Response(status=503 if loads["paused"] else 200)


async def flush_cache(request: web.Request) -> web.Response:
    flushed = await _engine(request).flush_cache()
    return web.Response(status=200 if flushed else 400, text=FLUSH_OK if flushed else FLUSH_BUSY)


async def freeze_gc(request: web.Request) -> web.Response:
    _engine(request).freeze_gc()
    return web.Response(status=200, text=FREEZE_GC_OK)


async def pause_generation(request: web.Request) -> web.Response:
    try:
        mode = parse_pause(await _json_body(request))  # SGLang answers 400 to a missing body
    except RequestError as e:
        return _refused(e)
    return web.json_response(await _engine(request).pause_generation(mode))


async def continue_generation(request: web.Request) -> web.Response:
    try:
        await _json_body(request)  # SGLang answers 400 to a missing body
    except RequestError as e:
        return _refused(e)
    return web.json_response(await _engine(request).continue_generation())


async def abort_request(request: web.Request) -> web.Response:
    try:
        abort = AbortRequest.from_json(await _json_body(request))
    except RequestError as e:
        return _refused(e)
    if abort is not None:  # `{}` is SGLang's no-op
        _engine(request).scheduler.abort(abort.rid)
    return web.Response(status=200)


async def update_weights_from_disk(request: web.Request) -> web.Response:
    try:
        update = UpdateWeightsRequest.from_json(await _json_body(request))
    except RequestError as e:
        return _refused(e)
    try:
        result = await _engine(request).update_weights_from_disk(update)
    except SchedulerUnavailable as e:
        return web.json_response(update_weights_answer(False, e.detail, 0), status=503)
    return web.json_response(result, status=200 if result["success"] else 400)


async def release_memory_occupation(request: web.Request) -> web.Response:
    return await _memory_occupation(request, release=True)


async def resume_memory_occupation(request: web.Request) -> web.Response:
    return await _memory_occupation(request, release=False)


async def _memory_occupation(request: web.Request, *, release: bool) -> web.Response:
    """SGLang's memory saver: free (or restore) the weights' and KV cache's device memory while a colocated
    trainer runs. Answers 200 with a null body, as SGLang does; 400 when the engine is busy."""
    try:
        tags = parse_memory_tags(await _json_body(request))  # SGLang answers 400 to a missing body
    except RequestError as e:
        return _refused(e)
    problem = await _engine(request).control(lambda reply: MemoryMsg(release, tags, reply))
    return _bad(problem) if problem else web.json_response(None)


async def loads(request: web.Request) -> web.Response:
    engine = _engine(request)
    state = await engine.control(LoadsMsg)
    running, waiting = state["num_running_reqs"], state["num_waiting_reqs"]
    return web.json_response(loads_response(
        version=VERSION, running=running, waiting=waiting, used_tokens=state["num_used_tokens"],
        max_total_tokens=state["max_total_num_tokens"], max_running_requests=engine.config.max_batch,
    ))


@web.middleware
async def _errors(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
    """Unexpected failures answer 500 with an error object; the server keeps serving."""
    try:
        return await handler(request)
    except web.HTTPException:
        raise
    except (asyncio.CancelledError, KeyboardInterrupt):
        raise
    except SchedulerUnavailable as exc:
        return _bad(f"{request.path}: {exc.detail}", status=503)
    except Exception as exc:
        logger.exception("%s %s failed", request.method, request.path)
        return _bad(f"{request.path}: internal error: {type(exc).__name__}: {exc}", status=500)


def _api_key_middleware(api_key: str) -> Callable[..., Awaitable[web.StreamResponse]]:
    """SGLang's `--api-key`: `Authorization: Bearer <key>` on every path but the health probes, else 401."""

    @web.middleware
    async def authenticate(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
        if not is_authorized(request.path, request.headers.get("Authorization"), api_key):
            return web.json_response(UNAUTHORIZED_BODY, status=401)
        return await handler(request)

    return authenticate


def build_app(engine: Engine, *, host: str = "127.0.0.1", port: int | None = None, prepare_workers: int = 4,
              api_key: str | None = None) -> web.Application:
    """The aiohttp application; the caller starts `engine` and cleans up the app. With `api_key`, requests
    need `Authorization: Bearer <api_key>` (health probes excepted)."""
    middlewares = [_errors] if api_key is None else [_errors, _api_key_middleware(api_key)]
    # aiohttp stops reading a body past client_max_size; `_json_body` answers 413 then.
    app = web.Application(middlewares=middlewares, client_max_size=engine.config.request_bytes_cap)
    app[_SERVED] = _Served(engine)
    app[_SERVER] = {"host": host, "port": port}
    executor = ThreadPoolExecutor(max_workers=prepare_workers, thread_name_prefix="jaxrl-vlm-prepare")
    app[_EXECUTOR] = executor

    async def _let_go(app: web.Application) -> None:
        executor.shutdown(wait=False, cancel_futures=True)
        app[_SERVED].engine = None

    app.on_cleanup.append(_let_go)
    handlers = {
        "generate": generate, "health": health, "health_generate": health_generate, "model_info": model_info,
        "server_info": server_info, "ready": ready, "flush_cache": flush_cache, "freeze_gc": freeze_gc,
        "pause_generation": pause_generation, "continue_generation": continue_generation,
        "abort_request": abort_request, "update_weights_from_disk": update_weights_from_disk, "loads": loads,
        "release_memory_occupation": release_memory_occupation, "resume_memory_occupation": resume_memory_occupation,
    }
    for method, path, handler in route_handlers(handlers):
        app.router.add_route(method, path, handler)
    return app


def _bind(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise OSError(f"cannot bind the engine server to {host}:{port}: {e}") from e
    return sock


class EmbeddedEngine:
    """The engine and its HTTP server inside this process, for the trainer and tests.

        with EmbeddedEngine(model_dir, config=EngineOptions(max_batch=8)) as engine:
            client = SGLangClient(engine.url)

    `port=0` picks a free port. The HTTP server runs on its own event loop in a background thread,
    the model on the scheduler thread; `stop()` aborts in-flight requests and joins both.
    """

    def __init__(
        self,
        model_dir: str,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        config: EngineOptions | None = None,
        weight_version: str = "default",
        api_key: str | None = None,
    ):
        if api_key is not None and not api_key:
            raise ValueError("api_key must be a non-empty string (or None for no key)")
        self.model_dir = str(model_dir)
        self.api_key = api_key
        self.host = host
        self.requested_port = port
        self.config = config or EngineOptions()
        self.weight_version = weight_version
        self.engine: Engine | None = None
        self.port: int | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        if self.port is None:
            raise RuntimeError("EmbeddedEngine is not started; call start()")
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def start(self, timeout_s: float = 120.0) -> str:
        """Load the model, start scheduler and HTTP server; return the base URL once it listens."""
        if self._thread is not None:
            raise RuntimeError("EmbeddedEngine already started")
        if self.api_key is None and not is_loopback(self.host):
            logger.warning(
                "the engine server binds %s, which is not a loopback address, without an API key: anyone who can "
                "reach it can generate, pause or abort requests and load weights from any server path "
                "(start it with --api-key)", self.host)
        self.engine = Engine(self.model_dir, self.config, weight_version=self.weight_version)
        self.engine.start()
        sock = _bind(self.host, self.requested_port)
        self.port = sock.getsockname()[1]
        ready = threading.Event()
        failure: list[BaseException] = []
        self._loop = asyncio.new_event_loop()

        def run() -> None:
            asyncio.set_event_loop(self._loop)
            try:
                app = build_app(self.engine, host=self.host, port=self.port, api_key=self.api_key)
                self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=2.0)
                self._loop.run_until_complete(self._runner.setup())
                self._loop.run_until_complete(web.SockSite(self._runner, sock, backlog=1024).start())
            except BaseException as exc:  # reported to start(), which raises it
                failure.append(exc)
                ready.set()
                return
            ready.set()
            self._loop.run_forever()
            self._loop.run_until_complete(self._runner.cleanup())
            self._loop.close()

        self._thread = threading.Thread(target=run, name="jaxrl-vlm-engine-http", daemon=True)
        self._thread.start()
        if not ready.wait(timeout_s) or failure:
            self.stop()
            raise RuntimeError(f"embedded engine HTTP server did not start on {self.host}:{self.port}") from (
                failure[0] if failure else None
            )
        logger.info("embedded engine serving %s at %s", self.model_dir, self.url)
        return self.url

    def stop(self, timeout_s: float = 30.0) -> None:
        """Abort in-flight requests (they answer `abort`), stop the HTTP server and the scheduler."""
        # Scheduler first: it answers every request it holds with `abort`, then HTTP delivers those answers.
        if self.engine is not None:
            self.engine.stop()
        if self._thread is not None and self._loop is not None:
            if self._loop.is_running():
                self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                raise RuntimeError(f"embedded engine HTTP thread did not stop within {timeout_s} s")
        self._thread = None
        self._loop = None
        self._runner = None  # its app holds the engine: a stopped server must not keep the model alive

    @property
    def stats(self) -> Any:
        """The scheduler's counters (decode steps, rows, prefills, ...)."""
        if self.engine is None:
            raise RuntimeError("EmbeddedEngine is not started")
        return self.engine.scheduler.stats

    def __enter__(self) -> EmbeddedEngine:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def serve(model_dir: str, *, host: str = "127.0.0.1", port: int = 30000, config: EngineOptions | None = None,
          weight_version: str = "default", api_key: str | None = None) -> None:
    """Run the engine server in the foreground until SIGINT or SIGTERM."""
    engine = EmbeddedEngine(model_dir, host=host, port=port, config=config, weight_version=weight_version,
                            api_key=api_key)
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        url = engine.start()
        print(f"jaxrl-vlm engine serving {model_dir} at {url}", flush=True)
        while not stop.wait(1.0):
            if not engine.engine.scheduler.alive:
                raise RuntimeError("engine scheduler stopped unexpectedly") from engine.engine.scheduler.error
    finally:
        engine.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
