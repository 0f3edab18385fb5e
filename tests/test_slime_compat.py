"""slime's own run line: every flag of its geo3k VLM multi-turn script is accepted, mapped onto our settings with
slime's meaning, or accepted with a logged reason; the flag map of docs/guides/slime.md covers every flag."""

from __future__ import annotations

import math
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import yaml
from _slime_geo3k_args import MODEL, TRAIN_DATA, argv, flags

from jaxrl_vlm import slime_flags
from jaxrl_vlm.cli import main
from jaxrl_vlm.config import FLAGS, ConfigError, load_config
from jaxrl_vlm.models.moe import load_balancing_loss
from jaxrl_vlm.rl.router_losses import router_z_loss
from jaxrl_vlm.rl.train_step import make_optimizer
from jaxrl_vlm.sglang_launcher import JAX_MEM_FRACTION_ENV, SGLangLaunchError, apply_colocation

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("backend", ["fsdp", "megatron"])
def test_jaxrl_vlm_config_accepts_slimes_whole_run_line(backend, capsys):
    assert main(["config", *argv(backend)]) == 0
    out = capsys.readouterr()
    cfg = yaml.safe_load(out.out)
    # slime's values, under our names.
    assert cfg["optim"] == {**cfg["optim"], "optimizer": "adam", "lr": 1e-6, "lr_decay_style": "constant",
                            "weight_decay": 0.1, "adam_beta1": 0.9, "adam_beta2": 0.98}
    assert cfg["rollout"]["n_samples_per_prompt"] == 8 and cfg["rollout"]["rollout_batch_size"] == 64
    assert cfg["rollout"]["num_rollout"] == 3000 and cfg["rollout"]["rollout_max_response_len"] == 4096
    assert cfg["rollout"]["rollout_temperature"] == 1.0
    assert cfg["train"]["global_batch_size"] == 512
    assert cfg["algo"] == {**cfg["algo"], "advantage_estimator": "grpo", "policy_loss": "ppo_clip", "eps_clip": 0.2,
                           "eps_clip_high": 0.28, "kl_loss_coef": 0.0, "kl_loss_type": "low_var_kl", "kl_coef": 0.0,
                           "entropy_coef": 0.0, "rm_type": "math"}
    assert cfg["data"]["prompt_data"] == TRAIN_DATA and cfg["data"]["image_key"] == "images"
    assert cfg["data"]["input_key"] == "problem" and cfg["data"]["label_key"] == "answer" and cfg["data"]["rollout_shuffle"]
    assert cfg["model"]["hf_checkpoint"] == MODEL and cfg["checkpoint"]["load"] is None
    assert cfg["model"]["remat"] == "full"  # --gradient-checkpointing / --recompute-granularity full
    # The custom config and episode function resolve to this project's equivalents of slime's example.
    assert cfg["rollout"]["custom_generate_function_path"] == "rollout.multiturn.generate"
    assert Path(cfg["rollout"]["custom_config_path"]).name == "geo3k_multiturn.yaml"
    assert cfg["multiturn"]["max_turns"] == 3
    # sglang group: forwarded to a launched SGLang.
    sglang = cfg["engine"]["sglang_args"]
    assert "--mem-fraction-static" in sglang and "0.6" in sglang
    assert cfg["engine"]["tp_size"] == 1  # --rollout-num-gpus-per-engine: the engine's (and a launched SGLang's) tp
    graph_bs = sglang[sglang.index("--cuda-graph-bs-decode") + 1 :]  # SGLang 0.5.23 renamed --cuda-graph-bs
    assert graph_bs[:5] == ["1", "2", "4", "8", "16"] and "256" in graph_bs
    assert cfg["engine"]["colocate"] is True
    # Eval group (slime's syntax, sliced path) and wandb group.
    assert cfg["eval"]["eval_interval"] == 20 and cfg["eval"]["eval_prompt_data"] == ["geo3k_eval", f"{TRAIN_DATA}@[0:64]"]
    assert cfg["eval"]["eval_top_k"] == 1 and cfg["eval"]["eval_max_response_len"] == 4096
    assert cfg["tracking"] == {**cfg["tracking"], "use_wandb": True, "wandb_project": "slime-dev",
                               "wandb_group": "geo3k_vlm_multi_turn", "wandb_key": "<redacted>"}
    assert "test-key" not in out.out + out.err
    if backend == "megatron":
        assert cfg["mesh"]["mesh_tensor"] == 4
        assert cfg["batching"]["max_tokens_per_device"] == 4096 and cfg["batching"]["packing"] is True
    else:
        assert "--attention-backend" in sglang and sglang[sglang.index("--attention-backend") + 1] == "fa3"
    # Every flag that is not ours left a note saying what became of it.
    for flag in {t for t in argv(backend) if t.startswith("--")} - set(FLAGS):
        assert f"slime flag {flag}" in out.err, flag


def test_every_flag_of_the_script_is_in_the_guides_flag_map():
    guide = (ROOT / "docs" / "guides" / "slime.md").read_text()
    table = guide[guide.index("## The flag map") :]
    first_cells = [line.split("|")[1] for line in table.splitlines() if line.startswith("| `")]
    rows = {flag for cell in first_cells for flag in re.findall(r"`(--[a-z0-9-]+)", cell)}
    missing = [f for f in flags() if f not in rows]
    assert not missing, f"docs/guides/slime.md's flag map lacks {missing}"
    assert all(f in rows for f in slime_flags.SLIME_FLAGS if slime_flags.SLIME_FLAGS[f].group != "model"), \
        sorted(set(slime_flags.SLIME_FLAGS) - rows)


@pytest.mark.parametrize(("granularity", "remat"), [("full", "full"), ("selective", "dots")])
def test_megatrons_recompute_granularity_maps_to_a_remat_policy(granularity, remat):
    # selective: Megatron recomputes the core attention and keeps the linear layers' outputs, as `dots` does.
    assert load_config(None, ["--recompute-granularity", granularity]).model.remat == remat


def test_context_parallel_size_maps_to_the_context_axis():
    assert load_config(None, ["--context-parallel-size", "4"]).mesh.mesh_context == 4


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--pipeline-model-parallel-size", "2"], "no pipeline parallelism"),
        (["--attention-dropout", "0.1"], "no dropout"),
        (["--multimodal-keys", '{"video": "videos"}'], "only images"),
        (["--multimodal-keys", "images"], "not JSON"),
        (["--gradient-checkpointing", "yes"], "is a switch"),
        (["--advantage-estimator", "gspo", "--policy-loss", "cispo"], "conflicts with policy_loss=cispo"),
        (["--policy-loss", "grpo_plus"], r"policy_loss='grpo_plus' is not one of \['cispo', 'gspo', 'ppo_clip'"),
        (["--advantage-estimator", "ppo"], "not one of"),
        (["--use-wandbb"], "did you mean '--use-wandb'"),
        (["--recompute-granularity", "partial"], r"Megatron's choices are \['full', 'selective'\]"),
    ],
)
def test_meaningless_values_are_clear_errors(extra, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, extra)


@pytest.mark.parametrize("name", ["gspo", "cispo"])
def test_slimes_advantage_estimator_spelling_selects_the_loss(name):
    cfg = load_config(None, ["--advantage-estimator", name])
    assert (cfg.algo.advantage_estimator, cfg.algo.policy_loss) == ("grpo", name)
    assert any(f"advantage_estimator {name}" in n for n in cfg.notes)


def test_external_engine_addresses():
    one = load_config(None, ["--rollout-external-engine-addrs", "10.0.0.1:30000"])
    assert one.engine.engine_url == "http://10.0.0.1:30000" and one.engine.engine_worker_urls == []
    several = load_config(None, ["--rollout-external-engine-addrs", "h1:1", "http://h2:2", "--engine-url", "http://r:9"])
    assert several.engine.engine_worker_urls == ["http://h1:1", "http://h2:2"] and several.engine.engine_url == "http://r:9"


def test_load_keeps_our_checkpoints_and_takes_an_hf_directory_as_the_model(tmp_path):
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    cfg = load_config(None, ["--load", str(hf)])
    assert (cfg.model.hf_checkpoint, cfg.checkpoint.load) == (str(hf), None)
    ours = tmp_path / "checkpoints"
    (ours / "3").mkdir(parents=True)
    cfg = load_config(None, ["--load", str(ours), "--hf-checkpoint", str(hf)])
    assert (cfg.model.hf_checkpoint, cfg.checkpoint.load) == (str(hf), str(ours))
    with pytest.raises(ConfigError, match="pass the model once"):
        load_config(None, ["--load", str(hf), "--hf-checkpoint", str(tmp_path / "other")])


def test_sglang_flags_are_forwarded_but_ours_stay_ours():
    cfg = load_config(None, ["--sglang-enable-torch-compile", "--sglang-server-concurrency", "32",
                             "--sglang-chunked-prefill-size", "4096"])
    assert cfg.engine.sglang_args == ["--enable-torch-compile", "--chunked-prefill-size", "4096"]
    assert cfg.rollout.sglang_server_concurrency == 32


def test_colocation_splits_gpu_memory_between_jax_and_sglang():
    cfg = load_config(None, ["--colocate", "--launch-sglang", "--sglang-mem-fraction-static", "0.6"])
    env: dict[str, str] = {}
    note = apply_colocation(cfg.engine, env)
    assert env[JAX_MEM_FRACTION_ENV] == "0.35" and "0.35" in note
    assert cfg.engine.sglang_args == ["--mem-fraction-static", "0.6"]
    # Without a fraction, SGLang gets a colocated default instead of its own ~0.9.
    cfg = load_config(None, ["--colocate", "--launch-sglang"])
    env = {JAX_MEM_FRACTION_ENV: "0.3"}
    apply_colocation(cfg.engine, env)
    assert env[JAX_MEM_FRACTION_ENV] == "0.3" and cfg.engine.sglang_args == ["--mem-fraction-static", "0.45"]
    cfg = load_config(None, ["--colocate", "--launch-sglang", "--sglang-mem-fraction-static", "0.97"])
    with pytest.raises(SGLangLaunchError, match="lower --sglang-mem-fraction-static"):
        apply_colocation(cfg.engine, {})
    # Not colocated (or the embedded engine): nothing is touched.
    env = {}
    assert apply_colocation(load_config(None, ["--colocate"]).engine, env) is None and env == {}


def test_adam_is_slimes_adam_with_decoupled_weight_decay():
    cfg_adam = load_config(None, ["--optimizer", "adam", "--lr", "0.1", "--weight-decay", "0.5", "--clip-grad", "0"])
    cfg_adamw = load_config(None, ["--optimizer", "adamw", "--lr", "0.1", "--weight-decay", "0.5", "--clip-grad", "0"])
    params = {"w": np.array([2.0, -4.0], np.float32)}
    grads = {"w": np.array([1.0, 0.0], np.float32)}
    results = []
    for cfg in (cfg_adam, cfg_adamw):
        tx = make_optimizer(cfg.optim, total_steps=10)
        updates, _ = tx.update(grads, tx.init(params), params)
        results.append(np.asarray(optax.apply_updates(params, updates)["w"]))
    np.testing.assert_array_equal(results[0], results[1])
    # Decoupled: the decay is lr * wd * w, outside Adam's normalisation. A zero gradient still decays its weight by
    # exactly lr * wd * w (coupled L2 would have gone through the moments: 0.1 * sign(...) instead).
    adam_step = 0.1 * 1.0 / (1.0 + 1e-8)  # m_hat / (sqrt(v_hat) + eps) = 1 for the first step
    np.testing.assert_allclose(results[0], [2.0 - adam_step - 0.1 * 0.5 * 2.0, -4.0 - 0.1 * 0.5 * -4.0], rtol=1e-6)


def test_lr_decay_iters_ends_the_decay_there_and_holds_min_lr_like_megatron():
    """Megatron's cosine: lr = min + (max - min) * 0.5 * (1 + cos(pi * (step - warmup) / (decay_iters - warmup)))
    up to --lr-decay-iters, min_lr after it; linear warm-up from 0 before. The run's length does not matter then."""
    cfg = load_config(None, ["--lr", "0.1", "--min-lr", "0.01", "--lr-decay-style", "cosine", "--lr-warmup-iters", "2",
                             "--lr-decay-iters", "10", "--clip-grad", "0", "--weight-decay", "0"])
    params = {"w": np.zeros(1, np.float32)}
    grads = {"w": np.ones(1, np.float32)}
    for total_steps in (20, 10**6):
        tx = make_optimizer(cfg.optim, total_steps=total_steps)
        state = tx.init(params)
        for step in range(14):
            updates, state = tx.update(grads, state, params)
            # Adam's first steps with a constant gradient move by lr exactly (m_hat / sqrt(v_hat) = 1).
            if step < 2:
                want = 0.1 * step / 2
            elif step < 10:
                want = 0.01 + 0.09 * 0.5 * (1 + math.cos(math.pi * (step - 2) / 8))
            else:
                want = 0.01
            np.testing.assert_allclose(-float(updates["w"][0]), want, rtol=1e-5, atol=1e-9)
    # Without it the decay spans the whole run.
    whole = load_config(None, ["--lr", "0.1", "--min-lr", "0.01", "--lr-decay-style", "linear", "--clip-grad", "0",
                               "--weight-decay", "0"])
    tx = make_optimizer(whole.optim, total_steps=10)
    state = tx.init(params)
    lrs = []
    for _ in range(12):
        updates, state = tx.update(grads, state, params)
        lrs.append(-float(updates["w"][0]))
    np.testing.assert_allclose(lrs, [0.1 - 0.009 * i for i in range(10)] + [0.01, 0.01], rtol=1e-5)
    with pytest.raises(ValueError, match="lr_decay_iters"):
        load_config(None, ["--lr-decay-iters", "0"])


def _megatron_router_losses(logits_lne: jax.Array, top_k: int, aux_coeff: float, z_coeff: float) -> jax.Array:
    """Megatron-LM's router terms as its `TopKRouter` adds them: per sparse layer `switch_load_balancing_loss_func`
    (softmax probs summed over tokens, times the top-k count per expert (no gradient), times
    E * coeff / (k * T^2)) and `z_loss_func` (coeff * mean over tokens of logsumexp^2); every layer's terms reach
    the gradient (MoEAuxLossAutoScaler), so the total is their sum over layers."""
    e = logits_lne.shape[-1]
    total = jnp.zeros((), jnp.float32)
    for layer in logits_lne:
        probs = jax.nn.softmax(layer, axis=-1)
        counts = jax.lax.stop_gradient(jax.nn.one_hot(jax.lax.top_k(probs, top_k)[1], e).sum(axis=(0, 1)))
        t = layer.shape[0]
        total += jnp.sum(probs.sum(0) * counts) * e * aux_coeff / (top_k * t * t)
        total += z_coeff * jnp.mean(jax.nn.logsumexp(layer, axis=-1) ** 2)
    return total


def test_megatrons_router_loss_coefficients_map_with_the_conversion_the_note_states():
    cfg = load_config(None, ["--moe-aux-loss-coeff", "0.01", "--moe-z-loss-coeff", "0.002",
                             "--expert-model-parallel-size", "2"])
    assert (cfg.algo.router_aux_loss_coef, cfg.algo.router_z_loss_coef, cfg.mesh.mesh_expert) == (0.01, 0.002, 2)
    assert any("--router-aux-loss-coef c*L/k" in n for n in cfg.notes)
    assert any("--router-z-loss-coef c*L" in n for n in cfg.notes)
    # The conversions the notes give, against Megatron's closed form: ours (transformers' aux loss, ST-MoE's z-loss
    # averaged over layers) with c*L/k and c*L equals Megatron's with c, in value and gradient, whenever every
    # sparse layer has the same expert load; the aux loss differs otherwise (it pools the layers' loads).
    k, c, cz = 2, 0.01, 0.002
    x = jax.random.normal(jax.random.key(0), (12, 5), jnp.float32)
    valid = jnp.ones(12, bool)

    @jax.jit
    def both(logits, aux_coeff, z_coeff):
        """(Megatron's value and gradient with c, ours with the notes' conversion of c), for [L, N, E] logits."""
        layers = logits.shape[0]

        def ours(x):
            return (aux_coeff * layers / k * load_balancing_loss(x, k, valid)
                    + z_coeff * layers * router_z_loss(x, valid))

        return (jax.value_and_grad(_megatron_router_losses)(logits, k, aux_coeff, z_coeff),
                jax.value_and_grad(ours)(logits))

    same_load = jnp.stack([x, 2.0 * x, 0.5 * x])  # positive scales: each token's top-k, so each layer's load, agree
    for logits in (jnp.stack([x, x, x]), same_load):
        (want, want_grad), (got, got_grad) = both(logits, c, cz)
        np.testing.assert_allclose(float(got), float(want), rtol=1e-5)
        np.testing.assert_allclose(np.asarray(got_grad), np.asarray(want_grad), rtol=1e-4, atol=1e-9)
    other_loads = jax.random.normal(jax.random.key(1), (3, 12, 5), jnp.float32)
    (want, _), (got, _) = both(other_loads, c, 0.0)
    assert abs(float(got) - float(want)) > 1e-5 * float(want)
    (want, _), (got, _) = both(other_loads, 0.0, cz)
    np.testing.assert_allclose(float(got), float(want), rtol=1e-5)
