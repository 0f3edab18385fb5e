"""--opd-type trainer: a frozen second model in the train step scores the packed batch (rl/train_step.py
`teacher_logprobs`), and a teacher that cannot read the student's batches is refused in one line
(job/trainer.py `teacher_mismatch`).

- The step's teacher log-probs equal the teacher model's own forward (its full-vocabulary logits, log-softmaxed in
  float64 numpy) within 1e-5, on a packed batch of multi-turn episodes with images, the teacher being another
  (smaller) model than the student.
- One compiled train step with the teacher gives the same `train/opd/*` metrics as the engine type's fold of those
  log-probs.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from test_batching import CFG, build, make_batch_samples

from jaxrl_vlm.errors import ConfigError
from jaxrl_vlm.job.trainer import teacher_mismatch
from jaxrl_vlm.models.qwen3_vl import Qwen3VL
from jaxrl_vlm.rl.losses import LossConfig
from jaxrl_vlm.rl.train_step import StepConfig, TrainState, compile_train_step, teacher_logprobs

COEF = 0.7
# Another model of the same vocabulary and image format: half the width, one layer.
TEACHER_CFG = dataclasses.replace(
    CFG, text=dataclasses.replace(CFG.text, hidden_size=32, intermediate_size=64, num_hidden_layers=1),
    vision=dataclasses.replace(CFG.vision, out_hidden_size=32))


def masked_logprobs(hidden, kernel, mb) -> np.ndarray:
    """log p(target) [R, T] from a model's hidden states: full logits, log-softmax in float64, 0 off the mask."""
    logits = np.asarray(hidden, np.float64) @ np.asarray(kernel, np.float64)
    logits -= logits.max(-1, keepdims=True)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    picked = np.take_along_axis(logp, np.asarray(mb.targets)[..., None], -1)[..., 0]
    return np.where(np.asarray(mb.loss_mask) > 0, picked, 0.0)


def test_the_step_teacher_scores_like_its_own_forward_and_folds_like_the_engine_teacher() -> None:
    samples, adv = make_batch_samples(seed=5, n=4, image_rate=0.7)
    batch = build(samples, adv, aggregation="token_mean", row_buckets=[4])
    arrays = jax.tree.map(jnp.asarray, batch.arrays)
    assert batch.layout.real_patches > 0 and arrays.tokens.shape[0] == 1
    student, teacher = Qwen3VL(CFG, rngs=nnx.Rngs(0)), Qwen3VL(TEACHER_CFG, rngs=nnx.Rngs(1))
    s_graph, s_params = nnx.split(student, nnx.Param)
    t_graph, t_params = nnx.split(teacher, nnx.Param)
    mb = jax.tree.map(lambda x: x[0], arrays)
    mask = np.asarray(mb.loss_mask) > 0

    @jax.jit
    def forwards(sp, tp, b):
        """Each model's own forward (hidden states, head), and the step's scoring function on the teacher."""
        s, t = nnx.merge(s_graph, sp), nnx.merge(t_graph, tp)
        return (s(b.tokens, b.positions, b.segment_ids, b.vision), s.lm_head_kernel(),
                t(b.tokens, b.positions, b.segment_ids, b.vision), t.lm_head_kernel(),
                teacher_logprobs(t_graph, tp, b, chunk_size=16))

    s_hidden, s_kernel, t_hidden, t_kernel, scored = forwards(s_params, t_params, mb)
    want_teacher = masked_logprobs(t_hidden, t_kernel, mb)
    np.testing.assert_allclose(np.asarray(scored), want_teacher, rtol=0, atol=1e-5)
    student_lp = masked_logprobs(s_hidden, s_kernel, mb)  # one step per rollout: the old log-probs are the current

    cfg = StepConfig(loss=LossConfig(num_sequences=batch.layout.max_sequences_per_micro_batch,
                                     aggregation="token_mean", opd_kl_coef=COEF), logprob_chunk_size=16)
    tx = optax.sgd(0.0)
    state = TrainState(s_params, tx.init(s_params), jnp.zeros((), jnp.int32),
                       jax.random.key_data(jax.random.key(0)))
    _, metrics = compile_train_step(s_graph, tx, cfg, teacher_graphdef=t_graph)(state, arrays, None, None, None,
                                                                                  t_params)
    n = mask.sum()
    want = {"train/opd/teacher_logprob": want_teacher[mask].sum() / n,
            "train/opd/student_logprob": student_lp[mask].sum() / n,
            "train/opd/reverse_kl": (student_lp - want_teacher)[mask].sum() / n}
    for key, value in want.items():
        assert float(metrics[key]) == pytest.approx(value, abs=1e-5), key


def test_a_teacher_that_cannot_read_the_students_batches_is_refused_in_one_line(tmp_path) -> None:
    from jaxrl_vlm.tiny_assets import build_tiny_tokenizer, save_tiny_processing

    student_dir = save_tiny_processing(tmp_path / "student", seed=0)
    same_dir = student_dir  # the tokenizer files are the student's own
    other_dir = save_tiny_processing(tmp_path / "other", build_tiny_tokenizer(seed=1), seed=1)
    assert teacher_mismatch(student_dir, same_dir, CFG, TEACHER_CFG) is None  # another size is fine
    vision = dataclasses.replace(TEACHER_CFG.vision, patch_size=8)
    for teacher_dir, teacher_cfg, message in [
        (same_dir, dataclasses.replace(TEACHER_CFG, text=dataclasses.replace(TEACHER_CFG.text, vocab_size=300)),
         r"vocab_size 300, the student \S+ 256"),
        (other_dir, TEACHER_CFG, "another tokenizer than the student"),
        (same_dir, dataclasses.replace(TEACHER_CFG, image_token_id=249), "image_token_id 249, the student 252"),
        (same_dir, dataclasses.replace(TEACHER_CFG, vision=vision), "reads images as"),
    ]:
        problem = teacher_mismatch(student_dir, teacher_dir, CFG, teacher_cfg)
        assert problem is not None and "\n" not in problem and re.search(message, problem), (message, problem)
    with pytest.raises(ConfigError, match="the teacher has no .*tokenizer.json"):
        teacher_mismatch(student_dir, tmp_path / "missing", CFG, TEACHER_CFG)
