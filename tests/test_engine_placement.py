"""Where the embedded engine runs (issues 15 and 18), on 8 simulated CPU devices.

- tensor-parallel (tp 2, 4) and data-parallel (dp 2) engines give the one-device engine's greedy tokens and
  log-probs (the one-device engine is checked against transformers' `generate` in test_engine.py);
- weights staged in memory from another device set serve exactly what a disk update of the same weights serves,
  under the same version, and the trainer's teacher-forced log-probs agree with the engine's;
- memory release / resume (colocation) frees the KV cache and the weights and gives back the same outputs;
- the main job with the engine on devices 0-3 and the trainer on 4-7 syncs weights across the two sets.
"""

from __future__ import annotations

import asyncio
import gc
import weakref
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl_vlm.config import load_config
from jaxrl_vlm.devices import parse_device_ids
from jaxrl_vlm.engine import EmbeddedEngine, EngineOptions
from jaxrl_vlm.engine.replicas import PrefixRouter, block_digests
from jaxrl_vlm.errors import ConfigError
from jaxrl_vlm.job.run import MainJob
from jaxrl_vlm.job.run_log import read_metrics
from jaxrl_vlm.models import build_vision_inputs, get_rope_index, token_logprobs
from jaxrl_vlm.distributed import export_hf
from jaxrl_vlm.models.hf_io import from_hf
from jaxrl_vlm.sharding.layout import build_mesh, shard_model
from jaxrl_vlm.sharding.rules import DEFAULT_RULES
from jaxrl_vlm.tiny import make_tiny
from rollout.client import RetryPolicy, SGLangClient
from rollout.encoding import ChatEncoder
from rollout.sglang_wire import IN_MEMORY_LOAD_FORMAT

GREEDY = {"temperature": 0.0, "max_new_tokens": 16}
MAX_SEQ = 256


def _options(**kw) -> EngineOptions:
    return EngineOptions(max_batch=8, max_seq_len=MAX_SEQ, min_kv_bucket=MAX_SEQ, decode_batch_sizes=(8,), **kw)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return make_tiny(tmp_path_factory.mktemp("placement") / "tiny")


@pytest.fixture(scope="module")
def prompts(tiny_dir, make_test_image) -> list[dict]:
    """Three text prompts and one with an image, as wire requests."""
    from rollout.processing import load_image_processor, load_tokenizer

    encoder = ChatEncoder(load_tokenizer(tiny_dir), load_image_processor(tiny_dir))
    out = []
    for text in ("Find the area of the triangle.", "What is x if 2x = 6?", "Name a color, please."):
        seg = encoder.encode_prompt([{"role": "user", "content": text}])
        out.append({"ids": seg.wire_ids, "image_data": None, "train_ids": seg.train_ids, "mm": None})
    seg = encoder.encode_prompt([{"role": "user", "content": [{"type": "image", "image": make_test_image(3, (96, 80))},
                                                               {"type": "text", "text": "What is shown?"}]}])
    out.append({"ids": seg.wire_ids, "image_data": seg.image_data, "train_ids": seg.train_ids, "mm": seg.mm_inputs})
    return out


async def _greedy(url: str, prompts: list[dict]) -> list[tuple[list[int], list[float], str]]:
    client = SGLangClient(url, retry=RetryPolicy(max_retries=0))
    try:
        results = await asyncio.gather(*(client.generate(p["ids"], image_data=p["image_data"], sampling_params=GREEDY)
                                         for p in prompts))
    finally:
        await client.close()
    return [(r.output_ids, r.output_log_probs, r.weight_version) for r in results]


@pytest.fixture(scope="module")
def one_device(tiny_dir, prompts):
    with EmbeddedEngine(str(tiny_dir), config=_options()) as engine:
        return asyncio.run(_greedy(engine.url, prompts))


def _assert_same(got, want) -> None:
    for (ids, lps, _), (ref_ids, ref_lps, _) in zip(got, want, strict=True):
        assert ids == ref_ids
        np.testing.assert_allclose(lps, ref_lps, atol=2e-5, rtol=0)


@pytest.mark.slow
# The last case also prefills text prompts two side by side (128 // their 64-token bucket): against the reference's
# one at a time. Tensor or data parallelism alone runs in CI's `ci_step` step (the suite's budget); tp 2 with dp 2
# covers both kinds of split here.
@pytest.mark.parametrize("tp,dp,batch_tokens", [pytest.param(2, 1, 0, marks=pytest.mark.ci_step),
                                                pytest.param(4, 1, 0, marks=pytest.mark.ci_step),
                                                pytest.param(1, 2, 0, marks=pytest.mark.ci_step), (2, 2, 128)])
def test_sharded_engine_equals_the_one_device_engine(tiny_dir, prompts, one_device, tp, dp, batch_tokens):
    assert len({tuple(ids) for ids, _, _ in one_device}) == len(one_device), "degenerate reference"
    devices = tuple(range(8 - tp * dp, 8))  # the last devices: placement is honoured, not "the first n"
    config = _options(tp_size=tp, dp_size=dp, device_ids=devices, prefill_batch_tokens=batch_tokens)
    with EmbeddedEngine(str(tiny_dir), config=config) as engine:
        runners = engine.engine.runners
        assert len(runners) == dp
        sets = [{d.id for d in r.placement.devices} for r in runners]
        assert set().union(*sets) == {jax.local_devices()[i].id for i in devices}
        assert sum(len(s) for s in sets) == tp * dp  # replicas share no device
        for r in runners:
            # Parameters are really split: the MLP kernels over all tp devices, each holding 1/tp.
            kernel = r.params["layers"][0]["mlp"]["up_kernel_df"].get_value()
            assert {d.id for d in kernel.sharding.device_set} == {d.id for d in r.placement.devices}
            assert kernel.addressable_shards[0].data.shape[-1] == kernel.shape[-1] // tp
        got = asyncio.run(_greedy(engine.url, prompts + prompts))  # twice: dp replicas both serve
        stats = engine.stats
        if dp > 1:
            assert all(r_stats > 0 for r_stats in (s.stats.prefills for s in engine.engine.scheduler.replicas))
        groups = {key[-1] for r in runners for key in r.programs if key[0] == "prefill"}
    _assert_same(got[:len(prompts)], one_device)
    _assert_same(got[len(prompts):], one_device)
    assert stats.finished == 2 * len(prompts)
    assert groups == ({1, 2} if batch_tokens else {1})  # the picture's prompt runs alone


@pytest.mark.slow
def test_sharded_qwen2_5_vl_engine_equals_its_one_device_engine(tmp_path, make_test_image):
    """The second family through the same placement (window-attention vision tower, q/k/v biases) at tp 2, dp 2."""
    from rollout.processing import load_image_processor, load_tokenizer

    model_dir = make_tiny(tmp_path / "tiny25", arch="qwen2_5_vl")
    encoder = ChatEncoder(load_tokenizer(model_dir), load_image_processor(model_dir))
    seg = encoder.encode_prompt([{"role": "user", "content": [{"type": "image", "image": make_test_image(4, (96, 80))},
                                                               {"type": "text", "text": "What is shown?"}]}])
    text = encoder.encode_prompt([{"role": "user", "content": "Find the area of the triangle."}])
    prompts = [{"ids": seg.wire_ids, "image_data": seg.image_data}, {"ids": text.wire_ids, "image_data": None}]
    with EmbeddedEngine(str(model_dir), config=_options()) as engine:
        want = asyncio.run(_greedy(engine.url, prompts))
    with EmbeddedEngine(str(model_dir), config=_options(tp_size=2, dp_size=2, device_ids=(4, 5, 6, 7))) as engine:
        assert engine.engine.cfg.model_type == "qwen2_5_vl" and len(engine.engine.runners) == 2
        got = asyncio.run(_greedy(engine.url, prompts))
    _assert_same(got, want)


def test_prefix_router_keeps_conversations_on_their_replica_and_balances_the_rest():
    router = PrefixRouter(2, block=4, imbalance=3)
    a = list(range(12))
    first = router.pick(a)
    # The next turn of the same conversation (its prompt extends the first) goes to the same replica ...
    assert router.pick(a + [50, 51, 52, 53]) == first
    # ... a new conversation to the least loaded one ...
    other = router.pick([90 + i for i in range(12)])
    assert other != first
    # ... and a hit is given up once its replica is `imbalance` requests ahead.
    router.done(other)
    assert router.pick(a + [60, 61, 62, 63]) == first  # 3 vs 0 outstanding: at the limit
    assert router.pick(a + [70, 71, 72, 73]) != first
    assert block_digests(list(range(8)), 4)[0] == block_digests(list(range(5)), 4)[0]
    assert block_digests(list(range(8)), 4)[1] != block_digests(list(range(4)) + [9, 9, 9, 9], 4)[1]


def _perturbed_trainer_state(tiny_dir: Path, devices: list) -> nnx.State:
    """The tiny model's parameters, changed and laid out like a trainer's (fsdp over `devices`)."""
    model = from_hf(str(tiny_dir))
    state = nnx.state(model, nnx.Param)
    rng = np.random.default_rng(0)
    state = jax.tree.map(lambda x: x + jnp.asarray(rng.normal(0, 0.05, x.shape), x.dtype), state)
    nnx.update(model, state)

    class Sizes:
        mesh_data, mesh_fsdp, mesh_tensor = 1, len(devices), 1

    shard_model(model, build_mesh(Sizes, devices), DEFAULT_RULES)
    return model


def _teacher_forced(model, prompt: dict, outputs: list[int]) -> np.ndarray:
    cfg = model.cfg
    seq = np.asarray(prompt["train_ids"] + outputs, np.int64)[None]
    mask = np.ones_like(seq, np.int32)
    grid = None if prompt["mm"] is None else prompt["mm"]["image_grid_thw"]
    positions, _ = get_rope_index(seq, grid, mask, cfg)
    pixels = np.zeros((0, cfg.vision.patch_dim), np.float32) if grid is None else prompt["mm"]["pixel_values"]
    vis = build_vision_inputs(pixels, np.zeros((0, 3), np.int64) if grid is None else grid, seq, cfg,
                              patch_bucket=64, token_valid=mask)
    targets = np.zeros_like(seq, np.int32)
    targets[0, :-1] = seq[0, 1:]
    hidden = model(jnp.asarray(seq, jnp.int32), jnp.asarray(positions), jnp.asarray(mask), vis)
    lps = token_logprobs(model, hidden, jnp.asarray(targets))[0]
    start = len(prompt["train_ids"]) - 1
    return np.asarray(lps)[0, start:start + len(outputs)]


@pytest.mark.slow
def test_in_memory_update_across_device_sets_serves_what_a_disk_update_serves(tiny_dir, prompts, tmp_path):
    devices = jax.local_devices()
    trainer_model = _perturbed_trainer_state(tiny_dir, devices[4:8])
    export_hf(trainer_model, tmp_path / "v1", dtype=jnp.float32, copy_from=str(tiny_dir))
    with EmbeddedEngine(str(tiny_dir), config=_options(tp_size=2, dp_size=2, device_ids=(0, 1, 2, 3))) as engine:
        before = asyncio.run(_greedy(engine.url, prompts))

        async def update(path: str, **kw) -> None:
            client = SGLangClient(engine.url)
            try:
                await client.sync_weights_from_disk(path, "1", **kw)
            finally:
                await client.close()

        asyncio.run(update(str(tmp_path / "v1")))
        from_disk = asyncio.run(_greedy(engine.url, prompts))
        asyncio.run(update(str(tiny_dir)))  # back to the original weights
        assert asyncio.run(_greedy(engine.url, prompts))[0][0] == before[0][0]
        engine.engine.stage_weights("v1", nnx.state(trainer_model, nnx.Param))
        staged = engine.engine._staged[("v1", 1)]
        leaf = staged["layers"][0]["mlp"]["up_kernel_df"].get_value()
        assert {d.id for d in leaf.sharding.device_set} == {devices[2].id, devices[3].id}  # replica 1's devices
        asyncio.run(update("v1", load_format=IN_MEMORY_LOAD_FORMAT))
        in_memory = asyncio.run(_greedy(engine.url, prompts))
        assert not engine.engine._staged  # consumed by the update
        # Nothing staged under that name any more: a second in-memory update fails and keeps the weights.
        with pytest.raises(Exception, match="no weights are staged"):
            asyncio.run(update("v1", load_format=IN_MEMORY_LOAD_FORMAT))
    assert [ids for ids, _, _ in in_memory] != [ids for ids, _, _ in before]
    assert all(version == "1" for _, _, version in in_memory)
    _assert_same(in_memory, from_disk)
    for prompt, (ids, lps, _) in zip(prompts, in_memory):
        np.testing.assert_allclose(lps, _teacher_forced(trainer_model, prompt, ids), atol=1e-4, rtol=0)


@pytest.mark.slow
def test_memory_release_frees_cache_and_weights_and_resume_serves_the_same(tiny_dir, prompts, one_device):
    with EmbeddedEngine(str(tiny_dir), config=_options()) as engine:
        runner = engine.engine.runner

        async def scenario():
            client = SGLangClient(engine.url, retry=RetryPolicy(max_retries=0))
            try:
                cache = [weakref.ref(part) for part in runner.cache]
                weights = [weakref.ref(x) for x in jax.tree.leaves(runner.params)]
                await client.release_memory_occupation(["kv_cache"])
                assert runner.cache is None and not runner.resident
                await client.release_memory_occupation(["weights"])
                gc.collect()
                # No array of the engine's weights or cache is alive any more: their device memory is free.
                assert all(ref() is None for ref in cache + weights)
                # A request that arrives while released waits; it is served once both are back.
                pending = asyncio.ensure_future(client.generate(prompts[0]["ids"], sampling_params=GREEDY))
                await asyncio.sleep(0.5)
                assert not pending.done()
                with pytest.raises(Exception, match="400"):  # busy: nothing more may be released
                    await client._memory_occupation("/release_memory_occupation", None, None)
                await client.resume_memory_occupation(["weights"])
                await asyncio.sleep(0.2)
                assert not pending.done()  # still no KV cache
                await client.resume_memory_occupation(["kv_cache"])
                result = await asyncio.wait_for(pending, 60)
                with pytest.raises(Exception, match="400"):
                    await client._memory_occupation("/release_memory_occupation", ["bogus"], None)
                return result
            finally:
                await client.close()

        result = asyncio.run(scenario())
        assert runner.resident
    assert result.output_ids == one_device[0][0]
    np.testing.assert_allclose(result.output_log_probs, one_device[0][1], atol=1e-6, rtol=0)


def test_placement_options_are_checked():
    assert parse_device_ids("0-1,6-7") == (0, 1, 6, 7)
    for bad in ("", "a", "3-1", "0,0", "0-2,2"):
        with pytest.raises(ConfigError):
            parse_device_ids(bad)
    with pytest.raises(ConfigError, match="share device"):
        load_config(None, ["--rollout-devices", "0-3", "--tp-size", "4", "--train-devices", "3-7"])
    with pytest.raises(ConfigError, match="tp_size 2 x dp_size 1"):
        load_config(None, ["--rollout-devices", "0-3", "--tp-size", "2"])
    with pytest.raises(ConfigError, match="--colocate"):
        load_config(None, ["--colocate", "--max-staleness", "1"])
    with pytest.raises(ConfigError, match="--colocate"):
        load_config(None, ["--colocate", "--train-devices", "4-7"])
    with pytest.raises(ConfigError, match="memory"):
        load_config(None, ["--weight-sync-mode", "memory", "--engine-url", "http://127.0.0.1:1"])
    cfg = load_config(None, ["--rollout-num-gpus-per-engine", "2", "--dp-size", "2", "--rollout-devices", "4-7"])
    assert (cfg.engine.tp_size, cfg.engine.dp_size, cfg.engine.rollout_device_ids) == (2, 2, (4, 5, 6, 7))


def _job_config(tiny_dir: Path, out: Path, *extra: str):
    return load_config(None, [
        "--hf-checkpoint", str(tiny_dir), "--prompt-data", str(out.parent / "prompts.jsonl"),
        "--prompt-style", "plain", "--rollout-interaction-env-path", "envs.letter_game", "--max-turns", "1",
        "--num-rollout", "2", "--rollout-batch-size", "2", "--n-samples-per-prompt", "4",
        "--rollout-max-response-len", "8", "--lr", "1e-2", "--seq-buckets", "64,128", "--row-buckets", "8",
        "--patch-buckets", "0", "--engine-max-batch", "8", "--engine-max-seq-len", "256",
        "--output-dir", str(out), "--rollout-temperature", "1.0", *extra,
    ])


def _write_prompts(path: Path) -> None:
    import json

    with path.open("w") as f:
        for i in range(4):
            f.write(json.dumps({"problem": f"Say something about {i}.", "answer": "x", "images": []}) + "\n")


@pytest.mark.slow
@pytest.mark.parametrize("staleness", [0, 1])
def test_main_job_with_engine_and_trainer_on_disjoint_devices(tiny_dir, tmp_path, staleness):
    """Synchronous, and asynchronous (K = 1: the engine on 0-3 generates while the trainer on 4-7 trains; the
    weights are staged in a worker thread while the engine keeps decoding)."""
    _write_prompts(tmp_path / "prompts.jsonl")
    cfg = _job_config(tiny_dir, tmp_path / "run", "--rollout-devices", "0-3", "--tp-size", "2", "--dp-size", "2",
                      "--train-devices", "4-7", "--mesh-data", "1", "--mesh-fsdp", "-1",
                      "--max-staleness", str(staleness), *(["--use-tis"] if staleness else []))
    job = MainJob(cfg)
    asyncio.run(job.run())
    devices = jax.local_devices()
    assert {d.id for d in job.trainer.mesh.devices.flat} == {d.id for d in devices[4:8]}
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["weight_version"] for r in records] == [1, 2]
    # Every version went to the engine in memory (none through the disk), the whole model each time.
    assert all(r["sync/in_memory"] == 1.0 and r["sync/gbytes"] == records[0]["sync/gbytes"] > 0 for r in records)
    if staleness == 0:  # step 2 sampled from the weights trained on devices 4-7 and moved to 0-3: they agree
        assert records[1]["train/train_rollout_logprob_abs_diff"] < 1e-4
    else:  # nothing trained more than one version behind
        assert all(r.get("async/staleness_2", 0) == 0 and r["async/staleness_mean"] <= 1 for r in records)
    assert not list((tmp_path / "run").rglob("weights_v*"))  # nothing went through the disk


@pytest.mark.slow
def test_colocated_main_job_releases_engine_memory_while_training(tiny_dir, tmp_path, monkeypatch):
    _write_prompts(tmp_path / "prompts.jsonl")
    calls: list[str] = []
    original = {name: getattr(SGLangClient, name) for name in ("release_memory_occupation", "resume_memory_occupation")}

    def recording(name):
        async def call(self, tags=None, url=None, **kw):
            calls.append(f"{name.split('_')[0]}:{','.join(tags or ['all'])}")
            return await original[name](self, tags, url, **kw)
        return call

    for name in original:
        monkeypatch.setattr(SGLangClient, name, recording(name))
    job = MainJob(_job_config(tiny_dir, tmp_path / "run", "--colocate"))
    train_calls = []
    train = job.train

    def checked_train(samples, metrics):
        train_calls.append(job.syncer.client.local_engine.runner.resident)
        train(samples, metrics)

    job.train = checked_train
    asyncio.run(job.run())
    assert train_calls == [False, False]  # the engine held no memory while the trainer ran
    assert calls == ["release:all", "resume:weights", "resume:kv_cache"] * 2
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["weight_version"] for r in records] == [1, 2]
    assert records[1]["train/train_rollout_logprob_abs_diff"] < 1e-4
