"""OpenEnv conformance, in the venv of `.ci/openenv_conformance.sh` (the real openenv-core; not the default run).

- openenv-core's own client (`GenericEnvClient`) plays multi-turn episodes against `env-serve` (sokoban, in this
  process; MiniWoB++, `jaxrl-vlm env-serve envs.miniwob` in a process of its own from the project venv, with its
  Chrome pool);
- our client env (`envs/remote.py`) plays one against a server built with openenv-core's `create_app`.
Loopback only.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
import types

import aiohttp
import pytest
import uvicorn
from aiohttp import web
from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from openenv.core.generic_client import GenericEnvClient

import envs.remote as remote
import envs.sokoban as sokoban
from envs.env_server import EnvServer
from envs.sokoban.synthetic import generate_row

pytestmark = pytest.mark.asyncio


def _args(**keys):
    return types.SimpleNamespace(**{"max_turns": 4, "env_step_timeout": 10.0, "env_hook_timeout": 10.0, **keys})


async def test_openenv_client_drives_env_serve():
    runner = web.AppRunner(EnvServer(sokoban, _args(), max_sessions=2).build_app(), shutdown_timeout=0.1)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    port = runner.addresses[0][1]
    try:
        for seed in (0, 1):
            solution = __import__("json").loads(generate_row(seed)["params"])["solution"]
            async with GenericEnvClient(base_url=f"http://127.0.0.1:{port}") as client:
                result = await client.reset(seed=seed)
                assert result.observation["images"] and not result.done
                for move in solution:
                    result = await client.step({"text": move})
                assert result.done and result.reward == pytest.approx(1 - 0.05 * len(solution))
                state = await client.state()
                assert getattr(state, "step_count", None) == len(solution) or state["step_count"] == len(solution)
    finally:
        await runner.cleanup()


#: The project's CLI from the project venv: MINIWOB_ENV_SERVE, else `jaxrl-vlm` on PATH (CI's activated venv), else
#: .venv's. The env server runs with its own dependencies (the miniwob extra, Chromium), none of which this venv has.
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV_SERVE = (os.environ.get("MINIWOB_ENV_SERVE") or shutil.which("jaxrl-vlm")
             or os.path.join(ROOT, ".venv", "bin", "jaxrl-vlm"))


def _sweep():
    """Click points 32 task-pixels apart over click-test's 160x160 area (Qwen-VL 0-1000 coordinates): its button is
    at least 35 px a side, so one of them hits it, and a miss leaves the episode going."""
    for y_px in range(66, 210, 32):
        for x_px in range(16, 160, 32):
            yield f"click({round(x_px * 1000 / 160)}, {round(y_px * 1000 / 210)})"


async def test_openenv_client_drives_env_serve_of_miniwob():
    if not (os.environ.get("MINIWOB_CHROMEDRIVER") or shutil.which("chromedriver")):
        pytest.fail("no chromedriver: apt-get install chromium chromium-driver (.ci/run's browser step installs them)")
    port = _free_port()
    server = subprocess.Popen([ENV_SERVE, "env-serve", "envs.miniwob", "--port", str(port), "--max-sessions", "2",
                               "--max-turns", "30"], cwd=ROOT)
    try:
        async with aiohttp.ClientSession() as http:
            for _ in range(200):
                try:
                    async with http.get(f"http://127.0.0.1:{port}/health") as answer:
                        if answer.status == 200:
                            break
                except aiohttp.ClientError:
                    pass
                assert server.poll() is None, f"env-serve envs.miniwob exited with {server.returncode}"
                await asyncio.sleep(0.1)
            else:
                pytest.fail(f"env-serve envs.miniwob ({ENV_SERVE}) not healthy on port {port} after 20 s")
        for seed in (0, 1):
            async with GenericEnvClient(base_url=f"http://127.0.0.1:{port}") as client:
                result = await client.reset(seed=seed)
                assert result.observation["images"] and not result.done
                assert "Click the button." in result.observation["text"]
                result = await client.step({"text": "where is it?"})  # malformed: a penalty, and the page stays
                assert not result.done and result.observation["text"].startswith("Invalid action")
                turns = 1
                for reply in _sweep():
                    result = await client.step({"text": reply})
                    turns += 1
                    if result.done:
                        break
                    assert result.observation["images"]
                assert result.done and result.reward == pytest.approx(1.0 - 0.1) and turns >= 2
                state = await client.state()
                assert getattr(state, "step_count", None) == turns or state["step_count"] == turns
    finally:
        server.send_signal(signal.SIGINT)  # a clean exit quits the pooled Chromes (SIGTERM would leave them running)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
            raise


class CountAction(Action):
    text: str


class CountObservation(Observation):
    text: str = ""


class CountEnv(Environment):
    """Say 'more' until the count reaches 3; reward 1 per step."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def reset(self, seed=None, episode_id=None, **kwargs):
        self.count = 0
        return CountObservation(text=f"count 0 (seed {seed})")

    def step(self, action, timeout_s=None, **kwargs):
        self.count += 1
        return CountObservation(text=f"count {self.count}", reward=1.0, done=self.count >= 3)

    @property
    def state(self):
        return State(step_count=self.count)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_our_client_drives_an_openenv_server():
    port = _free_port()
    app = create_app(CountEnv, CountAction, CountObservation, max_concurrent_envs=1)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        await asyncio.sleep(0.05)
    try:
        sample = types.SimpleNamespace(group_index=7, index=0, prompt=[], label=None, image_data=[], metadata={})
        env = remote.build_env(sample, _args(env_url=f"ws://127.0.0.1:{port}/ws", env_reset_data="seed"))
        opening = await env.reset()
        assert opening == {"obs_str": "count 0 (seed 7)"}
        done, turns = False, 0
        while not done:
            obs, done, _ = await env.step("more")
            turns += 1
        assert turns == 3 and obs["obs_str"] == "count 3" and env.verdict() == 3.0
        # One session at a time: a second episode is refused with CAPACITY_REACHED, retried, then typed.
        other = remote.build_env(sample, _args(env_url=f"ws://127.0.0.1:{port}/ws", env_reset_data="seed",
                                               env_capacity_retries=1, env_capacity_backoff_s=0.01))
        with pytest.raises(remote.RemoteEnvError) as e:
            await other.reset()
        assert e.value.code is remote.ErrorCode.CAPACITY_REACHED
        await env.close()
    finally:
        server.should_exit = True
        thread.join(timeout=10)
