"""Issue 49 item 1: one process, two device users. The main job on 8 simulated CPU devices, with the embedded
engine in the same process (tensor-parallel over devices 0-1, which the trainer's 8 devices include), async
streaming (`--max-staleness 1`: the engine generates while the trainer trains) and evaluation, runs to its end.

Engine and trainer both launch programs whose collectives span devices they share; `jaxrl_vlm/device_lock.py`
makes them take turns (scripts/repro_collective_stall.py tries the two-thread stall).
The run must finish every step and every eval within the subprocess's deadline: a deadlock would hold it until
XLA's collective timeout, far past it. Before issue 49 the run crashed here, with and without the device lock, on
a deleted buffer: the engine's weights, put on its 2 devices from the trainer's 8, still aliased the trainer's
buffers, which its next step donated (`engine.weights.place_weights` now copies; the second test).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from _launch import ROOT, xla_flags

from jaxrl_vlm.job.run_log import read_metrics

STEPS = 3


@pytest.mark.slow
@pytest.mark.ci_step  # 3 steps with evals on 8 devices: minutes (546 s on the 2-core machine under a load of ~20)
def test_the_main_job_on_8_devices_beside_its_in_process_engine_with_async_and_eval_finishes(tmp_path):
    out = tmp_path / "run"
    argv = [sys.executable, "-m", "jaxrl_vlm.cli", "train", "configs/color_reveal_tiny.yaml",
            "--hf-checkpoint", str(tmp_path / "tiny"), "--prompt-data", str(tmp_path / "train.parquet"),
            "--synthetic-rows", "16", "--synthetic-eval-rows", "4",
            "--eval-prompt-data", "heldout", str(tmp_path / "heldout.parquet"), "--eval-interval", "1",
            "--n-samples-per-eval-prompt", "2",
            "--num-rollout", str(STEPS), "--rollout-batch-size", "2", "--n-samples-per-prompt", "4",
            "--max-staleness", "1", "--tp-size", "2", "--save-interval", "0", "--output-dir", str(out)]
    env = {**os.environ, "XLA_FLAGS": xla_flags(8), "JAX_PLATFORMS": "cpu"}
    log = tmp_path / "run.log"
    with open(log, "wb") as f:
        try:
            done = subprocess.run(argv, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=1500)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the run did not finish in 1500 s (a collective stall?):\n{log.read_text()[-3000:]}")
    text = log.read_text(errors="replace")
    assert done.returncode == 0, text[-3000:]
    records = read_metrics(out / "metrics.jsonl")
    trained = [r for r in records if "rollout/samples" in r]
    assert [r["step"] for r in trained] == list(range(STEPS)), text[-3000:]
    assert all(r["rollout/samples"] > 0 and r["train/entropy_loss"] > 0 for r in trained)
    evals = sorted(r["step"] for r in records if "eval/heldout/raw_reward" in r)
    assert evals == list(range(STEPS + 1)), evals  # before the first step and after each one
    assert "run finished" in text


def test_weights_placed_on_an_engines_fewer_devices_survive_the_trainers_donation():
    """jax 0.10.2's device_put(may_alias=False) of an array replicated on 8 devices onto 2 of them hands back the
    source's own buffers; `place_weights` copies, so the trainer's next step (which donates its state) leaves the
    engine's weights alive. Without the copy the engine's next program gets a deleted buffer (this test's run above
    crashed so, with and without the device lock)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from jaxrl_vlm.engine.weights import place_weights

    devices = jax.devices()
    trainer = NamedSharding(Mesh(np.array(devices), ("data",)), P())
    engine = NamedSharding(Mesh(np.array(devices[:2]), ("tensor",)), P())
    sources = [jax.device_put(np.full((4, 4), k, np.float32), trainer) for k in (1, 2)]
    targets = [jax.ShapeDtypeStruct((4, 4), jnp.float32, sharding=engine)] * 2
    placed = place_weights(sources, targets)
    step = jax.jit(lambda xs: [x + 1 for x in xs], donate_argnums=0)
    jax.block_until_ready(step(sources))
    assert all(x.is_deleted() for x in sources)
    assert [float(jnp.sum(p)) for p in placed] == [16.0, 32.0]
    assert all(p.sharding == engine for p in placed)
