"""Parts of the training loop: NaN guard, checkpoint atomicity under SIGKILL, weight-sync failure policy,
and `--launch-sglang` starting SGLang from its own interpreter."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from _train_samples import train_samples
from _launch import xla_flags

from jaxrl_vlm.checkpoint import CheckpointStore, abstract_like
from jaxrl_vlm.config import load_config
from jaxrl_vlm.errors import ConfigError
from jaxrl_vlm.job.run import weight_sync_root
from jaxrl_vlm.job.session import rollout_session
from jaxrl_vlm.job.trainer import Trainer
from jaxrl_vlm.sglang_launcher import SGLangLaunchError, SGLangProcess
from jaxrl_vlm.weight_sync import WeightSyncer, WeightSyncFailed, version_dir
from rollout.client import RetryPolicy, SGLangClient
from rollout.fake_engine import FakeSGLangServer, Respond

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from jaxrl_vlm.tiny import make_tiny

    return make_tiny(tmp_path_factory.mktemp("tiny") / "model", seed=5)


@pytest.fixture(scope="module")
def trainer(tiny_dir):
    cfg = load_config(None, [
        "--hf-checkpoint", str(tiny_dir), "--lr", "1e-3", "--seq-buckets", "256,512", "--row-buckets", "8,16",
        "--patch-buckets", "0,64,128", "--logprob-chunk-size", "64", "--mesh-data", "1",
    ])
    t = Trainer(cfg, devices=jax.devices()[:1])
    t.build_policy(tiny_dir)
    return t


# ------------------------------------------------------------------------------------------- NaN guard
@pytest.mark.slow
def test_nonfinite_loss_skips_the_update(trainer, tiny_dir, make_test_image):
    samples = train_samples(tiny_dir, make_test_image)
    # The step donates its input state, so keep an independent copy to restore from.
    clean = jax.tree.map(jax.numpy.copy, trainer.state)
    clean_step = int(clean.step)
    # Inputs are checked upstream (rewards, advantages); a NaN can still come from the numerics (a diverged
    # weight, an overflow): poison one weight of the final norm and the loss is NaN.
    leaves, treedef = jax.tree.flatten(clean.params)
    shapes = [leaf.shape for leaf in leaves]
    k = next(i for i, shp in enumerate(shapes) if len(shp) == 1)
    poisoned = list(leaves)
    poisoned[k] = leaves[k].at[0].set(np.nan)
    trainer.state = jax.tree.map(jax.numpy.copy, clean)._replace(params=jax.tree.unflatten(treedef, poisoned))
    before = [np.asarray(x) for x in poisoned]
    metrics = trainer.train_on(samples)
    assert metrics["train/skipped_nonfinite"] == 1.0
    after = [np.asarray(x) for x in jax.tree.leaves(trainer.state.params)]
    assert all(np.array_equal(a, b, equal_nan=True) for a, b in zip(before, after))  # nothing written
    assert int(trainer.state.step) == clean_step
    # With clean weights the same batch trains normally.
    clean_values = [np.asarray(x) for x in leaves]
    trainer.state = clean
    metrics = trainer.train_on(samples)
    assert metrics["train/skipped_nonfinite"] == 0.0 and int(trainer.state.step) == clean_step + 1
    assert any(not np.array_equal(a, np.asarray(b)) for a, b in zip(clean_values, jax.tree.leaves(trainer.state.params)))


# ------------------------------------------------------------------------------------------- checkpoints
_SAVER = textwrap.dedent(
    """
    import sys, numpy as np, jax.numpy as jnp
    from jaxrl_vlm.checkpoint import CheckpointStore
    store = CheckpointStore(sys.argv[1], keep=5)
    store.save(1, {"w": jnp.arange(4.0)}, {"note": "small"})
    print("saved 1", flush=True)
    big = {"w": jnp.ones((160_000_000,), jnp.float32)}  # ~640 MB: long enough to be killed mid-write
    store.save(2, big, {"note": "big"})
    print("saved 2", flush=True)
    """
)


def test_checkpoint_killed_mid_write_is_never_restored(tmp_path):
    ckpt = tmp_path / "ckpt"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": xla_flags(1)}
    proc = subprocess.Popen([sys.executable, "-c", _SAVER, str(ckpt)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=ROOT)
    try:
        assert proc.stdout.readline().decode().strip() == "saved 1", proc.stderr.read().decode()[-2000:]
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not any(".orbax-checkpoint-tmp" in p.name for p in ckpt.iterdir()):
            time.sleep(0.005)
        partial = [p.name for p in ckpt.iterdir() if ".orbax-checkpoint-tmp" in p.name]
        assert partial, f"step 2 was never seen in progress: {[p.name for p in ckpt.iterdir()]}"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    store = CheckpointStore(ckpt, keep=5, read_only=True)
    assert store.steps() == [1]
    step, state, meta = store.restore(abstract_like({"w": jax.numpy.zeros(4)}))
    assert step == 1 and meta == {"note": "small"} and np.array_equal(state["w"], np.arange(4.0))
    # A new writer cleans the leftover temporary directory up and continues from step 1.
    writer = CheckpointStore(ckpt, keep=5)
    writer.save(2, {"w": jax.numpy.ones(4)}, {"note": "again"})
    assert writer.steps() == [1, 2]
    assert not any(".orbax-checkpoint-tmp" in p.name for p in ckpt.iterdir())


def _text_episodes(vocab: int) -> list:
    """Two groups of four finished text episodes (prompt, model turn, observation, closing turn) from token ids."""
    from rollout.sample import Sample, Status

    rng = np.random.default_rng(1)
    samples = []
    for g in range(2):
        prompt = rng.integers(10, vocab - 10, size=20 + 7 * g).tolist()
        for i in range(4):
            s = Sample(group_index=g, index=i, prompt=[{"role": "user", "content": "x"}], label="1")
            s.set_prompt_tokens(prompt)
            n = 6 + 3 * i
            s.append_model_tokens(rng.integers(10, vocab - 10, size=n).tolist(), (-rng.uniform(0.1, 3.0, size=n)).tolist())
            s.append_observation_tokens(rng.integers(10, vocab - 10, size=5).tolist())
            s.append_model_tokens([int(rng.integers(10, vocab - 10))], [-0.2])
            s.reward = float((i + g) % 3)
            s.set_status(Status.COMPLETED)
            samples.append(s)
    return samples


def test_qwen3_5_resumes_from_its_orbax_checkpoint_exactly(tmp_path):
    """A tiny Qwen3.5 (linear-attention A_log / dt_bias / conv kernels among its parameters) through the main job's
    own checkpoint path (`CheckpointCadence.save`, then `restore` for --load): parameters, Adam moments, step and
    RNG come back bit for bit, and the next step from them gives the same metrics and the same new state as the
    step that followed the save in the uninterrupted run. Text-only episodes and a weights-only checkpoint keep it
    cheap (no tokenizer files, no vision tower in the compiled step)."""
    import json

    from flax import nnx

    from jaxrl_vlm.job.checkpointing import CheckpointCadence, restore
    from jaxrl_vlm.models import to_hf
    from jaxrl_vlm.models.hf_io import abstract_model
    from jaxrl_vlm.tiny import tiny_model_config

    cfg_model = tiny_model_config(arch="qwen3_5")
    model = tmp_path / "tiny_qwen3_5"
    # Host-drawn weights into the abstract model: an initializer would run one eager program per tensor (~20 s here).
    shell, rng = abstract_model(cfg_model), np.random.default_rng(3)
    nnx.update(shell, jax.tree.map(lambda s: jax.numpy.asarray(rng.normal(0, 0.05, s.shape).astype(np.float32)),
                                   nnx.state(shell, nnx.Param)))
    to_hf(shell, model, dtype=jax.numpy.float32)
    (model / "config.json").write_text(json.dumps(cfg_model.to_hf_dict()))
    argv = ["--hf-checkpoint", str(model), "--lr", "1e-2", "--seq-buckets", "64", "--row-buckets", "8",
            "--patch-buckets", "0", "--logprob-chunk-size", "64", "--mesh-data", "1", "--output-dir", str(tmp_path / "run")]
    cfg = load_config(None, argv)
    trainer = Trainer(cfg, devices=jax.devices()[:1])
    trainer.build_policy(model)
    samples = _text_episodes(cfg_model.text.vocab_size)
    trainer.train_on(samples)
    cadence = CheckpointCadence(cfg, tmp_path / "run")
    cadence.save(1, trainer.state, weight_version=1, prompt_iterator={}, driver_state=None)
    cadence.close()
    saved = [np.asarray(x) for x in jax.tree.leaves(trainer.state)]  # the step donates its state: copy it out first
    uninterrupted = trainer.train_on(samples)
    after = [np.asarray(x) for x in jax.tree.leaves(trainer.state)]
    assert any(not np.array_equal(a, b) for a, b in zip(after, saved))

    point = restore(load_config(None, [*argv, "--load", str(tmp_path / "run" / "checkpoints")]), trainer.state)
    assert (point.step, point.weight_version) == (1, 1)
    restored = jax.tree.leaves(point.state)
    assert len(restored) == len(saved) and all(np.array_equal(np.asarray(a), b) for a, b in zip(restored, saved))
    trainer.state = point.state
    resumed = trainer.train_on(samples)
    assert resumed == uninterrupted and uninterrupted["train/loss_total"] != 0.0
    assert all(np.array_equal(np.asarray(a), b) for a, b in zip(jax.tree.leaves(trainer.state), after))


# ------------------------------------------------------------------------------------------- weight sync
async def test_weight_sync_keeps_old_version_until_success_and_stops_on_failure(trainer, tmp_path, tiny_dir):
    model = trainer.policy_model()
    async with FakeSGLangServer() as server:
        async with SGLangClient(server.url, retry=RetryPolicy(max_retries=0)) as client:
            syncer = WeightSyncer(client, tmp_path / "weights", copy_from=str(tiny_dir), retries=1, retry_wait_s=0.0)
            report = await syncer.push(model, 1)
            assert server.weight_version == "1" and report.path == version_dir(tmp_path / "weights", 1)
            assert server.paths[-5:] == ["/pause_generation", "/flush_cache", "/update_weights_from_disk",
                                         "/continue_generation", "/model_info"]  # the load is confirmed
            await syncer.push(model, 2)
            assert [p.name for p in (tmp_path / "weights").iterdir()] == ["weights_v000002"]  # v1 deleted after success

            failure = Respond(400, {"success": False, "message": "Failed to load weights: boom"})
            server.enqueue(failure, failure, path="/update_weights_from_disk")
            with pytest.raises(WeightSyncFailed, match=r"version 3 .*after 2 attempts.*boom"):
                await syncer.push(model, 3)
            assert server.weight_version == "2"
            # The last acknowledged version stays on disk; the engine was resumed after each failed attempt.
            assert version_dir(tmp_path / "weights", 2).is_dir()
            assert server.paths.count("/continue_generation") == 2 + 2


# ------------------------------------------------------------------------------------------- --launch-sglang
def _fake_sglang_package(root: Path, body: str) -> None:
    pkg = root / "sglang"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "launch_server.py").write_text(body)


async def test_launch_sglang_runs_its_module_from_the_given_interpreter(tmp_path, monkeypatch):
    # A stand-in `sglang.launch_server` on the child's path that serves SGLang's API (our scripted fake).
    _fake_sglang_package(tmp_path, textwrap.dedent(
        """
        import argparse, sys
        from rollout.fake_engine import main
        p = argparse.ArgumentParser(); p.add_argument("--model-path"); p.add_argument("--host"); p.add_argument("--port")
        p.add_argument("--mem-fraction-static")
        a = p.parse_args()
        sys.exit(main(["--host", a.host, "--port", a.port, "--weight-version", "launched:" + a.model_path]))
        """
    ))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), str(ROOT)]))
    proc = SGLangProcess(sys.executable, "/models/demo", extra_args=["--mem-fraction-static", "0.6"], log_path=tmp_path / "sglang.log")
    url = proc.start()
    try:
        async with SGLangClient(url) as client:
            await proc.wait_ready(client, timeout_s=60)
            assert await client.get_weight_version() == "launched:/models/demo"
    finally:
        proc.stop()
    assert proc.process.poll() is not None


async def test_launch_sglang_that_dies_reports_its_log(tmp_path, monkeypatch):
    _fake_sglang_package(tmp_path, "raise SystemExit('CUDA error: no kernel image is available')\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    proc = SGLangProcess(sys.executable, "/models/demo", log_path=tmp_path / "sglang.log")
    proc.start()
    async with SGLangClient(proc.url) as client:
        with pytest.raises(SGLangLaunchError, match=r"(?s)exited with code 1.*no kernel image"):
            await proc.wait_ready(client, timeout_s=60)
    with pytest.raises(SGLangLaunchError, match="--sglang-python"):
        SGLangProcess("", "/m", log_path=tmp_path / "x.log")


def test_launched_sglang_gets_routed_experts_for_replay_and_lora_refuses_data_parallel_replicas():
    """SGLang returns routed experts only when started with --enable-return-routed-experts (silently none otherwise),
    and loads adapters at run time only with one data-parallel replica (an assert: HTTP 500 without the cause)."""
    from jaxrl_vlm.job.session import _routing_args

    def cfg(*extra: str):
        return load_config(None, ["--launch-sglang", "--sglang-python", sys.executable, *extra])

    assert _routing_args(cfg("--use-rollout-routing-replay", "true")) == ["--enable-return-routed-experts"]
    assert _routing_args(cfg()) == []
    assert _routing_args(cfg("--use-rollout-routing-replay", "true",
                             "--sglang-args=--enable-return-routed-experts")) == []  # the user's own flag stays
    for dp in (["--dp-size", "2"], ["--sglang-args=--dp-size=2"]):
        with pytest.raises(ConfigError, match=r"--dp-size > 1.*--lora-sync merged"):
            cfg("--lora-rank", "4", *dp)
        cfg("--lora-rank", "4", "--lora-sync", "merged", *dp)  # the merged model loads as a full update
    cfg("--lora-rank", "4", "--dp-size", "1")


@pytest.mark.slow
def test_global_batch_size_splits_the_rollout_into_optimizer_steps(tiny_dir, make_test_image):
    samples = train_samples(tiny_dir, make_test_image)  # 8 samples in 2 groups
    cfg = load_config(None, [
        "--hf-checkpoint", str(tiny_dir), "--lr", "1e-3", "--seq-buckets", "256,512", "--row-buckets", "4,8,16",
        "--patch-buckets", "0,64,128", "--logprob-chunk-size", "64", "--mesh-data", "1",
        "--global-batch-size", "4", "--num-steps-per-rollout", "2",
    ])
    t = Trainer(cfg, devices=jax.devices()[:1])
    t.build_policy(tiny_dir)
    metrics = t.train_on(samples)
    # 2 optimizer batches of 4 samples, each trained twice.
    assert metrics["train/optimizer_steps"] == 4.0 and int(t.state.step) == 4
    # Old log-probs come from the weights before the first update, so the first step sees ratio 1 and the
    # later ones do not.
    assert metrics["train/ratio_max"] > 1.0 + 1e-6


# ------------------------------------------------------------------------------------------- engine left paused
async def test_session_resumes_an_external_engine_left_paused_and_runs_use_their_own_sync_dir(tiny_dir, tmp_path):
    """A trainer killed between pause and continue leaves the engine paused; the next run resumes it on attach.
    Two runs sharing one --weight-sync-dir write (and delete) only under their own subdirectories."""
    async with FakeSGLangServer() as server:
        async with SGLangClient(server.url) as client:
            await client.pause_generation("abort")
        assert server.paused is not None
        cfg = load_config(None, ["--hf-checkpoint", str(tiny_dir), "--engine-url", server.url,
                                 "--rollout-interaction-env-path", "envs.letter_game"])
        async with rollout_session(cfg, tiny_dir, tiny_dir, cfg.to_namespace()):
            # Resumed first, then probed: SGLang's health probe cannot succeed while it is paused.
            assert server.paused is None and "/continue_generation" in server.paths
            resumed = server.paths.index("/continue_generation")
            assert not any(p.startswith("/health") for p in server.paths[:resumed]), server.paths
            assert any(p.startswith("/health") for p in server.paths[resumed:]), server.paths
    shared = ["--weight-sync-dir", str(tmp_path / "shm")]
    a = weight_sync_root(load_config(None, [*shared, "--output-dir", str(tmp_path / "a")]), tmp_path / "a")
    b = weight_sync_root(load_config(None, [*shared, "--output-dir", str(tmp_path / "b")]), tmp_path / "b")
    assert a.parent == b.parent == tmp_path / "shm" and a != b
    assert a == weight_sync_root(load_config(None, [*shared]), tmp_path / "a")  # the same run (or its resume)
    assert weight_sync_root(load_config(None, []), tmp_path / "a") == tmp_path / "a" / "weights"


async def test_two_runs_sharing_a_sync_dir_never_delete_each_others_versions(trainer, tiny_dir, tmp_path):
    """Run B exporting (and pruning) its versions under the shared --weight-sync-dir leaves run A's untouched."""
    shared = ["--weight-sync-dir", str(tmp_path / "shm")]
    roots = [weight_sync_root(load_config(None, [*shared, "--output-dir", str(tmp_path / run)]), tmp_path / run)
             for run in ("a", "b")]
    a, b = (WeightSyncer(None, root, copy_from=str(tiny_dir)) for root in roots)
    model = trainer.policy_model()
    await a.push(model, 1)
    await a.push(model, 2)
    for version in (1, 2, 3):
        await b.push(model, version)
    assert [p.name for p in roots[0].iterdir()] == ["weights_v000002"]  # A keeps its own latest
    assert [p.name for p in roots[1].iterdir()] == ["weights_v000003"]
    assert sorted(p.name for p in (tmp_path / "shm").iterdir()) == sorted(r.name for r in roots)
