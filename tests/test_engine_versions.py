"""An external engine holds exactly the trainer's weights before the first rollout (issue 17 row 7).

On a fresh start and on resume with `--engine-url`, the job pushes the trainer's weights and confirms their
version on `/model_info` before any `/generate`; an engine that reports another version stops the run,
and so does a sample whose turns were made by other weights than the confirmed version.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from jaxrl_vlm.config import load_config
from jaxrl_vlm.job.run import MainJob
from jaxrl_vlm.job.staleness import OffPolicySampleError, check_sample_versions
from jaxrl_vlm.weight_sync import WeightSyncFailed
from rollout.fake_engine import FakeSGLangServer, Respond


def _sample(name: str, versions: list[str]) -> SimpleNamespace:
    return SimpleNamespace(name=name, weight_versions=versions)


def test_check_sample_versions_names_off_policy_samples_and_counts_unreported_ones():
    report = check_sample_versions([_sample("a", ["3"]), _sample("b", []), _sample("c", ["3"])], "3", step=4)
    assert (report.checked, report.unreported) == (2, 1)
    many = [_sample(f"s{i}", ["2", "3"]) for i in range(5)]
    with pytest.raises(OffPolicySampleError, match=r"step 4: 5 of 6 samples .*'3'.*s0 made by weight version\(s\) \['2', '3'\].*and 2 more"):
        check_sample_versions([_sample("ok", ["3"]), *many], "3", step=4)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from jaxrl_vlm.tiny import make_tiny

    return make_tiny(tmp_path_factory.mktemp("tiny") / "model", seed=3)


def _config(tiny: Path, tmp: Path, url: str, *extra: str):
    prompts = tmp / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"problem": f"Q{i}", "answer": "x", "images": []}) + "\n" for i in range(4)))
    return load_config(None, [
        "--hf-checkpoint", str(tiny), "--prompt-data", str(prompts), "--prompt-style", "plain",
        "--rollout-interaction-env-path", "envs.letter_game", "--engine-url", url,
        "--num-rollout", "1", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--rollout-max-response-len", "8",
        "--seq-buckets", "64", "--row-buckets", "8", "--patch-buckets", "0", "--output-dir", str(tmp / "run"),
        "--save-interval", "1", *extra,
    ])


def _first(paths: list[str], name: str) -> int:
    return paths.index(name) if name in paths else len(paths)


async def _attached(job: MainJob):
    job.prepare()
    session = await job.open_engine()
    client = await session.__aenter__()
    return session, client


@pytest.mark.slow
async def test_fresh_start_pushes_and_confirms_before_the_first_rollout(tiny, tmp_path):
    async with FakeSGLangServer(weight_version="whatever-it-held") as server:
        cfg = _config(tiny, tmp_path, server.url)
        job = MainJob(cfg)
        session, client = await _attached(job)
        try:
            await job.source.attach(client, job.version, job.resume)
            assert server.weight_version == "0"
            loaded = [r.body["model_path"] for r in server.requests_to("/update_weights_from_disk")]
            assert len(loaded) == 1 and Path(loaded[0]).name == "weights_v000000"
            assert "/model_info" in server.paths and "/generate" not in server.paths
            # Another trainer (or a stale worker) changes the engine's weights behind this run's back.
            server.weight_version = "7"
            with pytest.raises(OffPolicySampleError, match="weight version 7|\\['7'\\]"):
                await job.source.rollout(0)
        finally:
            await session.__aexit__(None, None, None)
            job.checkpoints.close()
            if job.log is not None:
                job.log.close()


async def test_an_engine_that_keeps_other_weights_stops_the_run_before_any_rollout(tiny, tmp_path):
    async with FakeSGLangServer(weight_version="old") as server:
        server.enqueue(*[Respond(200, {"weight_version": "old"})] * 3, path="/model_info")
        with pytest.raises(WeightSyncFailed, match=r"report weight version\(s\) .*'old'.*version 0"):
            await MainJob(_config(tiny, tmp_path, server.url)).run()
        assert "/generate" not in server.paths


@pytest.mark.slow
async def test_resume_pushes_the_resumed_version_to_the_external_engine(tiny, tmp_path):
    async with FakeSGLangServer(weight_version="default") as first:
        await MainJob(_config(tiny, tmp_path, first.url)).run()
        paths = first.paths
        assert _first(paths, "/update_weights_from_disk") < _first(paths, "/generate") < len(paths)
        assert first.weight_version == "1"
    async with FakeSGLangServer(weight_version="default") as second:  # a fresh engine, after a restart
        await MainJob(_config(tiny, tmp_path, second.url, "--load", str(tmp_path / "run" / "checkpoints"),
                              "--num-rollout", "2")).run()
        loads = [r.body["model_path"] for r in second.requests_to("/update_weights_from_disk")]
        assert Path(loads[0]).name == "weights_v000001", loads  # the resumed weights, before the first rollout
        assert second.paths.index("/update_weights_from_disk") < second.paths.index("/generate")
        assert second.weight_version == "2"
