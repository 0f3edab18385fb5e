"""An env that is a remote OpenEnv server: `--env-url ws://HOST:PORT/ws`, with the task's module as
`--rollout-interaction-env-path` (`remote_task`: its prompts and reward_fn, the server's episodes), or with
`--rollout-interaction-env-path envs.remote` alone for a server whose task has no module here.

One WebSocket per episode (aiohttp), opened by the async `reset` and closed by `close`; the protocol is
`envs/openenv_wire.py`. An adapter turns the model's text into an action and an observation into our observation
dict (`DefaultAdapter`: `jaxrl-vlm env-serve`'s shapes first, then common OpenEnv fields; pictures as data URLs,
bare base64 PNG/JPEG, or nested-integer HxWx3 arrays); `env_adapter_path` names another (`module:Class`).

- `reset` sends `data.sample` (the trainer's sample: `env-serve` rebuilds the in-process env from it, so episodes
  are identical), or with `env_reset_data: seed` the prompt's group index as `data.seed` (any OpenEnv server).
  A server at capacity (CAPACITY_REACHED) is retried with jittered exponential backoff, at most
  `env_capacity_retries` times; the waits are recorded in `sample.metadata["env_capacity_waits_s"]`. A refused
  connection (nothing listens: the server is restarting) is retried the same way, at most `env_connect_retries`
  times (`env_connect_waits_s`), so a restarted server takes the next episodes instead of a burst of FAILED ones.
  No retry starts that would end past the reset's `--env-hook-timeout`.
- Answers are awaited within `--env-hook-timeout` (reset) and `--env-step-timeout` (step), the rollout's limits.
- Reward: the server's running `verdict` when it sends one (`env-serve`), else the sum of the steps' rewards.
- Any failure (refused connection, dropped socket, an `error` answer, a timeout) raises `RemoteEnvError`, which
  the rollout turns into its typed env failure (a FAILED sample with cause `env_error`), never a lost sample. An
  episode whose server dies mid-episode is not resumed: its server-side state is gone.

No jax.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import aiohttp
import numpy as np
from PIL import Image

from envs.base import BaseInteractionEnv, EnvOptions, option, require_max_turns, sample_where
from envs.env_server import sample_payload
from envs.openenv_wire import (
    DEFAULT_MAX_MESSAGE_BYTES,
    ErrorCode,
    ErrorMessage,
    ObservationMessage,
    Reset,
    Step,
    WireError,
    parse_server,
    serialize,
    Close,
)
from rollout.loading import load_function
from rollout.options import MultiTurnOptions
from rollout.processing import image_to_data_url
from rollout.sglang_wire import authorization_header


@dataclass(frozen=True)
class RemoteOptions(EnvOptions):
    """The remote env's `--custom-config-path` keys."""

    ENV_NAME = "remote"

    env_api_key: str | None = option(None, "remote: sent as 'Authorization: Bearer KEY' (env-serve --api-key).")
    env_reset_data: str = option(
        "sample", "remote: what reset sends: 'sample' (the trainer's sample; env-serve replays the in-process "
        "episode) or 'seed' (the prompt's group index as data.seed, for any OpenEnv server).")
    env_capacity_retries: int = option(5, "remote: retries of a server at capacity (CAPACITY_REACHED).", ge=0)
    env_capacity_backoff_s: float = option(
        0.5, "remote: first backoff after CAPACITY_REACHED or a refused connection (doubles, jittered).", gt=0)
    env_connect_retries: int = option(
        5, "remote: retries of a refused connection at reset (a server restarting), with the same backoff.", ge=0)
    env_adapter_path: str | None = option(None, "remote: 'module:Class' of an adapter (default DefaultAdapter).")

    def validate(self) -> None:
        if self.env_reset_data not in ("sample", "seed"):
            raise ValueError(f"args.env_reset_data must be 'sample' or 'seed', got {self.env_reset_data!r}")


CONFIG_KEYS: dict[str, tuple[type, Any, str]] = RemoteOptions.config_keys()

#: Backoff cap after CAPACITY_REACHED or a refused connection.
MAX_CAPACITY_BACKOFF_S = 8.0


class RemoteEnvError(RuntimeError):
    """The remote env failed: `code` is the server's error code, or None for a transport failure; `refused`: the
    connection was refused (nothing listens at the URL), so no episode was started there."""

    def __init__(self, message: str, code: ErrorCode | None = None, *, refused: bool = False) -> None:
        super().__init__(message if code is None else f"{message} ({code.value})")
        self.message, self.code, self.refused = message, code, refused


# ------------------------------------------------------------------------------------------ adapter
def picture(value: Any, where: str) -> str:
    """A picture of an observation as a data URL: a data URL, bare base64 PNG/JPEG, or nested ints HxWx3 (0-255)."""
    if isinstance(value, str):
        if value.startswith("data:image/"):
            return value
        head = value[:8]
        mime = "png" if head.startswith("iVBOR") else "jpeg" if head.startswith("/9j/") else None
        if mime is None:
            raise ValueError(f"{where}: a string picture must be a data URL or base64 PNG/JPEG")
        return f"data:image/{mime};base64,{value}"
    if isinstance(value, list):
        array = np.asarray(value)
        if array.ndim != 3 or array.shape[2] not in (3, 4) or array.dtype.kind not in "iu":
            raise ValueError(f"{where}: an array picture is HxWx3 integers, got shape {array.shape}")
        return image_to_data_url(Image.fromarray(np.clip(array, 0, 255).astype(np.uint8)[..., :3]))
    raise TypeError(f"{where}: unsupported picture of type {type(value).__name__}")


class DefaultAdapter:
    """Model text -> `{"text": text}`; an observation -> our dict. Text from the first str field of TEXT_FIELDS,
    pictures from IMAGE_FIELDS (a list of pictures, or one)."""

    TEXT_FIELDS = ("text", "obs_str", "prompt", "message", "content", "goal")
    IMAGE_FIELDS = ("images", "image", "screenshot", "pixels")

    def action(self, text: str) -> dict[str, Any]:
        return {"text": text}

    def observation(self, fields: dict[str, Any]) -> dict[str, Any]:
        text = next((fields[k] for k in self.TEXT_FIELDS if isinstance(fields.get(k), str)), "")
        images: list[str] = []
        for key in self.IMAGE_FIELDS:
            value = fields.get(key)
            if value is None:
                continue
            many = isinstance(value, list) and value and (isinstance(value[0], str) or np.asarray(value[0]).ndim == 3)
            items = value if many else [value]
            images.extend(picture(v, f"observation[{key!r}]") for v in items if not (isinstance(v, list) and not v))
            break
        obs: dict[str, Any] = {"obs_str": text}
        if images:
            obs["multi_modal_data"] = {"image": images}
        if fields.get("role") in ("user", "tool"):
            obs["role"] = fields["role"]
        return obs


# ------------------------------------------------------------------------------------------ the env
class RemoteEnv(BaseInteractionEnv):
    """One episode on a remote OpenEnv server: see the module docstring."""

    def __init__(self, sample: Any, url: str, options: RemoteOptions, max_turns: int, reset_timeout_s: float,
                 step_timeout_s: float, adapter: Any = None) -> None:
        self.sample, self.url, self.options, self.max_turns = sample, url, options, max_turns
        self.reset_timeout_s, self.step_timeout_s = reset_timeout_s, step_timeout_s
        self.adapter = adapter if adapter is not None else DefaultAdapter()
        self._http: aiohttp.ClientSession | None = None
        self._ws: aiohttp.ClientWebSocketResponse | None = None
        self.verdicts: list[float | None] = []
        self.rewards: list[float] = []
        self.capacity_waits_s: list[float] = []
        self.connect_waits_s: list[float] = []

    # -- transport
    async def _exchange(self, frame: str, timeout_s: float, what: str) -> ObservationMessage:
        if self._ws is None or self._ws.closed:
            raise RemoteEnvError(f"remote env {what}: no open connection to {self.url}")
        try:
            await self._ws.send_str(frame)
            reply = await self._ws.receive(timeout=timeout_s)
        except asyncio.TimeoutError as e:
            raise RemoteEnvError(f"remote env {what}: no answer from {self.url} in {timeout_s:g} s") from e
        except (aiohttp.ClientError, ConnectionError, RuntimeError) as e:
            raise RemoteEnvError(f"remote env {what}: connection to {self.url} lost: {e}") from e
        if reply.type not in (aiohttp.WSMsgType.TEXT, aiohttp.WSMsgType.BINARY):
            raise RemoteEnvError(f"remote env {what}: {self.url} closed the connection ({reply.type.name})")
        try:
            message = parse_server(reply.data, DEFAULT_MAX_MESSAGE_BYTES)
        except WireError as e:
            raise RemoteEnvError(f"remote env {what}: bad answer from {self.url}: {e}") from e
        if isinstance(message, ErrorMessage):
            raise RemoteEnvError(f"remote env {what}: {self.url} answered: {message.message}", message.code)
        if not isinstance(message, ObservationMessage):
            raise RemoteEnvError(f"remote env {what}: expected an observation, got a {message.type} message")
        return message

    async def _disconnect(self) -> None:
        ws, http, self._ws, self._http = self._ws, self._http, None, None
        if ws is not None and not ws.closed:
            try:
                await ws.send_str(serialize(Close()))
            except (aiohttp.ClientError, ConnectionError, RuntimeError):
                pass  # the socket is going anyway; closing it below is what matters
            await ws.close()
        if http is not None:
            await http.close()

    def _reset_data(self) -> dict[str, Any]:
        if self.options.env_reset_data == "seed":
            return {"seed": int(getattr(self.sample, "group_index", 0))}
        return {"sample": sample_payload(self.sample)}

    def _record(self, message: ObservationMessage) -> None:
        verdict = message.observation.get("verdict")
        self.verdicts.append(None if verdict is None else float(verdict))
        if message.reward is not None:
            self.rewards.append(message.reward)

    async def _open(self, headers: dict[str, str], frame: str) -> ObservationMessage:
        """One try at an episode: connect and send `frame` (the reset); the socket is closed again on failure."""
        self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.reset_timeout_s))
        try:
            self._ws = await self._http.ws_connect(self.url, headers=headers, max_msg_size=4 * DEFAULT_MAX_MESSAGE_BYTES)
        except (aiohttp.ClientError, OSError) as e:
            await self._disconnect()
            refused = isinstance(getattr(e, "os_error", None), ConnectionRefusedError)  # ClientConnectorError's
            raise RemoteEnvError(f"remote env reset: cannot connect to {self.url}: {e}", refused=refused) from e
        try:
            return await self._exchange(frame, self.reset_timeout_s, "reset")
        except RemoteEnvError:
            await self._disconnect()
            raise

    # -- the contract
    async def reset(self) -> dict[str, Any] | None:
        """Connect, reset (retrying CAPACITY_REACHED and a refused connection) and return the opening observation
        (None when empty)."""
        await self._disconnect()
        self.turn, self.done, self.verdicts, self.rewards = 0, False, [], []
        headers = authorization_header(self.options.env_api_key) if self.options.env_api_key else {}
        frame = serialize(Reset(self._reset_data()))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.reset_timeout_s
        backoff = self.options.env_capacity_backoff_s
        while True:
            try:
                message = await self._open(headers, frame)
                break
            except RemoteEnvError as e:
                if e.code is ErrorCode.CAPACITY_REACHED:
                    waits, limit, key = self.capacity_waits_s, self.options.env_capacity_retries, "env_capacity_waits_s"
                elif e.refused:
                    waits, limit, key = self.connect_waits_s, self.options.env_connect_retries, "env_connect_waits_s"
                else:
                    raise
                wait = min(backoff, MAX_CAPACITY_BACKOFF_S) * (0.5 + random.random())
                if len(waits) >= limit or loop.time() + wait > deadline:
                    if not waits:
                        raise
                    raise RemoteEnvError(f"{e.message}; gave up after {len(waits)} retries in {sum(waits):.1f} s",
                                         e.code, refused=e.refused) from e
                waits.append(round(wait, 3))
                if hasattr(self.sample, "metadata"):
                    self.sample.metadata[key] = list(waits)
                await asyncio.sleep(wait)
                backoff *= 2
        self._record(message)
        observation = self.adapter.observation(message.observation)
        return observation if observation["obs_str"] or observation.get("multi_modal_data") else None

    async def step(self, response_text: str) -> tuple[dict[str, Any], bool, dict[str, Any]]:
        self.check_step(response_text)
        message = await self._exchange(serialize(Step(self.adapter.action(response_text))), self.step_timeout_s, "step")
        self.turn += 1
        self._record(message)
        self.done = message.done
        info = message.observation.get("info")
        return self.adapter.observation(message.observation), message.done, dict(info) if isinstance(info, dict) else {}

    def verdict(self) -> float | None:
        """The server's running verdict after the last answer, else the sum of the steps' rewards (None if none)."""
        if self.verdicts and any(v is not None for v in self.verdicts):
            return self.verdicts[-1]
        return sum(self.rewards) if self.rewards else None

    async def close(self) -> None:
        self.closed = True
        await self._disconnect()


def build_env(sample: Any, args: Any) -> RemoteEnv:
    """A RemoteEnv for `sample` on `--env-url`, with the rollout's env timeouts; nothing connects until reset."""
    options = RemoteOptions.from_args(args)
    multiturn = MultiTurnOptions.from_args(args)
    if not (multiturn.env_url or "").startswith(("ws://", "wss://")):
        raise ValueError(f"remote build_env: --env-url must be a ws:// or wss:// URL, got {multiturn.env_url!r}")
    adapter = None
    if options.env_adapter_path:
        adapter = load_function(options.env_adapter_path, "remote env adapter (env_adapter_path)")()
    if getattr(sample, "prompt", None) is None:
        raise ValueError(f"remote build_env: {sample_where(sample)} has no prompt")
    return RemoteEnv(sample, multiturn.env_url, options, require_max_turns(args, "remote"), multiturn.env_hook_timeout,
                     multiturn.env_step_timeout, adapter)


def remote_task(task: ModuleType) -> ModuleType:
    """`task` (an env module) with its episodes played on the env server at `--env-url`: its prompts (`TASK_PROMPT`),
    `reward_fn` and config keys stay the task's, `build_env` is the remote client's, so `jaxrl-vlm env-serve` of the
    same module gives the in-process episodes (each reset sends the sample)."""
    module = ModuleType(f"{task.__name__}@remote", task.__doc__)
    module.__dict__.update({k: v for k, v in vars(task).items() if not k.startswith("__")})
    module.build_env = build_env
    module.CONFIG_KEYS = {**getattr(task, "CONFIG_KEYS", {}), **CONFIG_KEYS}
    return module
