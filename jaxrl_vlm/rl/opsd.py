"""On-policy self-distillation (--opd-type self, slime's OPSD) in the train step, pure `jnp`.

The teacher is the frozen initial policy reading the student's episode with privileged information
(jaxrl_vlm/privileged.py lines its hidden states up with the student's target slots: `PrivilegedTeacher`). Per
loss-mask token, the signal is the clipped generalized JSD over the full vocabulary between the student's and the
teacher's next-token distributions at temperature 1 (`rl/opd.py: clipped_jsd`, slime's `--opsd-beta`,
`--opsd-jsd-clip`). It is a loss term, weighted by --opd-kl-coef and aggregated with the batch's token weights
(so every aggregation mode applies), added to the policy loss; the gradient flows through the student's logits
only.

The logits are computed in chunks of positions, each chunk's [R, C, V] float32 logits of both models recomputed
in the backward pass (`jax.checkpoint`), as `token_logprobs` does: peak memory O(R * C * V), not O(R * T * V).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxrl_vlm.rl.metrics import Metric
from jaxrl_vlm.rl.opd import METRIC_PREFIX, generalized_jsd


class PrivilegedTeacher(NamedTuple):
    """What the train step needs of the OPSD teacher beyond the batch's aligned hidden states: its LM head
    [D, V] (the frozen initial policy's)."""

    lm_head_kernel: jax.Array


def chunked_jsd(student_hidden: jax.Array, student_kernel: jax.Array, teacher_hidden: jax.Array,
                teacher_kernel: jax.Array, *, beta: float, chunk_size: int, compute_dtype: jnp.dtype) -> jax.Array:
    """The unclipped generalized JSD [R, T] per slot between softmax(student_hidden @ student_kernel) and
    softmax(teacher_hidden @ teacher_kernel); gradient through the student only."""
    r, t, d = student_hidden.shape
    c = max(1, min(chunk_size, t))
    n = -(-t // c)
    pad = n * c - t

    def chunks(h: jax.Array) -> jax.Array:
        return jnp.pad(h, ((0, 0), (0, pad), (0, 0))).reshape(r, n, c, d).transpose(1, 0, 2, 3)

    logits_dtype = jnp.promote_types(compute_dtype, jnp.float32)  # at least float32 (a float64 model: float64)
    k_s = student_kernel.astype(compute_dtype)
    k_t = jax.lax.stop_gradient(teacher_kernel).astype(compute_dtype)

    @jax.checkpoint
    def one(args: tuple[jax.Array, jax.Array]) -> jax.Array:
        hs, ht = args
        z_s = jnp.einsum("rcd,dv->rcv", hs.astype(compute_dtype), k_s, preferred_element_type=logits_dtype)
        z_t = jnp.einsum("rcd,dv->rcv", ht.astype(compute_dtype), k_t, preferred_element_type=logits_dtype)
        return generalized_jsd(z_s, z_t, beta=beta)

    jsd = jax.lax.map(one, (chunks(student_hidden), chunks(jax.lax.stop_gradient(teacher_hidden))))
    return jsd.transpose(1, 0, 2).reshape(r, n * c)[:, :t]


def opsd_term(student_hidden: jax.Array, student_kernel: jax.Array, teacher_hidden: jax.Array,
              teacher: PrivilegedTeacher, valid: jax.Array, token_weights: jax.Array, *, beta: float, clip: float,
              coef: float, chunk_size: int, compute_dtype: jnp.dtype) -> tuple[jax.Array, dict[str, Metric]]:
    """(coef * sum of token_weights * min(JSD, clip) over the valid slots, metrics) for one micro-batch [R, T].

    Metrics (token means over the valid slots, exact over micro-batches): `opd/jsd` (clipped, what the loss
    sees), `opd/jsd_unclipped`, `opd/jsd_clipped_frac` (tokens at the clip, which give no gradient)."""
    jsd = chunked_jsd(student_hidden, student_kernel, teacher_hidden, teacher.lm_head_kernel, beta=beta,
                      chunk_size=chunk_size, compute_dtype=compute_dtype)
    m = valid > 0
    clipped = jnp.where(jsd > clip, jnp.full_like(jsd, clip), jsd)
    zero = jnp.zeros_like(jsd)
    loss = coef * jnp.sum(jnp.where(m, token_weights.astype(jsd.dtype) * clipped, zero))
    count = jnp.sum(m.astype(jsd.dtype))
    sg = jax.lax.stop_gradient
    metrics = {
        f"{METRIC_PREFIX}jsd": Metric.mean(jnp.sum(jnp.where(m, sg(clipped), zero)), count),
        f"{METRIC_PREFIX}jsd_unclipped": Metric.mean(jnp.sum(jnp.where(m, sg(jsd), zero)), count),
        f"{METRIC_PREFIX}jsd_clipped_frac": Metric.mean(jnp.sum((m & (jsd > clip)).astype(jsd.dtype)), count),
    }
    return loss, metrics
