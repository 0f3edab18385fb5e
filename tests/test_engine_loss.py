"""An engine that dies and comes back, and a router worker that dies (issue 35, items 1 and 4).

Against the scripted fake SGLang server: while the engine is unreachable no /generate is sent (the server counts
them), the requests the loss cut are re-sent once it is back, the trainer's weights are pushed again before any of
them, and an engine that does not come back fails the waiting requests with `EngineLost` naming the URL and the wait.
A router worker that no control call reaches is dropped under `--allow-worker-loss` and stops the run otherwise.
The end-to-end test (`kill -9` of `jaxrl-vlm serve` mid-run, restart on the same port) is at the end.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from _launch import xla_flags

from rollout.client import RetryPolicy, SGLangClient, WorkerLost
from rollout.engine_link import EngineLost, LinkState
from rollout.fake_engine import Drop, FakeSGLangServer, Hang

FAST = RetryPolicy(max_retries=2, backoff_base_s=0.001, backoff_max_s=0.01)
PARAMS = {"max_new_tokens": 16, "stop_token_ids": [151645]}
ROOT = Path(__file__).resolve().parents[1]


async def until(predicate, timeout_s: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"{what} not reached within {timeout_s} s"
        await asyncio.sleep(0.01)


def linked_client(url: str, timeout_s: float = 10.0, **kw) -> SGLangClient:
    return SGLangClient(url, retry=FAST, seed=0, reconnect_timeout_s=timeout_s, **kw)


class Restores:
    """A stand-in for the job's return hook: counts calls, says it pushed the weights."""

    def __init__(self) -> None:
        self.calls = 0

    async def __call__(self) -> bool:
        self.calls += 1
        return True


async def test_no_generate_is_sent_while_the_engine_is_down_and_cut_requests_are_resent():
    async with FakeSGLangServer() as srv:
        async with linked_client(srv.url) as client:
            restores = Restores()
            client.link.arm(restores)
            srv.enqueue(*[Hang()] * 4)
            in_flight = [asyncio.ensure_future(client.generate([1, 2], sampling_params=PARAMS)) for _ in range(4)]
            await until(lambda: srv.num_in_flight == 4, what="4 requests in flight")
            srv.take_down()  # the engine crashes under them
            await until(lambda: client.link.state is LinkState.DOWN, what="link down")
            sent_at_loss = len(srv.requests_to("/generate"))
            later = [asyncio.ensure_future(client.generate([3], sampling_params=PARAMS)) for _ in range(3)]
            # Probed while down (with backoff), but no /generate reaches the engine.
            await until(lambda: len(srv.requests_to("/health_generate")) >= 3, what="3 health probes")
            assert len(srv.requests_to("/generate")) == sent_at_loss == 4
            assert not any(t.done() for t in in_flight + later)
            srv.bring_back()
            results = await asyncio.wait_for(asyncio.gather(*in_flight, *later), 10)
    assert all(r.finish_reason.value == "stop" and r.output_ids for r in results)
    assert restores.calls == 1
    assert len(srv.requests_to("/generate")) == 4 + 4 + 3  # the 4 cut requests once more, the 3 held ones once
    metrics = client.link.metrics()
    assert metrics["engine/outages"] == 1 and metrics["engine/requests_resent"] == 4
    assert metrics["engine/weight_restores"] == 1 and metrics["engine/outage_seconds"] > 0
    # A re-sent request carries a rid of its own (the engine may still hold the old one for a moment).
    rids = [r.body["rid"] for r in srv.requests_to("/generate")]
    assert len(set(rids)) == len(rids)


async def test_an_engine_restarted_on_the_same_port_serves_the_cut_request_again():
    first = await FakeSGLangServer([Hang()]).start()
    port = first.port
    async with linked_client(first.url) as client:
        client.link.arm(Restores())
        pending = asyncio.ensure_future(client.generate([1], sampling_params=PARAMS))
        await until(lambda: first.num_in_flight == 1, what="request in flight")
        first.take_down()  # it crashes: the request's connection is reset...
        await first.stop()  # ...and then connections are refused
        await until(lambda: client.link.state is LinkState.DOWN, what="link down")
        async with FakeSGLangServer(port=port) as second:
            result = await asyncio.wait_for(pending, 10)
            assert result.output_ids and len(second.requests_to("/generate")) == 1
    assert client.link.outages[0].recovered


async def test_an_engine_that_does_not_return_fails_the_waiting_requests_naming_url_and_wait():
    server = await FakeSGLangServer([Hang()]).start()
    url = server.url
    async with linked_client(url, timeout_s=0.6) as client:
        client.link.arm(Restores())
        pending = asyncio.ensure_future(client.generate([1], sampling_params=PARAMS))
        await until(lambda: server.num_in_flight == 1, what="request in flight")
        server.take_down()
        await server.stop()
        with pytest.raises(EngineLost, match=rf"engine at {url} lost: not back after waiting 0\.\d s "
                                             r"\(--engine-reconnect-timeout 0\.6\)"):
            await asyncio.wait_for(pending, 10)
        with pytest.raises(EngineLost):  # later requests fail at once, and the owner can ask
            await client.generate([1], sampling_params=PARAMS)
        with pytest.raises(EngineLost, match=url):
            client.link.raise_if_failed()
    assert client.link.state is LinkState.FAILED


async def test_the_restore_pushes_the_trainers_weights_before_any_request_is_resent(tmp_path):
    from jaxrl_vlm.weight_sync import SyncReport, WeightSyncer

    weights = tmp_path / "weights_v000003"
    weights.mkdir()
    async with FakeSGLangServer(weight_version="3") as srv:
        async with linked_client(srv.url) as client:
            syncer = WeightSyncer(client, tmp_path, flush_poll_s=0.01)
            syncer.history.append(SyncReport(3, weights, 0.0, 0.0, 0, 1))
            client.link.arm(syncer.restore)
            # A blip: the engine answers again with the weights it had -> nothing is pushed.
            srv.enqueue(Hang())
            first = asyncio.ensure_future(client.generate([1], sampling_params=PARAMS))
            await until(lambda: srv.num_in_flight == 1, what="request in flight")
            srv.take_down()
            await until(lambda: client.link.state is LinkState.DOWN, what="link down")
            srv.bring_back(weight_version="3")
            await asyncio.wait_for(first, 10)
            assert srv.requests_to("/update_weights_from_disk") == []
            # A restart: the engine came back with its initial weights -> version 3 pushed and confirmed first.
            srv.enqueue(Hang())
            second = asyncio.ensure_future(client.generate([2], sampling_params=PARAMS))
            await until(lambda: srv.num_in_flight == 1, what="request in flight")
            srv.take_down()
            await until(lambda: client.link.state is LinkState.DOWN, what="link down")
            cut = len(srv.requests)
            srv.bring_back(weight_version="default")
            result = await asyncio.wait_for(second, 10)
    after = [r.path for r in srv.requests[cut:] if not r.path.startswith("/health")]
    assert after.index("/update_weights_from_disk") < after.index("/generate"), after
    assert srv.requests_to("/update_weights_from_disk")[0].body["model_path"] == str(weights)
    assert srv.weight_version == "3" and result.weight_version == "3"
    assert [o.weights_restored for o in client.link.outages] == [False, True]


async def test_a_weight_load_cut_by_the_loss_waits_for_the_engine_and_is_pushed_once_on_return(tmp_path):
    from jaxrl_vlm.weight_sync import SyncReport, WeightSyncer

    old, new = tmp_path / "weights_v000003", tmp_path / "weights_v000004"
    old.mkdir(), new.mkdir()
    async with FakeSGLangServer(weight_version="3") as srv:
        async with linked_client(srv.url) as client:
            syncer = WeightSyncer(client, tmp_path, flush_poll_s=0.01, retry_wait_s=0.01)
            syncer.history.append(SyncReport(3, old, 0.0, 0.0, 0, 1))
            client.link.arm(syncer.restore)
            srv.take_down()  # the engine dies while the trainer trains: the sync's /pause_generation meets it
            load = asyncio.ensure_future(syncer.load(SyncReport(4, new, 0.0, 0.0, 0, 0)))
            await until(lambda: len(srv.requests_to("/health_generate")) >= 2, what="2 health probes")
            assert not load.done() and client.link.state is LinkState.DOWN
            srv.bring_back()
            report = await asyncio.wait_for(load, 10)
    updates = srv.requests_to("/update_weights_from_disk")
    assert [u.body["model_path"] for u in updates] == [str(new)]  # the version being loaded, pushed once
    assert srv.weight_version == "4" and syncer.restored_version == 4 and report.attempts == 1


@pytest.mark.parametrize("allow", [True, False])
async def test_a_dead_router_worker_is_dropped_when_allowed_and_stops_the_run_otherwise(tmp_path, allow):
    async with FakeSGLangServer() as router, FakeSGLangServer() as w1:
        w2 = await FakeSGLangServer().start()
        dead = w2.url
        await w2.stop()  # the worker died: connections refused
        async with SGLangClient(router.url, worker_urls=[w1.url, dead], retry=FAST, seed=0,
                                allow_worker_loss=allow) as client:
            if allow:
                answers = await client.sync_weights_from_disk(str(tmp_path), "5", flush_poll_s=0.001)
                assert set(answers) == {w1.url} and client.worker_urls == [w1.url]
                assert [loss.url for loss in client.lost_workers] == [dead]
                assert "/pause_generation" in client.lost_workers[0].during
                assert await client.get_weight_versions() == {w1.url: "5"}
            else:
                with pytest.raises(WorkerLost, match=rf"router worker {dead} is unreachable during the weight update"
                                                     r".*--allow-worker-loss"):
                    await client.sync_weights_from_disk(str(tmp_path), "5", flush_poll_s=0.001)
                with pytest.raises(WorkerLost, match=rf"{dead} .*weight version check"):
                    await client.get_weight_versions()
                assert client.worker_urls == [w1.url, dead]
    assert w1.paths[-1] in ("/continue_generation", "/model_info") and w1.paused is None


async def test_the_last_router_worker_is_never_dropped(tmp_path):
    async with FakeSGLangServer() as router:
        w = await FakeSGLangServer().start()
        dead = w.url
        await w.stop()
        async with SGLangClient(router.url, worker_urls=[dead], retry=FAST, allow_worker_loss=True) as client:
            with pytest.raises(WorkerLost, match="it is the last worker"):
                await client.get_weight_versions()


# ---- end to end: kill -9 of `jaxrl-vlm serve` mid-run, restarted on the same port --------------------------------


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict[str, str]:
    """One CPU device, and this tree's code in every process."""
    return {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": xla_flags(1), "PYTHONPATH": str(ROOT)}


def _serve(model: Path, port: int, log: Path) -> subprocess.Popen:
    with open(log, "ab") as out:
        return subprocess.Popen([sys.executable, "-m", "jaxrl_vlm.cli", "serve", "--model", str(model), "--port",
                                 str(port), "--max-batch", "2", "--max-seq-len", "256"],
                                cwd=ROOT, env=_env(), stdout=out, stderr=subprocess.STDOUT)


def _get(url: str) -> dict | None:
    try:
        with urllib.request.urlopen(url, timeout=2) as reply:
            return json.loads(reply.read())
    except OSError:
        return None


def _busy(url: str) -> int:
    """Requests running or waiting in the engine (0 when it does not answer)."""
    loads = _get(url + "/v1/loads?include=core")
    return sum(r["num_running_reqs"] + r["num_waiting_reqs"] for r in loads["loads"]) if loads else 0


def _steps(metrics: Path) -> list[dict]:
    if not metrics.exists():
        return []
    return [r for r in map(json.loads, metrics.read_text().splitlines()) if "rollout/samples" in r]


@pytest.mark.slow
@pytest.mark.ci_step  # CI's own step for long tests (.ci/run), not the README's test command: see pyproject.toml
def test_a_run_survives_kill_9_of_its_engine_and_a_restart_on_the_same_port(tmp_path):
    """The acceptance test of issue 35 item 1: every step trains its full batch, the weights are pushed and confirmed
    on the restarted engine, and no episode is lost or FAILED by anything but `engine_lost`."""
    from jaxrl_vlm.tiny import make_tiny

    model = make_tiny(tmp_path / "model", seed=3)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"problem": f"Q{i}", "answer": "x", "images": []}) + "\n" for i in range(8)))
    port = _free_port()  # chosen by the OS, reused for the restart
    url = f"http://127.0.0.1:{port}"
    out = tmp_path / "run"
    steps, batch, n = 3, 2, 4
    procs: list[subprocess.Popen] = [_serve(model, port, tmp_path / "serve.log")]
    try:
        deadline = time.monotonic() + 180
        while _get(url + "/model_info") is None:
            assert procs[0].poll() is None and time.monotonic() < deadline, (tmp_path / "serve.log").read_text()[-3000:]
            time.sleep(0.2)
        with open(tmp_path / "train.log", "wb") as log:
            train = subprocess.Popen([
                sys.executable, "-m", "jaxrl_vlm.cli", "train", "--hf-checkpoint", str(model), "--prompt-data",
                str(prompts), "--prompt-style", "plain", "--rollout-interaction-env-path", "envs.letter_game",
                "--engine-url", url, "--engine-reconnect-timeout", "240", "--num-rollout", str(steps),
                "--rollout-batch-size", str(batch), "--n-samples-per-prompt", str(n), "--rollout-max-response-len",
                "24", "--seq-buckets", "128", "--row-buckets", "8", "--patch-buckets", "0", "--output-dir", str(out),
                "--save-interval", "100"], cwd=ROOT, env=_env(), stdout=log, stderr=subprocess.STDOUT)
        procs.append(train)

        def train_log() -> str:
            return (tmp_path / "train.log").read_text(errors="replace")[-4000:]

        # Mid-run: after the first step trained (the engine then holds weights version 1, not its initial ones),
        # while the next rollout has requests in the engine.
        deadline = time.monotonic() + 300
        while not (_steps(out / "metrics.jsonl") and _busy(url) >= 2):
            assert train.poll() is None, train_log()
            assert time.monotonic() < deadline, "no busy engine after the first step\n" + train_log()
            time.sleep(0.01)
        procs[0].send_signal(signal.SIGKILL)
        procs[0].wait(timeout=30)
        killed_at_step = len(_steps(out / "metrics.jsonl"))
        time.sleep(3)  # the outage: the trainer must hold its requests meanwhile
        procs[0] = _serve(model, port, tmp_path / "serve.log")  # a fresh engine: its initial weights
        assert train.wait(timeout=600) == 0, train_log()
        final = _get(url + "/model_info")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=30)
    records = _steps(out / "metrics.jsonl")
    assert [r["rollout/samples"] for r in records] == [batch * n] * steps, records  # every step: its full batch
    last = records[-1]
    assert last["engine/outages"] == 1 and last["engine/weight_restores"] == 1, last
    assert final["weight_version"] == str(steps)  # the restarted engine got every later version too
    # The episodes in flight at the kill were re-sent once the weights were back: none FAILED (engine_lost would be
    # the only cause allowed), none vanished.
    assert 1 <= last["engine/requests_resent"] <= batch * n, last
    assert [r["rollout/episodes"] for r in records] == [batch * n] * steps, records
    assert killed_at_step >= 1


# ---- the main job against the fake engine ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from jaxrl_vlm.tiny import make_tiny

    return make_tiny(tmp_path_factory.mktemp("tiny") / "model", seed=3)


def _job_config(tiny: Path, tmp: Path, url: str, *extra: str):
    from jaxrl_vlm.config import load_config

    prompts = tmp / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"problem": f"Q{i}", "answer": "x", "images": []}) + "\n" for i in range(4)))
    return load_config(None, [
        "--hf-checkpoint", str(tiny), "--prompt-data", str(prompts), "--prompt-style", "plain",
        "--rollout-interaction-env-path", "envs.letter_game", "--engine-url", url, "--engine-max-retries", "1",
        "--num-rollout", "1", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--rollout-max-response-len", "8",
        "--seq-buckets", "64", "--row-buckets", "8", "--patch-buckets", "0", "--output-dir", str(tmp / "run"), *extra,
    ])


@pytest.mark.slow
async def test_a_run_whose_engine_does_not_return_stops_naming_url_and_wait_and_sends_nothing_meanwhile(tiny, tmp_path):
    from jaxrl_vlm.job.run import MainJob

    def crash_on_second_request(record):
        if len(server.requests_to("/generate")) == 2:
            server.take_down()  # any other request in flight sees its connection closed too
            return Drop()
        return None

    async with FakeSGLangServer(crash_on_second_request) as server:
        with pytest.raises(EngineLost, match=rf"engine at {server.url} lost: not back after waiting 1\.\d s "
                                             r"\(--engine-reconnect-timeout 1\)"):
            await MainJob(_job_config(tiny, tmp_path, server.url, "--engine-reconnect-timeout", "1")).run()
        # The rollout waited instead of submitting: at most the first request of each of the 4 first episodes
        # reached the engine (some were on their way when it went down), none was re-sent, no new group was sent.
        rids = [r.body["rid"].split("-t")[0] for r in server.requests_to("/generate")]
        assert len(rids) <= 4 and len(set(rids)) == len(rids), rids
        assert len(server.requests_to("/health_generate")) >= 2  # probed meanwhile


async def test_an_engine_that_restarted_unseen_between_steps_gets_the_weights_before_the_next_rollout(tiny, tmp_path):
    from jaxrl_vlm.job.run import MainJob

    async with FakeSGLangServer() as server:
        job = MainJob(_job_config(tiny, tmp_path, server.url))
        job.prepare()
        session = await job.open_engine()
        client = await session.__aenter__()
        try:
            await job.source.attach(client, job.version, job.resume)
            assert server.weight_version == "0" and client.link.armed
            await job.source.ensure_engine()  # the engine holds the confirmed version: nothing to do
            assert len(server.requests_to("/update_weights_from_disk")) == 1
            server.bring_back(weight_version="default")  # it restarted between two calls, no request saw it down
            await job.source.ensure_engine()
            assert server.weight_version == "0" and len(server.requests_to("/update_weights_from_disk")) == 2
            assert job.source.engine_metrics()["engine/weight_restores"] == 1
        finally:
            await session.__aexit__(None, None, None)
            job.checkpoints.close()
            if job.log is not None:
                job.log.close()


def test_the_cli_reports_a_lost_engine_or_worker_as_an_error_and_exits_1(monkeypatch, capsys):
    from jaxrl_vlm import cli

    for error in (EngineLost("http://h:1", "engine at http://h:1 lost: not back after waiting 300.0 s"),
                  WorkerLost("http://w:2", "router worker http://w:2 is unreachable during the weight update")):
        def fail(ns, rest, error=error):
            raise error

        monkeypatch.setattr(cli, "_cmd_train", fail)
        assert cli.main(["train"]) == 1
        assert f"jaxrl-vlm train: error: {error}" in capsys.readouterr().err
