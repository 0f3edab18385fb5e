"""The train step's mixture-of-experts terms and routing replay, on a tiny random Qwen3-VL-MoE (text only; no
torch: the references are numpy closed forms, and transformers' `load_balancing_loss_func` itself is matched
by `moe.load_balancing_loss` in test_qwen3_vl_moe.py).

Checked: with --router-aux-loss-coef c the step's total loss grows by exactly c times the Switch load-balancing
loss computed in numpy from the router logits of the real tokens (padding excluded), and --router-z-loss-coef
likewise with ST-MoE's mean logsumexp^2; with zero advantages only the router kernels move (the aux-loss gradient
reaches the router and nothing else); the per-layer expert-load metrics equal a numpy bincount of the router's
top-k over real tokens; packed batches carry each sample's engine expert ids exactly under its tokens (-1 on
padding and unrecorded positions); replaying the router's own ids reproduces the log-probs bit for bit, replaying
other ids changes them, and a dense family logs no MoE metric; the embedded engine's runner records each fed
position's experts by page (prefill, decode, and an extend over a reused prefix) equal to the trainer's router, and
SGLang's base64 `meta_info.routed_experts` carries them unchanged. With --use-routing-replay and two optimizer
steps on one rollout, the trainer records the old policy's experts before the first update and the second
update's current forward routes with them (its `ppo_kl` is that of a forward with those ids forced, not of the
router's new choice); the flag is a no-op with one update per rollout or under R3, and an error on a dense model.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import optax
import pytest
from flax import nnx

import jax
import jax.numpy as jnp
from jaxrl_vlm.batching import build_train_batch
from jaxrl_vlm.config import load_config
from jaxrl_vlm.errors import ConfigError
from jaxrl_vlm.job.trainer import Trainer, check_routing_replay, replays_old_routing
from jaxrl_vlm.models.config import from_hf_dict
from jaxrl_vlm.models.hf_io import to_hf
from jaxrl_vlm.rl.losses import LossConfig
from jaxrl_vlm.rl.train_step import StepConfig, TrainState, policy_logprobs, train_step
from jaxrl_vlm.tiny import init_tiny_model
from rollout.sample import Sample, Status

E, K, LAYERS = 4, 2, 3
SPECIALS = dict(vision_start_token_id=250, vision_end_token_id=251, image_token_id=252, video_token_id=253)
TEXT = dict(vocab_size=256, hidden_size=32, intermediate_size=48, num_hidden_layers=LAYERS, num_attention_heads=2,
            num_key_value_heads=1, head_dim=16, rms_norm_eps=1e-6, num_experts=E, num_experts_per_tok=K,
            moe_intermediate_size=24, decoder_sparse_step=1, mlp_only_layers=[1],
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 2, 2],
                             "mrope_interleaved": True})
VISION = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=1, patch_size=16, temporal_patch_size=2,
              spatial_merge_size=2, out_hidden_size=32, num_position_embeddings=16, deepstack_visual_indexes=[])
SPARSE = [0, 2]


def _cfg(model_type: str = "qwen3_vl_moe"):
    text = dict(TEXT, model_type=model_type + "_text")
    if model_type == "qwen3_vl":
        text = {k: v for k, v in text.items() if k not in ("num_experts", "num_experts_per_tok", "moe_intermediate_size",
                                                             "decoder_sparse_step", "mlp_only_layers")}
    return from_hf_dict(dict(model_type=model_type, text_config=text, vision_config=VISION, tie_word_embeddings=False,
                             **SPECIALS))


def _samples(routed: bool, seed: int = 0) -> list[Sample]:
    """Six text episodes of different lengths; with `routed`, engine ids for all but the last few positions."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(6):
        s = Sample(group_index=i // 3, index=i % 3)
        s.set_prompt_tokens(rng.integers(1, 240, size=4 + i).tolist())
        n = 3 + 2 * i
        s.append_model_tokens(rng.integers(1, 240, size=n).tolist(), (-rng.uniform(0.1, 2.0, size=n)).tolist())
        s.reward = float(i % 2)
        s.set_status(Status.COMPLETED)
        if routed:  # SGLang's layout: every decoder layer, -1 in the dense one; fewer rows than positions
            ids = np.stack([rng.permutation(E)[:K] for _ in range((len(s.tokens) - 1 - i % 2) * LAYERS)])
            ids = ids.reshape(-1, LAYERS, K).astype(np.int32)
            ids[:, 1] = -1
            s.rollout_routed_experts = ids.reshape(len(ids), LAYERS * K)
        s.validate()
        out.append(s)
    return out


def _batch(cfg, samples, *, replay=False, rows=None, packing=True, adv=None):
    adv = np.linspace(-1, 1, len(samples)) if adv is None else adv
    return build_train_batch(samples, np.asarray(adv, np.float32), cfg, seq_buckets=[32], row_buckets=[2, 4, 8],
                             patch_buckets=[], packing=packing, micro_batch_rows=rows, aggregation="token_mean",
                             aggregation_constant=None, overlong_policy="error", routing_replay=replay)


@pytest.fixture(scope="module")
def moe():
    cfg = _cfg()
    assert list(cfg.text.sparse_layers) == SPARSE
    model = init_tiny_model(cfg, seed=0)
    graphdef, params = nnx.split(model, nnx.Param)
    return cfg, model, graphdef, params


def _step(graphdef, params, batch, *, aux=0.0, z=0.0, lr=0.0):
    tx = optax.adam(lr)
    loss = LossConfig(num_sequences=8, aggregation="token_mean", router_aux_loss_coef=aux, router_z_loss_coef=z)
    cfg = StepConfig(loss=loss, logprob_chunk_size=32)
    state = TrainState(params, tx.init(params), jnp.zeros((), jnp.int32), jax.random.key_data(jax.random.key(0)))
    arrays = jax.tree.map(jnp.asarray, batch.arrays)
    return jax.jit(lambda st, b: train_step(graphdef, tx, cfg, st, b, None, None))(state, arrays)


@nnx.jit
def _route(model, tokens, positions, segment_ids):
    """The router's view of a forward: (router logits, top-k ids), each [L_sparse, B, T, ...]."""
    _, routing = model.forward(tokens, positions, segment_ids, None)
    return routing.logits, routing.topk_ids


def _np_router(model, batch):
    """(router logits [L, N, E] of the batch's real tokens, their top-k ids [L, N, k]) from our forward."""
    a = batch.arrays
    logits, ids = [], []
    for k in range(a.tokens.shape[0]):
        mb = jax.tree.map(lambda x: x[k], a)
        lg, top = _route(model, jnp.asarray(mb.tokens), jnp.asarray(mb.positions), jnp.asarray(mb.segment_ids))
        real = mb.segment_ids.reshape(-1) > 0
        logits.append(np.asarray(lg).reshape(len(SPARSE), -1, E)[:, real])
        ids.append(np.asarray(top).reshape(len(SPARSE), -1, K)[:, real])
    return np.concatenate(logits, 1).astype(np.float64), np.concatenate(ids, 1)


def _np_aux(logits: np.ndarray) -> float:
    """Switch/transformers: E * sum_e (top-k assignments to e / tokens) * (mean prob of e), layers pooled."""
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    top = np.argsort(-p, axis=-1)[..., :K]
    counts = np.stack([(top == e).sum() for e in range(E)]).astype(np.float64)
    rows = logits.shape[0] * logits.shape[1]
    return float(E * np.sum(counts / rows * p.reshape(-1, E).sum(0) / rows))


def _np_z(logits: np.ndarray) -> float:
    m = logits.max(-1)
    return float(np.mean((m + np.log(np.exp(logits - m[..., None]).sum(-1))) ** 2))


@pytest.fixture(scope="module")
def stepped(moe):
    """One compiled step with both router terms on, zero advantages (so the policy loss and its gradient are 0:
    everything the step trains comes from the router terms) and a positive learning rate."""
    cfg, model, graphdef, params = moe
    batch = _batch(cfg, _samples(False), adv=np.zeros(6))
    assert batch.arrays.tokens.shape[0] == 1 and (batch.arrays.segment_ids == 0).any()  # one micro-batch, padded
    new, metrics = _step(graphdef, params, batch, aux=0.3, z=0.05, lr=1e-2)
    return batch, new, metrics


def test_aux_and_z_loss_are_the_closed_forms_times_their_coefs_and_load_metrics_count_real_tokens(moe, stepped):
    _, model, _, _ = moe
    batch, _, metrics = stepped
    logits, ids = _np_router(model, batch)
    aux, z = _np_aux(logits), _np_z(logits)
    assert aux > 1.0
    np.testing.assert_allclose(float(metrics["moe/aux_loss"]), aux, rtol=1e-5)
    np.testing.assert_allclose(float(metrics["moe/z_loss"]), z, rtol=1e-5)
    assert float(metrics["train/loss"]) == 0.0  # zero advantages: the total is the router terms alone
    np.testing.assert_allclose(float(metrics["train/loss_total"]), 0.3 * aux + 0.05 * z, rtol=1e-5)
    # Expert load: a numpy count of the router's top-k over the real tokens, per sparse layer.
    for i in range(len(SPARSE)):
        counts = np.bincount(ids[i].reshape(-1), minlength=E)
        assert counts.sum() == K * int((batch.arrays.segment_ids > 0).sum())
        np.testing.assert_allclose(float(metrics[f"moe/layer{i}/max_over_mean"]), counts.max() / counts.mean(), rtol=1e-6)
        assert float(metrics[f"moe/layer{i}/max_tokens"]) == counts.max()
    assert float(metrics["moe/dropped_tokens"]) == 0.0


def test_router_loss_gradient_reaches_the_routers(moe, stepped):
    _, _, _, params = moe
    _, new, _ = stepped
    flat_new = dict(nnx.to_flat_state(new.params))
    moved = {".".join(map(str, p)) for p, v in nnx.to_flat_state(params)
             if not np.array_equal(np.asarray(v.get_value()), np.asarray(flat_new[p].get_value()))}
    assert {f"layers.{i}.mlp.router_kernel_de" for i in SPARSE} <= moved
    # What no router reads gets no gradient: the last sparse layer's experts, the final norm and the LM head.
    untouched = {"layers.2.mlp.gate_experts_edf", "layers.2.mlp.up_experts_edf", "layers.2.mlp.down_experts_efd",
                 "lm_head_dv", "final_norm.scale"}
    assert not moved & untouched, moved & untouched


def test_replay_ids_follow_the_tokens_through_packing_and_drive_the_forward(moe):
    cfg, _, graphdef, params = moe
    samples = _samples(True)
    batch = _batch(cfg, samples, replay=True, rows=2)
    a = batch.arrays
    assert a.routed_experts.shape == (*a.tokens.shape, len(SPARSE), K)
    assert (a.routed_experts[a.segment_ids == 0] == -1).all()
    seen = 0
    for p in batch.layout.placements:
        s = samples[p.sample_position]
        got = a.routed_experts[p.micro_batch, p.row, p.offset : p.offset + p.length]
        want = np.full((p.length, len(SPARSE), K), -1)
        n = s.rollout_routed_experts.shape[0]
        want[:n] = s.rollout_routed_experts.reshape(n, LAYERS, K)[:, SPARSE]
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(a.tokens[p.micro_batch, p.row, p.offset : p.offset + p.length], s.tokens)
        seen += 1
    assert seen == len(samples) and len({p.row for p in batch.layout.placements}) < len(samples)  # packed rows

    def logprobs(mb):  # eager: three calls cost less than one compile of this program
        return policy_logprobs(graphdef, params, mb, chunk_size=32, need_entropy=False)[0]

    mb0 = jax.tree.map(lambda x: jnp.asarray(x[0]), a)
    real = a.loss_mask[0] > 0
    # All -1 (nothing recorded): the router's own choice.
    plain = np.asarray(logprobs(mb0._replace(routed_experts=jnp.full_like(mb0.routed_experts, -1))))
    assert np.abs(np.asarray(logprobs(mb0)) - plain)[real].max() > 1e-3  # the engine's (random) ids took effect
    # The router's own ids (an unforced forward's), replayed: the same log-probs bit for bit.
    own = jnp.moveaxis(_route(nnx.merge(graphdef, params), mb0.tokens, mb0.positions, mb0.segment_ids)[1], 0, 2)
    np.testing.assert_array_equal(np.asarray(logprobs(mb0._replace(routed_experts=own))), plain)


def test_replay_needs_recorded_ids_and_a_dense_family_logs_no_moe_metric(moe):
    cfg = moe[0]
    with pytest.raises(ValueError, match="no rollout_routed_experts"):
        _batch(cfg, _samples(False), replay=True)
    bad = _samples(True)
    bad[2].rollout_routed_experts = bad[2].rollout_routed_experts[:, :4]
    with pytest.raises(ValueError, match=r"expected \[positions, 3 layers x 2 experts"):
        _batch(cfg, bad, replay=True)
    dense = _cfg("qwen3_vl")
    graphdef, params = nnx.split(init_tiny_model(dense, seed=0), nnx.Param)
    batch = _batch(dense, _samples(False))
    tx = optax.adam(0.0)
    step_cfg = StepConfig(loss=LossConfig(num_sequences=8, aggregation="token_mean", router_aux_loss_coef=1.0))
    state = TrainState(params, tx.init(params), jnp.zeros((), jnp.int32), jax.random.key_data(jax.random.key(0)))
    _, metrics = jax.eval_shape(lambda st, b: train_step(graphdef, tx, step_cfg, st, b, None, None), state, batch.arrays)
    assert "train/loss_total" in metrics and not [k for k in metrics if k.startswith("moe/")]


def test_sample_keeps_routed_experts_through_its_dict(moe):
    s = _samples(True)[3]
    back = Sample.from_dict(s.to_dict())
    np.testing.assert_array_equal(back.rollout_routed_experts, s.rollout_routed_experts)
    assert back.rollout_routed_experts.dtype == np.int32
    s2 = dataclasses.replace(s, rollout_routed_experts=np.zeros((len(s.tokens), LAYERS * K), np.int32))
    with pytest.raises(ValueError, match="rollout_routed_experts"):
        s2.validate()


def test_engine_records_each_fed_position_s_experts_by_page_and_sends_them_as_sglang_does(moe):
    """The embedded engine's runner (fp32, greedy): a prefill, three decode steps, then an "extend" prefill over a
    reused prefix; the experts read back by page table equal the trainer's router on the same tokens, -1 in the
    dense layer, and travel through SGLang's base64 encoding unchanged."""
    from jaxrl_vlm.engine import EngineOptions
    from jaxrl_vlm.engine.runner import IntRow, ModelRunner
    from rollout.sglang_wire import decode_routed_experts, encode_routed_experts, generate_response

    cfg, model, _, _ = moe
    runner = ModelRunner(model, EngineOptions(max_batch=2, max_seq_len=64, max_total_tokens=128, page_size=8,
                                              min_prefill_bucket=16, min_kv_bucket=64, decode_batch_sizes=(2,)), ())
    assert runner.records_experts
    rng = np.random.default_rng(3)
    prompt = rng.integers(1, 240, size=11).astype(np.int32)
    ints, floats = np.zeros((6,), np.int32), np.zeros((3,), np.float32)  # temperature 0: greedy
    pages = [3, 5, 9, 12]
    tok, _ = runner.prefill(0, pages, prompt, np.broadcast_to(np.arange(11, dtype=np.int32), (3, 11)), None, None,
                            None, ints, floats)
    seq = list(prompt) + [tok]
    for _ in range(3):
        col = np.zeros((6, 1), np.int32)
        col[IntRow.TOKEN, 0], col[IntRow.LENGTH, 0] = seq[-1], len(seq) - 1
        ids, _ = runner.decode(np.array([0], np.int32), np.array([pages], np.int32), col, np.zeros((3, 1), np.float32),
                               False)
        seq.append(int(ids[0]))
    n = len(seq) - 1  # every fed position: the last sampled token never was
    got = runner.routed_experts(pages, n)
    assert got.shape == (n, LAYERS, K) and (got[:, 1] == -1).all()
    ids = np.asarray(jnp.asarray(seq[:n], jnp.int32)[None])
    top = _route(model, jnp.asarray(ids), jnp.broadcast_to(jnp.arange(n)[None, None], (3, 1, n)), jnp.ones((1, n), jnp.int32))[1]
    want = np.moveaxis(np.asarray(top)[:, 0], 0, 1)  # [n, L_sparse, k]
    np.testing.assert_array_equal(np.sort(got[:, SPARSE], -1), np.sort(want, -1))
    # A second request reusing the first page (8 positions) computes only its suffix; its routing read by page
    # table is the first request's on the prefix and its own after it.
    more = np.asarray(seq[:8] + list(rng.integers(1, 240, size=6)), np.int32)
    runner.prefill(1, [3, 7], more, np.broadcast_to(np.arange(14, dtype=np.int32), (3, 14)), None, None, None,
                   ints, floats, start=8)
    second = runner.routed_experts([3, 7], 14)
    np.testing.assert_array_equal(second[:8], got[:8])
    top2 = _route(model, jnp.asarray(more[None]), jnp.broadcast_to(jnp.arange(14)[None, None], (3, 1, 14)),
                  jnp.ones((1, 14), jnp.int32))[1]
    np.testing.assert_array_equal(np.sort(second[8:, SPARSE], -1), np.sort(np.moveaxis(np.asarray(top2)[:, 0, 8:], 0, 1), -1))
    # SGLang's wire form: meta_info.routed_experts, base64 int32, prompt_tokens + completion_tokens - 1 rows.
    body = generate_response(rid="r", text="", output_ids=seq[11:], output_logprobs=[0.0] * 4, finish={"type": "length"},
                             prompt_tokens=11, weight_version="v", e2e_latency=0.0, return_logprob=False,
                             routed_experts=encode_routed_experts(got))
    np.testing.assert_array_equal(decode_routed_experts(body["meta_info"]), got.reshape(n, LAYERS * K))
    with pytest.raises(ValueError, match="prompt_tokens"):
        decode_routed_experts({**body["meta_info"], "prompt_tokens": 12})


@pytest.fixture(scope="module")
def old_routing_replayed(moe, tmp_path_factory):
    """A Trainer on the tiny MoE (exported without torch) with --use-routing-replay and two optimizer steps on one
    rollout; each update's parameters (before it), batch, old log-probs and metrics are captured."""
    _, model, _, _ = moe
    tmp = tmp_path_factory.mktemp("routing_replay")
    model_dir = to_hf(model, tmp / "model", dtype=jnp.float32)
    run = load_config(None, ["--hf-checkpoint", str(model_dir), "--use-routing-replay", "--num-steps-per-rollout", "2",
                             "--lr", "0.05", "--seq-buckets", "32", "--row-buckets", "2,4,8", "--logprob-chunk-size",
                             "32", "--mesh-data", "1", "--output-dir", str(tmp / "run")])
    trainer = Trainer(run, devices=jax.devices()[:1])
    trainer.build_policy(model_dir)
    compiled, calls = trainer._step_fn, []

    def spied(num_sequences, single):
        step = compiled(num_sequences, single)

        def run_step(state, batch, old, ref, *rest):  # rest: the frozen parameters, an --opd-type trainer teacher
            before = jax.tree.map(np.asarray, state.params)  # the state is donated to the step
            new_state, metrics = step(state, batch, old, ref, *rest)
            calls.append((before, jax.tree.map(np.asarray, batch), np.asarray(old), jax.device_get(metrics)))
            return new_state, metrics

        return run_step

    trainer._step_fn = spied
    trainer.train_on(_samples(False))
    return trainer, calls


def _ppo_kl(old, lp, arrays):
    w = arrays.token_weights * arrays.loss_mask
    return float(np.sum(w * (old - lp)) / np.sum(w))


def _own_routing(graphdef, params, arrays) -> np.ndarray:
    """The router's own top-k ids [K, R, T, L_sparse, k] of every micro-batch of `arrays` under `params`."""
    model = nnx.merge(graphdef, params)
    return np.stack([np.moveaxis(np.asarray(_route(model, jnp.asarray(arrays.tokens[k]), jnp.asarray(arrays.positions[k]),
                                                   jnp.asarray(arrays.segment_ids[k]))[1]), 0, 2)
                     for k in range(arrays.tokens.shape[0])])


def test_old_policy_routing_is_replayed_in_every_update_of_the_rollout(old_routing_replayed):
    trainer, calls = old_routing_replayed
    graphdef = trainer.graphdef
    assert len(calls) == 2
    (params0, first, _, _), (params1, second, old, metrics) = calls
    real = first.segment_ids > 0
    # Both updates carry the old policy's own routing (the weights before the first update), -1 on padding.
    np.testing.assert_array_equal(first.routed_experts[real], _own_routing(graphdef, params0, first)[real])
    assert (first.routed_experts[~real] == -1).all()
    np.testing.assert_array_equal(second.routed_experts, first.routed_experts)
    # After the first update the router itself would choose other experts for some tokens...
    own1 = _own_routing(graphdef, params1, second)
    assert (np.sort(own1, -1) != np.sort(first.routed_experts, -1))[real].any()

    # ...but the second update's current forward routed with the recorded ids: its ppo_kl is the one of a forward
    # with those ids forced, not of one that routes anew (all ids -1: each token routed by the router itself).
    logprobs = jax.jit(lambda mb: policy_logprobs(graphdef, params1, mb, chunk_size=32, need_entropy=False)[0])

    def all_logprobs(arrays):
        return np.stack([np.asarray(logprobs(jax.tree.map(lambda x: x[k], arrays))) for k in range(arrays.tokens.shape[0])])

    replayed = _ppo_kl(old, all_logprobs(second), second)
    anew = _ppo_kl(old, all_logprobs(second._replace(routed_experts=np.full_like(second.routed_experts, -1))), second)
    assert float(metrics["train/ppo_kl"]) == pytest.approx(replayed, abs=1e-6)
    assert abs(anew - replayed) > 1e-4, (anew, replayed)


def test_routing_replay_is_a_no_op_with_one_update_or_under_r3_and_an_error_on_a_dense_model(moe):
    flag = load_config(None, ["--use-routing-replay"])
    both = load_config(None, ["--use-routing-replay", "--use-rollout-routing-replay"])
    assert replays_old_routing(flag, single=False)
    assert not replays_old_routing(flag, single=True)  # one update per rollout: the old policy is the current one
    assert not replays_old_routing(both, single=False)  # R3: the engine's ids, already in the batch, win
    assert not replays_old_routing(load_config(None, []), single=False)
    check_routing_replay(flag, moe[0])
    for cfg, name in ((flag, "--use-routing-replay"), (load_config(None, ["--use-rollout-routing-replay"]),
                                                        "--use-rollout-routing-replay")):
        with pytest.raises(ConfigError, match=f"{name} replays a mixture-of-experts router.*dense"):
            check_routing_replay(cfg, _cfg("qwen3_vl"))
    check_routing_replay(load_config(None, []), _cfg("qwen3_vl"))
