"""Next-token sampling for a batch of rows, each with its own parameters (pure `jnp`, jit-able).

Semantics follow SGLang's sampler (`srt/layers/sampler.py`) and `SamplingParams`:

* logits first get the request's `logit_bias` added and banned ids masked (SGLang applies bias and
  vocab masks before its sampler), then are divided by `temperature`;
* `temperature < 1e-6` is greedy (argmax); otherwise top-k (-1 = whole vocabulary), top-p (a token is
  dropped when the probability mass strictly before it in descending order exceeds `top_p`, SGLang's
  rule) and min-p (dropped below `min_p * max_prob`) filter the distribution, and one token is drawn
  with the Gumbel-max trick;
* randomness comes from `fold_in(key(seed), step)` per row: a request's draws depend only on its own
  seed and on how many tokens it has generated, never on which other requests share the batch.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from rollout.sglang_wire import GREEDY_TEMPERATURE


class SamplingRows(NamedTuple):
    """Per-row sampling parameters, arrays of shape [B].

    temperature float32, top_p float32 in (0, 1], top_k int32 (-1 or <= 0 = no limit), min_p float32,
    seed uint32, step int32 (tokens generated so far by the row's request).
    """

    temperature: jax.Array
    top_p: jax.Array
    top_k: jax.Array
    min_p: jax.Array
    seed: jax.Array
    step: jax.Array


def token_logprobs_like_sglang(logits_bv: jax.Array, temperature_b: jax.Array) -> jax.Array:
    """Log-probabilities [B, V] that SGLang reports by default for sampled tokens.

    SGLang (0.5.x, `SGLANG_RETURN_ORIGINAL_LOGPROB` unset) returns, for greedy rows,
    `log_softmax(logits)` and for sampled rows `log(softmax(logits / temperature))`: *after*
    temperature, *before* top-k / top-p / min-p filtering (older 0.4 releases also renormalised over
    the top-p set; current ones do not). The trainer scores tokens at the same temperature
    (`token_logprobs(..., temperature=logprob_temperature(T))`), so importance-sampling corrections compare
    one policy with itself.

    Deliberate difference: we compute it from the model's logits *without* `logit_bias` and without
    the engine's ban on vision tokens. SGLang adds the bias first; the trainer never sees a bias, so
    including it would make rollout and trainer log-probs disagree by the banned tokens' mass.
    """
    greedy = temperature_b < GREEDY_TEMPERATURE
    t = jnp.where(greedy, 1.0, temperature_b).astype(jnp.float32)
    return jax.nn.log_softmax(logits_bv.astype(jnp.float32) / t[:, None], axis=-1)


def _filter_mask(probs_bv: jax.Array, top_p: jax.Array, top_k: jax.Array, min_p: jax.Array) -> jax.Array:
    """bool [B, V]: tokens kept by top-k, top-p and min-p (at least the most likely one survives)."""
    v = probs_bv.shape[-1]
    sorted_p = -jnp.sort(-probs_bv, axis=-1)  # descending
    mass_before = jnp.cumsum(sorted_p, axis=-1) - sorted_p
    rank = jnp.arange(v)[None, :]
    k = jnp.where(top_k <= 0, v, jnp.minimum(top_k, v))[:, None]
    # top_p >= 1 keeps everything outright: a float cumsum may pass 1.0 before the last token.
    within_p = (mass_before <= top_p[:, None]) | (top_p[:, None] >= 1.0)
    keep_sorted = within_p & (rank < k) & (sorted_p >= (min_p * sorted_p[:, 0])[:, None])
    keep_sorted = keep_sorted.at[:, 0].set(True)
    # The smallest kept probability is the threshold in the unsorted vocabulary (ties are kept).
    threshold = jnp.min(jnp.where(keep_sorted, sorted_p, jnp.inf), axis=-1)
    return probs_bv >= threshold[:, None]


def sample_tokens(
    logits_bv: jax.Array,
    bias_bv: jax.Array,
    banned_v: jax.Array,
    rows: SamplingRows,
    *,
    filtered: bool,
) -> tuple[jax.Array, jax.Array]:
    """Draw one token per row. Returns (ids int32 [B], logprobs float32 [B]).

    logits_bv float [B, V] (raw model logits); bias_bv float32 [B, V] (per-request `logit_bias`,
    0 elsewhere); banned_v bool [V] (ids that can never be sampled). `filtered` (static) enables the
    top-k / top-p / min-p path (a full-vocabulary sort per row); rows whose parameters disable all
    three sample the same distribution either way, so one filtered program can serve a mixed batch.
    """
    logits = logits_bv.astype(jnp.float32)
    greedy = rows.temperature < GREEDY_TEMPERATURE
    t = jnp.where(greedy, 1.0, rows.temperature).astype(jnp.float32)
    z = jnp.where(banned_v[None, :], -jnp.inf, logits + bias_bv) / t[:, None]
    if filtered:
        probs = jax.nn.softmax(z, axis=-1)
        z = jnp.where(_filter_mask(probs, rows.top_p, rows.top_k, rows.min_p), z, -jnp.inf)

    def gumbel(seed: jax.Array, step: jax.Array) -> jax.Array:
        key = jax.random.fold_in(jax.random.key(seed), step)
        return jax.random.gumbel(key, (logits.shape[-1],), jnp.float32)

    noise = jax.vmap(gumbel)(rows.seed, rows.step)
    drawn = jnp.argmax(z + noise, axis=-1)
    ids = jnp.where(greedy, jnp.argmax(z, axis=-1), drawn).astype(jnp.int32)
    logprobs = token_logprobs_like_sglang(logits, rows.temperature)
    return ids, jnp.take_along_axis(logprobs, ids[:, None], axis=-1)[:, 0]
