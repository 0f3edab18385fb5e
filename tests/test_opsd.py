"""On-policy self-distillation (--opd-type self, slime's OPSD) against independent references.

- The step's chunked, clipped JSD term (rl/opsd.py) and its gradient in the student's hidden states and LM head
  equal numpy's full-vocabulary computation (float64), under token and sequence weights, with chunks that do not
  divide the row.
- On a real packed batch of episodes with images, the alignment (jaxrl_vlm/privileged.py) sends every student
  target to the teacher-batch slot that predicts the same token; truncation leaves the cut tokens out.
- A real Trainer step: each sample rendered again with its privileged text (rollout/privileged.py, the chat
  template), the frozen initial policy's JSD against the student per loss-mask token equals a one-sample-at-a-time
  forward of both views (no packing), in numpy; with LoRA the teacher is the base and the student the base with its
  adapters merged.
- The privileged view's text, its errors, and the config's one-line errors.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _train_samples import train_samples
from flax import nnx
from test_batching import build, make_batch_samples
from test_opd import numpy_clipped_jsd

from jaxrl_vlm.batching import BatchingError, build_train_batch
from jaxrl_vlm.config import ConfigError, load_config
from jaxrl_vlm.distributed import global_batch
from jaxrl_vlm.job.trainer import Trainer
from jaxrl_vlm.privileged import alignment, teacher_view, teacher_views
from jaxrl_vlm.rl.opsd import PrivilegedTeacher, opsd_term
from rollout.encoding import ChatEncoder
from rollout.privileged import PrivilegedFieldError, PrivilegedView
from rollout.processing import load_image_processor, load_tokenizer

BETA, CLIP, COEF = 0.5, 0.05, 0.8


@pytest.fixture
def _x64() -> Iterator[None]:
    with jax.enable_x64(True):
        yield


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_the_chunked_term_and_its_gradient_match_numpy(_x64, beta: float) -> None:
    rng = np.random.default_rng(3)
    r, t, d, v, chunk = 3, 13, 6, 29, 5  # 13 positions in chunks of 5: the last chunk is padded
    h_s = rng.normal(size=(r, t, d))
    h_t = h_s + rng.normal(scale=rng.uniform(0.01, 1.0, size=(r, t, 1)), size=(r, t, d))  # some past the clip
    k_s = rng.normal(scale=0.5, size=(d, v))
    k_t = k_s + rng.normal(scale=0.05, size=(d, v))
    valid = (rng.uniform(size=(r, t)) < 0.7).astype(np.float64)
    w = rng.uniform(0.1, 1.0, size=(r, t)) * valid  # any aggregation's token weights

    def term(hs, ks):
        return opsd_term(hs, ks, jnp.asarray(h_t), PrivilegedTeacher(jnp.asarray(k_t)), jnp.asarray(valid),
                         jnp.asarray(w), beta=beta, clip=CLIP, coef=COEF, chunk_size=chunk, compute_dtype=jnp.float64)

    (loss, metrics), (g_h, g_k) = jax.value_and_grad(term, argnums=(0, 1), has_aux=True)(jnp.asarray(h_s),
                                                                                        jnp.asarray(k_s))
    z_s, z_t = (h_s @ k_s).reshape(-1, v), (h_t @ k_t).reshape(-1, v)
    jsd, dz = numpy_clipped_jsd(z_s, z_t, beta, CLIP)
    m = valid.reshape(-1) > 0
    assert 0 < int(np.sum(jsd[m] >= CLIP)) < m.sum(), "the clip must bind on some tokens and not on others"
    assert float(loss) == pytest.approx(COEF * float(np.sum(w.reshape(-1) * jsd)), rel=1e-9)
    dz = COEF * w.reshape(-1, 1) * dz  # d loss / d student logits
    np.testing.assert_allclose(np.asarray(g_h), (dz @ k_s.T).reshape(r, t, d), rtol=1e-6, atol=1e-12)
    np.testing.assert_allclose(np.asarray(g_k), h_s.reshape(-1, d).T @ dz, rtol=1e-6, atol=1e-12)
    unclipped, _ = numpy_clipped_jsd(z_s, z_t, beta, np.inf)
    assert float(metrics["opd/jsd"].value / metrics["opd/jsd"].weight) == pytest.approx(jsd[m].mean(), rel=1e-9)
    assert float(metrics["opd/jsd_unclipped"].value / metrics["opd/jsd_unclipped"].weight) == pytest.approx(
        unclipped[m].mean(), rel=1e-9)
    assert float(metrics["opd/jsd_clipped_frac"].value / metrics["opd/jsd_clipped_frac"].weight) == pytest.approx(
        float(np.mean(unclipped[m] > CLIP)))


def _with_privileged(samples, seed: int):
    """Each sample's prompt with 1-7 extra text tokens in front (never inside a picture's run of pads)."""
    rng = np.random.default_rng(seed)
    for s in samples:
        prompt = list(s.tokens[: s.prompt_length])
        extra = rng.integers(5, 40, size=int(rng.integers(1, 8))).tolist()
        s.privileged_prompt_tokens = extra + prompt
    return samples


@pytest.mark.parametrize("truncate", [False, True])
def test_the_alignment_sends_every_target_to_the_teacher_slot_of_the_same_token(truncate: bool) -> None:
    samples, adv = make_batch_samples(seed=4, n=10, image_rate=0.6)
    samples = _with_privileged(samples, 4)
    kw = dict(row_buckets=[1, 2])
    if truncate:  # the longest samples lose their tail in one layout or both
        longest = max(len(s.tokens) for s in samples)
        kw.update(seq_buckets=[longest - 4], overlong_policy="truncate")
    student = build(samples, adv, **kw)
    teacher = build(teacher_views(samples), adv, **({**kw, "seq_buckets": [max(len(v.tokens) for v in
                                                                               teacher_views(samples))]}
                                                     if not truncate else kw))
    assert student.layout.real_patches > 0 and student.arrays.loss_mask.shape[0] > 1  # images, micro-batches
    where = alignment(student, teacher, samples)
    s_mask = student.arrays.loss_mask > 0
    valid = where.valid > 0
    assert not np.any(valid & ~s_mask)
    t_targets = teacher.arrays.targets.reshape(-1)[where.index]
    t_mask = teacher.arrays.loss_mask.reshape(-1)[where.index]
    np.testing.assert_array_equal(t_targets[valid], student.arrays.targets[valid])
    assert np.all(t_mask[valid] > 0)
    # Per sample: its placed loss-mask response tokens that the teacher layout also holds, none other.
    want = 0
    t_placed = {q.sample_position: q for q in teacher.layout.placements}
    for p in student.layout.placements:
        s, q = samples[p.sample_position], t_placed[p.sample_position]
        prompt_s, prompt_t = s.prompt_length, len(s.privileged_prompt_tokens)
        want += sum(m for j, m in enumerate(s.loss_mask) if prompt_s + j < p.length and prompt_t + j < q.length)
    assert int(valid.sum()) == want
    if truncate:
        assert int(valid.sum()) < int(sum(sum(s.loss_mask) for s in samples))
    else:
        assert int(valid.sum()) == int(s_mask.sum())


def test_a_sample_without_its_privileged_prompt_is_refused_by_name() -> None:
    samples, _ = make_batch_samples(seed=1, n=2)
    with pytest.raises(BatchingError, match=re.escape(f"{samples[0].name} has no privileged_prompt_tokens")):
        teacher_view(samples[0])


# ----------------------------------------------------------------------------- a real Trainer step


@partial(jax.jit, static_argnums=0)
def _hidden(graphdef, params, mb):
    return nnx.merge(graphdef, params)(mb.tokens, mb.positions, mb.segment_ids, mb.vision)


def _one_sample_hidden(trainer: Trainer, params, sample) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(hidden [L, D], targets [L], loss mask [L]) of one sample in a batch of its own (one row, no packing)."""
    cfg = trainer.cfg
    batch = build_train_batch(
        [sample], np.zeros(1, np.float32), trainer.model_cfg, seq_buckets=[512], row_buckets=[1],
        patch_buckets=cfg.batching.patch_buckets, packing=False, micro_batch_rows=None,
        aggregation="token_mean", aggregation_constant=None, overlong_policy="error",
    )
    dev = jax.tree.map(lambda x: x[0], global_batch(batch.arrays, trainer.mesh, rules=trainer.rules))
    hidden = _hidden(trainer.graphdef, params, dev)
    a = batch.arrays
    return np.asarray(hidden[0], np.float64), a.targets[0, 0], a.loss_mask[0, 0]


@pytest.mark.parametrize("lora", [False, True])  # LoRA: the teacher is the base, the student base + adapters
def test_a_trainer_step_distills_from_the_privileged_initial_policy_like_unpacked_forwards(
        tiny_hf_checkpoint, tmp_path, make_test_image, lora: bool) -> None:
    samples = train_samples(tiny_hf_checkpoint, make_test_image)
    enc = ChatEncoder(load_tokenizer(tiny_hf_checkpoint), load_image_processor(tiny_hf_checkpoint))
    view = PrivilegedView("label", "The answer is {privileged}.")
    for s in samples:
        s.privileged_prompt_tokens = view.prompt_tokens(enc, s.prompt, s)
        assert len(s.privileged_prompt_tokens) > s.prompt_length
    text = enc.tokenizer.decode(samples[0].privileged_prompt_tokens)
    assert "The answer is 1." in text.split("<|im_end|>")[0]  # inside the first user turn
    cfg = load_config(None, [
        "--hf-checkpoint", str(tiny_hf_checkpoint), "--lr", "0", "--weight-decay", "0", "--seq-buckets", "128",
        "--row-buckets", "1,8", "--patch-buckets", "0,64,128", "--logprob-chunk-size", "16", "--mesh-data", "1",
        "--use-opd", "--opd-type", "self", "--opd-only", "--opd-kl-coef", str(COEF), "--opsd-beta", str(BETA),
        "--opsd-jsd-clip", "1.0", "--loss-aggregation", "token_mean", "--output-dir", str(tmp_path),
        *(["--lora-rank", "4"] if lora else []),
    ])
    trainer = Trainer(cfg, devices=jax.devices()[:1])
    trainer.build_policy(tiny_hf_checkpoint)
    # The teacher is the initial policy: perturb the student so that the two differ beyond the context (with LoRA
    # the trained state is the adapters, whose B starts at zero: every adapter entry moves).
    keys = iter(jax.random.split(jax.random.key(3), len(jax.tree.leaves(trainer.state.params))))
    perturb = ((lambda x: x + 0.3 * jax.random.normal(next(keys), x.shape, x.dtype)) if lora else (lambda x: x * 1.5))
    trainer.state = trainer.state._replace(params=jax.tree.map(
        lambda x: perturb(x) if jnp.issubdtype(x.dtype, jnp.floating) else x, trainer.state.params))
    metrics = trainer.train_on(samples)
    student = trainer.policy_params()
    if lora:  # the reference is the base itself, not a copy of the merged student
        assert trainer.ref_params is trainer.frozen
    student_k = np.asarray(nnx.merge(trainer.graphdef, student).lm_head_kernel(), np.float64)
    teacher_k = np.asarray(nnx.merge(trainer.graphdef, trainer.ref_params).lm_head_kernel(), np.float64)
    jsds = []
    for s in samples:
        h_s, targets, mask = _one_sample_hidden(trainer, student, s)
        h_t, t_targets, t_mask = _one_sample_hidden(trainer, trainer.ref_params, teacher_view(s))
        rows_s, rows_t = np.flatnonzero(mask > 0), np.flatnonzero(t_mask > 0)
        np.testing.assert_array_equal(targets[rows_s], t_targets[rows_t])  # the same response tokens
        jsd, _ = numpy_clipped_jsd(h_s[rows_s] @ student_k, h_t[rows_t] @ teacher_k, BETA, 1.0)
        jsds.append(jsd)
    jsd = np.concatenate(jsds)
    assert 1e-4 < jsd.mean() and jsd.max() < 1.0  # a signal, and below the clip
    assert metrics["train/opd/jsd"] == pytest.approx(jsd.mean(), rel=2e-4)
    # --opd-only: no reward advantage; token_mean: the loss is the coefficient times the tokens' mean JSD.
    assert metrics["train/loss_total"] == pytest.approx(COEF * jsd.mean(), rel=2e-4)
    assert metrics["train/opd/jsd_clipped_frac"] == 0.0


# ----------------------------------------------------------------------------- rollout-side view, options


def test_the_privileged_text_comes_from_the_label_or_one_key_of_it() -> None:
    samples, _ = make_batch_samples(seed=2, n=1)
    s = dataclasses.replace(samples[0], label={"answer": "blue", "hint": None})
    assert PrivilegedView("label.answer", "It is {privileged}.").text(s) == "It is blue."
    assert PrivilegedView("label", "{privileged}").text(dataclasses.replace(s, label="7")) == "7"
    with pytest.raises(PrivilegedFieldError, match="has no key 'colour'"):
        PrivilegedView("label.colour", "{privileged}").text(s)
    with pytest.raises(PrivilegedFieldError, match="label.hint is empty"):
        PrivilegedView("label.hint", "{privileged}").text(s)


@pytest.mark.parametrize("argv, message", [
    (["--opsd-privileged-field", "answer"], "use 'label'"),
    (["--opsd-privileged-template", "no slot"], "has no {privileged} slot"),
    (["--opsd-privileged-template", "{other}"], "not a format string"),
    (["--opd-teacher-checkpoint", "c"], "--opd-type self is the frozen initial policy"),
    (["--opsd-beta", "1.5"], "opsd_beta"),
])
def test_bad_self_distillation_settings_are_one_line_config_errors(argv, message) -> None:
    with pytest.raises(ConfigError, match=message) as e:
        load_config(None, ["--use-opd", "--opd-type", "self", *argv])
    assert "\n" not in str(e.value)
