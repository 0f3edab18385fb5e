"""Example `--rollout-correction custom --custom-tis-function-path`: masked importance sampling (IcePop-style
rejection), written as a hook (the built-in `--rollout-correction token_mis` is the same correction).

    jaxrl-vlm train CONFIG --rollout-correction custom --rollout-correction-low 0.5 --rollout-correction-high 2 \
        --custom-tis-function-path configs/hooks/custom_tis.py:masked_is

(slime's spelling, `--use-tis --tis-clip-low 0.5 --tis-clip 2 --custom-tis-function-path ...`, means the same.)

A TIS function is `fn(pg_loss, inputs: LossInputs, cfg: LossConfig) -> (pg_loss, loss_mask, metrics)`, pure
jax.numpy inside the compiled step. `pg_loss` is the per-token policy-gradient loss [B, T] before weighting; the
returned mask can only remove tokens; metrics are per-token [B, T] arrays, logged as token-weighted means
(train/tis/<name>).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl_vlm.rl.losses import LossConfig, LossInputs


def masked_is(pg_loss: jax.Array, inputs: LossInputs, cfg: LossConfig) -> tuple[jax.Array, jax.Array, dict]:
    """Weight each token by the trainer/sampler probability ratio exp(old - rollout); tokens whose ratio leaves
    [--rollout-correction-low, --rollout-correction-high] are rejected (masked) instead of clipped, so a mismatched
    token never trains."""
    sg = jax.lax.stop_gradient
    log_ratio = jnp.where(inputs.loss_mask > 0, sg(inputs.old_logprobs) - sg(inputs.rollout_logprobs), 0.0)
    ratio = jnp.exp(log_ratio)
    keep = (ratio >= cfg.rollout_correction_low) & (ratio <= cfg.rollout_correction_high)
    return pg_loss * ratio, keep.astype(pg_loss.dtype), {"rejected": (~keep).astype(pg_loss.dtype), "ratio": ratio}
