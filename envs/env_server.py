"""`jaxrl-vlm env-serve ENV_MODULE`: any env module of this project behind OpenEnv's WebSocket protocol (aiohttp).

Routes: `WS /ws` (one env per connection; `envs/openenv_wire.py`), `GET /health`, `GET /schema` (our text action
and text-and-pictures observation). At most `max_sessions` connections hold an env at once (by default the module's
`session_capacity`, if it has one, else 64; `resolve_max_sessions`); one more is answered CAPACITY_REACHED and closed
(openenv-core's behaviour). Loopback by default; with `api_key`, every path but /health needs `Authorization: Bearer
KEY` (as `jaxrl-vlm serve`; the WebSocket upgrade carries the header).

A `reset` builds a fresh env (closing the session's previous one) from either
- `data.sample`: the trainer's sample (`group_index`, `index`, `prompt`, `label`, `image_data`, `metadata`), so the
  episode is the in-process one; the observation is the env's own reset observation (empty when it has none); or
- `data.seed` alone: row `seed` of the task's synthetic generator (the module's `synthetic_row(seed)`, else its
  package's `synthetic.generate_row(seed)`); the observation then opens the task: the question and its pictures,
  what a client without our prompt needs.
A malformed, unknown or oversized frame (up to 4x `max_message_bytes`; beyond, aiohttp closes the socket) and an
env that raises are answered with an `error` message; the session stays usable. Each step's observation carries the
env's running `verdict`, and `reward` is that verdict once the episode is done.

No jax: an env server runs on a host without it.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import importlib
import inspect
import itertools
import logging
import signal
import types
import uuid
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import WSMsgType, web

from envs.base import SessionCapacity, observation_clips, observation_images
from envs.openenv_wire import (
    ACTION_SCHEMA,
    DEFAULT_MAX_MESSAGE_BYTES,
    HEALTH_PATH,
    OBSERVATION_SCHEMA,
    SCHEMA_PATH,
    STATE_SCHEMA,
    WS_PATH,
    Close,
    ErrorCode,
    ErrorMessage,
    ObservationMessage,
    Reset,
    StateMessage,
    StateRequest,
    Step,
    WireError,
    parse_client,
    serialize,
)
from rollout.processing import image_to_data_url
from rollout.sample import Sample
from rollout.sglang_wire import is_authorized

logger = logging.getLogger(__name__)

IMAGE_MARKER = "<image>"
#: Sessions env-serve holds at once when neither `--max-sessions` nor the module's `session_capacity` says.
DEFAULT_MAX_SESSIONS = 64
SAMPLE_FIELDS = ("group_index", "index", "prompt", "label", "image_data", "metadata")


def sample_payload(sample: Any) -> dict[str, Any]:
    """What the client env sends as `reset.data.sample`: the fields `build_env` may read (no token streams)."""
    return {name: getattr(sample, name) for name in SAMPLE_FIELDS if hasattr(sample, name)}


def synthetic_row(module: types.ModuleType, seed: int) -> dict[str, Any]:
    """Row `seed` of the env's synthetic generator (prompt-row layout: problem, answer, images)."""
    hook = getattr(module, "synthetic_row", None)
    if hook is None:
        try:
            synthetic = importlib.import_module(f"{module.__name__}.synthetic")
        except ImportError as e:
            raise ValueError(f"{module.__name__} has no synthetic generator (synthetic_row or "
                             f"{module.__name__}.synthetic.generate_row): reset it with data.sample") from e
        hook = getattr(synthetic, "generate_row", None)
        if hook is None:
            raise ValueError(f"{module.__name__}.synthetic has no generate_row(index): reset it with data.sample")
    return hook(seed)


def row_opening(module: types.ModuleType, row: dict[str, Any], seed: int) -> tuple[Sample, dict[str, Any]]:
    """The sample a synthetic row stands for, and the observation that opens its task (question and pictures)."""
    urls = [f"data:image/png;base64,{base64.b64encode(im['bytes']).decode('ascii')}" for im in row.get("images", [])]
    problem = str(row.get("problem", ""))
    instruction = getattr(getattr(module, "TASK_PROMPT", None), "instruction", None)
    text = problem.replace(IMAGE_MARKER, "").strip()
    if instruction:
        text = f"{text}\n\n{instruction}"
    content: list[dict[str, Any]] = [{"type": "image", "image": u} for u in urls] + [{"type": "text", "text": text}]
    sample = Sample(index=seed, prompt=[{"role": "user", "content": content}], label=row.get("answer"),
                    image_data=urls, metadata={"synthetic_seed": seed})
    return sample, {"obs_str": text, "multi_modal_data": {"image": urls}}


def observation_fields(observation: dict[str, Any] | None, owner: str) -> dict[str, Any]:
    """Our wire observation (`openenv_wire.OBSERVATION_SCHEMA`) of an env observation dict (None: empty)."""
    if observation is None:
        return {"text": "", "images": [], "role": "user"}
    if not isinstance(observation, dict) or not isinstance(observation.get("obs_str"), str):
        raise TypeError(f"{owner}: an observation is a dict with a str 'obs_str', got {observation!r:.200}")
    if observation_clips(observation, owner):  # refused, never dropped: the wire schema has no clips yet
        raise ValueError(f"{owner}: an observation with clips cannot be served over the env wire yet (its schema "
                         "carries text and pictures; docs/guides/video.md); run this env in-process")
    images = [im if isinstance(im, str) else image_to_data_url(im) for im in observation_images(observation, owner)]
    return {"text": observation["obs_str"], "images": images, "role": observation.get("role", "user")}


async def _call(fn: Any, *args: Any) -> Any:
    """An env hook: `async def` on the loop, a sync one in a worker thread (it may block)."""
    if inspect.iscoroutinefunction(fn):
        return await fn(*args)
    result = await asyncio.to_thread(fn, *args)
    return await result if inspect.isawaitable(result) else result


def _json_friendly(info: Any) -> dict[str, Any]:
    if not isinstance(info, dict):
        return {}
    return {str(k): (v if isinstance(v, (str, int, float, bool, type(None))) else repr(v)) for k, v in info.items()}


class _Session:
    """One connection's env and episode."""

    def __init__(self, server: "EnvServer") -> None:
        self.server = server
        self.env: Any = None
        self.episode_id: str | None = None
        self.step_count = 0

    async def close_env(self) -> None:
        env, self.env = self.env, None
        if env is not None:
            await _call(env.close)

    async def verdict(self) -> float | None:
        fn = getattr(self.env, "verdict", None)
        value = None if fn is None else await _call(fn)
        return None if value is None else float(value)

    async def reset(self, data: dict[str, Any]) -> ObservationMessage:
        await self.close_env()
        module = self.server.module
        opening = None
        if "sample" in data:
            if not isinstance(data["sample"], dict):
                raise WireError("reset data.sample must be an object", ErrorCode.VALIDATION_ERROR)
            unknown = set(data["sample"]) - set(SAMPLE_FIELDS)
            if unknown:
                raise WireError(f"reset data.sample has unknown fields {sorted(unknown)}", ErrorCode.VALIDATION_ERROR)
            sample = Sample(**data["sample"])
        elif data.get("seed") is not None:
            sample, opening = row_opening(module, synthetic_row(module, int(data["seed"])), int(data["seed"]))
        else:
            raise WireError("reset needs data.seed (a synthetic task) or data.sample (the trainer's sample)",
                            ErrorCode.VALIDATION_ERROR)
        self.env = await _call(module.build_env, sample, self.server.args)
        observation = await _call(self.env.reset)
        if opening is not None:
            if observation is not None:  # the env's own opening follows the task's question
                extra = observation_fields(observation, "env.reset")
                opening = {"obs_str": f"{opening['obs_str']}\n{extra['text']}",
                           "multi_modal_data": {"image": [*opening["multi_modal_data"]["image"], *extra["images"]]}}
            observation = opening
        self.episode_id = str(data.get("episode_id") or uuid.uuid4().hex)
        self.step_count = 0
        fields = observation_fields(observation, "env.reset")
        return ObservationMessage({**fields, "verdict": await self.verdict(), "info": {}}, None, False)

    async def step(self, action: dict[str, Any]) -> ObservationMessage:
        if self.env is None:
            raise WireError("step before reset", ErrorCode.VALIDATION_ERROR)
        if set(action) != {"text"} or not isinstance(action["text"], str):
            raise WireError(f"an action is {{'text': str}}, got fields {sorted(action)}", ErrorCode.VALIDATION_ERROR)
        result = await _call(self.env.step, action["text"])
        if not (isinstance(result, tuple) and len(result) == 3):
            raise TypeError(f"{type(self.env).__name__}.step must return (observation, done, info)")
        observation, done, info = result
        self.step_count += 1
        verdict = await self.verdict()
        fields = observation_fields(observation, "env.step")
        return ObservationMessage({**fields, "verdict": verdict, "info": _json_friendly(info)},
                                  verdict if done else None, bool(done))


def resolve_max_sessions(module: types.ModuleType, args: Any, requested: int | None) -> int:
    """The sessions env-serve holds at once: `requested` (`--max-sessions`), else the module's
    `session_capacity(args)`, else DEFAULT_MAX_SESSIONS. A request above the module's capacity is refused: a
    session past it would wait for the resource inside a hook, holding one of the few threads sync hooks run on,
    and may fail its episode; answered CAPACITY_REACHED instead, the client retries it later."""
    name = getattr(module, "__name__", module)
    hook = getattr(module, "session_capacity", None)
    capacity = hook(args) if callable(hook) else None
    if capacity is not None and not isinstance(capacity, SessionCapacity):
        raise TypeError(f"{name}.session_capacity must return envs.base.SessionCapacity, got {type(capacity).__name__}")
    if requested is None:
        return DEFAULT_MAX_SESSIONS if capacity is None else capacity.sessions
    if requested < 1:
        raise ValueError(f"max_sessions must be >= 1, got {requested}")
    if capacity is not None and requested > capacity.sessions:
        raise ValueError(f"max_sessions {requested} is more than {name} holds at once with these options: "
                         f"{capacity.sessions} ({capacity.set_by}); give at most {capacity.sessions}, or raise it")
    return requested


class EnvServer:
    """The aiohttp application of one env module (`build_app`), and `serve` to run it."""

    def __init__(self, module: types.ModuleType, args: Any, *, max_sessions: int | None = None,
                 api_key: str | None = None, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> None:
        if not callable(getattr(module, "build_env", None)):
            raise ValueError(f"{getattr(module, '__name__', module)} is not an env module (no build_env)")
        max_sessions = resolve_max_sessions(module, args, max_sessions)
        if api_key is not None and not api_key:
            raise ValueError("api_key must be a non-empty string (or None for no key)")
        self.module, self.args, self.max_sessions = module, args, max_sessions
        self.api_key, self.max_message_bytes = api_key, max_message_bytes
        self.active = 0
        self.sessions_served = itertools.count()

    def build_app(self) -> web.Application:
        @web.middleware
        async def auth(request: web.Request, handler: Any) -> web.StreamResponse:
            if not is_authorized(request.path, request.headers.get("Authorization"), self.api_key):
                return web.json_response({"error": "Unauthorized"}, status=401)
            return await handler(request)

        app = web.Application(middlewares=[auth] if self.api_key is not None else [])
        app.router.add_get(HEALTH_PATH, self._health)
        app.router.add_get(SCHEMA_PATH, self._schema)
        app.router.add_get(WS_PATH, self._ws)
        return app

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "healthy", "active_sessions": self.active, "max_sessions": self.max_sessions})

    async def _schema(self, request: web.Request) -> web.Response:
        return web.json_response({"action": ACTION_SCHEMA, "observation": OBSERVATION_SCHEMA, "state": STATE_SCHEMA})

    async def _ws(self, request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse(max_msg_size=4 * self.max_message_bytes)
        await ws.prepare(request)
        if self.active >= self.max_sessions:
            await ws.send_str(serialize(ErrorMessage(
                f"server at capacity ({self.active}/{self.max_sessions} sessions)", ErrorCode.CAPACITY_REACHED,
                {"active_sessions": self.active, "max_sessions": self.max_sessions})))
            await ws.close()
            return ws
        self.active += 1
        session = _Session(self)
        try:
            async for frame in ws:
                if frame.type not in (WSMsgType.TEXT, WSMsgType.BINARY):
                    break
                answer = await self._answer(session, frame.data)
                if answer is None:
                    break
                await ws.send_str(answer)
        finally:
            self.active -= 1
            try:
                await session.close_env()
            except Exception as e:  # the socket is gone: nobody to answer, but never silent
                logger.warning("env-serve: env.close() raised %s: %s", type(e).__name__, e)
            await ws.close()
        return ws

    async def _answer(self, session: _Session, frame: str | bytes) -> str | None:
        """The answer frame to one client frame; None for `close`."""
        try:
            message = parse_client(frame, self.max_message_bytes)
            if isinstance(message, Close):
                return None
            if isinstance(message, StateRequest):
                return serialize(StateMessage({"episode_id": session.episode_id, "step_count": session.step_count}))
            if isinstance(message, Reset):
                return serialize(await session.reset(message.data))
            assert isinstance(message, Step)
            return serialize(await session.step(message.data))
        except WireError as e:
            return serialize(ErrorMessage(str(e), e.code))
        except Exception as e:  # env code is user code: the client gets the error, the session goes on
            logger.warning("env-serve: %s: %s", type(e).__name__, e)
            return serialize(ErrorMessage(f"{type(e).__name__}: {e}", ErrorCode.EXECUTION_ERROR))


@contextlib.asynccontextmanager
async def running(server: EnvServer, host: str = "127.0.0.1", port: int = 0, *,
                  shutdown_timeout_s: float = 2.0) -> AsyncIterator[str]:
    """`server` listening on host:port (0: a free port) while the block runs; yields its WebSocket URL. Leaving
    drops open episodes after `shutdown_timeout_s`, as a killed server would."""
    runner = web.AppRunner(server.build_app(), shutdown_timeout=shutdown_timeout_s)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
        yield f"ws://{host}:{runner.addresses[0][1]}{WS_PATH}"
    finally:
        await runner.cleanup()


async def serve(server: EnvServer, host: str = "127.0.0.1", port: int = 8000,
                ready: asyncio.Event | None = None) -> None:
    """Run `server` on host:port until cancelled or SIGTERM. SIGTERM ends it like Ctrl-C: the sessions' envs are
    closed and the process exits normally, so an env holding outside processes (MiniWoB's Chrome pool) releases
    them; the default action would kill the process with them still running."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    try:
        loop.add_signal_handler(signal.SIGTERM, stop.set)
    except (NotImplementedError, RuntimeError, ValueError):  # not the main thread, or no signals on this platform
        pass
    try:
        async with running(server, host, port) as url:
            logger.info("env-serve: %s on %s (max %d sessions)", server.module.__name__, url, server.max_sessions)
            if ready is not None:
                ready.set()
            await stop.wait()
            logger.info("env-serve: SIGTERM, closing")
    finally:
        try:
            loop.remove_signal_handler(signal.SIGTERM)
        except (NotImplementedError, RuntimeError, ValueError):
            pass
