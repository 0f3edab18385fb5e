"""Loss metrics carry their reduction (`rl/metrics.py`), and what a loss is made of comes from registries: the
`--loss-type` choice (`LOSS_TYPES`), KL estimators (`KL_ESTIMATORS`) and aggregation modes (`AGGREGATION_MODES`).

The reductions are checked against plain numpy over explicit micro-batch values; the registries against the
functions they must hand out, and by adding an entry."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_vlm.rl import losses
from jaxrl_vlm.rl.aggregation import aggregation_weights, register_aggregation
from jaxrl_vlm.rl.losses import LossConfig, LossInputs, kl_estimate, register_kl_estimator, select_loss
from jaxrl_vlm.rl.metrics import Metric, Reduction, accumulate_metrics, finalize_metrics, init_metrics
from jaxrl_vlm.rl.registries import AGGREGATION_MODES, KL_ESTIMATORS, LOSS_TYPES


def micro_batch(i: int) -> dict[str, Metric]:
    """One micro-batch's metrics: values chosen so that sum, weighted mean, max and min all differ."""
    values = [(-1.0, 3.0, 0.5), (2.0, 1.0, -4.0), (0.5, 0.0, 7.0)][i]
    return {
        "loss": Metric.sum(jnp.float32(values[0])),
        "clipfrac": Metric.mean(jnp.float32(values[1]), jnp.float32(values[1] + 1.0)),
        "ratio_max": Metric.max(jnp.float32(values[2])),
        "ratio_min": Metric.min(jnp.float32(values[2])),
    }


def test_each_metric_combines_by_its_own_reduction():
    acc = None
    for i in range(3):
        acc = accumulate_metrics(acc, micro_batch(i))
    got = {k: float(v) for k, v in finalize_metrics(acc).items()}
    assert got == {"loss": 1.5, "clipfrac": pytest.approx(4.0 / 7.0), "ratio_max": 7.0, "ratio_min": -4.0}


def test_the_scan_carry_starts_at_each_reductions_identity():
    """`init_metrics` + every micro-batch == the micro-batches alone, negative maxima and positive minima included,
    inside a jitted scan like the train step's."""
    shapes = jax.eval_shape(lambda: micro_batch(0))
    start = init_metrics(shapes)
    assert [float(start[k].value) for k in ("loss", "clipfrac", "ratio_max", "ratio_min")] == [0, 0, -np.inf, np.inf]

    @jax.jit
    def scan():
        stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *[micro_batch(i) for i in range(3)])
        out, _ = jax.lax.scan(lambda acc, m: (accumulate_metrics(acc, m), None), start, stacked)
        return finalize_metrics(out)

    direct = finalize_metrics(accumulate_metrics(accumulate_metrics(micro_batch(0), micro_batch(1)), micro_batch(2)))
    assert {k: float(v) for k, v in scan().items()} == {k: float(v) for k, v in direct.items()}


def test_a_mean_with_no_weight_is_zero():
    m = Metric.mean(jnp.float32(0.0), jnp.float32(0.0))
    assert float(finalize_metrics({"x": m})["x"]) == 0.0


def test_an_untagged_metric_is_an_error_naming_it():
    for fn in (lambda m: accumulate_metrics(None, m), finalize_metrics, init_metrics):
        with pytest.raises(TypeError, match=r"metric 'pg_clipfrac' is a .*not a Metric.*Metric\.sum\(x\)"):
            fn({"loss": Metric.sum(jnp.float32(1.0)), "pg_clipfrac": jnp.float32(0.5)})


def test_a_reduction_cannot_change_between_micro_batches():
    with pytest.raises(ValueError, match="'x' changes its reduction between micro-batches: sum vs max"):
        accumulate_metrics({"x": Metric.sum(jnp.float32(1.0))}, {"x": Metric.max(jnp.float32(1.0))})
    with pytest.raises(ValueError, match="metric keys differ"):
        accumulate_metrics({"x": Metric.sum(jnp.float32(1.0))}, {"y": Metric.sum(jnp.float32(1.0))})


def test_every_builtin_loss_tags_every_metric():
    inputs = LossInputs(
        logprobs=jnp.array([[-0.5, -1.0, -2.0]]), old_logprobs=jnp.array([[-0.6, -0.7, -2.0]]),
        advantages=jnp.array([[1.0, 1.0, 0.0]]), loss_mask=jnp.array([[1.0, 1.0, 0.0]]),
        sequence_ids=jnp.array([[0, 0, -1]], jnp.int32), token_weights=jnp.array([[0.5, 0.5, 0.0]]),
        ref_logprobs=jnp.array([[-0.5, -0.9, 0.0]]), rollout_logprobs=jnp.array([[-0.6, -0.8, 0.0]]),
        entropy=jnp.array([[0.3, 0.2, 0.0]]),
    )
    cfg = LossConfig(num_sequences=1, eps_clip_c=3.0, use_kl_loss=True, kl_loss_coef=0.1)
    expected = {"loss": Reduction.SUM, "pg_loss": Reduction.SUM, "kl_loss": Reduction.SUM,
                "entropy_loss": Reduction.SUM, "weight_sum": Reduction.SUM, "ratio_max": Reduction.MAX}
    for name in ("ppo_clip", "gspo", "cispo"):
        _, metrics = losses.get_loss(name)(inputs, cfg)
        for k, m in metrics.items():
            assert m.reduction is expected.get(k, Reduction.MEAN), (name, k)
    _, sft = losses.sft_loss(inputs, cfg)
    assert {k: m.reduction for k, m in sft.items()} == dict.fromkeys(
        ["loss", "sft_loss", "weight_sum", "sft_tokens"], Reduction.SUM)


# ----------------------------------------------------------------------------- registries


def test_loss_types_hand_out_the_loss_each_names():
    assert list(LOSS_TYPES) == ["custom_loss", "policy_loss", "sft_loss"]
    assert select_loss("sft_loss", "ppo_clip") is losses.sft_loss
    assert select_loss("policy_loss", "gspo") is losses.gspo_loss
    with pytest.raises(ValueError, match="--loss-type custom_loss needs --custom-loss-function-path"):
        select_loss("custom_loss", "ppo_clip", None)
    with pytest.raises(KeyError, match="unknown loss type 'dpo'; registered: .*sft_loss"):
        select_loss("dpo", "ppo_clip")


def test_kl_estimators_are_a_registry():
    assert list(KL_ESTIMATORS) == ["k1", "k2", "k3", "low_var_kl"]
    lr = np.array([-20.0, -0.3, 0.0, 0.4])
    logp, ref = jnp.asarray(lr), jnp.zeros(4)
    k3 = np.exp(-lr) - 1.0 + lr
    np.testing.assert_allclose(kl_estimate(logp, ref, "k1"), lr, rtol=1e-6)
    np.testing.assert_allclose(kl_estimate(logp, ref, "k2"), 0.5 * lr**2, rtol=1e-6)
    np.testing.assert_allclose(kl_estimate(logp, ref, "k3"), k3, rtol=1e-5)
    np.testing.assert_allclose(kl_estimate(logp, ref, "low_var_kl"), np.clip(k3, -10, 10), rtol=1e-5)
    with pytest.raises(ValueError, match=r"kl_loss_type must be one of \['k1', 'k2', 'k3', 'low_var_kl'\]"):
        LossConfig(kl_loss_type="k4")

    @register_kl_estimator("test_only_abs")
    def kl_abs(log_ratio):  # noqa: ANN001, ANN202
        return jnp.abs(log_ratio)

    try:  # removed again: other modules of this worker process list the registry's names
        assert LossConfig(kl_loss_type="test_only_abs").kl_loss_type == "test_only_abs"
        np.testing.assert_allclose(kl_estimate(logp, ref, "test_only_abs"), np.abs(lr), rtol=1e-6)
    finally:
        KL_ESTIMATORS.unregister("test_only_abs")
    assert "test_only_abs" not in KL_ESTIMATORS


def test_aggregation_modes_are_a_registry():
    assert {"token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"} <= set(AGGREGATION_MODES)
    mask = np.array([[1, 1, 0, 1], [1, 0, 0, 0]])
    ids = np.array([[0, 0, 0, 1], [2, -1, -1, -1]])

    @register_aggregation("test_only_per_sequence_sum")
    def per_sequence_sum(seq_of_token, constant):  # noqa: ANN001, ANN202
        return np.ones(len(seq_of_token))

    try:
        np.testing.assert_array_equal(aggregation_weights(mask, ids, "test_only_per_sequence_sum"), mask)
        assert LossConfig(aggregation="test_only_per_sequence_sum").aggregation == "test_only_per_sequence_sum"
    finally:
        AGGREGATION_MODES.unregister("test_only_per_sequence_sum")
    with pytest.raises(ValueError, match="unknown aggregation mode 'mean'; expected one of .*token_mean"):
        LossConfig(aggregation="mean")
