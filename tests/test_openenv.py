"""Environments as services: the OpenEnv wire, `env-serve` and the remote client env, on 127.0.0.1 only.

The remote episode must be the in-process one (same observations, pictures, done flags and verdicts for the
same samples); a server at capacity is retried with bounded backoff; a dead server, a malformed frame and a
missing API key end in typed answers; and a rollout through the remote env FAILs with a cause, never lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import types
from typing import Any

import aiohttp
import numpy as np
import pytest
from _launch import ROOT, free_port

import envs.color_reveal as color_reveal
import envs.remote as remote
from envs.color_reveal.synthetic import generate_row
from envs.base import SessionCapacity
from envs.env_server import DEFAULT_MAX_SESSIONS, EnvServer, observation_fields, resolve_max_sessions, row_opening
from envs.env_server import running as env_running
from envs.openenv_wire import (
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
    parse_server,
    serialize,
)
from jaxrl_vlm.config import ConfigError, load_config
from rollout.processing import image_to_data_url
from rollout.video import Clip


# ----------------------------------------------------------------------------- wire
def test_client_and_server_messages_round_trip():
    for message in (Reset({"seed": 3}), Step({"text": "red"}), StateRequest(), Close()):
        assert parse_client(serialize(message)) == message
    for message in (ObservationMessage({"text": "hi", "images": []}, 0.5, True), StateMessage({"step_count": 2}),
                    ErrorMessage("full", ErrorCode.CAPACITY_REACHED, {"max_sessions": 1})):
        assert parse_server(serialize(message)) == message
    # openenv-core's shapes, as its server writes them.
    assert json.loads(serialize(ObservationMessage({"t": 1}))) == {
        "type": "observation", "data": {"observation": {"t": 1}, "reward": None, "done": False}}
    assert json.loads(serialize(ErrorMessage("x", ErrorCode.VALIDATION_ERROR))) == {
        "type": "error", "data": {"message": "x", "code": "VALIDATION_ERROR"}}


@pytest.mark.parametrize("frame, code", [
    ("{not json", ErrorCode.INVALID_JSON),
    ('{"type": "jump"}', ErrorCode.UNKNOWN_TYPE),
    ('{"type": "step", "data": "up"}', ErrorCode.VALIDATION_ERROR),
    ('{"type": "reset", "data": {"seed": -1}}', ErrorCode.VALIDATION_ERROR),
    ('{"type": "state", "extra": 1}', ErrorCode.VALIDATION_ERROR),
    ('[1, 2]', ErrorCode.VALIDATION_ERROR),
    ('{"type": "step", "data": {"text": "' + "x" * 200 + '"}}', ErrorCode.VALIDATION_ERROR),  # over the cap
])
def test_bad_client_frames_name_their_error_code(frame, code):
    with pytest.raises(WireError) as e:
        parse_client(frame, max_bytes=128)
    assert e.value.code is code


def test_an_observation_with_clips_is_refused_by_the_env_server_not_dropped():
    clip = Clip.of(np.zeros((2, 8, 8, 3), np.uint8), 2.0)
    with pytest.raises(ValueError, match="with clips cannot be served over the env wire"):
        observation_fields({"obs_str": "watch", "multi_modal_data": {"video": [clip]}}, "VideoEnv")
    assert observation_fields({"obs_str": "x", "multi_modal_data": {"video": []}}, "VideoEnv")["text"] == "x"


def test_pictures_come_as_data_urls_base64_or_nested_integer_arrays(make_test_image):
    image = make_test_image(1, 8)
    url = image_to_data_url(image)
    adapter = remote.DefaultAdapter()
    nested = [[list(image.getpixel((x, y))) for x in range(8)] for y in range(8)]
    for fields in ({"text": "a", "images": [url]}, {"text": "a", "screenshot": url.split(",", 1)[1]},
                   {"text": "a", "screenshot": nested}):
        obs = adapter.observation(fields)
        assert obs["obs_str"] == "a" and obs["multi_modal_data"]["image"] == [url]


# ----------------------------------------------------------------------------- server fixture
def running(server: EnvServer):  # leaving drops open sockets at once: a kill
    return env_running(server, shutdown_timeout_s=0.1)


def _args(**keys: Any) -> types.SimpleNamespace:
    return types.SimpleNamespace(**{"max_turns": 3, "env_step_timeout": 5.0, "env_hook_timeout": 5.0, **keys})


def _samples(n: int) -> list[Any]:
    return [row_opening(color_reveal, generate_row(i, seed=7), i)[0] for i in range(n)]


def _remote_env(sample: Any, url: str, **keys: Any) -> remote.RemoteEnv:
    return remote.build_env(sample, _args(env_url=url, **keys))


def _same_observation(local: dict, far: dict) -> None:
    assert far["obs_str"] == local["obs_str"] and far.get("role", "user") == local.get("role", "user")
    local_images = [image_to_data_url(im) for im in (local.get("multi_modal_data") or {}).get("image", [])]
    assert (far.get("multi_modal_data") or {}).get("image", []) == local_images


# ----------------------------------------------------------------------------- episodes
async def test_remote_episodes_equal_in_process_ones():
    guesses = ["green", "blue", "red"]  # a scripted policy: a fixed guess per turn
    async with running(EnvServer(color_reveal, _args(), max_sessions=4)) as url:
        for sample in _samples(4):
            local, far = color_reveal.build_env(sample, _args()), _remote_env(sample, url)
            assert local.reset() is None and await far.reset() is None
            for guess in guesses:
                l_obs, l_done, l_info = local.step(guess)
                f_obs, f_done, f_info = await far.step(guess)
                _same_observation(l_obs, f_obs)
                assert (f_done, f_info) == (l_done, l_info) and far.verdict() == local.verdict()
                if l_done:
                    break
            await far.close()


async def test_a_seed_reset_opens_the_task_with_its_question_and_picture():
    async with running(EnvServer(color_reveal, _args())) as url:
        sample = types.SimpleNamespace(group_index=5, index=0, prompt=[], label=None, image_data=[], metadata={})
        env = _remote_env(sample, url, env_reset_data="seed")
        opening = await env.reset()
        row = generate_row(5)
        assert "color" in opening["obs_str"].lower() and len(opening["multi_modal_data"]["image"]) == 1
        obs, done, info = await env.step(row["answer"])  # the right color ends it
        assert done and info["correct"] and env.verdict() == 1.0
        await env.close()


def _env_module(capacity: Any = None) -> types.ModuleType:
    module = types.ModuleType("pooled_env")
    module.build_env = color_reveal.build_env
    if capacity is not None:
        module.session_capacity = lambda args: capacity
    return module


def test_env_serve_holds_what_the_env_holds_by_default_and_refuses_more():
    """An env whose own resource bounds its episodes (MiniWoB's Chrome pages) says so in `session_capacity`:
    env-serve then holds that many sessions by default, takes fewer, and refuses more, naming the option; an env
    that says nothing gets 64 or what is asked."""
    pooled = _env_module(SessionCapacity(3, "pool_size 3"))
    assert resolve_max_sessions(pooled, _args(), None) == 3
    assert resolve_max_sessions(pooled, _args(), 2) == 2
    with pytest.raises(ValueError, match=r"max_sessions 4 is more than pooled_env holds .*: 3 \(pool_size 3\)"):
        resolve_max_sessions(pooled, _args(), 4)
    assert EnvServer(pooled, _args()).max_sessions == 3
    assert resolve_max_sessions(color_reveal, _args(), None) == DEFAULT_MAX_SESSIONS == 64
    assert resolve_max_sessions(color_reveal, _args(), 100) == 100
    with pytest.raises(ValueError, match="max_sessions must be >= 1, got 0"):
        resolve_max_sessions(color_reveal, _args(), 0)
    with pytest.raises(TypeError, match="pooled_env.session_capacity must return envs.base.SessionCapacity, got int"):
        resolve_max_sessions(_env_module(3), _args(), None)
    with pytest.raises(ValueError, match="sessions must be an int >= 1"):
        SessionCapacity(0, "pool_size 0")


async def test_capacity_is_retried_with_bounded_backoff_and_recorded():
    async with running(EnvServer(color_reveal, _args(), max_sessions=1)) as url:
        sample, other = _samples(2)
        holder = _remote_env(sample, url)
        await holder.reset()
        waiting = _remote_env(other, url, env_capacity_retries=2, env_capacity_backoff_s=0.01)
        with pytest.raises(remote.RemoteEnvError) as e:
            await waiting.reset()
        assert e.value.code is ErrorCode.CAPACITY_REACHED and len(other.metadata["env_capacity_waits_s"]) == 2
        # Freed during the backoff, the waiting episode gets in.
        patient = _remote_env(_samples(3)[2], url, env_capacity_retries=20, env_capacity_backoff_s=0.05)
        task = asyncio.create_task(patient.reset())
        await asyncio.sleep(0.1)
        await holder.close()
        assert await task is None and patient.capacity_waits_s
        await patient.close()


async def test_a_malformed_frame_gets_an_error_and_the_session_goes_on():
    async with running(EnvServer(color_reveal, _args())) as url:
        sample = _samples(1)[0]
        async with aiohttp.ClientSession() as http, http.ws_connect(url) as ws:
            for frame in ("{oops", '{"type": "step", "data": {"text": "red"}}', '{"type": "step", "data": {"x": 1}}'):
                await ws.send_str(frame)
                answer = parse_server((await ws.receive()).data)
                assert isinstance(answer, ErrorMessage)
            await ws.send_str(serialize(Reset({"sample": remote.sample_payload(sample)})))
            assert isinstance(parse_server((await ws.receive()).data), ObservationMessage)
            await ws.send_str(serialize(Step({"text": "red"})))
            assert isinstance(parse_server((await ws.receive()).data), ObservationMessage)
            await ws.send_str(serialize(StateRequest()))
            assert parse_server((await ws.receive()).data).data["step_count"] == 1


async def test_the_api_key_is_required_except_for_health():
    async with running(EnvServer(color_reveal, _args(), api_key="s3cret")) as url:
        http_url = url.replace("ws://", "http://").removesuffix("/ws")
        async with aiohttp.ClientSession() as http:
            assert (await http.get(http_url + "/health")).status == 200
            assert (await http.get(http_url + "/schema")).status == 401
        sample = _samples(1)[0]
        with pytest.raises(remote.RemoteEnvError, match="401"):
            await _remote_env(sample, url).reset()
        env = _remote_env(sample, url, env_api_key="s3cret")
        assert await env.reset() is None
        await env.close()


async def test_a_server_that_dies_mid_episode_is_a_typed_failure():
    server = EnvServer(color_reveal, _args())
    sample = _samples(1)[0]
    async with running(server) as url:
        env = _remote_env(sample, url)
        await env.reset()
    with pytest.raises(remote.RemoteEnvError):  # the server is gone: the step cannot be answered
        await env.step("red")
    await env.close()
    with pytest.raises(remote.RemoteEnvError, match="cannot connect") as e:
        await _remote_env(sample, url, env_connect_retries=0).reset()
    assert e.value.refused


async def test_a_refused_connection_is_retried_until_the_restarted_server_takes_the_episode():
    async with running(EnvServer(color_reveal, _args())) as url:
        pass  # killed: nothing listens on its port until it is started again below
    port = int(url.split(":")[-1].split("/")[0])
    sample = _samples(1)[0]
    env = _remote_env(sample, url, env_connect_retries=50, env_capacity_backoff_s=0.02)
    reset = asyncio.create_task(env.reset())
    await asyncio.sleep(0.15)
    async with env_running(EnvServer(color_reveal, _args()), port=port, shutdown_timeout_s=0.1):
        assert await reset is None and sample.metadata["env_connect_waits_s"] == env.connect_waits_s != []
        obs, done, info = await env.step("red")
        assert "obs_str" in obs
        await env.close()
    gone = _remote_env(_samples(2)[1], url, env_connect_retries=2, env_capacity_backoff_s=0.01)
    with pytest.raises(remote.RemoteEnvError, match="cannot connect.*gave up after 2 retries") as e:
        await gone.reset()
    assert e.value.refused and e.value.code is None


# ----------------------------------------------------------------------------- a jax-free env host
HEAVY = ("jax", "jaxlib", "flax", "optax", "orbax", "transformers", "torch")
# `jaxrl-vlm env-serve ...` (the console script is `jaxrl_vlm.cli:main`) reporting, as it exits, which of HEAVY it
# ever imported.
_SERVE_AND_REPORT = (
    "import atexit, sys\n"
    f"atexit.register(lambda: print('heavy modules:', sorted(m for m in {HEAVY!r} if m in sys.modules), flush=True))\n"
    "from jaxrl_vlm.cli import main\n"
    "sys.exit(main(sys.argv[1:]))\n"
)


def test_env_serve_plays_an_episode_without_importing_jax_or_transformers():
    """An env host needs none of the trainer's stack: `env-serve` runs a seed reset and a step, then exits cleanly
    on SIGTERM (status 0, its atexit handlers run: what quits MiniWoB's Chromes), and its process never imported
    jax, flax, transformers or torch (start-up time, memory)."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", _SERVE_AND_REPORT, "env-serve", "envs.color_reveal", "--port",
                             str(port)], cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    url = f"ws://127.0.0.1:{port}/ws"

    async def episode() -> None:
        async with aiohttp.ClientSession() as http:  # up within 30 s, however loaded the machine
            for _ in range(600):
                if proc.poll() is not None:
                    break
                with contextlib.suppress(aiohttp.ClientError):
                    if (await http.get(f"http://127.0.0.1:{port}/health")).status == 200:
                        break
                await asyncio.sleep(0.05)
        sample = types.SimpleNamespace(group_index=5, index=0, prompt=[], label=None, image_data=[], metadata={})
        env = _remote_env(sample, url, env_reset_data="seed")
        assert "color" in (await env.reset())["obs_str"].lower()
        obs, done, info = await env.step(generate_row(5)["answer"])
        assert done and env.verdict() == 1.0
        await env.close()

    try:
        asyncio.run(episode())
    finally:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err[-3000:]
    assert "heavy modules: []" in out, out + err[-3000:]  # printed by an atexit handler
    assert "env-serve: SIGTERM, closing" in err


# ----------------------------------------------------------------------------- through the rollout
from rollout.client import RetryPolicy, SGLangClient  # noqa: E402
from rollout.encoding import ChatEncoder  # noqa: E402
from rollout.fake_engine import FakeSGLangServer, Tokens  # noqa: E402
from rollout.multiturn import RolloutContext, generate  # noqa: E402
from rollout.sample import Sample, Status  # noqa: E402


@pytest.fixture(scope="module")
def encoder(tiny_tokenizer, tiny_image_processor):
    return ChatEncoder(tiny_tokenizer, tiny_image_processor)


async def _episode(encoder, env_module, sample: Sample, reply: str = "green", *, latency_s: float = 0.0,
                   **keys: Any) -> tuple[Sample, Any]:
    ids = encoder.tokenize(reply) + [encoder.vision.im_end]
    server = FakeSGLangServer(generate_fn=lambda body: Tokens(tuple(ids), tuple(-0.5 for _ in ids)),
                              eos_token_id=encoder.vision.im_end, image_token_id=encoder.vision.image_pad,
                              latency_s=latency_s)
    async with server:
        async with SGLangClient(server.url, timeout_s=5.0, retry=RetryPolicy(max_retries=0)) as client:
            ctx = RolloutContext(client=client, encoder=encoder, env_module=env_module,
                                 generate_slots=asyncio.Semaphore(4))
            args = types.SimpleNamespace(
                rollout_max_response_len=200, rollout_max_context_len=None, max_turns=2, max_env_retries_per_turn=1,
                env_step_timeout=5.0, env_hook_timeout=5.0, episode_timeout=30.0, delta_check="strict",
                rollout_temperature=1.0, rollout_top_p=1.0, rollout_top_k=-1, rollout_stop_token_ids=[],
                partial_rollout=False, rollout_context=ctx, **keys)
            return await generate(args, sample), server


def _fresh(k: int) -> Sample:
    opened = _samples(k + 1)[k]
    return Sample(group_index=k, prompt=opened.prompt, label=opened.label)


async def test_a_rollout_through_env_serve_is_token_for_token_the_in_process_one(encoder):
    async with running(EnvServer(color_reveal, _args(max_turns=2))) as url:
        for k in range(2):
            local, _ = await _episode(encoder, color_reveal, _fresh(k))
            # --env-url's wrapping (job/session.py): the task module's prompts and reward_fn, the server's episodes.
            far, _ = await _episode(encoder, remote.remote_task(color_reveal), _fresh(k), env_url=url)
            assert far.status is local.status is Status.COMPLETED
            assert (far.tokens, far.loss_mask, far.rollout_log_probs, far.image_data, far.reward) == (
                local.tokens, local.loss_mask, local.rollout_log_probs, local.image_data, local.reward)
            assert far.metadata["prefix_stable"] and "reset_observation" not in far.metadata


async def test_a_dead_env_server_fails_the_episode_with_a_typed_cause(encoder):
    async with running(EnvServer(color_reveal, _args())) as url:
        pass  # nothing listens there any more
    s, _ = await _episode(encoder, remote, _fresh(0), env_url=url, env_connect_retries=0)
    assert s.status is Status.FAILED and str(s.termination) == "env_error" and "cannot connect" in s.metadata["error"]
    assert s.metadata["env_errors"][0].startswith("env.reset failed: RemoteEnvError")  # env/errors/reset_failed


async def test_an_env_server_killed_mid_episode_fails_it_as_env_error_not_lost(encoder):
    """The server goes while the model writes its first turn: that turn's step FAILs the episode (env_error,
    the lost connection named, its tokens so far kept on the sample), and the rollout returns it."""
    opened = asyncio.Event()

    def build_env(sample: Any, args: Any) -> remote.RemoteEnv:
        env = remote.build_env(sample, args)
        reset = env.reset

        async def reset_then_signal() -> Any:
            out = await reset()
            opened.set()
            return out

        env.reset = reset_then_signal
        return env

    task = remote.remote_task(color_reveal)
    task.build_env = build_env
    async with running(EnvServer(color_reveal, _args(max_turns=2))) as url:
        episode = asyncio.create_task(_episode(encoder, task, _fresh(0), env_url=url, latency_s=0.5))
        await asyncio.wait_for(opened.wait(), 10)  # reset answered: the model's first turn takes 0.5 s
    s, _ = await episode
    assert s.status is Status.FAILED and str(s.termination) == "env_error", s.metadata.get("error")
    assert "remote env step" in s.metadata["error"] and len(s.metadata["env_errors"]) == 2  # a try and its retry
    assert s.response_length > 0 and s.reward is None


class _OpeningEnv(color_reveal.ColorRevealEnv):
    """color_reveal whose (async) reset opens with a text and a picture, as a remote env's first screenshot would."""

    async def reset(self):
        color_reveal.ColorRevealEnv.reset(self)
        return {"obs_str": "The card alone:", "multi_modal_data": {"image": [self.reveal_image()]}}


def _opening_env(sample: Any, args: Any) -> _OpeningEnv:
    env = _OpeningEnv.__new__(_OpeningEnv)  # ColorRevealEnv.__init__ calls reset(), a coroutine here
    env.color, env.max_turns, env.options, env.image_size, env.closed = sample.label, 2, color_reveal.ColorRevealOptions(), 64, False
    return env


async def test_a_reset_observation_joins_the_prompt_before_the_first_generation(encoder):
    module = types.ModuleType("opening_env")
    module.build_env = _opening_env
    plain, _ = await _episode(encoder, color_reveal, _fresh(0))
    s, server = await _episode(encoder, module, _fresh(0))
    first = server.requests_to("/generate")[0].body
    assert len(first["image_data"]) == 2 and "The card alone:" in encoder.tokenizer.decode(first["input_ids"])
    assert s.metadata["prefix_stable"] and s.metadata["reset_observation"] == {"text": "The card alone:", "images": 1,
                                                                                "clips": 0}
    assert s.prompt_length > plain.prompt_length and s.response_length == plain.response_length
    assert len(s.image_data) == len(plain.image_data) + 1 and s.prompt == _fresh(0).prompt  # the dataset's prompt kept
    s.validate(image_token_id=encoder.vision.image_pad, vision_start_token_id=encoder.vision.vision_start)


def test_env_url_is_a_run_option_and_brings_the_remote_clients_keys(tmp_path):
    extra = tmp_path / "remote.yaml"
    extra.write_text("env_reset_data: seed\nenv_capacity_retries: 2\n")
    cfg = load_config(None, ["--rollout-interaction-env-path", "envs.color_reveal", "--env-url", "ws://127.0.0.1:9/ws",
                             "--custom-config-path", str(extra)])
    assert cfg.multiturn.env_url == "ws://127.0.0.1:9/ws"
    assert cfg.extra["env_reset_data"] == "seed" and cfg.extra["env_capacity_retries"] == 2
    with pytest.raises(ConfigError, match="env_reset_data"):  # the remote client's keys need --env-url
        load_config(None, ["--rollout-interaction-env-path", "envs.color_reveal", "--custom-config-path", str(extra)])
    task = remote.remote_task(color_reveal)
    assert task.build_env is remote.build_env and task.TASK_PROMPT is color_reveal.TASK_PROMPT
    assert getattr(task, "reward_fn", None) is getattr(color_reveal, "reward_fn", None)
    assert "env_api_key" in task.CONFIG_KEYS
