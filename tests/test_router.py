"""Router mode against the real sgl-router (PyPI `sglang-router`, Rust) in front of two fake SGLang workers.

The router runs as its own process on loopback, launched with its CLI. The two workers are
FakeSGLangServers in this test's event loop (real aiohttp servers on loopback), so every request that
reaches a worker is recorded with its body and headers. Worker k reports weight version "w<k>", which
tells which worker answered a routed /generate. The router's own Prometheus counters (its metrics
port) show which paths went through it.

Three facts about sglang-router 0.3.2 shape the setup:
- It re-serializes /generate bodies and adds five fields (`model`, `background`, `no_logs`,
  `return_bytes`, `return_entropy`). Real SGLang ignores unknown fields; the fake rejects them with a
  400, so the fake accepts them as SGLang does (`ROUTER_ADDED_GENERATE_FIELDS`, asserted below).
- At worker registration it loads the tokenizer named by the worker's `/model_info` `model_path`,
  downloading from the hub when that is not a local dir; the workers report the tiny tokenizer's dir.
- Its CLI offers `--policy` random|round_robin|cache_aware|power_of_two|manual; `consistent_hashing`
  exists in the Rust core but not in the CLI's choices, so that case launches the same CLI parser
  and swaps the policy before starting the router.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest

from rollout import fake_engine
from rollout.client import ROUTING_KEY_HEADER, RetryPolicy, SGLangClient
from rollout.fake_engine import FakeSGLangServer
from rollout.sglang_wire import GENERATE_KEYS

ROUTER_ADDED_GENERATE_FIELDS = frozenset({"model", "background", "no_logs", "return_bytes", "return_entropy"})
ROUTER_START_TIMEOUT_S = 30.0
assert ROUTER_ADDED_GENERATE_FIELDS <= GENERATE_KEYS
CONTROL_PATHS = ("/pause_generation", "/flush_cache", "/update_weights_from_disk", "/continue_generation")
STOP_ID = fake_engine.DEFAULT_EOS_TOKEN_ID
SAMPLING = {"max_new_tokens": 16, "temperature": 1.0, "stop_token_ids": [STOP_ID]}

# The CLI only parses arguments; this swaps in a policy the Rust core has but the CLI's choices lack.
_LAUNCH_WITH_POLICY = (
    "import sys; from sglang_router.launch_router import parse_router_args, launch_router; "
    "policy = sys.argv.pop(1); args = parse_router_args(sys.argv[1:]); args.policy = policy; launch_router(args)"
)


@dataclass
class Fleet:
    router_url: str
    metrics_url: str
    workers: list[FakeSGLangServer]
    process: subprocess.Popen
    log_path: Path

    @property
    def worker_urls(self) -> list[str]:
        return [w.url for w in self.workers]

    def client(self) -> SGLangClient:
        return SGLangClient(self.router_url, worker_urls=self.worker_urls, timeout_s=10.0,
                            retry=RetryPolicy(max_retries=1, backoff_base_s=0.05))

    def log_tail(self, chars: int = 3000) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return re.sub(r"\x1b\[[0-9;]*m", "", text)[-chars:]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _wait_until_ready(fleet: Fleet) -> None:
    """Poll the router's worker list until both workers are registered and healthy, within a bound."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + ROUTER_START_TIMEOUT_S
    last = "no answer yet"
    async with aiohttp.ClientSession() as session:
        while loop.time() < deadline:
            if fleet.process.poll() is not None:
                raise RuntimeError(f"sgl-router exited with code {fleet.process.returncode}:\n{fleet.log_tail()}")
            try:
                async with session.get(fleet.router_url + "/workers", timeout=aiohttp.ClientTimeout(total=2)) as r:
                    data = await r.json(content_type=None) if r.status == 200 else None
                    last = f"HTTP {r.status}: {data}"
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                data, last = None, f"{type(e).__name__}: {e}"
            if isinstance(data, dict):
                healthy = {w.get("url") for w in data.get("workers", []) if w.get("is_healthy")}
                if healthy == set(fleet.worker_urls):
                    return
            await asyncio.sleep(0.2)
    raise TimeoutError(f"sgl-router at {fleet.router_url} not ready within {ROUTER_START_TIMEOUT_S} s "
                       f"(last: {last}):\n{fleet.log_tail()}")


@contextlib.asynccontextmanager
async def router_fleet(tmp_path: Path, tokenizer_dir: Path, policy: str) -> AsyncIterator[Fleet]:
    """Two fake workers plus a real sgl-router process in front of them; everything stopped on exit."""
    workers = [FakeSGLangServer(weight_version=f"w{k}", model_path=str(tokenizer_dir)) for k in range(2)]
    started: list[FakeSGLangServer] = []
    process: subprocess.Popen | None = None
    try:
        for worker in workers:
            started.append(await worker.start())
        port, metrics_port = _free_port(), _free_port()
        router_args = [
            "--worker-urls", *[w.url for w in workers], "--host", "127.0.0.1", "--port", str(port),
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port),  # default: 0.0.0.0:29000
            "--log-level", "warn", "--shutdown-grace-period-secs", "1",
        ]
        if policy == "manual":
            # manual: a new routing key goes to the worker with the fewest keys, then sticks to it.
            cmd = [sys.executable, "-m", "sglang_router.launch_router", *router_args,
                   "--policy", "manual", "--assignment-mode", "min_group"]
        else:
            cmd = [sys.executable, "-c", _LAUNCH_WITH_POLICY, policy, *router_args]
        log_path = tmp_path / "router.log"
        env = {**os.environ, "HF_HUB_OFFLINE": "1"}
        with open(log_path, "wb") as log:
            process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        fleet = Fleet(f"http://127.0.0.1:{port}", f"http://127.0.0.1:{metrics_port}/metrics", workers, process, log_path)
        await _wait_until_ready(fleet)
        yield fleet
    finally:
        if process is not None and process.poll() is None:
            process.terminate()
            try:
                await asyncio.to_thread(process.wait, 10)
            except subprocess.TimeoutExpired:
                process.kill()
                await asyncio.to_thread(process.wait, 10)
        for worker in started:
            await worker.stop()


async def router_counters(fleet: Fleet) -> dict[str, dict[tuple[str, ...], float]]:
    """The router's Prometheus counters: {metric: {label values: count}} for the two we check."""
    async with aiohttp.ClientSession() as session:
        async with session.get(fleet.metrics_url, timeout=aiohttp.ClientTimeout(total=5)) as r:
            assert r.status == 200, f"{fleet.metrics_url}: HTTP {r.status}"
            text = await r.text()
    out: dict[str, dict[tuple[str, ...], float]] = {"smg_http_requests_total": {}, "smg_worker_selection_total": {}}
    for line in text.splitlines():
        m = re.fullmatch(r"(\w+)\{(.*)\}\s+([0-9.eE+-]+)", line.strip())
        if m and m.group(1) in out:
            labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2)))
            key = (labels["method"], labels["path"]) if "path" in labels else (labels.get("policy", ""),)
            out[m.group(1)][key] = out[m.group(1)].get(key, 0.0) + float(m.group(3))
    return out


def _routing_key(headers: dict[str, str]) -> str | None:
    return next((v for k, v in headers.items() if k.lower() == ROUTING_KEY_HEADER.lower()), None)


# ----------------------------------------------------------------------------------------------- tests
async def test_generate_through_the_router_reaches_the_workers(tmp_path, tiny_processing_dir):
    async with router_fleet(tmp_path, tiny_processing_dir, "manual") as fleet:
        async with fleet.client() as client:
            results = [
                await client.generate([7, 8, 100 + k], sampling_params=SAMPLING, rid=f"plain-{k}") for k in range(6)
            ]
        counters = await router_counters(fleet)

    by_rid = {r.body["rid"]: (w, r) for w in fleet.workers for r in w.requests_to("/generate")}
    assert sorted(by_rid) == [f"plain-{k}" for k in range(6)]  # each request reached exactly one worker
    for k, result in enumerate(results):
        worker, request = by_rid[f"plain-{k}"]
        assert request.body["input_ids"] == [7, 8, 100 + k]
        assert request.body["sampling_params"] == SAMPLING
        assert request.body["return_logprob"] is True
        assert result.weight_version == worker.weight_version  # the answer came back from that worker
        assert result.output_ids == [1001, 1002, 1003, STOP_ID] and result.finish_reason == "stop"
        assert result.output_log_probs == [-0.5] * 4
    assert counters["smg_http_requests_total"][("POST", "/generate")] == 6


@pytest.mark.parametrize(("policy", "episodes"), [("manual", 8), ("consistent_hashing", 48)])
async def test_routing_key_keeps_every_turn_of_an_episode_on_one_worker(tmp_path, tiny_processing_dir, policy, episodes):
    turns = 3
    keys = [f"episode-{i}" for i in range(episodes)]
    async with router_fleet(tmp_path, tiny_processing_dir, policy) as fleet:
        async with fleet.client() as client:
            served: dict[str, list[str | None]] = {key: [] for key in keys}
            for turn in range(turns):
                async def one(i: int, key: str) -> None:
                    result = await client.generate([1, i, turn], sampling_params=SAMPLING, routing_key=key,
                                                   rid=f"{key}-t{turn}")
                    served[key].append(result.weight_version)

                if turn == 0:  # new keys one by one, so min_group assignment sees every earlier key
                    for i, key in enumerate(keys):
                        await one(i, key)
                else:  # later turns of all episodes interleave, as in a real rollout
                    await asyncio.gather(*(one(i, key) for i, key in enumerate(keys)))
        counters = await router_counters(fleet)

    assert counters["smg_worker_selection_total"] == {(policy,): float(episodes * turns)}
    for key in keys:
        assert len(served[key]) == turns and len(set(served[key])) == 1, (key, served[key])
    # The worker-side view agrees: every request carried its episode's key, all of a key's requests on one worker.
    seen: dict[str, set[str]] = {}
    for worker in fleet.workers:
        for request in worker.requests_to("/generate"):
            key = _routing_key(request.headers)
            assert key is not None and request.body["rid"].startswith(key + "-t")
            seen.setdefault(key, set()).add(worker.weight_version)
    assert set(seen) == set(keys) and all(len(v) == 1 for v in seen.values())
    # Different episodes spread over both workers.
    assert {served[key][0] for key in keys} == {"w0", "w1"}


async def test_weight_sync_sends_control_calls_to_each_worker_directly(tmp_path, tiny_processing_dir):
    weights = tmp_path / "weights_v000001"
    weights.mkdir()
    async with router_fleet(tmp_path, tiny_processing_dir, "manual") as fleet:
        async with fleet.client() as client:
            before = await router_counters(fleet)
            answers = await client.sync_weights_from_disk(str(weights), "1")
            after = await router_counters(fleet)
            versions = await client.get_weight_versions()
            routed = [await client.generate([5, k], sampling_params=SAMPLING, routing_key=f"after-sync-{k}")
                      for k in range(4)]

    assert set(answers) == set(fleet.worker_urls) and all(a["success"] for a in answers.values())
    for worker in fleet.workers:
        control = [r for r in worker.requests if r.path in CONTROL_PATHS]
        assert [r.path for r in control] == list(CONTROL_PATHS), worker.url
        assert control[0].body == {"mode": "abort"}
        assert control[2].body == {"model_path": str(weights), "weight_version": "1"}
        assert worker.paused is None and worker.model_path == str(weights)
    # None of them went through the router (it has a fan-out /flush_cache of its own that must stay unused).
    requests_through_router = {path for (_method, path) in after["smg_http_requests_total"]}
    assert not requests_through_router & set(CONTROL_PATHS)
    assert after["smg_http_requests_total"] == before["smg_http_requests_total"]
    assert versions == {url: "1" for url in fleet.worker_urls}
    assert {r.weight_version for r in routed} == {"1"}
