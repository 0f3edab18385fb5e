"""Engine sampling math against numpy, and SGLang request validation (no model, no server)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_vlm.engine.options import EngineOptions, bucket_for, powers_of_two
from jaxrl_vlm.engine.protocol import EMBEDDED_UNSUPPORTED
from jaxrl_vlm.engine.sampling import SamplingRows, sample_tokens
from rollout.sglang_wire import RequestError, SamplingParams, parse_generate

V = 12
LOGITS = np.array([2.0, 1.5, 1.4, 1.0, 0.5, 0.3, 0.0, -0.5, -1.0, 3.0, -2.0, 0.8], np.float32)
BANNED = np.zeros(V, bool)
BANNED[9] = True  # the most likely token is banned: it must never come out
N = 6000

_sample = jax.jit(sample_tokens, static_argnames=("filtered",))


def rows(n: int, temperature: float, top_p: float = 1.0, top_k: int = -1, min_p: float = 0.0, seed: int = 7,
         steps: np.ndarray | None = None) -> SamplingRows:
    return SamplingRows(
        temperature=jnp.full((n,), temperature, jnp.float32),
        top_p=jnp.full((n,), top_p, jnp.float32),
        top_k=jnp.full((n,), top_k, jnp.int32),
        min_p=jnp.full((n,), min_p, jnp.float32),
        seed=jnp.full((n,), seed, jnp.uint32),
        step=jnp.asarray(np.arange(n) if steps is None else steps, jnp.int32),
    )


def reference_distribution(temperature: float, top_p: float, top_k: int, min_p: float, bias: np.ndarray) -> np.ndarray:
    """SGLang's rule in plain numpy: bias, ban, temperature, then top-k, top-p (mass before a token
    > top_p drops it), min-p, renormalise."""
    z = np.where(BANNED, -np.inf, LOGITS.astype(np.float64) + bias) / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    keep = np.zeros(V, bool)
    mass = 0.0
    for rank, tok in enumerate(order):
        if (top_k > 0 and rank >= top_k) or mass > top_p or p[tok] < min_p * p[order[0]]:
            mass += p[tok]
            continue
        keep[tok] = True
        mass += p[tok]
    q = np.where(keep, p, 0.0)
    return q / q.sum()


@pytest.mark.parametrize(
    "temperature, top_p, top_k, min_p",
    [(1.0, 1.0, -1, 0.0), (0.7, 0.8, -1, 0.0), (1.3, 1.0, 4, 0.0), (1.0, 0.9, 5, 0.2)],
)
def test_sampled_frequencies_match_the_filtered_distribution(temperature, top_p, top_k, min_p):
    bias = np.zeros(V, np.float32)
    bias[3] = 0.7
    filtered = top_p < 1.0 or top_k > 0 or min_p > 0.0
    logits = jnp.broadcast_to(jnp.asarray(LOGITS), (N, V))
    ids, lps = _sample(logits, jnp.broadcast_to(jnp.asarray(bias), (N, V)), jnp.asarray(BANNED),
                       rows(N, temperature, top_p, top_k, min_p), filtered=filtered)
    ids, lps = np.asarray(ids), np.asarray(lps)
    expected = reference_distribution(temperature, top_p, top_k, min_p, bias)
    freq = np.bincount(ids, minlength=V) / N
    assert set(np.flatnonzero(freq)) <= set(np.flatnonzero(expected)), "a filtered-out or banned token was sampled"
    sigma = np.sqrt(expected * (1 - expected) / N)
    np.testing.assert_array_less(np.abs(freq - expected), 5 * sigma + 1e-9)
    # Reported log-probs: log_softmax(raw logits / T), without bias, ban or filtering (SGLang's default
    # is after temperature and before top-k/top-p; the bias is left out to match the trainer).
    z = LOGITS.astype(np.float64) / temperature
    log_softmax = z - np.log(np.exp(z - z.max()).sum()) - z.max()
    np.testing.assert_allclose(lps, log_softmax[ids], atol=1e-5)


def test_greedy_rows_take_the_best_allowed_token_and_report_raw_logprobs():
    bias = np.zeros(V, np.float32)
    logits = jnp.asarray(np.stack([LOGITS, LOGITS[::-1].copy()]))
    ids, lps = _sample(logits, jnp.zeros((2, V)), jnp.asarray(BANNED), rows(2, 0.0), filtered=False)
    masked = np.where(BANNED, -np.inf, np.asarray(logits))
    assert np.asarray(ids).tolist() == masked.argmax(-1).tolist()
    raw = np.asarray(jax.nn.log_softmax(logits, axis=-1))
    np.testing.assert_allclose(np.asarray(lps), raw[[0, 1], np.asarray(ids)], atol=1e-6)
    bias[4] = 10.0
    ids, _ = _sample(logits[:1], jnp.asarray(bias)[None], jnp.asarray(BANNED), rows(1, 1e-7), filtered=False)
    assert int(ids[0]) == 4


def test_draws_depend_only_on_seed_and_step_not_on_batch_position():
    logits = jnp.broadcast_to(jnp.asarray(LOGITS), (8, V))
    zeros, banned = jnp.zeros((8, V)), jnp.asarray(BANNED)
    steps = np.array([0, 1, 2, 3, 4, 5, 6, 7])
    a, _ = _sample(logits, zeros, banned, rows(8, 1.0, steps=steps), filtered=False)
    b, _ = _sample(logits, zeros, banned, rows(8, 1.0, steps=steps[::-1].copy()), filtered=False)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b)[::-1])
    c, _ = _sample(logits, zeros, banned, rows(8, 1.0, seed=8, steps=steps), filtered=False)
    assert np.asarray(a).tolist() != np.asarray(c).tolist()
    # A row that disables top-k / top-p / min-p draws the same token from the filtered program.
    d, _ = _sample(logits, zeros, banned, rows(8, 1.0, steps=steps), filtered=True)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(d))


def test_sampling_params_defaults_and_validation():
    p = SamplingParams.from_json(None, vocab_size=100)
    assert (p.max_new_tokens, p.temperature, p.top_p, p.top_k, p.min_p) == (128, 1.0, 1.0, -1, 0.0)
    assert p.skip_special_tokens and not p.no_stop_trim and not p.ignore_eos and not p.needs_filter
    p = SamplingParams.from_json({"stop": "END", "stop_token_ids": [3, 4], "logit_bias": {"5": -100}, "top_k": 3}, 100)
    assert p.stop == ("END",) and p.stop_token_ids == {3, 4} and p.logit_bias == ((5, -100.0),) and p.needs_filter
    for bad, needle in [({"top_p": 1.5}, "top_p"), ({"min_p": -0.1}, "min_p"), ({"stop": [1]}, "stop"),
                        ({"logit_bias": {"500": 1}}, "outside"), ({"n": 0}, "n must"), ({"max_new_tokens": 1.5}, "max_new_tokens"),
                        ({"ignore_eos": "yes"}, "ignore_eos"), ({"json_schema": "{}"}, "json_schema")]:
        with pytest.raises(RequestError, match=needle):
            SamplingParams.from_json(bad, 100, EMBEDDED_UNSUPPORTED)


def test_parse_generate_batches_n_and_image_lists():
    reqs, is_batch = parse_generate({"input_ids": [1, 2], "rid": "a"}, 100, EMBEDDED_UNSUPPORTED)
    assert not is_batch and [r.rid for r in reqs] == ["a"] and reqs[0].image_data == []
    reqs, is_batch = parse_generate({"input_ids": [[1], [2, 3]], "rid": ["a", "b"], "image_data": [None, ["x.png"]],
                                     "sampling_params": [{"max_new_tokens": 1}, {"max_new_tokens": 2}]},
                                    100, EMBEDDED_UNSUPPORTED)
    assert is_batch and [r.rid for r in reqs] == ["a", "b"] and reqs[1].image_data == ["x.png"]
    assert [r.params.max_new_tokens for r in reqs] == [1, 2]
    reqs, is_batch = parse_generate({"text": "hi", "rid": "r", "sampling_params": {"n": 3}}, 100, EMBEDDED_UNSUPPORTED)
    assert is_batch and [r.rid for r in reqs] == ["r_0", "r_1", "r_2"]  # SGLang 0.5.23's rid_k (io_struct)
    with pytest.raises(RequestError, match="one entry per prompt"):
        parse_generate({"input_ids": [[1], [2]], "image_data": ["a.png"]}, 100, EMBEDDED_UNSUPPORTED)
    with pytest.raises(RequestError, match="logprob_start_len"):
        parse_generate({"input_ids": [1], "logprob_start_len": 0}, 100, EMBEDDED_UNSUPPORTED)


def test_buckets_are_bounded_and_cover_the_range():
    cfg = EngineOptions(max_batch=24, max_seq_len=1000, min_prefill_bucket=64, min_kv_bucket=256)
    assert cfg.prefill_buckets == (64, 128, 256, 512, 1000)
    assert cfg.kv_buckets == (256, 512, 1000)
    assert cfg.batch_buckets == (1, 2, 4, 8, 16, 24)
    assert powers_of_two(4, 4) == (4,)
    assert bucket_for(65, cfg.prefill_buckets, "x") == 128 and bucket_for(1000, cfg.prefill_buckets, "x") == 1000
    with pytest.raises(ValueError, match="exceeds"):
        bucket_for(1001, cfg.prefill_buckets, "prompt tokens")
    assert cfg.patch_bucket(65) == 128 and cfg.patch_bucket(10) == 64
    with pytest.raises(ValueError, match="decode_batch_sizes"):
        EngineOptions(max_batch=8, decode_batch_sizes=(4,))
