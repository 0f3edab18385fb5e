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
from jaxrl_vlm.rl.options import OPD_BASELINES

METRIC_PREFIX = "opd/"


def reverse_kl(student_logprobs: jax.Array, teacher_logprobs: jax.Array, loss_mask: jax.Array) -> jax.Array:
    """rkl_t = student - teacher on loss-mask tokens, 0 elsewhere; constant (no gradient), [B, T]."""
    sg = jax.lax.stop_gradient
    d = sg(student_logprobs) - sg(teacher_logprobs)
    return jnp.where(loss_mask > 0, d, jnp.zeros_like(d))


def opd_advantages(advantages: jax.Array, student_logprobs: jax.Array, teacher_logprobs: jax.Array,
                   loss_mask: jax.Array, *, kl_coef: float, only: bool = False, baseline: str = "none") -> jax.Array:
    """The advantages with the OPD term folded in (module docstring): A - c * (rkl - b) on loss-mask tokens, or
    -c * (rkl - b) alone with `only`; [B, T]. b is `opd_baseline(rkl, loss_mask, baseline)`."""
    rkl = reverse_kl(student_logprobs, teacher_logprobs, loss_mask)
    centred = rkl - opd_baseline(rkl, loss_mask, baseline)
    centred = jnp.where(loss_mask > 0, centred, jnp.zeros_like(centred))
    base = jnp.zeros_like(advantages) if only else advantages
    return base - kl_coef * centred.astype(advantages.dtype)


def opd_baseline(rkl: jax.Array, loss_mask: jax.Array, kind: str) -> jax.Array:
    """The baseline b subtracted from the per-token reverse KL (a scalar, no gradient).

    `none`: b = 0 (slime). The term is then uncentred: its mean is the KL itself (>= 0), so on average every
    sampled token is pushed down and the freed mass goes to tokens that are never sampled (on color_reveal, a
    vision token the engine bans). `mean`: b = the mean reverse KL over the micro-batch's loss-mask tokens. Since
    E_s[grad log s] = 0, a constant baseline leaves the expected gradient of KL(student || teacher) unchanged (as
    the mean reward does in REINFORCE) and removes that drift; the micro-batch is the unit because the step sees
    no more."""
    if kind == "none":
        return jnp.zeros((), rkl.dtype)
    if kind == "mean":
        m = (loss_mask > 0).astype(rkl.dtype)
        return jax.lax.stop_gradient(jnp.sum(rkl * m) / jnp.maximum(jnp.sum(m), 1.0))
    raise ValueError(f"opd baseline {kind!r} is not one of {OPD_BASELINES}")


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


def generalized_jsd(student_logits: jax.Array, teacher_logits: jax.Array, *, beta: float) -> jax.Array:
    """The generalized Jensen-Shannon divergence [...] over the last (vocabulary) axis between the student's
    S = softmax(student_logits) and the teacher's T = softmax(teacher_logits), the teacher a constant:

        M = beta * S + (1 - beta) * T,    JSD_beta = beta * KL(T || M) + (1 - beta) * KL(S || M)

    with slime's (and TRL's GKD) limits taken as the endpoints: beta = 0 -> KL(T || S) (forward), beta = 1 ->
    KL(S || T) (reverse)."""
    s = jax.nn.log_softmax(student_logits, axis=-1)
    t = jax.lax.stop_gradient(jax.nn.log_softmax(teacher_logits, axis=-1))
    if beta == 0.0:
        per = jnp.exp(t) * (t - s)
    elif beta == 1.0:
        per = jnp.exp(s) * (s - t)
    else:
        m = jnp.logaddexp(s + jnp.log(beta), t + jnp.log1p(-beta))
        per = beta * jnp.exp(t) * (t - m) + (1.0 - beta) * jnp.exp(s) * (s - m)
    return jnp.sum(per, axis=-1)


def clipped_jsd(student_logits: jax.Array, teacher_logits: jax.Array, *, beta: float, clip: float) -> jax.Array:
    """slime's OPSD signal (--opd-type self, `compute_vocab_parallel_jsd` then `clamp(max=clip)`): per token,
    min(`generalized_jsd`, clip); [..., V] -> [...]. A token above the clip contributes `clip` and no gradient
    (torch's clamp, whose gradient passes at equality, as here). Both distributions are at temperature 1 (slime
    scores OPSD on the raw logits). The train step computes it in chunks from hidden states (rl/opsd.py)."""
    jsd = generalized_jsd(student_logits, teacher_logits, beta=beta)
    return jnp.where(jsd > clip, jnp.full_like(jsd, clip), jsd)
