"""On-policy distillation (OPD): the teacher's token log-probs as a dense per-token signal, pure `jnp`.

A teacher scored the student's own trajectory (rollout/teacher.py), so each loss-mask token t has the student's
behaviour log-prob s_t (the trainer's `old_logprobs`, at the rollout temperature) and the teacher's h_t. The
per-token reverse KL estimate is

    rkl_t = s_t - h_t        (a single-sample estimate of KL(student || teacher) at that position)

and, as slime's `apply_opd_kl_to_advantages` (after the advantage estimator, before any normalisation), it is
folded into the advantages with `--opd-kl-coef c`:

    A'_t = A_t - c * rkl_t   on loss-mask tokens, A_t elsewhere;

with `--opd-only` the reward's advantages are dropped: A'_t = -c * rkl_t on loss-mask tokens, 0 elsewhere (pure
distillation, Thinking Machines' on-policy distillation recipe). The advantage is a constant of the loss (stop
gradient), so every policy loss (ppo_clip, gspo, cispo, a custom loss) and every aggregation mode trains on it
unchanged. Every array is [B, T], aligned to targets; observation and padding tokens (mask 0) never count.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl_vlm.rl.metrics import Metric

METRIC_PREFIX = "opd/"


def reverse_kl(student_logprobs: jax.Array, teacher_logprobs: jax.Array, loss_mask: jax.Array) -> jax.Array:
    """rkl_t = student - teacher on loss-mask tokens, 0 elsewhere; constant (no gradient), [B, T]."""
    sg = jax.lax.stop_gradient
    d = sg(student_logprobs) - sg(teacher_logprobs)
    return jnp.where(loss_mask > 0, d, jnp.zeros_like(d))


def opd_advantages(advantages: jax.Array, student_logprobs: jax.Array, teacher_logprobs: jax.Array,
                   loss_mask: jax.Array, *, kl_coef: float, only: bool = False) -> jax.Array:
    """The advantages with the OPD term folded in (module docstring): A - c * rkl on loss-mask tokens, or -c * rkl
    alone with `only`; [B, T]."""
    rkl = reverse_kl(student_logprobs, teacher_logprobs, loss_mask)
    base = jnp.zeros_like(advantages) if only else advantages
    return base - kl_coef * rkl.astype(advantages.dtype)


def opd_metrics(student_logprobs: jax.Array, teacher_logprobs: jax.Array, loss_mask: jax.Array) -> dict[str, Metric]:
    """Token means over the loss-mask tokens (each a `Metric.mean` with the token count as its weight, so
    micro-batches combine exactly): `opd/reverse_kl`, `opd/teacher_logprob`, `opd/student_logprob`. They describe
    the sampled data, whatever the aggregation mode (as `rollout_corr/*`)."""
    sg = jax.lax.stop_gradient
    m = loss_mask > 0
    count = jnp.sum(m.astype(student_logprobs.dtype))
    total = lambda x: jnp.sum(jnp.where(m, sg(x), jnp.zeros_like(x)))  # noqa: E731  (padding may hold NaN)
    rkl = reverse_kl(student_logprobs, teacher_logprobs, loss_mask)
    return {
        f"{METRIC_PREFIX}reverse_kl": Metric.mean(total(rkl), count),
        f"{METRIC_PREFIX}teacher_logprob": Metric.mean(total(teacher_logprobs), count),
        f"{METRIC_PREFIX}student_logprob": Metric.mean(total(student_logprobs), count),
    }


def clipped_jsd(student_logits: jax.Array, teacher_logits: jax.Array, *, beta: float, clip: float) -> jax.Array:
    """slime's OPSD signal (--opd-type self, `compute_vocab_parallel_jsd` then `clamp(max=clip)`): per token, the
    generalized Jensen-Shannon divergence over the full vocabulary between the student's next-token distribution
    S = softmax(student_logits) and the teacher's T = softmax(teacher_logits), clipped from above; [..., V] -> [...].

        M = beta * S + (1 - beta) * T,    JSD_beta = beta * KL(T || M) + (1 - beta) * KL(S || M)

    with slime's (and TRL's GKD) limits taken as the endpoints: beta = 0 -> KL(T || S) (forward), beta = 1 ->
    KL(S || T) (reverse). Then min(JSD_beta, clip): a token above the clip contributes `clip` and no gradient
    (torch's clamp, whose gradient passes at equality, as here). The teacher is a constant (stop gradient); both
    distributions are at temperature 1 (slime scores OPSD on the raw logits). Not yet wired into a train step:
    --opd-type self is refused at config validation (rl/options.py `opd_problem`)."""
    sg = jax.lax.stop_gradient
    s = jax.nn.log_softmax(student_logits, axis=-1)
    t = sg(jax.nn.log_softmax(teacher_logits, axis=-1))
    if beta == 0.0:
        per = jnp.exp(t) * (t - s)
    elif beta == 1.0:
        per = jnp.exp(s) * (s - t)
    else:
        m = jnp.logaddexp(s + jnp.log(beta), t + jnp.log1p(-beta))
        per = beta * jnp.exp(t) * (t - m) + (1.0 - beta) * jnp.exp(s) * (s - m)
    jsd = jnp.sum(per, axis=-1)
    return jnp.where(jsd > clip, jnp.full_like(jsd, clip), jsd)
