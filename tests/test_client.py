"""SGLangClient against the scripted fake SGLang server, over real loopback HTTP.

Every test speaks the wire format through a real socket: the fake server records what it received,
so the tests check both what the client sent and how it read the answer.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rollout.client import (
    ROUTING_KEY_HEADER,
    EngineRequestError,
    EngineResponseError,
    EngineUnavailable,
    RetryPolicy,
    SGLangClient,
    WeightSyncError,
    backoff_delay,
)
from rollout.fake_engine import Abort, Delay, Drop, FakeSGLangServer, Hang, Respond, Tokens, bad_request

REPO = Path(__file__).resolve().parents[1]
FAST = RetryPolicy(max_retries=2, backoff_base_s=0.001, backoff_max_s=0.01)
PARAMS = {"max_new_tokens": 16, "temperature": 1.0, "stop_token_ids": [151645], "no_stop_trim": True}
PAD, VSTART, VEND = 151655, 151652, 151653


def client_for(url: str, **kw) -> SGLangClient:
    kw.setdefault("retry", FAST)
    return SGLangClient(url, seed=0, **kw)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def until(predicate, timeout_s: float = 2.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.005)


@pytest.fixture
async def srv():
    async with FakeSGLangServer() as server:
        yield server


# ---- parsing each finish-reason shape -----------------------------------------------------------


async def test_stop_token_answer_and_request_body(srv):
    async with client_for(srv.url) as client:
        res = await client.generate([1, 2, 3], sampling_params=PARAMS, rid="ep1-t0")
    # default fake engine: 1001 1002 1003 then the first stop id, each at logprob -0.5
    assert res.output_ids == [1001, 1002, 1003, 151645]
    assert res.output_log_probs == [-0.5] * 4
    assert (res.finish_reason, res.finish_matched) == ("stop", 151645)
    assert (res.prompt_tokens, res.cached_tokens, res.weight_version, res.rid) == (3, 0, "default", "ep1-t0")
    assert res.e2e_latency is not None and res.e2e_latency >= 0
    assert (res.retries, res.retry_errors) == (0, [])
    [req] = srv.requests_to("/generate")
    assert req.method == "POST"
    assert req.body == {"rid": "ep1-t0", "input_ids": [1, 2, 3], "sampling_params": PARAMS, "return_logprob": True}
    assert ROUTING_KEY_HEADER not in req.headers


async def test_stop_string_answer():
    finish = {"type": "stop", "matched": "</answer>"}
    script = [Tokens((11, 12, 13), log_probs=(-0.1, -0.2, -0.3), finish_reason=finish, text="24</answer>")]
    async with FakeSGLangServer(script=script) as srv, client_for(srv.url) as client:
        res = await client.generate([5], sampling_params=PARAMS)
    assert res.output_ids == [11, 12, 13]
    assert res.output_log_probs == pytest.approx([-0.1, -0.2, -0.3])
    assert (res.finish_reason, res.finish_matched, res.text) == ("stop", "</answer>", "24</answer>")


async def test_length_answer(srv):
    async with client_for(srv.url) as client:
        res = await client.generate([5, 6], sampling_params={**PARAMS, "max_new_tokens": 2})
    assert res.output_ids == [1001, 1002] and len(res.output_log_probs) == 2
    assert (res.finish_reason, res.finish_matched) == ("length", None)
    assert res.meta_info["finish_reason"] == {"type": "length", "length": 2}


async def test_abort_answer_keeps_partial_output():
    async with FakeSGLangServer(script=[Abort("engine restarting", output_ids=(9, 8))]) as srv:
        async with client_for(srv.url) as client:
            res = await client.generate([5], sampling_params=PARAMS)
    assert (res.finish_reason, res.finish_matched, res.finish_message) == ("abort", None, "engine restarting")
    assert res.output_ids == [9, 8] and res.retries == 0


async def test_without_logprobs_ids_come_from_output_ids(srv):
    async with client_for(srv.url) as client:
        res = await client.generate([5], sampling_params=PARAMS, return_logprob=False)
    assert res.output_ids == [1001, 1002, 1003, 151645] and res.output_log_probs is None
    assert "output_token_logprobs" not in res.meta_info


async def test_ids_disagreeing_with_logprob_ids_is_an_error_not_retried():
    meta = {"id": "x", "finish_reason": {"type": "stop", "matched": 2}, "prompt_tokens": 1,
            "output_token_logprobs": [[-0.1, 1, None], [-0.2, 3, None]]}
    async with FakeSGLangServer(script=[Respond(200, {"text": "", "output_ids": [1, 2], "meta_info": meta})]) as srv:
        async with client_for(srv.url) as client:
            with pytest.raises(EngineResponseError, match="disagree.*index 1"):
                await client.generate([5], sampling_params=PARAMS)
    assert len(srv.requests_to("/generate")) == 1


@pytest.mark.parametrize("body, needle", [
    ({"text": "hi"}, "meta_info"),
    ([{"text": "a"}], "batch"),
    ({"text": "", "meta_info": {"finish_reason": {"type": "done"}, "prompt_tokens": 1}}, "finish_reason"),
    ({"text": "", "output_ids": [1], "meta_info": {"finish_reason": {"type": "stop", "matched": 1},
      "prompt_tokens": 1, "output_token_logprobs": [[None, 1, None]]}}, r"output_token_logprobs\[0\]"),
])
async def test_malformed_answers_name_the_problem(body, needle):
    async with FakeSGLangServer(script=[Respond(200, body)]) as srv, client_for(srv.url) as client:
        with pytest.raises(EngineResponseError, match=needle) as info:
            await client.generate([5], sampling_params=PARAMS)
    assert srv.url + "/generate" in str(info.value)


async def test_images_are_sent_and_pads_expanded_in_prompt_tokens():
    images = ["data:image/png;base64,AAAA", "data:image/png;base64,BBBB"]
    ids = [151644, VSTART, PAD, VEND, 10, VSTART, PAD, VEND, 11]
    async with FakeSGLangServer(tokens_per_image=64) as srv, client_for(srv.url) as client:
        res = await client.generate(ids, image_data=images, sampling_params=PARAMS)
        assert res.prompt_tokens == len(ids) - 2 + 2 * 64
        assert srv.requests_to("/generate")[0].body["image_data"] == images
        with pytest.raises(EngineRequestError, match="image count mismatch") as info:
            await client.generate(ids, image_data=images[:1], sampling_params=PARAMS)
    assert info.value.status == 400 and info.value.attempts == 1
    assert len(srv.requests_to("/generate")) == 2


# ---- retries and errors ------------------------------------------------------------------------


async def test_503_twice_then_success_records_both_retries():
    async with FakeSGLangServer(script=[Respond(503, "overloaded"), Respond(503, "overloaded")]) as srv:
        async with client_for(srv.url) as client:
            res = await client.generate([1], sampling_params=PARAMS, rid="r")
    assert res.retries == 2 and len(res.retry_errors) == 2
    assert all("HTTP 503" in e and "overloaded" in e for e in res.retry_errors)
    assert res.output_ids[-1] == 151645
    # each attempt gets its own rid so the engine never sees a duplicate id
    assert [r.body["rid"] for r in srv.requests_to("/generate")] == ["r", "r.retry1", "r.retry2"]
    assert res.rid == "r.retry2"


async def test_400_raises_at_once_with_the_servers_error():
    async with FakeSGLangServer(script=[bad_request("max_new_tokens must be at least 0")]) as srv:
        async with client_for(srv.url) as client:
            with pytest.raises(EngineRequestError) as info:
                await client.generate([1], sampling_params=PARAMS)
    err = info.value
    assert (err.status, err.attempts, err.endpoint) == (400, 1, srv.url + "/generate")
    assert "HTTP 400" in str(err) and "max_new_tokens must be at least 0" in str(err) and srv.url in str(err)
    assert len(srv.requests_to("/generate")) == 1


async def test_unknown_sampling_key_is_rejected_by_the_fake(srv):
    async with client_for(srv.url) as client:
        with pytest.raises(EngineRequestError, match="max_tokens"):
            await client.generate([1], sampling_params={"max_tokens": 4})
    assert len(srv.requests_to("/generate")) == 1


async def test_hang_times_out_retries_then_gives_up():
    async with FakeSGLangServer(script=[Hang(), Hang(), Hang()]) as srv:
        async with client_for(srv.url, timeout_s=0.2) as client:
            t0 = time.monotonic()
            with pytest.raises(EngineUnavailable) as info:
                await client.generate([1], sampling_params=PARAMS, rid="h")
            elapsed = time.monotonic() - t0
        err = info.value
        assert err.attempts == 3 and err.status is None and len(err.errors) == 3
        assert all("timeout after 0.2 s" in e for e in err.errors)
        assert srv.url + "/generate" in str(err)
        assert 0.6 <= elapsed < 2.0
        # the server saw each timed-out client go away, as SGLang aborts on disconnect
        await until(lambda: srv.num_in_flight == 0)
        assert sorted(srv.disconnected_rids) == ["h", "h.retry1", "h.retry2"]


async def test_timeout_then_success():
    async with FakeSGLangServer(script=[Hang()]) as srv, client_for(srv.url, timeout_s=0.2) as client:
        res = await client.generate([1], sampling_params=PARAMS)
    assert res.retries == 1 and "timeout" in res.retry_errors[0] and res.finish_reason == "stop"


async def test_dropped_connection_is_retried():
    async with FakeSGLangServer(script=[Drop()]) as srv, client_for(srv.url) as client:
        res = await client.generate([1], sampling_params=PARAMS)
    assert res.retries == 1 and "ServerDisconnected" in res.retry_errors[0]
    assert len(srv.requests_to("/generate")) == 2 and res.finish_reason == "stop"


async def test_5xx_until_retries_run_out():
    async with FakeSGLangServer(script=[Respond(500, "kaboom")] * 3) as srv, client_for(srv.url) as client:
        with pytest.raises(EngineUnavailable) as info:
            await client.generate([1], sampling_params=PARAMS)
    assert (info.value.status, info.value.attempts, info.value.body) == (500, 3, "kaboom")
    assert "HTTP 500" in str(info.value) and "kaboom" in str(info.value)
    assert len(srv.requests_to("/generate")) == 3


async def test_unreachable_port_fails_fast_naming_the_url():
    url = f"http://127.0.0.1:{free_port()}"
    async with client_for(url, timeout_s=5.0, connect_timeout_s=1.0) as client:
        t0 = time.monotonic()
        with pytest.raises(EngineUnavailable) as info:
            await client.generate([1], sampling_params=PARAMS)
        assert time.monotonic() - t0 < 2.0
        assert url + "/generate" in str(info.value) and info.value.attempts == 3
        assert "no HTTP response" in str(info.value)
        assert await client.health() is False
        with pytest.raises(EngineUnavailable, match="not healthy within"):
            await client.wait_healthy(timeout_s=0.2, poll_interval_s=0.02)


def test_backoff_is_exponential_capped_and_jittered():
    policy = RetryPolicy(max_retries=7, backoff_base_s=0.5, backoff_max_s=4.0, jitter=0.5)
    rng = random.Random(1)
    for k in range(7):
        cap = min(4.0, 0.5 * 2**k)
        delays = [backoff_delay(policy, k, rng) for _ in range(50)]
        assert all(cap * 0.5 <= d <= cap for d in delays)
        assert max(delays) - min(delays) > 0.1 * cap  # jitter actually spreads them
    exact = RetryPolicy(backoff_base_s=0.25, backoff_max_s=10.0, jitter=0.0)
    assert [backoff_delay(exact, k, rng) for k in range(4)] == [0.25, 0.5, 1.0, 2.0]
    with pytest.raises(ValueError, match="max_retries"):
        RetryPolicy(max_retries=-1)


# ---- concurrency -------------------------------------------------------------------------------


async def test_256_concurrent_generates_share_one_pool():
    limit = 16
    async with FakeSGLangServer(latency_s=0.005) as srv:
        async with client_for(srv.url, max_connections=limit) as client:
            session = client._get_session()
            results = await asyncio.gather(*(
                client.generate([i, i + 1], sampling_params=PARAMS, rid=f"c{i}") for i in range(256)
            ))
            assert client._get_session() is session and client.sessions_created == 1
    assert [r.rid for r in results] == [f"c{i}" for i in range(256)]
    assert all(r.finish_reason == "stop" and r.prompt_tokens == 2 and r.retries == 0 for r in results)
    peers = {r.peer for r in srv.requests_to("/generate")}
    assert len(srv.requests_to("/generate")) == 256
    # at most `limit` sockets carried all 256 requests: connections were pooled and reused
    assert 1 <= len(peers) <= limit


# ---- router mode -------------------------------------------------------------------------------


async def test_router_mode_header_and_control_calls_go_to_workers(tmp_path):
    weights = tmp_path / "weights_v000003"
    weights.mkdir()
    async with FakeSGLangServer() as router, FakeSGLangServer() as w1, FakeSGLangServer() as w2:
        async with client_for(router.url, worker_urls=[w1.url, w2.url]) as client:
            await client.wait_healthy(timeout_s=2.0)
            await client.generate([1], sampling_params=PARAMS, routing_key="episode-7")
            await client.generate([1], sampling_params=PARAMS)
            with pytest.raises(ValueError, match="pass url="):
                await client.get_model_info()
            answers = await client.sync_weights_from_disk(str(weights), "3", flush_poll_s=0.001)
            versions = await client.get_weight_versions()
            assert (await client.get_model_info(url=w2.url))["model_path"] == str(weights)
    keyed, plain = router.requests_to("/generate")
    assert keyed.headers[ROUTING_KEY_HEADER] == "episode-7" and ROUTING_KEY_HEADER not in plain.headers
    assert set(router.paths) == {"/generate"}  # no control call went through the router
    sync = ["/pause_generation", "/flush_cache", "/update_weights_from_disk", "/continue_generation"]
    for worker in (w1, w2):
        assert [p for p in worker.paths if p in sync] == sync
        assert "/generate" not in worker.paths
    assert set(answers) == {w1.url, w2.url} and all(a["success"] for a in answers.values())
    assert versions == {w1.url: "3", w2.url: "3"}


async def test_router_sync_reports_the_failing_worker_and_continues_all(tmp_path):
    async with FakeSGLangServer() as w1, FakeSGLangServer() as w2:
        w2.enqueue(Respond(400, {"success": False, "message": "disk full"}), path="/update_weights_from_disk")
        async with client_for(w1.url, worker_urls=[w1.url, w2.url]) as client:
            with pytest.raises(WeightSyncError, match="disk full") as info:
                await client.sync_weights_from_disk(str(tmp_path), "4", flush_poll_s=0.001)
    assert set(info.value.failures) == {w2.url}
    assert w1.weight_version == "4" and w2.weight_version == "default"
    for worker in (w1, w2):
        assert worker.paths[-1] == "/continue_generation" and worker.paused is None


# ---- weight sync ---------------------------------------------------------------------------------


async def test_sync_order_with_flush_retried_while_busy(tmp_path):
    weights = tmp_path / "weights_v000001"
    weights.mkdir()
    async with FakeSGLangServer(flush_busy_calls=2) as srv, client_for(srv.url) as client:
        answers = await client.sync_weights_from_disk(str(weights), "1", flush_poll_s=0.001)
        assert srv.paths == ["/pause_generation", "/flush_cache", "/flush_cache", "/flush_cache",
                             "/update_weights_from_disk", "/continue_generation"]
        assert srv.requests_to("/pause_generation")[0].body == {"mode": "abort"}
        assert srv.requests_to("/update_weights_from_disk")[0].body == {"model_path": str(weights),
                                                                        "weight_version": "1"}
        assert answers[srv.url]["success"] is True and srv.paused is None
        assert await client.get_weight_version() == "1"
        assert (await client.generate([1], sampling_params=PARAMS)).weight_version == "1"


async def test_sync_update_failure_raises_and_still_continues(tmp_path):
    missing = tmp_path / "never_written"
    async with FakeSGLangServer() as srv, client_for(srv.url) as client:
        with pytest.raises(WeightSyncError, match="success=false") as info:
            await client.sync_weights_from_disk(str(missing), "2", flush_poll_s=0.001)
    assert str(missing) in str(info.value) and srv.url in str(info.value)
    assert srv.paths == ["/pause_generation", "/flush_cache", "/update_weights_from_disk", "/continue_generation"]
    assert srv.paused is None and srv.weight_version == "default"


async def test_sync_flush_busy_past_deadline_fails_without_updating(tmp_path):
    async with FakeSGLangServer(flush_busy_calls=10**9) as srv, client_for(srv.url) as client:
        t0 = time.monotonic()
        with pytest.raises(WeightSyncError, match="flush_cache still busy") as info:
            await client.sync_weights_from_disk(str(tmp_path), "2", flush_timeout_s=0.1, flush_poll_s=0.01)
        assert time.monotonic() - t0 < 1.0
    assert srv.url in str(info.value)
    assert "/update_weights_from_disk" not in srv.paths
    assert srv.paths.count("/flush_cache") >= 2 and srv.paths[-1] == "/continue_generation"
    assert srv.paused is None


async def test_cancelled_sync_still_resumes_the_engine(tmp_path):
    async with FakeSGLangServer(flush_busy_calls=10**9) as srv, client_for(srv.url) as client:
        task = asyncio.create_task(client.sync_weights_from_disk(str(tmp_path), "7", flush_poll_s=0.01))
        await until(lambda: srv.paths.count("/flush_cache") >= 2)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert srv.paths[-1] == "/continue_generation" and srv.paused is None
        with pytest.raises(ValueError, match="pause mode"):
            await client.sync_weights_from_disk(str(tmp_path), "7", pause_mode="hold")


async def test_sync_during_generation_aborts_it_then_loads(tmp_path):
    async with FakeSGLangServer(script=[Hang()]) as srv, client_for(srv.url) as client:
        pending = asyncio.create_task(client.generate([1], sampling_params=PARAMS, rid="long"))
        await until(lambda: srv.num_in_flight == 1)
        await client.sync_weights_from_disk(str(tmp_path), "5", flush_poll_s=0.001)
        res = await pending
    assert (res.finish_reason, res.output_ids) == ("abort", []) and "pause" in res.finish_message
    assert srv.weight_version == "5"


async def test_pause_in_place_keeps_requests_so_flush_stays_busy(tmp_path):
    async with FakeSGLangServer(script=[Hang()]) as srv, client_for(srv.url) as client:
        pending = asyncio.create_task(client.generate([1], sampling_params=PARAMS, rid="kept"))
        await until(lambda: srv.num_in_flight == 1)
        with pytest.raises(WeightSyncError, match="flush_cache still busy"):
            await client.sync_weights_from_disk(str(tmp_path), "6", pause_mode="in_place", flush_timeout_s=0.05,
                                                flush_poll_s=0.01)
        assert not pending.done()
        await client.abort_request(rid="kept")
        assert (await pending).finish_reason == "abort"


# ---- control endpoints -------------------------------------------------------------------------


async def test_abort_request_by_rid_ends_a_hanging_generate(srv):
    srv.enqueue(Hang(), Hang())
    async with client_for(srv.url) as client:
        a = asyncio.create_task(client.generate([1], sampling_params=PARAMS, rid="a"))
        b = asyncio.create_task(client.generate([1], sampling_params=PARAMS, rid="b"))
        await until(lambda: srv.num_in_flight == 2)
        await client.abort_request(rid="a")
        assert (await a).finish_reason == "abort"
        assert not b.done()
        await client.abort_all(timeout_s=2.0, retry_interval_s=0.01)
        assert (await b).finish_reason == "abort"
        loads = await client.get_loads()
    assert loads["loads"][0]["num_running_reqs"] == 0
    assert srv.requests_to("/abort_request")[0].body == {"rid": "a"}
    assert {"abort_all": True} in [r.body for r in srv.requests_to("/abort_request")]
    with pytest.raises(ValueError, match="exactly one"):
        await client.abort_request()


async def test_generate_waits_while_paused_until_continue(srv):
    async with client_for(srv.url) as client:
        await client.pause_generation("retract")
        pending = asyncio.create_task(client.generate([1], sampling_params=PARAMS))
        await until(lambda: srv.num_in_flight == 1)
        loads = await client.get_loads()
        assert (loads["loads"][0]["num_waiting_reqs"], loads["loads"][0]["num_running_reqs"]) == (1, 0)
        assert not pending.done()
        await client.continue_generation()
        assert (await pending).finish_reason == "stop"
        with pytest.raises(ValueError, match="pause mode"):
            await client.pause_generation("stop")


async def test_health_and_info_with_endpoint_fallbacks():
    async with FakeSGLangServer(disabled_paths={"/health_generate", "/model_info", "/server_info"},
                                model_path="/ckpt/qwen3vl") as srv:
        async with client_for(srv.url) as client:
            assert await client.health() is True
            assert srv.paths == ["/health_generate", "/health"]
            info = await client.get_model_info()
            server_info = await client.get_server_info()
            assert await client.flush_cache() is True
            srv.healthy = False
            assert await client.health() is False
            with pytest.raises(EngineUnavailable, match="not healthy within") as err:
                await client.wait_healthy(timeout_s=0.1, poll_interval_s=0.02)
    assert (info["model_path"], info["weight_version"], info["is_generation"]) == ("/ckpt/qwen3vl", "default", True)
    assert "/get_model_info" in srv.paths and "/get_server_info" in srv.paths
    assert server_info["version"] and "internal_states" in server_info
    assert srv.url in str(err.value)


async def test_control_5xx_is_retried_and_4xx_is_not(srv):
    srv.enqueue(Respond(503), path="/continue_generation")
    srv.enqueue(Respond(404, {"detail": "Not Found"}), path="/pause_generation")
    async with client_for(srv.url) as client:
        assert (await client.continue_generation())["status"] == "ok"
        with pytest.raises(EngineRequestError, match="Not Found") as info:
            await client.pause_generation()
    assert srv.paths == ["/continue_generation", "/continue_generation", "/pause_generation"]
    assert info.value.endpoint == srv.url + "/pause_generation"


async def test_delayed_control_answer_times_out(srv):
    srv.enqueue(*[Delay(1.0)] * 3, path="/model_info")  # the version lives in /model_info (SGLang 0.5.23)
    async with client_for(srv.url, control_timeout_s=0.1) as client:
        with pytest.raises(EngineUnavailable, match="timeout after 0.1 s"):
            await client.get_weight_version()


# ---- packaging -------------------------------------------------------------------------------


async def test_standalone_process_serves_the_wire_format():
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "rollout.fake_engine", "--port", str(port),
                             "--response-ids", "7", "8"], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        async with client_for(f"http://127.0.0.1:{port}") as client:
            await client.wait_healthy(timeout_s=20.0, poll_interval_s=0.05)
            res = await client.generate([1, 2], sampling_params={"max_new_tokens": 8, "stop_token_ids": [99]})
        assert (res.output_ids, res.finish_matched) == ([7, 8, 99], 99)
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=10)
    assert proc.returncode == 0 and f"127.0.0.1:{port}" in out


def test_rollout_modules_do_not_import_jax():
    code = "import sys, rollout.client, rollout.fake_engine; assert 'jax' not in sys.modules, 'jax imported'"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, check=True)
