"""LoRA in the learner: only the adapters train and have optimizer state, the base stays frozen in the compute dtype,
the reference policy is the base itself (no copy), every mesh layout shards the adapters like their kernels (goldens),
an orbax checkpoint restores adapters and optimizer state bit for bit (and a resumed step with rank dropout is the
uninterrupted one), and `jaxrl-vlm export-lora` writes what peft and transformers load."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _train_samples import train_samples
from flax import nnx

from jaxrl_vlm.checkpoint import CheckpointStore, abstract_like
from jaxrl_vlm.cli import main as cli_main
from jaxrl_vlm.config import load_config
from jaxrl_vlm.errors import ConfigError
from jaxrl_vlm.job.trainer import Trainer
from jaxrl_vlm.lora.adapters import adapter_layouts, adapter_nbytes, adapters_of, lora_setup
from jaxrl_vlm.lora.export import load_peft_adapter
from jaxrl_vlm.lora.optim import adapter_optimizer
from jaxrl_vlm.lora.options import LoraOptions
from jaxrl_vlm.models import from_hf
from jaxrl_vlm.models.hf_io import abstract_model
from jaxrl_vlm.rl.train_step import make_optimizer
from jaxrl_vlm.tiny import make_tiny, tiny_model_config

REPO = Path(__file__).resolve().parents[1]
LAYOUTS = sorted((REPO / "configs" / "mesh").glob("*.yaml"))
GOLDENS = REPO / "tests" / "goldens" / "lora"
REGENERATE = "python tests/test_lora.py --regenerate-goldens"
GOLDEN_OPTIONS = LoraOptions(lora_rank=8, lora_vision=True)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("tiny") / "model", seed=9)


def trainer_argv(tiny_dir: Path, out: Path, *extra: str) -> list[str]:
    return ["--hf-checkpoint", str(tiny_dir), "--lr", "1e-2", "--weight-decay", "0", "--seq-buckets", "256",
            "--row-buckets", "16", "--patch-buckets", "128", "--logprob-chunk-size", "64", "--mesh-data", "1",
            "--output-dir", str(out), "--lora-rank", "4", "--lora-alpha", "8", *extra]


def _trainer(tiny_dir: Path, out: Path, *extra: str) -> Trainer:
    t = Trainer(load_config(None, trainer_argv(tiny_dir, out, *extra)), devices=jax.devices()[:1])
    t.build_policy(tiny_dir)
    return t


def _peft_matches_merged(base_dir: Path, export: Path) -> None:
    import torch
    from _hf_tiny import hf_logits, make_batch
    from peft import PeftModel
    from transformers import Qwen3VLForConditionalGeneration

    def load(path):
        return Qwen3VLForConditionalGeneration.from_pretrained(str(path), dtype=torch.float32).eval()

    batch = make_batch([[12], [7]], [], seed=3)
    peft_logits = hf_logits(PeftModel.from_pretrained(load(base_dir), str(export / "adapter")).eval(), batch)
    merged_logits = hf_logits(load(export / "merged"), batch)
    mask = batch.attention_mask.astype(bool)
    assert np.abs(peft_logits - hf_logits(load(base_dir), batch))[mask].max() > 1e-3  # the adapters change the model
    assert np.abs(peft_logits - merged_logits)[mask].max() <= 1e-4


def _host_pairs(adapters) -> list[dict[str, np.ndarray]]:
    return [{k: np.asarray(v) for k, v in pair.items()} for pair in jax.device_get(adapters)]


def _host(tree):
    return [np.asarray(x) for x in jax.tree.leaves(jax.device_get(tree))]


def test_only_adapters_train_on_a_frozen_base_that_is_the_reference(tiny_dir, tmp_path, make_test_image):
    samples = train_samples(tiny_dir, make_test_image)
    trainer = _trainer(tiny_dir, tmp_path / "run", "--use-kl-loss", "--kl-loss-coef", "0.1", "--lora-dropout", "0.25",
                       "--lora-modules-to-save", "model.language_model.norm")
    sites = trainer.lora.sites
    assert [s.module.rsplit(".", 1)[-1] for s in sites[:7]] == [
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    assert len(sites) == 7 * trainer.model_cfg.text.num_hidden_layers  # all-linear: the text decoder's linears
    adapter_elems = sum(x.size for x in jax.tree.leaves(trainer.state.params))
    hidden = trainer.model_cfg.text.hidden_size  # the final norm, trained in full (modules_to_save)
    assert adapter_elems == sum(4 * (s.in_features + s.out_features) for s in sites) + hidden
    # Adam's two moments of the adapters and nothing of the base (besides integer step counters).
    moments = [x for x in jax.tree.leaves(trainer.state.opt_state) if jnp.issubdtype(x.dtype, jnp.floating)]
    assert sum(x.size for x in moments) == 2 * adapter_elems
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(trainer.frozen))  # --compute-dtype float32
    assert trainer.ref_params is trainer.frozen  # the reference is the base: no second copy
    base = _host(trainer.frozen)

    trainer.train_on(samples)
    metrics = trainer.train_on(samples)
    assert metrics["train/skipped_nonfinite"] == 0.0 and metrics["train/kl_loss"] != 0.0
    assert all(np.array_equal(a, b) for a, b in zip(base, _host(trainer.frozen))), "the base changed"
    assert max(float(jnp.abs(ad["lora_B"]).max()) for ad in trainer.state.params[:-1]) > 1e-3, "no adapter trained"
    norm = np.asarray(trainer.state.params[-1]["weight"])
    assert not np.array_equal(norm, np.asarray(dict(nnx.to_flat_state(trainer.frozen))[("final_norm", "scale")].get_value()))
    np.testing.assert_array_equal(np.asarray(dict(nnx.to_flat_state(trainer.policy_params()))[("final_norm", "scale")].get_value()), norm)

    # Reference log-probs are the base checkpoint's, read independently; the policy's differ from them.
    _, device_batch = trainer._batch(samples, np.zeros(len(samples), np.float32))
    mask = np.asarray(device_batch.loss_mask).astype(bool)
    fresh = nnx.state(from_hf(str(tiny_dir)), nnx.Param)
    ref = np.asarray(trainer._logprobs(trainer.ref_params, device_batch))
    np.testing.assert_allclose(ref[mask], np.asarray(trainer._logprobs(fresh, device_batch))[mask], atol=1e-6, rtol=0)
    policy = np.asarray(trainer._logprobs(trainer.policy_params(), device_batch))
    assert np.abs(policy - ref)[mask].max() > 1e-3

    # The merged model carries the adapters it was made from (for adapter-only sync).
    model = trainer.policy_model()
    carried = adapters_of(model)
    assert carried is not None and carried.setup == trainer.lora
    assert adapter_nbytes(carried.adapters) == 4 * adapter_elems

    # An orbax checkpoint restores the adapters and the optimizer state exactly.
    store = CheckpointStore(tmp_path / "ckpt", keep=1)
    store.save(2, trainer.state, {"weight_version": 2})
    store.close()
    reader = CheckpointStore(tmp_path / "ckpt", read_only=True)
    step, restored, _ = reader.restore(abstract_like(trainer.state))
    reader.close()
    assert step == 2
    assert jax.tree.structure(restored) == jax.tree.structure(trainer.state)
    assert all(np.array_equal(a, b) for a, b in zip(_host(restored), _host(trainer.state)))
    saved_pairs = _host_pairs(trainer.state.params)
    saved_policy = [(path, np.asarray(v.get_value())) for path, v in nnx.to_flat_state(trainer.policy_params())]

    # Resume is exact with dropout on: each step advances the state's RNG (fresh masks every step), and the step
    # after a restore draws the masks the uninterrupted run drew.
    rng2 = np.asarray(trainer.state.rng)
    trainer.train_on(samples)
    uninterrupted = _host(trainer.state)
    assert not np.array_equal(np.asarray(trainer.state.rng), rng2)
    trainer.state = restored
    trainer.train_on(samples)
    assert all(np.array_equal(a, b) for a, b in zip(_host(trainer.state), uninterrupted))

    # `jaxrl-vlm export-lora` writes the checkpoint's adapters as a PEFT directory, and the merged model.
    assert cli_main(["export-lora", "--checkpoint", str(tmp_path / "ckpt"), "--out", str(tmp_path / "export"),
                     *trainer_argv(tiny_dir, tmp_path / "x"), "--lora-modules-to-save", "model.language_model.norm",
                     "--train-devices", "0"]) == 0
    for got, put in zip(load_peft_adapter(tmp_path / "export" / "adapter", trainer.lora), saved_pairs):
        assert got.keys() == put.keys() and all(np.array_equal(got[k], put[k]) for k in got)
    merged = nnx.state(from_hf(str(tmp_path / "export" / "merged")), nnx.Param)
    for (path, var), (_, want) in zip(nnx.to_flat_state(merged), saved_policy):
        np.testing.assert_array_equal(np.asarray(var.get_value()), want, err_msg=str(path))
    # In PyTorch: peft applies the exported adapter to the transformers base and gives the merged export's logits.
    _peft_matches_merged(tiny_dir, tmp_path / "export")


def test_a_sharded_remat_lora_step_equals_the_single_device_step(tiny_dir, tmp_path, make_test_image):
    """fsdp x tensor over 8 devices with remat: the adapters sit in their layout and the step computes what one
    device computes."""
    samples = train_samples(tiny_dir, make_test_image)
    one = _trainer(tiny_dir, tmp_path / "one")
    cfg = load_config(None, [
        "--hf-checkpoint", str(tiny_dir), "--lr", "1e-2", "--weight-decay", "0", "--seq-buckets", "256",
        "--row-buckets", "16", "--patch-buckets", "128", "--logprob-chunk-size", "64", "--output-dir",
        str(tmp_path / "sharded"), "--lora-rank", "4", "--lora-alpha", "8", "--mesh-config",
        str(REPO / "configs" / "mesh" / "fsdp_tp.yaml"), "--remat", "full",
    ])
    sharded = Trainer(cfg, devices=jax.devices()[:8])
    sharded.build_policy(tiny_dir)
    assert dict(sharded.mesh.shape) == {"data": 1, "fsdp": 4, "expert": 1, "context": 1, "tensor": 2}
    q = sharded.state.params[0]  # layers.0 q_proj: lora_A [r, d] over fsdp, lora_B [n*h, r] over tensor
    assert tuple(q["lora_A"].sharding.spec) == (None, "fsdp") and tuple(q["lora_B"].sharding.spec)[:1] == ("tensor",)
    a, b = one.train_on(samples), sharded.train_on(samples)
    for key in ("train/loss_total", "train/grad_norm", "train/entropy_loss"):
        assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key


def test_target_modules_select_by_peft_names_and_unknown_names_fail(tiny_dir):
    model = abstract_model(tiny_model_config())
    params = nnx.state(model, nnx.Param)
    cfg = model.cfg
    picked = lora_setup(cfg, params, LoraOptions(lora_rank=2, lora_target_modules=["q_proj", "mlp.down_proj"]))
    assert {m.rsplit(".", 2)[-2] + "." + m.rsplit(".", 1)[-1] for m in picked.modules} == {"self_attn.q_proj", "mlp.down_proj"}
    vision = lora_setup(cfg, params, LoraOptions(lora_rank=2, lora_target_modules=["qkv"], lora_vision=True))
    assert vision.modules and all(m.startswith("model.visual.blocks.") and m.endswith(".attn.qkv") for m in vision.modules)
    # The patch embedding's convolution is adapted only when named (all-linear leaves it out), as a [out, C*T*P*P] map.
    every = lora_setup(cfg, params, LoraOptions(lora_rank=2, lora_vision=True))
    assert "model.visual.patch_embed.proj" not in every.modules
    (conv,) = lora_setup(cfg, params, LoraOptions(lora_rank=2, lora_target_modules=["patch_embed.proj"],
                                                  lora_vision=True)).sites
    assert conv.conv_shape == (32, 3, 2, 16, 16) and (conv.out_features, conv.in_features) == (32, 3 * 2 * 16 * 16)
    with pytest.raises(ConfigError, match=r"qkv.*--lora-vision"):
        lora_setup(cfg, params, LoraOptions(lora_rank=2, lora_target_modules=["qkv"]))
    with pytest.raises(ConfigError, match="q_prj"):
        lora_setup(cfg, params, LoraOptions(lora_rank=2, lora_target_modules=["q_prj"]))


def test_lora_plus_trains_lora_b_at_ratio_times_the_learning_rate(tmp_path):
    """--lora-plus-lr-ratio k: the run's optimizer moves lora_B k times as far as a plain Adam step at --lr (its first
    step after global-norm clipping, closed form: -lr * (g / (|g| + eps) + wd * p)), and lora_A and the modules to save exactly
    that far; ratio 1 is the plain optimizer (its state layout too)."""
    cfg = load_config(None, ["--lr", "1e-2", "--lora-rank", "4", "--lora-plus-lr-ratio", "16"])
    tx = make_optimizer(cfg.optim, 10)
    assert adapter_optimizer(tx, 1.0) is tx
    plus = adapter_optimizer(tx, cfg.lora.lora_plus_lr_ratio)
    keys = iter(jax.random.split(jax.random.key(5), 10))
    params = [{"lora_A": jax.random.normal(next(keys), (4, 24)), "lora_B": jax.random.normal(next(keys), (40, 4))},
              {"lora_A": jax.random.normal(next(keys), (4, 40)), "lora_B": jax.random.normal(next(keys), (24, 4))},
              {"weight": jax.random.normal(next(keys), (24,))}]
    grads = jax.tree.map(lambda p, k: jax.random.normal(k, p.shape), params,
                         jax.tree.unflatten(jax.tree.structure(params), list(keys)[:5]))
    updates, _ = plus.update(grads, plus.init(params), params)
    optim = cfg.optim
    norm = np.sqrt(sum(float(np.sum(np.asarray(g, np.float64) ** 2)) for g in jax.tree.leaves(grads)))
    clip = min(1.0, optim.clip_grad / norm)  # global-norm clipping first
    assert optim.weight_decay > 0  # AdamW's decoupled decay is part of the update LoRA+ scales
    for pair, grad, param in zip(updates, grads, params):
        for name, u in pair.items():
            g = np.asarray(grad[name], np.float64) * clip
            adam = g / (np.abs(g) + optim.adam_eps) + optim.weight_decay * np.asarray(param[name], np.float64)
            want = -optim.lr * (16.0 if name == "lora_B" else 1.0) * adam
            np.testing.assert_allclose(np.asarray(u), want, rtol=1e-4, atol=0, err_msg=name)
    with pytest.raises(ConfigError, match=r"lora.plus.lr.ratio"):
        load_config(None, ["--output-dir", str(tmp_path), "--lora-plus-lr-ratio", "0"])


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda p: p.stem)
def test_adapters_shard_like_their_kernels_under_every_layout_and_match_the_golden(layout):
    mesh_cfg = load_config(None, ["--mesh-config", str(layout)]).mesh
    current = adapter_layouts(tiny_model_config(), mesh_cfg, GOLDEN_OPTIONS, 8)
    for module, entry in current["adapters"].items():
        # lora_A [r, in]: the input dim shards as the kernel's input; lora_B [out, r]: the output as its output.
        assert entry["lora_A"]["spec"][1] == entry["kernel_in_spec"], module
        assert entry["lora_B"]["spec"][0] == entry["kernel_out_spec"], module
        assert entry["lora_A"]["spec"][0] is None and entry["lora_B"]["spec"][1] is None, module  # rank: never split
    golden = json.loads((GOLDENS / f"{layout.stem}.json").read_text())
    assert golden == json.loads(json.dumps(current)), f"{layout.name} re-shards the adapters; if intended: {REGENERATE}"


def _write_prompts(path: Path) -> None:
    with path.open("w") as f:
        for i in range(4):
            f.write(json.dumps({"problem": f"Say something about {i}.", "answer": "x", "images": []}) + "\n")


def test_a_lora_run_syncs_only_adapters_and_the_engine_serves_the_trainers_log_probs(tiny_dir, tmp_path):
    """Two steps of a run with the embedded engine: each version moves only the adapters (>= 5x fewer bytes than the
    model), the engine merges them into its base, and step 2's rollouts (sampled from the adapted weights) have the
    trainer's log-probs within 1e-4."""
    import asyncio

    from jaxrl_vlm.job.run import MainJob
    from jaxrl_vlm.job.run_log import read_metrics

    _write_prompts(tmp_path / "prompts.jsonl")
    cfg = load_config(None, [
        "--hf-checkpoint", str(tiny_dir), "--prompt-data", str(tmp_path / "prompts.jsonl"),
        "--prompt-style", "plain", "--rollout-interaction-env-path", "envs.letter_game", "--max-turns", "1",
        "--num-rollout", "2", "--rollout-batch-size", "2", "--n-samples-per-prompt", "4",
        "--rollout-max-response-len", "8", "--lr", "3e-2", "--seq-buckets", "64", "--row-buckets", "8",
        "--patch-buckets", "0", "--engine-max-batch", "8", "--engine-max-seq-len", "128",
        "--output-dir", str(tmp_path / "run"), "--rollout-temperature", "1.0", "--rollout-devices", "0",
        "--train-devices", "1", "--mesh-data", "1", "--lora-rank", "4", "--lora-alpha", "16",
    ])
    job = MainJob(cfg)
    # Each step's samples, with the policy that sampled them (the trainer's before the step trains).
    steps, train_on = [], job.trainer.train_on

    def recording(samples, *args, **kwargs):
        steps.append((samples, jax.tree.map(jnp.copy, job.trainer.policy_params())))
        return train_on(samples, *args, **kwargs)

    job.trainer.train_on = recording
    asyncio.run(job.run())
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["weight_version"] for r in records] == [1, 2]
    trainer = job.trainer
    adapter_bytes = adapter_nbytes(trainer.state.params, jnp.float32)
    model_bytes = sum(x.size * 4 for x in jax.tree.leaves(trainer.frozen))
    for r in records:
        assert r["sync/in_memory"] == 1.0 and r["sync/adapters_only"] == 1.0
        assert r["sync/gbytes"] * 1e9 == pytest.approx(adapter_bytes)
    assert model_bytes >= 5 * adapter_bytes
    assert records[1]["train/train_rollout_logprob_abs_diff"] < 1e-4
    # Token by token: the engine's log-probs of step 2's rollouts (sampled from the base plus the version-1 adapters)
    # are the trainer's under the same adapters within 1e-4.
    samples, adapted = steps[1]
    _, batch = job.trainer._batch(samples, np.zeros(len(samples), np.float32))
    mask = np.asarray(batch.loss_mask).astype(bool)
    ours = np.asarray(job.trainer._logprobs(adapted, batch))
    assert mask.sum() > 0 and np.abs(ours - np.asarray(batch.rollout_logprobs))[mask].max() <= 1e-4
    # The engine serves exactly the trainer's adapted kernels (the last version: the base plus the adapters).
    served = dict(nnx.to_flat_state(job.syncer.client.local_engine.runner.params))
    ours = dict(nnx.to_flat_state(trainer.policy_params()))
    path = ("layers", 0, "attn", "q_kernel_dnh")
    np.testing.assert_allclose(np.asarray(served[path].get_value()), np.asarray(ours[path].get_value()), atol=1e-6)
    assert not np.allclose(np.asarray(ours[path].get_value()), np.asarray(dict(nnx.to_flat_state(trainer.frozen))[path].get_value()))
    assert not list((tmp_path / "run").rglob("weights_v*"))
    # The finished run wrote its adapters as a PEFT directory beside final_model/.
    final = load_peft_adapter(tmp_path / "run" / "final_adapter", trainer.lora)
    assert all(np.array_equal(got[k], put[k]) for got, put in zip(final, _host_pairs(trainer.state.params)) for k in got)


def test_the_color_reveal_config_trains_every_adapter_it_syncs(tiny_dir, tmp_path, make_test_image):
    """configs/color_reveal_lora_tiny.yaml: every adapter and every module trained in full gets a gradient (two Adam
    steps on a batch with a picture move every lora_B off zero and every saved module off the base), so no synced
    byte is dead weight, and a sync moves >= 5x fewer bytes than the model's fp32 parameters. The tiny model's last
    deepstack merger is the trap: its features are added after the last decoder layer, at the picture's own
    positions, which no scored token reads (HF's Qwen3-VL does the same), so adapters there never train."""
    cfg = load_config(str(REPO / "configs" / "color_reveal_lora_tiny.yaml"), [
        "--hf-checkpoint", str(tiny_dir), "--output-dir", str(tmp_path / "run"), "--seq-buckets", "256",
        "--row-buckets", "16", "--patch-buckets", "128", "--mesh-data", "1"])
    trainer = Trainer(cfg, devices=jax.devices()[:1])
    trainer.build_policy(tiny_dir)
    base = nnx.state(abstract_model(trainer.model_cfg), nnx.Param)
    last = len(trainer.model_cfg.vision.deepstack_visual_indexes) - 1
    assert last == trainer.model_cfg.text.num_hidden_layers - 1  # the trap is there to avoid
    assert not [m for m in trainer.lora.modules + tuple(s.module for s in trainer.lora.saved)
                if f"deepstack_merger_list.{last}." in m]
    before = _host_pairs(trainer.state.params)
    samples = train_samples(tiny_dir, make_test_image)
    trainer.train_on(samples)
    trainer.train_on(samples)
    after = _host_pairs(trainer.state.params)
    n = len(trainer.lora.sites)
    dead = [s.module for s, pair in zip(trainer.lora.sites, after) if not np.abs(pair["lora_B"]).max() > 0]
    dead += [m.module for m, old, new in zip(trainer.lora.saved, before[n:], after[n:])
             if all(np.array_equal(old[k], new[k]) for k in old)]
    assert not dead, f"adapters that never train but are synced every step: {dead}"
    model_bytes = 4 * sum(int(np.prod(v.get_value().shape)) for _, v in nnx.to_flat_state(base))
    assert 5 * adapter_nbytes(trainer.state.params, jnp.float32) <= model_bytes


def regenerate_goldens() -> None:
    GOLDENS.mkdir(parents=True, exist_ok=True)
    for layout in LAYOUTS:
        mesh_cfg = load_config(None, ["--mesh-config", str(layout)]).mesh
        dump = adapter_layouts(tiny_model_config(), mesh_cfg, GOLDEN_OPTIONS, 8)
        (GOLDENS / f"{layout.stem}.json").write_text(json.dumps(dump, indent=1) + "\n")


if __name__ == "__main__":
    import sys

    if sys.argv[1:] != ["--regenerate-goldens"]:
        raise SystemExit(f"usage: {REGENERATE}")
    regenerate_goldens()
